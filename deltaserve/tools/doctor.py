"""`deltaserve doctor`: what this machine gets, without loading a model.

    deltaserve doctor [--memory BYTES] [--json]
    deltaserve doctor --build     compile every kernel build this CPU executes now (make test runs it first)

The instruction set the kernels would be built for and why, which compiled builds are already in torch's
extension cache (a first `serve` builds the missing one), the memory, and for each shipped model shape
(presets/) and each weight format (bf16, block-FP8) whether its weights fit and the longest context one
request then gets, by the planner's arithmetic (tools/planner.py, the sizing the engine uses); and which
agent CLIs are installed. Nothing is compiled and no weights are read.

The fit rule: weights + the cache must stay within FIT_FRACTION of the memory (the rest for activations, the
tokenizer, the OS); the context is the planner's pool for one request of `runs` pages, capped at the
model's max_position_embeddings. `serve` sizes its pool from --kv-cache-memory, else --memory-utilization
of what is free after the weights (at most 2 GiB on a CPU): a context longer than the default pool gives
needs --kv-cache-memory, and the report prints the flag.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
from typing import Any

from ..config import parse_bytes
from ..memory.resident import host_memory
from ..presets import preset_names

FIT_FRACTION = 0.8
FORMATS = ("bf16", "fp8")  # weight formats the engine loads (fp8: Qwen's block-FP8 checkpoints)


def model_fits(memory: int) -> list[dict[str, Any]]:
    """For each preset shape and weight format: weights, whether they fit `memory`, the cache budget left and
    the context one request gets from it (planner.plan)."""
    from .planner import plan

    rows = []
    for name in preset_names():
        for fmt in FORMATS:
            r = plan(name, device_memory=memory, gpu_memory_utilization=FIT_FRACTION,
                     quantization="fp8" if fmt == "fp8" else None, max_num_seqs=1)
            budget = r["budget_bytes"] or 0
            pool = r["pools"]["runs"]
            context = min(r["max_model_len"], pool["pool_tokens"]) if budget > 0 and pool["num_pages"] >= 2 else 0
            # the pool one request of that context needs (its pages and its GDN slot), at most the budget
            need = min(budget, pool["pages_per_seq"] * pool["bytes_per_page"] + pool["slot_bytes"])
            rows.append({"model": name, "format": fmt, "weight_bytes": r["weight_bytes"], "cache_budget": budget,
                         "cache_needed": need, "fits": context > 0, "context": context,
                         "max_position_embeddings": r["max_model_len"]})
    return sorted(rows, key=lambda m: (m["weight_bytes"], m["format"]))


def kernels() -> dict[str, Any]:
    """The instruction set auto picks and why, and each executable set's build: in the cache or not."""
    from ..model.ops import cpu_kernels as ck
    from ..model.ops import fp8
    from ..model.ops.build_notice import last_build_seconds, needs_build

    runs = ck.executable_isas()
    try:
        chosen, why = ck.resolve_isa("auto"), None
    except ValueError as e:
        chosen, why = None, str(e)
    sources = [str(p) for p in ck._SOURCES]
    builds = {}
    for isa in runs:
        build = ck.ISA_BUILD.get(isa, isa)
        what = f"the {build} CPU kernels ({len(sources)} C++ files)"
        builds[isa] = {"build": build, "built": not needs_build(ck.build_name("deltaserve_kernels", build), sources),
                       "last_build_seconds": last_build_seconds(what)}
    fp8_builds = {b: not needs_build(ck.build_name("deltaserve_fp8_kernels", b), [str(f) for f in fp8._SOURCES])
                  for b in fp8.executable_builds()}
    skipped = {i: ck._why_not(i, ck.cpu_flags()) for i in ck.ISAS if i not in runs}
    return {"machine": platform.machine(), "chosen": chosen, "refused": why, "executable": list(runs),
            "not_executable": skipped, "what": ck.ISA_WHAT.get(chosen or "", ""), "builds": builds,
            "fp8_builds": fp8_builds, "forced": os.environ.get(ck.ISA_ENV) or os.environ.get(ck.ENV)}


def agent_clis() -> dict[str, str | None]:
    """Each agent CLI's command where it is installed (on PATH, or where scripts/setup_agents.sh puts it)."""
    from ..bench.clis.clients import CLIENTS

    return {c.label: (shutil.which(c.name) or (c.command() if c.installed() else None)) for c in CLIENTS.values()}


def report(memory: int | None = None) -> dict[str, Any]:
    total, available = host_memory()
    planned = memory if memory is not None else available
    import torch

    return {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "cuda": torch.cuda.is_available(),
            "memory_total": total, "memory_available": available, "memory_planned": planned,
            "kernels": kernels(), "models": model_fits(planned), "agents": agent_clis()}


