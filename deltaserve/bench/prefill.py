"""`deltaserve bench prefill`: one prefill step of a preset's model, op by op.

The engine is built as `deltaserve serve` builds it (its kernels, its linears, the allocator tuned), and one
sequence of --tokens tokens (from position 0, into a fresh slot) runs through the model's forward: plain, then on
the profiler's timed op table (profile/instrument.py Instrument, the one `deltaserve profile` uses), --repeats times.
Each op's self time is the median over the timed forwards, scaled so that they add up to the median plain forward.
Prints the step's time and tokens/s, then each kernel's share, largest first: where a prefill spends its time.
"""
from __future__ import annotations

import argparse
import types

from .serve import in_process


def run(preset: str, tokens: int, repeats: int, cpu_isa: str = "auto", fp8: bool = False) -> dict:
    from ..embedded.model import ensure_model
    from ..profile.profiler import Profiler

    llm = in_process({"model": ensure_model(preset, quantize="fp8" if fp8 else None), "dtype": "bfloat16",
                      "kv_cache_memory": 1 << 30, "max_num_seqs": 4, "max_num_batched_tokens": tokens,
                      "enable_prefix_caching": False, "cpu_isa": cpu_isa})
    prof = Profiler(llm.engine, types.SimpleNamespace(repeats=repeats), progress=False, timer="wall")
    ev, total_us = prof.forward_profile(prof.work([(tokens, 0, False)]))
    kernels = sorted(prof.by_kernel(ev).items(), key=lambda kv: -kv[1])
    return {"preset": preset, "tokens": tokens, "total_ms": total_us / 1e3, "fp8": fp8,
            "isa": llm.engine.cpu_kernels, "kernels": [(k, us / 1e3) for k, us in kernels]}


def render(r: dict) -> str:
    total = r["total_ms"]
    lines = [f"one {r['tokens']}-token prefill of {r['preset']}{' (FP8)' if r['fp8'] else ''} (cpu kernels: "
             f"{r['isa']}): {total:.1f} ms, {r['tokens'] / total * 1e3:,.0f} tok/s", "",
             "| kernel | ms | share |", "|---|---|---|"]
    lines += [f"| {k} | {ms:.2f} | {100 * ms / total:.1f}% |" for k, ms in r["kernels"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="deltaserve bench prefill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cpu-isa", default="auto")
    p.add_argument("--fp8", action="store_true", help="the preset's FP8 checkpoint (make-model --quantize fp8)")
    a = p.parse_args(argv)
    if a.tokens < 1 or a.repeats < 1:
        p.error("--tokens and --repeats must be positive")
    print(render(run(a.preset, a.tokens, a.repeats, a.cpu_isa, a.fp8)))
    return 0
