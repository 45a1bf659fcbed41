"""The gate: replay the same trace on the real engine and in the simulator, and compare, in three parts.

    deltaserve simulate validate --out DIR [--presets tiny,qwen3.5-0.8b-shape] [--loads light,saturated,overloaded]
                                 [--caching on,off] [--clocks cpu,wall] [--reprofile] [--quick]

For each preset: profile the engine on this machine into DIR/bundles/PRESET (unless a bundle is there), make an
agent-session trace, and pick three arrival-time scales for it from the simulator's own estimate of the
engine's capacity (light: ~30% busy; saturated: ~90% busy; overloaded: arrivals about twice as fast as the
engine can serve). Each (load, caching, clock) scenario replays the trace on a fresh real LLMEngine TWICE (a few
warm-up requests under their own cache salt, then the trace offline: each request added once its arrival time
has passed on the replay's clock, engine.step() in a loop for as long as there are requests or background jobs,
as a server steps; cpu clock: the engine thread's CPU time, idle gaps skipped; wall), each run followed by its
simulations, and reports:

  a. scheduling fidelity, exact: the simulator on each real run's own measured step durations (sim/replayed.py:
     the k-th step takes the k-th measured duration, so the simulated clock is the real one) must take the very
     same steps: the same requests and token counts in every step, the same cached tokens per request, the same
     preemptions. A difference is a bug in the code the engine and the simulator share, not noise.
  b. the latency model, per step: predicted (at the probe's speed: nothing of the replay went into it) against
     measured duration of every real step, median and p90 |error| by step kind.
  c. end to end, against the engine's own spread: TTFT mean / p90, TPOT and E2E of the simulation at the probed
     speed against each real run, beside run 2 against run 1. A metric passes when the simulator is within its
     bar (5%, 5%, 2%, 3%) or within the real engine's own run-to-run difference, whichever is larger.

The command exits 1 when any run fails part a (that is a bug to find); parts b and c are measurements to read.

The machine is shared and its speed drifts by several percent within a minute, and the bundle's tables were
measured at another moment. So part c simulates at the speed a probe measured while the replay ran, and the
probe uses nothing from the replay:

  interleaved  (the default) a twin engine, same flags, replays another trace from the same generator at the
               same load (seed + 1: the same kind of steps, none of the same requests) in bursts between the
               replay's steps, half the replay's CPU time; the replay's clock stops during a burst, and a
               burst's short first step (on the caches the replay left) is not a sample. Its
               measured / predicted time, pooled over 32 neighbouring steps of a kind, is the speed at each
               moment for steps with prompt tokens and for decode-only steps apart (StepSpeed; on a shared
               machine the two drift apart), so the simulator follows the drift over the replay.
  bracket      the warm-up requests' steps before the replay and the same requests again after it: one factor.
  before       the warm-up steps alone.

Also simulated, for diagnosis: `static` (the bundle as profiled) and `oracle` (the replay's own measured /
predicted step time, by step kind as the probe reads it). DIR/steps-*.json keeps every step of each replay and
of its probe, measured and predicted, and the replay's schedule (what each step did, on the replay's clock).
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import logging
import math
import os
import random
import sys
import time
from dataclasses import dataclass, replace

from ..config import REPLICA_FLAGS
from ..sim.bundle import load_bundle
from ..sim.cluster import ClusterConfig, ReplicaConfig, Simulation
from ..sim.latency import LatencyModel, SpeedTrace, error_summary, step_errors, step_kind
from ..sim.replayed import (LoggedStep, ReplayedLatency, as_json, compare_records, compare_steps, schedule_facts,
                           step_signature)
from ..sim.report import RequestRecord, mean, percentile, summarize
from ..sim.trace import AgentTraceSpec, TraceRequest, agent_trace

log = logging.getLogger("deltaserve.sim")

BARS = {"ttft_mean": 5.0, "ttft_p90": 5.0, "tpot_mean": 2.0, "e2e_mean": 3.0}
PROBES = ("interleaved", "bracket", "before")


@dataclass
class Scenario:
    preset: str
    engine: dict  # engine flags (EngineConfig names)
    spec: AgentTraceSpec
    warmup: int = 8  # warm-up requests (64 + 96 i prompt tokens, 8 + 4 i outputs), run at once before the trace


def preset_scenario(preset: str, quick: bool = False) -> Scenario:
    if preset == "tiny":
        eng = dict(max_num_seqs=8, max_num_batched_tokens=512, kv_cache_memory=64 << 20)
        spec = AgentTraceSpec(num_sessions=8 if quick else 64, session_rate=1.0, turns=(2, 4), system_tokens=300,
                              first_user_tokens=(32, 160), new_tokens=(16, 128), output_tokens=(8, 40),
                              think_time=2.0, min_gap=1.0, seed=7)
    elif preset == "qwen3.5-0.8b-shape":
        eng = dict(max_num_seqs=6, max_num_batched_tokens=1152, kv_cache_memory=1 << 30)
        spec = AgentTraceSpec(num_sessions=3 if quick else 8, session_rate=1.0, turns=(2, 3), system_tokens=640,
                              first_user_tokens=(32, 200), new_tokens=(16, 160), output_tokens=(6, 16),
                              think_time=2.0, min_gap=1.0, seed=7)
    else:
        eng = dict(max_num_seqs=8, max_num_batched_tokens=1024, kv_cache_memory=1 << 30)
        spec = AgentTraceSpec(num_sessions=6, seed=7)
    return Scenario(preset, eng, spec, warmup=5 if preset == "qwen3.5-0.8b-shape" else 8)


def _scale(trace: list[TraceRequest], k: float) -> list[TraceRequest]:
    return [replace(r, arrival_time=r.arrival_time * k, prompt_token_ids=list(r.prompt_token_ids)) for r in trace]


def _warmup_requests(n: int, vocab: int, seed: int = 99) -> list[TraceRequest]:
    rng = random.Random(seed)
    return [TraceRequest(f"warmup-{i}", 0.0, 8 + 4 * i, prompt_token_ids=[rng.randrange(10, min(vocab, 4000))
                                                                           for _ in range(64 + 96 * i)],
                         cache_salt="warmup") for i in range(n)]


# ------------------------------------------------------------------------------------------------ simulator side
def _cluster(engine_flags: dict, caching: bool, bundle_path: str) -> ClusterConfig:
    rc = ReplicaConfig.from_dict({**{k: v for k, v in engine_flags.items() if k in REPLICA_FLAGS},
                                  "enable_prefix_caching": caching, "num_threads": None})
    return ClusterConfig([rc], "round-robin", bundle_path)


def _model(bundle, wall_per_cpu: "float | StepSpeed | None") -> LatencyModel:
    """The bundle's latency model at a speed: a constant, a StepSpeed over the replay's clock, or None (the
    bundle's own wall/CPU)."""
    if isinstance(wall_per_cpu, StepSpeed):
        return LatencyModel(bundle, speed=wall_per_cpu.prefill, decode_speed=wall_per_cpu.decode)
    return LatencyModel(bundle, wall_per_cpu=wall_per_cpu)


def run_sim(bundle, engine_flags: dict, caching: bool, trace: list[TraceRequest], warmup: list[TraceRequest],
            wall_per_cpu: "float | StepSpeed | None" = None, latency=None,
            record: bool = False) -> tuple[list[RequestRecord], Simulation]:
    """wall_per_cpu: the speed to simulate, a constant or a StepSpeed over the replay's clock (None: the
    bundle's own). latency: instead, a latency model for the trace's steps (after the warm-up), such as a
    ReplayedLatency. record: keep every step's signature, as sim.signatures = (warm-up steps, trace steps)."""
    sim = Simulation(_cluster(engine_flags, caching, bundle.path), bundle)
    rep = sim.replicas[0]
    if wall_per_cpu is not None:
        rep.latency = _model(bundle, wall_per_cpu)
    sigs: list[tuple] = []
    if record:
        rep.on_plan = lambda plan, now: sigs.append(step_signature(plan))
    if warmup:  # the real engine's warm-up requests, all at once: they leave the same pages cached
        from ..scheduler import Request

        for w in warmup:
            rep.submit(w, Request(w.request_id, w.prompt_token_ids, max_tokens=w.output_length,
                                  cache_salt=w.cache_salt), 0.0)
        while rep.has_work():  # background jobs included, as the real warm-up runs them
            if rep.start(0.0) is None:
                break
            rep.complete(0.0)
        rep.records.clear()
        rep.num_steps, rep.busy_time = 0, 0.0
    n_warm = len(sigs)
    if latency is not None:
        rep.latency = latency
    recs = sim.run(trace)
    sim.signatures = (sigs[:n_warm], sigs[n_warm:])
    return recs, sim


def utilization(bundle, flags: dict, caching: bool, trace: list[TraceRequest]) -> float:
    recs, sim = run_sim(bundle, flags, caching, trace, [], wall_per_cpu=1.0)
    span = max(r.finish for r in recs if r.finish is not None) - min(r.arrival for r in recs)
    return sim.replicas[0].busy_time / span if span > 0 else 1.0


def pick_scales(bundle, flags: dict, trace: list[TraceRequest], caching: bool = False) -> dict[str, float]:
    """Arrival-time scale factors for light (~30% busy), saturated (~90% busy) and overloaded (arrivals twice as
    fast as the saturated scale's) load, found by bisection on the simulator's busy fraction of the engine on a
    core of its own (the bundle's CPU-time tables; caching off: the heavier case, so saturated with caching on
    is a little lighter). The wall-clock replays stretch these by the bundle's wall/CPU contention."""
    def find(target: float) -> float:
        lo, hi = 0.01, 10000.0
        for _ in range(40):
            mid = (lo * hi) ** 0.5
            u = utilization(bundle, flags, caching, _scale(trace, mid))
            if u > target:
                lo = mid
            else:
                hi = mid
        return hi
    sat = find(0.9)
    return {"light": find(0.3), "saturated": sat, "overloaded": sat / 2}


# ------------------------------------------------------------------------------------------------ real side
def run_real(preset: str, engine_flags: dict, caching: bool, trace: list[TraceRequest], warmup: list[TraceRequest],
             num_threads: int | None, clock: str = "wall", progress: bool = True, probe: str = "interleaved",
             probe_share: float = 0.5, probe_burst_s: float = 0.1, probe_burst_steps: int = 5,
             probe_burst_cap_s: float = 1.0,
             probe_trace: list[TraceRequest] | None = None) -> tuple[list[RequestRecord], dict]:
    """Replay the trace on a fresh LLMEngine; per-request records and replay facts.

    probe: how the machine's speed is measured while the replay runs (nothing from the replay itself goes in):
      before       the warm-up requests' steps (info["warmup_steps"])
      bracket      those, and the same requests run again after the replay under another cache salt
                   (info["after_steps"])
      interleaved  a second engine with the same flags replays `probe_trace` (another trace from the same
                   generator, at the same load: the same kind of steps, none of the same requests) on a CPU
                   clock of its own, in bursts between the replay's steps, taking `probe_share` of the
                   replay's busy CPU time in bursts of at least `probe_burst_s` and `probe_burst_steps`
                   steps, the step count only until the burst has run `probe_burst_cap_s` (a 0.8B prefill
                   takes ~10 s: a burst of five stopped the replay for up to 46 s while the machine's speed
                   moved); a longer burst when the share is met early, a longer pause after it; the
                   replay's clock stops during a burst. info["probe_steps"]: (shape, wall us, cpu us, replay
                   clock, first of its burst) per probe step, so the simulator can follow the speed over the
                   replay.

    clock "wall": arrival times and token times in wall-clock seconds (time.time()), sleeping while idle.
    clock "cpu": a virtual clock that advances by this thread's CPU time while the engine works (add_request and
    step, one torch thread) and jumps to the next arrival while it is idle: the engine on a core of its own,
    whatever else the shared machine runs. Requests are added once the clock passes their arrival time.

    The engine is stepped while it has requests or background jobs (has_background_work: finished requests'
    outputs recomputed by prefill), as a server steps it; the warm-up runs to the end of its jobs too, so the
    replay starts on the cache state the simulated warm-up leaves. After an idle wait the clock is the arrival
    waited for (a wall-clock sleep that overshoots admits nothing more), which is where the simulator starts
    an idle replica's step. info["step_log"]: per replay step a LoggedStep (the clock when it was planned, when
    the loop next looked for arrivals, step_signature of its plan): what the trace-driven simulation
    (sim/replayed.py) replays and must reproduce; info["warmup_signatures"] the warm-up's steps."""
    from ..config import EngineConfig
    from ..engine.llm_engine import LLMEngine
    from ..engine.sampling_params import SamplingParams
    from ..sim.latency import StepShape

    if probe not in PROBES:
        raise ValueError(f"probe must be one of {PROBES}, got {probe!r}")
    if probe == "interleaved" and not probe_trace:
        raise ValueError("the interleaved probe needs a probe_trace")
    cfg = EngineConfig(preset=preset, dtype="auto", enable_prefix_caching=caching, num_threads=num_threads,
                       **engine_flags)
    params = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)  # noqa: E731

    def timed_step(engine, earlier: list) -> tuple:
        """One engine step: (its outputs, (shape of its plan, wall us, cpu us))."""
        c, t = time.thread_time(), time.perf_counter()
        outs = engine.step()
        dw, dc = time.perf_counter() - t, time.thread_time() - c
        shape = StepShape.of(engine.last_plan, after_prefill=bool(earlier) and bool(earlier[-1][0].prefill))
        return outs, (shape, dw * 1e6, dc * 1e6)

    def run_warmup(engine, salt_suffix: str = "", signatures: list | None = None) -> list:
        """The warm-up requests all at once (prefills, mixed steps, decode batches), to the end of their
        background jobs."""
        out: list = []
        for w in warmup:
            engine.add_request(w.request_id + salt_suffix, {"prompt_token_ids": w.prompt_token_ids,
                                                            "cache_salt": (w.cache_salt or "") + salt_suffix},
                               params(w.output_length))
        while _busy(engine):
            st = timed_step(engine, out)[1]
            if engine.last_plan.is_empty():  # not a step (see the replay loop); the simulator stops here too
                break
            out.append(st)
            if signatures is not None:
                signatures.append(step_signature(engine.last_plan))
        return out

    eng = LLMEngine(cfg)
    warm_sigs: list[tuple] = []
    warm_steps = run_warmup(eng, signatures=warm_sigs)
    twin = None
    probe_steps: list = []  # (shape, wall us, cpu us, replay clock, first of its burst)
    if probe == "interleaved":
        peng = LLMEngine(cfg)
        run_warmup(peng, "-probe-first")  # first calls into every kernel: not the machine's speed
        twin = _TwinReplay(peng, probe_trace, None, params)
        twin.timed_step = functools.partial(timed_step, peng, twin.steps)  # the list it appends to
    # as a served engine does after start-up (vLLM too): freeze what exists now (weights' wrappers, traces,
    # both engines) so that the collector's oldest-generation passes scan only what the replay creates; an
    # unfrozen heap made 10-60 ms pauses inside random steps, which no latency model should predict
    gc.collect()
    gc.freeze()
    pending = sorted(trace, key=lambda r: r.arrival_time)
    recs: dict[str, RequestRecord] = {}
    k = 0
    virtual = paused = 0.0
    t0 = time.time() + 0.01
    now = (lambda: virtual) if clock == "cpu" else (lambda: time.time() - t0 - paused)  # noqa: E731
    c0, w0 = time.thread_time(), time.perf_counter()
    busy_wall = busy_cpu = probe_cpu = 0.0
    steps: list = []
    step_log: list[LoggedStep] = []
    wake: float | None = None  # after an idle wait: the arrival waited for, which is the clock now
    empty = False  # the last step planned nothing
    last_print = time.time()
    while k < len(pending) or _busy(eng):
        c, t = time.thread_time(), time.perf_counter()
        t_check = now() if wake is None else wake
        wake = None
        if step_log and step_log[-1].end is None:
            step_log[-1].end = t_check  # what arrived by now the next step sees, here and in the simulator
        if k < len(pending) and pending[k].arrival_time <= t_check:
            empty = False  # something new to plan
        while k < len(pending) and pending[k].arrival_time <= t_check:
            r = pending[k]
            eng.add_request(r.request_id, {"prompt_token_ids": r.prompt_token_ids}, params(r.output_length),
                            cache_salt=r.cache_salt, arrival_time=t0 + r.arrival_time)
            recs[r.request_id] = RequestRecord(r.request_id, r.session_id, 0, r.arrival_time, len(r.prompt_token_ids),
                                               r.output_length)
            k += 1
        if not _busy(eng) or empty:
            if k == len(pending):  # busy, yet nothing to plan and nothing left to arrive
                raise RuntimeError(f"the engine plans empty steps with {eng.scheduler.num_waiting} request(s) "
                                   f"waiting and no arrival left: the scheduler is stalled")
            empty = False
            wake = pending[k].arrival_time
            if clock == "cpu":
                virtual = max(virtual, wake)
            else:
                time.sleep(max(0.0, wake - now()))
            continue
        dc0, dw0 = time.thread_time() - c, time.perf_counter() - t  # adding requests: the replay's time too
        t_step = t_check
        outs, st = timed_step(eng, steps or warm_steps)
        empty = eng.last_plan.is_empty()
        if empty:
            # not a step: the scheduler found nothing to run (it dropped a background job whose prompt checkpoint
            # was evicted, say). The simulated replica then idles until the next arrival at no cost; so does the
            # replay, and the microseconds of that schedule() are not on its clock
            continue
        step_log.append(LoggedStep(t_step, None, step_signature(eng.last_plan)))
        dc, dw = dc0 + (st[2] * 1e-6 if st else 0.0), dw0 + (st[1] * 1e-6 if st else 0.0)
        virtual += dc
        busy_wall += dw
        busy_cpu += dc
        if st is not None:
            steps.append(st + (t_step,))
        t_out = now()
        for o in outs:
            rec = recs.get(o.request_id)
            if rec is None or not o.outputs[0].token_ids:
                continue
            if rec.first_token is None:
                rec.first_token = t_out
            if o.finished:
                rec.finish = t_out
                rec.output_tokens = len(o.outputs[0].token_ids)
                rec.cached_tokens = o.num_cached_tokens
                rec.preemptions = o.metrics.num_preemptions if o.metrics else 0
        if twin is not None and probe_cpu + probe_burst_s <= probe_share * busy_cpu:
            tb = time.perf_counter()  # a burst: the replay's clock stops (cpu: it only counts replay steps)
            burst = _burst(twin.step, probe_share * busy_cpu - probe_cpu, probe_burst_steps, probe_burst_cap_s)
            for i, pst in enumerate(burst):
                probe_steps.append(pst + (t_out, i == 0))  # a burst's first step: see step_speed
                probe_cpu += pst[2] * 1e-6
            paused += time.perf_counter() - tb
        if progress and time.time() - last_print > 15:
            n_done = sum(1 for r in recs.values() if r.finish is not None)
            print(f"    real ({clock} clock): {n_done}/{len(trace)} done, {k} arrived, t={now():.1f}s", file=sys.stderr,
                  flush=True)
            last_print = time.time()
    if step_log and step_log[-1].end is None:
        step_log[-1].end = now()
    after_steps = run_warmup(eng, "-after") if probe == "bracket" else []
    info = {"clock": clock, "probe": probe,
            "replay_wall_per_cpu": round(busy_wall / busy_cpu, 4) if busy_cpu > 0 else 1.0,
            "replay_wall_s": round(time.perf_counter() - w0 - paused, 2),
            "replay_cpu_s": round(time.thread_time() - c0 - probe_cpu, 2), "probe_cpu_s": round(probe_cpu, 2),
            "load_avg": os.getloadavg()[0], "steps": steps, "warmup_steps": warm_steps,
            "after_steps": after_steps, "probe_steps": probe_steps, "step_log": step_log,
            "warmup_signatures": warm_sigs}
    gc.unfreeze()  # the engines may go now
    del eng, twin
    return [recs[r.request_id] for r in trace], info


