"""Speculative decoding gates (docs/speculative.md): drafted == plain, tokens and logprobs bit-identical, with the MTP
drafter and with the controls (forced acceptance: the target's own greedy continuation; forced rejection: always
wrong; drafts right with probability p), batch 1 and 8, short and long prompts, k = 1, 2, 3, under a prefix-cache hit,
after a preemption; seeded sampling with drafts equal to plain sampling; the verify rule's distribution."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from deltaserve import SamplingParams
from deltaserve.engine.speculative import (Acceptance, ScriptedDrafter, SpecStats, fit_drafts, verify,
                                           verify_greedy_lazily)

from util import greedy, make_llm, random_tokens, run, signature

VOCAB = 4096  # the tiny preset's


def spec(k: int, max_verify_rows: int = 0, **kw):
    """An engine drafting k tokens a step; no cap on a step's verify rows (the gates verify drafts at batch 8 too)."""
    return make_llm(speculative_config={"method": "mtp", "num_speculative_tokens": k,
                                        "max_verify_rows": max_verify_rows}, **kw)


def counted(llm, fn):
    """fn()'s result and the speculative counters it added: (drafts verified, accepted, verify steps)."""
    a = llm.engine.stats()
    out = fn()
    b = llm.engine.stats()
    return out, (b.spec_decode_num_draft_tokens - a.spec_decode_num_draft_tokens,
                 b.spec_decode_num_accepted_tokens - a.spec_decode_num_accepted_tokens,
                 b.spec_decode_num_drafts - a.spec_decode_num_drafts)


@pytest.fixture
def compiled_verify(monkeypatch):
    """Whether each verify step ran in the model's compiled decode call (model/fused.py), appended as it runs: the
    gates below assert they all did, so they hold for that path and not only for the op table's."""
    from deltaserve.model import fused

    taken, real = [], fused._verify_step

    def spy(*a):
        out = real(*a)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(fused, "_verify_step", spy)
    return taken


@pytest.fixture
def lazy_verify(monkeypatch):
    """How many verify steps ran the head lazily (speculative.verify_greedy_lazily) and how many over every row
    (verify), counted as the engine calls them: the gates below assert both paths ran."""
    from deltaserve.engine import llm_engine

    calls = {"lazy": 0, "full": 0}

    def counting(name, real):
        def spy(*a, **kw):
            calls[name] += 1
            return real(*a, **kw)
        return spy

    monkeypatch.setattr(llm_engine, "verify_greedy_lazily", counting("lazy", llm_engine.verify_greedy_lazily))
    monkeypatch.setattr(llm_engine, "verify", counting("full", llm_engine.verify))
    return calls


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(11)
    return [random_tokens(rng, n) for n in (1, 5, 63, 130, 300, 700, 20, 64)]


MAX_TOKENS = 16


@pytest.fixture(scope="module")
def plain_ref(prompts):
    """Plain greedy decoding of the 8 prompts together (the same alone: the engine is batch-invariant,
    tests/test_engine.py)."""
    llm = make_llm(enable_prefix_caching=False)
    return [signature(o) for o in run(llm, prompts, params=greedy(max_tokens=MAX_TOKENS))]


def test_a_scripted_drafter_priced_by_mtp_pays_its_cost(prompts, plain_ref):
    """A benchmark's scripted acceptance with the real drafter's cost: the MTP layer is fed every step and drafts
    (its layer and head run) at least as many tokens as the script proposes; the script's tokens are what is
    verified, the output is plain decoding's, and the MTP drafter forgets each finished request."""
    llm = spec(2, enable_prefix_caching=False)
    mtp = llm.engine.drafter
    real = mtp.propose
    mtp_drafts = []
    mtp.propose = lambda rid, tokens, k: mtp_drafts.append(len(d := real(rid, tokens, k))) or d
    cont = {tuple(p): r[0] for p, r in zip(prompts, plain_ref)}
    llm.engine.drafter = ScriptedDrafter(cont, p=1.0, vocab_size=VOCAB, priced_by=mtp)
    got, (drafted, accepted, _) = counted(llm, lambda: [signature(o) for o in run(llm, prompts,
                                                                                 params=greedy(max_tokens=MAX_TOKENS))])
    assert got == plain_ref and drafted == accepted > 0  # the script's drafts, all accepted
    assert sum(mtp_drafts) >= drafted  # the layer drafted alongside (near the end the script proposes fewer)
    assert not mtp.caches and not mtp.queued and not mtp.last


