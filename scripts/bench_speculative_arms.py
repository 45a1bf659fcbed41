"""Speculative decoding arms on one engine, interleaved in a shuffled order each repeat: plain (no drafter) and
scripted drafters right with probability p (plain greedy's own continuation), adaptive or fixed drafts; batch 1.
Prints wall and process-CPU tok/s of the decode phase (after the first token): on a host shared with other jobs the
CPU time of a one-thread run is the steadier figure. Run with OMP_NUM_THREADS=1 from the repository root:

    OMP_NUM_THREADS=1 python scripts/bench_speculative_arms.py qwen3.5-0.8b-shape 64 3    # preset, tokens, repeats
"""
import dataclasses
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's deltaserve

import torch

from deltaserve import LLM, SamplingParams
from deltaserve.embedded.model import ensure_model
from deltaserve.engine.speculative import ScriptedDrafter

preset, ntok, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = LLM(ensure_model(preset), dtype="bfloat16", kv_cache_memory=512 << 20, max_num_seqs=1,
          max_num_batched_tokens=2048, enable_prefix_caching=False,
          speculative_config={"method": "mtp", "num_speculative_tokens": 3})
eng = llm.engine
print("threads", torch.get_num_threads(), "kernels", eng.cpu_kernels, flush=True)
rng = random.Random(0)
prompt = [rng.randrange(100, 3000) for _ in range(128)]
params = SamplingParams(temperature=0.0, max_tokens=ntok, ignore_eos=True)
eng.drafter = None
cont = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
arms = [("plain", None, True), ("p1", 1.0, True), ("p0.8", 0.8, True), ("p0.8 fixed", 0.8, False),
        ("p0", 0.0, True), ("p0 fixed", 0.0, False)]
n = 0
res = {a[0]: [] for a in arms}
for r in range(reps):
    for name, p, adaptive in random.Random(r).sample(arms, len(arms)):
        eng.spec = dataclasses.replace(eng.spec, adaptive=adaptive)
        eng.drafter = None if p is None else ScriptedDrafter({tuple(prompt): cont}, p=p, vocab_size=eng.model_config.vocab_size, seed=r)
        n += 1
        rid = f"r{n}"
        eng.add_request(rid, {"prompt_token_ids": prompt}, params)
        got, t0 = 0, None
        before = eng.stats()
        while True:
            outs = eng.step()
            o = next((o for o in outs if o.request_id == rid), None)
            if o is not None:
                got = len(o.outputs[0].token_ids)
                if t0 is None and got >= 1:
                    t0, c0, g0 = time.perf_counter(), time.process_time(), got
                if o.finished:
                    break
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        after = eng.stats()
        d = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
        a = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
        res[name].append(((got - g0) / dt, (got - g0) / dc, a / d if d else None))
        print(f"rep {r} {name}: wall {res[name][-1][0]:.2f} tok/s, cpu {res[name][-1][1]:.2f} tok/s, accepted {a}/{d}; load {os.getloadavg()[0]:.1f}", flush=True)
base_w = max(x[0] for x in res["plain"]); base_c = max(x[1] for x in res["plain"])
med_w = statistics.median(x[0] for x in res["plain"]); med_c = statistics.median(x[1] for x in res["plain"])
print("| arm | best wall tok/s | x plain | median wall | x plain | best CPU-time tok/s | x plain | median CPU | x plain | accepted |")
print("|---|---|---|---|---|---|---|---|---|---|")
for name, *_ in arms:
    v = res[name]
    bw, bc = max(x[0] for x in v), max(x[1] for x in v)
    mw, mc = statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)
    acc = [x[2] for x in v if x[2] is not None]
    print(f"| {name} | {bw:.2f} | {bw / base_w:.2f}x | {mw:.2f} | {mw / med_w:.2f}x | {bc:.2f} | {bc / base_c:.2f}x | {mc:.2f} | {mc / med_c:.2f}x | {statistics.mean(acc) if acc else 0:.2f} |")
