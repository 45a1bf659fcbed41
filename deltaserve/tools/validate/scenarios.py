"""The gate's workloads: per preset the engine's flags and an agent-session trace (a Scenario), the warm-up
requests run before a replay, and the three loads, arrival-time scales picked from the simulator's own
estimate of the engine's capacity."""
from __future__ import annotations

import random
from dataclasses import dataclass, replace

from ...sim.trace import AgentTraceSpec, TraceRequest
from .simulate import run_sim


@dataclass
class Scenario:
    preset: str
    engine: dict  # engine flags (EngineConfig names)
    spec: AgentTraceSpec
    warmup: int = 8  # warm-up requests (64 + 96 i prompt tokens, 8 + 4 i outputs), run at once before the trace


def preset_scenario(preset: str, quick: bool = False) -> Scenario:
    if preset == "tiny":
        eng = dict(max_num_seqs=8, max_num_batched_tokens=512, kv_cache_memory=64 << 20)
        spec = AgentTraceSpec(num_sessions=8 if quick else 64, session_rate=1.0, turns=(2, 4), system_tokens=300,
                              first_user_tokens=(32, 160), new_tokens=(16, 128), output_tokens=(8, 40),
                              think_time=2.0, min_gap=1.0, seed=7)
    elif preset == "qwen3.5-0.8b-shape":
        eng = dict(max_num_seqs=6, max_num_batched_tokens=1152, kv_cache_memory=1 << 30)
        spec = AgentTraceSpec(num_sessions=3 if quick else 8, session_rate=1.0, turns=(2, 3), system_tokens=640,
                              first_user_tokens=(32, 200), new_tokens=(16, 160), output_tokens=(6, 16),
                              think_time=2.0, min_gap=1.0, seed=7)
    else:
        eng = dict(max_num_seqs=8, max_num_batched_tokens=1024, kv_cache_memory=1 << 30)
        spec = AgentTraceSpec(num_sessions=6, seed=7)
    return Scenario(preset, eng, spec, warmup=5 if preset == "qwen3.5-0.8b-shape" else 8)


def scaled(trace: list[TraceRequest], k: float) -> list[TraceRequest]:
    """The trace with every arrival time times k (prompts copied)."""
    return [replace(r, arrival_time=r.arrival_time * k, prompt_token_ids=list(r.prompt_token_ids)) for r in trace]


def warmup_requests(n: int, vocab: int, seed: int = 99) -> list[TraceRequest]:
    """n warm-up requests, the i-th of 64 + 96 i prompt tokens and 8 + 4 i outputs, under their own cache salt."""
    rng = random.Random(seed)
    return [TraceRequest(f"warmup-{i}", 0.0, 8 + 4 * i, prompt_token_ids=[rng.randrange(10, min(vocab, 4000))
                                                                           for _ in range(64 + 96 * i)],
                         cache_salt="warmup") for i in range(n)]


def utilization(bundle, flags: dict, caching: bool, trace: list[TraceRequest]) -> float:
    recs, sim = run_sim(bundle, flags, caching, trace, [], wall_per_cpu=1.0)
    span = max(r.finish for r in recs if r.finish is not None) - min(r.arrival for r in recs)
    return sim.replicas[0].busy_time / span if span > 0 else 1.0


def pick_scales(bundle, flags: dict, trace: list[TraceRequest], caching: bool = False) -> dict[str, float]:
    """Arrival-time scale factors for light (~30% busy), saturated (~90% busy) and overloaded (arrivals twice as
    fast as the saturated scale's) load, found by bisection on the simulator's busy fraction of the engine on a
    core of its own (the bundle's CPU-time tables; caching off: the heavier case, so saturated with caching on
    is a little lighter). The wall-clock replays stretch these by the bundle's wall/CPU contention."""
    def find(target: float) -> float:
        lo, hi = 0.01, 10000.0
        for _ in range(40):
            mid = (lo * hi) ** 0.5
            u = utilization(bundle, flags, caching, scaled(trace, mid))
            if u > target:
                lo = mid
            else:
                hi = mid
        return hi
    sat = find(0.9)
    return {"light": find(0.3), "saturated": sat, "overloaded": sat / 2}
