"""From what an API request carries to what the vision encoder reads: decode, preprocess, hash.

decode_data_url / decode_base64 -> bytes; open_image(bytes) -> an RGB PIL image (image_size(bytes): its height
and width from the header alone); ImagePreprocessor(path)
runs transformers' image processor for Qwen3.5 (Qwen2VLImageProcessorPil, the PIL backend AutoImageProcessor
picks for qwen3_5 without torchvision): resize to a multiple of patch_size * merge_size with the pixel count
inside [shortest_edge, longest_edge], rescale, normalise, cut into patches in merge-block order. Its
settings come from the model directory's preprocessor_config.json, else Qwen3.5's published ones.

ProcessedImage.hash is sha256 over the processor's output (the normalised patches and the grid): two
requests with the same hash feed the encoder the same input, so its output (and every K/V computed from
it) is the same. It is what the prefix cache's block hashes carry for an image's placeholder tokens.
ProcessedImageCache maps a digest of an image's encoded form (the data URL, base64 text or file bytes a request
carries) to its ProcessedImage, LRU within a byte budget, so an image sent again costs one digest instead of a
decode, a resize and a content hash.
Every failure to read an image is a MediaError (a ValueError the servers answer with 400).
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

# Qwen3.5's preprocessor_config.json (Qwen3-VL's): patches of 16, 2x2 merge, 2 frames per temporal patch,
# mean / std 0.5, 65,536 to 16,777,216 pixels (256x256 .. 4096x4096: 64 to 16,384 tokens an image)
QWEN35_PROCESSOR = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                    "image_std": [0.5, 0.5, 0.5], "size": {"shortest_edge": 65536, "longest_edge": 16777216}}
PROCESSOR_KEYS = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std", "size",
                  "min_pixels", "max_pixels", "do_resize", "do_rescale", "do_normalize", "rescale_factor", "resample")
MAX_IMAGE_BYTES = 20 * 1024 * 1024  # one encoded image (a data URL's payload)


class MediaError(ValueError):
    """An image the request carries cannot be used (the message says why; a 400)."""


_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?);base64,(?P<data>.*)", re.DOTALL)


def decode_base64(data: str, what: str = "image") -> bytes:
    try:
        raw = base64.b64decode(data.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(f"{what}: the data is not valid base64") from None
    if not raw:
        raise MediaError(f"{what}: the data is empty")
    if len(raw) > MAX_IMAGE_BYTES:
        raise MediaError(f"{what}: {len(raw):,} bytes, more than {MAX_IMAGE_BYTES:,}")
    return raw


def decode_data_url(url: str, what: str = "image_url") -> bytes:
    """The bytes of a base64 data: URL; remote URLs are refused (the server fetches nothing)."""
    if not isinstance(url, str) or not url:
        raise MediaError(f"{what}: expected a data: URL string")
    if re.match(r"(https?|ftp|file)://", url, re.IGNORECASE):
        raise MediaError(f"{what}: remote image URLs are not fetched (this server has no network access); "
                         f"send the image inline as a data:image/...;base64,... URL")
    m = _DATA_URL.fullmatch(url)
    if m is None:
        raise MediaError(f"{what}: only base64 data: URLs are accepted (data:image/png;base64,...)")
    if m.group("mime") and not m.group("mime").startswith("image/"):
        raise MediaError(f"{what}: media type {m.group('mime')!r} is not an image")
    return decode_base64(m.group("data"), what)


def open_image(raw: bytes, what: str = "image"):
    """An RGB PIL image from encoded bytes (PNG, JPEG, WebP, GIF's first frame, ...)."""
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(raw))
        img.load()
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise MediaError(f"{what}: not a readable image ({type(e).__name__})") from None
    return img.convert("RGB")


def image_size(raw: bytes, what: str = "image") -> tuple[int, int]:
    """(height, width) from an encoded image's header, without decoding its pixels (counting tokens)."""
    from PIL import Image, UnidentifiedImageError

    try:
        w, h = Image.open(io.BytesIO(raw)).size
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise MediaError(f"{what}: not a readable image ({type(e).__name__})") from None
    return h, w


@dataclass(frozen=True)
class ProcessedImage:
    """pixels [t*h*w, C*Tp*P*P] float32 in merge-block order; grid (t, h, w) in patches; num_tokens the
    placeholder tokens it fills (t*h*w / merge**2); hash the sha256 of pixels and grid."""

    pixels: np.ndarray
    grid: tuple[int, int, int]
    num_tokens: int
    hash: bytes


