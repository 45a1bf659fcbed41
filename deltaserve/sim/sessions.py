"""Closed-loop agent sessions on one simulated replica: a session's next turn is submitted when its previous answer
has ended (plus a think time), as an agent that waits for the model does. No torch.

    spec = SessionSpec(sessions=4, start_tokens=8192, end_tokens=65536)
    run = run_sessions(scheduler, latency.step_us, spec)          # the engine's own Scheduler (scheduler/build.py)
    run.wall_s, run.later_ttft(), run.hit_rate(), run.counters["preemptions"]

The conversation of session s: turn 0 is the shared system prompt + tools (`shared_tokens`, the same ids in every
session) followed by the session's own first message, `start_tokens` in all; every later turn re-sends the whole
previous prompt, the previous answer (the very token ids the replica produced) and `new_tokens` new ones (a tool
result or a user message). Turns continue while a turn's prompt + answer stays within `end_tokens`. Every request
decodes exactly `output_tokens` (ignore_eos).

The loop is the engine's (sim/cluster.py's replica): schedule() at `now`, the step lasts step_us(plan), update()
at its end stamps its tokens; a turn arriving while a step runs is seen by the next schedule(). Invariants: a
session has at most one request in flight; a turn's arrival is its previous turn's finish + think_time (the first
turn: its session's start, `stagger` seconds apart); the run ends when every session has run all its turns, and
raises if the scheduler can make no progress with requests still waiting.
"""
from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field, fields

from ..scheduler import Request

SAMPLED_TOKEN = 11  # what every simulated step "samples" (as sim/cluster.py)


@dataclass(frozen=True)
class SessionSpec:
    """N agent sessions growing from start_tokens to end_tokens."""

    sessions: int = 4
    start_tokens: int = 8192  # the first turn's prompt (shared + the session's first message)
    end_tokens: int = 65536  # a turn's prompt + answer stays within this
    shared_tokens: int = 4096  # system prompt + tools, identical in every session
    new_tokens: int = 3072  # appended to each later turn after the previous answer
    output_tokens: int = 200
    think_time: float = 0.0  # seconds from an answer's end to the next turn
    stagger: float = 0.0  # seconds between session starts
    vocab: int = 4000
    seed: int = 0

    def __post_init__(self):
        if self.sessions < 1 or self.output_tokens < 1 or self.new_tokens < 0:
            raise ValueError("sessions and output_tokens must be >= 1, new_tokens >= 0")
        if not 0 < self.shared_tokens <= self.start_tokens:
            raise ValueError(f"shared_tokens must be in (0, start_tokens]: {self.shared_tokens}")
        if self.start_tokens + self.output_tokens > self.end_tokens:
            raise ValueError(f"the first turn ({self.start_tokens} + {self.output_tokens}) passes end_tokens "
                             f"{self.end_tokens}")

    @classmethod
    def from_dict(cls, d: dict) -> SessionSpec:
        """From a dict of these field names; unknown keys are errors."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown session option(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**d)

    @property
    def turns(self) -> int:
        """Turns per session: turn k's prompt is start + k (output + new); the last one's answer ends within
        end_tokens."""
        grow = self.output_tokens + self.new_tokens
        if grow == 0:
            return 1
        return 1 + (self.end_tokens - self.output_tokens - self.start_tokens) // grow

    def prompt_tokens(self, turn: int) -> int:
        return self.start_tokens + turn * (self.output_tokens + self.new_tokens)


@dataclass
class TurnRecord:
    session: int
    turn: int
    arrival: float
    prompt_tokens: int
    first_token: float | None = None
    finish: float | None = None
    cached_tokens: int = 0
    preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival


@dataclass
class SessionRun:
    """What one closed-loop run measured: per turn, and the scheduler's counters at the end."""

    records: list[TurnRecord]
    wall_s: float
    steps: int
    busy_s: float
    counters: dict = field(default_factory=dict)

    def later_ttft(self) -> list[float]:
        """TTFT of every turn after a session's first (the turns that can hit the cache)."""
        return [r.ttft for r in self.records if r.turn > 0 and r.ttft is not None]

    def hit_rate(self, later_only: bool = True) -> float:
        """Cached prompt tokens / prompt tokens (later turns by default)."""
        rs = [r for r in self.records if r.turn > 0 or not later_only]
        total = sum(r.prompt_tokens for r in rs)
        return sum(r.cached_tokens for r in rs) / total if total else 0.0

    def decode_rate(self, output_tokens: int) -> float:
        """Per-stream decode speed: mean over turns of (output_tokens - 1) / (finish - first token), tokens/s."""
        rates = [(output_tokens - 1) / (r.finish - r.first_token) for r in self.records
                 if r.finish is not None and r.first_token is not None and r.finish > r.first_token]
        return sum(rates) / len(rates) if rates else 0.0


