"""The simulator's side of the gate: the real replay's engine flags and warm-up on one simulated replica, at a
given speed or on a given latency model (the real run's own step durations, for part a)."""
from __future__ import annotations

from ...config import REPLICA_FLAGS
from ...scheduler import Request
from ...sim.cluster import ClusterConfig, ReplicaConfig, Simulation
from ...sim.latency import LatencyModel
from ...sim.replayed import step_signature
from ...sim.report import RequestRecord
from ...sim.trace import TraceRequest
from .speed import StepSpeed


def _cluster(engine_flags: dict, caching: bool, bundle_path: str) -> ClusterConfig:
    rc = ReplicaConfig.from_dict({**{k: v for k, v in engine_flags.items() if k in REPLICA_FLAGS},
                                  "enable_prefix_caching": caching, "num_threads": None})
    return ClusterConfig([rc], "round-robin", bundle_path)


def latency_at(bundle, wall_per_cpu: float | StepSpeed | None) -> LatencyModel:
    """The bundle's latency model at a speed: a constant, a StepSpeed over the replay's clock, or None (the
    bundle's own wall/CPU)."""
    if isinstance(wall_per_cpu, StepSpeed):
        return LatencyModel(bundle, speed=wall_per_cpu.prefill, decode_speed=wall_per_cpu.decode)
    return LatencyModel(bundle, wall_per_cpu=wall_per_cpu)


def _simulate_warmup(rep, warmup: list[TraceRequest]) -> None:
    """The real engine's warm-up requests, all at once: they leave the same pages cached. Then the replica's
    records and counters start over."""
    for w in warmup:
        rep.submit(w, Request(w.request_id, w.prompt_token_ids, max_tokens=w.output_length,
                              cache_salt=w.cache_salt), 0.0)
    while rep.has_work():  # background jobs included, as the real warm-up runs them
        if rep.start(0.0) is None:
            break
        rep.complete(0.0)
    rep.records.clear()
    rep.num_steps, rep.busy_time = 0, 0.0


def run_sim(bundle, engine_flags: dict, caching: bool, trace: list[TraceRequest], warmup: list[TraceRequest],
            wall_per_cpu: float | StepSpeed | None = None, latency=None,
            record: bool = False) -> tuple[list[RequestRecord], Simulation]:
    """wall_per_cpu: the speed to simulate, a constant or a StepSpeed over the replay's clock (None: the
    bundle's own). latency: instead, a latency model for the trace's steps (after the warm-up), such as a
    ReplayedLatency. record: keep every step's signature, as sim.signatures = (warm-up steps, trace steps)."""
    sim = Simulation(_cluster(engine_flags, caching, bundle.path), bundle)
    rep = sim.replicas[0]
    if wall_per_cpu is not None:
        rep.latency = latency_at(bundle, wall_per_cpu)
    sigs: list[tuple] = []
    if record:
        rep.on_plan = lambda plan, now: sigs.append(step_signature(plan))
    if warmup:
        _simulate_warmup(rep, warmup)
    n_warm = len(sigs)
    if latency is not None:
        rep.latency = latency
    recs = sim.run(trace)
    sim.signatures = (sigs[:n_warm], sigs[n_warm:])
    return recs, sim
