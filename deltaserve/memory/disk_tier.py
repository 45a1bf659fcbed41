"""The disk tier's bookkeeping: which blocks and checkpoints live on local disk, what to write and what to read.
No torch, no file I/O: the memory manager decides, runner/disk_store.py moves the bytes.

Two kinds of record, each under the block hash of the prefix cache (memory/hashing.py: the cache_salt is in the
chain, so a salted prefix is nobody else's hit on disk either):
  kv    the K/V of one block: every layer position of its attention page;
  ckpt  the GDN checkpoint taken after the block's last token: every GDN layer's state bytes.
A record carries the block's parent hash and tokens, and a lookup compares them, as the pool's does.

The life of a record:
  * spill    a pool page whose content the manager evicts (or, at shutdown, every cached block) is queued for
             writing (`Spill`): the record enters the index at once, so the next lookup can count on it; the
             bytes are copied out of the pool before the next step runs, and the I/O worker writes them;
  * read     a lookup that finds a longer hit through the disk than in the pool asks for the records it
             lacks (`read`); the request waits in the scheduler while they are read and verified;
  * stage    a verified record's bytes wait in the worker (`staged`);
  * load     once every record of the hit is staged, the manager takes pool pages for them, publishes them
             in the prefix cache and queues a `Load`; the bytes are copied into those pages before the
             step that may read them runs (the same ordering rule as a save: publish before anyone reads,
             the bytes land first in the step);
  * evict    over the byte budget, the record the eviction policy picks goes (`delete`): the pool's own
             policy (--eviction, memory/eviction.py) over records, lru by default (a record read back counts as
             used); value weighs the prefill tokens a record spares per byte it takes, with its hits.
A failed read (a corrupt or missing file) drops the record from the index: a miss. A failed write:
  * no room on the file system (ENOSPC, EDQUOT): the budget is larger than the disk; the budget comes down to what
    is on disk, the policy evicts to make room for the record, and its write is tried once more (the store kept
    its bytes); a second failure stops the writing (`writable` false): what is on disk is still read;
  * not allowed (EROFS, EACCES, EPERM): the writing stops at once;
  * anything else (EIO): that record is dropped, a miss.
Records of other fingerprints (another model or configuration on the same directory, `ForeignRecord`) share the
budget and the policy's order: never a hit, deleted only when the budget needs their room.
Recency and value outlive the process: the store orders the records found at start-up by their files' mtimes
(set again at each read-back) and reads each one's value from its header.

Invariants (check_integrity): the index's byte count equals the sum of its records and the foreign ones; it
never exceeds the budget; the gauges count the records whose write finished (not those queued); a staged or
reading key is in the index or was dropped since (its bytes are then never loaded).
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from .events import BLOCK, BLOCK_GONE, CHECKPOINT, CHECKPOINT_GONE, DISK, CacheRecord
from .eviction import EvictionPolicy, LRUEviction
from .hashing import BlockHash

KV = "kv"
CKPT = "ckpt"
HEADER_BYTES = 4096  # what a record's header is charged against the budget (the real one is smaller)


@dataclass(frozen=True)
class DiskRecord:
    """What the index knows of one record; the file's header holds the same fields."""

    kind: str  # KV or CKPT
    hash: BlockHash
    parent: BlockHash
    tokens: tuple[int, ...]
    nbytes: int  # payload bytes
    ckpt_kind: str | None = None  # a checkpoint's SaveKind value
    index: int = -1  # the block's index in its chain (KV events)

    @property
    def key(self) -> tuple[str, BlockHash]:
        return self.kind, self.hash

    def matches(self, parent: BlockHash, tokens) -> bool:
        return self.parent == parent and self.tokens == tuple(tokens)


@dataclass(frozen=True)
class ForeignRecord:
    """A record of another fingerprint on the same directory: its bytes count against the budget and it is evicted
    by policy like the others, but no lookup finds it."""

    name: str  # its file's name: the key the store deletes it by
    nbytes: int  # payload bytes

    @property
    def key(self) -> str:
        return self.name


@dataclass(frozen=True)
class Spill:
    """Write the bytes at `location` (kv: (page,); ckpt: the checkpoint's location) as `record`; value is the
    policy's (kept in the record's header, so that it outlives the process)."""

    record: DiskRecord
    location: tuple[int, ...]
    value: float = 0.0


@dataclass(frozen=True)
class Rewrite:
    """Write `record` once more from the bytes the store kept when its first write found the disk full."""

    record: DiskRecord


