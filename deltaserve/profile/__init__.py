"""`deltaserve profile`: measure this engine's step costs on this machine into a bundle for the simulator.

    deltaserve profile --out DIR [--quick] [engine flags: --model DIR | --preset NAME, --max-num-seqs N, ...]
    deltaserve profile coverage DIR

The bundle format is documented in deltaserve/sim/bundle.py and docs/simulator.md.
"""
from __future__ import annotations

import argparse
import logging
import sys

from ..config import EngineConfig, add_engine_args, engine_args
from ..errors import ConfigError
from .coverage import main as coverage_main

log = logging.getLogger("deltaserve.profile")

# the profiling engine's pool when --kv-cache-memory is not given: enough for the grid's contexts, small enough
# to zero quickly (a pool sized from the machine's memory would take gigabytes here)
DEFAULT_KV_BYTES = {"tiny": 256 << 20, "qwen3.5-0.8b-shape": 1536 << 20}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deltaserve profile",
                                description="profile this engine's step costs on this machine into a bundle "
                                            "(`deltaserve profile coverage DIR` reports what a bundle covers). The "
                                            "engine flags are the served engine's: --max-num-seqs is the largest "
                                            "decode batch profiled, --max-num-batched-tokens the largest token "
                                            "count; --kv-cache-memory defaults to a pool sized for the grid")
    p.add_argument("--out", required=True, help="bundle directory to write")
    p.add_argument("--quick", action="store_true", help="a coarse grid and 3 repeats (for tests)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per shape (median kept); default 5, quick 3")
    p.add_argument("--max-context", type=int, default=None, help="longest attention context profiled")
    p.add_argument("--no-calibrate", action="store_true", help="skip the real-step calibration of the step overhead")
    p.add_argument("--no-progress", action="store_true")
    add_engine_args(p)
    return p


def make_engine(**flags):
    """The profiling engine: an LLMEngine with these engine flags (EngineConfig names), its pool DEFAULT_KV_BYTES
    for the preset unless kv_cache_memory is given."""
    from ..engine.llm_engine import LLMEngine  # torch: `profile coverage` imports this package without it

    cfg = EngineConfig.from_kwargs(**flags)
    if cfg.tensor_parallel_size > 1:  # the profiler times one process's forwards; its bundles derive per_tp
        raise ConfigError("deltaserve profile profiles one rank: drop --tensor-parallel-size (the bundle's "
                          "engine_resolved.per_tp gives the block size of each TP degree)")
    if cfg.kv_cache_memory is None:
        kv = DEFAULT_KV_BYTES.get(cfg.preset if cfg.model is None else "", 1 << 30)
        cfg = EngineConfig.from_kwargs(**{**flags, "kv_cache_memory": kv})
    return LLMEngine(cfg)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "coverage":
        return coverage_main(argv[1:])
    a = build_parser().parse_args(argv)
    from .run import profile  # torch: `profile coverage` runs without it

    eng = make_engine(**engine_args(a))
    meta = profile(eng, a.out, quick=a.quick, repeats=a.repeats, max_context=a.max_context,
                   calibrate=not a.no_calibrate, progress=not a.no_progress,
                   source=eng.config.model or f"preset:{eng.config.preset}")
    cal = meta.get("calibration") or {}
    print(f"wrote {a.out}: block size {eng.block_size} (tp 1), {meta['hardware']['torch_threads']} threads, "
          f"{meta['profile']['wall_s']} s, load {meta['profile']['load_avg_start']} -> {meta['profile']['load_avg_end']}")
    if cal:
        print(f"calibration ({cal.get('timer')} time): fixed {cal.get('fixed_us')} us + {cal.get('per_seq_us')} us/seq + "
              f"{cal.get('per_prefill_us')} us/prefill span, compute x{cal.get('compute_scale')} (decode x{cal.get('compute_scale_decode')}), wall/cpu "
              f"{cal.get('wall_per_cpu')}; median |error| {cal.get('median_abs_error_pct')}% over {cal.get('steps')} "
              f"steps (total error {cal.get('total_error_pct')}%, uncalibrated {cal.get('uncalibrated_total_error_pct')}%)")
    return 0
