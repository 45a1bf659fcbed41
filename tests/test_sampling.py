"""SamplingParams validation and the sampler against naive references."""
from __future__ import annotations

import math

import pytest
import torch

from deltaserve.engine.outputs import Logprob
from deltaserve.engine.sampler import Guide, Sampler, SampleOut, SamplingState
from deltaserve.engine.sampling_params import MAX_LOGPROBS, SamplingParams

V = 512


def _logits(n: int, v: int = V, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g) * 3.0


def _state(prompt=(), out=(), eos=(1,), seed=0, **kw) -> SamplingState:
    return SamplingState.create(SamplingParams(**kw), list(prompt), eos_token_ids=eos, seed=seed,
                                output_token_ids=list(out))


# ------------------------------------------------------------------ SamplingParams

def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1, 1.0, 1.0, 0, 0.0, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.ignore_eos, p.logprobs, p.prompt_logprobs) == (16, 0, False, None, None)
    assert p.stop == [] and p.stop_token_ids == [] and p.logit_bias is None
    assert p.skip_special_tokens and not p.include_stop_str_in_output and p.structured is None
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(logit_bias={"5": 1.5}).logit_bias == {5: 1.5}
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=0.7).greedy
    assert SamplingParams(temperature=0.001).temperature == 0.01  # vLLM clamps tiny temperatures


@pytest.mark.parametrize("kw, field", [
    (dict(n=0), "n"), (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"), (dict(top_k=1.5), "top_k"),
    (dict(min_p=-0.1), "min_p"), (dict(min_p=1.1), "min_p"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=20, max_tokens=10), "min_tokens"),
    (dict(logprobs=MAX_LOGPROBS + 1), "logprobs"), (dict(logprobs=-1), "logprobs"),
    (dict(prompt_logprobs=21), "prompt_logprobs"), (dict(stop=[""]), "stop"), (dict(stop_token_ids=[-3]), "stop_token_ids"),
    (dict(logit_bias={1: 101}), "logit_bias"), (dict(logit_bias={"a": 1}), "logit_bias"),
    (dict(seed="1"), "seed"), (dict(ignore_eos="yes"), "ignore_eos"),
])
def test_invalid_values_raise_with_field_name(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_validate_for_vocab():
    SamplingParams(logit_bias={V - 1: 1.0}, stop_token_ids=[0]).validate_for(V)
    with pytest.raises(ValueError, match=r"logit_bias.*\[0, 512\)"):
        SamplingParams(logit_bias={V: 1.0}).validate_for(V)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[V + 7]).validate_for(V)


# ------------------------------------------------------------------ sampler vs references

def test_greedy_is_argmax_and_commits():
    logits = _logits(6)
    states = [_state(temperature=0.0) for _ in range(6)]
    outs = Sampler().sample(logits, states)
    assert [o.token_id for o in outs] == logits.argmax(-1).tolist()
    assert all(s.output_token_ids == [o.token_id] for s, o in zip(states, outs))
    # the processed path (penalties off but a zero bias present) agrees with the fast path
    st = _state(temperature=0.0, logit_bias={3: 0.0})
    assert Sampler().sample(logits[:1], [st])[0].token_id == outs[0].token_id


def _kept(x: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(x)).flatten().tolist())


def test_top_k_mask_matches_reference():
    row = _logits(1)[0]
    for k in (1, 5, 50):
        x = Sampler().processed_logits(row, _state(top_k=k))
        assert _kept(x) == set(torch.argsort(row, descending=True)[:k].tolist())
    assert _kept(Sampler().processed_logits(row, _state(top_k=V + 10))) == set(range(V))


