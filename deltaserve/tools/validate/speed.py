"""The machine's speed against the bundle: measured step time on the replay's clock over the latency model's
CPU-time prediction, as one factor (a probe's warm-up steps, or the replay's own: the oracle) or over the replay's
clock by step kind (the interleaved probe: StepSpeed)."""
from __future__ import annotations

from dataclasses import dataclass

from ...sim.latency import LatencyModel, SpeedTrace


def speed_factor(bundle, steps, clock: str) -> float:
    """How much slower (>1) or faster this machine ran `steps` than the bundle's CPU-time model predicts:
    measured time on the replay's clock / predicted CPU time. On the warm-up steps it is the probe of the
    machine's present speed (contention included on the wall clock); on the replay's own steps, the oracle."""
    lm = LatencyModel(bundle, wall_per_cpu=1.0)
    pred = sum(lm.shape_us(st[0]) for st in steps)
    meas = sum((st[1] if clock == "wall" else st[2]) for st in steps)
    return meas / pred if pred > 0 else 1.0


COLD_STEP_US = 100_000  # a cold first step's ~1 ms is under 1% of a step this long


@dataclass
class StepSpeed:
    """The speed the machine ran at over a replay's clock, for steps with prompt tokens (prefill) and for
    decode-only steps apart, and over all steps (`mean`, the number the tables show)."""

    prefill: SpeedTrace
    decode: SpeedTrace
    mean: float


def step_speed(bundle, steps, clock: str, window: int = 32) -> StepSpeed:
    """steps: (shape, wall us, cpu us, replay clock[, first of its burst]). A burst's first step runs on the
    caches the other engine left: 0.5-0.9 ms more on tiny whatever the step (15-28% of a 4 ms decode, which
    biased the decode speed by 1-2%; nothing measurable on a 0.8B step). So a first step shorter than
    COLD_STEP_US is not a sample; a longer one is (on the 0.8B shape most prefill samples are first steps).
    A kind with no steps takes the other kind's speed."""
    lm = LatencyModel(bundle, wall_per_cpu=1.0)
    kinds: dict[bool, list] = {True: [], False: []}
    for shape, w, c, t, *first in steps:
        us = w if clock == "wall" else c
        if not (first and first[0] and us < COLD_STEP_US):
            kinds[shape.decode_only].append((t, us, lm.shape_us(shape)))
    both = kinds[True] + kinds[False]
    traces = {k: SpeedTrace(v or both, window) for k, v in kinds.items()}
    return StepSpeed(traces[False], traces[True], SpeedTrace(both, window).mean)


def step_model_error(bundle, steps) -> float:
    """The latency model's total error over the real replay's own steps (CPU time, wall_per_cpu 1), in %."""
    lm = LatencyModel(bundle, wall_per_cpu=1.0)
    meas = sum(st[2] for st in steps)
    pred = sum(lm.shape_us(st[0]) for st in steps)
    return 100.0 * (pred - meas) / meas if meas else float("nan")
