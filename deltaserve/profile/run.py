"""Measure this engine's step costs on this machine and write a profile bundle (deltaserve/sim/bundle.py).

The profiler builds a real LLMEngine (the same model loading, dtype, cache store and runner the server
uses) and times the pieces of a step inside real forwards of the model (Instrument runs them on a timed copy
of the model's op table, with forward hooks on its layers; every call records its self time, so the kernels of
a forward add up to the forward), in phases:

  forward_runs.py  prefill runs (one span of T tokens), decode runs (D sequences at context c), mixed runs
  alone.py         lm head and sampler per sampled row; attention at longer prior contexts; copies; the
                   torch-free scheduler's schedule() + update(); one image through the vision encoder by
                   its patch count (a model with a vision tower)
  calibrate.py     real engine.step()s fitted against the tables (fit.py): the overhead they do not explain

Times are medians of repeats (profiler.py); meta.calibration.wall_per_cpu records the contention seen while
calibrating.
"""
from __future__ import annotations

import sys
import time

from tqdm import tqdm

from . import alone, forward_runs
from .calibrate import calibration
from .grid import make_grid
from .machine import load_avg
from .profiler import Profiler
from .writer import bundle_meta, write_bundle


def run_phases(prof: Profiler) -> None:
    """Every phase, in this order: the decode runs and the attention grid price from the prefill runs, the mixed
    runs read every table before them, and the phases draw their random inputs from one generator in turn."""
    prof.bar = tqdm(total=prof.grid.num_shapes(), desc="profile", unit="shape", disable=not prof.progress,
                    file=sys.stderr)
    try:
        facts = forward_runs.prefill_runs(prof)
        forward_runs.decode_runs(prof, facts)
        alone.head_and_sampler(prof)
        alone.attention_grid(prof, facts.attn_incontext)
        alone.copies(prof)
        alone.scheduler_overhead(prof)
        forward_runs.mixed_runs(prof)
        alone.vision_encoder(prof)  # last: the other phases' random inputs stay what they were
    finally:
        prof.bar.close()
        prof.bar = None


def profile(engine, out: str, *, quick: bool = False, repeats: int | None = None, max_tokens: int | None = None,
            max_context: int | None = None, calibrate: bool = True, progress: bool = True,
            source: str = "") -> dict:
    """Profile `engine` (an LLMEngine) into the bundle directory `out`; returns meta. The tables are written
    before calibrating (the fit reads them back as the simulator will), the bundle again after."""
    cfg = engine.config
    max_tokens = max_tokens or cfg.max_num_batched_tokens
    pool_ctx = engine.pool.num_pages * engine.block_size
    max_context = min(max_context or (4096 if quick else 16384), pool_ctx)
    grid = make_grid(quick, max_tokens, cfg.max_num_seqs, max_context, repeats)
    load0 = load_avg()
    t0 = time.time()
    prof = Profiler(engine, grid, progress=progress)
    run_phases(prof)
    meta = bundle_meta(engine, grid, prof.timer_name, quick=quick, max_tokens=max_tokens, max_context=max_context,
                       load0=load0, source=source)
    write_bundle(out, engine, prof, meta)
    if calibrate:
        meta["calibration"], prof.rows["calibration.csv"] = calibration(engine, out, quick, prof.timer_name,
                                                                        progress=progress)
    meta["checks"] = prof.checks
    meta["profile"]["load_avg_end"] = load_avg()
    meta["profile"]["wall_s"] = round(time.time() - t0, 1)
    write_bundle(out, engine, prof, meta)
    return meta