def test_top_p_mask_matches_reference():
    row = _logits(1, seed=3)[0]
    probs = torch.softmax(row.double(), -1).tolist()
    order = sorted(range(V), key=lambda i: -probs[i])
    for top_p in (0.05, 0.3, 0.9):
        ref, cum = set(), 0.0
        for i in order:  # the smallest set of most likely tokens whose mass reaches top_p
            ref.add(i)
            cum += probs[i]
            if cum >= top_p:
                break
        assert _kept(Sampler().processed_logits(row, _state(top_p=top_p))) == ref


def test_min_p_mask_matches_reference():
    row = _logits(1, seed=4)[0]
    probs = torch.softmax(row.double() / 0.8, -1)
    for min_p in (0.01, 0.1, 0.5):
        ref = set(torch.nonzero(probs >= min_p * probs.max()).flatten().tolist())
        assert _kept(Sampler().processed_logits(row, _state(temperature=0.8, min_p=min_p))) == ref


def test_temperature_scales():
    row = _logits(1)[0]
    x = Sampler().processed_logits(row, _state(temperature=0.5))
    torch.testing.assert_close(x, row / 0.5)


def test_penalties_match_reference():
    row = _logits(1, seed=5)[0]
    prompt, out = [3, 3, 7, 11, 400], [7, 9, 9, 9, 12, 3]
    rp, fp, pp = 1.3, 0.4, -0.25
    x = Sampler().processed_logits(row, _state(prompt, out, temperature=0.0, repetition_penalty=rp,
                                               frequency_penalty=fp, presence_penalty=pp))
    ref = row.double().tolist()
    for t in set(prompt) | set(out):
        ref[t] = ref[t] / rp if ref[t] > 0 else ref[t] * rp
    for t in set(out):
        ref[t] -= fp * out.count(t) + pp
    torch.testing.assert_close(x.double(), torch.tensor(ref, dtype=torch.float64), rtol=1e-6, atol=1e-5)


def test_logit_bias_plus_100_forces_token():
    logits = _logits(4, seed=6)
    for temp in (0.0, 1.0, 1.5):
        states = [_state(seed=s, temperature=temp, logit_bias={42: 100.0}) for s in range(4)]
        assert [o.token_id for o in Sampler().sample(logits, states)] == [42] * 4
    st = _state(temperature=0.0, logit_bias={int(logits[0].argmax()): -100.0})
    assert Sampler().sample(logits[:1], [st])[0].token_id != int(logits[0].argmax())


def _run(seed, steps=12, **kw) -> list[int]:
    st = _state(seed=seed, **kw)
    logits = _logits(steps, seed=9)
    return [Sampler().sample(logits[i:i + 1], [st])[0].token_id for i in range(steps)]


def test_seed_reproducibility():
    a = _run(1234, temperature=1.0, top_p=0.95, top_k=100)
    assert a == _run(1234, temperature=1.0, top_p=0.95, top_k=100)
    assert a != _run(99, temperature=1.0, top_p=0.95, top_k=100)
    # params.seed wins over the engine's seed; n > 1 children get seed + index
    p = SamplingParams(seed=7)
    assert SamplingState.create(p, seed=1).seed == 7 and SamplingState.create(p, index=2).seed == 9
    assert SamplingState.create(SamplingParams(), seed=5).seed == 5


def test_sampling_follows_distribution():
    row = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    st = _state(seed=0)
    counts = [0] * 4
    s = Sampler()
    for _ in range(4000):
        counts[s.sample_row(row[0], st).token_id] += 1
    probs = torch.softmax(row[0].double(), -1).tolist()
    for c, p in zip(counts, probs):
        assert abs(c / 4000 - p) < 0.03


def test_min_tokens_blocks_eos_and_stop_ids():
    logits = torch.zeros(1, V)
    logits[0, 1] = 50.0  # eos
    logits[0, 9] = 40.0  # a stop token id
    st = _state(eos=(1,), temperature=0.0, min_tokens=3, stop_token_ids=[9])
    s = Sampler()
    toks = [s.sample(logits, [st])[0].token_id for _ in range(4)]
    assert 1 not in toks[:3] and 9 not in toks[:3] and toks[3] == 1


