"""The scheduler: chunking and align mode, budgets, decode-first mixing, preemption, aborts, isolation."""
from __future__ import annotations

import random

import pytest

from deltaserve.config import ConfigError
from deltaserve.memory import MemoryManager
from deltaserve.scheduler import Request, RequestStatus, Scheduler

BS = 4


def make(num_pages=32, slots=4, G=2, caching=True, layout="in-page", seqs=4, budget=16):
    return Scheduler(MemoryManager(num_pages, slots, BS, G, caching, layout), seqs, budget)


def tok(w):  # a deterministic "model": the next token depends on the request and the position
    return 1 + (hash((w.request_id, w.start_pos + len(w.token_ids))) % 50)


def step(s, sampler=tok):
    plan = s.schedule()
    s.memory.check_integrity()
    s.update(plan, {w.request_id: sampler(w) for w in plan.work if w.sample})
    s.memory.check_integrity()
    return plan


def spans(plan):
    return [(w.request_id, w.start_pos, len(w.token_ids), w.is_decode, w.sample) for w in plan.work]


def run_all(s, limit=10_000):
    plans = []
    while s.has_unfinished():
        plans.append(step(s))
        assert len(plans) < limit
    return plans


def test_align_mode_floors_prefill_chunks_and_saves_on_boundaries():
    s = make(budget=10)
    s.add(Request("a", list(range(1, 24)), max_tokens=3))  # 23 prompt tokens
    p1, p2, p3, p4, p5 = (step(s) for _ in range(5))
    assert spans(p1) == [("a", 0, 8, False, False)] and len(p1.saves) == 1 and p1.zero_slots == (0,)
    assert p1.zero_pages == (0, 1) and p1.saves[0].location == (2, 3)
    assert spans(p2) == [("a", 8, 8, False, False)] and len(p2.saves) == 1
    # the last chunk runs to the prompt's ragged end and samples; the checkpoint after the prompt's last block
    # boundary (the one later requests hit) is taken inside it
    assert spans(p3) == [("a", 16, 7, False, True)] and [c.pos for c in p3.saves] == [20]
    assert spans(p4) == [("a", 23, 1, True, True)] and [c.pos for c in p4.saves] == [24]  # a decode completes a block
    assert spans(p5) == [("a", 24, 1, True, True)] and not p5.saves
    assert s.memory.stats.checkpoints_saved == 4
    assert s.memory.stats.checkpoints_saved_by_kind == {"step": 3, "prompt": 1, "fork": 0, "grid": 0, "declared": 0,
                                                         "structural": 0, "learned": 0, "generated": 0}


def test_caching_off_chunks_are_not_floored():
    s = make(budget=10, caching=False)
    s.add(Request("a", list(range(1, 24)), max_tokens=2))
    plans = run_all(s)
    assert [spans(p) for p in plans] == [[("a", 0, 10, False, False)], [("a", 10, 10, False, False)],
                                         [("a", 20, 3, False, True)], [("a", 23, 1, True, True)]]
    assert not any(p.saves or p.restores for p in plans)
    assert s.stats.prefix_cache_queries == 0 and s.memory.num_cached_blocks() == 0


def test_caching_off_chunks_stay_on_the_kernel_grid_whatever_the_batch():
    s = make(num_pages=128, caching=False, budget=70)
    s.add(Request("a", [1, 2, 3], max_tokens=5))
    step(s)
    s.add(Request("b", list(range(1, 201)), max_tokens=1))
    p = step(s)
    assert spans(p) == [("a", 3, 1, True, True), ("b", 0, 64, False, False)]  # 69 floored to 64
    assert spans(step(s)) == [("a", 4, 1, True, True), ("b", 64, 64, False, False)]
    s2 = make(num_pages=128, caching=False, budget=64)
    s2.add(Request("a", [1, 2, 3], max_tokens=3))
    step(s2)
    s2.add(Request("b", list(range(1, 201)), max_tokens=1))
    assert spans(step(s2)) == [("a", 3, 1, True, True)]  # b waits rather than cut 63 tokens
    assert spans(step(s2)) == [("a", 4, 1, True, True)]
    assert spans(step(s2)) == [("b", 0, 64, False, False)]
    s3 = Scheduler(MemoryManager(128, 4, BS, 2, False), 4, 70, chunk_grid=1)
    s3.add(Request("a", [1, 2, 3], max_tokens=5))
    step(s3)
    s3.add(Request("b", list(range(1, 201)), max_tokens=1))
    assert spans(step(s3)) == [("a", 3, 1, True, True), ("b", 0, 69, False, False)]


