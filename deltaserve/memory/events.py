"""Cache events for a router: what this replica can serve as a prefix hit, at the checkpoint grid. No torch.

The memory manager, when asked (`MemoryManager.enable_events()`), appends one `CacheRecord` per change of
its prefix cache to a deque: a block's K/V published, a checkpoint attached to a block, a block dropped, a
block's checkpoint dropped. That is all it does on the engine's thread. Another thread drains the deque into
a `RouterView`, which turns the records into the events a KV-aware router consumes (vLLM's BlockStored /
BlockRemoved; server/kv_events.py encodes and publishes them).

The hybrid rule (docs/cluster.md). A router credits a replica with the longest run of blocks, from token 0,
that the replica announced. On a hybrid a cached prefix is only a hit where a GDN checkpoint ends it, so an
*event block* (the checkpoint grid: `event_block_size` tokens, a multiple of the page) is announced as
stored only when
  * every page of it is cached on the prefill path (a block written by decode steps has another hash: a
    next turn, which re-sends those tokens as its prompt, cannot hit it),
  * a checkpoint ends it (the state after exactly its last token is cached),
  * the event block before it is announced (the router anchors a block under its parent; one announced
    after a hole would be credited from the root), and its chain starts at the unsalted root (the router
    hashes tokens only; a salted prefix is nobody else's hit).
It is announced as removed as soon as one of its pages or its checkpoint is dropped. So every prefix depth the
router credits is a hit this replica would take, if nothing is evicted meanwhile. The recurrent state itself
(the GDN group) is never an event: it is the checkpoint's presence, folded into the block's.
Each record names the medium it happened on (vLLM's `medium` field): `POOL` ("GPU", vLLM's name for the
engine's own pool, whatever the device) or `DISK` (the disk tier, memory/disk_tier.py). A router keeps one
`RouterView` per medium: a block evicted from the pool to disk is removed from the first and stored in the second.
Event ids are the first 8 bytes of the engine's chain hash of the event block's last page (vLLM sends 64-bit
ints too); the parent id is the previous event block's.
"""
from __future__ import annotations

from typing import NamedTuple

from .hashing import BlockHash, block_hash, root_hash

# CacheRecord kinds
BLOCK = "block"  # a block's K/V entered the cache (hash, parent, tokens, index in its chain)
CHECKPOINT = "checkpoint"  # a checkpoint was attached to a cached block
BLOCK_GONE = "block_gone"  # a block left the cache (with its checkpoint, if it had one)
CHECKPOINT_GONE = "checkpoint_gone"  # a block's checkpoint was dropped; its K/V stay

POOL = "GPU"  # vLLM's medium name for the engine's own pool
DISK = "DISK"  # the prefix cache's disk tier


class CacheRecord(NamedTuple):
    """One change of the prefix cache, as the memory manager saw it. tokens and index only on BLOCK."""

    kind: str
    hash: BlockHash
    parent: BlockHash | None = None
    tokens: tuple[int, ...] | None = None
    index: int = -1
    medium: str = POOL


class Stored(NamedTuple):
    """An event block announced: the replica can hit [0, end of this block) for these tokens."""

    block_hash: int
    parent_block_hash: int | None
    token_ids: tuple[int, ...]


class Removed(NamedTuple):
    block_hash: int


def event_id(h: BlockHash) -> int:
    """The 64-bit id of an event block: its last page's chain hash, cut to 8 bytes (big-endian)."""
    return int.from_bytes(h[:8], "big")


