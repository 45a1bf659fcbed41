"""KV events for a KV-aware router (memory/events.py, server/kv_events.py; docs/cluster.md).

* The hybrid rule, against the memory manager's own cache: the real Scheduler and MemoryManager under the
  state-machine workload (preemption, eviction, salts, decode-path blocks, background recompute), with the
  manager recording its changes; after every step the view is checked against an oracle computed from the
  manager's cache itself, and the Stored / Removed stream replayed from scratch must equal the view.
* The wire contract: a real server's event stream, decoded with vLLM's msgspec definitions rewritten here from
  their published field lists (not imported from vLLM), frames and sequence numbers included.
* The server routes a router needs (/tokenize, /detokenize, the two render routes) and the fields it adds.
"""
from __future__ import annotations

import time

import msgspec
import pytest

from deltaserve.memory import MemoryManager
from deltaserve.memory.events import (BLOCK, BLOCK_GONE, CHECKPOINT, CHECKPOINT_GONE, CacheRecord, Removed,
                                      RouterView, Stored, event_id)
from deltaserve.memory.hashing import block_hash, root_hash


# ---------------------------------------------------------------------------------------------- the rule
def oracle(mem: MemoryManager, per_event: int) -> set[bytes]:
    """The event blocks (by their last page's hash) the rule admits, computed from the manager's cache: an
    announced chain of whole event blocks from the unsalted root, every page on the prefill path, a checkpoint
    at each event block's end."""
    cache = mem._cache
    kids: dict[bytes, list[bytes]] = {}
    for h, e in cache.items():
        kids.setdefault(e.parent, []).append(h)
    want: set[bytes] = set()
    # walk event block by event block from the root: (parent hash, pages so far in this event block)
    frontier = [(root_hash(None), [])]
    while frontier:
        parent, pages = frontier.pop()
        for h in kids.get(parent, ()):
            e = cache[h]
            if block_hash(e.parent, e.tokens) != h:
                continue  # a decode-path block: no prefill lookup finds it
            run = pages + [h]
            if len(run) < per_event:
                frontier.append((h, run))
            elif e.checkpoint is not None or mem.num_gdn_groups == 0:
                want.add(h)
                frontier.append((h, []))
    return want


class EventedManager(MemoryManager):
    """The real manager, recording events; every check_integrity() also checks the router's view."""

    per_event = 2

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.records = self.enable_events()
        self.view = RouterView(self.block_size, self.per_event * self.block_size,
                               checkpoints=self.num_gdn_groups > 0)
        self.replayed: set[int] = set()
        self.stored_seen = 0
        self.removed_seen = 0

    def check_integrity(self, deep: bool = True) -> None:
        super().check_integrity(deep)
        recs = []
        while self.records:
            recs.append(self.records.popleft())
        for ev in self.view.feed(recs):
            if isinstance(ev, Stored):
                assert ev.block_hash not in self.replayed, "announced twice"
                assert ev.parent_block_hash is None or ev.parent_block_hash in self.replayed, \
                    "announced under a parent the router does not hold"
                assert len(ev.token_ids) == self.per_event * self.block_size
                self.replayed.add(ev.block_hash)
                self.stored_seen += 1
            else:
                assert ev.block_hash in self.replayed, "retracted what was never announced"
                self.replayed.discard(ev.block_hash)
                self.removed_seen += 1
        self.view.check()
        assert self.replayed == self.view.announced()
        want = oracle(self, self.per_event)
        announced = self.view._announced
        assert want <= set(announced), "a prefix the replica can hit is not announced"
        for end, pages in announced.items():  # and nothing announced that the replica cannot hit now
            assert all(p in self._cache for p in pages), "announced after a page was evicted"
            assert self._cache[end].checkpoint is not None or self.num_gdn_groups == 0, \
                "announced after its checkpoint was evicted"


@pytest.mark.parametrize("layout", ["runs", "in-page", "per-block"])
def test_router_view_follows_the_cache(monkeypatch, layout):
    import tests.test_state_machine as sm

    made: list[EventedManager] = []

    def make(*a, **kw):
        m = EventedManager(*a, **kw)
        made.append(m)
        return m

    monkeypatch.setattr(sm, "MemoryManager", make)
    stored = removed = 0
    for seed in range(6):
        res = sm.run_workload(seed, layout)
        assert not res.errors, res.errors[:3]
        stored += made[-1].stored_seen
        removed += made[-1].removed_seen
    assert stored > 20 and removed > 5, (stored, removed)  # the workload exercised both directions


