"""The disk tier's bytes: record files, the fingerprint, and the I/O worker thread (memory/disk_tier.py decides).

A directory (`--cache-disk DIR`, made 0700 if missing, its mode never changed; one writing engine at a time: an
flock on DIR/LOCK) holds
  FINGERPRINT        JSON: each fingerprint digest whose records the directory holds -> its fields (everything
                     that changes a record's bits: the model (config.json and the safetensors' names, sizes and
                     mtimes), dtype, layout, page geometry, the CPU kernels' instruction set, the LM head's
                     quantization, the device kind), null where only a header told the digest. Descriptive: the
                     headers count; rebuilt from them when missing.
  <kind>-<hash>-<digest[:16]>.rec  one record (mode 0600):
                       magic "DSDISK01" | u32 header length | u64 payload length | header (JSON: fingerprint
                       digest, kind, hash, parent, tokens, checkpoint kind, index, eviction value) |
                       sha256(header + payload) | payload
                     the payload is the pool's bytes as they are (CacheStore.record_views): no conversion. Its mtime
                     is when it was last written or read back: the policy's order at the next start-up.
Records of other fingerprints (another model on the same directory) are kept under the one budget: misses here.
Crash safety: a record is written to ".tmp-..." in the directory, fsynced, renamed over its final name (atomic)
and the directory fsynced; a process killed mid-write leaves a temp file, removed (with a log line) at the next
start. A record is only believed after its whole checksum, header included, matches at read time: a torn,
truncated or flipped record, a missing file, or another fingerprint is a miss with a log line, never bytes in the
pool. A write the disk has no room for evicts and is tried once more (memory/disk_tier.py); a directory this
process cannot write is served read-only; one it cannot read is refused (check_directory).

Threads: the engine's thread copies a spilled page out of the pool (sync, before the step that may overwrite it)
and hands the bytes to the worker; the worker writes, reads, verifies and deletes files, appends what it finished
to DiskTier.done and keeps the verified payloads in `staged` until the engine's thread copies them into the pool
pages the manager took for them (sync, before the step that reads them). A step never waits for a write.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time

from ..errors import ConfigError
from ..memory.disk_tier import CKPT, KV, DiskRecord, DiskTier, ForeignRecord
from ..memory.save_kind import SaveKind

log = logging.getLogger("deltaserve")

FORMAT = 1
MAGIC = b"DSDISK01"
_HEAD = struct.Struct("<IQ")  # header length, payload length
_PREFIX = len(MAGIC) + _HEAD.size
_DIGEST = 32  # sha256
_FULL = (errno.ENOSPC, errno.EDQUOT)  # a write that more room would let through
_REFUSED = (errno.EROFS, errno.EACCES, errno.EPERM)  # a write that no room would let through
WARN_EVERY_S = 30.0  # write failures are logged at most this often (with how many went unlogged)


class DiskTierError(RuntimeError):
    """A load whose bytes are not staged: the pool would hold garbage under a published hash. Ends the engine."""

    fatal = True


def model_digest(path: str) -> str:
    """config.json's bytes and every safetensors file's name, size and mtime: what identifies the weights without
    reading them."""
    h = hashlib.sha256()
    cfg = os.path.join(path, "config.json")
    if os.path.exists(cfg):
        with open(cfg, "rb") as f:
            h.update(f.read())
    for name in sorted(os.listdir(path)) if os.path.isdir(path) else ():
        if name.endswith(".safetensors"):
            st = os.stat(os.path.join(path, name))
            h.update(f"{name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()


def fingerprint(model_path: str, dtype: str, pool, layout: str, kernels: str, quantize_head: str,
                device: str, quantize: str = "none") -> dict:
    """Everything that changes a record's bits (module docstring): int4 at load (--quantize) changes every one. A
    quantized head is the embedding too where the model ties them (HybridModel.embed; before, the lookups read a
    bf16 table beside it): "quantize_head" names that, so records an engine made with the bf16 table are misses."""
    head = quantize_head if quantize_head == "none" else f"{quantize_head} (the embedding of a tied model)"
    return {"format": FORMAT, "model": model_digest(model_path), "dtype": dtype, "layout": layout,
            "block_size": pool.block_size, "page_bytes": pool.page_bytes, "group_size": pool.group_size,
            "pages_per_state": pool.pages_per_state, "kernels": kernels, "quantize_head": head,
            "quantize": quantize, "device": device}


def record_name(kind: str, h: bytes, fp_digest: str) -> str:
    """The fingerprint is in the name: two models' records of the same block hash (the same tokens) coexist."""
    return f"{kind}-{h.hex()}-{fp_digest[:16]}.rec"


def check_directory(directory: str) -> str:
    """The --cache-disk directory's absolute path, made (mode 0700) if missing. Refused (ConfigError naming it)
    only when it cannot be made or read: a directory that cannot be written is served read-only."""
    path = os.path.abspath(directory)
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--cache-disk {path} does not exist and cannot be made: {e.strerror or e}") from None
    try:
        os.listdir(path)
    except OSError as e:
        raise ConfigError(f"--cache-disk {path} cannot be read: {e.strerror or e}") from None
    return path


def _write_all(fd: int, data) -> None:
    """os.write until done (tests replace it to simulate a full disk)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def encode_header(rec: DiskRecord, fp_digest: str, value: float = 0.0) -> bytes:
    """value: the eviction policy's (--eviction value), read back at the next start-up."""
    return json.dumps({"fingerprint": fp_digest, "kind": rec.kind, "hash": rec.hash.hex(), "parent": rec.parent.hex(),
                       "tokens": list(rec.tokens), "ckpt_kind": rec.ckpt_kind, "index": rec.index, "value": value},
                      separators=(",", ":")).encode()


def decode_header(header: bytes, nbytes: int) -> tuple[str, DiskRecord, float]:
    """(fingerprint digest, record, value) from a header; raises ValueError on anything malformed."""
    d = json.loads(header)
    kinds = {KV: (None,), CKPT: tuple(k.value for k in SaveKind)}
    if d["kind"] not in kinds or d["ckpt_kind"] not in kinds[d["kind"]] or not all(isinstance(t, int)
                                                                                  for t in d["tokens"]):
        raise ValueError("malformed header")
    value = float(d.get("value", 0.0))  # an older record has none
    return d["fingerprint"], DiskRecord(d["kind"], bytes.fromhex(d["hash"]), bytes.fromhex(d["parent"]),
                                        tuple(d["tokens"]), nbytes, d["ckpt_kind"], int(d["index"])), value


class DiskStore:
    """One engine's disk tier: the directory, the worker thread, and the copies in and out of the CacheStore.

    writable false: a directory this process cannot write (read-only, or a disk full at start-up) or a tier that
    stopped writing (the disk stayed full, or writes are refused): the records found are still read and verified,
    nothing is written, deleted or touched."""

    def __init__(self, directory: str, capacity: int, memory, cache, fp: dict, eviction=None):
        self.dir = check_directory(directory)
        self.cache = cache
        self.fp = fp
        self.fp_digest = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()
        self.tier = DiskTier(capacity, cache.record_bytes(KV), cache.record_bytes(CKPT), eviction)
        self.staged: dict[tuple[str, bytes], memoryview] = {}  # verified payloads, the worker's until sync takes them
        self._retry: dict[tuple[str, bytes], tuple[bytes, float]] = {}  # writes a full disk failed: (payload, value)
        self._q: queue.Queue = queue.Queue()
        self._idle = threading.Event()
        self._tmp = 0
        self._stamped = 0  # the last mtime set (ns): strictly increasing, so a coarse clock never ties two uses
        self._closed = False
        self._warned = 0.0  # when the last write failure was logged (rate-limited), and how many were not since
        self._unlogged = 0
        self.why_not = ""  # why nothing is written (writable false)
        self.writable = True
        self._lock = None
        try:  # never changes the directory's mode: a directory made read-only is served read-only
            self._lock = os.open(os.path.join(self.dir, "LOCK"), os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            self._cannot_write(e)
        if self._lock is not None:
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(self._lock)
                raise ConfigError(f"--cache-disk {self.dir} is in use by another engine") from None
        found, digests = self._scan()
        self._check_fingerprint(digests)
        self.tier.adopt(found)
        if not self.writable:
            self.tier.stop_writing()
        memory.attach_disk(self.tier)
        self._worker = threading.Thread(target=self._run, name="deltaserve-disk-tier", daemon=True)
        self._worker.start()
        ours = len(self.tier)
        others = f", {self.tier.foreign} of other fingerprints" if self.tier.foreign else ""
        if self.writable:
            log.info("disk tier %s: %d records%s (%s bytes) of a %s-byte budget", self.dir, ours, others,
                     f"{self.tier.bytes:,}", f"{capacity:,}")
        else:
            log.warning("disk tier %s: cannot write (%s): serving its %d records%s read-only, writing nothing",
                        self.dir, self.why_not, ours, others)

    # ------------------------------------------------------------------ start-up
    def _cannot_write(self, e: OSError) -> None:
        self.writable = False
        self.why_not = e.strerror or str(e)

    def _check_fingerprint(self, digests: dict[str, int]) -> None:
        """FINGERPRINT maps the digest of each fingerprint whose records the directory holds to its fields (None
        where only a record's header told the digest): what a log line names when models differ. The records'
        headers are what counts; a missing or unreadable file is rebuilt from them, never a reason to delete."""
        path = os.path.join(self.dir, "FINGERPRINT")
        old = None
        try:
            with open(path) as f:
                old = json.load(f)
            if isinstance(old, dict) and "format" in old:  # one fingerprint's fields (an older directory)
                old = {hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest(): old}
            if not isinstance(old, dict):
                raise ValueError("not a JSON object")
        except FileNotFoundError:
            if sum(digests.values()):
                log.warning("disk tier %s: FINGERPRINT missing: rebuilt from the headers of its %d records",
                            self.dir, sum(digests.values()))
        except (OSError, ValueError) as e:
            log.warning("disk tier %s: FINGERPRINT unreadable (%s): rebuilt from the headers of its %d records",
                        self.dir, e, sum(digests.values()))
            old = None
        known = old or {}
        others = {d: n for d, n in digests.items() if d != self.fp_digest}
        if others:
            fields = set()
            for d in others:
                theirs = known.get(d)
                if isinstance(theirs, dict):
                    fields |= {k for k in set(theirs) | set(self.fp) if theirs.get(k) != self.fp.get(k)}
            log.warning("disk tier %s: fingerprint mismatch (%s differ): %d records of %d other fingerprints kept "
                        "(misses here; evicted by policy when the budget needs their room)", self.dir,
                        ", ".join(sorted(fields)) or "unknown fields", sum(others.values()), len(others))
        want = {d: known.get(d) for d in others}
        want[self.fp_digest] = self.fp
        if want == old or not self.writable:
            return
        data = json.dumps(want, sort_keys=True, indent=1).encode()
        tmp = os.path.join(self.dir, f".tmp-FINGERPRINT-{os.getpid()}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                _write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            _fsync_dir(self.dir)
        except OSError as e:  # a full disk, a read-only one: served without writing
            self._unlink(os.path.basename(tmp))
            self._cannot_write(e)

    def _scan(self) -> tuple[list, dict[str, int]]:
        """The records on disk, least recently written or read back first (file mtimes: a read-back sets it), each
        with the value its header keeps: this fingerprint's as DiskRecords, others' as ForeignRecords; and how many
        records each fingerprint digest has. Temp files of interrupted writes and unusable records are removed,
        each with a log line (left in place when the directory cannot be written)."""
        found, digests = [], {}
        for name in sorted(os.listdir(self.dir)):
            path = os.path.join(self.dir, name)
            if name.startswith(".tmp-"):
                if self.writable:
                    log.warning("disk tier %s: removed %s, left by a write that did not finish (a crash)", self.dir,
                                name)
                    self._unlink(name)
                continue
            if not name.endswith(".rec"):
                continue
            try:
                with open(path, "rb") as f:
                    head = f.read(_PREFIX)
                    if len(head) != _PREFIX or head[:len(MAGIC)] != MAGIC:
                        raise ValueError("not a record")
                    hlen, plen = _HEAD.unpack(head[len(MAGIC):])
                    digest, rec, value = decode_header(f.read(hlen), plen)
                    st = os.fstat(f.fileno())
                if st.st_size != _PREFIX + hlen + _DIGEST + plen:
                    raise ValueError("wrong size (truncated?)")
                if digest == self.fp_digest:
                    if plen != self.tier.sizes[rec.kind]:
                        raise ValueError("wrong size for its kind")
                    final = record_name(rec.kind, rec.hash, digest)
                    if name != final:
                        if name != f"{rec.kind}-{rec.hash.hex()}.rec" or not self.writable:
                            raise ValueError("wrong name")
                        os.replace(path, os.path.join(self.dir, final))  # an older directory's name: renamed
                        name = final
                else:
                    rec = ForeignRecord(name, plen)
            except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
                if self.writable:
                    log.warning("disk tier %s: discarding %s: %s", self.dir, name, e)
                    self._unlink(name)
                else:
                    log.warning("disk tier %s: skipping %s: %s", self.dir, name, e)
                continue
            digests[digest] = digests.get(digest, 0) + 1
            found.append((st.st_mtime_ns, name, rec, value))
        found.sort(key=lambda t: (t[0], t[1]))
        return [(rec, value) for _, _, rec, value in found], digests

    def _unlink(self, name: str) -> None:
        """Remove a file of the directory; one that is gone already, or that cannot be removed (a read-only
        directory), is left as it is."""
        try:
            os.unlink(os.path.join(self.dir, name))
        except FileNotFoundError:
            pass
        except OSError as e:
            log.debug("disk tier %s: cannot remove %s: %s", self.dir, name, e)

    # ------------------------------------------------------------------ the engine's thread
    def sync(self) -> None:
        """Carry out what the manager decided since the last call, before the step runs: copy spilled pages out
        (the step may overwrite them) and hand them to the worker with the reads and deletes, in order; then
        copy staged payloads into the pages taken for them (the step may read them)."""
        tier = self.tier
        tier.poll()  # the gauges follow the worker between lookups; a full disk's retries are queued now
        if self.writable and not tier.writable:
            self.writable = False
            log.warning("disk tier %s: stopped writing (%s): its %d records are still read", self.dir,
                        self.why_not or "writes fail", len(tier))
        ops, loads = tier.take()
        for op, arg in ops:
            if op == "write":
                self._q.put(("write", arg.record, (self.cache.read_record(arg.record.kind, arg.location), arg.value)))
            elif op == "rewrite":
                kept = self._retry.pop(arg.record.key, None)
                if kept is not None:
                    self._q.put(("write", arg.record, kept))
            elif op == "read":
                self._q.put(("read", arg, time.perf_counter()))
            else:  # its staged bytes stay until the loads below are done: a record loaded this step may be
                self._q.put(("delete", arg, None))  # deleted in it too (evicted from the disk right after)
        for ld in loads:
            data = self.staged.pop(ld.record.key, None)
            if data is None:
                raise DiskTierError(f"disk tier: no staged bytes for {ld.record.kind} {ld.record.hash.hex()[:16]}")
            self.cache.write_record(ld.record.kind, ld.location, data)
        for key in list(self.staged):  # a copy: the worker adds to it meanwhile
            if key not in tier.staged and key not in tier.reading:
                del self.staged[key]  # read for a record dropped since
        for key in list(self._retry):
            if not tier.pending(key):
                del self._retry[key]  # kept for a record dropped since

    def wait(self, timeout: float) -> None:
        """Block until the worker finishes something (or timeout): a step with nothing to run but reads."""
        self._idle.wait(timeout)
        self._idle.clear()

    def drain(self) -> None:
        """Wait until every queued op is done (tests; shutdown)."""
        self._q.join()

    def close(self) -> None:
        """Finish the queued writes and stop the worker (idempotent). The caller spills what it wants kept first."""
        if self._closed:
            return
        self._closed = True
        for _ in range(2):  # the second round: the writes a full disk asked to try once more
            self.sync()
            self._q.join()
        self._q.put(None)
        self._worker.join()
        if self._lock is not None:
            os.close(self._lock)

    # ------------------------------------------------------------------ the worker's thread
    def _run(self) -> None:
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                op, rec, arg = item
                if op == "write":
                    self._write(rec, arg)
                elif op == "read":
                    self._read(rec, arg)
                else:  # a record's key, or a foreign record's file name
                    self._unlink(rec if isinstance(rec, str) else record_name(*rec, self.fp_digest))
            except Exception as e:  # noqa: BLE001 - the worker must outlive any one record
                log.error("disk tier %s: %s failed: %s: %s", self.dir, item[0], type(e).__name__, e)
                if item[0] in ("write", "read"):
                    self.tier.done.append((item[0], item[1].key, False, 0.0, 0))
            finally:
                self._q.task_done()
                self._idle.set()

    def _write(self, rec: DiskRecord, item: tuple[bytes, float]) -> None:
        payload, value = item
        name = record_name(rec.kind, rec.hash, self.fp_digest)
        self._tmp += 1
        tmp = os.path.join(self.dir, f".tmp-{name}-{os.getpid()}-{self._tmp}")
        header = encode_header(rec, self.fp_digest, value)
        digest = hashlib.sha256(header + payload).digest()
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                _write_all(fd, MAGIC + _HEAD.pack(len(header), len(payload)) + header + digest)
                _write_all(fd, payload)
                os.utime(fd, ns=(self._stamp(),) * 2)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, os.path.join(self.dir, name))
            _fsync_dir(self.dir)
        except OSError as e:
            self._unlink(os.path.basename(tmp))
            if e.errno in _FULL:  # the tier evicts to make room and asks for it once more: its bytes are kept
                self._retry[rec.key] = item
                op, why = "write_full", "the disk is full"
            elif e.errno in _REFUSED:
                op, why = "write_refused", e.strerror or str(e)
            else:
                op, why = "write", str(e)
            self.why_not = why
            self._warn_write(name, why)
            self.tier.done.append((op, rec.key, False, 0.0, 0))
            return
        self.tier.done.append(("write", rec.key, True, 0.0, len(payload)))

    def _stamp(self) -> int:
        """A record's use time: now, and after every earlier one of this process (the file system's clock ticks
        in milliseconds)."""
        self._stamped = max(time.time_ns(), self._stamped + 1)
        return self._stamped

    def _warn_write(self, name: str, why: str) -> None:
        """One line per WARN_EVERY_S at most: a disk that fills fails every write."""
        now = time.monotonic()
        if self._warned and now - self._warned < WARN_EVERY_S:
            self._unlogged += 1
            return
        more = f" ({self._unlogged} more failed writes since the last line)" if self._unlogged else ""
        log.warning("disk tier %s: writing %s failed (%s): evicting by policy and trying once more, else the record "
                    "is dropped%s", self.dir, name, why, more)
        self._warned, self._unlogged = now, 0

    def _read(self, rec: DiskRecord, submitted: float) -> None:
        name = record_name(rec.kind, rec.hash, self.fp_digest)
        try:
            with open(os.path.join(self.dir, name), "rb") as f:
                data = bytearray(f.read())
            view = memoryview(data)
            if len(view) < _PREFIX or bytes(view[:len(MAGIC)]) != MAGIC:
                raise ValueError("not a record")
            hlen, plen = _HEAD.unpack(view[len(MAGIC):_PREFIX])
            if len(view) != _PREFIX + hlen + _DIGEST + plen or plen != rec.nbytes:
                raise ValueError(f"{len(view)} bytes, not the {_PREFIX + hlen + _DIGEST + rec.nbytes} of a whole "
                                 f"record (torn or truncated)")
            header = view[_PREFIX:_PREFIX + hlen]
            digest = bytes(view[_PREFIX + hlen:_PREFIX + hlen + _DIGEST])
            payload = view[_PREFIX + hlen + _DIGEST:]
            h = hashlib.sha256(header)
            h.update(payload)
            if h.digest() != digest:
                raise ValueError("checksum mismatch (corrupt)")
            fp, found, _ = decode_header(bytes(header), plen)
            if fp != self.fp_digest:
                raise ValueError("another fingerprint")
            if found != rec:
                raise ValueError("its header names another block")
        except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            log.warning("disk tier %s: record %s unusable (%s): a miss", self.dir, name, e)
            self._unlink(name)
            self.tier.done.append(("read", rec.key, False, 0.0, 0))
            return
        if self.writable:  # a read-back is a use: the next start-up orders the records by this time
            try:
                os.utime(os.path.join(self.dir, name), ns=(self._stamp(),) * 2)
            except OSError:
                pass
        self.staged[rec.key] = payload
        self.tier.done.append(("read", rec.key, True, time.perf_counter() - submitted, plen))