@pytest.mark.parametrize("k", [1, 2, 3])
def test_drafted_equals_plain_mtp_and_controls(k, prompts, plain_ref, compiled_verify, lazy_verify):
    llm = spec(k, enable_prefix_caching=False)
    params = greedy(max_tokens=MAX_TOKENS)
    cont = {tuple(p): r[0] for p, r in zip(prompts, plain_ref)}
    # the MTP layer (random weights: its drafts are almost always wrong), batch 8 and batch 1
    got, (drafted, _, _) = counted(llm, lambda: [signature(o) for o in run(llm, prompts, params=params)])
    assert got == plain_ref and drafted > 0
    assert [signature(run(llm, [p], params=params)[0]) for p in prompts[:2]] == plain_ref[:2]
    # forced acceptance: every draft is accepted, and the steps emit k + 1 tokens
    llm.engine.drafter = ScriptedDrafter(cont, p=1.0, vocab_size=VOCAB)
    got, (drafted, accepted, steps) = counted(llm, lambda: [signature(o) for o in run(llm, prompts, params=params)])
    assert got == plain_ref
    assert drafted == accepted and accepted > 2 * steps * k / 3  # steps near max_tokens draft less
    got, (drafted, accepted, _) = counted(llm, lambda: [signature(run(llm, [p], params=params)[0])
                                                        for p in (prompts[1], prompts[5])])
    assert got == [plain_ref[1], plain_ref[5]] and drafted == accepted > 0
    # forced rejection: never one accepted; every step rolls its slot back
    llm.engine.drafter = ScriptedDrafter(cont, p=0.0, vocab_size=VOCAB)
    got, (drafted, accepted, _) = counted(llm, lambda: [signature(o) for o in run(llm, prompts, params=params)])
    assert got == plain_ref and drafted > 0 and accepted == 0
    # right with probability 0.6: rejections at every draft position
    llm.engine.drafter = ScriptedDrafter(cont, p=0.6, vocab_size=VOCAB, seed=k)
    got, (drafted, accepted, _) = counted(llm, lambda: [signature(o) for o in run(llm, prompts, params=params)])
    assert got == plain_ref and 0 < accepted < drafted
    st = llm.engine.stats()
    assert len(st.spec_decode_accepted_per_pos) == k and sum(st.spec_decode_accepted_per_pos) == \
        st.spec_decode_num_accepted_tokens
    # forced rejection with K drafts every step (adaptive off), greedy without logprobs: once the acceptance rate
    # falls low, the head runs lazily (row 0 alone), batch 8 and batch 1; the tokens stay plain decoding's
    assert lazy_verify["lazy"] == 0 and lazy_verify["full"] > 0  # logprobs need every row's logits
    llm.engine.spec = dataclasses.replace(llm.engine.spec, adaptive=False)
    llm.engine.drafter = ScriptedDrafter(cont, p=0.0, vocab_size=VOCAB)
    tokens = greedy(max_tokens=MAX_TOKENS, logprobs=None)
    got, (drafted, accepted, _) = counted(llm, lambda: [o.outputs[0].token_ids for o in run(llm, prompts, params=tokens)])
    assert got == [r[0] for r in plain_ref] and drafted > 0 and accepted == 0 and lazy_verify["lazy"] > 0
    lazy = lazy_verify["lazy"]
    assert run(llm, [prompts[3]], params=tokens)[0].outputs[0].token_ids == plain_ref[3][0]
    assert lazy_verify["lazy"] > lazy
    st = llm.engine.stats()
    assert st.pages_used == 0 and st.slots_used == 0
    # the compiled decode call wherever the compiled kernels run (not with DELTASERVE_DECODE_KERNELS=torch)
    assert compiled_verify and all(taken == (llm.engine.cpu_kernels != "torch") for taken in compiled_verify)


