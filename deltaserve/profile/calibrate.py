"""Calibration: real engine.step()s of a calibration workload (plans captured), fitted (fit.py) against the
bundle's tables: fixed + per sequence + per prefill span overhead and a compute scale, by least absolute
deviations. Leaving the fixed per-step overhead out is what biases other simulators' TTFT low.
"""
from __future__ import annotations

import random
import sys
import time

from tqdm import tqdm

from ..engine.sampling_params import SamplingParams
from ..sim.bundle import load_bundle
from ..sim.latency import LatencyModel, StepShape
from .fit import fit_calibration


def calibration_workload(max_num_seqs: int, max_num_batched_tokens: int, block_size: int, quick: bool,
                         vocab: int, seed: int = 1) -> list[tuple[int, list[int], int]]:
    """(submit at step k, prompt ids, output tokens): prefills of several sizes, decode batches of several sizes,
    staggered arrivals that make mixed steps, and shared prefixes that make cache hits."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(10, min(vocab, 4000)) for _ in range(n)]  # noqa: E731
    M, S = max_num_batched_tokens, max_num_seqs
    items: list[tuple[int, list[int], int]] = []
    step = 0
    lens = [32, 200, M // 2, M, int(1.6 * M)] if quick else [16, 64, 200, M // 4, M // 2, 3 * M // 4, M, int(1.6 * M),
                                                             3 * M]
    for L in lens:  # prefill sizes, alone
        items.append((step, tok(max(8, L)), 2))
        step += 6 + L // max(1, M)
    bsz = sorted({1, 2, max(1, S // 2), S} if quick else {1, 2, 3, 4, max(1, S // 4), max(1, S // 2), S})
    for B in bsz:  # decode batches
        for _ in range(B):
            items.append((step, tok(rng.randint(16, 160)), 10 if quick else 16))
        step += 30
    for _ in range(min(S, 4)):  # decode at a longer context: attention's share of a decode step grows with it
        items.append((step, tok(M + rng.randint(0, M // 4)), 10 if quick else 16))
    step += 30
    sys_prompt = tok(2 * block_size + 17)
    for i in range(min(S, 6)):  # staggered arrivals: mixed steps; a shared prefix: hits and restores
        items.append((step + 3 * i, sys_prompt + tok(rng.randint(40, M // 2)), 12))
    return items


def run_calibration(engine, workload, progress: bool = True) -> list[dict]:
    """Run the workload through engine.step(), capturing each step's plan, wall time and thread CPU time."""
    rows = []
    pending = sorted(workload, key=lambda x: x[0])
    k = 0
    step = 0
    bar = tqdm(total=len(pending), desc="calibrate", unit="req", disable=not progress, file=sys.stderr)
    while k < len(pending) or engine.has_unfinished_requests():
        if k < len(pending) and not engine.has_unfinished_requests():
            step = max(step, pending[k][0])  # idle: fast-forward to the next submission
        while k < len(pending) and pending[k][0] <= step:
            _, ids, n = pending[k]
            engine.add_request(f"cal-{k}-{time.monotonic_ns()}", ids,
                               SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
            k += 1
        c = time.thread_time()
        t = time.perf_counter()
        outs = engine.step()
        dt = (time.perf_counter() - t) * 1e6
        dc = (time.thread_time() - c) * 1e6
        step += 1
        plan = engine.last_plan
        bar.update(sum(1 for o in outs if o.finished))
        if plan.is_empty():
            continue
        s = StepShape.of(plan, after_prefill=bool(rows) and bool(rows[-1]["_shape"].prefill))
        rows.append({"step": step, "n_seqs": s.n_seqs, "n_prefill": len(s.prefill),
                     "prefill_tokens": sum(n for n, _ in s.prefill), "n_decode": len(s.decode_ctx),
                     "context_tokens": sum(s.decode_ctx) + sum(n + p for n, p in s.prefill), "n_sample": s.n_sample,
                     "copies": s.zero_slots + s.restores + s.saves, "measured_us": dt, "cpu_us": dc, "_shape": s})
    bar.close()
    return rows


def calibration(engine, bundle_dir: str, quick: bool, timer: str, progress: bool = True) -> tuple[dict, list[dict]]:
    """(meta.calibration, the calibration.csv rows): the calibration workload on `engine`, fitted against the
    tables already written to `bundle_dir`."""
    cfg = engine.config
    # a first pass warms every shape up (oneDNN builds a primitive per new shape; first calls cost more), the
    # second (other tokens, the same kinds of steps) is measured
    for seed in (1, 2):
        work = calibration_workload(cfg.max_num_seqs, cfg.max_num_batched_tokens, engine.block_size, quick,
                                    engine.model_config.vocab_size, seed=seed)
        rows = run_calibration(engine, work, progress=progress)
    model = LatencyModel(load_bundle(bundle_dir))
    return fit_calibration(rows, model, timer), rows