def test_router_view_rule_by_hand():
    """The rule's cases one at a time: page 4 tokens, event block 8 (two pages)."""
    root = root_hash(None)
    t = [tuple(range(k * 4, k * 4 + 4)) for k in range(6)]
    h0 = block_hash(root, t[0])
    h1 = block_hash(h0, t[1])
    h2 = block_hash(h1, t[2])
    h3 = block_hash(h2, t[3])
    v = RouterView(4, 8)
    blocks = [CacheRecord(BLOCK, h, p, tok, i) for i, (h, p, tok) in enumerate([(h0, root, t[0]), (h1, h0, t[1]),
                                                                                 (h2, h1, t[2]), (h3, h2, t[3])])]
    assert v.feed(blocks) == []  # K/V without a checkpoint: nothing a hybrid can hit
    assert v.feed([CacheRecord(CHECKPOINT, h3)]) == []  # its parent event block is not announced
    assert v.feed([CacheRecord(CHECKPOINT, h0)]) == []  # mid event block: not on the grid
    out = v.feed([CacheRecord(CHECKPOINT, h1)])  # announces [0, 8), then [8, 16) which waited for it
    assert out == [Stored(event_id(h1), None, t[0] + t[1]), Stored(event_id(h3), event_id(h1), t[2] + t[3])]
    assert v.feed([CacheRecord(CHECKPOINT_GONE, h3)]) == [Removed(event_id(h3))]
    assert v.feed([CacheRecord(CHECKPOINT, h3)]) == [Stored(event_id(h3), event_id(h1), t[2] + t[3])]
    assert v.feed([CacheRecord(BLOCK_GONE, h0)]) == [Removed(event_id(h1))]  # a page of it gone
    # [8, 16) stays announced: the router credits nothing past the hole, as a lookup here finds nothing
    v.check()
    assert v.feed([CacheRecord(BLOCK, h0, root, t[0], 0)]) == [Stored(event_id(h1), None, t[0] + t[1])]
    v.check()
    # a salted chain and a decode-path block are never announced
    s0 = block_hash(root_hash("salt"), t[0])
    s1 = block_hash(s0, t[1])
    d1 = block_hash(h0, t[4], decode=True)
    out = v.feed([CacheRecord(BLOCK, s0, root_hash("salt"), t[0], 0), CacheRecord(BLOCK, s1, s0, t[1], 1),
                  CacheRecord(CHECKPOINT, s1), CacheRecord(BLOCK, d1, h0, t[4], 1), CacheRecord(CHECKPOINT, d1)])
    assert out == []
    v.check()
    with pytest.raises(ValueError):
        RouterView(4, 6)


def test_no_events_unless_enabled():
    m = MemoryManager(16, 2, 4, 1)
    assert m.events is None
    m.admit("a")
    m.append_pages("a", 8)
    root = root_hash(None)
    k0 = block_hash(root, (1, 2, 3, 4))
    m.publish("a", [(k0, root, (1, 2, 3, 4))])
    with pytest.raises(RuntimeError):
        m.enable_events()  # the cache holds something: the records would not describe it


# ---------------------------------------------------------------------------------------------- the wire
# vLLM's event structs (vllm/distributed/kv_events.py), rewritten from their published field lists: the batch an
# array [ts, events, data_parallel_rank]; each event a msgspec Struct with tag=True (its class name under "type")
# and omit_defaults.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def test_encoding_decodes_with_vllm_structs():
    from deltaserve.server.kv_events import encode_batch, encode_event

    big = (1 << 64) - 1  # 64-bit ids need msgpack's uint64
    payload = encode_batch([encode_event(Stored(big, 7, (1, 2, 3)), 3), encode_event(Removed(9), 3)], ts=12.5)
    b = msgspec.msgpack.Decoder(KVEventBatch).decode(payload)
    assert b.ts == 12.5 and b.data_parallel_rank == 0
    s, r = b.events
    assert isinstance(s, BlockStored) and isinstance(r, BlockRemoved)
    assert (s.block_hashes, s.parent_block_hash, s.token_ids, s.block_size) == ([big], 7, [1, 2, 3], 3)
    assert (s.lora_id, s.medium, s.lora_name, s.group_idx, s.kv_cache_spec_kind) == (None, "GPU", None, 0,
                                                                                     "full_attention")
    assert (r.block_hashes, r.medium, r.group_idx) == ([9], "GPU", 0)
    # and the encoder vLLM uses writes the same bytes for the same batch
    again = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=12.5, events=[s, r], data_parallel_rank=0))
    assert again == payload


def test_kv_events_config():
    from deltaserve.server.kv_events import KVEventsConfig

    c = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "zmq", '
                                 '"endpoint": "tcp://127.0.0.1:5557", "topic": ""}')
    assert c.enabled and c.endpoint == "tcp://127.0.0.1:5557"
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": false, "publisher": "zmq"}').enabled
    for bad in ('{"enable_kv_cache_events": true, "publisher": "kafka"}', '{"endpoint": "http://x"}',
                '{"nope": 1}', '[1]', '{', '{"hwm": 0}'):
        with pytest.raises(ValueError):
            KVEventsConfig.from_json(bad)


