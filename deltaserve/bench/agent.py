"""`deltaserve bench agent`: synthetic agent sessions, caching off vs in-page vs per-block, side by side.

Each session shares one system prompt + tool block; every turn re-sends the whole conversation
(previous prompt + the previous answer + new tokens), growing from about 1/8 of the target context
to all of it with about 5% of the target as new tokens per turn, as seed 000's replay does. Sessions
run closed-loop: a session's next turn is sent when its previous answer is complete.
"""
from __future__ import annotations

import argparse
import csv
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Turn:
    session: int
    turn: int
    new_tokens: list[int]  # appended to the conversation (user message / tool result) before this turn
    output_tokens: int


def make_sessions(num_sessions: int, target_context: int, output_tokens: int, seed: int = 0,
                  vocab: int = 3000, new_frac: float = 0.05, start_frac: float = 0.125) -> tuple[list[int], list[list[Turn]]]:
    """(shared prefix, per-session turns). Turn 0's new tokens follow the shared prefix."""
    rng = random.Random(seed)
    shared = [rng.randrange(10, vocab) for _ in range(max(1, int(target_context * start_frac * 0.6)))]
    sessions = []
    for s in range(num_sessions):
        first = [rng.randrange(10, vocab) for _ in range(int(target_context * start_frac) - len(shared))]
        turns, ctx, t = [Turn(s, 0, first, output_tokens)], int(target_context * start_frac), 1
        step = max(1, int(target_context * new_frac))
        while ctx + output_tokens + step + output_tokens <= target_context:
            ctx += output_tokens + step
            turns.append(Turn(s, t, [rng.randrange(10, vocab) for _ in range(step)], output_tokens))
            t += 1
        sessions.append(turns)
    return shared, sessions


@dataclass
class TurnResult:
    arm: str
    session: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    e2e_s: float
    output_tokens: int


def run_arm(arm: str, engine_args: dict, shared: list[int], sessions: list[list[Turn]], progress=None) -> tuple[list[TurnResult], dict]:
    """Run every session closed-loop on a fresh in-process engine; returns per-turn results and a summary."""
    from ..engine import LLMEngine
    from ..config import EngineConfig
    from ..sampling_params import SamplingParams

    eng = LLMEngine(EngineConfig.from_kwargs(**engine_args))
    convo = {i: list(shared) for i in range(len(sessions))}
    nxt = {i: 0 for i in range(len(sessions))}
    live: dict[str, tuple[int, int, float, float | None]] = {}
    results: list[TurnResult] = []

    def submit(s: int) -> None:
        turn = sessions[s][nxt[s]]
        convo[s] += turn.new_tokens
        rid = f"{arm}-{s}-{turn.turn}"
        eng.add_request(rid, {"prompt_token_ids": list(convo[s])},
                        SamplingParams(temperature=0.0, max_tokens=turn.output_tokens, ignore_eos=True))
        live[rid] = (s, turn.turn, time.perf_counter(), None)

    t0 = time.perf_counter()
    for s in range(len(sessions)):
        submit(s)
    while live:
        for out in eng.step():
            s, t, sent, first = live[out.request_id]
            now = time.perf_counter()
            if first is None and out.outputs[0].token_ids:
                first = now
                live[out.request_id] = (s, t, sent, first)
            if out.finished:
                del live[out.request_id]
                results.append(TurnResult(arm, s, t, len(out.prompt_token_ids), out.num_cached_tokens,
                                          first - sent, now - sent, len(out.outputs[0].token_ids)))
                convo[s] += out.outputs[0].token_ids
                nxt[s] += 1
                if progress:
                    progress(1)
                if nxt[s] < len(sessions[s]):
                    submit(s)
    wall = time.perf_counter() - t0
    later = [r for r in results if r.turn > 0]
    ttfts = sorted(r.ttft_s for r in later) or [0.0]
    decode = [(r.output_tokens - 1) / (r.e2e_s - r.ttft_s) for r in results if r.e2e_s > r.ttft_s and r.output_tokens > 1]
    st = eng.stats()
    prompt_tokens = sum(r.prompt_tokens for r in results)
    summary = dict(arm=arm, wall_s=wall, later_ttft_mean_s=statistics.mean(ttfts),
                   later_ttft_p90_s=ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
                   decode_tok_s_per_stream=statistics.mean(decode) if decode else 0.0,
                   hit_rate=sum(r.cached_tokens for r in results) / max(1, prompt_tokens),
                   cached_tokens=sum(r.cached_tokens for r in results), pool_tokens=eng.pool.pool_tokens,
                   block_size=eng.block_size, preemptions=st.preemptions)
    return results, summary