def test_drafted_equals_plain_across_block_ends_with_caching_and_a_prefix_hit(compiled_verify):
    """Caching on: verify steps stop short of each block's end (no checkpoint or block from a draft), blocks published
    by the steps that complete them; a second turn hits the first turn's prompt and re-prefilled outputs."""
    rng = random.Random(5)
    first = random_tokens(rng, 150)
    params = greedy(max_tokens=120)  # the first turn ends at 270: past the 256 block end, decoding
    plain = make_llm()
    ref1 = signature(run(plain, [first], params=params)[0])
    second = first + ref1[0] + random_tokens(rng, 40)
    cold = make_llm()
    ref2 = signature(run(cold, [second], params=params)[0])  # the second turn, cold
    llm = spec(3)
    llm.engine.drafter = ScriptedDrafter({tuple(first): ref1[0], tuple(second): ref2[0]}, p=0.8, vocab_size=VOCAB)
    assert signature(run(llm, [first], params=params)[0]) == ref1
    for _ in range(50):  # the re-prefill jobs of the first turn's outputs (spare steps)
        if not llm.engine.has_background_work():
            break
        llm.engine.step()
    hits = llm.engine.stats().prefix_cache_hits
    (out,), (drafted, accepted, _) = counted(llm, lambda: run(llm, [second], params=params))
    assert signature(out) == ref2
    assert llm.engine.stats().prefix_cache_hits - hits >= 256 and 0 < accepted < drafted
    assert out.num_cached_tokens >= 256
    # the compiled decode call wherever the compiled kernels run (not with DELTASERVE_DECODE_KERNELS=torch)
    assert compiled_verify and all(taken == (llm.engine.cpu_kernels != "torch") for taken in compiled_verify)


def _log_bytes(slots: int, k: int) -> int:
    """The state log's bytes (it comes out of the cache budget): per slot and draft position, 6 GDN layers of the
    tiny preset's conv state (3 x 512 bf16) and one token's recurrence inputs (512 + 4 bf16, 4 fp32 gates); no
    recurrent state (64 KB a layer)."""
    return slots * k * 6 * (3 * 512 * 2 + (512 + 4) * 2 + 4 * 4)


def test_the_state_log_comes_out_of_the_cache_budget():
    plain, drafted = make_llm(enable_prefix_caching=False), spec(3, enable_prefix_caching=False)
    st = drafted.engine.store
    log = sum(t.numel() * t.element_size() for t in st.log_conv + st.log_x + st.log_g + st.log_beta)
    assert log == _log_bytes(8, 3)
    assert drafted.engine.store.nbytes() <= 64 * 2**20 < plain.engine.store.nbytes() + log
    assert drafted.engine.pool.num_pages < plain.engine.pool.num_pages


def test_preempted_while_speculating_equals_uninterrupted(compiled_verify):
    from test_engine import _budget_for_pages

    rng = random.Random(3)
    prompts = [random_tokens(rng, 200 + 40 * i) for i in range(5)]
    params = greedy(max_tokens=64, logprobs=None)
    big = make_llm(enable_prefix_caching=False)
    ref = [signature(o)[0] for o in run(big, prompts, params=params)]
    small = spec(2, enable_prefix_caching=False, kv_cache_memory=_budget_for_pages(small_pages=10) + _log_bytes(6, 2),
                 max_num_seqs=6)
    small.engine.drafter = ScriptedDrafter({tuple(p): r for p, r in zip(prompts, ref)}, p=0.7, vocab_size=VOCAB)
    outs, (drafted, accepted, _) = counted(small, lambda: run(small, prompts, params=params))
    assert small.engine.stats().preemptions > 0 and 0 < accepted < drafted
    assert [signature(o)[0] for o in outs] == ref
    assert small.engine.stats().pages_used == 0 and small.engine.stats().slots_used == 0
    # the compiled decode call wherever the compiled kernels run (not with DELTASERVE_DECODE_KERNELS=torch)
    assert compiled_verify and all(taken == (small.engine.cpu_kernels != "torch") for taken in compiled_verify)