def _busy(engine) -> bool:
    """What a server steps the engine for: unfinished requests, or the scheduler's background jobs (stepped while
    otherwise idle). An engine without background work (a test's stand-in) has none."""
    return engine.has_unfinished_requests() or bool(getattr(engine, "has_background_work", lambda: False)())


def _burst(step, owed_s: float, min_steps: int, cap_s: float) -> list:
    """One probe burst: step() -> (shape, wall us, cpu us) until the burst has run `owed_s` of CPU and at least
    `min_steps` steps, the step minimum only until it has run `cap_s`."""
    out, spent = [], 0.0
    while spent < owed_s or (len(out) < min_steps and spent < cap_s):
        out.append(step())
        spent += out[-1][2] * 1e-6
    return out


class _TwinReplay:
    """The interleaved probe's workload: a trace replayed on its own engine and its own CPU clock (idle time
    skipped), one step at a time when asked, starting over under fresh cache salts when it runs out."""

    def __init__(self, engine, trace: list[TraceRequest], timed_step, params):
        self.engine, self.trace, self.timed_step, self.params = engine, trace, timed_step, params
        self.k, self.round, self.clock, self.offset = 0, 0, 0.0, 0.0
        self.steps: list = []  # (shape, wall us, cpu us)

    def step(self) -> tuple:
        """Run the twin's next step (admitting what has arrived on its clock): (shape, wall us, cpu us)."""
        while True:
            while self.k < len(self.trace) and self.offset + self.trace[self.k].arrival_time <= self.clock:
                r = self.trace[self.k]
                salt = f"{r.cache_salt or ''}-twin-{self.round}"
                self.engine.add_request(f"{r.request_id}-twin-{self.round}", {"prompt_token_ids": r.prompt_token_ids,
                                                                              "cache_salt": salt},
                                        self.params(r.output_length))
                self.k += 1
            if _busy(self.engine):
                _, st = self.timed_step()
                if st is not None:
                    self.steps.append(st)
                    self.clock += st[2] * 1e-6
                    return st
            elif self.k < len(self.trace):
                self.clock = self.offset + self.trace[self.k].arrival_time
            else:
                self.round, self.k, self.offset = self.round + 1, 0, self.clock


