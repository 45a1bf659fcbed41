"""`deltaserve bench linear`: the bf16 projections of a preset through oneDNN's prepacked linear and through
the compiled linear_bf16 (ops/csrc/linear_bf16.cpp; linear_bf16_amx.cpp for the amx set), side by side in one
run.

Every projection of the model and its head, each with its own weights (so a pass streams them all from memory
as a decode step does), at several row counts; the arms alternate pass by pass and the best of --repeats is
kept. Prints one row per row count: ms per pass for each arm (with its GFLOP/s and the GB/s of weights it
streams) and oneDNN's time over each compiled arm's. --cpu-isa takes several sets (`amx,avx512bf16`): one
compiled arm each, the first the one the ratios and --fp8 compare with. --fp8 adds one more arm: every
projection quantized to block-FP8 as `make-model --quantize fp8` does, through the compiled linear_fp8, with the
head kept bf16 (compiled linear_bf16), as Qwen's FP8 checkpoints keep it.
"""
from __future__ import annotations

import argparse
import time

import torch

from ..embedded.model import ensure_model
from ..model.loader import load_model
from ..model.ops.cpu_kernels import ISAS, load_extension, resolve_isa
from ..model.ops.fp8 import Fp8Weight, build_for, executable_builds, load_fp8_extension, path_for, quantize_fp8
from ..model.ops.int4 import Int4Weight
from ..model.ops.linear import linear
from ..model.ops.packed import PackedWeight
from ..runner.platform import tune_allocator


def _weights(preset: str):
    """(name, [out, in] bf16 weight) for every packable projection and the head of the preset's model."""

    model = load_model(ensure_model(preset), dtype="bfloat16", prepack=False)
    out = []
    for mname, module in model.named_modules():
        for n in getattr(module, "PACKABLE", ()):
            w = module._parameters.get(n)
            if w is not None and w.dim() == 2:
                out.append((f"{mname}.{n}", w.detach()))
    out.append(("head", (model.embed_tokens if model.tied else model.lm_head).detach()))
    return out


def _fp8_arm(weights, ext) -> list:
    """The fp8 arm's weights: each projection quantized and packed for linear_fp8 as the engine runs it on ext's
    instruction set (its fp8 build, build_for; the amx path on the amx set), the head compiled bf16."""

    fp8_ext = load_fp8_extension(build_for(ext.kernel_isa()))
    path = path_for(fp8_ext, ext.kernel_isa())
    arm = []
    for name, w in weights:
        if name == "head":
            arm.append(PackedWeight(w, ext))
            continue
        fw = Fp8Weight.from_block_scales(*quantize_fp8(w), name)
        fw.pack(fp8_ext, path)
        arm.append(fw)
    return arm


def _int4_arm(weights, build_path: str) -> list:
    """An int4 arm's weights: each projection and the head quantized as --quantize int4 --quantize-head int4 does
    (groups of 128 with a zero point), packed by the fp8 / int4 build `build` and run on its linear_int4 path
    (`build/path`, e.g. avx2/int4:avx-vnni; fp8.executable_builds() and each build's int4_paths() list them)."""
    build, _, path = build_path.partition("/")
    ext = load_fp8_extension(build)
    if path not in ext.int4_paths():
        raise SystemExit(f"--int4-paths: {build_path} is not a path here; this CPU has "
                         + ", ".join(f"{b}/{q}" for b in executable_builds() for q in load_fp8_extension(b).int4_paths()))
    arm = []
    for _, w in weights:
        q = Int4Weight.quantize(w, 128, sym=False)
        q.pack(ext, path)
        arm.append(q)
    return arm