def test_budget_below_one_block_is_refused_with_caching_and_progresses_without():
    with pytest.raises(ConfigError):
        make(budget=BS - 1, seqs=2)
    with pytest.raises(ConfigError):
        make(budget=3, seqs=4, caching=False)  # below max_num_seqs
    s = make(budget=BS - 1, seqs=2, caching=False)
    s.add(Request("a", list(range(1, 11)), max_tokens=1))
    plans = run_all(s)
    assert [len(p.work[0].token_ids) for p in plans] == [3, 3, 3, 1]


def test_prefill_waits_when_less_than_a_block_of_budget_is_left():
    s = make(budget=BS)
    s.add(Request("a", [1, 2, 3], max_tokens=3))
    assert spans(step(s)) == [("a", 0, 3, False, True)]
    s.add(Request("b", list(range(1, 13)), max_tokens=1))
    s.add(Request("c", [5, 6], max_tokens=1))
    # 3 tokens left after a's decode: b's chunk cannot reach a block boundary, so b (and c behind it) wait
    assert spans(step(s)) == [("a", 3, 1, True, True)]
    assert spans(step(s)) == [("a", 4, 1, True, True)]  # a finishes (3 tokens)
    assert spans(step(s)) == [("b", 0, 4, False, False)]
    assert s.num_waiting == 1  # c waits: FCFS, no budget left


def test_max_num_seqs_and_token_budget():
    s = make(num_pages=64, slots=4, seqs=2, budget=16)
    for i in range(5):
        s.add(Request(f"r{i}", [i + 1] * 6, max_tokens=4))
    for p in run_all(s):
        assert len(p.work) <= 2 and p.num_tokens <= 16 and s.num_running <= 2
        assert len({w.slot for w in p.work}) == len(p.work)
    assert s.memory.usage().slots_used == 0


def test_slots_cap_admission():
    s = make(num_pages=64, slots=2, seqs=8, budget=64)
    for i in range(4):
        s.add(Request(f"r{i}", [i + 1] * 6, max_tokens=3))
    p = step(s)
    assert [w.request_id for w in p.work] == ["r0", "r1"] and s.num_waiting == 2


def test_decodes_first_then_prefill_chunks():
    s = make(num_pages=64, budget=12)
    s.add(Request("a", [1, 2], max_tokens=10))
    s.add(Request("b", [3, 4, 5], max_tokens=10))
    step(s)
    s.add(Request("c", list(range(1, 30)), max_tokens=2))
    p = step(s)
    assert spans(p) == [("a", 2, 1, True, True), ("b", 3, 1, True, True), ("c", 0, 8, False, False)]
    assert p.num_tokens == 10  # c's chunk floored from 10 to 8


@pytest.mark.parametrize("replay_decode", [True, False])
def test_preemption_resumes_from_cache(replay_decode):
    s = Scheduler(MemoryManager(13, 2, BS, 1, True, "in-page"), 2, 32, replay_decode=replay_decode)
    s.add(Request("a", list(range(1, 17)), max_tokens=12))
    s.add(Request("b", list(range(101, 117)), max_tokens=12))
    plans = run_all(s)
    pre = [i for i, p in enumerate(plans) if p.preempted]
    assert pre and plans[pre[0]].preempted == ("b",)  # the most recently admitted
    assert plans[pre[0]].work[0].request_id == "a"
    # b comes back restored from its own checkpoint after the prompt (block 3), with 4 tokens generated
    after = [(p, w) for p in plans[pre[0] + 1:] for w in p.work if w.request_id == "b"]
    p, w = after[0]
    assert [r.slot for r in p.restores] == [w.slot] and w.start_pos == 16
    if replay_decode:  # generated tokens recomputed through the decode path; only the last one samples
        assert [(w.start_pos, len(w.token_ids), w.is_decode, w.sample) for _, w in after[:3]] == [
            (16, 1, True, False), (17, 1, True, False), (18, 1, True, False)]
        assert ("b", 19, 1, True, True) in [x for p in plans for x in spans(p)]
    else:  # through prefill: one chunk, sampling at its end
        assert (w.start_pos, len(w.token_ids), w.is_decode, w.sample) == (16, 4, False, True)
    assert s.stats.preemptions >= 1 and s.memory.stats.checkpoints_restored >= 1
    assert s.memory.usage().pages_used == 0 and s.memory.usage().slots_used == 0