def test_preempted_with_caching_resumes_bit_exactly():
    from test_engine import _budget_for_pages

    rng = random.Random(4)
    prompts = [random_tokens(rng, 150 + 30 * i) for i in range(5)]
    params = greedy(max_tokens=100)
    ref = [signature(run(make_llm(), [p], params=params)[0]) for p in prompts]
    small = spec(3, kv_cache_memory=_budget_for_pages(small_pages=12) + _log_bytes(5, 3), max_num_seqs=5)
    small.engine.drafter = ScriptedDrafter({tuple(p): r[0] for p, r in zip(prompts, ref)}, p=0.9, vocab_size=VOCAB)
    outs = run(small, prompts, params=params)
    assert small.engine.stats().preemptions > 0
    assert [signature(o) for o in outs] == ref


def test_seeded_sampling_with_drafts_is_plain_sampling_bit_for_bit(compiled_verify):
    rng = random.Random(7)
    prompts = [random_tokens(rng, n) for n in (10, 90, 200)]
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=30, logprobs=3, ignore_eos=True)
    plain = make_llm(enable_prefix_caching=False)
    ref = [signature(o) for o in run(plain, prompts, params=params)]
    llm = spec(3, enable_prefix_caching=False)
    llm.engine.drafter = ScriptedDrafter({tuple(p): r[0] for p, r in zip(prompts, ref)}, p=0.7, vocab_size=VOCAB)
    (got, (drafted, accepted, _)) = counted(llm, lambda: [signature(o) for o in run(llm, prompts, params=params)])
    assert got == ref and 0 < accepted < drafted
    again = [signature(o) for o in run(llm, prompts, params=params)]  # reproducible
    assert again == ref
    # the compiled decode call wherever the compiled kernels run (not with DELTASERVE_DECODE_KERNELS=torch)
    assert compiled_verify and all(taken == (llm.engine.cpu_kernels != "torch") for taken in compiled_verify)
    llm.engine.drafter = ScriptedDrafter({}, vocab_size=VOCAB)  # no drafts at all
    assert [signature(o) for o in run(llm, prompts, params=params)] == ref


def _chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs) if p > 0)


def test_verify_rule_matches_the_target_distribution_on_a_small_vocabulary():
    """8 tokens, fixed seed: the first emitted token follows p0 and, after an accepted draft, the next one p1 (chi-square
    under the 0.999 quantile of 7 degrees of freedom, 24.3); a draft is accepted with probability p0(draft)."""
    from deltaserve.engine.sampler import Sampler, SamplingState

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 8, generator=g) * 1.5
    p0, p1 = torch.softmax(logits[0], -1).tolist(), torch.softmax(logits[1], -1).tolist()
    draft = int(torch.argmax(logits[0]))
    sampler = Sampler()
    state = SamplingState.create(SamplingParams(temperature=1.0, seed=99, max_tokens=10**6))
    plain = SamplingState.create(SamplingParams(temperature=1.0, seed=99, max_tokens=10**6))
    first, second, n = [0] * 8, [0] * 8, 20000
    accepted = 0
    for _ in range(n):
        outs = verify(sampler, logits, state, [draft])
        # the first token is plain sampling's own draw (same generator state)
        assert outs[0].token_id == sampler.sample(logits[:1], [plain])[0].token_id
        first[outs[0].token_id] += 1
        if len(outs) == 2:
            accepted += 1
            second[outs[1].token_id] += 1
            plain.accept(0)
            sampler.sample(logits[1:], [plain])  # keep the plain generator in step
    assert _chi_square(first, p0) < 24.3
    assert _chi_square(second, p1) < 24.3
    assert abs(accepted / n - p0[draft]) < 4 * (p0[draft] * (1 - p0[draft]) / n) ** 0.5


def test_verify_of_plain_greedy_rows_in_one_argmax_is_row_by_row_sampling():
    """verify() samples a plain greedy request without logprobs by one argmax over all its rows: the same tokens and
    commits as sampling row by row (and a request with logprobs still samples row by row)."""
    from deltaserve.engine.sampler import Sampler, SamplingState

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=g)
    best = torch.argmax(logits, dim=-1).tolist()
    sampler = Sampler()
    for drafts in ([best[0], best[1], best[2]], [best[0], (best[1] + 1) % 50, best[2]], [(best[0] + 1) % 50, 0, 0]):
        for logprobs in (None, 2):
            params = SamplingParams(temperature=0.0, max_tokens=100, logprobs=logprobs)
            fast, slow = SamplingState.create(params), SamplingState.create(params)
            outs = verify(sampler, logits, fast, drafts)
            ref = []
            for j in range(4):
                ref.append(sampler.sample(logits[j: j + 1], [slow])[0])
                if j == 3 or ref[-1].token_id != drafts[j]:
                    break
            assert outs == ref and fast.output_token_ids == slow.output_token_ids


