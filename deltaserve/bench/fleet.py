"""`deltaserve bench fleet`: a fleet of agent sessions that share one system prompt and tool list, in-process,
prefix caching off against on (one arm per cache layout asked for), side by side in one run.

Workload: N sessions; every session's first turn is the shared prefix (a system prompt plus a tool list,
--shared-tokens) and its own user message; every later turn re-sends the whole conversation: the previous
prompt, the answer the model generated (its own token ids, as a client re-sending the answer's text does) and
new user or tool text (--new-tokens). Sessions start staggered (session k+1 sends its first turn when session
k's first answer is complete) and then run closed-loop. Greedy, ignore_eos, --output-tokens per answer; with
caching on every hit is bit-identical to the cold run (tests/test_agent_cache.py), so every arm sees exactly the
same prompts. Every prompt carries the cache hint the chat routes derive for a request with a system prompt and
tools (a position at the end of the shared prefix: a declared resume point, docs/design.md); --no-cache-hints
sends bare token ids, as a client of the raw completions route does.

Reported per arm: wall; per turn, the cached fraction of the prompt and TTFT; the first-turn TTFT of sessions
2..N against session 1's, and the share of the shared prefix they cached; the generated tokens recomputed through
the prefill path (background jobs: the scheduler's docstring) and their share of the wall time (each step's time
split by its tokens; a decode token counted as one); and the off/on ratios with the targets:
wall >= 6x, later-turn TTFT >= 10x, sessions 2..N cache >= 90% of the shared prefix, re-prefill <= 5% of wall.

With --cache-disk DIR, every caching arm also runs with the prefix cache's disk tier (an arm "<layout>+disk", each in
a fresh directory under DIR): with a pool smaller than the fleet's live context, what the pool evicts comes back
from disk instead of being recomputed (the report adds the disk's hit tokens, reads and mean read latency).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from dataclasses import dataclass

from ..config import ENGINE_DEFAULTS, EVICTIONS, LAYOUT_NAMES, add_engine_args, engine_args
from ..engine.sampling_params import SamplingParams
from .agent.workload import TurnResult
from .progress import progress_for
from .serve import in_process

DEFAULTS = {  # per preset: sessions, turns, output tokens, the cache pool
    "tiny": {"sessions": 4, "turns": 4, "output_tokens": 32, "kv_cache_memory": 512 << 20},
    "qwen3.5-0.8b-shape": {"sessions": 4, "turns": 3, "output_tokens": 16, "kv_cache_memory": 3 << 30},
}


_progress = progress_for("fleet")


@dataclass(frozen=True)
class Workload:
    shared: list[int]
    first: list[list[int]]  # per session: its first user message
    news: list[list[list[int]]]  # per session, per later turn: the new text
    output_tokens: int


def make_workload(sessions: int, turns: int, shared_tokens: int, new_tokens: tuple[int, int], output_tokens: int,
                  seed: int, vocab: int = 3000) -> Workload:
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(10, vocab) for _ in range(n)]  # noqa: E731
    return Workload(ids(shared_tokens), [ids(rng.randint(*new_tokens)) for _ in range(sessions)],
                    [[ids(rng.randint(*new_tokens)) for _ in range(turns - 1)] for _ in range(sessions)], output_tokens)


def run_arm(engine_flags: dict, wl: Workload, label: str, think_time: float = 0.0, hints: bool = True) -> dict:
    """One arm: a fresh engine, the fleet replayed closed-loop with the staggered start; a session sends its next
    turn think_time seconds after its answer is complete (the client runs a tool meanwhile; the engine is free to
    do its background work). Returns its summary."""

    eng = in_process(engine_flags).engine
    params = SamplingParams(temperature=0.0, max_tokens=wl.output_tokens, ignore_eos=True)
    warm = [random.Random(7).randrange(10, 3000) for _ in range(200)]  # first calls into every kernel
    eng.add_request("warm", {"prompt_token_ids": warm, "cache_salt": "warm"}, params)
    while eng.has_unfinished_requests() or eng.has_background_work():
        eng.step()
    n = len(wl.first)
    convo = [list(wl.shared) + list(wl.first[s]) for s in range(n)]
    turn = [0] * n
    live: dict[str, list] = {}
    records: list[TurnResult] = []
    bg_s = 0.0
    job_tokens0 = eng.stats().reprefill_tokens

    due: list[tuple[float, int]] = []  # (when, session): turns waiting for their client's think time

    def send(s: int) -> None:
        rid = f"{label}-{s}-{turn[s]}"
        prompt = {"prompt_token_ids": list(convo[s])}
        if hints:
            prompt["cache_hints"] = [len(wl.shared)]
        eng.add_request(rid, prompt, params)
        live[rid] = [s, time.perf_counter(), None]

    t0 = time.perf_counter()
    send(0)
    while live or due or eng.has_background_work():
        now = time.perf_counter()
        for when, s in [d for d in due if d[0] <= now]:
            due.remove((when, s))
            send(s)
        if not live and not eng.has_background_work():
            time.sleep(max(0.0, min(w for w, _ in due) - now))
            continue
        ts = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - ts
        plan = eng.last_plan
        if plan is not None and plan.work:
            bg = sum(len(w.token_ids) for w in plan.work if w.request_id.endswith("/outputs"))
            bg_s += dt * bg / plan.num_tokens
        now = time.perf_counter()
        for out in outs:
            st = live.get(out.request_id)
            if st is None:
                continue
            if st[2] is None and out.outputs[0].token_ids:
                st[2] = now
            if not out.finished:
                continue
            del live[out.request_id]
            s, sent, first = st
            records.append(TurnResult(label, s, turn[s], len(out.prompt_token_ids), out.num_cached_tokens,
                                      first - sent, now - sent, len(out.outputs[0].token_ids), sent - t0))
            convo[s] += list(out.outputs[0].token_ids)
            if turn[s] == 0 and s + 1 < n:
                send(s + 1)  # the staggered start
            turn[s] += 1
            if turn[s] <= len(wl.news[s]):
                convo[s] += wl.news[s][turn[s] - 1]
                due.append((now + think_time, s))
    wall = time.perf_counter() - t0
    st = eng.stats()
    eng.shutdown()
    shared = len(wl.shared)
    later = [r for r in records if r.turn > 0]
    firsts = sorted((r for r in records if r.turn == 0), key=lambda r: r.session)
    return {"arm": label, "wall_s": wall, "records": records,
            "later_ttft_s": statistics.mean(r.ttft_s for r in later) if later else float("nan"),
            "first_ttft_s": firsts[0].ttft_s,
            "others_first_ttft_s": statistics.mean(r.ttft_s for r in firsts[1:]) if len(firsts) > 1 else float("nan"),
            "others_shared_cached": (min(min(r.cached_tokens, shared) / shared for r in firsts[1:])
                                     if len(firsts) > 1 else float("nan")),
            "hit_rate": sum(r.cached_tokens for r in records) / sum(r.prompt_tokens for r in records),
            "reprefill_tokens": st.reprefill_tokens - job_tokens0, "reprefill_s": bg_s,
            "reprefill_jobs": st.reprefill_jobs, "reprefill_dropped": st.reprefill_dropped,
            "checkpoints_saved_by_kind": st.checkpoints_saved_by_kind, "pool_tokens": eng.pool.pool_tokens,
            "evictions": st.evictions, "preemptions": st.preemptions,
            "block_size": eng.block_size, "disk_hit_tokens": st.disk_hit_tokens, "disk_reads": st.disk_reads,
            "disk_read_s": st.disk_read_seconds / st.disk_reads if st.disk_reads else 0.0,
            "disk_writes": st.disk_writes}


def format_report(arms: list[dict], head: str) -> str:
    out = [head, "", "| arm | wall s | later-turn TTFT s | session 1 first TTFT s | sessions 2..N first TTFT s | "
           "2..N cached of shared | hit rate | re-prefill tokens | re-prefill share of wall | checkpoints saved | "
           "evicted pages / preemptions |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for a in arms:
        kinds = ", ".join(f"{k} {v}" for k, v in a["checkpoints_saved_by_kind"].items() if v)
        out.append(f"| {a['arm']} | {a['wall_s']:.2f} | {a['later_ttft_s']:.3f} | {a['first_ttft_s']:.3f} | "
                   f"{a['others_first_ttft_s']:.3f} | {a['others_shared_cached']:.0%} | {a['hit_rate']:.3f} | "
                   f"{a['reprefill_tokens']:,} | {a['reprefill_s'] / a['wall_s']:.1%} | {kinds or '-'} | "
                   f"{a['evictions']:,} / {a['preemptions']} |")
    off = next((a for a in arms if a["arm"] == "off"), None)
    if off is not None:
        out += ["", "| arm vs off | wall | later-turn TTFT | target |", "|---|---|---|---|"]
        for a in arms:
            if a is off:
                continue
            w, t = off["wall_s"] / a["wall_s"], off["later_ttft_s"] / a["later_ttft_s"]
            ok = (w >= 6, t >= 10, a["others_shared_cached"] >= 0.9, a["reprefill_s"] <= 0.05 * a["wall_s"])
            out.append(f"| {a['arm']} | {w:.2f}x | {t:.2f}x | wall >= 6x {'yes' if ok[0] else 'no'}, later TTFT >= "
                       f"10x {'yes' if ok[1] else 'no'}, 2..N cache >= 90% {'yes' if ok[2] else 'no'}, re-prefill "
                       f"<= 5% {'yes' if ok[3] else 'no'} |")
    disk = [a for a in arms if a["arm"].endswith("+disk")]
    if disk:
        out += ["", "| disk arm | hit tokens from disk | reads | mean read ms | writes |", "|---|---|---|---|---|"]
        out += [f"| {a['arm']} | {a['disk_hit_tokens']:,} | {a['disk_reads']:,} | {a['disk_read_s'] * 1e3:.2f} | "
                f"{a['disk_writes']:,} |" for a in disk]
    on = [a for a in arms if a["arm"] != "off"]
    if on:
        out += ["", "per turn, cached share of the prompt / TTFT s:", "",
                "| session | turn | prompt | " + " | ".join(a["arm"] for a in on) + " |",
                "|---|---|---|" + "---|" * len(on)]
        rows = [{(r.session, r.turn): r for r in a["records"]} for a in on]
        for key in sorted(rows[0]):
            cells = [f"{row[key].cached_tokens / row[key].prompt_tokens:.0%} / {row[key].ttft_s:.3f}"
                     if key in row else "-" for row in rows]
            out.append(f"| {key[0] + 1} | {key[1]} | {rows[0][key].prompt_tokens} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deltaserve bench fleet", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default="off,runs",
                   help=f"comma list of off and cache layouts ({', '.join(LAYOUT_NAMES)}), a layout optionally "
                        f"with an eviction policy (runs:value, runs:lru: a pressure scenario compares them)")
    p.add_argument("--sessions", type=int, default=None)
    p.add_argument("--turns", type=int, default=None, help="turns per session")
    p.add_argument("--shared-tokens", type=int, default=2000, help="the shared system prompt + tool list")
    p.add_argument("--new-tokens", default="100,300", help="min,max new tokens per turn (user or tool text)")
    p.add_argument("--output-tokens", type=int, default=None)
    p.add_argument("--think-time", type=float, default=0.0,
                   help="seconds a session's client takes between an answer and its next turn (a tool running)")
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--cache-hints", action=argparse.BooleanOptionalAction, default=True,
                   help="each prompt carries the hint the chat routes give at the end of the shared system prompt "
                        "and tools, so a checkpoint is taken there whatever the pool's pressure")
    add_engine_args(p, ("preset", "model", "kv_cache_memory", "max_num_batched_tokens", "max_num_seqs",
                        "checkpoint_grid", "reprefill_outputs", "reprefill_job_tokens", "eviction", "num_threads",
                        "cache_disk", "cache_disk_bytes"))
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    flags = engine_args(a)
    preset = flags.get("preset", ENGINE_DEFAULTS["preset"])
    d = DEFAULTS.get(preset, DEFAULTS["tiny"])
    sessions, turns = a.sessions or d["sessions"], a.turns or d["turns"]
    out_tokens = a.output_tokens or d["output_tokens"]
    lo, hi = (int(x) for x in a.new_tokens.split(","))
    wl = make_workload(sessions, turns, a.shared_tokens, (lo, hi), out_tokens, a.workload_seed)
    disk_dir = flags.pop("cache_disk", None)
    base = {"kv_cache_memory": d["kv_cache_memory"], "dtype": "bfloat16", "max_num_seqs": max(4, sessions), **flags}
    arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    if disk_dir and not any(x.endswith("+disk") for x in arms):
        arms = [y for x in arms for y in ((x,) if x == "off" else (x, x + "+disk"))]
    if any(x.endswith("+disk") for x in arms) and not disk_dir:
        raise SystemExit("deltaserve bench fleet: a +disk arm needs --cache-disk DIR")
    bad = [x for x in arms if x != "off" and (x.removesuffix("+disk").split(":")[0] not in LAYOUT_NAMES
                                              or x.removesuffix("+disk").partition(":")[2] not in ("",) + EVICTIONS)]
    if bad:
        raise SystemExit(f"deltaserve bench fleet: unknown arm(s) {bad}; choose from off, {', '.join(LAYOUT_NAMES)} "
                         f"(optionally :{'|:'.join(EVICTIONS)})")
    results = []
    for i, arm in enumerate(arms):
        layout, _, eviction = arm.removesuffix("+disk").partition(":")
        cfg = {**base, "enable_prefix_caching": arm != "off"}
        if arm != "off":
            cfg |= {"cache_layout": layout} | ({"eviction": eviction} if eviction else {})
        if arm.endswith("+disk"):  # a fresh directory: the arm starts cold, as the others do
            cfg["cache_disk"] = os.path.join(disk_dir, f"fleet-{os.getpid()}-{i}")
        _progress(f"{arm}: {sessions} sessions x {turns} turns")
        results.append(run_arm(cfg, wl, arm, a.think_time, a.cache_hints))
        r = results[-1]
        _progress(f"{arm}: wall {r['wall_s']:.1f}s, later TTFT {r['later_ttft_s']:.3f}s, hit rate {r['hit_rate']:.3f}")
    head = (f"fleet: {sessions} sessions x {turns} turns sharing {a.shared_tokens} tokens, {lo}-{hi} new tokens and "
            f"{out_tokens} generated per turn (re-sent), think time {a.think_time} s, {flags.get('model') or preset}, "
            f"bf16, cache hints {'on' if a.cache_hints else 'off'}, token budget "
            f"{base.get('max_num_batched_tokens', ENGINE_DEFAULTS['max_num_batched_tokens'])}")
    print(format_report(results, head))
    return 0