def test_preempted_running_work_is_withdrawn():
    # b (admitted after a) is scheduled first as a decode; then a's prefill chunk needs pages: b, the
    # most recently admitted, is preempted and its already planned decode and save are withdrawn
    s = make(num_pages=7, slots=2, G=1, seqs=2, budget=11)
    s.add(Request("a", list(range(1, 17)), max_tokens=2))
    s.add(Request("b", [7, 8, 9], max_tokens=4))
    assert spans(step(s)) == [("a", 0, 8, False, False), ("b", 0, 3, False, True)]
    p = step(s)
    assert p.preempted == ("b",) and spans(p) == [("a", 8, 8, False, True)]
    assert [c.slot for c in p.saves] == [p.work[0].slot] and s.num_waiting == 1
    run_all(s)
    assert s.get("b").finish_reason == "length" and s.usage().pages_used == 0


def test_abort_at_any_moment_frees_everything():
    s = make(num_pages=32, budget=8)
    s.add(Request("a", list(range(1, 30)), max_tokens=5))
    s.add(Request("b", list(range(1, 30)), max_tokens=5))
    s.add(Request("w", [1, 2, 3], max_tokens=5))
    step(s)  # a mid-prefill
    assert s.abort("w") and "w" not in s.requests and s.get("w").is_finished  # waiting
    plan = s.schedule()
    assert s.abort("a")  # between schedule() and update(): update skips its work
    s.update(plan, {w.request_id: 1 for w in plan.work if w.sample})
    s.memory.check_integrity()
    assert s.abort("b") and not s.abort("b") and not s.abort("nope")
    u = s.usage()
    assert (u.pages_used, u.slots_used, s.num_running, s.num_waiting) == (0, 0, 0, 0)
    assert not s.has_unfinished()


def test_finish_length_and_stop():
    s = make()
    a, b = Request("a", [1, 2, 3], max_tokens=2), Request("b", [4, 5], max_tokens=10)
    s.add(a)
    s.add(b)
    out = s.update(s.schedule(), {"a": 11, "b": 12})
    assert out == [a, b]
    assert s.finish("b", "stop") and b.status is RequestStatus.FINISHED_STOPPED and b.finish_reason == "stop"
    step(s)
    assert a.status is RequestStatus.FINISHED_LENGTH and a.finish_reason == "length" and len(a.output_token_ids) == 2
    assert s.get("a") is a  # until the next schedule()
    s.schedule()
    assert s.get("a") is None
    assert s.usage().pages_used == 0 and not s.has_unfinished()
    with pytest.raises(ValueError):
        s.finish("a", "bored")


def test_add_validation():
    s = make(num_pages=8, G=1)
    assert s.max_request_tokens() == (8 - 2) * BS
    with pytest.raises(ValueError):
        s.add(Request("e", [], max_tokens=1))
    with pytest.raises(ValueError):
        s.add(Request("z", [1], max_tokens=0))
    with pytest.raises(ValueError):
        s.add(Request("l", [1] * 20, max_tokens=5))  # 25 > 24
    s.add(Request("ok", [1] * 20, max_tokens=4))
    with pytest.raises(ValueError):
        s.add(Request("ok", [2], max_tokens=1))
    run_all(s)


@pytest.mark.parametrize("layout", ["in-page", "per-block"])
def test_hit_backs_off_to_a_block_with_a_checkpoint(layout):
    # one-block chunks: checkpoints after every block, so an identical 8-token prompt hits 1 block
    s = make(budget=BS, layout=layout)
    s.add(Request("a", list(range(1, 9)), max_tokens=1))
    run_all(s)
    b = Request("b", list(range(1, 9)), max_tokens=1)
    s.add(b)
    p = step(s)
    assert spans(p) == [("b", 4, 4, False, True)] and b.num_cached_tokens == 4 and len(p.restores) == 1
    assert not p.zero_slots
    # a chunk spanning two blocks leaves no checkpoint at the first one: no hit for the same prompt,
    # which therefore saves one at that fork point, inside its chunk, for the next
    s2 = make(budget=16, layout=layout)
    s2.add(Request("a", list(range(1, 9)), max_tokens=1))
    run_all(s2)
    c = Request("c", list(range(1, 9)), max_tokens=1)
    s2.add(c)
    p = step(s2)
    assert spans(p) == [("c", 0, 8, False, True)] and c.num_cached_tokens == 0 and p.zero_slots
    assert [c.pos for c in p.saves] == [4, 8]
    run_all(s2)
    e = Request("e", list(range(1, 9)), max_tokens=1)
    s2.add(e)
    assert spans(step(s2)) == [("e", 4, 4, False, True)] and e.num_cached_tokens == 4
    # a longer prompt hits both blocks
    d = Request("d", list(range(1, 12)), max_tokens=1)
    s2.add(d)
    p = step(s2)
    assert spans(p) == [("d", 8, 3, False, True)] and d.num_cached_tokens == 8
    assert s2.stats.prefix_cache_hits == 12 and s2.stats.prefix_cache_queries == 8 + 8 + 8 + 11


