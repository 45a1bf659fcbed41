"""`deltaserve simulate validate`: per preset a bundle (profiled here unless DIR has one), a trace and its three
loads; per (load, caching, clock) scenario two real replays, each followed by its simulations; the results in
DIR/validation.json (kept across runs in the same DIR) and the tables in DIR/validation.md."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import replace

from ...config import ModelConfig
from ...profile import make_engine
from ...sim.bundle import load_bundle
from ...sim.latency import error_summary
from ...sim.trace import agent_trace, write_trace
from .compare import BARS, compare, end_to_end
from .real import PROBES
from .replay import replay_once
from .report import format_end_to_end, format_fidelity, format_step_errors, report
from .scenarios import pick_scales, preset_scenario, scaled, warmup_requests

PRESET_ORDER = ["tiny", "qwen3.5-0.8b-shape"]  # validation.json's and the tables' order; other presets after
LOADS = ["light", "saturated", "overloaded"]


def build_parser() -> argparse.ArgumentParser:
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
    return p


def _earlier_results(out_json: str) -> list[dict]:
    """Earlier runs of this gate in this directory: kept where this run does not redo them."""
    if not os.path.exists(out_json):
        return []
    with open(out_json) as f:
        return [r for r in json.load(f).get("results", []) if "runs" in r and "end_to_end" in r]


def _keep(results: list[dict], res: dict) -> None:
    """res in place of an earlier result of its scenario, in the tables' order."""
    key = lambda r: (r["preset"], r["load"], r["caching"], r["clock"])  # noqa: E731
    results[:] = [r for r in results if key(r) != key(res)] + [res]
    order = {p: i for i, p in enumerate(PRESET_ORDER)}
    results.sort(key=lambda r: (order.get(r["preset"], 9), r["preset"], LOADS.index(r["load"]), not r["caching"],
                                r["clock"]))


def _bundle(a, preset: str, sc):
    """DIR/bundles/PRESET, profiled first where it is missing (or --reprofile)."""
    bdir = os.path.join(a.out, "bundles", preset)
    if a.reprofile or not os.path.exists(os.path.join(bdir, "meta.yaml")):
        from ...profile.run import profile as run_profile  # torch, only when a bundle is to be made

        print(f"[{preset}] profiling into {bdir}", file=sys.stderr, flush=True)
        eng = make_engine(preset=preset, num_threads=a.num_threads, **sc.engine)
        run_profile(eng, bdir, quick=a.quick or preset in a.quick_profile.split(","), source=f"preset:{preset}")
        del eng
    return load_bundle(bdir)


def _scenario_result(a, bundle, sc, load: str, caching: bool, clock: str, trace, warm, twin, scale: float) -> dict:
    """The real engine twice on the trace, each run followed by its simulations; the scenario's result."""
    tag = f"{sc.preset}-{load}-{'on' if caching else 'off'}-{clock}"
    reals, runs, errors = [], [], {"probe": [], "static": []}
    for n in (1, 2):
        print(f"[{tag}] real replay {n} of 2 ({trace[-1].arrival_time:.1f} s of arrivals)",
              file=sys.stderr, flush=True)
        real, run, errs = replay_once(a, bundle, sc, caching, trace, warm, twin, clock, f"{tag}-{n}")
        reals.append(real)
        runs.append(run)
        for v in errors:
            errors[v] += errs[v]
    spread = compare(reals[0], reals[1])
    return {"preset": sc.preset, "load": load, "caching": caching, "clock": clock,
            "requests": len(trace), "scale": scale, "runs": runs, "real_vs_real": spread,
            "step_errors": {v: error_summary(e) for v, e in errors.items()},
            "end_to_end": end_to_end([r["compare"]["probe"] for r in runs], spread)}


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    os.makedirs(a.out, exist_ok=True)
    out_json = os.path.join(a.out, "validation.json")
    results = _earlier_results(out_json)
    for preset in a.presets.split(","):
        sc = preset_scenario(preset, a.quick)
        if a.sessions:
            sc = replace(sc, spec=replace(sc.spec, num_sessions=a.sessions))
        bundle = _bundle(a, preset, sc)
        vocab = ModelConfig.from_hf(bundle.config).vocab_size  # the text model's, also in a multimodal config
        base = agent_trace(replace(sc.spec, vocab=min(vocab, 4000)))
        twin_base = agent_trace(replace(sc.spec, vocab=min(vocab, 4000), seed=sc.spec.seed + 1))  # the probe's
        warm = warmup_requests(sc.warmup, vocab)
        scales = pick_scales(bundle, sc.engine, base)
        wpc_bundle = float(bundle.calibration.get("wall_per_cpu", 1.0))
        print(f"[{preset}] {len(base)} requests; arrival scales {scales}", file=sys.stderr, flush=True)
        for load in a.loads.split(","):
            base_trace = scaled(base, scales[load])
            write_trace(os.path.join(a.out, f"trace-{preset}-{load}.jsonl"), base_trace)
            for caching in [c == "on" for c in a.caching.split(",")]:
                for clock in a.clocks.split(","):
                    # the wall-clock replays stretch the arrivals by the bundle's wall/CPU contention
                    trace = base_trace if clock == "cpu" else scaled(base_trace, wpc_bundle)
                    twin = scaled(twin_base, scales[load] * (1.0 if clock == "cpu" else wpc_bundle))
                    res = _scenario_result(a, bundle, sc, load, caching, clock, trace, warm, twin, scales[load])
                    _keep(results, res)
                    for table in (format_fidelity, format_step_errors, format_end_to_end):
                        print("\n".join(table([res]).splitlines()[2:]), file=sys.stderr, flush=True)
                    with open(out_json, "w") as f:
                        json.dump({"results": results, "bars_pct": BARS}, f, indent=2, default=str)
    text = report(results)
    with open(os.path.join(a.out, "validation.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0 if all(run["fidelity"]["identical"] for r in results for run in r["runs"]) else 1