def test_logprobs_raw_distribution_ranks():
    logits = _logits(2, seed=11)
    st = _state(seed=3, temperature=1.0, top_k=3, logprobs=5, logit_bias={17: 100.0})
    out = Sampler().sample(logits[:1], [st])[0]
    assert out.token_id == 17
    lp = torch.log_softmax(logits[0], -1)
    assert out.logprobs[17].logprob == pytest.approx(float(lp[17]), abs=1e-6)  # raw, not the biased one
    assert out.logprobs[17].rank == int((lp >= lp[17]).sum())
    top = torch.topk(lp, 5)
    for r, (v, i) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
        if i != 17:
            assert out.logprobs[i] == Logprob(pytest.approx(v, abs=1e-6), r, None)
    assert len(out.logprobs) in (5, 6)
    # logprobs=0: only the sampled token; id_to_piece fills decoded_token
    out0 = Sampler(id_to_piece=lambda i: f"<{i}>").sample(logits[1:], [_state(temperature=0.0, logprobs=0)])[0]
    assert list(out0.logprobs) == [out0.token_id] and out0.logprobs[out0.token_id].rank == 1
    assert out0.logprobs[out0.token_id].decoded_token == f"<{out0.token_id}>"


def test_prompt_logprobs():
    logits = _logits(5, seed=12)
    targets = [4, 8, 15, 16, 23]
    res = Sampler().prompt_logprobs(logits, targets, 3)
    assert len(res) == 5
    for row, t, d in zip(logits, targets, res):
        lp = torch.log_softmax(row, -1)
        assert d[t].logprob == pytest.approx(float(lp[t]), abs=1e-6)
        assert d[t].rank == int((lp >= lp[t]).sum())
        assert {i for i, v in d.items() if v.rank <= 3} >= set(torch.topk(lp, 3).indices.tolist())


def test_batch_invariance_bit_identical():
    """A request's token and logprobs alone == inside a batch of others (bit for bit)."""
    v = 65536  # large enough that vocab-wide reductions are split across threads
    logits = _logits(8, v=v, seed=13)
    kinds = [dict(temperature=0.0, logprobs=5), dict(temperature=0.9, top_p=0.9, logprobs=20),
             dict(temperature=1.0, top_k=40, min_p=0.05, logprobs=3), dict(temperature=0.7, repetition_penalty=1.2)]

    def states():
        return [SamplingState.create(SamplingParams(seed=100 + i, **kinds[i % 4]), [1, 2, 3], eos_token_ids=(1,))
                for i in range(8)]

    batch = Sampler().sample(logits, states())
    for i in range(8):
        alone = Sampler().sample(logits[i:i + 1].clone(), [states()[i]])[0]
        assert alone.token_id == batch[i].token_id
        if alone.logprobs is not None:
            assert {k: (x.logprob, x.rank) for k, x in alone.logprobs.items()} == \
                   {k: (x.logprob, x.rank) for k, x in batch[i].logprobs.items()}


def test_batched_greedy_argmax_equals_row_by_row():
    """Plain greedy rows share one argmax over [B, V]: the same ids as each row alone, ties included."""
    v = 248320  # the Qwen3.5 vocab: reductions split across threads
    logits = _logits(9, v=v, seed=21)
    logits[2, [7, 90000, v - 1]] = 1e4  # a tie: the first index wins either way
    logits[5, v - 3:] = 1e4
    kinds = [dict(temperature=0.0), dict(temperature=0.0), dict(temperature=0.0, logprobs=2),
             dict(temperature=0.8, seed=3)]
    states = [_state(**kinds[i % 4]) for i in range(9)]
    outs = Sampler().sample(logits, states)
    for i, o in enumerate(outs):
        alone = Sampler().sample(logits[i:i + 1].clone(), [_state(**kinds[i % 4])])[0]
        assert o.token_id == alone.token_id, i
        if kinds[i % 4]["temperature"] == 0.0:
            assert o.token_id == int(torch.argmax(logits[i].clone()))
    assert outs[2].token_id == 7 and outs[5].token_id == v - 3


