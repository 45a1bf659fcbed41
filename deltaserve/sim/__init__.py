"""`deltaserve simulate`: a discrete-event serving simulator over the engine's own scheduler and memory manager.

    deltaserve simulate --cluster-config C.json --trace T.jsonl --output out.csv [--num-reqs N] [--profile DIR]
                        [engine flags of every replica: --max-num-seqs N, --kv-cache-memory 64M, ...]
    deltaserve simulate gen-trace {agent,mooncake} --out T.jsonl [options]
    deltaserve simulate validate [--presets tiny,qwen3.5-0.8b-shape] --out DIR      (the gate: real vs simulated)
    deltaserve simulate external --bundle DIR --model-config F --trace F --measured F  (a real vLLM run, external.py)
    deltaserve simulate hybrid-ab [--scenario NAME] [--step-scale P,D]    (agent sessions, layouts A/B, hybrid_ab.py)

Nothing here imports torch. `deltaserve simulate validate` (deltaserve/tools/validate/, which runs the real engine and
the profiler beside this package) is routed by cli.py. See docs/simulator.md.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from ..config import REPLICA_FLAGS, ConfigError, ModelConfig, add_engine_args, engine_args
from .bundle import Bundle, load_bundle
from .cluster import ClusterConfig, Replica, ReplicaConfig, Simulation
from .external_compare import main as external_main
from .hybrid_ab import main as hybrid_ab_main
from .latency import LatencyModel, StepShape
from .report import RequestRecord, summarize, summary_table, write_csv
from .router import make_router
from .trace import AgentTraceSpec, TraceRequest, agent_trace, materialize, mooncake_like, read_trace, write_trace

__all__ = ["AgentTraceSpec", "Bundle", "ClusterConfig", "LatencyModel", "Replica", "ReplicaConfig", "RequestRecord",
           "Simulation", "StepShape", "TraceRequest", "agent_trace", "load_bundle", "main", "make_router",
           "materialize", "read_trace", "simulate", "summarize", "summary_table", "write_trace"]


def simulate(cluster: ClusterConfig, trace: list[TraceRequest], bundle: Bundle | None = None,
             num_reqs: int | None = None) -> tuple[Simulation, list[RequestRecord]]:
    """Materialize the trace against the model's vocabulary and run it; (simulation, records)."""
    sim = Simulation(cluster, bundle)
    if num_reqs is not None:
        trace = trace[:num_reqs]
    vocab = min(ModelConfig.from_hf(r.bundle.config).vocab_size for r in sim.replicas)  # the text model's (nested
    # in text_config where the checkpoint is multimodal)
    materialize(trace, vocab=vocab)
    return sim, sim.run(trace)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deltaserve simulate",
                                description="simulate serving a trace on a cluster of deltaserve replicas; engine "
                                            "flags given here override every replica's (without --cluster-config: "
                                            "one replica with these flags, on the --profile bundle)")
    p.add_argument("--cluster-config", default=None,
                   help="cluster JSON (replicas with engine flags, router, profile); default: one replica")
    p.add_argument("--trace", required=True, help="JSONL trace (deltaserve or Mooncake format)")
    p.add_argument("--output", required=True, help="per-request CSV")
    p.add_argument("--num-reqs", type=int, default=None, help="simulate only the first N requests")
    p.add_argument("--profile", default=None, help="profile bundle directory (overrides the cluster config's)")
    p.add_argument("--router", default=None, help="override the router policy")
    p.add_argument("--summary-json", default=None, help="also write the summary as JSON here")
    add_engine_args(p, REPLICA_FLAGS, title="engine flags of every replica")
    return p


def cluster_from_args(a: argparse.Namespace) -> ClusterConfig:
    """The cluster config file (or one replica), with the command line's profile, router and engine flags."""
    if a.cluster_config:
        cluster = ClusterConfig.load(a.cluster_config)
    else:
        if not a.profile:
            raise ConfigError("give --cluster-config, or --profile for a single replica")
        cluster = ClusterConfig([ReplicaConfig()], "round-robin", None)
    if a.profile:
        cluster.profile = a.profile
    if a.router:
        cluster.router = a.router
    flags = engine_args(a)
    if flags:
        cluster.replicas = [r.with_flags(**flags) for r in cluster.replicas]
    return cluster


def _simulate_main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    cluster = cluster_from_args(a)
    t0 = time.perf_counter()
    trace = read_trace(a.trace, a.num_reqs)
    sim, records = simulate(cluster, trace)
    wall = time.perf_counter() - t0
    write_csv(a.output, records)
    s = summarize(records)
    s["simulation_wall_s"] = wall
    s["replicas"] = sim.stats()
    print(summary_table(s))
    print(f"simulated {len(records)} requests on {len(sim.replicas)} replica(s) ({sim.router.name}) in {wall:.2f} s; "
          f"per-request rows in {a.output}")
    if a.summary_json:
        with open(a.summary_json, "w") as f:
            json.dump(s, f, indent=2, default=str)
    return 0


def _gen_trace_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="deltaserve simulate gen-trace", description="write a synthetic trace")
    p.add_argument("kind", choices=["agent", "mooncake"])
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("agent sessions")
    g.add_argument("--sessions", type=int, default=20)
    g.add_argument("--session-rate", type=float, default=1.0, help="new sessions per second")
    g.add_argument("--turns", default="2,5", help="min,max turns per session")
    g.add_argument("--system-tokens", type=int, default=512, help="shared system prompt + tools")
    g.add_argument("--first-user-tokens", default="64,256")
    g.add_argument("--new-tokens", default="32,192", help="min,max tokens appended per later turn")
    g.add_argument("--output-tokens", default="16,64")
    g.add_argument("--think-time", type=float, default=2.0, help="mean seconds between turns")
    g.add_argument("--min-gap", type=float, default=0.0,
                   help="at least this many seconds between a session's turns (the trace is open-loop: a gap "
                        "no shorter than a turn's service keeps its next turn from arriving before its answer)")
    g.add_argument("--vocab", type=int, default=4000)
    g = p.add_argument_group("mooncake-style")
    g.add_argument("--num-reqs", type=int, default=100)
    g.add_argument("--rate", type=float, default=1.0)
    a = p.parse_args(argv)
    rng2 = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
    if a.kind == "agent":
        spec = AgentTraceSpec(num_sessions=a.sessions, session_rate=a.session_rate, turns=rng2(a.turns),
                              system_tokens=a.system_tokens, first_user_tokens=rng2(a.first_user_tokens),
                              new_tokens=rng2(a.new_tokens), output_tokens=rng2(a.output_tokens),
                              think_time=a.think_time, min_gap=a.min_gap, vocab=a.vocab, seed=a.seed)
        reqs = agent_trace(spec)
        write_trace(a.out, reqs)
        n = len(reqs)
    else:

        with open(a.out, "w") as f:
            n = 0
            for d in mooncake_like(a.num_reqs, a.rate, seed=a.seed):
                f.write(json.dumps(d) + "\n")
                n += 1
    print(f"wrote {n} requests to {a.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "gen-trace":
        return _gen_trace_main(argv[1:])
    if argv and argv[0] == "external":

        return external_main(argv[1:])
    if argv and argv[0] == "hybrid-ab":
        return hybrid_ab_main(argv[1:])
    return _simulate_main(argv)