@pytest.mark.parametrize("layout", ["in-page", "per-block"])
def test_shared_system_prompt_gets_a_checkpoint_at_the_fork(layout):
    """Sessions sharing a 3-block system prompt, each computed in one chunk: the first leaves a checkpoint
    only at its own prompt's last block boundary; the second saves one, inside its chunk, where its text
    diverges from the cached chain (the fork point, which the learned source names first: requests without a key
    form one group, and the second parted from the first there); every later session hits the shared blocks."""
    system = list(range(1, 13))  # 3 blocks
    s = make(num_pages=64, budget=32, layout=layout)
    reqs = [Request(f"s{i}", system + [100 + i] * 9, max_tokens=1) for i in range(4)]  # 21 tokens each
    s.add(reqs[0])
    run_all(s)
    s.add(reqs[1])
    p = step(s)
    assert spans(p) == [("s1", 0, 21, False, True)] and reqs[1].num_cached_tokens == 0
    kinds = s.memory.stats.checkpoints_saved_by_kind
    assert [(c.pos) for c in p.saves] == [12, 20] and kinds["learned"] == 1 and kinds["fork"] == 0
    run_all(s)
    for r in reqs[2:]:
        s.add(r)
        p = step(s)
        assert spans(p)[0] == (r.request_id, 12, 9, False, True) and r.num_cached_tokens == 12
        run_all(s)
    # without a fork (a prompt that extends the cached chain to its end) nothing changes
    t = Request("t", list(reqs[3].prompt_token_ids) + [7, 7, 7, 7], max_tokens=1)
    s.add(t)
    assert spans(step(s)) == [("t", 20, 5, False, True)] and t.num_cached_tokens == 20


@pytest.mark.parametrize("reprefill", [False, True])
def test_multi_turn_extension_hits_previous_turn(reprefill):
    """Turn 2 = turn 1's prompt (14 tokens) + its 6 outputs + 3 new. Blocks that decode steps wrote are on the decode
    path's hash, so without the outputs' recompute turn 2 hits turn 1's prompt to its last block boundary (12);
    with it, a background job recomputed prompt + outputs to their last full block (20, the last output included,
    which turn 1 never computed) through the prefill path, and turn 2 hits all of it."""
    s = Scheduler(MemoryManager(64, 4, BS, 2, True, "in-page"), 4, 8, reprefill_outputs=reprefill)
    a = Request("t1", list(range(1, 15)), max_tokens=6)
    s.add(a)
    run_all(s)  # runs the background job too
    convo = a.prompt_token_ids + a.output_token_ids  # 20 tokens; the last one was never computed
    t2 = Request("t2", convo + [40, 41, 42], max_tokens=2)
    s.add(t2)
    step(s)
    assert t2.num_cached_tokens == (20 if reprefill else 12)
    st, kinds = s.stats, s.memory.stats.checkpoints_saved_by_kind
    assert (st.reprefill_jobs, st.reprefill_tokens, kinds["generated"]) == ((1, 20 - 12, 1) if reprefill
                                                                            else (0, 0, 0))


def test_prompt_logprobs_skip_the_cache():
    s = make(budget=BS)
    s.add(Request("a", list(range(1, 9)), max_tokens=1))
    run_all(s)
    b = Request("b", list(range(1, 9)), max_tokens=1, prompt_logprobs=True)
    s.add(b)
    p = step(s)
    assert p.work[0].start_pos == 0 and p.work[0].prompt_logprobs and b.num_cached_tokens == 0