def run(preset: str, rows: list[int], repeats: int, fp8: bool = False,
        isa: str | list[str] | None = None, int4_paths: list[str] = ()) -> list[dict]:
    """isa: the compiled kernels' instruction set, or several (cpu_kernels.load_extension's; None = this CPU's
    choice); the first is "compiled" in the results, every one is in r["arms"] (ms per pass). int4_paths: an int4
    arm per `build/path` (_int4_arm), in r["int4"] (ms per pass)."""


    tune_allocator()  # as the engine: the head's output at 512 rows (254 MB) is not mmapped and faulted per call
    isas = [resolve_isa(i) for i in (isa if isinstance(isa, list) else [isa])]
    exts = {i: load_extension(i) for i in isas}
    if not all(e.bf16_linear_available() for e in exts.values()):
        raise SystemExit("the compiled linear is not built for this CPU (it needs AVX2 + FMA or AVX-512)")
    weights = _weights(preset)
    arms = {"onednn": [PackedWeight(w) for _, w in weights]}
    arms.update({i: [PackedWeight(w, e) for _, w in weights] for i, e in exts.items()})
    if fp8:
        arms["fp8"] = _fp8_arm(weights, exts[isas[0]])
    for bp in int4_paths:
        arms[f"int4 {bp}"] = _int4_arm(weights, bp)
    gbytes = sum(w.numel() * 2 for _, w in weights) / 1e9
    params = sum(w.numel() for _, w in weights)
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
        first = best[isas[0]]
        r = {"rows": m, "onednn_ms": 1e3 * best["onednn"], "compiled_ms": 1e3 * first,
             "ratio": best["onednn"] / first, "weights_gb": gbytes, "compiled_gbps": gbytes / first,
             "isa": isas[0], "isas": isas, "threads": torch.get_num_threads(), "gflop": 2 * m * params / 1e9,
             "arms": {a: 1e3 * best[a] for a in ["onednn", *isas]}}
        if fp8:
            r.update(fp8_ms=1e3 * best["fp8"], fp8_ratio=first / best["fp8"])
        r["int4"] = {bp: 1e3 * best[f"int4 {bp}"] for bp in int4_paths}
        results.append(r)
    return results


def render(preset: str, results: list[dict]) -> str:
    r0 = results[0]
    isas, fp8 = r0["isas"], "fp8_ms" in r0
    lines = [f"bf16 projections + head of {preset} ({r0['weights_gb']:.2f} GB of weights per pass; linear_bf16 built "
             f"for {', '.join(isas)}; {r0['threads']} torch threads; ms per pass (GFLOP/s, weight GB/s))", "",
             "| rows | oneDNN prepacked |" + "".join(f" compiled {i} |" for i in isas)
             + "".join(f" oneDNN / {i} |" for i in isas)
             + (f" fp8 (linear_fp8, bf16 head) ms | fp8 speed / {isas[0]} |" if fp8 else "")
             + "".join(f" int4 {bp} ms |" for bp in r0["int4"]),
             "|---|---|" + "---|" * (2 * len(isas)) + ("---|---|" if fp8 else "") + "---|" * len(r0["int4"])]

    def cell(ms: float, r: dict) -> str:
        return f"{ms:.1f} ({r['gflop'] / ms * 1e3:.0f}, {r['weights_gb'] / ms * 1e3:.1f})"

    for r in results:
        arms = r["arms"]
        lines.append(f"| {r['rows']} | {cell(arms['onednn'], r)} |" + "".join(f" {cell(arms[i], r)} |" for i in isas)
                     + "".join(f" {arms['onednn'] / arms[i]:.2f}x |" for i in isas)
                     + (f" {r['fp8_ms']:.1f} | {r['fp8_ratio']:.2f}x |" if fp8 else "")
                     + "".join(f" {ms:.1f} |" for ms in r["int4"].values()))
    return "\n".join(lines)


def isa_list(s: str) -> list[str]:
    out = [x.strip() for x in s.split(",") if x.strip()]
    if not out or any(x not in ISAS for x in out) or len(set(out)) < len(out):
        raise argparse.ArgumentTypeError(f"--cpu-isa: distinct names from {', '.join(ISAS)}, not {s!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="deltaserve bench linear", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3.5-0.8b-shape")
    p.add_argument("--rows", default="1,8,32", help="row counts (tokens per GEMM), comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--fp8", action="store_true", help="add the block-FP8 arm (linear_fp8; the head stays bf16)")
    p.add_argument("--cpu-isa", default=None, type=isa_list,
                   help="the compiled linear's instruction set, or several comma-separated (amx,avx512bf16): one "
                        "arm each, the first compared with --fp8 (default: the one the engine picks on this CPU)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--int4-paths", default="", help="int4 arms, comma-separated build/path (avx2/int4:avx-vnni, "
                   "avx2/int4:avx2, avx512/int4:amx, ...): every projection and the head in int4 on that path")
    a = p.parse_args(argv)
    rows = [int(x) for x in a.rows.split(",") if x]
    if a.threads:
        torch.set_num_threads(a.threads)
    int4 = [x.strip() for x in a.int4_paths.split(",") if x.strip()]
    print(render(a.preset, run(a.preset, rows, a.repeats, a.fp8, a.cpu_isa, int4)))
    return 0
