"""The calibration fit: the step time the profiled tables do not explain, from real steps (calibrate.py)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def _lad(X, y, iters: int = 60):
    """Least absolute deviations by iteratively reweighted least squares."""
    w = np.ones_like(y)
    beta = None
    floor = 1e-3 * max(1.0, float(np.median(np.abs(y))))
    for _ in range(iters):
        sw = np.sqrt(w)
        beta, *_ = np.linalg.lstsq(X * sw[:, None], y * sw, rcond=None)
        w = 1.0 / np.maximum(np.abs(y - X @ beta), floor)
    return beta


@dataclass
class _Steps:
    """The calibration steps as arrays, one entry per step."""

    comp: np.ndarray  # the tables' compute of the step's prefill part
    comp_d: np.ndarray  # ... and of its decode part
    base: np.ndarray  # the tables' overhead
    n: np.ndarray  # sequences
    p: np.ndarray  # prefill spans
    dec_only: np.ndarray  # 1 on a decode-only step
    cold: np.ndarray  # 1 on a decode-only step right after a prefill
    meas: np.ndarray  # the measured time the fit explains


def _steps(rows: list[dict], model, key: str) -> _Steps:
    parts = np.array([model.compute_parts(r["_shape"]) for r in rows])  # [steps, 2]: prefill, decode parts
    dec_only = np.array([r["_shape"].decode_only for r in rows], dtype=float)
    return _Steps(comp=parts[:, 0], comp_d=parts[:, 1], base=np.array([model.overhead_us(r["_shape"]) for r in rows]),
                  n=np.array([r["_shape"].n_seqs for r in rows], dtype=float),
                  p=np.array([len(r["_shape"].prefill) for r in rows], dtype=float), dec_only=dec_only,
                  cold=dec_only * np.array([r["_shape"].after_prefill for r in rows], dtype=float),
                  meas=np.array([r[key] for r in rows]))


def _plausible_fit(s: _Steps) -> dict[str, float]:
    """The coefficients of the features that survive: fit, drop the most implausible feature, refit.

    Features: compute scales (the prefill and the decode parts of the tables), per sequence, per prefill span,
    decode_fixed and after_prefill; the overheads must not be negative and a scale must stay plausible (a
    negative overhead or a wild scale is noise being fitted): such a feature is dropped (a scale then stays 1).
    What comes back is always plausible: where every feature was dropped, nothing (the tables alone)."""
    y = s.meas - s.base
    # decode_fixed may be negative (the tables carry the per-op timers' cost, which a decode step's ~100 small
    # ops make visible) but not by more than half a decode step
    dec_bound = 0.5 * float(np.median(s.meas[s.dec_only > 0])) if s.dec_only.any() else 0.0
    scales = {"scale": s.comp, "scale_decode": s.comp_d}
    # no all-steps "fixed" term: nested with decode_fixed it made the fit flip between runs (fixed +1 ms and
    # decode_fixed -1.5 ms, or both dropped); per_prefill carries a prefill step's fixed cost instead
    feats = {**scales, "per_seq": s.n, "per_prefill": s.p, "decode_fixed": s.dec_only, "after_prefill": s.cold}
    active = [f for f in feats if (f != "scale_decode" or s.comp_d.any())
              and (f not in ("decode_fixed", "after_prefill") or feats[f].sum() >= 3)]

    def implausible(f: str, c: float) -> bool:
        if f in scales:
            return not 0.8 <= c <= 1.25
        if f == "decode_fixed":
            return abs(c) > dec_bound
        return c < 0

    while active:
        fixed_part = sum(v for f, v in scales.items() if f not in active)
        beta = _lad(np.stack([feats[f] for f in active], 1), y - fixed_part)
        coef = dict(zip(active, (float(b) for b in beta)))
        bad = [f for f in active if implausible(f, coef[f])]
        if not bad:
            return coef
        active.remove(min(bad, key=lambda f: coef[f] if f not in scales else -1e18))
    return {}  # every feature was noise: the tables alone (the last fit's coefficients were all implausible)


def fit_calibration(rows: list[dict], model, timer: str = "cpu") -> dict:
    """The step time the tables do not explain.

    With the CPU timer: cpu = scale * compute + tables' overhead + fixed + per_seq * N + per_prefill * P
    (+ decode_fixed on decode-only steps, + after_prefill on a decode-only step right after a prefill), fitted
    on the thread CPU time of real steps (load-independent), and wall_per_cpu = total wall / total CPU time of
    those steps (how much of a core this process got while calibrating: the machine's contention). With the wall
    timer the same fit runs on wall time and wall_per_cpu is 1. Least absolute deviations: the noise of a shared
    machine has a long right tail. Sets each row's predicted_us (on the wall clock)."""
    if len(rows) < 4:
        return {"fixed_us": 0.0, "per_seq_us": 0.0, "per_prefill_us": 0.0, "compute_scale": 1.0, "wall_per_cpu": 1.0,
                "steps": len(rows), "timer": timer}
    s = _steps(rows, model, "cpu_us" if timer == "cpu" else "measured_us")
    coef = _plausible_fit(s)
    scale, scale_d = coef.get("scale", 1.0), coef.get("scale_decode", 1.0)
    fixed, per_seq, per_pre = coef.get("fixed", 0.0), coef.get("per_seq", 0.0), coef.get("per_prefill", 0.0)
    dec_fixed, after_pre = coef.get("decode_fixed", 0.0), coef.get("after_prefill", 0.0)
    pred = (scale * s.comp + scale_d * s.comp_d + s.base + fixed + per_seq * s.n + per_pre * s.p
            + dec_fixed * s.dec_only + after_pre * s.cold)
    wall = np.array([r["measured_us"] for r in rows])
    cpu = np.array([r["cpu_us"] for r in rows])
    wpc = float(wall.sum() / cpu.sum()) if timer == "cpu" and cpu.sum() > 0 else 1.0
    for r_, pr in zip(rows, pred):
        r_["predicted_us"] = float(pr * wpc)
    meas = s.meas
    rel = np.abs(pred - meas) / meas
    return {"timer": timer, "fixed_us": round(fixed, 2), "per_seq_us": round(per_seq, 2),
            "per_prefill_us": round(per_pre, 2), "compute_scale": round(scale, 4),
            "compute_scale_decode": round(scale_d, 4), "decode_fixed_us": round(dec_fixed, 2),
            "after_prefill_us": round(after_pre, 2), "wall_per_cpu": round(wpc, 4),
            "steps": len(rows), "median_abs_error_pct": round(100 * float(np.median(rel)), 2),
            "total_error_pct": round(100 * float((pred.sum() - meas.sum()) / meas.sum()), 2),
            "uncalibrated_total_error_pct": round(100 * float(((s.comp + s.comp_d + s.base).sum() - meas.sum())
                                                              / meas.sum()), 2)}