def recv_batches(sub, decoder, until, timeout=30.0):
    """(seq, batch) frames from a SUB socket until until(batches) holds (bounded)."""
    import zmq

    got = []
    deadline = time.time() + timeout
    while time.time() < deadline and not until(got):
        if sub.poll(200, zmq.POLLIN):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"" and len(seq) == 8
            got.append((int.from_bytes(seq, "big"), decoder.decode(payload)))
    return got


@pytest.fixture(scope="module")
def evented_server():
    from tests.server_support import RealServer

    # a 16 MB pool's default resume-point bound (an eighth: two of the embedded default's checkpoints) would leave
    # no grid to announce; the contract is about the events, so the grid gets its count back
    srv = RealServer("--kv-cache-memory", "16M", "--resume-point-bytes", "64M", "--max-num-seqs", "4", kv_events=True)
    yield srv
    srv.stop()


def session_messages(n_words: int, tag: str) -> list[dict]:
    words = " ".join(f"{tag}{i}" for i in range(n_words))
    return [{"role": "system", "content": "You are a careful assistant. " + words},
            {"role": "user", "content": f"Tell me about {tag}."}]


def test_server_event_stream_contract(evented_server):
    """A chat request's prompt, announced block by block at the checkpoint grid: decoded with vLLM's structs,
    frames [topic, 8-byte seq, payload], seq from 0 without gaps, the token ids the prompt's own (/tokenize),
    chained by parent ids."""
    import httpx
    import zmq

    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(f"tcp://127.0.0.1:{evented_server.events_port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        time.sleep(0.5)  # the subscription reaches the PUB socket (ZMQ's slow joiner)
        base = evented_server.base
        msgs = session_messages(120, "contract")
        ids = httpx.post(base + "/tokenize", json={"messages": msgs}, timeout=60).json()["tokens"]
        assert len(ids) >= 256
        r = httpx.post(base + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 4, "temperature": 0},
                       timeout=120)
        assert r.status_code == 200, r.text
        grid = 128
        want = len(ids) // grid
        stored: list = []

        def enough(got):
            stored[:] = [e for _, b in got for e in b.events if isinstance(e, BlockStored)]
            return len(stored) >= want

        got = recv_batches(sub, msgspec.msgpack.Decoder(KVEventBatch), enough)
        assert len(stored) >= want, f"{len(stored)} blocks announced, {want} expected"
        seqs = [s for s, _ in got]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        parent = None
        for k, e in enumerate(stored[:want]):
            assert e.block_size == grid and e.group_idx == 0 and e.medium == "GPU"
            assert e.token_ids == ids[k * grid:(k + 1) * grid], f"event block {k} holds other tokens"
            assert len(e.block_hashes) == 1 and e.parent_block_hash == parent
            parent = e.block_hashes[0]
    finally:
        sub.close(linger=0)


