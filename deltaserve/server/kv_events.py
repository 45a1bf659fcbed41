"""KV events for a KV-aware router (vllm-router's kv_aware policy): vLLM's wire format on a ZMQ PUB socket.

    deltaserve serve --kv-events-endpoint tcp://*:5557
    deltaserve serve --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}'

The memory manager records each change of its prefix cache into a deque (memory/events.py); a thread of this
module drains it every `interval` seconds, turns it into announced / retracted event blocks (RouterView: the
hybrid rule, at the checkpoint grid) and publishes them. So the engine's thread only appends small tuples,
and nothing runs when no endpoint is configured.

Wire format (vLLM's vllm/distributed/kv_events.py, as its ZmqEventPublisher sends it; docs/cluster.md):
  frames   [topic (utf-8), seq (8-byte big-endian, from 0), payload]
  payload  msgpack of the batch as an array [ts (float seconds), events, data_parallel_rank]
  events   tagged maps (msgspec tag=True: the class name under "type"; fields equal to their default left out):
           {"type": "BlockStored", "block_hashes": [id], "parent_block_hash": id | None, "token_ids": [...],
            "block_size": N, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0,
            "kv_cache_spec_kind": "full_attention"}
           {"type": "BlockRemoved", "block_hashes": [id], "medium": "GPU", "group_idx": 0}
           {"type": "AllBlocksCleared"}
"medium" is vLLM's name for the engine's own pool (the router's device tier), whatever the device; "DISK" for the
prefix cache's disk tier (--cache-disk), announced by a second RouterView under the same rule. An optional
replay socket (ZMQ ROUTER, `replay_endpoint`) answers [client, "", start seq] with every buffered batch from
that seq on, then seq -1 and an empty payload, as vLLM's does.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, fields

from ..memory.events import DISK, POOL, Removed, RouterView, Stored

log = logging.getLogger("deltaserve.server")

MEDIUM = POOL  # vLLM's word for the engine's own KV pool
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig fields (its --kv-events-config JSON); unknown keys are errors."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq" or "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # accepted for vLLM's schema; records queue in the manager's deque
    topic: str = ""

    @classmethod
    def from_json(cls, text: str) -> "KVEventsConfig":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--kv-events-config is not JSON: {e}") from None
        if not isinstance(d, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ValueError(f"--kv-events-config: unknown field(s) {', '.join(unknown)} (known: {', '.join(known)})")
        cfg = cls(**d)
        cfg.check()
        return cfg

    @classmethod
    def for_endpoint(cls, endpoint: str) -> "KVEventsConfig":
        cfg = cls(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint)
        cfg.check()
        return cfg

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def check(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError("--kv-events-config: enable_kv_cache_events must be true or false")
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: publisher must be 'zmq' or 'null', not {self.publisher!r}")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"--kv-events-config: {name} must be a string")
        if self.replay_endpoint is not None and not isinstance(self.replay_endpoint, str):
            raise ValueError("--kv-events-config: replay_endpoint must be a string or null")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"--kv-events-config: {name} must be an integer >= 1")
        for ep in (self.endpoint, self.replay_endpoint):
            if ep is not None and not ep.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"KV events endpoint {ep!r}: use tcp://HOST:PORT (tcp://*:PORT binds every "
                                 "interface), ipc://PATH or inproc://NAME")


def event_block_size(engine) -> int:
    """The event block: the checkpoint grid, rounded up to the page as the scheduler rounds it (docs/cluster.md).
    Refused where no grid is taken or nothing is cached: the router would have nothing it could credit."""
    cfg = engine.config
    if not cfg.enable_prefix_caching:
        raise ValueError("KV events need prefix caching (--enable-prefix-caching)")
    if cfg.checkpoint_grid <= 0:
        raise ValueError("KV events are announced at the checkpoint grid: give --checkpoint-grid N > 0")
    bs = engine.block_size
    return -(-cfg.checkpoint_grid // bs) * bs


def encode_event(ev: Stored | Removed, block_size: int, medium: str = MEDIUM) -> dict:
    if isinstance(ev, Stored):
        return {"type": "BlockStored", "block_hashes": [ev.block_hash], "parent_block_hash": ev.parent_block_hash,
                "token_ids": list(ev.token_ids), "block_size": block_size, "lora_id": None, "medium": medium,
                "lora_name": None, "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    return {"type": "BlockRemoved", "block_hashes": [ev.block_hash], "medium": medium, "group_idx": 0}


def encode_batch(events: list[dict], ts: float | None = None, dp_rank: int = 0) -> bytes:
    import msgpack  # the cluster extra: only a server with KV events needs it

    return msgpack.packb([time.time() if ts is None else ts, events, dp_rank], use_bin_type=True)


class KVEventPublisher:
    """Binds (or connects) the sockets at construction, so a bad endpoint fails `deltaserve serve` at start;
    attach() starts the thread once the engine exists; close() stops it."""

    def __init__(self, config: KVEventsConfig, interval: float = 0.02):
        try:
            import msgpack  # noqa: F401 - encode_batch's, checked here so a missing one fails at start
            import zmq
        except ImportError as e:
            raise ValueError(f"KV events need pyzmq and msgpack ({e}): pip install 'deltaserve[cluster]'") from None

        self.config = config
        self.interval = interval
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        try:
            self._open(self._pub, config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self.close()
            raise ValueError(f"cannot open the KV events socket {config.endpoint!r}: {e}") from None
        self._topic = config.topic.encode("utf-8")
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.records = None
        self.view: RouterView | None = None

    @staticmethod
    def _open(sock, endpoint: str) -> None:
        # vLLM's rule: a wildcard host or a local transport binds, anything else connects
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")) \
                or endpoint.startswith("tcp://127.") or endpoint.startswith("tcp://localhost"):
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)

    def attach(self, records: deque, view: RouterView) -> None:
        """Start publishing what the manager records into `records` (MemoryManager.enable_events())."""
        assert self._thread is None, "attached twice"
        self.records, self.view = records, view
        self.disk_view = RouterView(view.block_size, view.event_block_size, view.checkpoints, medium=DISK)
        self._thread = threading.Thread(target=self._run, name="deltaserve-kv-events", daemon=True)
        self._thread.start()
        log.info("KV events on %s (event block %d tokens)", self.config.endpoint, view.event_block_size)

    def flush(self) -> int:
        """Drain the records and publish one batch of what they changed; returns the number of events sent."""
        out: list = []
        recs = self.records
        while recs:
            out.append(recs.popleft())
        if not out:
            return 0
        events = [encode_event(e, v.event_block_size, v.medium) for v in (self.view, self.disk_view)
                  for e in v.feed(out)]
        if not events:
            return 0
        payload = encode_batch(events)
        seq = self._seq
        self._seq += 1
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        return len(events)

    def _serve_replay(self) -> None:
        import zmq  # the cluster extra, as above

        while self._replay.poll(0):
            frames = self._replay.recv_multipart(zmq.NOBLOCK)
            if len(frames) != 3:
                log.warning("KV events replay: a request of %d frames, not [id, '', seq]", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", END_SEQ, b""))

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.flush()
                if self._replay is not None:
                    self._serve_replay()
            except Exception:  # noqa: BLE001 - the events must never take the server down
                log.exception("KV events publisher error")
            self._stop.wait(self.interval)
        try:
            self.flush()
        except Exception:  # noqa: BLE001
            pass

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=0)
