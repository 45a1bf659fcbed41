"""The gate: replay the same trace on the real engine and in the simulator, and compare request by request.

    deltaserve simulate validate --out DIR [--presets tiny,qwen3.5-0.8b-shape] [--loads light,saturated,overloaded]
                                 [--caching on,off] [--reprofile] [--quick]

For each preset: profile the engine on this machine into DIR/bundles/PRESET (unless a bundle is there), make an
agent-session trace, and pick three arrival-time scales for it from the simulator's own estimate of the
engine's capacity (light: ~30% busy; saturated: ~90% busy; overloaded: arrivals about twice as fast as the
engine can serve). Each (load, caching) scenario then runs:

  real   a fresh LLMEngine (same flags), a few warm-up requests under their own cache salt, then the trace
         replayed offline, each request added once its arrival time has passed on the replay's clock (cpu: the
         engine thread's CPU time, idle gaps skipped; wall), engine.step() in a loop; TTFT / TPOT / E2E are
         the times the loop saw each request's tokens come out
  sim    one simulated replica with the same flags, the same warm-up requests, the same trace

and the table compares mean and p90 TTFT, mean TPOT and mean E2E (bars: 5%, 5%, 2%, 3%), plus the mean
per-request absolute error. The machine is shared and its speed drifts by several percent within a minute (other
tenants, memory bandwidth), more than the bars; the bundle's tables were measured at another moment. So the
simulator runs at the speed a probe measured while the replay ran, and the probe uses nothing from the replay:

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
predicted step time, by step kind as the probe reads it: what is left is the latency model's shape and the
queue's sensitivity to step boundaries). DIR/steps-*.json keeps every step of the replay
and of the probe, measured and predicted.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import sys
import time
from dataclasses import dataclass, replace

from .config import REPLICA_FLAGS
from .sim.bundle import load_bundle
from .sim.cluster import ClusterConfig, ReplicaConfig, Simulation
from .sim.latency import LatencyModel, SpeedTrace
from .sim.report import RequestRecord, mean, percentile, summarize
from .sim.trace import AgentTraceSpec, TraceRequest, agent_trace

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


def run_sim(bundle, engine_flags: dict, caching: bool, trace: list[TraceRequest], warmup: list[TraceRequest],
            wall_per_cpu: "float | StepSpeed | None" = None) -> tuple[list[RequestRecord], Simulation]:
    """wall_per_cpu: the speed to simulate, a constant or a StepSpeed over the replay's clock (None: the
    bundle's own)."""
    sim = Simulation(_cluster(engine_flags, caching, bundle.path), bundle)
    rep = sim.replicas[0]
    if isinstance(wall_per_cpu, StepSpeed):
        rep.latency = LatencyModel(bundle, speed=wall_per_cpu.prefill, decode_speed=wall_per_cpu.decode)
    elif wall_per_cpu is not None:
        rep.latency = LatencyModel(bundle, wall_per_cpu=wall_per_cpu)
    if warmup:  # the real engine's warm-up requests, all at once: they leave the same pages cached
        from .scheduler import Request

        for w in warmup:
            rep.submit(w, Request(w.request_id, w.prompt_token_ids, max_tokens=w.output_length,
                                  cache_salt=w.cache_salt), 0.0)
        while rep.has_work():
            if rep.start(0.0) is None:
                break
            rep.complete(0.0)
        rep.records.clear()
        rep.num_steps, rep.busy_time = 0, 0.0
    return sim.run(trace), sim


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
    whatever else the shared machine runs. Requests are added once the clock passes their arrival time."""
    from .config import EngineConfig
    from .engine import LLMEngine
    from .sampling_params import SamplingParams
    from .sim.latency import StepShape

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

    def run_warmup(engine, salt_suffix: str = "") -> list:
        """The warm-up requests all at once (prefills, mixed steps, decode batches), to the end."""
        out: list = []
        for w in warmup:
            engine.add_request(w.request_id + salt_suffix, {"prompt_token_ids": w.prompt_token_ids,
                                                            "cache_salt": (w.cache_salt or "") + salt_suffix},
                               params(w.output_length))
        while engine.has_unfinished_requests():
            out.append(timed_step(engine, out)[1])
        return out

    eng = LLMEngine(cfg)
    warm_steps = run_warmup(eng)
    twin = None
    probe_steps: list = []  # (shape, wall us, cpu us, replay clock, first of its burst)
    if probe == "interleaved":
        peng = LLMEngine(cfg)
        run_warmup(peng, "-probe-first")  # first calls into every kernel: not the machine's speed
        twin = _TwinReplay(peng, probe_trace, lambda: timed_step(peng, twin.steps), params)
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
    last_print = time.time()
    while k < len(pending) or eng.has_unfinished_requests():
        c, t = time.thread_time(), time.perf_counter()
        while k < len(pending) and pending[k].arrival_time <= now():
            r = pending[k]
            eng.add_request(r.request_id, {"prompt_token_ids": r.prompt_token_ids}, params(r.output_length),
                            cache_salt=r.cache_salt, arrival_time=t0 + r.arrival_time)
            recs[r.request_id] = RequestRecord(r.request_id, r.session_id, 0, r.arrival_time, len(r.prompt_token_ids),
                                               r.output_length)
            k += 1
        if not eng.has_unfinished_requests():
            if clock == "cpu":
                virtual = max(virtual, pending[k].arrival_time)
            else:
                time.sleep(max(0.0, pending[k].arrival_time - now()))
            continue
        dc0, dw0 = time.thread_time() - c, time.perf_counter() - t  # adding requests: the replay's time too
        t_step = now()
        outs, st = timed_step(eng, steps or warm_steps)
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
    after_steps = run_warmup(eng, "-after") if probe == "bracket" else []
    info = {"clock": clock, "probe": probe,
            "replay_wall_per_cpu": round(busy_wall / busy_cpu, 4) if busy_cpu > 0 else 1.0,
            "replay_wall_s": round(time.perf_counter() - w0 - paused, 2),
            "replay_cpu_s": round(time.thread_time() - c0 - probe_cpu, 2), "probe_cpu_s": round(probe_cpu, 2),
            "load_avg": os.getloadavg()[0], "steps": steps, "warmup_steps": warm_steps,
            "after_steps": after_steps, "probe_steps": probe_steps}
    gc.unfreeze()  # the engines may go now
    del eng, twin
    return [recs[r.request_id] for r in trace], info


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
            if self.engine.has_unfinished_requests():
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


def _write_steps(path: str, bundle, clock: str, steps: list, probe_steps: list) -> None:
    """Per step of the replay and of the interleaved probe: [replay clock, measured us on the clock, predicted
    CPU us, kind, tokens, first of a probe burst]: what the speed trace and the oracle were computed from."""
    lm = LatencyModel(bundle, wall_per_cpu=1.0)
    m = 1 if clock == "wall" else 2

    def row(st) -> list:
        s = st[0]
        kind = "decode" if s.decode_only else "mixed" if s.decode_ctx else "prefill"
        return [round(st[3], 4), round(st[m], 1), round(lm.shape_us(s), 1), kind, s.n_tokens,
                len(st) > 4 and bool(st[4])]  # replay steps carry no burst flag
    with open(path, "w") as f:
        json.dump({"clock": clock, "columns": ["t", "measured_us", "predicted_us", "kind", "tokens", "burst_first"],
                   "replay": [row(st) for st in steps], "probe": [row(st) for st in probe_steps]}, f)


def _speeds(info: dict) -> str:
    """'probe / oracle' over all steps, and by kind where the probe measured the kinds apart."""
    out = f"{info['probe_factor']:.2f} / {info['oracle_factor']:.2f}"
    if "probe_prefill" in info and "oracle_prefill" in info:
        out += (f" (prefill {info['probe_prefill']:.2f} / {info['oracle_prefill']:.2f}, decode "
                f"{info['probe_decode']:.2f} / {info['oracle_decode']:.2f})")
    return out


def format_table(results: list[dict], variants: dict[str, str]) -> str:
    """variants: clock -> which simulated variant to show for it."""
    head = ("| preset | load | caching | clock | reqs | real TTFT mean / p90 (s) | TTFT mean err | TTFT p90 err | "
            "real TPOT (ms) | TPOT err | real E2E (s) | E2E err | per-req E2E err | cached tok real / sim | "
            "step-model err | speed probe / oracle | pass |")
    lines = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    for r in results:
        v = variants.get(r["clock"])
        if v is None or v not in r["compare"]:
            continue
        c = r["compare"][v]
        f = lambda k: f"{c[k]['err_pct']:+.1f}%"  # noqa: E731
        info = r["real_info"]
        lines.append(
            f"| {r['preset']} | {r['load']} | {'on' if r['caching'] else 'off'} | {r['clock']} ({v}) | {r['requests']} | "
            f"{c['ttft_mean']['real']:.3f} / {c['ttft_p90']['real']:.3f} | {f('ttft_mean')} | {f('ttft_p90')} | "
            f"{1000 * c['tpot_mean']['real']:.1f} | {f('tpot_mean')} | {c['e2e_mean']['real']:.3f} | {f('e2e_mean')} | "
            f"{c['per_request_e2e_mape_pct']:.1f}% | {c['cached_tokens']['real']} / {c['cached_tokens']['sim']} | "
            f"{r['step_model_err_pct']:+.1f}% | {_speeds(info)} | "
            f"{'yes' if c['pass'] else 'no'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="deltaserve simulate validate",
                                description="replay traces on the real engine and in the simulator; compare")
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
    from .profile import make_engine
    from .profile.profiler import profile as run_profile
    from .sim.report import write_csv
    from .sim.trace import write_trace

    out_json = os.path.join(a.out, "validation.json")
    results: list[dict] = []
    if os.path.exists(out_json):  # earlier runs in this directory: keep what this run does not redo
        with open(out_json) as f:
            results = json.load(f).get("results", [])

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
                    print(f"[{tag}] real replay ({trace[-1].arrival_time:.1f} s of arrivals)", file=sys.stderr,
                          flush=True)
                    real, info = run_real(preset, sc.engine, caching, trace, warm, a.num_threads, clock=clock,
                                          probe=a.probe, probe_share=a.probe_share, probe_trace=twin)
                    steps = info.pop("steps")
                    write_csv(os.path.join(a.out, f"real-{tag}.csv"), real)
                    warm_steps, after_steps = info.pop("warmup_steps"), info.pop("after_steps")
                    probe_steps = info.pop("probe_steps")
                    info["probe_before"] = round(speed_factor(bundle, warm_steps, clock), 4)
                    if after_steps:
                        info["probe_after"] = round(speed_factor(bundle, after_steps, clock), 4)
                    if probe_steps:  # interleaved: the speed over time, by step kind; the table shows its mean
                        probe = step_speed(bundle, probe_steps, clock, a.probe_window)
                        info["probe_range"] = [round(min(probe.prefill.factors + probe.decode.factors), 4),
                                               round(max(probe.prefill.factors + probe.decode.factors), 4)]
                        info["probe_factor"] = round(probe.mean, 4)
                        info["probe_prefill"], info["probe_decode"] = (round(probe.prefill.mean, 4),
                                                                       round(probe.decode.mean, 4))
                    else:
                        probe = speed_factor(bundle, warm_steps + after_steps, clock)
                        info["probe_factor"] = round(probe, 4)
                    # the oracle: the replay's own mean speed, by step kind as the probe reads it (one
                    # number over the whole replay when the probe is a single number)
                    oracle = step_speed(bundle, steps, clock, window=len(steps)) if probe_steps and steps \
                        else speed_factor(bundle, steps, clock)
                    if isinstance(oracle, StepSpeed):
                        info["oracle_factor"] = round(oracle.mean, 4)
                        info["oracle_prefill"], info["oracle_decode"] = (round(oracle.prefill.mean, 4),
                                                                         round(oracle.decode.mean, 4))
                    else:
                        info["oracle_factor"] = round(oracle, 4)
                    _write_steps(os.path.join(a.out, f"steps-{tag}.json"), bundle, clock, steps, probe_steps)
                    static = 1.0 if clock == "cpu" else None  # CPU tables as measured / the bundle's wall per CPU
                    variants = {"probe": probe, "static": static, "oracle": oracle}
                    cmp, sims = {}, {}
                    for variant, wpc in variants.items():
                        t = time.perf_counter()
                        recs, _ = run_sim(bundle, sc.engine, caching, trace, warm, wpc)
                        sims[variant] = round(time.perf_counter() - t, 3)
                        write_csv(os.path.join(a.out, f"sim-{tag}-{variant}.csv"), recs)
                        cmp[variant] = compare(real, recs)
                    res = {"preset": preset, "load": load, "caching": caching, "clock": clock,
                           "requests": len(trace), "scale": scales[load], "real_info": info,
                           "step_model_err_pct": step_model_error(bundle, steps), "real_summary": summarize(real),
                           "compare": cmp, "sim_wall_s": sims}
                    keep(res)
                    print(format_table([res], {"cpu": "probe", "wall": "probe"}).splitlines()[-1], file=sys.stderr,
                          flush=True)
                    with open(out_json, "w") as f:
                        json.dump({"results": results, "bars_pct": BARS}, f, indent=2, default=str)
    text = ["## The gate: real engine vs simulator at the probed speed (see real_info.probe in validation.json)", "",
            format_table(results, {"cpu": "probe", "wall": "probe"}), "",
            "## Without the probe: the bundle as profiled (CPU tables; wall clock: the profile's wall/CPU)", "",
            format_table(results, {"cpu": "static", "wall": "static"}), "",
            "## Oracle speed (the replay's own mean measured / predicted step time, by step kind): what is left is "
            "the latency model's shape and the queue's chaos", "",
            format_table(results, {"cpu": "oracle", "wall": "oracle"})]
    with open(os.path.join(a.out, "validation.md"), "w") as f:
        f.write("\n".join(text) + "\n")
    print("\n".join(text))
    return 0
