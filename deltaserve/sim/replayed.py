"""Trace-driven time: the simulator run on a real replay's own measured step durations. No torch.

The simulator's replica runs the engine's own Scheduler and MemoryManager; only the time a step takes comes from
a model. Give it, for the k-th step, the k-th step's measured duration on the real replay's clock
(`ReplayedLatency`) and the simulated clock is the real one, so every schedule() sees the same requests at the
same moments and must decide the same steps: the same requests and token counts in every step, the same cached
tokens, the same preemptions. That is exact, not approximate, and so it is a test: a difference is a bug in the
path the engine and the simulator share (or in how one of them is driven), never noise. `step_signature` is what
"the same step" means; `compare_steps` finds the first step where two runs part.

A real replay logs, per step, the clock at which it decided what had arrived (`start`) and the clock at which it
next looked (`end`): a request arriving in between is seen by the next step on both sides. The duration the
simulator replays is end - start.
"""
from __future__ import annotations

from dataclasses import dataclass


def step_signature(plan) -> tuple:
    """What the scheduler decided for one step: per sequence (request id, first position, tokens, decode path,
    samples), in plan order, then the requests it preempted while planning. Equal signatures are the same step."""
    work = tuple((w.request_id, w.start_pos, len(w.token_ids), bool(w.is_decode), bool(w.sample)) for w in plan.work)
    return work, tuple(plan.preempted)


@dataclass
class LoggedStep:
    """One real step: the replay clock when it was planned (arrivals up to it were added), when the replay next
    looked for arrivals (its end as far as scheduling can tell), and what the step did."""

    start: float
    end: float | None
    signature: tuple

    @property
    def duration_us(self) -> float:
        if self.end is None:
            raise ValueError("a logged step without an end time (the replay stopped inside it)")
        return (self.end - self.start) * 1e6


class ReplayExhausted(RuntimeError):
    """The simulated run asked for more steps than the real run took."""


class ReplayedLatency:
    """A latency model that answers the k-th step it is asked about with the k-th measured duration (us).

    It ignores the step's shape: the point is that the shapes come out equal anyway. Asked for a step beyond the
    real run's last, it raises ReplayExhausted, or, given a `fallback` latency model, prices it with that and
    counts it in `overrun` (so a diverged run can still finish and be compared)."""

    def __init__(self, durations_us, fallback=None):
        self.durations = [float(d) for d in durations_us]
        if any(d < 0 for d in self.durations):
            raise ValueError("a measured step duration is negative: the replay's clock went backwards")
        self.fallback = fallback
        self.k = 0
        self.overrun = 0

    @classmethod
    def from_log(cls, log: list[LoggedStep], fallback=None) -> "ReplayedLatency":
        return cls([s.duration_us for s in log], fallback)

    def shape_us(self, shape, now: float = 0.0) -> float:
        k, self.k = self.k, self.k + 1
        if k < len(self.durations):
            return self.durations[k]
        self.overrun += 1
        if self.fallback is None:
            raise ReplayExhausted(f"the simulated run asked for step {k + 1}; the real run took "
                                  f"{len(self.durations)}")
        return self.fallback.shape_us(shape, now)


def compare_steps(real: list[tuple], sim: list[tuple]) -> dict:
    """Two step sequences (signatures): whether they are identical, their lengths, and at the first step where
    they differ (index from 0), what each side did there."""
    first = next((i for i, (a, b) in enumerate(zip(real, sim)) if a != b), None)
    if first is None and len(real) != len(sim):
        first = min(len(real), len(sim))
    out = {"identical": first is None, "real_steps": len(real), "sim_steps": len(sim), "first_diff": first}
    if first is not None:
        out["real_at_diff"] = describe(real[first]) if first < len(real) else "(no step)"
        out["sim_at_diff"] = describe(sim[first]) if first < len(sim) else "(no step)"
    return out


def describe(sig: tuple) -> str:
    """A step signature in a line: 'id@pos+n[d|p][s]' per sequence, then any preemptions."""
    work, preempted = sig
    parts = [f"{rid}@{pos}+{n}{'d' if dec else 'p'}{'s' if smp else ''}" for rid, pos, n, dec, smp in work]
    return " ".join(parts) + (f" preempted {','.join(preempted)}" if preempted else "")


def as_json(sig: tuple) -> list:
    """A signature as JSON lists (tuples do not survive json); from_json undoes it."""
    work, preempted = sig
    return [[list(w) for w in work], list(preempted)]


def from_json(obj: list) -> tuple:
    work, preempted = obj
    return tuple(tuple(w) for w in work), tuple(preempted)


def compare_records(real, sim) -> dict:
    """Request by request (RequestRecords, matched by id): requests whose cached tokens, preemptions or output
    tokens differ, and the largest difference in first-token and finish times (s; 0 up to rounding when the
    two clocks are the same clock)."""
    by = {r.request_id: r for r in sim}
    out = {"cached_tokens": {"real": 0, "sim": 0, "differ": []}, "preemptions": {"real": 0, "sim": 0, "differ": []},
           "outputs_differ": [], "missing": [], "max_time_diff_s": 0.0}
    for r in real:
        s = by.get(r.request_id)
        if s is None:
            out["missing"].append(r.request_id)
            continue
        for key in ("cached_tokens", "preemptions"):
            a, b = getattr(r, key), getattr(s, key)
            out[key]["real"] += a
            out[key]["sim"] += b
            if a != b:
                out[key]["differ"].append(r.request_id)
        if r.output_tokens != s.output_tokens:
            out["outputs_differ"].append(r.request_id)
        for a, b in ((r.first_token, s.first_token), (r.finish, s.finish)):
            if a is not None and b is not None:
                out["max_time_diff_s"] = max(out["max_time_diff_s"], abs(a - b))
            elif (a is None) != (b is None):
                out["max_time_diff_s"] = float("inf")
    out["identical"] = not (out["cached_tokens"]["differ"] or out["preemptions"]["differ"] or out["outputs_differ"]
                            or out["missing"])
    return out


def is_background(rid: str) -> bool:
    """The scheduler names a background job '<request id>/outputs' (scheduler/jobs.py ReprefillJobs.queue_for)."""
    return rid.endswith("/outputs")


def schedule_facts(sigs: list[tuple]) -> dict:
    """What a step sequence exercised, so that a test can see its traces reach the paths it means to test: steps
    with background jobs, with a preemption, with prompt and decode tokens together."""
    return {"steps": len(sigs),
            "background": sum(1 for w, _ in sigs if any(is_background(x[0]) for x in w)),
            "preempting": sum(1 for _, p in sigs if p),
            "mixed": sum(1 for w, _ in sigs if any(x[3] for x in w) and any(not x[3] for x in w))}
