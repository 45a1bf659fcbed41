"""The phases timed alone, outside a forward:

  rows        lm head and sampler per sampled row (dense.csv)
  attention   prefill attention at longer prior contexts (attention.csv), scaled by the in-context / alone
              ratio the prefill runs measured at prior 0
  copies      zeroing pages and slots, checkpoint restore and save (copies.csv)
  scheduler   the torch-free scheduler's schedule() + update() (overhead.csv)
"""
from __future__ import annotations

import math
import random

import torch

from ..engine.sampler import SamplingState
from ..engine.sampling_params import SamplingParams
from ..model.ops.attention import kv_gather
from ..scheduler import Request
from ..scheduler.build import build_scheduler, resolve_shape
from ..scheduler.plan import StateCopy
from ..sim.latency import Interp1D
from .profiler import stats


def _layers_to_time(n: int, tokens: int) -> int:
    """All layers while weight streaming matters (few tokens); a quarter (at least 2) when compute dominates."""
    if tokens <= 128 or n <= 2:
        return n
    return max(2, math.ceil(n / 4))


@torch.inference_mode()
def head_and_sampler(prof) -> None:
    """The lm head and the sampler, per sampled row."""
    m, H = prof.model, prof.cfg.hidden_size
    sp = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
    eos = prof.engine.tokenizer.eos_token_ids
    for R in prof.grid.rows:
        hdn = (torch.randn(R, H, generator=prof.gen)).to(prof.dtype).to(prof.device)
        st = prof.timeit(lambda: m.compute_logits(hdn))
        prof.rows["dense.csv"].append({"kernel": "lm_head", "tokens": R, "time_us": st[0], "p10_us": st[1],
                                       "p90_us": st[2], "layers": 1})
        logits = m.compute_logits(hdn)
        states = [SamplingState.create(sp, [1, 2, 3], eos_token_ids=eos, seed=i) for i in range(R)]
        rows_ = [logits[i] for i in range(R)]
        st = prof.timeit(lambda: prof.engine.sampler.sample(torch.stack(rows_), states))
        prof.rows["dense.csv"].append({"kernel": "sampler", "tokens": R, "time_us": st[0], "p10_us": st[1],
                                       "p90_us": st[2], "layers": 1})
        prof.tick(f"rows R={R}")


