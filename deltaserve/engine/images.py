"""A request's images at the engine's door: counted against --limit-mm-per-prompt, preprocessed, and their
placeholders laid out in the prompt.

The prompt marks each image with its placeholder token (<|image_pad|>, what the chat template renders
between <|vision_start|> and <|vision_end|>): one token per image, which expand_placeholders widens to the
image's token count (its merged grid rows x cols), or a run already that long. Images pair with the runs in
order. Every problem is an EngineInputError naming the field (a 400).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..media.images import (ImagePreprocessor, MediaError, ProcessedImage, ProcessedImageCache, decode_base64,
                            decode_data_url, image_size, open_image)
from .inputs import EngineInputError


@dataclass(frozen=True)
class PromptImages:
    """The prompt with its placeholders expanded, and per image: its processed pixels, its merged grid
    (rows, cols) and where its placeholder run starts."""

    token_ids: list[int]
    images: list[ProcessedImage]
    grids: list[tuple[int, int]]
    offsets: list[int]
    runs: tuple[tuple[int, int], ...] = ()  # each placeholder run before expansion: (start, length)

    def widen(self, positions: tuple[int, ...]) -> tuple[int, ...]:
        """Positions in the prompt before expansion -> the same places after it (one inside a placeholder run ->
        the start of its image's tokens)."""
        out = []
        for p in positions:
            shift, at = 0, p
            for (start, n), o, (r, c) in zip(self.runs, self.offsets, self.grids):
                if p >= start + n:
                    shift += r * c - n
                elif p > start:
                    at, shift = o, 0
                    break
            out.append(at + shift)
        return tuple(out)

    @property
    def media_keys(self) -> tuple[tuple[int, int, bytes], ...]:
        """(offset, count, content hash) per image: what the scheduler's block hashes carry."""
        return tuple((o, r * c, im.hash) for o, (r, c), im in zip(self.offsets, self.grids, self.images))


def image_items(data) -> list:
    """multi_modal_data's images as a list (one item or a list of them)."""
    if not isinstance(data, dict):
        raise EngineInputError("multi_modal_data must be an object like {'image': [...]}", "multi_modal_data")
    unknown = set(data) - {"image"}
    if unknown:
        raise EngineInputError(f"multi_modal_data: only images are served, not {', '.join(sorted(unknown))}",
                               "multi_modal_data")
    items = data.get("image", [])
    return list(items) if isinstance(items, (list, tuple)) else [items]


def load_item(item, what: str):
    """A PIL image from what a caller may hand over: a PIL image, encoded bytes, a data: URL or base64 text."""
    if hasattr(item, "convert") and hasattr(item, "size"):
        return item.convert("RGB")
    if isinstance(item, (bytes, bytearray)):
        return open_image(bytes(item), what)
    if isinstance(item, str):
        raw = decode_data_url(item, what) if ":" in item[:16] else decode_base64(item, what)
        return open_image(raw, what)
    raise MediaError(f"{what}: expected an image (PIL image, bytes, data: URL or base64), not {type(item).__name__}")


def item_size(item, what: str) -> tuple[int, int]:
    """(height, width) of an item load_item takes, from the header alone where it is encoded."""
    if hasattr(item, "convert") and hasattr(item, "size"):
        return item.size[1], item.size[0]
    if isinstance(item, (bytes, bytearray)):
        return image_size(bytes(item), what)
    if isinstance(item, str):
        return image_size(decode_data_url(item, what) if ":" in item[:16] else decode_base64(item, what), what)
    raise MediaError(f"{what}: expected an image (PIL image, bytes, data: URL or base64), not {type(item).__name__}")


def placeholder_runs(ids: list[int], image_token_id: int) -> list[tuple[int, int]]:
    """(start, length) of each run of image placeholder tokens in ids."""
    runs, i = [], 0
    while i < len(ids):
        if ids[i] == image_token_id:
            j = i
            while j < len(ids) and ids[j] == image_token_id:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs


def _check_limit(items: list, limit: int) -> None:
    if len(items) > limit:
        raise EngineInputError(f"{len(items)} images in one request; --limit-mm-per-prompt allows at most {limit} "
                               f"image{'s' if limit != 1 else ''}", "multi_modal_data")


def _runs_for(ids: list[int], image_token_id: int, n_images: int) -> list[tuple[int, int]]:
    """The prompt's placeholder runs, one per image (EngineInputError otherwise)."""
    runs = placeholder_runs(ids, image_token_id)
    if len(runs) != n_images:
        raise EngineInputError(f"the prompt has {len(runs)} image placeholder(s) for {n_images} image(s)",
                               "multi_modal_data")
    return runs


def widened_ids(ids: list[int], items: list, processor: ImagePreprocessor, image_token_id: int,
                limit: int) -> list[int]:
    """The prompt prepare_images would make (each placeholder widened to its image's token count), from the
    images' sizes alone, no pixels decoded or processed: what token counting reports. The same refusals as
    prepare_images, but for damage past a readable header."""
    _check_limit(items, limit)
    try:
        counts = [processor.num_tokens(*item_size(item, f"image {k}")) for k, item in enumerate(items)]
    except MediaError as e:
        raise EngineInputError(str(e), "multi_modal_data") from None
    runs = _runs_for(ids, image_token_id, len(counts))
    out, prev = [], 0
    for (start, n), c in zip(runs, counts):
        if n not in (1, c):
            raise EngineInputError(f"an image placeholder run of {n} tokens for an image of {c}", "multi_modal_data")
        out += ids[prev:start] + [image_token_id] * c
        prev = start + n
    return out + ids[prev:]


def process_item(item, processor: ImagePreprocessor, what: str,
                 cache: ProcessedImageCache | None = None) -> ProcessedImage:
    """item decoded and preprocessed; with a cache (made for this processor), encoded bytes seen before are one
    digest and a lookup. A refused item is never cached, so the same bytes are refused again the same way."""
    key = cache.key(item) if cache is not None else None
    hit = cache.get(key) if key is not None else None
    if hit is not None:
        return hit
    image = processor(load_item(item, what))
    if key is not None:
        cache.put(key, image)
    return image


def prepare_images(ids: list[int], items: list, processor: ImagePreprocessor, image_token_id: int,
                   limit: int, cache: ProcessedImageCache | None = None) -> PromptImages:
    _check_limit(items, limit)
    images = []
    for k, item in enumerate(items):
        try:
            images.append(process_item(item, processor, f"image {k}", cache))
        except MediaError as e:
            raise EngineInputError(str(e), "multi_modal_data") from None
    runs = _runs_for(ids, image_token_id, len(images))
    out, offsets, grids, prev = [], [], [], 0
    for (start, n), im in zip(runs, images):
        if n not in (1, im.num_tokens):
            raise EngineInputError(f"an image placeholder run of {n} tokens for an image of {im.num_tokens}",
                                   "multi_modal_data")
        out.extend(ids[prev:start])
        offsets.append(len(out))
        out.extend([image_token_id] * im.num_tokens)
        grids.append((im.grid[1] // processor.merge, im.grid[2] // processor.merge))
        prev = start + n
    out.extend(ids[prev:])
    return PromptImages(out, images, grids, offsets, tuple(runs))