@dataclass(frozen=True)
class Load:
    """Copy the staged bytes of `record` into `location` (pages taken for it this step)."""

    record: DiskRecord
    location: tuple[int, ...]


@dataclass
class DiskStats:
    """The tier's counters and gauges, each under its EngineStats field and metric name."""

    disk_bytes: int = 0  # gauge: bytes the records on disk take (headers charged HEADER_BYTES), queued writes not
    disk_records: int = 0  # gauge: records on disk, other fingerprints' included
    disk_writes: int = 0  # records written
    disk_write_bytes: int = 0
    disk_write_errors: int = 0  # writes that failed (a full disk, an I/O error): those records are misses
    disk_reads: int = 0  # records read and verified
    disk_read_bytes: int = 0
    disk_read_errors: int = 0  # reads that failed (corrupt, torn, missing): misses
    disk_read_seconds: float = 0.0  # summed latency of the reads, from request to verified bytes
    disk_evictions: int = 0  # records deleted to stay under the budget
    disk_hit_tokens: int = 0  # prefix-hit tokens whose K/V came back from disk


class DiskTier:
    """The index of the records on disk and the queue of work for the I/O worker. See the module docstring."""

    def __init__(self, capacity: int, kv_bytes: int, ckpt_bytes: int, eviction: EvictionPolicy | None = None):
        self.capacity = capacity
        self.sizes = {KV: kv_bytes, CKPT: ckpt_bytes}
        self._index: OrderedDict[tuple[str, BlockHash], DiskRecord] = OrderedDict()
        # the eviction policy works on ints (pages, in the pool): one id per record, its value kept for a touch
        self._evictor: EvictionPolicy = eviction if eviction is not None else LRUEviction()
        self._ids: dict[tuple[str, BlockHash], int] = {}
        self._keys: dict[int, tuple[str, BlockHash]] = {}
        self._values: dict[int, float] = {}
        self._next_id = 0
        self.wants_value = self._evictor.wants_value
        self._foreign: dict[str, ForeignRecord] = {}
        # writes queued or in flight (not on disk yet), each with its place in the order of writes queued
        self._pending: dict[tuple[str, BlockHash], int] = {}
        self._pending_bytes = 0
        self._queued = 0  # writes queued so far
        self._learned = 0  # a full disk queued before this write (its failure) says nothing new of the disk's size
        self._retried: set[tuple[str, BlockHash]] = set()  # rewritten once after a full disk
        self.writable = True  # false: nothing more is written (a read-only directory, a disk that stays full)
        self._ops: list[tuple[str, object]] = []  # ("write", Spill) | ("rewrite", Rewrite) | ("read", DiskRecord)
        # | ("delete", key of a record or name of a foreign one)
        self._loads: list[Load] = []
        self._loading_now: set[tuple[str, BlockHash]] = set()  # installed since the ops were last taken
        self.reading: set[tuple[str, BlockHash]] = set()
        self.staged: set[tuple[str, BlockHash]] = set()
        # the I/O worker's thread appends (op, key, ok, seconds, nbytes); the engine's thread pops (atomic)
        self.done: deque[tuple[str, tuple[str, BlockHash], bool, float, int]] = deque()
        self.bytes = 0
        self.stats = DiskStats()
        self.closed = False  # the engine shut down: nothing more is written or read
        self.events = None  # the manager's KV-event deque, when enabled: records on the DISK medium

    def close(self) -> None:
        self.closed = True

    # ------------------------------------------------------------------ the index
    def get(self, kind: str, h: BlockHash) -> DiskRecord | None:
        return self._index.get((kind, h))

    def __len__(self) -> int:
        return len(self._index)

    def charge(self, rec) -> int:
        return rec.nbytes + HEADER_BYTES

    @property
    def foreign(self) -> int:
        """Records of other fingerprints held under the budget."""
        return len(self._foreign)

    def value_of(self, key) -> float:
        i = self._ids.get(key)
        return 0.0 if i is None else self._values[i]

    def add(self, rec, value: float = 0.0, written: bool = False) -> bool:
        """Enter rec (a DiskRecord, or a ForeignRecord found at start-up) in the index, evicting what the policy
        picks to make room. False: it cannot fit. value: the prefill tokens the record spares per K/V record's
        bytes (the value policy's; lru ignores it). written: its file is on disk already (not a queued write)."""
        if rec.key in self._ids:
            return True
        need = self.charge(rec)
        if need > self.capacity:
            return False
        self._make_room(need)
        if isinstance(rec, ForeignRecord):
            self._foreign[rec.key] = rec
        else:
            self._index[rec.key] = rec
            if not written:
                self._pending[rec.key] = self._queued
                self._queued += 1
                self._pending_bytes += need
        i = self._ids[rec.key] = self._next_id
        self._next_id += 1
        self._keys[i], self._values[i] = rec.key, value
        self._evictor.push(i, False, value)
        self.bytes += need
        self._gauges()
        if not isinstance(rec, ForeignRecord):
            self._event(rec, True)
        return True

    def _make_room(self, need: int) -> None:
        """Evict by policy until `need` more bytes fit the budget (the caller checked need <= capacity)."""
        while self.bytes + need > self.capacity:
            self._evict(self._keys[self._evictor.pop()])

    def _evict(self, key) -> None:
        """key left the policy already: forget it, delete its file."""
        if key in self._foreign:
            self._release(key, self.charge(self._foreign.pop(key)))
        else:
            self._forget(self._index.pop(key))
        self._ops.append(("delete", key))
        self.stats.disk_evictions += 1

    def _event(self, rec: DiskRecord, stored: bool) -> None:
        if self.events is not None and rec.index >= 0:  # a block's place in its chain anchors it for a router
            if rec.kind == KV:
                self.events.append(CacheRecord(BLOCK, rec.hash, rec.parent, rec.tokens, rec.index, DISK) if stored
                                   else CacheRecord(BLOCK_GONE, rec.hash, medium=DISK))
            else:
                self.events.append(CacheRecord(CHECKPOINT if stored else CHECKPOINT_GONE, rec.hash, medium=DISK))

    def announce(self) -> None:
        """Record every record already on disk as stored (KV events enabled after start-up)."""
        for rec in sorted(self._index.values(), key=lambda r: r.kind != KV):
            self._event(rec, True)

    def adopt(self, records) -> None:
        """Records found on disk at start-up, least recently written or read back first (the policy's order): each
        a DiskRecord, a ForeignRecord, or a (record, value) pair (the value its header keeps)."""
        budget, self.capacity = self.capacity, float("inf")  # all enter first: the policy then picks among all
        for item in records:
            rec, value = item if isinstance(item, tuple) else (item, 0.0)
            if self.charge(rec) <= budget:
                self.add(rec, value, written=True)
        self.capacity = budget
        self._make_room(0)

    def pending(self, key) -> bool:
        """key's write is queued or in flight (or waits to be tried once more)."""
        return key in self._pending

    def stop_writing(self) -> None:
        """Nothing more is written (a read-only directory, a disk that stays full); the records on disk are read."""
        self.writable = False

    def touch(self, key) -> None:
        """key was used (read back): the policy sees it anew."""
        i = self._ids.get(key)
        if i is not None:
            self._evictor.remove(i)
            self._evictor.push(i, False, self._values[i])

    def drop(self, key) -> None:
        """Forget a record (its write or read failed) and delete its file."""
        rec = self._index.pop(key, None)
        if rec is not None:
            self._evictor.remove(self._ids[key])
            self._forget(rec)
            self._ops.append(("delete", key))

    def _forget(self, rec: DiskRecord) -> None:
        """rec left the index (and the policy)."""
        self._release(rec.key, self.charge(rec))
        self.staged.discard(rec.key)
        self._event(rec, False)

    def _release(self, key, charge: int) -> None:
        i = self._ids.pop(key)
        del self._keys[i], self._values[i]
        self.bytes -= charge
        if self._pending.pop(key, None) is not None:
            self._pending_bytes -= charge
        self._retried.discard(key)
        self._gauges()

    def _gauges(self) -> None:
        """What is on disk: the records whose write finished, the foreign ones (a queued write is not there yet)."""
        self.stats.disk_bytes = self.bytes - self._pending_bytes
        self.stats.disk_records = len(self._index) + len(self._foreign) - len(self._pending)

    # ------------------------------------------------------------------ decisions the manager takes
    def spill(self, rec: DiskRecord, location: tuple[int, ...], value: float = 0.0) -> None:
        """Queue a write of the pool bytes at location, unless the record is on disk already or its bytes are
        not in the pool yet (loaded this step: they land after the spills are copied)."""
        if self.closed or not self.writable or rec.key in self._index or rec.key in self._loading_now:
            return
        if self.add(rec, value):
            self._ops.append(("write", Spill(rec, location, value)))
        else:
            self.stats.disk_write_errors += 1

    def read(self, rec: DiskRecord) -> None:
        if rec.key not in self.reading and rec.key not in self.staged:
            self.reading.add(rec.key)
            self._ops.append(("read", rec))

    def load(self, rec: DiskRecord, location: tuple[int, ...]) -> None:
        self.staged.discard(rec.key)
        self._loading_now.add(rec.key)
        self._loads.append(Load(rec, location))
        self.touch(rec.key)

    def poll(self) -> None:
        """Take what the worker finished: failed reads drop their record (a miss); a failed write is handled by what
        failed (the module docstring): "write" ok or not, "write_full" (no room), "write_refused" (not allowed)."""
        while self.done:
            op, key, ok, seconds, nbytes = self.done.popleft()
            if op == "read":
                self.reading.discard(key)
                if ok and key in self._index:
                    self.staged.add(key)
                    self.stats.disk_reads += 1
                    self.stats.disk_read_bytes += nbytes
                    self.stats.disk_read_seconds += seconds
                elif not ok:
                    self.stats.disk_read_errors += 1
                    self.drop(key)
            elif ok:  # a write
                if self._pending.pop(key, None) is not None:
                    self._pending_bytes -= self.charge(self._index[key])
                    self._gauges()
                self.stats.disk_writes += 1
                self.stats.disk_write_bytes += nbytes
            else:
                self.stats.disk_write_errors += 1
                if op == "write_full" and self.writable and key in self._index and key not in self._retried:
                    self._room_for_retry(key)
                else:
                    if op in ("write_full", "write_refused"):
                        self.stop_writing()
                    self.drop(key)

    def _room_for_retry(self, key) -> None:
        """key's write found the file system full: the budget comes down to what is on disk (the queued writes must
        fit in it too), the policy evicts to make room, and key is written once more. A write queued before the
        last such lesson failed for want of the room that lesson's deletes (queued after it) make: it only retries."""
        if self._pending[key] >= self._learned:
            self.capacity = min(self.capacity, self.bytes - self._pending_bytes)
            self._learned = self._queued
        i = self._ids[key]
        self._evictor.remove(i)  # not its own victim
        while self.bytes > self.capacity and len(self._evictor):
            self._evict(self._keys[self._evictor.pop()])
        self._evictor.push(i, False, self._values[i])
        if self.bytes > self.capacity:  # nothing left to evict: it cannot fit this disk
            self.drop(key)
            return
        self._retried.add(key)
        self._ops.append(("rewrite", Rewrite(self._index[key])))

    def take(self) -> tuple[list[tuple[str, object]], list[Load]]:
        """The worker's ops (in order) and the loads, for the engine to carry out before the step runs."""
        ops, loads = self._ops, self._loads
        self._ops, self._loads, self._loading_now = [], [], set()
        return ops, loads

    def pending_loads(self) -> list[Load]:
        """The loads queued since the ops were last taken (check_integrity of the manager reads them)."""
        return list(self._loads)

    def busy(self) -> bool:
        """Reads in flight: a request may be waiting for them."""
        return bool(self.reading)

    def check_integrity(self) -> None:
        total = sum(self.charge(r) for r in self._foreign.values())
        for key, rec in self._index.items():
            assert key == rec.key and rec.kind in self.sizes and rec.nbytes == self.sizes[rec.kind], \
                f"disk record {key!r} does not match its kind's size"
            total += self.charge(rec)
        assert total == self.bytes, "disk tier bytes do not match its records"
        assert self.bytes <= self.capacity, "disk tier over its budget"
        assert not (self.reading & self.staged), "a record both read and staged"
        assert self.staged <= set(self._index), "a staged record left the index"
        assert set(self._pending) <= set(self._index) and self._retried <= set(self._pending), "a queued write left the index"
        queued = sum(self.charge(self._index[k]) for k in self._pending)
        assert queued == self._pending_bytes and self.stats.disk_bytes == self.bytes - queued, "the bytes gauge is not what is on disk"
        assert self.stats.disk_records == len(self._index) + len(self._foreign) - len(self._pending)
        held = set(self._index) | set(self._foreign)
        assert set(self._ids) == held and set(self._keys) == set(self._ids.values()) == set(self._evictor)\
            and len(self._evictor) == len(held), "the eviction policy does not hold exactly the records"
