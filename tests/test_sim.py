"""The simulator: traces, the latency model, routers, and the discrete-event loop over the engine's own
scheduler and memory manager. Torch-free except where a test compares with the real engine's arithmetic."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from deltaserve.config import ModelConfig
from deltaserve.presets import load_preset
from deltaserve.scheduler import Scheduler
from deltaserve.scheduler.build import build_scheduler, resolve_shape
from deltaserve.sim import (AgentTraceSpec, ClusterConfig, ReplicaConfig, Simulation, agent_trace, load_bundle,
                            materialize, read_trace, summarize, write_trace)
from deltaserve.sim.bundle import FORMAT, save_meta, write_table
from deltaserve.sim.latency import Interp1D, Interp2D, LatencyModel, SpeedTrace, StepShape
from deltaserve.sim.report import percentile, read_csv
from deltaserve.sim.trace import TraceRequest, mooncake_like

MiB = 1 << 20


def synthetic_bundle(path: str, preset: str = "tiny", step_fixed_us: float = 1000.0) -> str:
    """A hand-written bundle: dense 10 us/token/layer-kind, GDN and attention linear in their keys."""
    os.makedirs(path, exist_ok=True)
    cfg = load_preset(preset)
    mc = ModelConfig.from_hf(cfg)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    toks = [1, 16, 64, 256, 1024, 4096]
    dense = [{"kernel": "mlp", "tokens": t, "time_us": 5 + 0.5 * t, "p10_us": "", "p90_us": "", "layers": 8}
             for t in toks]
    dense += [{"kernel": "lm_head", "tokens": r, "time_us": 50 + 20 * r, "p10_us": "", "p90_us": "", "layers": 1}
              for r in (1, 8, 64)]
    la = [{"kernel": "gdn_prefill", "regime": "prefill", "prefill_tokens": t, "n_decode": 0, "time_us": 20 + 0.3 * t,
           "p10_us": "", "p90_us": "", "layers": 6} for t in toks]
    la += [{"kernel": "gdn_decode", "regime": "decode", "prefill_tokens": 0, "n_decode": d, "time_us": 30 + 5 * d,
            "p10_us": "", "p90_us": "", "layers": 6} for d in (1, 8, 64)]
    attn = [{"kernel": "attn_prefill", "query_tokens": q, "context_len": q + p, "time_us": 10 + 0.01 * q * (q + p) / 64,
             "p10_us": "", "p90_us": "", "layers": 2} for q in (1, 64, 512, 2048) for p in (0, 1024, 8192)]
    attn += [{"kernel": "attn_decode", "query_tokens": 1, "context_len": c, "time_us": 20 + 0.05 * c, "p10_us": "",
              "p90_us": "", "layers": 2} for c in (16, 1024, 16384)]
    copies = [{"op": op, "count": n, "time_us": 10 * n, "p10_us": "", "p90_us": ""}
              for op in ("zero_pages", "zero_slots", "restore", "save") for n in (1, 16)]
    write_table(path, "dense.csv", dense)
    write_table(path, "linear_attention.csv", la)
    write_table(path, "attention.csv", attn)
    write_table(path, "copies.csv", copies)
    write_table(path, "overhead.csv", [{"component": "scheduler", "n_seqs": n, "tokens": n, "time_us": 20 + 2 * n,
                                         "p10_us": "", "p90_us": ""} for n in (1, 64)])
    save_meta(path, {"format": FORMAT, "model": {"name": preset, "model_type": mc.model_type},
                     "layers": {"gdn": len(mc.gdn_layers), "attention": len(mc.attn_layers), "total": 8},
                     "hardware": {"device": "cpu", "torch_threads": 1}, "dtypes": {"model": "bfloat16"},
                     "engine_resolved": {"per_tp": {1: {"block_size": 128}}},
                     "calibration": {"fixed_us": step_fixed_us, "per_seq_us": 10.0, "wall_per_cpu": 1.0}})
    return path


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return load_bundle(synthetic_bundle(str(tmp_path_factory.mktemp("bundle"))))


def cluster(bundle, n=1, router="round-robin", **flags) -> ClusterConfig:
    flags = {"max_num_seqs": 8, "max_num_batched_tokens": 512, "kv_cache_memory": 64 * MiB, **flags}
    return ClusterConfig([ReplicaConfig.from_dict(flags) for _ in range(n)], router, bundle.path)


def small_trace(n_sessions=6, rate=2.0, seed=0):
    return agent_trace(AgentTraceSpec(num_sessions=n_sessions, session_rate=rate, turns=(2, 3), system_tokens=300,
                                      first_user_tokens=(20, 60), new_tokens=(10, 40), output_tokens=(4, 12),
                                      think_time=0.5, seed=seed))


# ------------------------------------------------------------------------------------------------ the builder
def test_builder_matches_the_engine_arithmetic():
    mc = ModelConfig.from_hf(load_preset("tiny"))
    shape = resolve_shape(mc, dtype="bfloat16", kv_cache_memory=64 * MiB, max_num_seqs=8, cache_layout="in-page")
    assert shape.block_size == 128  # bf16 tiny: 68,608-byte GDN state over 1,024 B/token/layer at alignment 64
    assert resolve_shape(mc, dtype="float32", kv_cache_memory=64 * MiB, max_num_seqs=8,
                         cache_layout="in-page").block_size == 64
    runs = resolve_shape(mc, dtype="bfloat16", kv_cache_memory=64 * MiB, max_num_seqs=8)  # the default layout
    assert (runs.block_size, runs.pool.pages_per_state, runs.pool.layout.name) == (64, 2, "runs")
    mem, sch = build_scheduler(shape, max_num_seqs=8, max_num_batched_tokens=512)
    assert isinstance(sch, Scheduler) and mem.caching and mem.num_pages == shape.pool.num_pages
    assert shape.max_model_len == mem.max_request_tokens() < shape.pool.pool_tokens  # checkpoint pages held back


def test_builder_agrees_with_a_real_engine():
    from tests.util import make_llm

    eng = make_llm(kv_cache_memory=64 * MiB, max_num_seqs=8, max_num_batched_tokens=512).engine
    shape = resolve_shape(eng.model_config, dtype=eng.dtype, block_size=eng.config.block_size,
                          kv_cache_memory=64 * MiB, max_num_seqs=8)
    assert (shape.block_size, shape.pool, shape.max_model_len) == (eng.block_size, eng.pool, eng.max_model_len)


# ------------------------------------------------------------------------------------------------ traces
def test_trace_round_trip_and_mooncake(tmp_path):
    tr = small_trace()
    p = tmp_path / "t.jsonl"
    write_trace(str(p), tr)
    back = read_trace(str(p))
    assert [(r.request_id, r.prompt_token_ids, r.output_length) for r in back] == \
        [(r.request_id, r.prompt_token_ids, r.output_length) for r in tr]
    assert back[0].arrival_time == 0.0
    mc = tmp_path / "mc.jsonl"
    with open(mc, "w") as f:
        f.write(json.dumps({"timestamp": 1000, "input_length": 1100, "output_length": 5, "hash_ids": [7, 8, 9]}) + "\n")
        f.write(json.dumps({"timestamp": 3500, "input_length": 700, "output_length": 3, "hash_ids": [7, 5]}) + "\n")
    reqs = materialize(read_trace(str(mc)), vocab=4000)
    assert [r.arrival_time for r in reqs] == [0.0, 2.5]
    a, b = reqs[0].prompt_token_ids, reqs[1].prompt_token_ids
    assert len(a) == 1100 and len(b) == 700
    assert a[:512] == b[:512] and a[512:700] != b[512:700]  # hash id 7 is the same block in both
    assert all(10 <= t < 4000 for t in a + b)
    lines = list(mooncake_like(20, rate=5.0, seed=1))
    assert len(lines) == 20 and all(set(d) == {"timestamp", "input_length", "output_length", "hash_ids"} for d in lines)


def test_agent_sessions_resend_the_conversation():
    tr = small_trace(n_sessions=3)
    by_s: dict[str, list[TraceRequest]] = {}
    for r in tr:
        by_s.setdefault(r.session_id, []).append(r)
    system = tr[0].prompt_token_ids[:300]
    for turns in by_s.values():
        turns.sort(key=lambda r: r.arrival_time)
        assert all(t.prompt_token_ids[:300] == system for t in turns)
        for prev, nxt in zip(turns, turns[1:]):
            assert nxt.prompt_token_ids[:len(prev.prompt_token_ids)] == prev.prompt_token_ids
            assert nxt.arrival_time > prev.arrival_time


def test_agent_turns_keep_the_minimum_gap():
    spec = AgentTraceSpec(num_sessions=20, turns=(3, 5), think_time=1.0, seed=5)
    gaps = lambda tr: [b.arrival_time - a.arrival_time for a, b in zip(tr, tr[1:])  # noqa: E731
                       if a.session_id == b.session_id]
    by_session = lambda tr: sorted(tr, key=lambda r: (r.session_id, r.arrival_time))  # noqa: E731
    assert min(gaps(by_session(agent_trace(spec)))) < 0.5  # exponential think times: some nearly coincide
    from dataclasses import replace
    assert min(gaps(by_session(agent_trace(replace(spec, min_gap=0.5))))) >= 0.5 - 1e-9


# ------------------------------------------------------------------------------------------------ latency model
def test_interpolation():
    f = Interp1D([(1, 10), (10, 100), (100, 1000)])
    assert f(1) == 10 and f(55) == pytest.approx(550) and f(200) == pytest.approx(2000) and f(0) >= 0
    g = Interp2D([(1, 1, 1.0), (1, 100, 2.0), (10, 10, 10.0), (10, 100, 20.0)])
    assert g(1, 50) == pytest.approx(1.0 + 49 / 99)
    assert g(10, 55) == pytest.approx(15.0)


def test_step_time_grows_with_the_work(bundle):
    lm = LatencyModel(bundle)
    small = lm.shape_us(StepShape([(64, 0)], [], 1))
    big = lm.shape_us(StepShape([(512, 0)], [], 1))
    dec = lm.shape_us(StepShape([], [100] * 4, 4))
    dec8 = lm.shape_us(StepShape([], [100] * 8, 8))
    long_ctx = lm.shape_us(StepShape([], [10000] * 4, 4))
    assert small < big and dec < dec8 and dec < long_ctx
    assert lm.shape_us(StepShape([], [], 0)) == 0.0
    assert lm.shape_us(StepShape([(64, 0)], [], 1)) >= 1000.0  # the calibrated fixed overhead is charged
    slow = LatencyModel(bundle, wall_per_cpu=2.0)
    assert slow.shape_us(StepShape([(64, 0)], [], 1)) == pytest.approx(2 * small)



def test_speed_trace_follows_a_drift_and_not_one_slow_step():
    """Probe samples (t, measured, predicted): ratio 1 before t=10, 2 after, one outlier step at t=5."""
    samples = [(t, 100.0 * (2.0 if t >= 10 else 1.0), 100.0) for t in range(20)]
    samples[5] = (5, 300.0, 100.0)
    tr = SpeedTrace(samples, window=4)
    assert tr(0) == pytest.approx(1.0) and tr(19) == pytest.approx(2.0) and tr(-5) == tr(0) and tr(99) == tr(19)
    assert tr(5) == pytest.approx(1.4)  # the outlier is pooled with its four neighbours: 700 / 500
    assert tr.mean == pytest.approx((900 + 300 + 2000) / 2000)
    assert tr(12.4) == tr(12) and tr(12.6) == tr(13)  # the nearest sample's factor
    assert SpeedTrace(samples, window=1000)(0) == pytest.approx(tr.mean)  # a window over all: the mean
    with pytest.raises(ValueError):
        SpeedTrace([])


def test_a_speed_trace_slows_the_steps_it_covers(bundle):
    """LatencyModel(speed=...): a step starting at t costs speed(t) x the CPU-time model."""
    s = StepShape([(64, 0)], [], 1)
    plain = LatencyModel(bundle, wall_per_cpu=1.0).shape_us(s)
    lm = LatencyModel(bundle, speed=SpeedTrace([(0.0, 1.0, 1.0), (1.0, 1.0, 1.0), (5.0, 3.0, 1.0), (6.0, 3.0, 1.0)],
                                               window=1))
    assert lm.shape_us(s, 0.0) == pytest.approx(plain) and lm.shape_us(s, 6.0) == pytest.approx(3 * plain)
    d = StepShape([], [100] * 4, 4)  # decode-only steps take decode_speed where one is given
    two = LatencyModel(bundle, speed=SpeedTrace([(0.0, 1.0, 1.0)]), decode_speed=SpeedTrace([(0.0, 2.0, 1.0)]))
    assert two.shape_us(d) == pytest.approx(2 * LatencyModel(bundle, wall_per_cpu=1.0).shape_us(d))
    assert two.shape_us(s) == pytest.approx(plain)
    tr = materialize(small_trace())
    fast = summarize(Simulation(cluster(bundle)).run(tr))
    sim = Simulation(cluster(bundle))
    sim.replicas[0].latency = LatencyModel(bundle, speed=SpeedTrace([(0.0, 3.0, 1.0)], window=1))
    assert summarize(sim.run(materialize(small_trace())))["e2e"]["mean"] > 2 * fast["e2e"]["mean"]


def test_step_speed_reads_the_step_kinds_apart(bundle):
    """The validation's speed: prefill-carrying and decode-only steps measured apart; a kind the probe never
    ran takes the speed of all steps."""
    from deltaserve.tools.validate.speed import COLD_STEP_US, step_speed

    lm = LatencyModel(bundle, wall_per_cpu=1.0)
    pre, dec = StepShape([(64, 0)], [], 1), StepShape([], [100] * 2, 2)
    steps = [(pre, 0.0, 0.9 * lm.shape_us(pre), float(t)) for t in range(4)]
    steps += [(dec, 0.0, 1.2 * lm.shape_us(dec), float(t)) for t in range(4)]
    sp = step_speed(bundle, steps, "cpu")
    assert sp.prefill(2.0) == pytest.approx(0.9) and sp.decode(2.0) == pytest.approx(1.2)
    assert 0.9 < sp.mean < 1.2
    only = step_speed(bundle, steps[:4], "cpu")
    assert only.decode(0.0) == pytest.approx(0.9)
    assert step_speed(bundle, [(pre, 2.0 * lm.shape_us(pre), 1.0, 0.0)], "wall").prefill(0.0) == pytest.approx(2.0)
    cold = [(pre, 0.0, 5.0 * lm.shape_us(pre), 0.0, True)]  # a probe burst's short first step is not a sample
    assert 5.0 * lm.shape_us(pre) < COLD_STEP_US
    assert step_speed(bundle, cold + [s + (False,) for s in steps], "cpu").prefill(2.0) == pytest.approx(0.9)
    long = (pre, 0.0, 2.0 * COLD_STEP_US, 0.0, True)  # a long one is: its cold caches are under 1% of it
    assert step_speed(bundle, [long], "cpu").prefill(0.0) == pytest.approx(2.0 * COLD_STEP_US / lm.shape_us(pre))


def test_twin_replay_runs_its_own_clock_and_starts_over_with_fresh_salts():
    """The interleaved probe's workload driver, on a stand-in engine: requests are admitted by the twin's own
    clock (which advances by its steps' CPU time and jumps over idle gaps), and the trace repeats under new
    cache salts so that a second round cannot hit the first's pages."""
    from deltaserve.tools.validate.real import _TwinReplay

    class Engine:
        def __init__(self):
            self.added, self.running = [], []

        def add_request(self, rid, prompt, params):
            self.added.append((rid, prompt["cache_salt"]))
            self.running.append(params)

        def has_unfinished_requests(self):
            return bool(self.running)

    eng = Engine()

    def timed_step():  # every step takes 0.5 s of CPU and finishes one request
        eng.running.pop(0)
        return None, ("shape", 5e5, 5e5)
    trace = [TraceRequest("a", 0.0, 1, prompt_token_ids=[1]), TraceRequest("b", 10.0, 1, prompt_token_ids=[2])]
    twin = _TwinReplay(eng, trace, timed_step, lambda n: n)
    for _ in range(4):
        assert twin.step() == ("shape", 5e5, 5e5)
    assert [r for r, _ in eng.added] == ["a-twin-0", "b-twin-0", "a-twin-1", "b-twin-1"]
    assert len({salt for _, salt in eng.added}) == 2 and len(twin.steps) == 4
    # a at 0 (clock 0.5 after it), a jump to b's arrival at 10 (10.5), round 2 starts there: a (11.0), b at 20.5
    assert twin.clock == pytest.approx(21.0)


def test_probe_burst_pays_its_share_with_a_step_minimum_up_to_a_cap():
    """A burst runs the CPU time the twin owes, at least five steps while they are short (one cache
    disturbance per burst, not per step), but never five 10-second steps (the replay would stop a minute)."""
    from deltaserve.tools.validate.real import _burst

    def steps_of(us):
        return lambda: ("shape", us, us)
    assert len(_burst(steps_of(1e3), 0.1, 5, 1.0)) == 100  # 1 ms steps: the owed 0.1 s
    assert len(_burst(steps_of(5e4), 0.001, 5, 1.0)) == 5  # 50 ms steps: the step minimum
    assert len(_burst(steps_of(4e5), 0.001, 5, 1.0)) == 3  # 0.4 s steps: the minimum stops at 1 s
    assert len(_burst(steps_of(1e7), 5.0, 5, 1.0)) == 1  # a 10 s prefill pays 5 s owed at once
    assert len(_burst(steps_of(1e7), 15.0, 5, 1.0)) == 2


# ------------------------------------------------------------------------------------------------ the simulation
def test_simulation_drives_the_real_scheduler(bundle):
    tr = materialize(small_trace())
    # a 256-token budget cuts the 300-token system prompt at a block boundary (128): align mode checkpoints
    # only where a chunk ends, so a prompt computed in one chunk leaves no checkpoint to hit
    sim = Simulation(cluster(bundle, max_num_batched_tokens=256, cache_layout="in-page"))
    rep = sim.replicas[0]
    assert type(rep.scheduler) is Scheduler and rep.scheduler.memory is rep.memory
    recs = sim.run(tr)
    assert len(recs) == len(tr) and all(r.status == "ok" for r in recs)
    by = {r.request_id: r for r in recs}
    for t in tr:
        r = by[t.request_id]
        assert r.output_tokens == t.output_length
        assert t.arrival_time <= r.first_token <= r.finish
    assert sum(r.cached_tokens for r in recs) > 0  # the shared system prompt hits (caching on)
    assert all(r.cached_tokens % 128 == 0 for r in recs)
    st = sim.stats()[0]
    assert st["prefix_cache_hits"] == sum(r.cached_tokens for r in recs) and st["steps"] > 0
    rep.memory.check_integrity()
    off = Simulation(cluster(bundle, enable_prefix_caching=False, max_num_batched_tokens=256, cache_layout="in-page")).run(
        materialize(small_trace()))
    assert sum(r.cached_tokens for r in off) == 0
    assert summarize(off)["ttft"]["mean"] > summarize(recs)["ttft"]["mean"]


def test_requests_arriving_together_start_one_step(bundle):
    """An idle engine admits everything that has arrived before it plans: two requests at one instant share the
    first step; one a nanosecond later waits for the next (the real replay loop does the same, validate/real.py)."""
    def first_step(t2: float) -> list[str]:
        sim = Simulation(cluster(bundle, max_num_batched_tokens=1024))
        plans = []
        sim.replicas[0].on_plan = lambda plan, now: plans.append([w.request_id for w in plan.work])
        sim.run([TraceRequest("a", 1.0, 4, prompt_token_ids=list(range(10, 200))),
                 TraceRequest("b", t2, 4, prompt_token_ids=list(range(300, 400)))])
        return plans[0]
    assert first_step(1.0) == ["a", "b"]
    assert first_step(1.0 + 1e-9) == ["a"]


def test_runs_layout_replica_hits_on_the_64_grid(bundle):
    """A replica with cache_layout runs gets the engine's runs pool (64-token pages) from the same builder:
    hits are multiples of 64 and cover at least what the in-page replica's 128-token blocks do."""
    hits = {}
    for layout in ("in-page", "runs"):
        sim = Simulation(cluster(bundle, max_num_batched_tokens=256, cache_layout=layout))
        recs = sim.run(materialize(small_trace()))
        assert all(r.status == "ok" for r in recs)
        assert sim.replicas[0].memory.block_size == (64 if layout == "runs" else 128)
        assert all(r.cached_tokens % 64 == 0 for r in recs)
        sim.replicas[0].memory.check_integrity()
        hits[layout] = sum(r.cached_tokens for r in recs)
    assert hits["runs"] >= hits["in-page"] > 0


def test_simulation_is_deterministic_and_overload_queues(bundle):
    a = Simulation(cluster(bundle)).run(materialize(small_trace()))
    b = Simulation(cluster(bundle)).run(materialize(small_trace()))
    assert [(r.first_token, r.finish) for r in a] == [(r.first_token, r.finish) for r in b]
    fast = summarize(Simulation(cluster(bundle)).run(materialize(small_trace(rate=200.0))))
    assert fast["ttft"]["p90"] > summarize(a)["ttft"]["p90"]


def test_preemption_under_memory_pressure(bundle):
    tr = materialize(agent_trace(AgentTraceSpec(num_sessions=8, session_rate=100.0, turns=(1, 1), system_tokens=0,
                                                first_user_tokens=(900, 1000), output_tokens=(200, 300), seed=3)))
    recs = Simulation(cluster(bundle, kv_cache_memory=16 * MiB, max_num_seqs=8)).run(tr)
    assert all(r.status == "ok" for r in recs)
    assert sum(r.preemptions for r in recs) > 0


def test_routers(bundle):
    tr = materialize(small_trace(n_sessions=8, rate=0.5))
    def cl(**kw):  # a 256-token budget chunks the system prompt, so that it leaves checkpoints
        return cluster(bundle, max_num_batched_tokens=256, **kw)
    rr = Simulation(cl(n=3, router="round-robin")).run(tr)
    assert [r.replica for r in rr][:6] == [0, 1, 2, 0, 1, 2]
    ll = Simulation(cl(n=3, router="least-loaded")).run(tr)
    assert {r.replica for r in ll} <= {0, 1, 2}
    pa = Simulation(cl(n=3, router={"policy": "prefix-affinity", "max_imbalance": 8})).run(tr)
    by_s: dict = {}
    for r in pa:
        by_s.setdefault(r.session_id, set()).add(r.replica)
    assert all(len(v) == 1 for v in by_s.values())  # a session's turns follow its cached prefix
    assert sum(r.cached_tokens for r in pa) >= sum(r.cached_tokens for r in rr)
    with pytest.raises(ValueError):
        Simulation(cl(router="random"))


def test_rejects_what_the_engine_rejects(bundle):
    tr = [TraceRequest("huge", 0.0, 10, prompt_token_ids=[11] * 10_000)]
    recs = Simulation(cluster(bundle, kv_cache_memory=8 * MiB)).run(tr)
    assert recs[0].status.startswith("rejected")


def test_300_requests_simulate_within_two_seconds(bundle):
    tr = materialize(agent_trace(AgentTraceSpec(num_sessions=120, session_rate=3.0, turns=(2, 4), seed=5)))[:300]
    assert len(tr) == 300
    t = time.process_time()
    recs = Simulation(cluster(bundle, n=2, router="prefix-affinity", max_num_seqs=16,
                              max_num_batched_tokens=2048, kv_cache_memory=256 * MiB)).run(tr)
    cpu = time.process_time() - t
    assert len(recs) == 300 and all(r.finish is not None for r in recs)
    assert cpu <= 2.0, f"300 requests took {cpu:.2f} s of CPU"


def test_cli_writes_csv_and_summary(bundle, tmp_path, capsys):
    from deltaserve.sim import main

    trace = tmp_path / "t.jsonl"
    write_trace(str(trace), small_trace())
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"profile": bundle.path, "router": "least-loaded",
                               "replicas": [{"count": 2, "max_num_seqs": 4, "max_num_batched_tokens": 256,
                                             "kv_cache_memory": 32 * MiB}]}))
    out = tmp_path / "o.csv"
    assert main(["--cluster-config", str(cfg), "--trace", str(trace), "--output", str(out), "--num-reqs", "7",
                 "--summary-json", str(tmp_path / "s.json")]) == 0
    recs = read_csv(str(out))
    assert len(recs) == 7 and {r.replica for r in recs} <= {0, 1}
    text = capsys.readouterr().out
    assert "TTFT" in text and "p99" in text and "hit rate" in text
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["completed"] == 7 and "throughput_req_s" in s
    cfg.write_text(json.dumps({"profile": bundle.path, "replicas": [{"max_num_seqs": 4, "bogus": 1}]}))
    with pytest.raises(ValueError, match="bogus"):
        main(["--cluster-config", str(cfg), "--trace", str(trace), "--output", str(out)])
    assert main(["gen-trace", "agent", "--out", str(tmp_path / "g.jsonl"), "--sessions", "3"]) == 0
    assert len(read_trace(str(tmp_path / "g.jsonl"))) >= 3