class RouterView:
    """The router's view of one replica's cache, kept from CacheRecords (module docstring: the hybrid rule).

    feed(records) -> the Stored / Removed events that bring a router from the previous view to the new one.
    Invariant: check().
    """

    def __init__(self, block_size: int, event_block_size: int, checkpoints: bool = True, medium: str = POOL):
        """checkpoints: False for a model without GDN layers (every cached block ends a usable prefix). medium: the
        records this view reads (the others are another view's)."""
        if block_size < 1 or event_block_size < block_size or event_block_size % block_size:
            raise ValueError(f"the event block ({event_block_size} tokens) must be a multiple of the page "
                             f"({block_size} tokens)")
        self.block_size = block_size
        self.event_block_size = event_block_size
        self.per_event = event_block_size // block_size  # pages per event block
        self.checkpoints = checkpoints
        self.medium = medium
        self._root = root_hash(None)
        self._entries: dict[BlockHash, tuple[BlockHash, tuple[int, ...], int]] = {}  # hash -> parent, tokens, index
        self._prefill: set[BlockHash] = set()  # entries on the prefill path (their hash is the prefill hash)
        self._ckpt: set[BlockHash] = set()  # entries with a checkpoint
        self._children: dict[BlockHash, set[BlockHash]] = {}
        self._announced: dict[BlockHash, tuple[BlockHash, ...]] = {}  # last page's hash -> its pages' hashes
        self._member_of: dict[BlockHash, set[BlockHash]] = {}  # page hash -> announced event blocks holding it

    # ------------------------------------------------------------------ feeding
    def feed(self, records) -> list[Stored | Removed]:
        out: list[Stored | Removed] = []
        for r in records:
            if r.medium != self.medium:
                continue
            if r.kind == BLOCK:
                self._add(r, out)
            elif r.kind == CHECKPOINT:  # on disk a checkpoint may arrive before its block's K/V: kept for it
                self._ckpt.add(r.hash)
                if r.hash in self._entries:
                    self._try(r.hash, out)
            elif r.kind == CHECKPOINT_GONE:
                self._ckpt.discard(r.hash)
                self._retract(r.hash, out, as_member=False)
            elif r.kind == BLOCK_GONE:
                self._drop(r.hash, out)
            else:
                raise ValueError(f"unknown cache record kind {r.kind!r}")
        return out

    def _add(self, r: CacheRecord, out: list) -> None:
        if r.hash in self._entries:
            return
        assert r.tokens is not None and len(r.tokens) == self.block_size and r.index >= 0, r
        self._entries[r.hash] = (r.parent, tuple(r.tokens), r.index)
        if block_hash(r.parent, r.tokens) == r.hash:
            self._prefill.add(r.hash)
        if not self.checkpoints:
            self._ckpt.add(r.hash)
        self._children.setdefault(r.parent, set()).add(r.hash)
        # a page that completes an event block whose end is already cached (it came back after an eviction)
        depth = self.per_event - 1 - r.index % self.per_event
        for end in self._descendants(r.hash, depth):
            self._try(end, out)

    def _drop(self, h: BlockHash, out: list) -> None:
        ent = self._entries.pop(h, None)
        if ent is None:
            return
        self._retract(h, out, as_member=True)
        self._prefill.discard(h)
        self._ckpt.discard(h)
        kids = self._children.get(ent[0])
        if kids is not None:
            kids.discard(h)
            if not kids:
                del self._children[ent[0]]

    def _retract(self, h: BlockHash, out: list, as_member: bool) -> None:
        ends = set(self._member_of.get(h, ())) if as_member else ({h} if h in self._announced else set())
        for end in ends:
            for m in self._announced.pop(end):
                s = self._member_of[m]
                s.discard(end)
                if not s:
                    del self._member_of[m]
            out.append(Removed(event_id(end)))

    def _descendants(self, h: BlockHash, depth: int) -> list[BlockHash]:
        level = [h]
        for _ in range(depth):
            level = [c for x in level for c in self._children.get(x, ())]
        return level

    def _pages(self, end: BlockHash) -> tuple[BlockHash, ...] | None:
        """The pages of the event block that ends with page `end`, first to last, if all are cached on the
        prefill path; None otherwise (or when `end` does not end an event block)."""
        ent = self._entries.get(end)
        if ent is None or (ent[2] + 1) % self.per_event:
            return None
        pages, h = [], end
        for _ in range(self.per_event):
            e = self._entries.get(h)
            if e is None or h not in self._prefill:
                return None
            pages.append(h)
            h = e[0]
        return tuple(reversed(pages))

    def _try(self, end: BlockHash, out: list) -> None:
        """Announce the event block ending with page `end` if the rule holds, then those it unblocks."""
        if end in self._announced or end not in self._ckpt:
            return
        pages = self._pages(end)
        if pages is None:
            return
        first_parent, first_index = self._entries[pages[0]][0], self._entries[pages[0]][2]
        if first_index == 0:
            if first_parent != self._root:
                return
            parent_id = None
        elif first_parent in self._announced:
            parent_id = event_id(first_parent)
        else:
            return
        self._announced[end] = pages
        for m in pages:
            self._member_of.setdefault(m, set()).add(end)
        out.append(Stored(event_id(end), parent_id, tuple(t for p in pages for t in self._entries[p][1])))
        for nxt in self._descendants(end, self.per_event):
            self._try(nxt, out)

    # ------------------------------------------------------------------ queries
    def is_announced(self, h: BlockHash) -> bool:
        """Whether the event block whose last page has chain hash h is announced."""
        return h in self._announced

    def announced(self) -> set[int]:
        return {event_id(h) for h in self._announced}

    def check(self) -> None:
        """Assert the invariant: every announced event block holds the local rule now (its pages cached on the
        prefill path, a checkpoint at its end), and every event block the whole rule admits (an announced
        chain from the unsalted root) is announced. An announced block after a retracted one may stay: the
        router credits nothing past the hole, and neither does a lookup here, until the hole is filled."""
        for end, pages in self._announced.items():
            assert end in self._ckpt and self._pages(end) == pages, "an announced event block no longer holds"
            for m in pages:
                assert end in self._member_of.get(m, ()), "member index out of date"
        want: set[BlockHash] = set()
        level = [h for h, e in self._entries.items() if e[2] == self.per_event - 1]
        while level:
            nxt = []
            for end in level:
                pages = self._pages(end) if end in self._ckpt else None
                if pages is None:
                    continue
                p, i = self._entries[pages[0]][0], self._entries[pages[0]][2]
                if (i == 0 and p == self._root) or (i > 0 and p in want):
                    want.add(end)
                    nxt += self._descendants(end, self.per_event)
            level = nxt
        assert want <= set(self._announced), "an event block the rule admits is not announced"