@pytest.mark.parametrize("layout", ["in-page", "per-block"])
def test_isolation_24_rounds(layout):
    """Interleaved requests under different salts: every page and checkpoint a request reads was written
    by a request with its salt; hits happen within each salt; nothing is left allocated at the end."""
    rng = random.Random(24)
    s = make(num_pages=48, slots=4, seqs=4, budget=12, layout=layout)
    salts = [None, "alice", "bob", "carol"]
    system = [rng.randint(1, 50) for _ in range(18)]
    writer: dict[int, object] = {}  # attention page -> salt of the request that wrote it
    ckpt_writer: dict[tuple, object] = {}  # checkpoint location -> salt
    salt_of: dict[str, object] = {}
    n = 0
    hits_by_salt = {x: 0 for x in salts}
    for rnd in range(24):
        batch = []
        for _ in range(rng.randint(3, 6)):
            n += 1
            salt = rng.choice(salts)
            prompt = system + [rng.randint(1, 50) for _ in range(rng.randint(0, 10))]
            batch.append(Request(f"r{n}", prompt, max_tokens=rng.randint(1, 6), cache_salt=salt))
            salt_of[f"r{n}"] = salt
        while batch or s.has_unfinished():
            if batch and rng.random() < 0.5:
                s.add(batch.pop())
            plan = s.schedule()
            by_slot = {w.slot: w for w in plan.work}
            for w in plan.work:
                salt = salt_of[w.request_id]
                for p in w.page_ids:
                    if p in plan.zero_pages:
                        writer[p] = salt
                    assert writer[p] == salt, f"{w.request_id} ({salt!r}) reads page {p} of {writer[p]!r}"
            for c in plan.restores:
                salt = salt_of[by_slot[c.slot].request_id]
                assert ckpt_writer[c.location] == salt
                hits_by_salt[salt] += 1
            for c in plan.saves:
                ckpt_writer[c.location] = salt_of[by_slot[c.slot].request_id]
            s.update(plan, {w.request_id: tok(w) for w in plan.work if w.sample})
            s.memory.check_integrity()
        u = s.usage()
        assert (u.pages_used, u.slots_used) == (0, 0)
    assert all(hits_by_salt.values()), hits_by_salt


def test_missing_sample_then_finish():
    s = make()
    s.add(Request("a", [1, 2, 3], max_tokens=4))
    plan = s.schedule()
    assert s.update(plan, {}) == []  # sampling failed: no token; the engine finishes the request
    assert s.finish("a", "abort") and s.usage().pages_used == 0


def test_stats_and_usage_for_metrics():
    s = make(budget=BS)
    for rid in ("a", "b"):
        s.add(Request(rid, list(range(1, 9)), max_tokens=1))
        run_all(s)
    st = s.counters()
    assert {k: st[k] for k in ("prefix_cache_queries", "prefix_cache_hits", "checkpoints_saved",
                               "checkpoints_restored", "evictions", "preemptions")} == \
        {"prefix_cache_queries": 16, "prefix_cache_hits": 4, "checkpoints_saved": 3, "checkpoints_restored": 1,
         "evictions": 0, "preemptions": 0}
    assert st["checkpoints_saved_by_kind"]["step"] == 3 and sum(st["checkpoints_evicted_by_kind"].values()) == 0
    u = s.usage()
    assert u.pages_used == s.memory.num_pages_in_use == 0 and u.pages_cached > 0 and u.kv_usage == 0.0