# ------------------------------------------------------------------------------------------------ comparison
def compare(real: list[RequestRecord], sim: list[RequestRecord]) -> dict:
    def metric(recs, name):
        return [getattr(r, name) for r in recs if getattr(r, name) is not None]

    out = {}
    for name, fn, key in (("ttft", mean, "ttft_mean"), ("ttft", lambda xs: percentile(xs, 90), "ttft_p90"),
                          ("tpot", mean, "tpot_mean"), ("e2e", mean, "e2e_mean")):
        a, b = fn(metric(real, name)), fn(metric(sim, name))
        out[key] = {"real": a, "sim": b, "err_pct": 100.0 * (b - a) / a if a else float("nan")}
    by = {r.request_id: r for r in sim}
    per = []
    for r in real:
        s = by.get(r.request_id)
        if s is not None and r.e2e and s.e2e is not None:
            per.append(abs(s.e2e - r.e2e) / r.e2e)
    out["per_request_e2e_mape_pct"] = 100.0 * mean(per) if per else float("nan")
    out["cached_tokens"] = {"real": sum(r.cached_tokens for r in real), "sim": sum(r.cached_tokens for r in sim)}
    out["preemptions"] = {"real": sum(r.preemptions for r in real), "sim": sum(r.preemptions for r in sim)}
    out["pass"] = all(abs(out[k]["err_pct"]) <= v for k, v in BARS.items())
    return out


