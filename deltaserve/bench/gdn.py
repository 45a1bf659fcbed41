"""`deltaserve bench gdn`: one GDN layer's chunked gated delta rule, and its causal conv with the silu, over a prefill
chunk through the torch path (ops/gdn.py chunk_gated_delta_rule, ops/conv.py causal_conv1d_prefill) and through the
compiled kernels (ops/csrc/gdn_prefill.cpp, conv_prefill.cpp) of each instruction set in --cpu-isa, side by side in
one run.

The preset's GDN geometry (key heads, value heads, head dims, conv channels and taps), random bf16 q / k / v, decays
and betas, an initial state, the conv's input as a column slice of a wider matrix (as the in_proj output is), for
each token count: the arms alternate call by call and the best of --repeats is kept. Prints ms per call for each arm
and the torch time over each compiled one.
"""
from __future__ import annotations

import argparse
import functools

import torch

from ..config import ModelConfig
from ..model.ops.conv import causal_conv1d_prefill
from ..model.ops.cpu_kernels import resolve_isa, select_decode_kernels
from ..model.ops.gdn import chunk_gated_delta_rule
from ..presets import load_preset
from ..runner.platform import tune_allocator
from .attention import alternate
from .linear import isa_list


def run(preset: str, tokens: list[int], repeats: int, isas: list[str] | None = None) -> list[dict]:
    tune_allocator()  # as the engine: the torch arm's large temporaries are not mmapped and faulted per call

    isas = [resolve_isa(i) for i in (isas or [None])]
    kernels = {i: select_decode_kernels("cpu", torch.bfloat16, "cpp", i) for i in isas}
    missing = [i for i, k in kernels.items() if not k.gdn_prefill_compiled]
    if missing:
        raise SystemExit(f"no compiled chunked gated delta rule in the {', '.join(missing)} build (the generic one has none)")
    cfg = ModelConfig.from_hf(load_preset(preset))
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    gen = torch.Generator().manual_seed(0)
    arms = {"torch": chunk_gated_delta_rule, **{i: k.chunk_gated_delta_rule for i, k in kernels.items()}}
    conv_arms = {"torch": causal_conv1d_prefill, **{i: k.conv_prefill for i, k in kernels.items()}}
    C, taps = cfg.conv_dim, cfg.linear_conv_kernel_dim
    out = []
    for n in tokens:
        q = torch.randn(n, hk, dk, generator=gen).to(torch.bfloat16)
        k = torch.randn(n, hk, dk, generator=gen).to(torch.bfloat16)
        v = torch.randn(n, hv, dv, generator=gen).to(torch.bfloat16)
        g = -torch.rand(n, hv, generator=gen) * 0.3
        beta = torch.rand(n, hv, generator=gen).to(torch.bfloat16)
        state = torch.randn(hv, dv, dk, generator=gen) * 0.1
        best = alternate({a: functools.partial(f, q, k, v, g, beta, state, start_pos=0) for a, f in arms.items()},
                         repeats)
        x = torch.randn(n, C + 2 * hv, generator=gen).to(torch.bfloat16)[:, :C]  # [n, C], row stride C + 2 hv
        w = torch.randn(C, taps, generator=gen).to(torch.bfloat16)
        conv_best = alternate({a: functools.partial(f, x, w) for a, f in conv_arms.items()}, repeats)
        out.append({"tokens": n, "ms": {a: 1e3 * t for a, t in best.items()},
                    "conv_ms": {a: 1e3 * t for a, t in conv_best.items()}, "isas": isas,
                    "heads": (hk, hv, dk, dv), "conv": (C, taps), "threads": torch.get_num_threads()})
    return out


def render(preset: str, results: list[dict]) -> str:
    hk, hv, dk, dv = results[0]["heads"]
    isas = results[0]["isas"]
    head = ["| tokens | torch |" + "".join(f" compiled {i} |" for i in isas) + "".join(f" torch / {i} |" for i in isas),
            "|---|---|" + "---|" * (2 * len(isas))]
    lines = [f"chunked gated delta rule of one {preset} GDN layer ({hk} key heads, {hv} value heads, dims {dk} / {dv}; "
             f"{results[0]['threads']} torch threads; ms per call)", "", *head]

    def rows(key):
        for r in results:
            ms = r[key]
            lines.append(f"| {r['tokens']} |" + "".join(f" {ms[a]:.2f} |" for a in ["torch", *isas])
                         + "".join(f" {ms['torch'] / ms[i]:.2f}x |" for i in isas))

    rows("ms")
    C, taps = results[0]["conv"]
    lines += ["", f"causal conv with its silu, same layer ({C} channels, {taps} taps; ms per call)", "", *head]
    rows("conv_ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="deltaserve bench gdn", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--tokens", default="64,512,2048", help="prefill chunk lengths, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cpu-isa", default=None, type=isa_list,
                   help="the compiled arms' instruction sets, comma-separated (avx512bf16,avx512; default: the one "
                        "the engine picks on this CPU)")
    a = p.parse_args(argv)
    tokens = [int(x) for x in a.tokens.split(",") if x.strip()]
    if not tokens or min(tokens) < 1:
        p.error(f"--tokens: positive counts, not {a.tokens!r}")
    print(render(a.preset, run(a.preset, tokens, a.repeats, a.cpu_isa)))
    return 0
