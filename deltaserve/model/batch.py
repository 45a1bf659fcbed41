"""The model's view of one step: a flat batch of tokens cut into per-sequence spans, and the caches.

Built by the model runner from a StepPlan; consumed by the model's forward.
"""
from __future__ import annotations

import array
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch


def long_tensor(xs: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """[len(xs)] int64 from Python ints; through a buffer, ~1 us where torch.tensor takes 4-8 us (a decode step
    makes a few of these)."""
    t = torch.frombuffer(array.array("q", xs), dtype=torch.int64) if len(xs) else torch.empty(0, dtype=torch.long)
    return t if torch.device(device).type == "cpu" else t.to(device)


@dataclass
class Span:
    """One sequence's tokens inside the flat batch: rows start .. start + length - 1."""

    start: int
    length: int
    pos: int  # absolute position of the first token (= tokens of this sequence already in the caches)
    slot: int  # GDN state slot
    page_ids: torch.Tensor  # [num_pages] int64, the attention page table covering pos + length tokens
    # decode path: every token is computed as a one-token decode step computes it, in order (a span of length L > 1
    # is a speculative verify span: the last sampled token and L - 1 drafts; docs/speculative.md)
    is_decode: bool
    # checkpoints taken inside this prefill span: (absolute position p, location), the state of every GDN layer
    # after exactly token p - 1 (pos < p < pos + length, p on the 64-token grid) goes to Caches.save_state
    saves: tuple[tuple[int, tuple[int, ...]], ...] = ()


@dataclass
class SpanMedia:
    """What images change in one span (the runner's MediaStore makes it): its rotary positions and the rows
    whose input is an image embedding instead of a token embedding.

    pos3: the (t, h, w) rotary positions of the span's tokens (model/mrope.py), or None when all three
    axes equal token index + shift (text, generated tokens); embed_rows: rows inside the span (0-based)
    that take `embeds` [len(embed_rows), hidden], in order."""

    shift: int = 0
    pos3: tuple[Sequence[int], Sequence[int], Sequence[int]] | None = None
    embed_rows: Sequence[int] = ()
    embeds: torch.Tensor | None = None


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    # [T] int64: the rotary position of each token: its index in the sequence (Span.pos + row) on a text-only
    # model; on a multimodal one index + the span's M-RoPE shift (all three axes equal there)
    positions: torch.Tensor
    spans: list[Span]  # in flat order; prefill spans first, then decode spans
    # [B, max pages] int64: the decode spans' page tables in order, padded with page 0 (never read: a span's
    # length bounds it); each decode span's page_ids is a view of its row. None: made from the spans when needed
    decode_table: torch.Tensor | None = None
    rope_end: int = 0  # 1 + the largest rotary position (how far the rotary table must reach); 0: not known
    mrope: torch.Tensor | None = None  # [3, T] int64 (t, h, w) positions, when some span holds image tokens
    embed_rows: torch.Tensor | None = None  # [N] flat rows whose input is embeds[i] instead of a token embedding
    embeds: torch.Tensor | None = None  # [N, hidden]

    @classmethod
    def build(cls, seqs: list[tuple], device: torch.device | str = "cpu") -> "ForwardBatch":
        """seqs: (token ids, first position, slot, page ids, is_decode, saves[, SpanMedia | None]) per span,
        prefill spans first. The decode spans' page tables become one tensor (decode_table), not one each."""
        ids, pos, spans, start = [], [], [], 0
        pos3: list[list[int]] | None = None
        rows: list[int] = []
        embeds: list[torch.Tensor] = []
        dec = [s for s in seqs if s[4]]
        table = None
        if dec:
            width = max(len(s[3]) for s in dec)
            flat = []
            for s in dec:
                flat.extend(s[3])
                flat.extend([0] * (width - len(s[3])))
            table = long_tensor(flat, device).view(len(dec), width)
        d = 0
        if any(len(s) > 6 and s[6] is not None and s[6].pos3 is not None for s in seqs):
            pos3 = [[], [], []]
        for toks, first, slot, pages, is_decode, saves, *rest in seqs:
            media: SpanMedia | None = rest[0] if rest else None
            n = len(toks)
            ids.extend(toks)
            shift = media.shift if media is not None else 0
            text = range(first + shift, first + shift + n)
            pos.extend(text if media is None or media.pos3 is None else media.pos3[0])
            if pos3 is not None:
                for a in range(3):
                    pos3[a].extend(text if media is None or media.pos3 is None else media.pos3[a])
            if media is not None and media.embed_rows:
                assert media.embeds is not None and media.embeds.shape[0] == len(media.embed_rows)
                rows.extend(start + r for r in media.embed_rows)
                embeds.append(media.embeds)
            if is_decode:
                page_ids = table[d] if len(pages) == width else table[d, :len(pages)]
                d += 1
            else:
                page_ids = long_tensor(pages, device)
            spans.append(Span(start=start, length=n, pos=first, slot=slot, page_ids=page_ids, is_decode=is_decode,
                              saves=saves))
            start += n
        end = 1 + max(max(p) for p in pos3) if pos3 is not None and pos else (1 + max(pos) if pos else 0)
        return cls(input_ids=long_tensor(ids, device), positions=long_tensor(pos, device), spans=spans,
                   decode_table=table, rope_end=end,
                   mrope=None if pos3 is None else torch.stack([long_tensor(p, device) for p in pos3]),
                   embed_rows=long_tensor(rows, device) if rows else None,
                   embeds=torch.cat(embeds) if embeds else None)

    def check(self, block_size: int) -> None:
        """ValueError unless: prefill spans come first; a decode span has at least one token and no checkpoints; a
        prefill span's checkpoints are grid positions inside it; every page table covers its span."""
        decode_seen = False
        for s in self.spans:
            if s.is_decode and s.length < 1:
                raise ValueError(f"a decode span has at least one token, not {s.length}")
            if s.saves and (s.is_decode or any(not s.pos < p < s.pos + s.length or p % 64 for p, _ in s.saves)):
                raise ValueError(f"span at rows {s.start}..: checkpoints {[p for p, _ in s.saves]} are not grid "
                                 f"positions inside its prefill chunk {s.pos}..{s.pos + s.length}")
            if s.page_ids.numel() * block_size < s.pos + s.length:
                raise ValueError(f"span at rows {s.start}..: page table covers {s.page_ids.numel() * block_size} "
                                 f"positions, needs {s.pos + s.length}")
            if decode_seen and not s.is_decode:
                raise ValueError(f"span at rows {s.start}..: a prefill span after a decode span (prefill spans first)")
            decode_seen = decode_seen or s.is_decode

    def decode_page_table(self) -> torch.Tensor:
        """[B, max pages] int64: the decode spans' page tables (decode_table as build made it, else padded here)."""
        if self.decode_table is not None:
            return self.decode_table
        return torch.nn.utils.rnn.pad_sequence([s.page_ids.to(torch.long) for s in self.spans if s.is_decode],
                                               batch_first=True)

    @property
    def prefill_spans(self) -> list[Span]:
        return [s for s in self.spans if not s.is_decode]


@dataclass
class Caches:
    """Tensors the layers read and write. The runner owns the storage; these are views.

    kv[a]:   attention layer a (a-th full-attention layer), [num_pages, 2, block_size, kv_heads, head_dim]
             in the KV dtype; [:, 0] keys, [:, 1] values.
    conv[l]: GDN layer l (l-th linear-attention layer), [num_slots, kernel - 1, conv_dim] in the conv dtype;
             the last kernel-1 conv inputs, oldest first.
    ssm[l]:  GDN layer l, [num_slots, num_v_heads, v_head_dim, k_head_dim] float32 recurrent state
             (the transpose of transformers' [.., dk, dv] layout: reductions over dk are contiguous).
    """

    kv: list[torch.Tensor]
    conv: list[torch.Tensor]
    ssm: list[torch.Tensor]
    block_size: int
    # save_state(l, location, conv [K-1, conv_dim], ssm [Hv, dv, dk] fp32): store GDN layer l's state at a
    # checkpoint location (the runner's CacheStore.save_layer); needed by spans with saves
    save_state: Callable[[int, tuple[int, ...], torch.Tensor, torch.Tensor], None] | None = None
    # log_state(l, j, slots [B] int64, x [B, conv_dim], g [B, Hv] fp32, beta [B, Hv]): after the j-th token of
    # their verify spans, GDN layer l's live conv state in `slots` and that token's recurrence inputs (the
    # per-position state log, CacheStore.log_states); needed by decode spans longer than one token
    log_state: Callable[..., None] | None = None
    # the tensors log_state writes (CacheStore.log_conv / log_x / log_g / log_beta: [l] [num_slots, positions, ...]),
    # which the compiled verify step (model/fused.py) writes itself; empty: that step takes the op table
    log_conv: list[torch.Tensor] = field(default_factory=list)
    log_x: list[torch.Tensor] = field(default_factory=list)
    log_g: list[torch.Tensor] = field(default_factory=list)
    log_beta: list[torch.Tensor] = field(default_factory=list)