def test_the_lazy_head_gives_the_full_heads_tokens_and_runs_row_0_alone_on_a_rejection():
    """verify_greedy_lazily on the tiny model's packed head: the tokens and commits of verify() over the full head's
    logits for a rejection at every position, one span and four at once; the head runs over row 0 alone when draft 1
    is wrong, else over row 0 and then the rest, in two calls at most for all the spans together; each part's logits
    are the full head's rows bit for bit (the row-wise batch invariance the lazy path rests on)."""
    from deltaserve.engine.sampler import Sampler, SamplingState

    llm = make_llm(enable_prefix_caching=False)
    model = llm.engine.model
    assert llm.engine.runner.lazy_head_exact()
    g = torch.Generator().manual_seed(5)
    hidden = (torch.randn(4, model.config.hidden_size, generator=g) * 3).to(model.dtype)
    full = model.compute_logits(hidden)
    assert torch.equal(model.compute_logits(hidden[:1]), full[:1])
    assert torch.equal(model.compute_logits(hidden[1:]), full[1:])
    best = torch.argmax(full, dim=-1).tolist()
    sampler = Sampler(argmax=model.decode_kernels.argmax)
    params = SamplingParams(temperature=0.0, max_tokens=100)
    for accept in range(4):  # drafts right up to `accept`, then wrong
        drafts = [best[j] if j < accept else (best[j] + 1) % VOCAB for j in range(3)]
        rows = []

        def head(h):
            rows.append(h.shape[0])
            return model.compute_logits(h)

        lazy, ref = SamplingState.create(params), SamplingState.create(params)
        (got,) = verify_greedy_lazily(sampler.argmax, head, [(hidden, lazy, drafts)])
        want = verify(sampler, full, ref, drafts)
        assert got == want and lazy.output_token_ids == ref.output_token_ids
        assert [o.token_id for o in got] == best[:accept + 1]
        assert rows == ([1] if accept == 0 else [1, 3])
    # four spans in one call: drafts right up to 0, 3, 1, 2 rows; the second call holds the last three's rows 1..3
    patterns = [0, 3, 1, 2]
    drafts = [[best[j] if j < a else (best[j] + 1) % VOCAB for j in range(3)] for a in patterns]
    rows = []

    def head(h):
        rows.append(h.shape[0])
        return model.compute_logits(h)

    states = [SamplingState.create(params) for _ in patterns]
    got = verify_greedy_lazily(sampler.argmax, head, [(hidden, s, d) for s, d in zip(states, drafts)])
    assert rows == [4, 9]
    for a, d, g, s in zip(patterns, drafts, got, states):
        ref = SamplingState.create(params)
        assert g == verify(sampler, full, ref, d) and s.output_token_ids == ref.output_token_ids
        assert [o.token_id for o in g] == best[:a + 1]