class _Session:
    def __init__(self, index: int, spec: SessionSpec, shared: list[int]):
        rng = random.Random(f"{spec.seed}/session/{index}")
        own = spec.start_tokens - spec.shared_tokens
        # the first own token differs from every other session's (a block hash parts there, not by chance later)
        first = [1 + (index % (spec.vocab - 1))] if own else []
        self.index = index
        self.prompt = shared + first + [rng.randrange(1, spec.vocab) for _ in range(own - len(first))]
        self.rng = rng
        self.turn = 0


def run_sessions(scheduler, step_us, spec: SessionSpec, max_steps: int = 10_000_000) -> SessionRun:
    """Run the sessions to their last turn on `scheduler` (a fresh engine Scheduler), each step lasting
    step_us(plan) microseconds."""
    shared_rng = random.Random(f"{spec.seed}/shared")
    shared = [shared_rng.randrange(1, spec.vocab) for _ in range(spec.shared_tokens)]
    sessions = [_Session(i, spec, shared) for i in range(spec.sessions)]
    turns = spec.turns
    arrivals: list[tuple[float, int]] = [(i * spec.stagger, i) for i in range(spec.sessions)]
    heapq.heapify(arrivals)
    records: list[TurnRecord] = []
    live: dict[str, TurnRecord] = {}
    now, steps, busy = 0.0, 0, 0.0

    def submit(i: int, t: float) -> None:
        s = sessions[i]
        rid = f"s{i}-t{s.turn}"
        rec = TurnRecord(i, s.turn, t, len(s.prompt))
        records.append(rec)
        live[rid] = rec
        scheduler.add(Request(rid, list(s.prompt), max_tokens=spec.output_tokens, arrival_time=t))

    while arrivals or scheduler.has_unfinished():
        while arrivals and arrivals[0][0] <= now:
            t, i = heapq.heappop(arrivals)
            submit(i, t)
        if not scheduler.has_unfinished():
            now = arrivals[0][0]  # idle until the next turn arrives
            continue
        plan = scheduler.schedule()
        if plan.is_empty():
            if not scheduler.num_waiting and not scheduler.num_running:
                continue  # what was left had finished (the scheduler drops finished requests as it plans)
            if arrivals:
                now = arrivals[0][0]
                continue
            raise RuntimeError(f"the scheduler can make no progress at t={now:.1f}s with "
                               f"{scheduler.num_waiting} waiting, {scheduler.num_running} running")
        dt = step_us(plan) * 1e-6
        now += dt
        steps += 1
        busy += dt
        if steps > max_steps:
            raise RuntimeError(f"more than {max_steps} steps")
        sampled = {w.request_id: SAMPLED_TOKEN for w in plan.work if w.sample}
        for req in scheduler.update(plan, sampled):
            rec = live.get(req.request_id)
            if rec is None:
                continue
            if rec.first_token is None:
                rec.first_token = now
            rec.cached_tokens, rec.preemptions = req.num_cached_tokens, req.num_preemptions
            if req.is_finished:
                rec.finish = now
                del live[req.request_id]
                s = sessions[rec.session]
                s.turn += 1
                if s.turn < turns:
                    s.prompt = (s.prompt + list(req.output_token_ids)
                                + [s.rng.randrange(1, spec.vocab) for _ in range(spec.new_tokens)])
                    heapq.heappush(arrivals, (now + spec.think_time, s.index))
    return SessionRun(records, now, steps, busy, scheduler.counters())
