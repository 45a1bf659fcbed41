"""The real side of the gate: a trace replayed on a fresh LLMEngine as a server steps it, with the machine's
speed probed meanwhile (the interleaved probe: a twin engine replaying another trace in bursts between the
replay's steps). Importing this module imports no torch; run_real does.
"""
from __future__ import annotations

import functools
import gc
import os
import sys
import time

from ...config import EngineConfig
from ...engine.sampling_params import SamplingParams
from ...sim.latency import StepShape
from ...sim.replayed import LoggedStep, step_signature
from ...sim.report import RequestRecord
from ...sim.trace import TraceRequest

PROBES = ("interleaved", "bracket", "before")


def _params(n: int) -> SamplingParams:
    """What a trace request asks: n output tokens, greedy, EOS ignored."""
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _busy(engine) -> bool:
    """What a server steps the engine for: unfinished requests, or the scheduler's background jobs (stepped while
    otherwise idle). An engine without background work (a test's stand-in) has none."""
    return engine.has_unfinished_requests() or bool(getattr(engine, "has_background_work", lambda: False)())


def _timed_step(engine, earlier: list) -> tuple:
    """One engine step: (its outputs, (shape of its plan, wall us, cpu us)). earlier: the steps before it, for
    the shape's after_prefill."""
    c, t = time.thread_time(), time.perf_counter()
    outs = engine.step()
    dw, dc = time.perf_counter() - t, time.thread_time() - c
    shape = StepShape.of(engine.last_plan, after_prefill=bool(earlier) and bool(earlier[-1][0].prefill))
    return outs, (shape, dw * 1e6, dc * 1e6)


def _run_warmup(engine, warmup: list[TraceRequest], salt_suffix: str = "", signatures: list | None = None) -> list:
    """The warm-up requests all at once (prefills, mixed steps, decode batches), to the end of their
    background jobs: their steps (shape, wall us, cpu us); signatures, when given, gets each step's."""
    out: list = []
    for w in warmup:
        engine.add_request(w.request_id + salt_suffix, {"prompt_token_ids": w.prompt_token_ids,
                                                        "cache_salt": (w.cache_salt or "") + salt_suffix},
                           _params(w.output_length))
    while _busy(engine):
        st = _timed_step(engine, out)[1]
        if engine.last_plan.is_empty():  # not a step (see the replay loop); the simulator stops here too
            break
        out.append(st)
        if signatures is not None:
            signatures.append(step_signature(engine.last_plan))
    return out


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


def _twin(engine_cls, cfg: EngineConfig, warmup: list[TraceRequest], probe_trace: list[TraceRequest]) -> _TwinReplay:
    """The interleaved probe's engine (the replay's flags), warmed up, replaying probe_trace."""
    peng = engine_cls(cfg)
    _run_warmup(peng, warmup, "-probe-first")  # first calls into every kernel: not the machine's speed
    twin = _TwinReplay(peng, probe_trace, None, _params)
    twin.timed_step = functools.partial(_timed_step, peng, twin.steps)  # the list it appends to
    return twin


class _Clock:
    """The replay's clock. wall: seconds since the start (time.time()) less the time the probe's bursts paused
    the replay; cpu: virtual, advanced by the replay's CPU time and moved to the next arrival while idle."""

    def __init__(self, kind: str):
        self.kind = kind
        self.virtual = self.paused = 0.0
        self.t0 = time.time() + 0.01

    def now(self) -> float:
        return self.virtual if self.kind == "cpu" else time.time() - self.t0 - self.paused

    def idle_until(self, t: float) -> None:
        if self.kind == "cpu":
            self.virtual = max(self.virtual, t)
        else:
            time.sleep(max(0.0, t - self.now()))


def _admit(eng, pending: list[TraceRequest], k: int, t_check: float, recs: dict[str, RequestRecord],
           t0: float) -> int:
    """Add the requests of pending[k:] (by arrival) that have arrived by t_check to the engine, each with its
    record; the index of the first still to arrive."""
    while k < len(pending) and pending[k].arrival_time <= t_check:
        r = pending[k]
        eng.add_request(r.request_id, {"prompt_token_ids": r.prompt_token_ids}, _params(r.output_length),
                        cache_salt=r.cache_salt, arrival_time=t0 + r.arrival_time)
        recs[r.request_id] = RequestRecord(r.request_id, r.session_id, 0, r.arrival_time, len(r.prompt_token_ids),
                                           r.output_length)
        k += 1
    return k


def _probe_burst(twin: _TwinReplay, clk: _Clock, probe_steps: list, t_out: float, probe_cpu: float, owed_s: float,
                 min_steps: int, cap_s: float) -> float:
    """A burst of the twin's steps between two of the replay's, the replay's clock stopped (cpu: it only counts
    replay steps); each appended to probe_steps at replay clock t_out. The probe's CPU time after it."""
    tb = time.perf_counter()
    for i, pst in enumerate(_burst(twin.step, owed_s, min_steps, cap_s)):
        probe_steps.append(pst + (t_out, i == 0))  # a burst's first step: see step_speed
        probe_cpu += pst[2] * 1e-6
    clk.paused += time.perf_counter() - tb
    return probe_cpu