def test_the_gdn_replay_is_the_decode_step_token_by_token():
    """A rollback's replay (DecodeKernels.gdn_replay: one call through n tokens on one slot) gives the bits of the
    compiled decode step on each token in turn, and the torch step's values (ops/gdn.py, the reference)."""
    from deltaserve.model.ops.gdn import recurrent_gated_delta_rule_step

    from deltaserve.model.ops.cpu_kernels import select_decode_kernels

    kernels = select_decode_kernels("cpu", torch.bfloat16, mode="cpp")  # compiled even under DECODE_KERNELS=torch
    g = torch.Generator().manual_seed(2)
    n, H, Hk, dk, dv, S, slot = 3, 4, 2, 64, 64, 5, 3
    q, k = (torch.randn(n, Hk, dk, generator=g).to(torch.bfloat16) for _ in range(2))
    v = torch.randn(n, H, dv, generator=g).to(torch.bfloat16)
    gate, beta = -torch.rand(n, H, generator=g) * 0.3, torch.rand(n, H, generator=g).to(torch.bfloat16)
    state0 = torch.randn(S, H, dv, dk, generator=g) * 0.2
    replayed = state0.clone()
    out = kernels.gdn_replay(q, k, v, gate, beta, replayed, slot)
    stepped, ref = state0.clone(), state0[slot: slot + 1].clone()
    for i in range(n):
        o = kernels.gdn_step(q[i: i + 1], k[i: i + 1], v[i: i + 1], gate[i: i + 1], beta[i: i + 1], stepped,
                             torch.tensor([slot]))
        assert torch.equal(out[i], o[0])
        r = recurrent_gated_delta_rule_step(q[i: i + 1], k[i: i + 1], v[i: i + 1], gate[i: i + 1], beta[i: i + 1], ref)
        torch.testing.assert_close(out[i: i + 1].float(), r.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(replayed, stepped)  # the slot's state; the other slots untouched
    torch.testing.assert_close(replayed[slot: slot + 1], ref, atol=1e-5, rtol=1e-5)
    others = [i for i in range(S) if i != slot]
    assert torch.equal(replayed[others], state0[others])


def test_adaptive_drafts_stop_when_they_do_not_pay_and_probe_back():
    a = Acceptance()
    assert a.next_k(3) == 3
    for _ in range(10):
        a.record(3, 0)
    ks = [a.next_k(3) for _ in range(16)]
    assert ks.count(0) == 14 and ks.count(1) == 2  # a probe of one draft every PROBE steps
    for _ in range(10):
        a.record(1, 1)
    assert a.next_k(3) == 3
    s = SpecStats()
    s.record(3, 2)
    s.record(2, 0)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, s.accepted_per_pos) == (2, 5, 2, [1, 1, 0])


def test_a_large_batch_drafts_the_likeliest_drafts_that_fit():
    wanted = {"a": (3, 1.0), "b": (3, 0.9), "c": (2, 0.5), "d": (0, 0.1)}
    assert fit_drafts(wanted, 4, 0) == {"a": 3, "b": 3, "c": 2, "d": 0}  # no cap
    assert fit_drafts(wanted, 4, 64) == {"a": 3, "b": 3, "c": 2, "d": 0}  # all fit
    # 4 rows of room: 1.0, 1.0, 1.0 (a's three), 0.9 (b's first); then 0.81 and 0.73 (b) before 0.5 (c)
    assert fit_drafts(wanted, 4, 8) == {"a": 3, "b": 1, "c": 0, "d": 0}
    assert fit_drafts(wanted, 4, 10) == {"a": 3, "b": 3, "c": 0, "d": 0}
    assert fit_drafts(wanted, 8, 8) == fit_drafts(wanted, 9, 8) == dict.fromkeys(wanted, 0)  # a full step: none
    assert fit_drafts({"x": (3, 0.8), "y": (3, 0.8)}, 2, 5) == {"x": 2, "y": 1}  # ties: the earlier request
    assert fit_drafts({"x": (3, 1.0), "y": (3, 1.0)}, 2, 5) == {"x": 2, "y": 1}  # equal rates share the room


def test_drafts_shrink_with_the_batch():
    """The adaptive rule's row cap on the engine: forced acceptance (every draft right) drafts 3 a step at batch 1,
    none at batch 8 under the default max_verify_rows (8 rows: the batch's own) once every request decodes, and
    drafts again without the cap; the tokens equal plain's."""
    rng = random.Random(11)
    prompts = [random_tokens(rng, 20 + 7 * i) for i in range(8)]
    params = greedy(max_tokens=12)
    plain = [signature(o) for o in run(make_llm(enable_prefix_caching=False), prompts, params=params)]
    llm = make_llm(speculative_config={"method": "mtp", "num_speculative_tokens": 3}, enable_prefix_caching=False)
    assert llm.engine.spec.max_verify_rows == 8
    llm.engine.drafter = ScriptedDrafter({tuple(p): r[0] for p, r in zip(prompts, plain)}, p=1.0, vocab_size=VOCAB)
    one, (drafted, accepted, steps) = counted(llm, lambda: signature(run(llm, prompts[:1], params=params)[0]))
    assert one == plain[0] and drafted == accepted >= 2 * steps  # 3 a step but near max_tokens
    batch, (capped, _, _) = counted(llm, lambda: [signature(o) for o in run(llm, prompts, params=params)])
    assert batch == plain
    llm.engine.spec = dataclasses.replace(llm.engine.spec, max_verify_rows=0)
    batch, (free, _, _) = counted(llm, lambda: [signature(o) for o in run(llm, prompts, params=params)])
    assert batch == plain and free >= 8 * 6 and capped <= 3  # capped: only while the batch was still filling