def _gb(n: int) -> str:
    return f"{n / 1e9:,.1f} GB"


def format_report(r: dict[str, Any]) -> str:
    k = r["kernels"]
    out = [f"machine: {k['machine']}, {r['cpus']} CPUs (torch uses {r['torch_threads']} threads)"
           + (", a CUDA device" if r["cuda"] else ", no CUDA device"),
           f"memory:  {_gb(r['memory_total'])} total, {_gb(r['memory_available'])} available; planned for "
           f"{_gb(r['memory_planned'])}", ""]
    if k["chosen"]:
        out.append(f"kernels: {k['chosen']} ({k['what']}), the fastest of {', '.join(k['executable'])} this CPU "
                   "executes" + (f"; {k['forced']} is set in the environment" if k["forced"] else ""))
    else:
        out.append(f"kernels: none compiled ({k['refused']}); the plain-torch ops run instead")
    for isa, why in k["not_executable"].items():
        out.append(f"  not {isa}: {why}")
    for isa, b in k["builds"].items():
        last = f", {b['last_build_seconds']:.0f} s last time" if b["last_build_seconds"] else ""
        state = "built" if b["built"] else f"not built yet (the first serve compiles it{last})"
        out.append(f"  {isa:<11} build {b['build']}: {state}")
    fp8_state = (f"{b} {'built' if ok else 'not built'}" for b, ok in k["fp8_builds"].items())
    out.append("  fp8 linear: " + ", ".join(fp8_state))
    out += ["", f"models (weights + cache within {FIT_FRACTION:.0%} of {_gb(r['memory_planned'])}; "
                "context: one request alone in the pool):"]
    out.append(f"  {'model':<22}{'format':<8}{'weights':>11}   context")
    for m in r["models"]:
        if m["fits"]:
            ctx = f"{m['context']:,} tokens" + (" (the model's own)" if m["context"] >= m["max_position_embeddings"]
                                                 else "")
            ctx += f"  with --kv-cache-memory {-(-m['cache_needed'] // (1 << 20))}MiB"
        else:
            ctx = "does not fit"
        out.append(f"  {m['model']:<22}{m['format']:<8}{_gb(m['weight_bytes']):>11}   {ctx}")
    for fmt in FORMATS:
        fits = [m for m in r["models"] if m["fits"] and m["format"] == fmt]
        best = max(fits, key=lambda m: m["weight_bytes"]) if fits else None
        out.append(f"  largest in {fmt}: " + (f"{best['model']}, {best['context']:,} tokens of context" if best
                                              else "none of these shapes"))
    out += ["", "agent CLIs (scripts/setup_agents.sh installs all four):"]
    for label, where in r["agents"].items():
        out.append(f"  {label:<12} {where or 'not installed'}")
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deltaserve doctor",
                                description="what this machine gets (kernels, memory, models that fit, agent CLIs), "
                                            "without loading a model")
    p.add_argument("--memory", type=parse_bytes, default=None, metavar="BYTES",
                   help="plan the models for this much memory instead of what is available now (e.g. 64G)")
    p.add_argument("--json", action="store_true", help="the report as JSON")
    p.add_argument("--build", action="store_true",
                   help="compile every kernel build this CPU executes (into torch's extension cache) and exit: "
                        "non-zero with the compiler's message when one fails")
    return p


def build_all() -> list[tuple[str, float | Exception]]:
    """Compile (or load from torch's cache) every build of the project's C++ this CPU executes: the kernels of
    each executable instruction set and each fp8 / int4 linear build. A build is what an install makes, like a
    wheel's extension: the tests and the first serve then load it instead of compiling inside a timed run.
    Returns (what, seconds or the exception) per build."""
    import time

    from ..model.ops import cpu_kernels as ck
    from ..model.ops import fp8

    jobs = [(f"kernels {ck.ISA_BUILD.get(i, i)}", lambda i=i: ck.load_extension(i)) for i in ck.executable_isas()
            if ck.ISA_BUILD.get(i, i) == i]
    jobs += [(f"fp8/int4 linear {b}", lambda b=b: fp8.load_fp8_extension(b)) for b in fp8.executable_builds()]
    out = []
    for what, load in jobs:
        t0 = time.perf_counter()
        try:
            load()
            out.append((what, time.perf_counter() - t0))
        except Exception as e:  # noqa: BLE001 - reported with the compiler's message, then a non-zero exit
            out.append((what, e))
    return out


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if a.build:
        failed = 0
        for what, r in build_all():
            if isinstance(r, Exception):
                failed += 1
                print(f"{what}: FAILED\n{r}", file=sys.stderr)
            else:
                print(f"{what}: ready ({r:.0f} s)")
        return 1 if failed else 0
    r = report(a.memory)
    print(json.dumps(r, indent=1) if a.json else format_report(r))
    return 0