def test_simulator_imports_no_torch(tmp_path):
    path = synthetic_bundle(str(tmp_path / "b"))
    code = f"""
import sys
from deltaserve.sim import ClusterConfig, ReplicaConfig, Simulation, agent_trace, AgentTraceSpec, materialize
from deltaserve.profile.coverage import coverage
from deltaserve.sim.bundle import load_bundle
c = ClusterConfig([ReplicaConfig.from_dict(dict(max_num_seqs=4, max_num_batched_tokens=256, kv_cache_memory=32 << 20))], "round-robin", {path!r})
recs = Simulation(c).run(materialize(agent_trace(AgentTraceSpec(num_sessions=3, seed=1))))
coverage(load_bundle({path!r}))
assert recs and "torch" not in sys.modules, "torch was imported"
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))


def test_percentile_matches_numpy_linear():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(xs, 50) == 3.0 and percentile(xs, 90) == pytest.approx(4.6) and percentile([7.0], 99) == 7.0


@pytest.mark.slow
def test_validation_smoke(tmp_path):
    """One scenario of the gate end to end (quick profile of tiny, two real replays on the CPU clock with the
    interleaved probe, the simulations), and its three parts in the table."""
    from deltaserve.tools.validate.cli import main

    out = tmp_path / "val"
    assert main(["--out", str(out), "--presets", "tiny", "--quick", "--loads", "light", "--caching", "on",
                 "--clocks", "cpu"]) == 0  # non-zero when a run's steps are not reproduced exactly
    res = json.loads((out / "validation.json").read_text())["results"]
    assert len(res) == 1 and len(res[0]["runs"]) == 2
    for run in res[0]["runs"]:
        assert run["fidelity"]["identical"] and run["compare"]["probe"]["cached_tokens"]["real"] > 0
        info = run["real_info"]  # the interleaved probe: its speed over time, and its mean between the extremes
        assert info["probe"] == "interleaved" and info["probe_cpu_s"] > 0
        lo, hi = info["probe_range"]
        assert 0 < lo <= info["probe_factor"] <= hi
    assert set(res[0]["step_errors"]["probe"]) <= {"prefill", "mixed", "decode"} and res[0]["step_errors"]["probe"]
    assert {"sim_pct", "real_real_pct", "bound"} <= set(res[0]["end_to_end"]["ttft_mean"])
    steps = json.loads((out / "steps-tiny-light-on-cpu-2.json").read_text())
    assert steps["probe"] and steps["replay"] and {r[3] for r in steps["replay"]} <= {"prefill", "mixed", "decode"}
    assert len(steps["schedule"]) == len(steps["replay"])
    md = (out / "validation.md").read_text()
    assert md.count("| tiny | light | on | cpu |") == 2 + 1 + 1 + 2  # a: per run; b; c; diagnostics: per run


def test_monotone_tables_never_fall_with_size():
    """Two noisy neighbours (4 measured cheaper than 2) must not make a bigger step cheaper."""
    pts = [(1, 5.0), (2, 8.0), (4, 7.0), (8, 12.0)]
    plain, mono = Interp1D(pts), Interp1D(pts, monotone=True)
    assert plain(4) == 7.0 and mono(4) == 8.0 and mono(3) == 8.0 and mono(8) == 12.0
    assert all(mono(x) <= mono(x + 0.5) for x in [1 + 0.5 * i for i in range(20)])


def test_a_disk_tier_brings_evicted_prefixes_back_at_its_bandwidth(bundle):
    """A pool too small for the sessions: with the disk tier (the engine's own decisions, reads on a bandwidth model)
    later turns hit what the pool evicted; a slower disk makes them wait longer, never hit less."""
    tr = materialize(agent_trace(AgentTraceSpec(num_sessions=8, session_rate=50.0, turns=(3, 3), system_tokens=0,
                                                first_user_tokens=(600, 700), new_tokens=(20, 40),
                                                output_tokens=(4, 8), think_time=0.2, seed=4)))
    small = {"kv_cache_memory": 16 * MiB, "max_num_seqs": 8}
    off = Simulation(cluster(bundle, **small)).run(tr)
    runs = {}
    for gbps in (4.0, 0.05):
        c = cluster(bundle, cache_disk="sim", **small)
        c.replicas[0] = replace(c.replicas[0], disk_gbps=gbps)
        sim = Simulation(c)
        runs[gbps] = (sim.run(tr), sim.stats()[0])
    fast, st = runs[4.0]
    slow, slow_st = runs[0.05]
    assert all(r.status == "ok" for r in fast + slow)
    assert st["evictions"] > 0 and st["disk_hit_tokens"] > 0 and st["disk_reads"] > 0
    assert sum(r.cached_tokens for r in fast) > sum(r.cached_tokens for r in off)
    assert slow_st["disk_read_seconds"] / slow_st["disk_reads"] > 10 * st["disk_read_seconds"] / st["disk_reads"]