def test_mtp_layer_loads_and_its_cache_is_incremental():
    """load_model(mtp=True) takes the stored mtp.* tensors; the layer over n positions at once equals it position by
    position through its cache (the drafter's way), to rounding."""
    from safetensors.torch import load_file

    from deltaserve.embedded.model import ensure_model
    from deltaserve.model.loader import load_model

    path = ensure_model("tiny")
    model = load_model(path, dtype="float32", mtp=True)
    stored = load_file(f"{path}/model.safetensors")
    assert torch.equal(model.mtp.pre_fc_norm_hidden, stored["mtp.pre_fc_norm_hidden.weight"].float())
    assert torch.equal(model.mtp.fc, stored["mtp.fc.weight"].float())
    assert load_model(path, dtype="float32").mtp is None
    g = torch.Generator().manual_seed(1)
    n = 9
    ids = torch.randint(0, VOCAB, (n,), generator=g)
    hidden = torch.randn(n, model.config.hidden_size, generator=g)
    whole = model.mtp(model, ids, hidden, 0, model.mtp.new_cache(model.config, model.device))
    cache = model.mtp.new_cache(model.config, model.device)
    parts = torch.cat([model.mtp(model, ids[i:i + 1], hidden[i:i + 1], i, cache) for i in range(n)])
    torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-5)
    assert whole.abs().sum() > 0
    # MTPDrafter: queued rows run in one call at propose(); the first draft is the head's argmax of the layer's
    # output at the newest position, the next ones chain on the layer's own output
    from deltaserve.engine.speculative import MTPDrafter

    drafter = MTPDrafter(model)
    tokens = [7] + ids.tolist()  # tokens[i + 1] follows position i
    drafter.observe("r", 0, hidden[:4], tokens)
    drafter.observe("r", 4, hidden[4:], tokens)
    assert drafter.propose("r", tokens[:5], 0) == [] and "r" in drafter.queued
    d = drafter.propose("r", tokens, 3)
    assert d[0] == int(torch.argmax(model.compute_logits(whole[-1:])[0])) and len(d) == 3
    drafter.observe("r", 2, hidden[2:5], tokens)  # recomputed from position 2 (after a preemption)
    assert drafter.queued["r"][0] == 2 and drafter.queued["r"][1][-1].shape[0] == 3
    drafter.forget("r")
    assert not drafter.queued and not drafter.caches


def test_a_model_without_mtp_layers_is_refused_for_mtp(tmp_path):
    from deltaserve.model.errors import WeightsError
    from deltaserve.model.loader import load_model
    from deltaserve.model.make import make_random_model
    from deltaserve.presets import load_preset

    cfg = {k: v for k, v in load_preset("tiny").items() if not k.startswith("_")}
    cfg.update(mtp_num_hidden_layers=0, num_hidden_layers=4, layer_types=cfg["layer_types"][:4])
    make_random_model(cfg, str(tmp_path))
    with pytest.raises(WeightsError, match="multi-token-prediction"):
        load_model(str(tmp_path), mtp=True)
    load_model(str(tmp_path))  # without speculation it loads as before


def test_spec_metrics_have_vllms_names():
    from deltaserve.server.metrics import ServerMetrics

    llm = spec(2, enable_prefix_caching=False)
    rng = random.Random(2)
    p = random_tokens(rng, 30)
    ref = run(llm, [p], params=greedy(max_tokens=10))[0].outputs[0].token_ids
    llm.engine.drafter = ScriptedDrafter({tuple(p): ref}, vocab_size=VOCAB)
    run(llm, [p], params=greedy(max_tokens=10))
    text = ServerMetrics(llm.engine.stats, "m").render().decode()
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total", 'vllm:spec_decode_num_accepted_tokens_per_pos_total{'
                 'model_name="m",position="1"}'):
        assert name in text, name