def test_align_policy_chunk_ends():
    from deltaserve.scheduler import AlignEveryBlock, GridChunks
    a = AlignEveryBlock(128)
    assert a.chunk_end(0, 448, 1000) == 384  # a middle chunk floors to a boundary
    assert a.chunk_end(0, 100, 1000) == 0  # less than a block of budget: wait
    assert a.chunk_end(0, 64, 100) == 0  # no boundary before the end: wait until the end fits
    assert a.chunk_end(0, 448, 100) == 100  # reaches the end
    assert a.chunk_end(0, 448, 300) == 300  # reaches the ragged end: its checkpoints are taken inside the chunk
    assert a.chunk_end(0, 448, 256) == 256
    assert a.saves(0, 300, 300, 0) == [(256, "prompt")]
    assert a.saves(0, 384, 1000, 128) == [(128, "fork"), (384, "step")]
    assert a.saves(256, 257, 100, 0) == []  # a decode inside a block
    g2 = AlignEveryBlock(128, grid=256)
    assert g2.saves(0, 1000, 1000, 640) == [(256, "grid"), (512, "grid"), (640, "fork"), (768, "grid"),
                                            (896, "prompt")]
    # a resume point (a block boundary) the step passes is saved with its source's kind; one the step does not pass,
    # or at the step's end, adds none
    assert g2.saves(0, 1000, 1000, 0, ((640, "structural"),)) == [(256, "grid"), (512, "grid"), (640, "structural"),
                                                                  (768, "grid"), (896, "prompt")]
    assert a.saves(0, 384, 1000, 0, ((256, "declared"), (384, "structural"), (896, "declared"))) == \
        [(256, "declared"), (384, "step")]
    assert a.saves(0, 300, 300, 0, ((256, "declared"),)) == [(256, "prompt")]  # the prompt's own keeps its kind
    assert g2.saves(0, 1000, 1000, 0, (), grid=768) == [(768, "grid"), (896, "prompt")]  # the request's own spacing
    with pytest.raises(ValueError):
        AlignEveryBlock(128, grid=200)
    g = GridChunks(64)
    assert (g.chunk_end(0, 100, 1000), g.chunk_end(0, 63, 1000), g.chunk_end(0, 100, 90)) == (64, 0, 90)


def test_prefill_merge_tokens_lets_prompts_that_arrive_together_finish_one_after_another():
    """Two 9-token prompts with a merge limit of 6: the second waits one step instead of sharing the first's
    step (mean time to first token 1.5 steps of prefill instead of 2); short prompts still share a step."""
    s = Scheduler(MemoryManager(32, 4, BS, 2, False, "in-page"), 4, 32, chunk_grid=1, prefill_merge_tokens=6)
    s.add(Request("a", list(range(1, 10)), max_tokens=2))
    s.add(Request("b", list(range(11, 20)), max_tokens=2))
    p1, p2, p3 = step(s), step(s), step(s)
    assert spans(p1) == [("a", 0, 9, False, True)]
    assert spans(p2) == [("a", 9, 1, True, True), ("b", 0, 9, False, True)]
    assert spans(p3) == [("b", 9, 1, True, True)]
    assert not s.has_unfinished()
    s.add(Request("c", [1, 2], max_tokens=1))
    s.add(Request("d", [3, 4], max_tokens=1))
    s.add(Request("e", [5, 6, 7], max_tokens=1))
    s.add(Request("f", [8], max_tokens=1))
    # 2 + 2 < 6: e joins; 2 + 2 + 3 >= 6: f waits
    assert [w.request_id for w in step(s).work] == ["c", "d", "e"]
    assert [w.request_id for w in step(s).work] == ["f"]
    unlimited = Scheduler(MemoryManager(32, 4, BS, 2, False, "in-page"), 4, 32, chunk_grid=1)
    unlimited.add(Request("a", list(range(1, 10)), max_tokens=1))
    unlimited.add(Request("b", list(range(11, 20)), max_tokens=1))
    assert [w.request_id for w in step(unlimited).work] == ["a", "b"]
    with pytest.raises(ConfigError, match="prefill-merge-tokens"):
        Scheduler(MemoryManager(32, 4, BS, 2, True, "in-page"), 4, 32, prefill_merge_tokens=-1)


def test_prefill_merge_tokens_counts_a_running_chunk():
    """A long prompt's running chunk fills the step's prefill share: a new prompt waits for its last chunk."""
    s = Scheduler(MemoryManager(32, 4, BS, 2, False, "in-page"), 4, 8, chunk_grid=1, prefill_merge_tokens=4)
    s.add(Request("long", list(range(1, 21)), max_tokens=1))
    s.add(Request("short", [1, 2, 3], max_tokens=1))
    assert spans(step(s)) == [("long", 0, 8, False, False)]
    assert spans(step(s)) == [("long", 8, 8, False, False)]
    assert spans(step(s)) == [("long", 16, 4, False, True)]  # 4 >= 4: short still waits
    assert spans(step(s)) == [("short", 0, 3, False, True)]