def speed_factor(bundle, steps, clock: str) -> float:
    """How much slower (>1) or faster this machine ran `steps` than the bundle's CPU-time model predicts:
    measured time on the replay's clock / predicted CPU time. On the warm-up steps it is the probe of the
    machine's present speed (contention included on the wall clock); on the replay's own steps, the oracle."""
    lm = LatencyModel(bundle, wall_per_cpu=1.0)
    pred = sum(lm.shape_us(st[0]) for st in steps)
    meas = sum((st[1] if clock == "wall" else st[2]) for st in steps)
    return meas / pred if pred > 0 else 1.0


COLD_STEP_US = 100_000  # a cold first step's ~1 ms is under 1% of a step this long


@dataclass
class StepSpeed:
    """The speed the machine ran at over a replay's clock, for steps with prompt tokens (prefill) and for
    decode-only steps apart, and over all steps (`mean`, the number the tables show)."""

    prefill: SpeedTrace
    decode: SpeedTrace
    mean: float


def step_speed(bundle, steps, clock: str, window: int = 32) -> StepSpeed:
    """steps: (shape, wall us, cpu us, replay clock[, first of its burst]). A burst's first step runs on the
    caches the other engine left: 0.5-0.9 ms more on tiny whatever the step (15-28% of a 4 ms decode, which
    biased the decode speed by 1-2%; nothing measurable on a 0.8B step). So a first step shorter than
    COLD_STEP_US is not a sample; a longer one is (on the 0.8B shape most prefill samples are first steps).
    A kind with no steps takes the other kind's speed."""
    lm = LatencyModel(bundle, wall_per_cpu=1.0)
    kinds: dict[bool, list] = {True: [], False: []}
    for shape, w, c, t, *first in steps:
        us = w if clock == "wall" else c
        if not (first and first[0] and us < COLD_STEP_US):
            kinds[shape.decode_only].append((t, us, lm.shape_us(shape)))
    both = kinds[True] + kinds[False]
    traces = {k: SpeedTrace(v or both, window) for k, v in kinds.items()}
    return StepSpeed(traces[False], traces[True], SpeedTrace(both, window).mean)


