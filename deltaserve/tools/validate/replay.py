"""One real replay and everything simulated from it: the speeds the probe and the oracle read, the simulations
at each speed, the three parts' measurements, and the files of the run (real-*.csv, sim-*.csv, steps-*.json)."""
from __future__ import annotations

import json
import os
import time

from ...sim.latency import LatencyModel, step_kind
from ...sim.replayed import as_json
from ...sim.report import RequestRecord, summarize, write_csv
from ...sim.trace import TraceRequest
from .compare import compare, fidelity, latency_errors
from .real import run_real
from .scenarios import Scenario
from .simulate import run_sim
from .speed import StepSpeed, speed_factor, step_model_error, step_speed


def write_steps(path: str, bundle, clock: str, steps: list, probe_steps: list, step_log: list) -> None:
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


def _probed_speed(bundle, info: dict, clock: str, warm_steps: list, after_steps: list, probe_steps: list,
                  window: int) -> StepSpeed | float:
    """The speed to simulate at, from the probe alone (nothing of the replay goes in); its numbers into info."""
    info["probe_before"] = round(speed_factor(bundle, warm_steps, clock), 4)
    if after_steps:
        info["probe_after"] = round(speed_factor(bundle, after_steps, clock), 4)
    if probe_steps:  # interleaved: the speed over time, by step kind; the tables show its mean
        probe = step_speed(bundle, probe_steps, clock, window)
        info["probe_range"] = [round(min(probe.prefill.factors + probe.decode.factors), 4),
                               round(max(probe.prefill.factors + probe.decode.factors), 4)]
        info["probe_factor"] = round(probe.mean, 4)
        info["probe_prefill"], info["probe_decode"] = round(probe.prefill.mean, 4), round(probe.decode.mean, 4)
        return probe
    probe = speed_factor(bundle, warm_steps + after_steps, clock)
    info["probe_factor"] = round(probe, 4)
    return probe


def _oracle_speed(bundle, info: dict, clock: str, steps: list, by_kind: bool) -> StepSpeed | float:
    """The replay's own mean speed, by step kind as the probe reads it (by_kind: the interleaved probe), else one
    number over the whole replay; its numbers into info."""
    oracle = step_speed(bundle, steps, clock, window=len(steps)) if by_kind and steps \
        else speed_factor(bundle, steps, clock)
    if isinstance(oracle, StepSpeed):
        info["oracle_factor"] = round(oracle.mean, 4)
        info["oracle_prefill"], info["oracle_decode"] = round(oracle.prefill.mean, 4), round(oracle.decode.mean, 4)
    else:
        info["oracle_factor"] = round(oracle, 4)
    return oracle


def replay_once(a, bundle, sc: Scenario, caching: bool, trace: list[TraceRequest], warm: list[TraceRequest],
                twin: list[TraceRequest], clock: str, tag: str) -> tuple[list[RequestRecord], dict, dict]:
    """One real replay and everything simulated from it: (its records, its JSON result, its per-step errors by
    speed). a: the command's arguments (out, num_threads and the probe's)."""
    real, info = run_real(sc.preset, sc.engine, caching, trace, warm, a.num_threads, clock=clock, probe=a.probe,
                          probe_share=a.probe_share, probe_trace=twin)
    steps, step_log = info.pop("steps"), info.pop("step_log")
    write_csv(os.path.join(a.out, f"real-{tag}.csv"), real)
    warm_steps, after_steps = info.pop("warmup_steps"), info.pop("after_steps")
    probe_steps = info.pop("probe_steps")
    probe = _probed_speed(bundle, info, clock, warm_steps, after_steps, probe_steps, a.probe_window)
    oracle = _oracle_speed(bundle, info, clock, steps, bool(probe_steps))
    warm_sigs = info.pop("warmup_signatures")
    write_steps(os.path.join(a.out, f"steps-{tag}.json"), bundle, clock, steps, probe_steps, step_log)
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