def test_recover_and_isolate_after_a_failed_step():
    """A failed step: its requests are preempted, then recompute alone and in order until past the failed
    step; then the normal mix resumes. Pages and slots stay consistent throughout."""
    s = Scheduler(MemoryManager(32, 4, BS, 2, False, "in-page"), 4, 32, chunk_grid=1)
    s.add(Request("a", list(range(1, 7)), max_tokens=4))
    s.add(Request("b", list(range(11, 16)), max_tokens=4))
    step(s)  # both prefills; each samples its first token
    failed = s.schedule()  # both decode: this step "fails" (no update)
    assert spans(failed) == [("a", 6, 1, True, True), ("b", 5, 1, True, True)]
    assert s.failed_steps.recover(failed) == ["a", "b"]
    s.memory.check_integrity()
    assert s.memory.num_pages_in_use == 0 and [r.request_id for r in s.waiting] == ["a", "b"]
    s.failed_steps.isolate({w.request_id: w.start_pos + len(w.token_ids) for w in failed.work})
    # a alone: its prompt again (cache off), then its generated token through the decode path (replay)
    assert spans(step(s)) == [("a", 0, 6, False, False)]
    assert spans(step(s)) == [("a", 6, 1, True, True)]  # past the failed step: a leaves isolation
    assert spans(step(s)) == [("b", 0, 5, False, False)]
    assert spans(step(s)) == [("b", 5, 1, True, True)]
    assert spans(step(s)) == [("a", 7, 1, True, True), ("b", 6, 1, True, True)]  # the normal mix again
    run_all(s)
    assert s.memory.num_pages_in_use == 0


def test_encoder_budget_cuts_the_second_image_request_of_a_step():
    """A request's images are encoded in the step its chunk first reaches one, paid from the step's encoder
    budget: the first such request of a step always runs, a second that would go over ends its chunk at the
    block before its image and reaches it in a later step; each request pays once."""
    IMG = 99
    s = Scheduler(MemoryManager(64, 4, BS, 2, True, "in-page"), 4, 64, encoder_budget=10)
    s.memory.media_token_ids = frozenset({IMG})  # their blocks hash with the images (check_integrity knows)
    a = Request("a", [5] * 6 + [IMG] * 8 + [6] * 2, max_tokens=2, media=((6, 8, b"A" * 32),))
    b = Request("b", [7] * 9 + [IMG] * 4 + [8] * 3, max_tokens=2, media=((9, 4, b"B" * 32),))
    s.add(a)
    s.add(b)
    plan = step(s)
    assert spans(plan) == [("a", 0, 16, False, True), ("b", 0, 8, False, False)]  # b stops at the block before 9
    assert a.media_encoded and not b.media_encoded
    plan = step(s)
    assert ("b", 8, 8, False, True) in spans(plan) and b.media_encoded  # now within the budget: b's turn
    run_all(s)
    solo = Scheduler(MemoryManager(64, 4, BS, 2, True, "in-page"), 4, 64, encoder_budget=2)
    solo.memory.media_token_ids = frozenset({IMG})
    big = Request("c", [IMG] * 12 + [1] * 4, max_tokens=1, media=((0, 12, b"C" * 32),))
    solo.add(big)
    assert spans(step(solo)) == [("c", 0, 16, False, True)]  # over the budget alone: the first always runs


@pytest.mark.parametrize("max_tokens", [8, 4])  # 4: the verify step's last token reaches it
def test_a_stop_inside_a_verify_step_drops_the_tokens_after_it(max_tokens):
    """The engine owns none of a request's state: it hands the drafts to the scheduler (set_drafts) and, where a
    stop string or token ends the answer before a verify step's last token, says how many outputs the request
    keeps (finish(outputs=)); that holds too when update() has just finished the request at max_tokens."""
    s = make(caching=False)
    s.add(Request("a", [1, 2, 3], max_tokens=max_tokens))
    step(s)  # the prompt, and the first token
    req = s.get("a")
    first = req.output_token_ids[0]
    s.set_drafts("a", [7, 8, 9])
    plan = s.schedule()  # at most max_tokens - 2 drafts: the outputs so far and the token after the drafts
    assert [(w.start_pos, w.num_drafts) for w in plan.work] == [(3, min(3, max_tokens - 2))]
    s.update(plan, {"a": [7, 8, 5]})  # two drafts accepted, then the token after them (8: the third rejected)
    assert req.output_token_ids == [first, 7, 8, 5] and req.num_computed_tokens == 6
    assert req.is_finished == (max_tokens == 4)  # "length", by update()
    assert s.finish("a", "stop", outputs=2) == (max_tokens == 8)
    assert req.output_token_ids == [first, 7] and req.num_computed_tokens == req.num_tokens - 1 == 4
    assert not s.has_unfinished()
    s.memory.check_integrity()