def step_model_error(bundle, steps) -> float:
    """The latency model's total error over the real replay's own steps (CPU time, wall_per_cpu 1), in %."""
    lm = LatencyModel(bundle, wall_per_cpu=1.0)
    meas = sum(st[2] for st in steps)
    pred = sum(lm.shape_us(st[0]) for st in steps)
    return 100.0 * (pred - meas) / meas if meas else float("nan")


# ------------------------------------------------------------------------------------------------ the three parts
def fidelity(bundle, flags: dict, caching: bool, trace: list[TraceRequest], warmup: list[TraceRequest],
             real: list[RequestRecord], info: dict) -> dict:
    """Part a: the simulator on this real run's own measured step durations (the k-th step takes the k-th
    duration, so its clock is the replay's) must take the very same steps, warm-up included, and give every
    request the same cached tokens, preemptions and outputs. Steps beyond the real run's last (a diverged run)
    are priced by the bundle so that the run can finish and be compared."""
    log = info["step_log"]
    lat = ReplayedLatency.from_log(log, fallback=LatencyModel(bundle, wall_per_cpu=1.0))
    recs, sim = run_sim(bundle, flags, caching, trace, warmup, latency=lat, record=True)
    warm_sim, trace_sim = sim.signatures
    real_sigs = [st.signature for st in log]
    out = {"warmup": compare_steps(info["warmup_signatures"], warm_sim), "trace": compare_steps(real_sigs, trace_sim),
           "overrun_steps": lat.overrun, "requests": compare_records(real, recs),
           "exercised": schedule_facts(real_sigs)}
    out["identical"] = out["warmup"]["identical"] and out["trace"]["identical"] and out["requests"]["identical"]
    return out


def latency_errors(bundle, steps: list, clock: str, speed) -> list[tuple[str, float]]:
    """Part b: (kind, error %) of the latency model at `speed` (a probe's, or None: the bundle's own) against
    every real step, measured on the replay's clock. steps: (shape, wall us, cpu us, replay clock)."""
    m = 1 if clock == "wall" else 2
    return step_errors(_model(bundle, speed), [(st[0], st[m], st[3]) for st in steps])


