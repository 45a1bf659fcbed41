"""The memory manager: one pool of pages, the live GDN slots, and the hybrid prefix cache. No torch.

Terms
  page   the memory unit. Page p has `group_size` layer positions; an attention layer keeps the K/V of
         block_size tokens at its position of the page. One page per block of a sequence.
  block  block_size consecutive tokens of a sequence; the unit of hashing and of checkpoints.
  slot   a live GDN state (conv window + recurrent state of every GDN layer) of one running sequence.
  checkpoint  the GDN state after exactly the last token of a full block.
           in-page layout: `num_gdn_groups` pool pages, page location[g] owned by GDN group g;
           runs layout: `num_gdn_groups * pages_per_state` pool pages, location[g * pages_per_state + j]
           the j-th page of group g's states (pages smaller than a state; any pages, not adjacent ones);
           per-block layout: (attention page of that block,), an index into a separate state tensor,
           so it costs no pool page.

Every page is in exactly one of three places:
  free       unreferenced, holds nothing anyone will read (owner kind None);
  evictable  unreferenced, holds cached content (a published block or a checkpoint); the eviction
             policy (LRU by default) picks which one to reclaim when the free list is empty;
  held       referenced by sequences (ref count = number of holders). Holders: a sequence's page table
             (attention pages), its latest checkpoint and its pending (planned, not yet run) save.
Each allocated page has one owner kind: ATTN (-1) or a GDN group g >= 0.

The prefix cache maps a block hash (memory/hashing.py) to a CacheEntry: the attention page holding
that block's K/V, the block's tokens and parent hash (a hit compares them, not only the hash), and
optionally the checkpoint taken at the end of the block. A prefix hit is the longest chain of cached
blocks whose LAST block has a checkpoint (every GDN group, by construction: the groups' pages of a
checkpoint are attached and dropped together). Evicting an entry's attention page drops the entry and
its checkpoint; evicting a checkpoint page drops only the checkpoint. Blocks after an evicted one stay
in the cache but are unreachable (the chain walk stops) until they are evicted in turn.

Choices (and why)
  * A running sequence HOLDS its latest checkpoint until the next one is published (vLLM's "2 + N":
    N attention pages + the latest checkpoint + the one being written). Cost: checkpoint_pages pages per
    running sequence (in-page, runs). Gain: a preempted sequence can always resume from its last block
    boundary while its own pages survive (they are released last, so LRU evicts them last), and
    concurrent sequences sharing the prefix can hit it. Older checkpoints are released as soon as a
    newer one is published, so under pressure intermediate checkpoints go first.
  * New attention pages are zeroed (listed for StepPlan.zero_pages): attention reads whole pages and
    a mask does not cancel a NaN. New checkpoint pages are not zeroed: the save overwrites the whole
    state region before anything reads it, and the padding is never read.
  * Eviction (memory/eviction.py): LRU by release time, except that a checkpoint replaced by a newer
    one and never hit goes first, so a running sequence's stale checkpoints are evicted before the
    resume point of a sequence it just preempted; or, by value, the page that spares the least recompute
    per page held (_value), weighed with hits and recency.
  * A junction renews with its path (_renew_junctions): a checkpoint that JUNCTION_READS requests have
    resumed from (a shared system prompt's end, where sessions part) is renewed in the eviction order
    whenever a hit passes it, as that hit's attention pages are. Without it the attention pages of a shared
    prefix stay young (every turn of every session reads them) while the one checkpoint that makes them
    usable to the next session ages and goes. A checkpoint read once (a turn's end, read by the next turn)
    is not renewed, so a long conversation does not keep one checkpoint per turn alive.
  * A sequence that computes a block already cached by someone else keeps its own copy uncached (the
    "duplicate"). When it frees, its duplicates are published if their hash has left the cache
    meanwhile (and so is its orphaned latest checkpoint), so concurrent identical prefixes survive the
    eviction of whichever copy won the race.
  * Fail closed: reserving a save at a position that is not a block boundary, saving into a shared
    cached page, or admitting a hit that is no longer cached raises CheckpointError.
  * A second tier on disk (attach_disk; memory/disk_tier.py): what eviction drops from the pool is spilled
    there (pool -> disk -> gone), and a lookup that finds a longer hit through the disk waits while it is read
    back (prepare_from_disk), then takes pool pages for it and publishes it like any cached block. The
    manager decides; runner/disk_store.py moves the bytes before the step that reads them.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..errors import ConfigError
from .layouts import CacheLayout, layout_for
from .eviction import EvictionPolicy, LRUEviction
from .disk_tier import CKPT, KV, DiskRecord, DiskStats, DiskTier
from .events import BLOCK, BLOCK_GONE, CHECKPOINT, CHECKPOINT_GONE, CacheRecord
from .hashing import BlockHash, block_hash
from .save_kind import KEPT_WHEN_REPLACED, SaveKind, zero_by_kind
from .sizing import Pool

ATTN = -1  # owner kind of an attention page; GDN group g is owner kind g >= 0
VALUE_WALK = 256  # blocks a checkpoint's value looks back for the previous checkpoint
JUNCTION_READS = 2  # requests that resumed from a checkpoint before a hit passing it renews it (a junction)
DISK_GO, DISK_READING, DISK_ROOM = "go", "reading", "room"  # prepare_from_disk's answers


class CheckpointError(RuntimeError):
    """Fail closed: a GDN state copy that could serve a wrong state."""


class OutOfPagesError(RuntimeError):
    """An allocation was attempted without checking num_allocatable() first."""


@dataclass
class CacheEntry:
    hash: BlockHash
    parent: BlockHash
    tokens: tuple[int, ...]
    page: int  # the attention page holding this block's K/V
    checkpoint: tuple[int, ...] | None = None  # GDN state after the block's last token, if kept
    checkpoint_kind: SaveKind | None = None  # why it was taken
    hits: int = 0  # prefix hits that ended at this block (restored its checkpoint)
    index: int = -1  # the block's index in its chain (the disk tier's KV events)

    def matches(self, parent: BlockHash, tokens: Sequence[int]) -> bool:
        return self.parent == parent and self.tokens == tuple(tokens)


@dataclass(frozen=True)
class PrefixHit:
    """The usable cached prefix of a sequence: num_blocks full blocks and the checkpoint after them."""

    num_blocks: int
    block_size: int
    page_ids: tuple[int, ...] = ()
    checkpoint: tuple[int, ...] | None = None  # restore location; () on a model without GDN layers
    hashes: tuple[BlockHash, ...] = ()
    num_matched_blocks: int = 0  # leading blocks whose K/V are cached, checkpoint or not (>= num_blocks)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


@dataclass
class MemoryStats:
    """The memory manager's monotonic counters, each under the name of its EngineStats field and metric (the
    scheduler keeps its own, scheduler/stats.py)."""

    checkpoints_saved: int = 0  # saves that ran (counted when their step is committed)
    checkpoints_restored: int = 0  # restores planned
    checkpoints_renewed: int = 0  # junctions a hit passed and renewed in the eviction order (_renew_junctions)
    evictions: int = 0  # cached pages whose content was dropped (including sibling checkpoint pages)
    # by SaveKind value
    checkpoints_saved_by_kind: dict[str, int] = field(default_factory=zero_by_kind)
    checkpoints_evicted_by_kind: dict[str, int] = field(default_factory=zero_by_kind)
    checkpoints_hit_by_kind: dict[str, int] = field(default_factory=zero_by_kind)  # prefix hits that resumed there
    # evicted before any request resumed from them: what a kind cost and nobody read (the resume-point budget's gauge)
    checkpoints_evicted_unread_by_kind: dict[str, int] = field(default_factory=zero_by_kind)


@dataclass(frozen=True)
class MemoryUsage:
    pages_total: int
    pages_used: int  # referenced by running sequences
    pages_cached: int  # unreferenced, cached, evictable
    pages_free: int
    slots_total: int
    slots_used: int

    @property
    def kv_usage(self) -> float:
        """Fraction of pages referenced by running sequences (cached-but-free pages count as free)."""
        return self.pages_used / self.pages_total if self.pages_total else 0.0


@dataclass
class _Seq:
    slot: int
    pages: list[int] = field(default_factory=list)  # attention page table
    keys: list[tuple[BlockHash, BlockHash, tuple[int, ...]]] = field(default_factory=list)  # published blocks
    ckpt: tuple[int, ...] | None = None  # pooled checkpoints: the held latest checkpoint
    ckpt_block: int = -1
    ckpt_kind: SaveKind | None = None
    pending: dict[int, tuple[int, ...]] = field(default_factory=dict)  # block index -> planned save location
    pending_kind: dict[int, SaveKind] = field(default_factory=dict)  # block index -> why it is saved
    orphan_saves: dict[int, SaveKind] = field(default_factory=dict)  # beside the pool: saved blocks not attached


class MemoryManager:
    """Pages, slots and the prefix cache. See the module docstring for the invariants."""

    def __init__(self, num_pages: int, num_slots: int, block_size: int, num_gdn_groups: int,
                 caching: bool = True, layout: str | CacheLayout = "runs", eviction: EvictionPolicy | None = None,
                 pages_per_state: int = 1):
        layout = layout_for(layout)
        if block_size < 1 or num_slots < 1 or num_gdn_groups < 0 or pages_per_state < 1:
            raise ConfigError("block_size, num_slots and pages_per_state must be >= 1, num_gdn_groups >= 0")
        most = layout.max_pages_per_state
        if most is not None and pages_per_state > most:
            raise ConfigError(f"a GDN state spans {most} page(s) in the {layout.name} layout, not {pages_per_state}")
        self.num_pages = num_pages
        self.num_slots = num_slots
        self.block_size = block_size
        self.num_gdn_groups = num_gdn_groups
        self.caching = caching
        self.layout = layout
        # checkpoints in pool pages, held and evicted like attention pages (else in a tensor beside the pool, at
        # the row of their block's attention page: they cost no page and live as long as it)
        self._pooled = layout.in_pool
        self.pages_per_state = pages_per_state
        # pages a save takes from the pool
        self.checkpoint_pages = layout.checkpoint_pages(num_gdn_groups, pages_per_state) if caching else 0
        if num_pages < 1 + 2 * self.checkpoint_pages:
            raise ConfigError(f"{num_pages} pages cannot hold one block and two checkpoints of "
                              f"{num_gdn_groups} GDN groups; give the pool more memory")
        self._ref = [0] * num_pages
        self._kind: list[int | None] = [None] * num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._evictor: EvictionPolicy = eviction if eviction is not None else LRUEviction()
        self._cache: dict[BlockHash, CacheEntry] = {}
        self._role: dict[int, BlockHash] = {}  # cached page -> hash of the entry it serves
        self._free_slots: deque[int] = deque(range(num_slots))
        self._slot_owner: dict[int, str] = {}
        self._seqs: dict[str, _Seq] = {}
        self.stats = MemoryStats()
        self.events: deque[CacheRecord] | None = None  # enable_events(): changes of the cache, for a router
        self.disk: DiskTier | None = None  # attach_disk(): the second tier

    def enable_events(self) -> deque[CacheRecord]:
        """Record every change of the prefix cache (memory/events.py) into a deque, and return it: the engine's
        thread only appends; another thread drains it (deque appends and pops are atomic). Call before the
        first request, so the records describe the whole cache."""
        if self._cache:
            raise RuntimeError("enable cache events before the cache holds anything")
        if self.events is None:
            self.events = deque()
        if self.disk is not None:
            self.disk.events = self.events
            self.disk.announce()
        return self.events

    def attach_disk(self, tier: DiskTier) -> None:
        """Give the prefix cache a second tier on disk (module docstring). Call before the first request."""
        if not self.caching:
            raise ConfigError("a disk tier needs prefix caching on")
        self.disk = tier
        tier.events = self.events

    def disk_stats(self) -> DiskStats:
        return self.disk.stats if self.disk is not None else DiskStats()

    @classmethod
    def from_pool(cls, pool: Pool, caching: bool, eviction: EvictionPolicy | None = None) -> "MemoryManager":
        """From a sizing.Pool."""
        return cls(pool.num_pages, pool.num_slots, pool.block_size, pool.num_gdn_groups, caching,
                   pool.layout, eviction, pool.pages_per_state)

    # ------------------------------------------------------------------ queries
    def num_allocatable(self) -> int:
        """Pages an allocation can get now: free plus evictable."""
        return len(self._free) + len(self._evictor)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def num_pages_in_use(self) -> int:
        """Pages referenced by running sequences (cached-but-unreferenced pages are not in use)."""
        return self.num_pages - len(self._free) - len(self._evictor)

    @property
    def num_slots_in_use(self) -> int:
        return len(self._slot_owner)

    def max_request_tokens(self) -> int:
        """The most tokens (prompt + max_tokens) one request can ever hold, alone in the pool.

        Reserves the two checkpoints (held + pending) a sequence may hold where checkpoints take pool pages.
        The engine refuses requests above this; they could never finish.
        """
        return (self.num_pages - 2 * self.checkpoint_pages) * self.block_size

    def page_table(self, seq_id: str) -> tuple[int, ...]:
        return tuple(self._seqs[seq_id].pages)

    def num_published(self, seq_id: str) -> int:
        """Blocks of seq_id published so far (its next publish() starts at this block index)."""
        return len(self._seqs[seq_id].keys)

    def slot_of(self, seq_id: str) -> int:
        return self._seqs[seq_id].slot

    def pages_needed(self, seq_id: str, num_tokens: int) -> int:
        """New attention pages seq_id needs to cover positions [0, num_tokens)."""
        return max(0, self.pages_for(num_tokens) - len(self._seqs[seq_id].pages))

    def pages_for(self, num_tokens: int) -> int:
        """Attention pages that hold positions [0, num_tokens)."""
        return -(-num_tokens // self.block_size)

    def usage(self) -> MemoryUsage:
        cached, free = len(self._evictor), len(self._free)
        return MemoryUsage(self.num_pages, self.num_pages - cached - free, cached, free, self.num_slots,
                           len(self._slot_owner))

    def num_checkpoints(self) -> tuple[int, int]:
        """(checkpoints kept: cached ones plus held ones not attached to an entry, pool pages they take)."""
        cached = sum(1 for e in self._cache.values() if e.checkpoint is not None)
        held = sum(1 for s in self._seqs.values() if s.ckpt is not None and s.ckpt[0] not in self._role)
        held += sum(len(s.orphan_saves) for s in self._seqs.values())
        pages = sum(1 for k in self._kind if k is not None and k >= 0)
        return cached + held, pages

    def free_page_ids(self) -> tuple[int, ...]:
        """Pages nobody will read (for tests that plant garbage there)."""
        return tuple(self._free)

    def free_slot_ids(self) -> tuple[int, ...]:
        return tuple(self._free_slots)

    def num_cached_blocks(self) -> int:
        return len(self._cache)

    # ------------------------------------------------------------------ prefix lookup
    def find_prefix(self, root: BlockHash, hashes: Sequence[BlockHash],
                    block_tokens: Callable[[int], Sequence[int]], max_blocks: int) -> PrefixHit:
        """The longest cached prefix (at most max_blocks blocks) whose last block has a checkpoint.

        hashes[j] is the chain hash of block j (root is the parent of block 0); block_tokens(j) its tokens.
        num_matched_blocks also counts the cached blocks after the hit that have no checkpoint: where that
        chain ends, another sequence's tokens diverged from this one's (the scheduler's fork point).
        No side effects: admit() takes the hit.
        """
        if not self.caching:
            return PrefixHit(0, self.block_size)
        parent, best, best_ckpt, pages = root, 0, None, []
        for j in range(min(max_blocks, len(hashes))):
            e = self._cache.get(hashes[j])
            if e is None or not e.matches(parent, block_tokens(j)):
                break
            pages.append(e.page)
            if self.num_gdn_groups == 0:
                best, best_ckpt = j + 1, ()
            elif e.checkpoint is not None:
                best, best_ckpt = j + 1, e.checkpoint
            parent = hashes[j]
        if best == 0:
            return PrefixHit(0, self.block_size, num_matched_blocks=len(pages))
        return PrefixHit(best, self.block_size, tuple(pages[:best]), best_ckpt, tuple(hashes[:best]), len(pages))

    # ------------------------------------------------------------------ the disk tier
    def prepare_from_disk(self, root: BlockHash, hashes: Sequence[BlockHash],
                          block_tokens: Callable[[int], Sequence[int]], max_blocks: int) -> str:
        """Bring back from disk what makes this prefix's hit longer than the pool's (find_prefix's arguments).

        DISK_GO: go ahead, find_prefix now returns the longest hit both tiers give (the records were staged and are
        installed: pool pages taken, blocks published, their bytes queued to land before the step runs), or the
        disk cannot help (nothing there, or no room in the pool even once every running sequence is done: then the
        pool's hit). DISK_READING: wait, reads are in flight (a failed read drops its record, and the next call asks
        for what is left). DISK_ROOM: wait, the staged records need more pages than are allocatable now, and the
        running sequences hold enough to make room when they release theirs: reading a prefix back costs a copy,
        computing it again costs its prefill, and needs the same pages."""
        d = self.disk
        if d is None or d.closed:
            return DISK_GO
        d.poll()
        want, chain = self._disk_want(root, hashes, block_tokens, max_blocks)
        if not want:
            return DISK_GO
        missing = [r for r in want if r.key not in d.staged]
        for r in missing:
            d.read(r)
        if missing:
            return DISK_READING
        short = self._install(want, chain)
        return DISK_ROOM if 0 < short <= self.num_pages_in_use else DISK_GO

    def _disk_want(self, root, hashes, block_tokens, max_blocks) -> tuple[list[DiskRecord], list[BlockHash]]:
        """The records to read back for the longest hit through both tiers (K/V in chain order, then the
        checkpoint), and that hit's chain; no records when the pool alone gives it."""
        d, G = self.disk, self.num_gdn_groups
        parent, best, best_ck, kv = root, 0, None, []
        for j in range(min(max_blocks, len(hashes))):
            h, toks = hashes[j], tuple(block_tokens(j))
            e = self._cache.get(h)
            if e is not None:
                if not e.matches(parent, toks):
                    break
                in_pool = G == 0 or e.checkpoint is not None
            else:
                r = d.get(KV, h)
                if r is None or not r.matches(parent, toks):
                    break
                kv.append((j, r))
                in_pool = G == 0
            ck = None if in_pool else d.get(CKPT, h)
            if in_pool:
                best, best_ck = j + 1, None
            elif ck is not None and ck.matches(parent, toks):
                best, best_ck = j + 1, ck
            parent = h
        want = [r for j, r in kv if j < best] + ([best_ck] if best_ck is not None else [])
        return want, list(hashes[:best])

    def _install(self, want: list[DiskRecord], chain: list[BlockHash]) -> int:
        """Take pool pages for the staged records `want` and publish them; the chain's pool pages (and its
        checkpoint's) are pinned meanwhile, so taking pages never evicts the hit being built. Returns how many
        pages it lacked: 0 when installed; no room: nothing done."""
        d = self.disk
        last = self._cache.get(chain[-1])
        pinned = [self._cache[h].page for h in chain if h in self._cache]
        pinned_ckpt = list(last.checkpoint) if self._pooled and last is not None and last.checkpoint else []
        for p in pinned + pinned_ckpt:
            self._ref_cached(p)
        per = self.checkpoint_pages if self._pooled else 0
        ckpt_pages: list[int] = []
        short = sum(1 if r.kind == KV else per for r in want) - self.num_allocatable()
        if short <= 0:
            for r in want:
                if r.kind == KV:
                    p = self._take_page(ATTN)
                    self._cache[r.hash] = CacheEntry(r.hash, r.parent, r.tokens, p, index=chain.index(r.hash))
                    self._role[p] = r.hash
                    d.load(r, (p,))
                    d.stats.disk_hit_tokens += self.block_size
                    if self.events is not None:
                        self.events.append(CacheRecord(BLOCK, r.hash, r.parent, r.tokens, chain.index(r.hash)))
                    continue
                e = self._cache[r.hash]
                if self._pooled:
                    loc = tuple(self._take_page(i // self.pages_per_state) for i in range(per))
                    for q in loc:
                        self._role[q] = r.hash
                    ckpt_pages.extend(loc)
                else:
                    loc = (e.page,)
                e.checkpoint, e.checkpoint_kind = loc, SaveKind(r.ckpt_kind)
                d.load(r, loc)
                if self.events is not None:
                    self.events.append(CacheRecord(CHECKPOINT, r.hash))
        # every page below carries one reference of ours (pinned, or taken); a chain's tail is released (so
        # evicted) before its head, its checkpoint last
        for p in reversed([self._cache[h].page for h in chain if h in self._cache]):
            self._release(p)
        for q in pinned_ckpt + ckpt_pages:
            self._release(q)
        return max(0, short)

    def spill_all(self) -> None:
        """Queue a write of every cached block and checkpoint the disk lacks (at shutdown: the pool dies with
        the process)."""
        if self.disk is not None:
            for e in list(self._cache.values()):
                self._spill(e, True)

    def _spill(self, e: CacheEntry, kv: bool) -> None:
        """e's content leaves the pool: its K/V (kv) and its checkpoint, if it has one, go to disk."""
        d = self.disk
        if kv:
            d.spill(DiskRecord(KV, e.hash, e.parent, e.tokens, d.sizes[KV], index=e.index), (e.page,),
                    float(self.block_size))
        if e.checkpoint is not None and self.num_gdn_groups:
            # the value policy's: tokens spared per K/V record's bytes
            value = self._checkpoint_spares(e) * d.sizes[KV] / d.sizes[CKPT] if d.wants_value else 0.0
            d.spill(DiskRecord(CKPT, e.hash, e.parent, e.tokens, d.sizes[CKPT], SaveKind(e.checkpoint_kind).value,
                               e.index), e.checkpoint, value)

    def pin_cost(self, hit: PrefixHit | None) -> int:
        """How many allocatable (evictable) pages taking this hit would pin."""
        if hit is None or not hit.num_blocks:
            return 0
        n = sum(1 for p in hit.page_ids if self._ref[p] == 0)
        if self._pooled and hit.checkpoint:
            n += sum(1 for q in hit.checkpoint if self._ref[q] == 0)
        return n

    # ------------------------------------------------------------------ sequence lifecycle
    def admit(self, seq_id: str, hit: PrefixHit | None = None) -> tuple[int, tuple[int, ...] | None]:
        """Give seq_id a slot and take its prefix hit (pages referenced, checkpoint held).

        Returns (slot, restore location or None). With no restore the caller must zero the slot.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already holds memory")
        if not self._free_slots:
            raise OutOfPagesError("no free GDN slot")
        seq = _Seq(slot=self._free_slots.popleft())
        self._slot_owner[seq.slot] = seq_id
        self._seqs[seq_id] = seq
        location = None
        if hit is not None and hit.num_blocks:
            if not self.caching or hit.block_size != self.block_size:
                raise CheckpointError("prefix hit on a pool without caching or with another block size")
            passed = []  # the junctions the hit passes (_renew_junctions)
            for j, (h, p) in enumerate(zip(hit.hashes, hit.page_ids)):
                e = self._cache.get(h)
                if e is None or e.page != p:
                    raise CheckpointError(f"stale prefix hit: block {j} is no longer cached in page {p}")
                self._ref_cached(p)
                seq.pages.append(p)
                seq.keys.append((e.hash, e.parent, e.tokens))
                if e.checkpoint is not None and e.hits >= JUNCTION_READS and j < hit.num_blocks - 1:
                    passed.append(e)
            last = self._cache[hit.hashes[-1]]
            last.hits += 1
            if self.num_gdn_groups and last.checkpoint_kind is not None:
                self.stats.checkpoints_hit_by_kind[last.checkpoint_kind] += 1
            if self.num_gdn_groups:
                if last.checkpoint is None or last.checkpoint != hit.checkpoint:
                    raise CheckpointError("stale prefix hit: its checkpoint is no longer cached")
                location = last.checkpoint
                if self._pooled:
                    for q in location:
                        self._ref_cached(q)
                    seq.ckpt, seq.ckpt_block, seq.ckpt_kind = location, hit.num_blocks - 1, last.checkpoint_kind
                    self._renew_junctions(passed)
                self.stats.checkpoints_restored += 1
        return seq.slot, location

    def append_pages(self, seq_id: str, num_tokens: int) -> list[int]:
        """Grow seq_id's page table to cover positions [0, num_tokens). Returns the new pages (to zero)."""
        seq = self._seqs[seq_id]
        n = self.pages_needed(seq_id, num_tokens)
        if n > self.num_allocatable():
            raise OutOfPagesError(f"{n} pages wanted, {self.num_allocatable()} allocatable")
        new = [self._take_page(ATTN) for _ in range(n)]
        seq.pages.extend(new)
        return new

    def num_free_pages(self) -> int:
        """Pages that hold nothing: taking them evicts no cached content."""
        return len(self._free)

    def reserve_checkpoint(self, seq_id: str, end: int, kind: SaveKind | str = SaveKind.STEP) -> tuple[int, ...]:
        """Plan a save of seq_id's GDN state after position `end`: the end of its work in the coming step, or a
        block boundary inside its prefill chunk. kind: why (a SaveKind or its value; counted, and kept for eviction).

        Call after append_pages(seq_id, the chunk's end). Returns the location (pooled: checkpoint_pages new
        pages; beside the pool: the block's attention page). Raises CheckpointError unless `end` is the end of
        a full block of the page table that is not yet published nor already planned.
        """
        seq = self._seqs[seq_id]
        if not self.caching or not self.num_gdn_groups:
            raise CheckpointError("checkpoints need caching on and GDN layers")
        if kind not in tuple(SaveKind):
            raise ValueError(f"checkpoint kind must be one of {tuple(k.value for k in SaveKind)}, not {kind!r}")
        kind = SaveKind(kind)
        if end <= 0 or end % self.block_size:
            raise CheckpointError(f"save after position {end}: not the end of a full block "
                                  f"(block size {self.block_size})")
        k = end // self.block_size - 1
        if not len(seq.keys) <= k < len(seq.pages) or k in seq.pending:
            raise CheckpointError(f"save of block {k}: not an unpublished block of the chunk being computed "
                                  f"(page table holds {len(seq.pages)} blocks, {len(seq.keys)} published)")
        if self._pooled:
            if self.checkpoint_pages > self.num_allocatable():
                raise OutOfPagesError("no pages for a checkpoint")
            loc = tuple(self._take_page(i // self.pages_per_state) for i in range(self.checkpoint_pages))
        else:
            p = seq.pages[k]
            if p in self._role:
                raise CheckpointError(f"save into page {p}, which is shared through the cache")
            loc = (p,)
        seq.pending[k] = loc
        seq.pending_kind[k] = kind
        return loc

    def publish(self, seq_id: str, blocks: Sequence[tuple[BlockHash, BlockHash, Sequence[int]]]) -> None:
        """Publish the next blocks of seq_id (their K/V has been written): (hash, parent hash, tokens).

        Call only after the step that wrote them has run. A hash already cached (another copy won) leaves
        this sequence's page uncached (a duplicate).
        """
        if not self.caching:
            return
        seq = self._seqs[seq_id]
        for h, parent, toks in blocks:
            j = len(seq.keys)
            toks = tuple(toks)
            if j >= len(seq.pages) or len(toks) != self.block_size:
                raise CheckpointError(f"publish of block {j}: not a full block this sequence holds")
            p = seq.pages[j]
            seq.keys.append((h, parent, toks))
            if h not in self._cache and p not in self._role:
                self._cache[h] = CacheEntry(h, parent, toks, p, index=j)
                self._role[p] = h
                if self.events is not None:
                    self.events.append(CacheRecord(BLOCK, h, parent, toks, j))

    def commit_checkpoints(self, seq_id: str) -> int:
        """The planned saves of published blocks have run: attach them to their cache entries.

        pooled: the sequence then holds this newest checkpoint (the entry's own if it already had one)
        and releases the previous. Returns the number committed.
        """
        seq = self._seqs[seq_id]
        done = sorted(k for k in seq.pending if k < len(seq.keys))
        for k in done:
            loc, kind = seq.pending.pop(k), seq.pending_kind.pop(k)
            self.stats.checkpoints_saved += 1
            self.stats.checkpoints_saved_by_kind[kind] += 1
            h, parent, toks = seq.keys[k]
            e = self._cache.get(h)
            ok = e is not None and e.matches(parent, toks)
            if not self._pooled:
                if ok and e.checkpoint is None and e.page != loc[0] and loc[0] not in self._role:
                    self._repoint(e, loc[0])  # our duplicate carries the state: it becomes the cached copy
                if ok and e.page == loc[0]:
                    if e.checkpoint is None:
                        e.checkpoint, e.checkpoint_kind = loc, kind
                        if self.events is not None:
                            self.events.append(CacheRecord(CHECKPOINT, h))
                else:
                    seq.orphan_saves[k] = kind
                continue
            if ok and e.checkpoint is None:
                e.checkpoint, e.checkpoint_kind = loc, kind
                for q in loc:
                    self._role[q] = h
                if self.events is not None:
                    self.events.append(CacheRecord(CHECKPOINT, h))
                self._hold_ckpt(seq, loc, k, kind)
            elif ok:  # the entry already has one: hold that, drop ours
                for q in e.checkpoint:
                    self._ref_cached(q)
                for q in loc:
                    self._release(q)
                self._hold_ckpt(seq, e.checkpoint, k, e.checkpoint_kind)
            else:  # no entry (a colliding or evicted hash): keep ours, maybe attached at free()
                self._hold_ckpt(seq, loc, k, kind)
        return len(done)

    def free(self, seq_id: str) -> None:
        """Release everything seq_id holds: pages, checkpoints, slot. Published blocks stay cached."""
        seq = self._seqs.pop(seq_id)
        if self.caching:
            self._republish(seq)
        if self._pooled:
            for loc in seq.pending.values():
                for q in loc:
                    self._release(q)
        for p in reversed(seq.pages):
            self._release(p)
        if seq.ckpt is not None:
            for q in seq.ckpt:
                self._release(q)
        del self._slot_owner[seq.slot]
        self._free_slots.append(seq.slot)

    # ------------------------------------------------------------------ internals
    def _take_page(self, kind: int) -> int:
        if self._free:
            p = self._free.popleft()
        elif len(self._evictor):
            p = self._evictor.pop()
            assert self._ref[p] == 0 and p in self._role, f"the eviction policy offered page {p}: held or not cached"
            self._evict(p)
        else:
            raise OutOfPagesError("the pool is exhausted")
        assert self._ref[p] == 0 and p not in self._role
        self._ref[p] = 1
        self._kind[p] = kind
        return p

    def _evict(self, p: int) -> None:
        """p was just popped from the evictor: drop the cache content it carries."""
        h = self._role.pop(p)
        e = self._cache[h]
        self.stats.evictions += 1
        if self.disk is not None:
            self._spill(e, e.page == p)
        if e.checkpoint is not None:
            self.stats.checkpoints_evicted_by_kind[e.checkpoint_kind] += 1
            if e.hits == 0:
                self.stats.checkpoints_evicted_unread_by_kind[e.checkpoint_kind] += 1
        if e.page == p:
            del self._cache[h]
            if self._pooled and e.checkpoint:
                for q in e.checkpoint:
                    self._drop_role(q)
            if self.events is not None:
                self.events.append(CacheRecord(BLOCK_GONE, h))
        else:
            ck, e.checkpoint, e.checkpoint_kind = e.checkpoint, None, None
            for q in ck:
                if q != p:
                    self._drop_role(q)
            if self.events is not None:
                self.events.append(CacheRecord(CHECKPOINT_GONE, h))
        self._kind[p] = None

    def _repoint(self, e: CacheEntry, p: int) -> None:
        """beside the pool: make page p (a duplicate of e's block, same K/V bits) e's cached page, because a
        checkpoint was saved with it (a fork point). The old page stays with whoever holds it, uncached."""
        old = e.page
        del self._role[old]
        if self._ref[old] == 0:
            self._evictor.remove(old)
            self._free.append(old)
            self._kind[old] = None
        e.page = p
        self._role[p] = e.hash

    def _drop_role(self, q: int) -> None:
        del self._role[q]
        if self._ref[q] == 0:
            self._evictor.remove(q)
            self._free.append(q)
            self._kind[q] = None
            self.stats.evictions += 1

    def _ref_cached(self, p: int) -> None:
        if self._ref[p] == 0:
            self._evictor.remove(p)
        self._ref[p] += 1

    def _release(self, p: int, low_value: bool = False) -> None:
        self._ref[p] -= 1
        assert self._ref[p] >= 0, f"page {p} released more often than taken"
        if self._ref[p] == 0:
            if p in self._role:
                self._push_evictable(p, low_value)
            else:
                self._free.append(p)
                self._kind[p] = None

    def _value(self, p: int) -> float:
        """The prefill tokens cached page p spares per page held: an attention page its block; a checkpoint the
        tokens back to the previous checkpoint of its chain (what a hit recomputes without it; the walk stops
        after VALUE_WALK blocks), times 1 + its hits, over its pages."""
        e = self._cache[self._role[p]]
        if e.page == p:
            return float(self.block_size)
        return self._checkpoint_spares(e) / len(e.checkpoint)

    def _checkpoint_spares(self, e: CacheEntry) -> float:
        """The prefill tokens e's checkpoint spares: back to the previous checkpoint of its chain, times 1 + hits."""
        n, parent = 1, e.parent
        while n < VALUE_WALK:
            pe = self._cache.get(parent)
            if pe is None or pe.checkpoint is not None:
                break
            n, parent = n + 1, pe.parent
        return n * self.block_size * (1 + e.hits)

    def _push_evictable(self, p: int, low_value: bool = False) -> None:
        self._evictor.push(p, low_value, self._value(p) if self._evictor.wants_value else 0.0)

    def _renew_junctions(self, passed: list[CacheEntry]) -> None:
        """The checkpoints a hit passes (not its last) that JUNCTION_READS requests resumed from move to the young
        end of the eviction order, as the hit's attention pages do when it releases them; one some sequence holds
        is not in that order and stays as it is (not counted)."""
        for e in passed:
            free = [q for q in e.checkpoint if self._ref[q] == 0]
            for q in free:
                self._evictor.remove(q)
                self._push_evictable(q)
            self.stats.checkpoints_renewed += bool(free)

    def _hold_ckpt(self, seq: _Seq, loc: tuple[int, ...], k: int, kind: SaveKind | None) -> None:
        old, old_kind = seq.ckpt, seq.ckpt_kind
        seq.ckpt, seq.ckpt_block, seq.ckpt_kind = loc, k, kind
        if old is not None:  # replaced: low value unless some request has hit it, or it is the prompt's, a hint's
            # (the request said that prefix will be re-sent) or a fork's (a second sequence shares the prefix it ends:
            # the next one that does hits it, so evicting it first would waste the save it was taken for)
            # the prompt's checkpoint is replaced only by a decode's, on a block of generated tokens that only
            # this request can find (tag_outputs); a conversation's next turn re-sends those tokens as prompt,
            # hashed apart, so the prompt's checkpoint is the deepest point that turn can resume from
            h = self._role.get(old[0])
            low = (h is None or self._cache[h].hits == 0) and old_kind not in KEPT_WHEN_REPLACED
            for q in old:
                self._release(q, low)

    def _republish(self, seq: _Seq) -> None:
        for j, (h, parent, toks) in enumerate(seq.keys):
            p = seq.pages[j]
            if p not in self._role and h not in self._cache:
                self._cache[h] = CacheEntry(h, parent, toks, p, index=j)
                self._role[p] = h
                if self.events is not None:
                    self.events.append(CacheRecord(BLOCK, h, parent, toks, j))
        if self._pooled and seq.ckpt is not None and seq.ckpt[0] not in self._role:
            h, parent, toks = seq.keys[seq.ckpt_block]
            e = self._cache.get(h)
            if e is not None and e.matches(parent, toks) and e.checkpoint is None:
                e.checkpoint, e.checkpoint_kind = seq.ckpt, seq.ckpt_kind
                for q in seq.ckpt:
                    self._role[q] = h
                if self.events is not None:
                    self.events.append(CacheRecord(CHECKPOINT, h))
        for k, kind in seq.orphan_saves.items():
            h, parent, toks = seq.keys[k]
            e = self._cache.get(h)
            if e is not None and e.page == seq.pages[k] and e.checkpoint is None:
                e.checkpoint, e.checkpoint_kind = (e.page,), kind
                if self.events is not None:
                    self.events.append(CacheRecord(CHECKPOINT, h))

    # image placeholder token ids (the engine sets them for a multimodal model): a block holding one is hashed
    # with its images' content hashes (hashing.py), which its tokens do not carry, so check_integrity cannot
    # recompute its key from the tokens; a hit still compares the stored parent and tokens
    media_token_ids: frozenset[int] = frozenset()

    # ------------------------------------------------------------------ invariants
    def check_integrity(self, deep: bool = True) -> None:
        """Assert every invariant of the pool, the slots and the cache (tests call it after every op)."""
        n, G, bs, per = self.num_pages, self.num_gdn_groups, self.block_size, self.pages_per_state
        refs = [0] * n
        slots_seen: dict[int, str] = {}
        for sid, seq in self._seqs.items():
            assert self._slot_owner.get(seq.slot) == sid, f"slot {seq.slot} not owned by {sid}"
            assert seq.slot not in slots_seen, f"slot {seq.slot} held twice"
            slots_seen[seq.slot] = sid
            assert len(seq.keys) <= len(seq.pages)
            for p in seq.pages:
                refs[p] += 1
                assert self._kind[p] == ATTN, f"page {p} in a page table is owned by {self._kind[p]}"
            for j, (h, parent, toks) in enumerate(seq.keys):
                assert len(toks) == bs and (j == 0 or parent == seq.keys[j - 1][0])
                if deep and not self.media_token_ids.intersection(toks):
                    assert h in (block_hash(parent, toks), block_hash(parent, toks, True)), \
                        "published key does not hash to itself"
            if seq.ckpt is not None:
                assert self._pooled and len(seq.ckpt) == G * per and 0 <= seq.ckpt_block < len(seq.keys)
                for i, q in enumerate(seq.ckpt):
                    refs[q] += 1
                    assert self._kind[q] == i // per, f"checkpoint page {q} not owned by GDN group {i // per}"
            for k, loc in seq.pending.items():
                assert len(seq.keys) <= k < len(seq.pages), f"pending save of block {k} out of range"
                if self._pooled:
                    assert len(loc) == G * per
                    for i, q in enumerate(loc):
                        refs[q] += 1
                        assert self._kind[q] == i // per
                else:
                    assert loc == (seq.pages[k],)
            for k in seq.orphan_saves:
                assert not self._pooled and k < len(seq.keys)
        assert refs == self._ref, "ref counts do not match holders"
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        evictable = set(self._evictor)
        assert len(evictable) == len(self._evictor)
        held = {p for p in range(n) if self._ref[p] > 0}
        assert not (free & evictable) and not (free & held) and not (evictable & held), "page states overlap"
        assert len(free) + len(evictable) + len(held) == n, "pages unaccounted for"
        for p in free:
            assert self._kind[p] is None and p not in self._role
        for p in evictable:
            assert p in self._role and self._kind[p] is not None
        for p in held:
            assert self._kind[p] is not None
        if not self.caching:
            assert not self._cache and not self._role and not evictable
        roles: dict[int, BlockHash] = {}
        for h, e in self._cache.items():
            assert e.hash == h and len(e.tokens) == bs
            if deep and not self.media_token_ids.intersection(e.tokens):
                assert h in (block_hash(e.parent, e.tokens), block_hash(e.parent, e.tokens, True)), \
                    "cache entry does not hash to its key"
            roles[e.page] = h
            assert self._kind[e.page] == ATTN, f"cached attention page {e.page} owned by {self._kind[e.page]}"
            assert (e.checkpoint is None) == (e.checkpoint_kind is None), f"entry {h!r}: checkpoint without its kind"
            if e.checkpoint is not None:
                assert G > 0
                if self._pooled:
                    assert len(e.checkpoint) == G * per
                    for i, q in enumerate(e.checkpoint):
                        assert q not in roles, f"page {q} serves two cache roles"
                        roles[q] = h
                        assert self._kind[q] == i // per
                else:
                    assert e.checkpoint == (e.page,)
        assert roles == self._role, "page roles do not match cache entries"
        assert set(self._slot_owner) == set(slots_seen), "slot owners do not match sequences"
        fs = set(self._free_slots)
        assert len(fs) == len(self._free_slots) and not (fs & set(slots_seen))
        assert len(fs) + len(slots_seen) == self.num_slots and all(0 <= s < self.num_slots for s in fs)
        if self.disk is not None:
            self.disk.check_integrity()
            # queued loads land in order before the step: the last one into a page that serves the cache must be
            # that content's (a page loaded and evicted in one schedule may be taken again, by a later load too)
            last = {q: ld.record.hash for ld in self.disk.pending_loads() for q in ld.location}
            for q, h in last.items():
                assert self._role.get(q, h) == h, f"a queued load into page {q} would overwrite cached content"