ARMS = {
    "off": dict(enable_prefix_caching=False),
    "in-page": dict(enable_prefix_caching=True, cache_layout="in-page"),
    "per-block": dict(enable_prefix_caching=True, cache_layout="per-block"),
}


def plot(results: list[TurnResult], out_prefix: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = sorted({r.arm for r in results}, key=list(ARMS).index if all(r.arm in ARMS for r in results) else str)
    paths = []
    fig, ax = plt.subplots(figsize=(7, 4))
    for arm in arms:
        by_turn: dict[int, list[float]] = {}
        for r in results:
            if r.arm == arm:
                by_turn.setdefault(r.turn, []).append(r.ttft_s)
        turns = sorted(by_turn)
        ax.plot(turns, [statistics.mean(by_turn[t]) for t in turns], marker="o", label=arm)
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT (s), mean over sessions")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("agent replay: TTFT per turn")
    fig.tight_layout()
    paths.append(f"{out_prefix}_ttft_per_turn.png")
    fig.savefig(paths[-1], dpi=110)
    fig, ax = plt.subplots(figsize=(7, 4))
    for arm in arms:
        rs = [r for r in results if r.arm == arm]
        ax.scatter([r.prompt_tokens for r in rs], [r.ttft_s for r in rs], label=arm, s=14)
    ax.set_xlabel("context length (prompt tokens)")
    ax.set_ylabel("TTFT (s)")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("agent replay: context length vs TTFT")
    fig.tight_layout()
    paths.append(f"{out_prefix}_ttft_vs_context.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close("all")
    return paths


def format_table(summaries: list[dict]) -> str:
    cols = ["arm", "wall_s", "later_ttft_mean_s", "later_ttft_p90_s", "decode_tok_s_per_stream", "hit_rate",
            "cached_tokens", "pool_tokens", "preemptions"]
    base = next((s for s in summaries if s["arm"] == "off"), None)
    lines = ["| " + " | ".join(cols + (["wall vs off", "later TTFT vs off"] if base else [])) + " |",
             "|" + "---|" * (len(cols) + (2 if base else 0))]
    for s in summaries:
        cells = [f"{s[c]:.3f}" if isinstance(s[c], float) else f"{s[c]:,}" if isinstance(s[c], int) else str(s[c])
                 for c in cols]
        if base:
            cells += [f"{base['wall_s'] / s['wall_s']:.2f}x", f"{base['later_ttft_mean_s'] / s['later_ttft_mean_s']:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="deltaserve bench agent", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--model", default=None)
    p.add_argument("--arms", default="off,in-page,per-block")
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--target-context", type=int, default=8192)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/agent", help="prefix for the CSV and PNG files")
    a = p.parse_args(argv)
    from tqdm import tqdm

    shared, sessions = make_sessions(a.sessions, a.target_context, a.output_tokens, seed=a.seed)
    n_turns = sum(len(s) for s in sessions)
    arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    unknown = set(arms) - set(ARMS)
    if unknown:
        p.error(f"unknown arm(s) {sorted(unknown)}; choose from {list(ARMS)}")
    base = dict(model=a.model, preset=a.preset, kv_cache_memory=a.kv_cache_memory, dtype="bfloat16",
                max_num_batched_tokens=a.max_num_batched_tokens, max_num_seqs=a.max_num_seqs, seed=a.seed)
    print(f"agent replay: {a.sessions} sessions, {n_turns} turns, context {len(shared) + len(sessions[0][0].new_tokens)}"
          f" -> ~{a.target_context} tokens, {a.output_tokens} output tokens per turn, preset {a.model or a.preset}")
    all_results, summaries = [], []
    for arm in arms:
        with tqdm(total=n_turns, desc=arm, unit="turn") as bar:
            res, summ = run_arm(arm, {**base, **ARMS[arm]}, shared, sessions, progress=bar.update)
        all_results += res
        summaries.append(summ)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(f"{a.out}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(asdict(all_results[0])))
        w.writeheader()
        w.writerows(asdict(r) for r in all_results)
    pngs = plot(all_results, a.out)
    print(format_table(summaries))
    print(f"wrote {a.out}.csv, " + ", ".join(pngs))
    return 0
