"""`deltaserve bench attention`: one attention layer's prefill attention through the torch path (SDPA per 64-row
query tile, ops/attention.py) and through the compiled kernel (ops/csrc/prefill_attention.cpp, the avx512bf16
build), side by side in one run.

The preset's attention geometry (query heads, kv heads, head dim), random bf16 q / k / v, for each (queries,
cached context) shape: the arms alternate call by call and the best of --repeats is kept. Prints ms per call for
each arm, the GFLOP/s of causal work (4 * heads * dim multiply-adds per query-key pair, keys up to the query's
own position) and the torch time over the compiled one.
"""
from __future__ import annotations

import argparse
import time


def run(preset: str, shapes: list[tuple[int, int]], repeats: int) -> list[dict]:
    import torch

    from ..config import ModelConfig
    from ..model.ops.attention import prefill_attention
    from ..model.ops.cpu_kernels import cannot_execute, load_extension
    from ..presets import load_preset

    why = cannot_execute("avx512bf16")
    if why:
        raise SystemExit(f"the compiled prefill attention needs the avx512bf16 build: {why}")
    ext = load_extension("avx512bf16")
    cfg = ModelConfig.from_hf(load_preset(preset))
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    gen = torch.Generator().manual_seed(0)
    arms = {"torch": prefill_attention, "compiled": ext.prefill_attention}
    out = []
    for n, prior in shapes:
        q = torch.randn(n, hq, d, generator=gen).to(torch.bfloat16)
        k = torch.randn(prior + n, hkv, d, generator=gen).to(torch.bfloat16)
        v = torch.randn(prior + n, hkv, d, generator=gen).to(torch.bfloat16)
        best = {a: float("inf") for a in arms}
        for _ in range(repeats + 1):  # the first call of each arm warms up
            for a, f in arms.items():
                t = time.perf_counter()
                f(q, k, v, prior, d ** -0.5)
                best[a] = min(best[a], time.perf_counter() - t)
        gflop = 4 * hq * d * (n * prior + n * (n + 1) // 2) / 1e9
        out.append({"queries": n, "prior": prior, "torch_ms": 1e3 * best["torch"], "compiled_ms": 1e3 * best["compiled"],
                    "gflop": gflop, "ratio": best["torch"] / best["compiled"], "heads": (hq, hkv, d),
                    "threads": torch.get_num_threads()})
    return out


def render(preset: str, results: list[dict]) -> str:
    hq, hkv, d = results[0]["heads"]
    lines = [f"prefill attention of one {preset} attention layer ({hq} query heads, {hkv} kv heads, head dim {d}; "
             f"{results[0]['threads']} torch threads; ms per call (GFLOP/s))", "",
             "| queries | cached context | torch (SDPA tiles) | compiled | torch / compiled |", "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['queries']} | {r['prior']} | {r['torch_ms']:.2f} ({r['gflop'] / r['torch_ms'] * 1e3:.0f}) | "
                     f"{r['compiled_ms']:.2f} ({r['gflop'] / r['compiled_ms'] * 1e3:.0f}) | {r['ratio']:.2f}x |")
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
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    a = p.parse_args(argv)
    if a.threads:
        import torch
        torch.set_num_threads(a.threads)
    print(render(a.preset, run(a.preset, a.shapes, a.repeats)))
    return 0
