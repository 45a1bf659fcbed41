"""The gate's three parts, from a real run and its simulations:

  a. fidelity: the simulator on the real run's own step durations takes the very same steps (exact)
  b. latency_errors: the latency model's error on every real step, by step kind
  c. end_to_end: TTFT, TPOT and E2E of the simulation against the real run (compare), within a bar or the real
     engine's own run-to-run difference, whichever is larger
"""
from __future__ import annotations

import math

from ...sim.latency import LatencyModel, step_errors
from ...sim.replayed import ReplayedLatency, compare_records, compare_steps, schedule_facts
from ...sim.report import RequestRecord, mean, percentile
from ...sim.trace import TraceRequest
from .simulate import latency_at, run_sim

BARS = {"ttft_mean": 5.0, "ttft_p90": 5.0, "tpot_mean": 2.0, "e2e_mean": 3.0}


def compare(real: list[RequestRecord], sim: list[RequestRecord]) -> dict:
    """Per metric of BARS: the real and the simulated value and the simulator's error in %; the per-request E2E
    error, cached tokens and preemptions of both; whether every metric is within its bar."""
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
    return step_errors(latency_at(bundle, speed), [(st[0], st[m], st[3]) for st in steps])


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