class ImagePreprocessor:
    """transformers' Qwen3.5 image processor with a model's settings. __call__(PIL image) -> ProcessedImage."""

    def __init__(self, model_path: str | None = None, overrides: dict | None = None):
        try:  # transformers 5: the PIL backend by name; 4.x: the slow processor is the PIL / numpy one
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
        except ImportError:
            from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor as \
                Qwen2VLImageProcessorPil

        settings = dict(QWEN35_PROCESSOR)
        f = os.path.join(model_path, "preprocessor_config.json") if model_path else None
        if f and os.path.exists(f):
            with open(f) as fh:
                stored = json.load(fh)
            settings.update({k: v for k, v in stored.items() if k in PROCESSOR_KEYS})
        settings.update(overrides or {})
        self.settings = settings
        self.merge = int(settings["merge_size"])
        self._proc = Qwen2VLImageProcessorPil(**settings)

    def __call__(self, image) -> ProcessedImage:
        try:
            out = self._proc(images=[image], return_tensors="np")
        except ValueError as e:  # e.g. an aspect ratio beyond 200:1
            raise MediaError(f"image: {e}") from None
        pixels = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
        t, h, w = (int(x) for x in out["image_grid_thw"][0])
        h_ = hashlib.sha256(b"deltaserve-image-v1")
        h_.update(np.array([t, h, w], dtype="<i8").tobytes())
        h_.update(pixels.astype("<f4").tobytes())
        return ProcessedImage(pixels, (t, h, w), t * h * w // self.merge ** 2, h_.digest())

    def num_tokens(self, height: int, width: int) -> int:
        """The placeholder tokens an image of height x width pixels fills: the processor's own resize arithmetic
        (get_number_of_image_patches, what vLLM counts with), no pixels touched; equals __call__'s num_tokens."""
        try:
            patches = self._proc.get_number_of_image_patches(height, width, {})
        except ValueError as e:  # an aspect ratio beyond 200:1, as __call__ says
            raise MediaError(f"image: {e}") from None
        return int(patches) // self.merge ** 2

    def merged_grid(self, p: ProcessedImage) -> tuple[int, int]:
        """(rows, cols) of p's placeholder tokens on the merged grid."""
        return p.grid[1] // self.merge, p.grid[2] // self.merge


class ProcessedImageCache:
    """Encoded image -> ProcessedImage, for one ImagePreprocessor (its owner holds both: a processor with other
    settings makes other pixels from the same bytes). LRU, at most budget_bytes of entries (pixels plus the
    digest and hash); an entry larger than the budget is not kept. A hit hands back the very ProcessedImage the
    processor made for those bytes: the processor is deterministic, so it is what processing them again would
    give, bit for bit (tests/test_images_engine.py checks against the processor, the reference). Its pixels
    are shared by every request that sends those bytes: nothing writes to them (the runner concatenates them
    into a new tensor for the encoder). Lookups and inserts take a lock, so token counting on another thread
    could share it; the engine uses it from add_request only."""

    ENTRY_OVERHEAD = 256  # bytes beside the pixels an entry holds (the key, the hash, the object): a floor per entry

    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"a processed-image cache of {budget_bytes} bytes")
        self.budget_bytes = int(budget_bytes)
        self.bytes = 0
        self.hits = self.misses = self.evictions = 0
        self._entries: OrderedDict[bytes, ProcessedImage] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def key(item) -> bytes | None:
        """sha256 of the item's encoded form, tagged with its kind (a str is its UTF-8: a data URL or base64 text;
        bytes are the file); None for what has no encoded form (a PIL image)."""
        if isinstance(item, str):
            kind, raw = b"str\0", item.encode("utf-8", "surrogatepass")
        elif isinstance(item, (bytes, bytearray, memoryview)):
            kind, raw = b"bytes\0", bytes(item)
        else:
            return None
        h = hashlib.sha256(kind)
        h.update(raw)
        return h.digest()

    @classmethod
    def size_of(cls, image: ProcessedImage) -> int:
        return image.pixels.nbytes + cls.ENTRY_OVERHEAD

    def get(self, key: bytes | None) -> ProcessedImage | None:
        if key is None or not self.budget_bytes:
            return None
        with self._lock:
            image = self._entries.get(key)
            if image is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return image

    def put(self, key: bytes | None, image: ProcessedImage) -> None:
        size = self.size_of(image)
        if key is None or size > self.budget_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= self.size_of(old)
            self._entries[key] = image
            self.bytes += size
            while self.bytes > self.budget_bytes:
                _, gone = self._entries.popitem(last=False)
                self.bytes -= self.size_of(gone)
                self.evictions += 1

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries
