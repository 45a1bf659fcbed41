"""The disk tier's bytes: record files, the fingerprint, and the I/O worker thread (memory/disk_tier.py decides).

A directory (`--cache-disk DIR`, mode 0700, one engine at a time: an flock on DIR/LOCK) holds
  FINGERPRINT        JSON of everything that changes a record's bits: the model (config.json and the
                     safetensors' names, sizes and mtimes), dtype, layout, page geometry, the CPU kernels'
                     instruction set, the LM head's quantization, the device kind. A different fingerprint at
                     start-up discards every record (a log line says which fields differ).
  <kind>-<hash>.rec  one record (mode 0600):
                       magic "DSDISK01" | u32 header length | u64 payload length | header (JSON: fingerprint
                       digest, kind, hash, parent, tokens, checkpoint kind) | sha256(header + payload) | payload
                     the payload is the pool's bytes as they are (CacheStore.record_views): no conversion.
Crash safety: a record is written to ".tmp-..." in the directory, fsynced, renamed over its final name (atomic)
and the directory fsynced; a process killed mid-write leaves a temp file, removed (with a log line) at the next
start. A record is only believed after its whole checksum, header included, matches at read time: a torn,
truncated or flipped record, a missing file, or another fingerprint is a miss with a log line, never bytes in the
pool. A write that fails (a full disk) drops its record: a miss later.

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
from ..memory.disk_tier import CKPT, KV, DiskRecord, DiskTier
from ..memory.save_kind import SaveKind

log = logging.getLogger("deltaserve")

FORMAT = 1
MAGIC = b"DSDISK01"
_HEAD = struct.Struct("<IQ")  # header length, payload length
_PREFIX = len(MAGIC) + _HEAD.size
_DIGEST = 32  # sha256


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
                device: str) -> dict:
    """Everything that changes a record's bits (module docstring)."""
    return {"format": FORMAT, "model": model_digest(model_path), "dtype": dtype, "layout": layout,
            "block_size": pool.block_size, "page_bytes": pool.page_bytes, "group_size": pool.group_size,
            "pages_per_state": pool.pages_per_state, "kernels": kernels, "quantize_head": quantize_head,
            "device": device}


def record_name(kind: str, h: bytes) -> str:
    return f"{kind}-{h.hex()}.rec"


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


def encode_header(rec: DiskRecord, fp_digest: str) -> bytes:
    return json.dumps({"fingerprint": fp_digest, "kind": rec.kind, "hash": rec.hash.hex(), "parent": rec.parent.hex(),
                       "tokens": list(rec.tokens), "ckpt_kind": rec.ckpt_kind, "index": rec.index},
                      separators=(",", ":")).encode()


def decode_header(header: bytes, nbytes: int) -> tuple[str, DiskRecord]:
    """(fingerprint digest, record) from a header; raises ValueError on anything malformed."""
    d = json.loads(header)
    kinds = {KV: (None,), CKPT: tuple(k.value for k in SaveKind)}
    if d["kind"] not in kinds or d["ckpt_kind"] not in kinds[d["kind"]] or not all(isinstance(t, int)
                                                                                  for t in d["tokens"]):
        raise ValueError("malformed header")
    return d["fingerprint"], DiskRecord(d["kind"], bytes.fromhex(d["hash"]), bytes.fromhex(d["parent"]),
                                        tuple(d["tokens"]), nbytes, d["ckpt_kind"], int(d["index"]))


class DiskStore:
    """One engine's disk tier: the directory, the worker thread, and the copies in and out of the CacheStore."""

    def __init__(self, directory: str, capacity: int, memory, cache, fp: dict, eviction=None):
        self.dir = os.path.abspath(directory)
        self.cache = cache
        self.fp = fp
        self.fp_digest = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()
        self.tier = DiskTier(capacity, cache.record_bytes(KV), cache.record_bytes(CKPT), eviction)
        self.staged: dict[tuple[str, bytes], memoryview] = {}  # verified payloads, the worker's until sync takes them
        self._q: queue.Queue = queue.Queue()
        self._idle = threading.Event()
        self._tmp = 0
        self._closed = False
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        os.chmod(self.dir, 0o700)
        self._lock = os.open(os.path.join(self.dir, "LOCK"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock)
            raise ConfigError(f"--cache-disk {self.dir} is in use by another engine") from None
        self._check_fingerprint()
        found = self._scan()
        self.tier.adopt(found)
        memory.attach_disk(self.tier)
        self._worker = threading.Thread(target=self._run, name="deltaserve-disk-tier", daemon=True)
        self._worker.start()
        log.info("disk tier %s: %d records (%s bytes) of a %s-byte budget", self.dir, len(self.tier),
                 f"{self.tier.bytes:,}", f"{capacity:,}")

    # ------------------------------------------------------------------ start-up
    def _records(self) -> list[str]:
        return [n for n in os.listdir(self.dir) if n.endswith(".rec")]

    def _check_fingerprint(self) -> None:
        path = os.path.join(self.dir, "FINGERPRINT")
        old = None
        if os.path.exists(path):
            try:
                with open(path) as f:
                    old = json.load(f)
            except (OSError, ValueError):
                old = {}
        if old != self.fp:
            names = self._records()
            if old is not None and names:
                differ = sorted(k for k in set(old) | set(self.fp) if old.get(k) != self.fp.get(k))
                log.warning("disk tier %s: fingerprint mismatch (%s differ): discarding its %d records", self.dir,
                            ", ".join(differ) or "unreadable", len(names))
            for n in names:
                self._unlink(n)
            data = json.dumps(self.fp, sort_keys=True, indent=1).encode()
            tmp = os.path.join(self.dir, f".tmp-FINGERPRINT-{os.getpid()}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                _write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            _fsync_dir(self.dir)

    def _scan(self) -> list[DiskRecord]:
        """The records on disk whose header is well formed and carries this fingerprint, oldest first; temp files
        of interrupted writes and unusable records are removed, each with a log line."""
        found = []
        for name in sorted(os.listdir(self.dir)):
            path = os.path.join(self.dir, name)
            if name.startswith(".tmp-"):
                log.warning("disk tier %s: removed %s, left by a write that did not finish (a crash)", self.dir, name)
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
                    digest, rec = decode_header(f.read(hlen), plen)
                size, mtime = os.path.getsize(path), os.path.getmtime(path)
                if digest != self.fp_digest:
                    raise ValueError("another fingerprint")
                if record_name(rec.kind, rec.hash) != name or plen != self.tier.sizes[rec.kind] \
                        or size != _PREFIX + hlen + _DIGEST + plen:
                    raise ValueError("wrong name or size (truncated?)")
            except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
                log.warning("disk tier %s: discarding %s: %s", self.dir, name, e)
                self._unlink(name)
                continue
            found.append((mtime, name, rec))
        return [rec for _, _, rec in sorted(found, key=lambda t: (t[0], t[1]))]

    def _unlink(self, name: str) -> None:
        try:
            os.unlink(os.path.join(self.dir, name))
        except FileNotFoundError:
            pass

    # ------------------------------------------------------------------ the engine's thread
    def sync(self) -> None:
        """Carry out what the manager decided since the last call, before the step runs: copy spilled pages out
        (the step may overwrite them) and hand them to the worker with the reads and deletes, in order; then
        copy staged payloads into the pages taken for them (the step may read them)."""
        tier = self.tier
        ops, loads = tier.take()
        for op, arg in ops:
            if op == "write":
                self._q.put(("write", arg.record, self.cache.read_record(arg.record.kind, arg.location)))
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
        self.sync()
        self._q.put(None)
        self._worker.join()
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
                else:
                    self._unlink(record_name(*rec))
            except Exception as e:  # noqa: BLE001 - the worker must outlive any one record
                log.error("disk tier %s: %s failed: %s: %s", self.dir, item[0], type(e).__name__, e)
                if item[0] in ("write", "read"):
                    self.tier.done.append((item[0], item[1].key, False, 0.0, 0))
            finally:
                self._q.task_done()
                self._idle.set()

    def _write(self, rec: DiskRecord, payload: bytes) -> None:
        name = record_name(rec.kind, rec.hash)
        self._tmp += 1
        tmp = os.path.join(self.dir, f".tmp-{name}-{os.getpid()}-{self._tmp}")
        header = encode_header(rec, self.fp_digest)
        digest = hashlib.sha256(header + payload).digest()
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                _write_all(fd, MAGIC + _HEAD.pack(len(header), len(payload)) + header + digest)
                _write_all(fd, payload)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, os.path.join(self.dir, name))
            _fsync_dir(self.dir)
        except OSError as e:
            self._unlink(os.path.basename(tmp))
            why = "the disk is full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else str(e)
            log.warning("disk tier %s: writing %s failed (%s): the record is dropped", self.dir, name, why)
            self.tier.done.append(("write", rec.key, False, 0.0, 0))
            return
        self.tier.done.append(("write", rec.key, True, 0.0, len(payload)))

    def _read(self, rec: DiskRecord, submitted: float) -> None:
        name = record_name(rec.kind, rec.hash)
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
            fp, found = decode_header(bytes(header), plen)
            if fp != self.fp_digest:
                raise ValueError("another fingerprint")
            if found != rec:
                raise ValueError("its header names another block")
        except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            log.warning("disk tier %s: record %s unusable (%s): a miss", self.dir, name, e)
            self._unlink(name)
            self.tier.done.append(("read", rec.key, False, 0.0, 0))
            return
        self.staged[rec.key] = payload
        self.tier.done.append(("read", rec.key, True, time.perf_counter() - submitted, plen))