def end_to_end(sim_vs_real: list[dict], spread: dict) -> dict:
    """Part c. sim_vs_real: compare(real run, its simulation at the probed speed) per run; spread: compare(run 1,
    run 2), the real engine against itself. Per metric: the simulator's worst error over the runs, the real
    engine's own difference, the bound that applied (the bar, or that difference where it is larger) and
    whether the simulator is within it."""
    out: dict = {}
    for key, bar in BARS.items():
        sim = max((c[key]["err_pct"] for c in sim_vs_real), key=lambda e: math.inf if math.isnan(e) else abs(e))
        rr = spread[key]["err_pct"]
        bound, by = (abs(rr), "spread") if abs(rr) > bar else (bar, "bar")
        out[key] = {"sim_pct": sim, "real_real_pct": rr, "bound_pct": bound, "bound": by, "pass": abs(sim) <= bound}
    out["pass"] = all(v["pass"] for v in out.values())
    return out


# ------------------------------------------------------------------------------------------------ output
def _write_steps(path: str, bundle, clock: str, steps: list, probe_steps: list, step_log: list) -> None:
    """Per step of the replay and of the interleaved probe: [replay clock, measured us on the clock, predicted
    CPU us, kind, tokens, first of a probe burst]: what the speed trace and the oracle were computed from; and
    the replay's schedule: [planned at, next look for arrivals at, what the step did (as_json of its
    signature)], what the trace-driven simulation replays."""
    lm = LatencyModel(bundle, wall_per_cpu=1.0)
    m = 1 if clock == "wall" else 2

    def row(st) -> list:
        s = st[0]
        return [round(st[3], 4), round(st[m], 1), round(lm.shape_us(s), 1), step_kind(s), s.n_tokens,
                len(st) > 4 and bool(st[4])]  # replay steps carry no burst flag
    with open(path, "w") as f:
        json.dump({"clock": clock, "columns": ["t", "measured_us", "predicted_us", "kind", "tokens", "burst_first"],
                   "replay": [row(st) for st in steps], "probe": [row(st) for st in probe_steps],
                   "schedule_columns": ["start", "end", "signature"],
                   "schedule": [[ls.start, ls.end, as_json(ls.signature)] for ls in step_log]}, f)


def _speeds(info: dict) -> str:
    """'probe / oracle' over all steps, and by kind where the probe measured the kinds apart."""
    out = f"{info['probe_factor']:.2f} / {info['oracle_factor']:.2f}"
    if "probe_prefill" in info and "oracle_prefill" in info:
        out += (f" (prefill {info['probe_prefill']:.2f} / {info['oracle_prefill']:.2f}, decode "
                f"{info['probe_decode']:.2f} / {info['oracle_decode']:.2f})")
    return out


def _table(head: list[str], rows: list[list]) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
                     + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def _key(r: dict) -> list:
    return [r["preset"], r["load"], "on" if r["caching"] else "off", r["clock"]]


def _clip(text: str, n: int = 70) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def format_fidelity(results: list[dict]) -> str:
    """Part a, one row per real run."""
    rows = []
    for r in results:
        for i, run in enumerate(r["runs"], 1):
            f = run["fidelity"]
            tr, req, ex = f["trace"], f["requests"], f["exercised"]
            diff = "-"
            for part in ("warmup", "trace"):
                d = f[part]
                if not d["identical"]:
                    diff = (f"{part} step {d['first_diff']}: real `{_clip(d['real_at_diff'])}`, sim "
                            f"`{_clip(d['sim_at_diff'])}`")
                    break
            rows.append(_key(r) + [i, f"{tr['real_steps']} / {tr['sim_steps']}", "**yes**" if f["identical"] else "NO",
                                   diff, f"{ex['background']} / {ex['preempting']} / {ex['mixed']}",
                                   f"{req['cached_tokens']['real']} / {req['cached_tokens']['sim']}",
                                   f"{req['preemptions']['real']} / {req['preemptions']['sim']}",
                                   f"{1e3 * req['max_time_diff_s']:.3g}"])
    return _table(["preset", "load", "caching", "clock", "run", "steps real / sim", "identical", "first difference",
                   "steps with jobs / preemption / mixed", "cached tokens real / sim", "preemptions real / sim",
                   "max token-time diff (ms)"], rows)


def format_step_errors(results: list[dict]) -> str:
    """Part b, one row per scenario (both runs' steps), at the probed speed."""
    def cell(e: dict | None) -> str:
        return "-" if e is None else \
            f"{e['n']}: {e['median_abs_pct']:.1f}% / {e['p90_abs_pct']:.1f}% ({e['median_pct']:+.1f}%)"
    rows = [_key(r) + [cell(r["step_errors"]["probe"].get(k)) for k in ("prefill", "mixed", "decode")]
            for r in results]
    return _table(["preset", "load", "caching", "clock", "prefill: steps: median / p90 abs err (median err)",
                   "mixed", "decode"], rows)


def format_end_to_end(results: list[dict]) -> str:
    """Part c, one row per scenario."""
    rows = []
    for r in results:
        e, c = r["end_to_end"], r["runs"][0]["compare"]["probe"]
        cells = [f"{e[k]['sim_pct']:+.1f}% / {e[k]['real_real_pct']:+.1f}%" for k in BARS]
        bounds = ", ".join("bar" if e[k]["bound"] == "bar" else f"spread {e[k]['bound_pct']:.1f}%" for k in BARS)
        rows.append(_key(r) + [r["requests"], f"{c['ttft_mean']['real']:.3f} / {c['ttft_p90']['real']:.3f}",
                               f"{1000 * c['tpot_mean']['real']:.1f}", f"{c['e2e_mean']['real']:.3f}"]
                    + cells + [bounds, "**yes**" if e["pass"] else "no"])
    return _table(["preset", "load", "caching", "clock", "reqs", "real TTFT mean / p90 (s)", "real TPOT (ms)",
                   "real E2E (s)", "TTFT mean: sim / real-real", "TTFT p90", "TPOT", "E2E",
                   "bound (TTFT mean, p90, TPOT, E2E)", "pass"], rows)


