"""`deltaserve profile`: measure this engine's step costs on this machine into a bundle for the simulator.

    deltaserve profile [--model DIR | --preset NAME] --out DIR [--quick] [engine flags]
    deltaserve profile coverage DIR

The bundle format is documented in deltaserve/sim/bundle.py and docs/simulator.md.
"""
from __future__ import annotations

import argparse
import logging
import sys

from ..config import CACHE_LAYOUTS

log = logging.getLogger("deltaserve.profile")

DEFAULT_KV_BYTES = {"tiny": 256 << 20, "qwen3.5-0.8b-shape": 1536 << 20}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deltaserve profile",
                                description="profile this engine's step costs on this machine into a bundle "
                                            "(`deltaserve profile coverage DIR` reports what a bundle covers)")
    p.add_argument("--model", default=None, help="checkpoint directory (config.json + safetensors)")
    p.add_argument("--preset", default="tiny", help="embedded model preset when --model is not given")
    p.add_argument("--out", required=True, help="bundle directory to write")
    p.add_argument("--quick", action="store_true", help="a coarse grid and 3 repeats (for tests)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per shape (median kept); default 5, quick 3")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (record them; simulate with the same)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--max-num-seqs", type=int, default=16, help="largest decode batch profiled")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="largest token count profiled")
    p.add_argument("--max-context", type=int, default=None, help="longest attention context profiled")
    p.add_argument("--kv-cache-memory", type=int, default=None, help="cache pool bytes of the profiling engine")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--cache-layout", default="runs", choices=CACHE_LAYOUTS)
    p.add_argument("--no-calibrate", action="store_true", help="skip the real-step calibration of the step overhead")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    return p


def make_engine(model: str | None, preset: str, *, dtype: str = "auto", num_threads: int | None = None,
                device: str = "auto", max_num_seqs: int = 16, max_num_batched_tokens: int = 2048,
                kv_cache_memory: int | None = None, block_size: int = 16, cache_layout: str = "runs",
                enable_prefix_caching: bool = True, seed: int = 0):
    from ..config import EngineConfig
    from ..engine import LLMEngine

    kv = kv_cache_memory or DEFAULT_KV_BYTES.get(preset if model is None else "", 1 << 30)
    cfg = EngineConfig(model=model, preset=preset, dtype=dtype, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=max_num_batched_tokens, kv_cache_memory=kv, block_size=block_size,
                       enable_prefix_caching=enable_prefix_caching, cache_layout=cache_layout, seed=seed,
                       num_threads=num_threads, device=device)
    return LLMEngine(cfg)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "coverage":
        from .coverage import main as coverage_main

        return coverage_main(argv[1:])
    a = build_parser().parse_args(argv)
    from .profiler import profile

    eng = make_engine(a.model, a.preset, dtype=a.dtype, num_threads=a.num_threads, device=a.device,
                      max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                      kv_cache_memory=a.kv_cache_memory, block_size=a.block_size, cache_layout=a.cache_layout,
                      seed=a.seed)
    meta = profile(eng, a.out, quick=a.quick, repeats=a.repeats, max_context=a.max_context,
                   calibrate=not a.no_calibrate, progress=not a.no_progress,
                   source=a.model or f"preset:{a.preset}")
    cal = meta.get("calibration") or {}
    print(f"wrote {a.out}: block size {eng.block_size} (tp 1), {meta['hardware']['torch_threads']} threads, "
          f"{meta['profile']['wall_s']} s, load {meta['profile']['load_avg_start']} -> {meta['profile']['load_avg_end']}")
    if cal:
        print(f"calibration ({cal.get('timer')} time): fixed {cal.get('fixed_us')} us + {cal.get('per_seq_us')} us/seq + "
              f"{cal.get('per_prefill_us')} us/prefill span, compute x{cal.get('compute_scale')} (decode x{cal.get('compute_scale_decode')}), wall/cpu "
              f"{cal.get('wall_per_cpu')}; median |error| {cal.get('median_abs_error_pct')}% over {cal.get('steps')} "
              f"steps (total error {cal.get('total_error_pct')}%, uncalibrated {cal.get('uncalibrated_total_error_pct')}%)")
    return 0
