"""The prefix-cache hash chain over full blocks. Pure Python, deterministic across processes.

    root             = sha256("deltaserve-root" | cache_salt | extra keys)
    hash(block j)    = sha256(hash(block j-1) | token ids of block j)      (hash(block -1) = root)
                       sha256(hash(block j-1) | "decode" | token ids)    a block whose K/V decode steps wrote

The salt and the extra keys (anything else that changes the KV: adapters, media, ...) enter once, at
the root, and reach every block through the chain; two requests with different salts therefore never
share a hash. Python's hash() is not used (salted per process for str/bytes). A cache hit compares the
stored parent hash and token tuple too, so a hit never rests on the hash alone.

A block that holds image placeholder tokens carries the content hash of every image whose placeholders it
holds (vLLM's multimodal extra keys):

    hash(block j)    = sha256(hash(block j-1) | "media" | n | hash of each image | token ids of block j)

The placeholder ids are the same for any two images of one size; the content hashes are not, so a second
image of the same size hits the blocks before its placeholders and none from the first holding them (the
chain carries the difference to every block after). The same image bytes give the same hash (media/images.py
hashes the processed pixels), hence the same chain.

A block that holds a generated token was computed by decode steps, whose last bits differ from the prefill
path's (docs/design.md): it is published under the decode path's hash, so only a lookup that asks for the
decode path (the same request resuming after a preemption, which replays that path) finds it. A next turn
that sends those tokens as its prompt looks them up on the prefill path and finds what a prefill computed.
"""
from __future__ import annotations

import hashlib
import struct
from typing import Iterable, Sequence

BlockHash = bytes

_ROOT_TAG = b"deltaserve-root-v1"
_DECODE_TAG = b"deltaserve-decode-path"
_MEDIA_TAG = b"deltaserve-media"


def _encode_key(k: object) -> bytes:
    if isinstance(k, bytes):
        return b"b" + struct.pack("<Q", len(k)) + k
    if isinstance(k, str):
        b = k.encode("utf-8")
        return b"s" + struct.pack("<Q", len(b)) + b
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"extra cache keys must be str, bytes or int, not {type(k).__name__}")
    return b"i" + struct.pack("<q", k)


def root_hash(cache_salt: str | None, extra_keys: Iterable[object] = ()) -> BlockHash:
    """The parent hash of block 0. None and "" are different salts (None = no salt)."""
    h = hashlib.sha256(_ROOT_TAG)
    h.update(b"\x00" if cache_salt is None else b"\x01" + _encode_key(cache_salt))
    for k in extra_keys:
        h.update(_encode_key(k))
    return h.digest()


def block_hash(parent: BlockHash, tokens: Sequence[int], decode: bool = False,
               media: Sequence[bytes] = ()) -> BlockHash:
    """Hash of one full block, chained on its parent's hash; decode: its K/V came from decode steps; media: the
    content hashes of the images whose placeholder tokens the block holds, in order."""
    tag = _MEDIA_TAG + struct.pack("<Q", len(media)) + b"".join(_encode_key(m) for m in media) if media else b""
    return hashlib.sha256(parent + (_DECODE_TAG if decode else b"") + tag
                          + struct.pack(f"<{len(tokens)}q", *tokens)).digest()
