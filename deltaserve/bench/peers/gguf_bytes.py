"""The bytes one batch-1 decode step of llama.cpp reads, from a GGUF file's own header (no tensor is loaded).

A roofline counts the bytes an engine's own weights stream: for llama.cpp that is its GGUF's tensors as stored
(4.5 bits a weight for q4_0, 8.5 for q8_0, 2 bytes for bf16), never the bf16 checkpoint it was made from.
Every tensor of the text model is read once per token, except the token embedding (a one-row lookup); where
the file has no separate output tensor the head is the embedding, read once. The MTP blocks (the last
`<arch>.nextn_predict_layers` of `<arch>.block_count`) are not read by plain decode.

GGUF layout (little-endian): magic "GGUF", version u32, tensor count u64, metadata count u64, the metadata
(key string, value type u32, value), then per tensor: name string, n_dims u32, dims u64 x n_dims, ggml type
u32, offset u64 (from the data section, which starts at the header's end aligned to general.alignment). A
tensor's stored size is the distance to the next tensor's offset (the last one's: to the end of the file),
which holds for every ggml type, block-quantized or not, up to the alignment padding (< 32 bytes a tensor).
"""
from __future__ import annotations

import os
import re
import struct

# metadata value types: fixed-size scalars by struct code; 8 string, 9 array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


class _Reader:
    def __init__(self, f):
        self.f = f

    def unpack(self, code: str):
        size = struct.calcsize("<" + code)
        data = self.f.read(size)
        if len(data) != size:
            raise ValueError("truncated GGUF header")
        return struct.unpack("<" + code, data)[0]

    def string(self) -> str:
        return self.f.read(self.unpack("Q")).decode("utf-8", "replace")

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == 8:
            return self.string()
        if vtype == 9:
            itype, n = self.unpack("I"), self.unpack("Q")
            return [self.value(itype) for _ in range(n)]
        raise ValueError(f"unknown GGUF metadata type {vtype}")


def read_header(path: str) -> tuple[dict, list[tuple[str, int]], int]:
    """(metadata, [(tensor name, offset)], data section start) of a GGUF file."""
    with open(path, "rb") as f:
        r = _Reader(f)
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        version = r.unpack("I")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} (2 and later are read)")
        n_tensors, n_kv = r.unpack("Q"), r.unpack("Q")
        meta = {}
        for _ in range(n_kv):
            key = r.string()
            meta[key] = r.value(r.unpack("I"))
        tensors = []
        for _ in range(n_tensors):
            name = r.string()
            n_dims = r.unpack("I")
            for _ in range(n_dims):
                r.unpack("Q")
            r.unpack("I")  # ggml type: the size comes from the offsets
            tensors.append((name, r.unpack("Q")))
        align = int(meta.get("general.alignment", 32))
        start = -(-f.tell() // align) * align
    return meta, tensors, start


def tensor_bytes(path: str) -> dict[str, int]:
    """Each tensor's stored bytes (alignment padding included)."""
    _, tensors, start = read_header(path)
    end = os.path.getsize(path) - start
    ordered = sorted(tensors, key=lambda t: t[1])
    nexts = [o for _, o in ordered[1:]] + [end]
    return {name: nxt - off for (name, off), nxt in zip(ordered, nexts)}


def decode_bytes_per_token(path: str) -> int:
    """The bytes one batch-1 decode step reads from this GGUF (see the module docstring for what counts)."""
    meta, _, _ = read_header(path)
    arch = meta.get("general.architecture", "")
    blocks = int(meta.get(f"{arch}.block_count", 0))
    mtp = int(meta.get(f"{arch}.nextn_predict_layers", 0))
    sizes = tensor_bytes(path)
    total = 0
    for name, n in sizes.items():
        m = re.match(r"blk\.(\d+)\.", name)
        if m and blocks and int(m.group(1)) >= blocks - mtp:
            continue  # an MTP block
        if name == "token_embd.weight" and "output.weight" in sizes:
            continue  # a lookup: one row a token
        total += n
    return total
