"""`deltaserve bench restart`: a session's next turn after the server restarted, served from the prefix cache's
disk tier, against the same turn cold; side by side in one run.

    deltaserve bench restart --preset qwen3.5-0.8b-shape --context 32768

One session: turn 1 is --context prompt tokens (seeded random ids) and --output-tokens generated; its engine runs
with --cache-disk DIR (a fresh directory) and is closed, which ends its writes. A second engine opens the same
DIR, as a restarted server does, and serves turn 2: turn 1's prompt, its answer and --new-tokens more. A third
engine without the disk tier serves turn 2 cold. Greedy with logprobs: the restarted turn must equal its cold
twin bit for bit (tokens and logprobs), which the report checks.

Reported: turn 1's TTFT (cold); turn 2 after the restart: prompt tokens, cached tokens and their share of turn 1's
prompt, the tokens that came from disk, the reads and their mean latency, TTFT; turn 2 cold: TTFT; the ratio cold
/ restarted and the targets (>= 95% of the previous prompt cached, TTFT <= 1/5 of cold).
"""
from __future__ import annotations

import argparse
import random
import shutil
import tempfile

from ..config import ENGINE_DEFAULTS, add_engine_args, engine_args
from ..engine.llm import LLM
from ..engine.sampling_params import SamplingParams
from .progress import progress_for

_say = progress_for("restart")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deltaserve bench restart", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--context", type=int, default=32768, help="turn 1's prompt tokens")
    p.add_argument("--new-tokens", type=int, default=512, help="turn 2's tokens after turn 1's answer")
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0, help="the prompt's random ids")
    p.add_argument("--dir", default=None, help="the disk tier's directory (default: a fresh temporary one)")
    add_engine_args(p, ("preset", "model", "kv_cache_memory", "max_num_batched_tokens", "cache_layout",
                        "checkpoint_grid", "num_threads", "cache_disk_bytes"))
    return p


def _serve(flags: dict, prompt: list[int], params: SamplingParams):
    """One request on a fresh engine: its output, its time to first token (the engine's own request metrics), the
    engine's stats; the engine closed (which ends its disk writes)."""
    llm = LLM(**flags)
    try:
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        return out, out.metrics.first_token_time - out.metrics.arrival_time, llm.engine.stats()
    finally:
        llm.close()


def _signature(out) -> tuple:
    c = out.outputs[0]
    return tuple(c.token_ids), tuple(tuple(sorted((t, lp.logprob) for t, lp in pos.items())) for pos in c.logprobs)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    flags = engine_args(a)
    vocab = 3000  # ids well inside every preset's vocabulary, clear of the special tokens
    rng = random.Random(a.seed)
    p1 = [rng.randrange(10, vocab) for _ in range(a.context)]
    params = SamplingParams(temperature=0.0, max_tokens=a.output_tokens, ignore_eos=True, logprobs=5)
    directory = a.dir or tempfile.mkdtemp(prefix="deltaserve-restart-")
    shutil.rmtree(directory, ignore_errors=True)
    disk = flags | {"cache_disk": directory}
    try:
        _say(f"turn 1: {a.context} tokens cold, tier {directory}")
        out1, ttft1, _ = _serve(disk, p1, params)
        p2 = p1 + list(out1.outputs[0].token_ids) + [rng.randrange(10, vocab) for _ in range(a.new_tokens)]
        _say(f"turn 2 after a restart: {len(p2)} tokens")
        hit, ttft_hit, s = _serve(disk, p2, params)
        _say("turn 2 cold")
        cold, ttft_cold, _ = _serve(flags, p2, params)
    finally:
        if a.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    share = hit.num_cached_tokens / len(p1)
    ratio = ttft_cold / ttft_hit
    same = _signature(hit) == _signature(cold)
    mean_read = s.disk_read_seconds / s.disk_reads * 1e3 if s.disk_reads else 0.0
    print(f"model {flags.get('preset', ENGINE_DEFAULTS['preset']) if 'model' not in flags else flags['model']}, "
          f"layout {flags.get('cache_layout', ENGINE_DEFAULTS['cache_layout'])}")
    print("| | prompt | cached | from disk | TTFT s |")
    print("|---|---|---|---|---|")
    print(f"| turn 1, cold | {len(p1)} | 0 | - | {ttft1:.2f} |")
    print(f"| turn 2 after a restart | {len(p2)} | {hit.num_cached_tokens} ({100 * share:.1f}% of turn 1's prompt) | "
          f"{s.disk_hit_tokens} tokens, {s.disk_reads} reads, {mean_read:.1f} ms mean | {ttft_hit:.2f} |")
    print(f"| turn 2, cold | {len(p2)} | {cold.num_cached_tokens} | - | {ttft_cold:.2f} |")
    print(f"cold / restarted TTFT {ratio:.1f}x (target >= 5x: {'met' if ratio >= 5 else 'missed'}); cached "
          f"{100 * share:.1f}% of the previous prompt (target >= 95%: {'met' if share >= 0.95 else 'missed'}); "
          f"restarted == cold, tokens and logprobs: {'bit-identical' if same else 'DIFFERENT'}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
