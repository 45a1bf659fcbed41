"""`deltaserve bench linear`: the bf16 projections of a preset through oneDNN's prepacked linear and through
the compiled linear_bf16 (ops/csrc/linear_bf16.cpp), side by side in one run.

Every projection of the model and its head, each with its own weights (so a pass streams them all from memory
as a decode step does), at several row counts; the two arms alternate pass by pass and the best of --repeats is
kept. Prints one row per row count: ms per pass for each arm and their ratio.
"""
from __future__ import annotations

import argparse
import time


def _weights(preset: str):
    """(name, [out, in] bf16 weight) for every packable projection and the head of the preset's model."""
    from ..embedded import ensure_model
    from ..model.loader import load_model

    model = load_model(ensure_model(preset), dtype="bfloat16", prepack=False)
    out = []
    for mname, module in model.named_modules():
        for n in getattr(module, "PACKABLE", ()):
            w = module._parameters.get(n)
            if w is not None and w.dim() == 2:
                out.append((f"{mname}.{n}", w.detach()))
    out.append(("head", (model.embed_tokens if model.tied else model.lm_head).detach()))
    return out


def run(preset: str, rows: list[int], repeats: int) -> list[dict]:
    import torch

    from ..model.ops.cpu_kernels import load_extension
    from ..model.ops.linear import PackedWeight, linear

    ext = load_extension()
    if not ext.bf16_linear_available():
        raise SystemExit("this CPU has no AVX512-BF16: the compiled linear is not built here")
    weights = _weights(preset)
    arms = {"onednn": [PackedWeight(w) for _, w in weights], "compiled": [PackedWeight(w, ext) for _, w in weights]}
    gbytes = sum(w.numel() * 2 for _, w in weights) / 1e9
    results = []
    for m in rows:
        xs = {k: torch.randn(m, k, dtype=torch.bfloat16) for k in {w.shape[1] for _, w in weights}}
        best = {a: float("inf") for a in arms}
        for _ in range(repeats + 1):  # the first pass of each arm warms up
            for arm, packed in arms.items():
                t = time.perf_counter()
                for p in packed:
                    linear(xs[p.shape[1]], p)
                best[arm] = min(best[arm], time.perf_counter() - t)
        results.append({"rows": m, "onednn_ms": 1e3 * best["onednn"], "compiled_ms": 1e3 * best["compiled"],
                        "ratio": best["onednn"] / best["compiled"], "weights_gb": gbytes,
                        "compiled_gbps": gbytes / best["compiled"]})
    return results


def render(preset: str, results: list[dict]) -> str:
    lines = [f"bf16 projections + head of {preset} ({results[0]['weights_gb']:.2f} GB of weights per pass)", "",
             "| rows | oneDNN prepacked ms | compiled linear_bf16 ms | oneDNN / compiled | compiled GB/s |",
             "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['rows']} | {r['onednn_ms']:.1f} | {r['compiled_ms']:.1f} | {r['ratio']:.2f}x | "
                     f"{r['compiled_gbps']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="deltaserve bench linear", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3.5-0.8b-shape")
    p.add_argument("--rows", default="1,8,32", help="row counts (tokens per GEMM), comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    rows = [int(x) for x in a.rows.split(",") if x]
    print(render(a.preset, run(a.preset, rows, a.repeats)))
    return 0
