"""The gate's tables: part a per real run, parts b and c per scenario, and the diagnostics (the speeds and every
simulated speed's errors), as markdown; report() is validation.md."""
from __future__ import annotations

from .compare import BARS


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