def test_drafted_equals_plain_on_the_plain_torch_kernels(monkeypatch):
    """The other decode path: plain-torch GDN steps (waves through gather / step / scatter) and attention (one
    decode_attention per verify token), oneDNN's bf16 linears."""
    monkeypatch.setenv("DELTASERVE_DECODE_KERNELS", "torch")
    rng = random.Random(1)
    prompts = [random_tokens(rng, n) for n in (5, 70, 150)]
    params = greedy(max_tokens=12)
    plain = make_llm(enable_prefix_caching=False)
    assert plain.engine.cpu_kernels == "torch"
    ref = [signature(o) for o in run(plain, prompts, params=params)]
    llm = spec(3, enable_prefix_caching=False)
    llm.engine.drafter = ScriptedDrafter({tuple(p): r[0] for p, r in zip(prompts, ref)}, p=0.7, vocab_size=VOCAB)
    got, (drafted, accepted, _) = counted(llm, lambda: [signature(o) for o in run(llm, prompts, params=params)])
    assert got == ref and 0 < accepted < drafted


def test_a_stop_inside_a_verify_step_drops_the_tokens_after_it():
    rng = random.Random(8)
    prompts = [random_tokens(rng, n) for n in (12, 40)]
    plain = make_llm(enable_prefix_caching=False)
    ref = [o.outputs[0].token_ids for o in run(plain, prompts, params=greedy(max_tokens=20))]
    stops = [r[6] for r in ref]  # the 7th token: inside a verify step of 4 tokens
    params = greedy(max_tokens=20, stop_token_ids=stops)
    want = [signature(o) for o in run(plain, prompts, params=params)]
    llm = spec(3, enable_prefix_caching=False)
    llm.engine.drafter = ScriptedDrafter({tuple(p): r for p, r in zip(prompts, ref)}, p=1.0, vocab_size=VOCAB)
    outs = run(llm, prompts, params=params)
    assert [signature(o) for o in outs] == want
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)


def test_drafted_equals_plain_on_block_fp8_weights(compiled_verify):
    """A -FP8 checkpoint: its MTP layer's linears are block-FP8 too (model/make.py quantize_state_dict)."""
    from deltaserve.embedded.model import ensure_model

    path = ensure_model("tiny", quantize="fp8")
    rng = random.Random(1)
    prompts = [random_tokens(rng, n) for n in (5, 70)]
    params = greedy(max_tokens=12)
    ref = [signature(o) for o in run(make_llm(model=path, enable_prefix_caching=False), prompts, params=params)]
    llm = spec(2, model=path, enable_prefix_caching=False)
    assert [signature(o) for o in run(llm, prompts, params=params)] == ref  # the MTP layer drafting
    llm.engine.drafter = ScriptedDrafter({tuple(p): r[0] for p, r in zip(prompts, ref)}, p=0.7, vocab_size=VOCAB)
    got, (drafted, accepted, _) = counted(llm, lambda: [signature(o) for o in run(llm, prompts, params=params)])
    assert got == ref and 0 < accepted < drafted
    # the compiled decode call wherever the compiled kernels run (not with DELTASERVE_DECODE_KERNELS=torch)
    assert compiled_verify and all(taken == (llm.engine.cpu_kernels != "torch") for taken in compiled_verify)


def test_fixed_drafts_draft_k_every_step():
    """"adaptive": false: K drafts every step even when none is ever accepted (the rule would turn them off), the
    outputs still plain decoding's."""
    rng = random.Random(12)
    prompt = random_tokens(rng, 40)
    params = greedy(max_tokens=20, logprobs=None)
    ref = signature(run(make_llm(enable_prefix_caching=False), [prompt], params=params)[0])
    llm = make_llm(enable_prefix_caching=False,
                   speculative_config={"method": "mtp", "num_speculative_tokens": 3, "adaptive": False})
    llm.engine.drafter = ScriptedDrafter({tuple(prompt): ref[0]}, p=0.0, vocab_size=VOCAB)
    out, (drafted, accepted, steps) = counted(llm, lambda: signature(run(llm, [prompt], params=params)[0]))
    assert out == ref and accepted == 0 and steps >= 15 and drafted >= 3 * (steps - 2)  # max_tokens caps the last
