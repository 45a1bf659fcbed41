"""The cases agent traffic produces every turn, each hit compared with its cold twin (another cache_salt), bit for
bit: sessions sharing a system prompt, a next turn that contains the previous turn's output, token budgets."""
import random

import pytest

from tests.util import greedy, make_llm, random_tokens, run, signature

LAYOUTS = ("runs", "in-page", "per-block")


def _block(llm) -> int:
    return llm.engine.block_size


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sessions_sharing_a_system_prompt(layout):
    """A 1,500-token system prompt: session 2 caches >= 75% of it from session 1's grid checkpoints (the pool has
    room), session 3 all of it to the block grid (session 2's fork checkpoint); every hit equals its cold run."""
    rng = random.Random(21)
    system = random_tokens(rng, 1500)
    prompts = [system + random_tokens(rng, 300 + 11 * i) for i in range(3)]
    llm = make_llm(cache_layout=layout, max_num_batched_tokens=2048, kv_cache_memory=256 << 20)
    hits = [run(llm, [p], salt="fleet")[0] for p in prompts]
    colds = run(llm, prompts, salt=[f"cold-{i}" for i in range(3)])
    bs = _block(llm)
    cached = [h.num_cached_tokens for h in hits]
    assert cached[0] == 0 and cached[1] >= 0.75 * 1500 and cached[2] == 1500 // bs * bs, cached
    assert [signature(h) for h in hits] == [signature(c) for c in colds]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_next_turn_over_the_previous_output_is_exact(layout):
    """Turn 2 = turn 1's prompt + its 150 generated tokens + 200 new: it caches prompt + output floored to the
    block, and its tokens and logprobs equal a cold run's, because the generated tokens' blocks were recomputed
    through the prefill path after turn 1 (the decode steps' own blocks are only for turn 1's resume)."""
    _next_turn_over_the_previous_output_is_exact(layout)


def test_next_turn_over_the_previous_output_is_exact_fp8(fp8_tiny):
    """The same on the block-FP8 checkpoint of the tiny preset."""
    _next_turn_over_the_previous_output_is_exact("runs", model=fp8_tiny)


def _next_turn_over_the_previous_output_is_exact(layout, **kw):
    rng = random.Random(22)
    first = random_tokens(rng, 1200)
    llm = make_llm(cache_layout=layout, max_num_batched_tokens=2048, kv_cache_memory=256 << 20, **kw)
    t1 = run(llm, [first], salt="s", params=greedy(max_tokens=150))[0]
    second = first + list(t1.outputs[0].token_ids) + random_tokens(rng, 200)
    hit = run(llm, [second], salt="s")[0]
    cold = run(llm, [second], salt="cold")[0]
    bs = _block(llm)
    assert hit.num_cached_tokens == (1200 + 150) // bs * bs
    assert signature(hit) == signature(cold)
    st = llm.engine.stats()
    assert st.reprefill_jobs >= 1 and st.checkpoints_saved_by_kind["generated"] >= 1
    assert st.reprefill_tokens >= (1200 + 150) // bs * bs - 1200 // bs * bs


def test_without_reprefill_the_next_turn_hits_the_prompt_and_stays_exact():
    """The control: with --no-reprefill-outputs the next turn hits only to the prompt's checkpoint (blocks written
    by decode steps are on the decode path's hash), so nothing decode-computed leaks into it: still exact."""
    rng = random.Random(22)
    first = random_tokens(rng, 1200)
    llm = make_llm(max_num_batched_tokens=2048, kv_cache_memory=256 << 20, reprefill_outputs=False)
    t1 = run(llm, [first], salt="s", params=greedy(max_tokens=150))[0]
    second = first + list(t1.outputs[0].token_ids) + random_tokens(rng, 200)
    hit = run(llm, [second], salt="s")[0]
    assert hit.num_cached_tokens == 1200 // 64 * 64
    assert signature(hit) == signature(run(llm, [second], salt="cold")[0])


