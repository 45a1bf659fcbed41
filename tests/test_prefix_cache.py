"""Hybrid prefix caching gates on the tiny preset (block 128 in bf16; 64 in the runs layout).

Every hit is compared with a cold run of the same prompt under a different cache_salt:
greedy tokens identical and logprobs bit-identical.
"""
from __future__ import annotations

import random

import pytest

from util import greedy, make_llm, random_tokens, run, signature

BLOCK = 128
LAYOUTS = ["in-page", "runs", "per-block"]


def agent_prompts(rng: random.Random) -> list[list[int]]:
    """32 prompts in four shapes, lengths from under one block to many blocks, in the order they are sent."""
    out: list[list[int]] = []
    for n in (40, 128, 300, 1000):  # one prompt repeated (sent twice)
        p = random_tokens(rng, n)
        out += [p, p]
    conv = random_tokens(rng, 150)  # a multi-turn agent conversation: each turn extends the last
    for _ in range(8):
        conv = conv + random_tokens(rng, rng.randrange(30, 200))
        out.append(list(conv))
    for n in (100, 256, 500, 777):  # an extension of an earlier prompt
        p = random_tokens(rng, n)
        out += [p, p + random_tokens(rng, rng.randrange(1, 300))]
    for n in (129, 384, 640, 900):  # a diverging prefix
        p = random_tokens(rng, n)
        out += [p + random_tokens(rng, 50), p + random_tokens(rng, 70)]
    assert len(out) == 32
    return out


# every layout with a budget of several blocks a step (hits land inside chunks); the one-block budget on the default
# layout (runs) by default, on the other two under the slow mark (the same gate, one more step shape)
@pytest.mark.parametrize("layout, budget", [(layout, 3 * BLOCK + 64) for layout in LAYOUTS] + [
    ("runs", BLOCK), *(pytest.param(layout, BLOCK, marks=pytest.mark.slow) for layout in ("in-page", "per-block"))])
def test_hit_equals_cold(layout, budget):
    _hit_equals_cold(layout, budget)


def test_hit_equals_cold_fp8(fp8_tiny):
    """The same gate on the block-FP8 checkpoint of the tiny preset (the compiled linear_fp8 is batch-invariant)."""
    _hit_equals_cold("in-page", 3 * BLOCK + 64, model=fp8_tiny)


def _hit_equals_cold(layout, budget, **kw):
    prompts = agent_prompts(random.Random(7))
    llm = make_llm(cache_layout=layout, max_num_batched_tokens=budget, kv_cache_memory=128 << 20, **kw)
    hits = [run(llm, [p], salt="shared")[0] for p in prompts]  # sequential: later prompts hit earlier ones
    colds = run(llm, prompts, salt=[f"cold-{i}" for i in range(len(prompts))])  # all at once, none can hit
    cold_sigs = [signature(run(llm, [p], salt=f"cold-again-{i}")[0]) for i, p in enumerate(prompts[:4])]
    assert cold_sigs == [signature(c) for c in colds[:4]]  # cold == cold, alone or batched
    mismatches = [i for i, (h, c) in enumerate(zip(hits, colds)) if signature(h) != signature(c)]
    assert mismatches == []
    cached = [h.num_cached_tokens for h in hits]
    assert llm.engine.block_size == (64 if layout == "runs" else BLOCK)
    assert all(c % llm.engine.block_size == 0 for c in cached)
    assert sum(c > 0 for c in cached) >= 16, cached  # most shapes do hit
    assert all(c.num_cached_tokens == 0 for c in colds)
    s = llm.engine.stats()
    assert s.checkpoints_restored > 0 and s.checkpoints_saved > 0 and s.pages_used == 0 and s.slots_used == 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_shared_system_prompt_hits_at_the_fork_and_equals_cold(layout):
    """A 700-token system prompt, then per-session text; budget 2048 so each first prompt is one chunk.
    Session 1 leaves checkpoints inside its chunk on a 256-token grid (the pool has room); session 2 hits the
    last of them inside the system prompt (512) and saves one at the fork (token 640, where its text leaves
    the cached chain; a learned resume point, since the sessions share a key, their salt), inside its own chunk;
    sessions 3 and 4 hit there. Every hit equals its cold run, bit
    for bit; without the grid, session 2 hits nothing and the fork save still serves sessions 3 and 4."""
    rng = random.Random(11)
    system = random_tokens(rng, 700)
    prompts = [system + random_tokens(rng, 200 + 37 * i) for i in range(4)]
    llm = make_llm(cache_layout=layout, max_num_batched_tokens=2048, kv_cache_memory=128 << 20, checkpoint_grid=256)
    hits = [run(llm, [p], salt="shared")[0] for p in prompts]
    colds = run(llm, prompts, salt=[f"cold-{i}" for i in range(len(prompts))])
    assert [h.num_cached_tokens for h in hits] == [0, 512, 640, 640]
    assert [signature(h) for h in hits] == [signature(c) for c in colds]
    kinds = llm.engine.memory.stats.checkpoints_saved_by_kind
    assert kinds["learned"] >= 1 and kinds["grid"] >= 2
    no_grid = make_llm(cache_layout=layout, max_num_batched_tokens=2048, kv_cache_memory=128 << 20, checkpoint_grid=0)
    hits = [run(no_grid, [p], salt="shared")[0] for p in prompts]
    assert [h.num_cached_tokens for h in hits] == [0, 0, 640, 640]
    assert [signature(h) for h in hits] == [signature(c) for c in colds]