@torch.inference_mode()
def attention_grid(prof, attn_incontext: dict[int, float]) -> None:
    """Prefill attention at (q, prior context) per layer: the kernels alone (page gather + the model's prefill
    attention op), scaled by the in-context / alone ratio measured at prior 0 in the prefill runs
    (attn_incontext: T -> per-layer in-context time)."""
    if not prof.n_attn:
        return
    prefill_attention = prof.model.ops.prefill_attention  # the op the model's prefill runs (untimed)
    am = next(l for l in prof.model.layers if not l.is_gdn).self_attn
    kvs = prof.store.kv
    max_ctx = prof.num_pages * prof.bs
    alone: dict[tuple[int, int], tuple] = {}
    for q in prof.grid.attn_q:
        for prior in prof.grid.attn_prior:
            ctx = prior + q
            if ctx > max_ctx:
                prof.tick("skip")
                continue
            page_ids = torch.tensor(prof.perm[:-(-ctx // prof.bs)], dtype=torch.long, device=prof.device)
            qt = (torch.randn(q, am.hq, am.d, generator=prof.gen)).to(prof.dtype).to(prof.device)
            sel = kvs[:_layers_to_time(len(kvs), q)]

            def fn():
                for kv in sel:
                    keys, values = kv_gather(kv, page_ids, ctx)
                    prefill_attention(qt, keys, values, prior, am.scale)
            st = prof.timeit(fn)
            alone[(q, ctx)] = tuple(x / len(sel) for x in st)
            prof.tick(f"attn q={q} c={ctx}")
    ratios = {q: attn_incontext[q] / alone[(q, q)][0] for q in prof.grid.attn_q
              if q in attn_incontext and (q, q) in alone and alone[(q, q)][0] > 0}
    ratio = Interp1D(ratios.items()) if ratios else (lambda q: 1.0)
    prof.checks["attention_in_context_ratio"] = {q: round(r, 3) for q, r in ratios.items()}
    for (q, ctx), (med, p10, p90) in sorted(alone.items()):
        r = ratio(q)
        prof.rows["attention.csv"].append({"kernel": "attn_prefill", "query_tokens": q, "context_len": ctx,
                                           "time_us": med * r, "p10_us": p10 * r, "p90_us": p90 * r,
                                           "layers": prof.n_attn})


@torch.inference_mode()
def copies(prof) -> None:
    """Zeroing pages and slots, and (with GDN state) checkpoint restore and save, per count; the pool is zeroed
    after."""
    st = prof.store
    pool = prof.engine.pool
    nslots = pool.num_slots
    G = max(1, pool.num_gdn_groups * pool.pages_per_state)  # pages of one in-pool checkpoint

    def add(op, n, timing):
        prof.rows["copies.csv"].append({"op": op, "count": n, "time_us": timing[0], "p10_us": timing[1],
                                        "p90_us": timing[2]})

    for n in prof.grid.copies:
        pages = tuple(prof.perm[:min(n, pool.num_pages)])
        add("zero_pages", n, prof.timeit(lambda: st.zero_pages(pages)))
        slots = tuple(range(min(n, nslots)))
        add("zero_slots", n, prof.timeit(lambda: st.zero_slots(slots)))
        if st.conv:
            if st.beside:
                locs = [(p,) for p in prof.perm[:min(n, pool.num_pages)]]
            else:
                locs = [tuple(prof.perm[i * G:(i + 1) * G]) for i in range(min(n, pool.num_pages // G))]
            cps = [StateCopy(i % nslots, loc) for i, loc in enumerate(locs)]
            add("restore", n, prof.timeit(lambda: [st.restore(cp) for cp in cps]))
            add("save", n, prof.timeit(lambda: [st.save(cp) for cp in cps]))
        prof.tick(f"copies x{n}")
    st.zero_pages(tuple(range(pool.num_pages)))
    st.zero_slots(tuple(range(nslots)))


def scheduler_overhead(prof) -> None:
    """The scheduler's own time: schedule() + update() of a step of n decoding sequences, on a scheduler of the
    engine's shape with a pool that holds them."""
    eng = prof.engine
    cfg = eng.config
    S = max(prof.grid.seqs)
    pool = eng.pool
    ckpt = max(pool.checkpoint_pages, pool.num_gdn_groups)  # per-block takes no pool pages: keep the old margin
    kv = pool.slot_bytes * S + pool.bytes_per_page * (S * (4 + 2 * ckpt) + 64)
    shape = resolve_shape(eng.model_config, dtype=eng.dtype, block_size=cfg.block_size,
                          kv_cache_memory=max(kv, pool.total_bytes), max_num_seqs=S, cache_layout=cfg.cache_layout)
    rng = random.Random(0)
    for n in prof.grid.seqs:
        mem, sch = build_scheduler(shape, max_num_seqs=max(n, 1), max_num_batched_tokens=max(4096, n),
                                   enable_prefix_caching=cfg.enable_prefix_caching)
        for i in range(n):
            sch.add(Request(f"r{i}", [rng.randrange(10, 4000) for _ in range(100 + i)], max_tokens=1000))
        for _ in range(3):  # prefill, then decodes
            p = sch.schedule()
            sch.update(p, {w.request_id: 11 for w in p.work if w.sample})
        ts = []
        for _ in range(max(5, prof.grid.repeats * 2)):
            t = prof.timer()
            p = sch.schedule()
            sch.update(p, {w.request_id: 11 for w in p.work if w.sample})
            ts.append((prof.timer() - t) * 1e6)
        med, p10, p90 = stats(ts)
        prof.rows["overhead.csv"].append({"component": "scheduler", "n_seqs": n, "tokens": n, "time_us": med,
                                          "p10_us": p10, "p90_us": p90})
        prof.tick(f"scheduler n={n}")


@torch.inference_mode()
def vision_encoder(prof) -> None:
    """One image through the whole vision encoder (the runner's call, engine.vision), by its patch count, for a
    model with a vision tower: the simulator prices the images a step encodes with it. Random pixels: the
    encoder's work depends on the grid, not on the values."""
    visual = getattr(prof.engine, "vision", None)
    if visual is None:
        return
    vc = visual.config
    dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    m = vc.spatial_merge_size
    prof.rows["vision_encoder.csv"] = rows = []
    for side in prof.grid.encoder_sides:
        grid = (1, side * m, side * m)
        patches = grid[1] * grid[2]
        pixels = torch.randn(patches, dim, generator=prof.gen).to(prof.device)
        med, p10, p90 = prof.timeit(lambda px=pixels, g=grid: visual(px, [g]))
        rows.append({"patches": patches, "tokens": patches // vc.merge_unit, "time_us": med, "p10_us": p10,
                     "p90_us": p90})