def format_diagnostics(results: list[dict]) -> str:
    """Per real run: the speeds, the bundle's error over the run's steps, and the errors of each simulated speed."""
    rows = []
    for r in results:
        for i, run in enumerate(r["runs"], 1):
            errs = []
            for v in ("probe", "oracle", "static"):
                c = run["compare"].get(v)
                errs.append("-" if c is None else " / ".join(f"{c[k]['err_pct']:+.1f}" for k in BARS)
                            + (" ok" if c["pass"] else ""))
            rows.append(_key(r) + [i, _speeds(run["real_info"]), f"{run['step_model_err_pct']:+.1f}%"] + errs)
    return _table(["preset", "load", "caching", "clock", "run", "speed probe / oracle", "step-model err",
                   "errors % (TTFT mean / p90 / TPOT / E2E): probe", "oracle", "static"], rows)


def report(results: list[dict]) -> str:
    n_fid = sum(1 for r in results for run in r["runs"] if run["fidelity"]["identical"])
    n_runs = sum(len(r["runs"]) for r in results)
    n_e2e = sum(1 for r in results if r["end_to_end"]["pass"])
    return "\n".join([
        f"## a. Scheduling fidelity: the simulator on each real run's own step durations ({n_fid} of {n_runs} runs "
        "identical)", "", format_fidelity(results), "",
        "## b. Latency model per step: predicted at the probed speed against measured, every real step", "",
        format_step_errors(results), "",
        f"## c. End to end: simulation at the probed speed against each real run (worst of the two), beside run 2 "
        f"against run 1 ({n_e2e} of {len(results)} scenarios pass)", "",
        format_end_to_end(results), "",
        "## Diagnostics: per run, the probe's and the oracle's speed, and every simulated speed's errors", "",
        format_diagnostics(results)])