@pytest.mark.parametrize("weights", ["bf16", "fp8"])
def test_drift_zero_with_unrelated_request_between(weights, request):
    rng = random.Random(8)
    p = random_tokens(rng, 700)
    llm = make_llm(**({"model": request.getfixturevalue("fp8_tiny")} if weights == "fp8" else {}))
    cold = signature(run(llm, [p], salt="cold")[0])
    run(llm, [p], salt="s")  # fill
    run(llm, [random_tokens(rng, 500)], salt="s")  # unrelated request between fill and hit
    hit = run(llm, [p], salt="s")[0]
    assert hit.num_cached_tokens == 640
    assert signature(hit) == cold  # drift 0.0


# 8K: four chunks of 2,048 before the hit; 16K (twice the chunks, four times the attention) under the slow mark
@pytest.mark.parametrize("n", [8_300, pytest.param(16_500, marks=pytest.mark.slow)])
def test_long_context_hit_equals_cold(n):
    rng = random.Random(9)
    p = random_tokens(rng, n)
    llm = make_llm(kv_cache_memory=256 << 20, max_num_batched_tokens=2048, max_num_seqs=2)
    run(llm, [p[:n - 100]], salt="s", params=greedy(max_tokens=1, logprobs=None))  # fill
    hit = run(llm, [p], salt="s", params=greedy(max_tokens=4))[0]
    assert hit.num_cached_tokens >= n - 500
    cold = run(llm, [p], salt="cold", params=greedy(max_tokens=4))[0]
    assert signature(hit) == signature(cold)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_preemption_mid_decode_resumes_from_cache(layout):
    from test_engine import _budget_for_pages

    rng = random.Random(10)
    prompts = [random_tokens(rng, 300 + 50 * i) for i in range(5)]
    params = greedy(max_tokens=150, logprobs=None)
    big = make_llm(cache_layout=layout, enable_prefix_caching=False)
    ref = [signature(run(big, [p], params=params)[0])[0] for p in prompts]
    small = make_llm(cache_layout=layout, kv_cache_memory=_budget_for_pages({"in-page": 14, "per-block": 12, "runs": 28}[layout], layout),
                     max_num_seqs=6)
    outs = run(small, prompts, salt="s", params=params)
    s = small.engine.stats()
    assert s.preemptions > 0 and s.checkpoints_restored > 0
    assert [signature(o)[0] for o in outs] == ref
    assert s.pages_used == 0 and s.slots_used == 0


def test_poison_in_freed_pages_and_slots_never_reaches_output():
    import torch

    rng = random.Random(11)
    prompts = [random_tokens(rng, n) for n in (90, 300, 520)]
    clean = make_llm()
    ref = [signature(o) for o in run(clean, prompts, salt="x")]
    llm = make_llm()
    run(llm, [random_tokens(rng, 400) for _ in range(4)], salt="y")  # use, then free, pages and slots
    store, mem = llm.engine.store, llm.engine.memory
    free_pages = torch.tensor(sorted(mem.free_page_ids()), dtype=torch.long)
    assert len(free_pages) > 0
    for t in store.pool:
        t.view(torch.bfloat16)[free_pages] = float("nan")
    for t in store.conv + store.ssm:
        t.fill_(float("nan"))  # every slot is free now
    outs = run(llm, prompts, salt="x")
    assert [signature(o) for o in outs] == ref


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hinted_system_prefix_is_checkpointed(layout):
    """A request's cache hint (the end of its system prefix, as the chat routes pass it) takes a checkpoint at the
    block boundary at or before it, from any allocatable page (a grid checkpoint takes free pages only, so a
    full pool, as agent traffic leaves it, has none): session 2 hits the whole hinted prefix (640 of 700
    tokens), bit for bit as cold. Without the hint and the grid, session 2 hits nothing (the fork checkpoint it
    leaves serves session 3)."""
    rng = random.Random(12)
    system = random_tokens(rng, 700)
    prompts = [system + random_tokens(rng, 200 + 37 * i) for i in range(3)]

    def sessions(hint: bool):
        llm = make_llm(cache_layout=layout, max_num_batched_tokens=2048, kv_cache_memory=128 << 20, checkpoint_grid=0)
        reqs = [{"prompt_token_ids": p, "cache_salt": "shared", **({"cache_hints": [700, 5000, -1]} if hint else {})}
                for p in prompts]
        hits = [llm.generate([r], greedy(), use_tqdm=False)[0] for r in reqs]
        colds = run(llm, prompts, salt=[f"cold-{i}" for i in range(len(prompts))])
        assert [signature(h) for h in hits] == [signature(c) for c in colds]
        return [h.num_cached_tokens for h in hits], llm.engine.memory.stats.checkpoints_saved_by_kind["declared"]

    assert sessions(hint=True) == ([0, 640, 640], 1)
    assert sessions(hint=False) == ([0, 0, 640], 0)


def test_cache_hints_must_be_positions():
    llm = make_llm()
    with pytest.raises(Exception, match="cache_hints"):
        llm.generate([{"prompt_token_ids": [5, 6, 7], "cache_hints": "end"}], greedy(), use_tqdm=False)
    assert llm.engine.stats().pages_used == 0