def _record_outputs(recs: dict[str, RequestRecord], outs, t_out: float) -> None:
    """A step's outputs into the requests' records: first token and finish at t_out, what a finished one got."""
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
    from ...engine.llm_engine import LLMEngine  # torch: the simulator's side of the gate runs without it

    if probe not in PROBES:
        raise ValueError(f"probe must be one of {PROBES}, got {probe!r}")
    if any(r.images for r in (*trace, *warmup, *(probe_trace or ()))):  # fail closed: a replay would drop them
        raise ValueError("the real-engine replay sends token ids only, no pixels: a trace with images is simulated only")
    if probe == "interleaved" and not probe_trace:
        raise ValueError("the interleaved probe needs a probe_trace")
    cfg = EngineConfig(preset=preset, dtype="auto", enable_prefix_caching=caching, num_threads=num_threads,
                       **engine_flags)
    eng = LLMEngine(cfg)
    warm_sigs: list[tuple] = []
    warm_steps = _run_warmup(eng, warmup, signatures=warm_sigs)
    twin = _twin(LLMEngine, cfg, warmup, probe_trace) if probe == "interleaved" else None
    probe_steps: list = []  # (shape, wall us, cpu us, replay clock, first of its burst)
    # as a served engine does after start-up (vLLM too): freeze what exists now (weights' wrappers, traces,
    # both engines) so that the collector's oldest-generation passes scan only what the replay creates; an
    # unfrozen heap made 10-60 ms pauses inside random steps, which no latency model should predict
    gc.collect()
    gc.freeze()
    pending = sorted(trace, key=lambda r: r.arrival_time)
    recs: dict[str, RequestRecord] = {}
    k = 0
    clk = _Clock(clock)
    now = clk.now
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
        k = _admit(eng, pending, k, t_check, recs, clk.t0)
        if not _busy(eng) or empty:
            if k == len(pending):  # busy, yet nothing to plan and nothing left to arrive
                raise RuntimeError(f"the engine plans empty steps with {eng.scheduler.num_waiting} request(s) "
                                   f"waiting and no arrival left: the scheduler is stalled")
            empty = False
            wake = pending[k].arrival_time
            clk.idle_until(wake)
            continue
        dc0, dw0 = time.thread_time() - c, time.perf_counter() - t  # adding requests: the replay's time too
        t_step = t_check
        outs, st = _timed_step(eng, steps or warm_steps)
        empty = eng.last_plan.is_empty()
        if empty:
            # not a step: the scheduler found nothing to run (it dropped a background job whose prompt checkpoint
            # was evicted, say). The simulated replica then idles until the next arrival at no cost; so does the
            # replay, and the microseconds of that schedule() are not on its clock
            continue
        step_log.append(LoggedStep(t_step, None, step_signature(eng.last_plan)))
        dc, dw = dc0 + (st[2] * 1e-6 if st else 0.0), dw0 + (st[1] * 1e-6 if st else 0.0)
        clk.virtual += dc
        busy_wall += dw
        busy_cpu += dc
        if st is not None:
            steps.append(st + (t_step,))
        t_out = now()
        _record_outputs(recs, outs, t_out)
        if twin is not None and probe_cpu + probe_burst_s <= probe_share * busy_cpu:
            probe_cpu = _probe_burst(twin, clk, probe_steps, t_out, probe_cpu, probe_share * busy_cpu - probe_cpu,
                                     probe_burst_steps, probe_burst_cap_s)
        if progress and time.time() - last_print > 15:
            n_done = sum(1 for r in recs.values() if r.finish is not None)
            print(f"    real ({clock} clock): {n_done}/{len(trace)} done, {k} arrived, t={now():.1f}s", file=sys.stderr,
                  flush=True)
            last_print = time.time()
    if step_log and step_log[-1].end is None:
        step_log[-1].end = now()
    after_steps = _run_warmup(eng, warmup, "-after") if probe == "bracket" else []
    info = {"clock": clock, "probe": probe,
            "replay_wall_per_cpu": round(busy_wall / busy_cpu, 4) if busy_cpu > 0 else 1.0,
            "replay_wall_s": round(time.perf_counter() - w0 - clk.paused, 2),
            "replay_cpu_s": round(time.thread_time() - c0 - probe_cpu, 2), "probe_cpu_s": round(probe_cpu, 2),
            "load_avg": os.getloadavg()[0], "steps": steps, "warmup_steps": warm_steps,
            "after_steps": after_steps, "probe_steps": probe_steps, "step_log": step_log,
            "warmup_signatures": warm_sigs}
    gc.unfreeze()  # the engines may go now
    del eng, twin
    return [recs[r.request_id] for r in trace], info