# ------------------------------------------------------------------------------------------------ the command
def replay_once(a, bundle, sc: Scenario, caching: bool, trace: list[TraceRequest], warm: list[TraceRequest],
                twin: list[TraceRequest], clock: str, tag: str) -> tuple[list[RequestRecord], dict, dict]:
    """One real replay and everything simulated from it: (its records, its JSON result, its per-step errors by
    speed)."""
    from ..sim.report import write_csv

    real, info = run_real(sc.preset, sc.engine, caching, trace, warm, a.num_threads, clock=clock, probe=a.probe,
                          probe_share=a.probe_share, probe_trace=twin)
    steps, step_log = info.pop("steps"), info.pop("step_log")
    write_csv(os.path.join(a.out, f"real-{tag}.csv"), real)
    warm_steps, after_steps = info.pop("warmup_steps"), info.pop("after_steps")
    probe_steps = info.pop("probe_steps")
    info["probe_before"] = round(speed_factor(bundle, warm_steps, clock), 4)
    if after_steps:
        info["probe_after"] = round(speed_factor(bundle, after_steps, clock), 4)
    if probe_steps:  # interleaved: the speed over time, by step kind; the tables show its mean
        probe = step_speed(bundle, probe_steps, clock, a.probe_window)
        info["probe_range"] = [round(min(probe.prefill.factors + probe.decode.factors), 4),
                               round(max(probe.prefill.factors + probe.decode.factors), 4)]
        info["probe_factor"] = round(probe.mean, 4)
        info["probe_prefill"], info["probe_decode"] = round(probe.prefill.mean, 4), round(probe.decode.mean, 4)
    else:
        probe = speed_factor(bundle, warm_steps + after_steps, clock)
        info["probe_factor"] = round(probe, 4)
    # the oracle: the replay's own mean speed, by step kind as the probe reads it (one number over the whole
    # replay when the probe is a single number)
    oracle = step_speed(bundle, steps, clock, window=len(steps)) if probe_steps and steps \
        else speed_factor(bundle, steps, clock)
    if isinstance(oracle, StepSpeed):
        info["oracle_factor"] = round(oracle.mean, 4)
        info["oracle_prefill"], info["oracle_decode"] = round(oracle.prefill.mean, 4), round(oracle.decode.mean, 4)
    else:
        info["oracle_factor"] = round(oracle, 4)
    warm_sigs = info.pop("warmup_signatures")
    _write_steps(os.path.join(a.out, f"steps-{tag}.json"), bundle, clock, steps, probe_steps, step_log)
    static = 1.0 if clock == "cpu" else None  # CPU tables as measured / the bundle's wall per CPU
    cmp, sims = {}, {}
    for variant, wpc in {"probe": probe, "static": static, "oracle": oracle}.items():
        t = time.perf_counter()
        recs, _ = run_sim(bundle, sc.engine, caching, trace, warm, wpc)
        sims[variant] = round(time.perf_counter() - t, 3)
        write_csv(os.path.join(a.out, f"sim-{tag}-{variant}.csv"), recs)
        cmp[variant] = compare(real, recs)
    fid = fidelity(bundle, sc.engine, caching, trace, warm, real,
                   {"step_log": step_log, "warmup_signatures": warm_sigs})
    errors = {v: latency_errors(bundle, steps, clock, speed) for v, speed in (("probe", probe), ("static", static))}
    run = {"real_info": info, "step_model_err_pct": step_model_error(bundle, steps), "real_summary": summarize(real),
           "compare": cmp, "sim_wall_s": sims, "fidelity": fid}
    return real, run, errors


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="deltaserve simulate validate",
                                description="replay traces on the real engine (twice) and in the simulator; "
                                            "compare the steps, the step times and the end-to-end metrics")
    p.add_argument("--out", required=True, help="directory for bundles, traces, per-request CSVs and the table")
    p.add_argument("--presets", default="tiny,qwen3.5-0.8b-shape")
    p.add_argument("--loads", default="light,saturated,overloaded")
    p.add_argument("--caching", default="on,off")
    p.add_argument("--clocks", default="cpu,wall", help="replay clocks: cpu (the engine on a core of its own), wall")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads for profiling and the real engine")
    p.add_argument("--reprofile", action="store_true", help="profile again even if a bundle exists")
    p.add_argument("--probe", default="interleaved", choices=PROBES,
                   help="the speed probe (nothing from the replay itself goes in): a twin engine replaying "
                        "another trace of the same kind in bursts between the replay's steps, followed over time "
                        "and by step kind (interleaved); the warm-up steps before the replay (before), or those "
                        "and the same requests again after it (bracket)")
    p.add_argument("--probe-share", type=float, default=0.5,
                   help="interleaved probe: its CPU time as a share of the replay's busy time")
    p.add_argument("--probe-window", type=int, default=32,
                   help="interleaved probe: probe steps of a kind pooled for the speed at one time")
    p.add_argument("--quick", action="store_true", help="fewer sessions and a quick profile (a smoke run)")
    p.add_argument("--sessions", type=int, default=None,
                   help="agent sessions per trace (default: the preset's, 64 on tiny and 8 on the 0.8B shape); "
                        "more requests average out the scheduling coincidences near saturation")
    p.add_argument("--quick-profile", default="qwen3.5-0.8b-shape",
                   help="presets profiled on the quick grid even without --quick (comma-separated)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    os.makedirs(a.out, exist_ok=True)
    from ..profile import make_engine
    from ..profile.profiler import profile as run_profile
    from ..sim.trace import write_trace

    out_json = os.path.join(a.out, "validation.json")
    results: list[dict] = []
    if os.path.exists(out_json):  # earlier runs of this gate in this directory: keep what this run does not redo
        with open(out_json) as f:
            results = [r for r in json.load(f).get("results", []) if "runs" in r and "end_to_end" in r]

    def keep(res: dict) -> None:
        key = lambda r: (r["preset"], r["load"], r["caching"], r["clock"])  # noqa: E731
        results[:] = [r for r in results if key(r) != key(res)] + [res]
        order = {p: i for i, p in enumerate(["tiny", "qwen3.5-0.8b-shape"])}
        results.sort(key=lambda r: (order.get(r["preset"], 9), r["preset"],
                                    ["light", "saturated", "overloaded"].index(r["load"]), not r["caching"],
                                    r["clock"]))
    for preset in a.presets.split(","):
        sc = preset_scenario(preset, a.quick)
        if a.sessions:
            sc = replace(sc, spec=replace(sc.spec, num_sessions=a.sessions))
        bdir = os.path.join(a.out, "bundles", preset)
        if a.reprofile or not os.path.exists(os.path.join(bdir, "meta.yaml")):
            print(f"[{preset}] profiling into {bdir}", file=sys.stderr, flush=True)
            eng = make_engine(preset=preset, num_threads=a.num_threads, **sc.engine)
            run_profile(eng, bdir, quick=a.quick or preset in a.quick_profile.split(","), source=f"preset:{preset}")
            del eng
        bundle = load_bundle(bdir)
        vocab = int(bundle.config.get("vocab_size", 4096))
        base = agent_trace(replace(sc.spec, vocab=min(vocab, 4000)))
        twin_base = agent_trace(replace(sc.spec, vocab=min(vocab, 4000), seed=sc.spec.seed + 1))  # the probe's
        warm = _warmup_requests(sc.warmup, vocab)
        scales = pick_scales(bundle, sc.engine, base)
        wpc_bundle = float(bundle.calibration.get("wall_per_cpu", 1.0))
        print(f"[{preset}] {len(base)} requests; arrival scales {scales}", file=sys.stderr, flush=True)
        for load in a.loads.split(","):
            base_trace = _scale(base, scales[load])
            write_trace(os.path.join(a.out, f"trace-{preset}-{load}.jsonl"), base_trace)
            for caching in [c == "on" for c in a.caching.split(",")]:
                for clock in a.clocks.split(","):
                    tag = f"{preset}-{load}-{'on' if caching else 'off'}-{clock}"
                    trace = base_trace if clock == "cpu" else _scale(base_trace, wpc_bundle)
                    twin = _scale(twin_base, scales[load] * (1.0 if clock == "cpu" else wpc_bundle))
                    reals, runs, errors = [], [], {"probe": [], "static": []}
                    for n in (1, 2):  # the real engine twice, each run followed by its simulations
                        print(f"[{tag}] real replay {n} of 2 ({trace[-1].arrival_time:.1f} s of arrivals)",
                              file=sys.stderr, flush=True)
                        real, run, errs = replay_once(a, bundle, sc, caching, trace, warm, twin, clock, f"{tag}-{n}")
                        reals.append(real)
                        runs.append(run)
                        for v in errors:
                            errors[v] += errs[v]
                    spread = compare(reals[0], reals[1])
                    res = {"preset": preset, "load": load, "caching": caching, "clock": clock,
                           "requests": len(trace), "scale": scales[load], "runs": runs, "real_vs_real": spread,
                           "step_errors": {v: error_summary(e) for v, e in errors.items()},
                           "end_to_end": end_to_end([r["compare"]["probe"] for r in runs], spread)}
                    keep(res)
                    for table in (format_fidelity, format_step_errors, format_end_to_end):
                        print("\n".join(table([res]).splitlines()[2:]), file=sys.stderr, flush=True)
                    with open(out_json, "w") as f:
                        json.dump({"results": results, "bars_pct": BARS}, f, indent=2, default=str)
    text = report(results)
    with open(os.path.join(a.out, "validation.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0 if all(run["fidelity"]["identical"] for r in results for run in r["runs"]) else 1
