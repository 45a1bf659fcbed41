"""`deltaserve bench attention`: one attention layer's prefill attention through the torch path (SDPA per 64-row
query tile, ops/attention.py) and through the compiled kernel (ops/csrc/prefill_attention.cpp) of each
instruction set in --cpu-isa, side by side in one run.

The preset's attention geometry (query heads, kv heads, head dim), random bf16 q / k / v, for each (queries,
cached context) shape: the arms alternate call by call and the best of --repeats is kept. Prints ms per call for
each arm, the GFLOP/s of causal work (4 * heads * dim multiply-adds per query-key pair, keys up to the query's
own position) and the torch time over each compiled one. torch picks its own kernels from the CPU (set
ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 to see what it runs on an AVX2-only CPU).
"""
from __future__ import annotations

import argparse
import functools
import time
from typing import Callable

import torch

from ..config import ModelConfig
from ..model.ops.attention import prefill_attention
from ..model.ops.cpu_kernels import load_extension, resolve_isa
from ..presets import load_preset
from ..runner.platform import tune_allocator
from .linear import isa_list


def alternate(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """The best seconds per call of each arm over repeats + 1 rounds, the arms taking turns call by call (the extra
    round warms up; a warm-up slower than the rest never wins the min)."""
    best = {a: float("inf") for a in calls}
    for _ in range(repeats + 1):
        for a, f in calls.items():
            t = time.perf_counter()
            f()
            best[a] = min(best[a], time.perf_counter() - t)
    return best


def run(preset: str, shapes: list[tuple[int, int]], repeats: int, isas: list[str] | None = None) -> list[dict]:
    """isas: the compiled arms' instruction sets (default: the one the engine picks on this CPU)."""


    tune_allocator()  # as the engine: the torch arm's large temporaries are not mmapped and faulted per call

    isas = [resolve_isa(i) for i in (isas or [None])]
    exts = {i: load_extension(i) for i in isas}
    missing = [i for i, e in exts.items() if not e.prefill_attention_available()]
    if missing:
        raise SystemExit(f"no compiled prefill attention in the {', '.join(missing)} build (the generic one has none)")
    cfg = ModelConfig.from_hf(load_preset(preset))
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    gen = torch.Generator().manual_seed(0)
    arms = {"torch": prefill_attention, **{i: e.prefill_attention for i, e in exts.items()}}
    out = []
    for n, prior in shapes:
        q = torch.randn(n, hq, d, generator=gen).to(torch.bfloat16)
        k = torch.randn(prior + n, hkv, d, generator=gen).to(torch.bfloat16)
        v = torch.randn(prior + n, hkv, d, generator=gen).to(torch.bfloat16)
        best = alternate({a: functools.partial(f, q, k, v, prior, d ** -0.5) for a, f in arms.items()}, repeats)
        gflop = 4 * hq * d * (n * prior + n * (n + 1) // 2) / 1e9
        out.append({"queries": n, "prior": prior, "ms": {a: 1e3 * t for a, t in best.items()}, "isas": isas,
                    "gflop": gflop, "heads": (hq, hkv, d), "threads": torch.get_num_threads()})
    return out


def render(preset: str, results: list[dict]) -> str:
    hq, hkv, d = results[0]["heads"]
    isas = results[0]["isas"]
    lines = [f"prefill attention of one {preset} attention layer ({hq} query heads, {hkv} kv heads, head dim {d}; "
             f"{results[0]['threads']} torch threads; ms per call (GFLOP/s))", "",
             "| queries | cached context | torch (SDPA tiles) |" + "".join(f" compiled {i} |" for i in isas)
             + "".join(f" torch / {i} |" for i in isas), "|---|---|---|" + "---|" * (2 * len(isas))]
    for r in results:
        ms = r["ms"]
        lines.append(f"| {r['queries']} | {r['prior']} |"
                     + "".join(f" {ms[a]:.2f} ({r['gflop'] / ms[a] * 1e3:.0f}) |" for a in ["torch", *isas])
                     + "".join(f" {ms['torch'] / ms[i]:.2f}x |" for i in isas))
    return "\n".join(lines)


def _shapes(s: str) -> list[tuple[int, int]]:
    try:
        out = [tuple(int(x) for x in part.split("@")) for part in s.split(",") if part.strip()]
    except ValueError:
        out = []
    if not out or any(len(t) != 2 or t[0] < 1 or t[1] < 0 for t in out):
        raise argparse.ArgumentTypeError(f"--shapes: comma-separated QUERIES@CONTEXT pairs (512@0,512@4096), not {s!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="deltaserve bench attention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--shapes", default="512@0,2048@0,512@2048,458@6000", type=_shapes,
                   help="QUERIES@CACHED_CONTEXT pairs, comma-separated")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cpu-isa", default=None, type=isa_list,
                   help="the compiled arms' instruction sets, comma-separated (avx512bf16,avx2; default: the one the "
                        "engine picks on this CPU)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    print(render(a.preset, run(a.preset, a.shapes, a.repeats, a.cpu_isa)))
    return 0