def test_render_and_tokenize_routes(evented_server):
    import httpx

    base = evented_server.base
    msgs = session_messages(10, "route")
    chat = httpx.post(base + "/tokenize", json={"model": None, "messages": msgs}).json()
    assert chat["count"] == len(chat["tokens"]) and chat["max_model_len"] > 0 and chat["token_strs"] is None
    # what vllm-router sends: the request plus its defaults
    routed = {"messages": msgs, "stream": False, "max_tokens": 5, "logprobs": False, "no_stop_trim": False,
              "ignore_eos": False, "continue_final_message": False, "skip_special_tokens": True,
              "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False,
              "include_reasoning": True}
    r = httpx.post(base + "/v1/chat/completions/render", json=routed)
    assert r.status_code == 200, r.text
    assert r.json()["token_ids"] == chat["tokens"]
    text = httpx.post(base + "/tokenize", json={"prompt": "hello world"}).json()
    assert httpx.post(base + "/detokenize", json={"tokens": text["tokens"]}).json() == {"prompt": "hello world"}
    routed_c = {"echo": False, "no_stop_trim": False, "skip_special_tokens": True, "return_hidden_states": False}
    comp = httpx.post(base + "/v1/completions/render", json={"prompt": ["hello world", "hi"], **routed_c})
    assert comp.status_code == 200, comp.text
    hi = httpx.post(base + "/tokenize", json={"prompt": "hi"}).json()["tokens"]
    assert [g["token_ids"] for g in comp.json()] == [text["tokens"], hi]
    ids = httpx.post(base + "/v1/completions/render", json={"prompt": [1, 2, 3], **routed_c}).json()
    assert [g["token_ids"] for g in ids] == [[1, 2, 3]]
    r = httpx.post(base + "/v1/chat/completions", json=routed)
    assert r.status_code == 200, r.text
    # the same fields at values this server does not behave as: refused, naming the field
    for field, value in [("separate_reasoning", False), ("stream_reasoning", False), ("include_reasoning", False),
                         ("continue_final_message", True), ("return_hidden_states", True)]:
        r = httpx.post(base + "/v1/chat/completions", json={**routed, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
    r = httpx.post(base + "/v1/chat/completions", json={**routed, "no_such_field": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_field"
    bad = httpx.post(base + "/detokenize", json={"tokens": [10 ** 9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = httpx.post(base + "/tokenize", json={"prompt": "x", "messages": msgs})
    assert both.status_code == 400


def test_no_stop_trim_keeps_the_stop_string(evented_server):
    import httpx

    base = evented_server.base
    body = {"prompt": "count: 1 2 3 4 5 6 7 8 9", "max_tokens": 24, "temperature": 0}
    free = httpx.post(base + "/v1/completions", json=body).json()["choices"][0]["text"]
    if len(free) < 3:
        pytest.skip("the tiny model wrote too little text to cut")
    stop = free[1:3]
    cut = httpx.post(base + "/v1/completions", json={**body, "stop": [stop]}).json()["choices"][0]["text"]
    kept = httpx.post(base + "/v1/completions", json={**body, "stop": [stop], "no_stop_trim": True}).json()
    assert kept["choices"][0]["text"] == cut + stop


def test_router_metrics(evented_server):
    import httpx

    text = httpx.get(evented_server.base + "/metrics").text
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:request_success_total"):
        assert name in text, name
    info = [ln for ln in text.splitlines() if ln.startswith("vllm:cache_config_info{")]
    assert info and 'block_size="64"' in info[0] and 'num_gpu_blocks="' in info[0], info


def test_serve_refuses_events_it_cannot_publish(capsys):
    from deltaserve.server.cli import main
    from tests.server_support import free_port

    ep = f"tcp://127.0.0.1:{free_port()}"
    for extra, says in [(["--kv-events-endpoint", ep, "--checkpoint-grid", "0"], "--checkpoint-grid"),
                        (["--kv-events-endpoint", ep, "--no-enable-prefix-caching"], "prefix-caching"),
                        (["--kv-events-endpoint", "http://127.0.0.1:1"], "tcp://"),
                        (["--kv-events-endpoint", ep, "--kv-events-config", "{}"], "not both"),
                        (["--kv-events-config", '{"publisher": "zmq", "bogus": 1}'], "bogus")]:
        assert main(["--port", "1", *extra]) == 2, extra
        assert says in capsys.readouterr().err, extra


def test_simulated_kv_aware_router_sends_each_turn_to_its_prefix():
    """deltaserve simulate's kv-aware router: two sessions start together (no credit anywhere: least loaded
    splits them), and each next turn goes where its first turn's prefix is announced, where least-loaded sends
    both to the idle replica 0 and hits on one of them only."""
    import tempfile

    from deltaserve.sim import ClusterConfig, ReplicaConfig, Simulation, load_bundle
    from deltaserve.sim.trace import TraceRequest
    from tests.test_sim import synthetic_bundle

    bundle = load_bundle(synthetic_bundle(tempfile.mkdtemp(prefix="ds-kv-sim-")))
    first = {s: [1000 * (s + 1) + k % 500 for k in range(700)] for s in (0, 1)}
    trace = [TraceRequest(f"s{s}t1", 0.0, 8, prompt_token_ids=first[s], session_id=f"s{s}") for s in (0, 1)]
    # the next turns one at a time, on idle replicas: least-loaded sends both to replica 0
    trace += [TraceRequest(f"s{s}t2", 100.0 * (2 - s), 8, prompt_token_ids=first[s] + [11] * 8 + [7] * 40,
                           session_id=f"s{s}") for s in (0, 1)]

    def run(router):
        flags = {"kv_cache_memory": 64 << 20, "max_num_seqs": 4}
        sim = Simulation(ClusterConfig([ReplicaConfig.from_dict(flags) for _ in range(2)], router, bundle.path),
                         bundle)
        return {r.request_id: (r.replica, r.cached_tokens) for r in sim.run(trace)}

    kv = run("kv-aware")
    assert kv["s0t1"][0] != kv["s1t1"][0]
    for s in (0, 1):
        assert kv[f"s{s}t2"][0] == kv[f"s{s}t1"][0] and kv[f"s{s}t2"][1] >= 640, kv
    ll = run("least-loaded")
    assert ll["s0t2"][0] == ll["s1t2"][0] == 0 and ll["s1t2"][1] == 0 and ll["s0t2"][1] >= 640, ll
    with pytest.raises(ValueError):
        run({"policy": "kv-aware", "bogus": 1})
