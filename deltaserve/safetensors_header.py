"""The header of a .safetensors file, read without torch or the safetensors package: the loader streams tensors by
its offsets (model/loader.py), the planner and the engine's pre-load memory check count bytes from it
(memory/resident.py, tools/planner.py).

The format: an 8-byte little-endian header length n, n bytes of JSON (tensor name -> dtype, shape, data_offsets
relative to the data; an optional "__metadata__" of strings), then the data.
"""
from __future__ import annotations

import json
import struct

MAX_HEADER_BYTES = 100 * 2**20  # far above any real header: a larger length means the file is not safetensors


def read_header(path: str) -> tuple[dict, int]:
    """(name -> {dtype, shape, data_offsets} without "__metadata__", the file offset where the data starts).
    ValueError naming the file when it is not a readable safetensors file."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES:
            raise ValueError(f"{path}: implausible safetensors header length {n}")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise ValueError(f"{path}: unreadable safetensors header ({e})") from None
    header.pop("__metadata__", None)
    return header, 8 + n