def test_token_budgets_give_the_same_bits():
    """A three-turn conversation (each turn extends the last and its output) under budgets 256 and 2048: the
    same tokens and logprobs, turn by turn, hit or not."""
    rng = random.Random(23)
    news = [random_tokens(rng, n) for n in (900, 150, 260)]
    sigs = []
    for budget in (256, 2048):
        llm = make_llm(max_num_batched_tokens=budget, kv_cache_memory=256 << 20)
        conv, turn_sigs = [], []
        for new in news:
            conv = conv + new
            out = run(llm, [conv], salt="b", params=greedy(max_tokens=40))[0]
            turn_sigs.append(signature(out))
            conv = conv + list(out.outputs[0].token_ids)
        sigs.append(turn_sigs)
    assert sigs[0] == sigs[1]


def test_eight_concurrent_sessions_each_equal_their_cold_run():
    """Eight sessions sharing a system prompt, two turns each, every turn of all eight submitted together (they
    share steps, some hit what others computed in the same run): each turn equals its own cold run, bit for bit."""
    rng = random.Random(24)
    system = random_tokens(rng, 700)
    convs = [system + random_tokens(rng, 60 + 7 * i) for i in range(8)]
    llm = make_llm(max_num_seqs=8, max_num_batched_tokens=1024, kv_cache_memory=256 << 20)
    for turn in range(2):
        hits = run(llm, convs, salt="fleet", params=greedy(max_tokens=12))
        colds = run(llm, convs, salt=[f"cold-{turn}-{i}" for i in range(8)], params=greedy(max_tokens=12))
        assert [signature(h) for h in hits] == [signature(c) for c in colds]
        if turn:
            assert all(h.num_cached_tokens >= 700 // 64 * 64 for h in hits)
        convs = [c + list(h.outputs[0].token_ids) + random_tokens(rng, 40) for c, h in zip(convs, hits)]


# ---------------------------------------------------------------- the gates catch these mutants
def test_mutant_publishing_decode_path_blocks_is_caught(monkeypatch):
    """If the blocks decode steps wrote were published on the prefill path's hash, the next turn would hit them and
    its logprobs would no longer equal the cold run's: the gate above sees it."""
    from deltaserve.scheduler import Scheduler

    add = Scheduler.add

    def untagged(self, request):
        add(self, request)
        request.tag_outputs = False
    monkeypatch.setattr(Scheduler, "add", untagged)
    rng = random.Random(22)
    first = random_tokens(rng, 1200)
    llm = make_llm(max_num_batched_tokens=2048, kv_cache_memory=256 << 20, reprefill_outputs=False)
    t1 = run(llm, [first], salt="s", params=greedy(max_tokens=150))[0]
    second = first + list(t1.outputs[0].token_ids) + random_tokens(rng, 200)
    hit = run(llm, [second], salt="s")[0]
    assert hit.num_cached_tokens == (1200 + 150) // 64 * 64  # it hit decode-written blocks ...
    assert signature(hit) != signature(run(llm, [second], salt="cold")[0])  # ... and is not the cold run


def test_mutant_fork_save_on_the_wrong_side_is_caught(monkeypatch):
    """A fork checkpoint a block past the fork (into the second session's own text) keeps every state exact, but the
    third session can no longer hit all of the shared prefix: the gate's cached-token bound sees it. The learned
    resume point at the same junction is shifted too (it would otherwise serve the third session)."""
    from deltaserve.scheduler.policy import AlignEveryBlock

    saves = AlignEveryBlock.saves

    def shifted(self, start, end, prompt_end, fork, points=(), grid=None):
        bs = self.block_size
        return saves(self, start, end, prompt_end, fork + bs if fork else 0,
                     tuple((p + bs, kind) for p, kind in points), grid)
    monkeypatch.setattr(AlignEveryBlock, "saves", shifted)
    rng = random.Random(21)
    system = random_tokens(rng, 1500)
    prompts = [system + random_tokens(rng, 300 + 11 * i) for i in range(3)]
    llm = make_llm(max_num_batched_tokens=2048, kv_cache_memory=256 << 20, checkpoint_grid=0)
    hits = [run(llm, [p], salt="fleet")[0] for p in prompts]
    assert hits[2].num_cached_tokens < 1500 // 64 * 64
