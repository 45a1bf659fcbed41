"""A request's images on the runner's side: pixels in, the encoder's output computed once, sliced per chunk.

RequestMedia holds one request's processed images (the image processor's patch rows and grids) and where
their placeholders sit in the prompt. The vision encoder runs once, the first time any chunk of the request
touches an image, over all of its images together; its output stays until the request ends (finished,
aborted), so a recompute after a preemption or the next chunk of a long prompt reuses it. A prefill chunk
may end anywhere, inside an image too: the text model is causal, so the rows of an image split across two
chunks see exactly what they would in one, and each chunk takes its slice of the stored embeddings.

MediaStore: request id -> RequestMedia, what ModelRunner.build_batch consults; the engine adds a request's
media when it adds the request and drops it when the request ends.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..model.batch import SpanMedia
from ..model.mrope import ImageSpan, final_shift, positions


@dataclass
class RequestMedia:
    """spans[i] is image i's placeholder run; pixels[i] [t*h*w, patch_dim] and grids[i] (t, h, w) its patches
    (the processor's output). Invariant: span i has t*h*w / merge_unit tokens, spans sorted and apart."""

    spans: list[ImageSpan]
    pixels: list[torch.Tensor]
    grids: list[tuple[int, int, int]]
    embeds: torch.Tensor | None = None  # [sum of span lengths, hidden], once encoded
    encodes: int = 0  # how many times the encoder ran for this request (1 at most: asserted by the tests)
    key: tuple = ()  # the images' content hashes in order: requests with the same key share one encoder output
    on_encoded: object = None  # MediaStore's callback: the output, for the live requests of the same key
    _starts: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        assert len(self.spans) == len(self.pixels) == len(self.grids)
        assert all(a.end <= b.offset for a, b in zip(self.spans, self.spans[1:])), "image spans sorted and apart"
        acc = 0
        for s in self.spans:
            self._starts.append(acc)
            acc += s.length

    @property
    def shift(self) -> int:
        """The rotary shift of every token after the last image (generated tokens included)."""
        return final_shift(self.spans)

    def encode(self, visual) -> torch.Tensor:
        if self.embeds is None:
            out = visual(torch.cat(self.pixels), self.grids)
            if out.shape[0] != sum(s.length for s in self.spans):
                raise ValueError(f"the encoder made {out.shape[0]} image tokens for {sum(s.length for s in self.spans)} "
                                 f"placeholders")
            self.embeds = out
            self.encodes += 1
            self.pixels = []  # the embeddings are what later chunks read: the pixels can go
            if self.on_encoded is not None:
                self.on_encoded(self)
        return self.embeds

    def span_media(self, visual, start: int, n: int) -> SpanMedia:
        """The SpanMedia of tokens start .. start + n - 1 (encoding the images on first need)."""
        end = start + n
        touched = [k for k, s in enumerate(self.spans) if s.offset < end and start < s.end]
        if not touched:  # text only: one shift for the whole span
            shift = sum(s.shift for s in self.spans if s.end <= start)
            return SpanMedia(shift=shift)
        embeds = self.encode(visual)
        rows, parts = [], []
        for k in touched:
            s = self.spans[k]
            a, b = max(start, s.offset), min(end, s.end)
            rows.extend(range(a - start, b - start))
            base = self._starts[k] + a - s.offset
            parts.append(embeds[base: base + b - a])
        return SpanMedia(pos3=positions(self.spans, start, end), embed_rows=rows, embeds=torch.cat(parts))


class MediaStore:
    """request id -> RequestMedia for the requests alive in the engine.

    Live requests with the same images (the same content hashes in the same order: the n choices of one API
    request, or one conversation sent twice at once) share one encoder output: the encoder's input is the
    same, so its output would be the same bits. It is kept while any of them lives."""

    def __init__(self) -> None:
        self._by_id: dict[str, RequestMedia] = {}
        self._shared: dict[tuple, list] = {}  # key -> [live requests with it, the encoder output or None]
        self.encoder_runs = 0  # encoder runs of the requests dropped so far (one per set of images in flight)

    def add(self, request_id: str, media: RequestMedia) -> None:
        assert request_id not in self._by_id, f"media of {request_id} added twice"
        self._by_id[request_id] = media
        if not media.key:
            return
        entry = self._shared.setdefault(media.key, [0, None])
        entry[0] += 1
        if entry[1] is not None:  # already encoded for a live request with the same images
            media.embeds, media.pixels = entry[1], []
        media.on_encoded = self._encoded

    def _encoded(self, media: RequestMedia) -> None:
        entry = self._shared.get(media.key)
        if entry is not None:
            entry[1] = media.embeds
            for other in self._by_id.values():  # the same images' requests waiting to be reached
                if other.key == media.key and other.embeds is None:
                    other.embeds, other.pixels = media.embeds, []

    def get(self, request_id: str) -> RequestMedia | None:
        return self._by_id.get(request_id)

    def drop(self, request_id: str) -> None:
        m = self._by_id.pop(request_id, None)
        if m is not None:
            self.encoder_runs += m.encodes
            entry = self._shared.get(m.key) if m.key else None
            if entry is not None:
                entry[0] -= 1
                if entry[0] == 0:
                    del self._shared[m.key]

    def __len__(self) -> int:
        return len(self._by_id)