class _SetGuide:
    def __init__(self, allowed, finish_after=2):
        self.allowed, self.seen, self.finish_after = allowed, [], finish_after

    def allowed_tokens(self, vocab_size):
        m = torch.zeros(vocab_size, dtype=torch.bool)
        m[list(self.allowed)] = True
        return m

    def accept(self, token_id):
        self.seen.append(token_id)

    def is_finished(self):
        return len(self.seen) >= self.finish_after


def test_guide_mask_accept_and_finish():
    g = _SetGuide({5, 77, 300})
    assert isinstance(g, Guide)
    st = SamplingState.create(SamplingParams(temperature=1.0, seed=0), [], guide=g)
    s = Sampler()
    o1 = s.sample(_logits(1, seed=14), [st])[0]
    o2 = s.sample(_logits(1, seed=15), [st])[0]
    assert {o1.token_id, o2.token_id} <= {5, 77, 300} and g.seen == [o1.token_id, o2.token_id]
    assert not o1.guide_finished and o2.guide_finished
    # structured= a factory: each state gets a fresh guide
    class Factory:
        def new_guide(self):
            return _SetGuide({9})
    p = SamplingParams(temperature=0.0, structured=Factory())
    a, b = SamplingState.create(p), SamplingState.create(p)
    assert a.guide is not b.guide and s.sample(_logits(1), [a])[0].token_id == 9
    # a dead end (nothing allowed) falls back to eos
    dead = SamplingState.create(SamplingParams(temperature=0.0), guide=_SetGuide(set()), eos_token_ids=(1,))
    assert s.sample(_logits(1), [dead])[0].token_id == 1


def test_failing_row_does_not_disturb_others():
    class Broken(_SetGuide):
        def allowed_tokens(self, vocab_size):
            raise RuntimeError("grammar exploded")
    logits = _logits(2)
    good = _state(temperature=0.0)
    bad = SamplingState.create(SamplingParams(), guide=Broken(set()))
    outs = Sampler().sample(logits, [bad, good])
    assert outs[0] == SampleOut(token_id=-1, error="RuntimeError: grammar exploded") and bad.output_token_ids == []
    assert outs[1].token_id == int(logits[1].argmax()) and outs[1].error is None


def test_greedy_ignores_generator_and_nan_free():
    row = torch.full((V,), -1e30)
    row[3] = 0.0
    st = _state(temperature=1.0, top_p=0.5, min_p=0.5, top_k=2)
    assert Sampler().sample_row(row, st).token_id == 3
    assert not math.isnan(float(torch.softmax(Sampler().processed_logits(row, st), -1)[3]))


@pytest.mark.parametrize("prefixes", [(8,), (8, 64), (4096,)])
def test_top_p_prefix_search_and_top_k_combo(prefixes, monkeypatch):
    """top_p's cut found in a topk prefix, past it (full sort), and after top_k: same sets as the reference."""
    monkeypatch.setattr(Sampler, "TOP_P_PREFIXES", prefixes)
    row = _logits(1, seed=21)[0] * 0.3  # flat: the 0.9 cut lies past a small prefix
    for top_k, top_p in ((0, 0.2), (0, 0.9), (30, 0.5), (300, 0.9)):
        x = row.clone()
        if top_k:
            x[torch.argsort(x, descending=True)[top_k:]] = float("-inf")
        probs = torch.softmax(x.double(), -1).tolist()
        ref, cum = set(), 0.0
        for i in sorted(range(V), key=lambda i: -probs[i]):
            ref.add(i)
            cum += probs[i]
            if cum >= top_p:
                break
        assert _kept(Sampler().processed_logits(row, _state(top_k=top_k, top_p=top_p))) == ref
