"""Parity with transformers: random-weight models written by transformers' own save_pretrained load, their
fp32 logits match transformers' forward, and greedy generation matches transformers' generate. Plus the
model-level bit-exactness properties: chunked prefill on the 64 grid == unchunked, concurrent == solo."""
from __future__ import annotations

import math

import pytest
import torch

from deltaserve.model.loader import load_model
from model_driver import Sequence, greedy, make_caches, prefill, step

LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"]
COMMON = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 5, "layer_types": LAYER_TYPES,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
              "linear_conv_kernel_dim": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 16,
              "linear_num_key_heads": 2, "linear_num_value_heads": 4, "rms_norm_eps": 1e-6}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}
LENGTHS = [1, 63, 64, 65, 300]


def _hf_classes(model_type):
    import transformers as tf

    if model_type == "qwen3_5_text":
        return tf.Qwen3_5TextConfig, tf.Qwen3_5ForCausalLM, {"intermediate_size": 96, "tie_word_embeddings": True}
    if model_type == "qwen3_5_moe_text":
        return tf.Qwen3_5MoeTextConfig, tf.Qwen3_5MoeForCausalLM, dict(MOE)
    # qwen3_next: a dense layer among the MoE ones, top-k weights not renormalised
    return tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM, dict(MOE, intermediate_size=96, mlp_only_layers=[2],
                                                              norm_topk_prob=False)


def randomize(model, seed: int) -> None:
    """Weights large enough that every part of the model moves the logits (transformers' init keeps the
    norms neutral and the projections tiny); zero-centred norms get non-zero weights."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=g) * 2.5)
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) - 2.0)
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:  # zero-centred RMSNorm weights
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:  # also the (tied) head: logits of a few units
                p.copy_(0.25 * torch.randn(p.shape, generator=g))
            elif "conv1d" in name:
                p.copy_(0.4 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.7 * torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"])
def pair(request, tmp_path_factory):
    """(transformers model, deltaserve model) with the same weights, through save_pretrained + load_model."""
    cfg_cls, model_cls, extra = _hf_classes(request.param)
    hf = model_cls(cfg_cls(**COMMON, **extra)).eval()
    randomize(hf, seed=len(request.param))
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    ours = load_model(str(path), dtype="float32")
    assert ours.config.model_type == request.param
    return hf, ours


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, COMMON["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_logits_match_transformers(pair):
    hf, ours = pair
    ids = prompt(max(LENGTHS))
    for n in LENGTHS:
        with torch.no_grad():
            ref = hf(torch.tensor([ids[:n]])).logits[0]
        caches = make_caches(ours, num_slots=1, num_pages=8, block_size=64)
        got = prefill(ours, caches, Sequence(slot=0, pages=list(range(8))), ids[:n])
        assert got.dtype == torch.float32 and got.shape == ref.shape
        diff = (got - ref).abs().max().item()
        assert diff <= 1e-4, f"length {n}: max abs diff {diff}"
        assert ref.abs().max() > 1.0  # the comparison is not between two near-zero tensors


def test_greedy_matches_transformers_generate(pair):
    hf, ours = pair
    ids = prompt(20, seed=1)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, min_new_tokens=32)[0, 20:].tolist()
    assert greedy(ours, ids, 32) == ref


def test_chunked_decode_matches_transformers_logits(pair):
    """Prefill in off-grid chunks, then decode steps: every position's logits match a full forward."""
    hf, ours = pair
    ids = prompt(90, seed=2)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    caches = make_caches(ours, num_slots=2, num_pages=4, block_size=64)
    seq = Sequence(slot=1, pages=[3, 0])
    got = [prefill(ours, caches, seq, ids[:70], chunks=[37, 33])]
    for t in ids[70:]:
        got.append(step(ours, caches, [(seq, [t], True)])[0])
    assert (torch.cat(got) - ref).abs().max().item() <= 1e-4


@pytest.fixture(scope="module")
def dense_path(tmp_path_factory):
    cfg_cls, model_cls, extra = _hf_classes("qwen3_5_text")
    hf = model_cls(cfg_cls(**COMMON, **extra))
    randomize(hf, seed=5)
    path = tmp_path_factory.mktemp("dense")
    hf.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_chunks_on_grid_are_bit_identical(dense_path, dtype):
    model = load_model(dense_path, dtype=dtype)
    ids = prompt(300, seed=3)

    def run(chunks):
        caches = make_caches(model, num_slots=1, num_pages=5, block_size=64)
        seq = Sequence(slot=0, pages=[4, 2, 0, 1, 3])
        out = prefill(model, caches, seq, ids, chunks)
        nxt = [int(out[-1].argmax())]
        for _ in range(4):
            nxt.append(int(step(model, caches, [(seq, [nxt[-1]], True)])[0][-1].argmax()))
        return out, nxt

    whole, whole_next = run(None)
    for chunks in ([128, 172], [64, 64, 172], [256, 44]):
        out, nxt = run(chunks)
        assert torch.equal(out, whole), chunks
        assert nxt == whole_next
    out, nxt = run([37, 263])  # off the grid: close (a few bf16 ulps), same greedy tokens
    assert (out - whole).abs().max().item() <= (1e-3 if dtype == "float32" else 0.1)
    assert nxt == whole_next


@pytest.mark.parametrize("slots", [(0, 1, 2), (2, 0, 1)], ids=["consecutive-slots", "scattered-slots"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_concurrent_equals_solo(dense_path, dtype, slots):
    """Two prefills and a decode in one step, then decodes batched together, against each sequence alone.

    bf16: logits bit-identical. fp32: same tokens, logits within 1e-4 (fp32 GEMMs on this CPU give
    different bits for 1, 2-3 and >= 4 rows; docs/cpu.md). Consecutive decode slots are updated in
    place, scattered ones gathered and scattered back: both paths are checked."""
    model = load_model(dense_path, dtype=dtype)
    prompts = [prompt(100, seed=10), prompt(70, seed=11), prompt(5, seed=12)]
    steps = 6

    def solo(i):
        caches = make_caches(model, num_slots=3, num_pages=6, block_size=64)
        seq = Sequence(slot=slots[i], pages=[2 * i, 2 * i + 1])
        logits = [prefill(model, caches, seq, prompts[i])[-1]]
        for _ in range(steps):
            logits.append(step(model, caches, [(seq, [int(logits[-1].argmax())], True)])[0][-1])
        return logits

    caches = make_caches(model, num_slots=3, num_pages=6, block_size=64)
    seqs = [Sequence(slot=slots[i], pages=[2 * i + 1, 2 * i]) for i in range(3)]
    together = [[] for _ in seqs]
    # sequence 2 starts first and is already decoding when 0 and 1 prefill
    together[2].append(step(model, caches, [(seqs[2], prompts[2], False)])[0][-1])
    outs = step(model, caches, [(seqs[2], [int(together[2][-1].argmax())], True),
                                (seqs[0], prompts[0], False), (seqs[1], prompts[1], False)])
    together[2].append(outs[0][-1])
    together[0].append(outs[1][-1])
    together[1].append(outs[2][-1])
    while min(len(t) for t in together) < steps + 1:
        live = [i for i in range(3) if len(together[i]) < steps + 1]
        outs = step(model, caches, [(seqs[i], [int(together[i][-1].argmax())], True) for i in live])
        for i, o in zip(live, outs):
            together[i].append(o[-1])
    for i in range(3):
        alone = solo(i)
        assert [int(x.argmax()) for x in alone] == [int(x.argmax()) for x in together[i]]
        if dtype == "bfloat16":
            assert all(torch.equal(a, b) for a, b in zip(alone, together[i])), i
        else:
            assert max((a - b).abs().max().item() for a, b in zip(alone, together[i])) <= 1e-4


def test_prepacked_bf16_linears_keep_bits(dense_path):
    """Packed bf16 weights give F.linear's logits (prefill and decode): bit for bit with oneDNN's packing, at
    bf16 tolerance with the compiled linear_bf16 (its own k summation order; tests/test_linear.py)."""
    plain, packed = load_model(dense_path, dtype="bfloat16", prepack=False), load_model(dense_path, dtype="bfloat16")
    if packed.packed_head is None:
        pytest.skip("no oneDNN bf16 on this machine")
    assert packed.linear_kind in ("cpp", "onednn")
    assert plain.packed_head is None and not packed.prepack_linears()  # packed once, by load_model
    assert load_model(dense_path, dtype="float32").packed_head is None  # fp32 stays on F.linear
    ids = prompt(150, seed=4)
    outs = []
    for model in (plain, packed):
        caches = make_caches(model, num_slots=1, num_pages=3, block_size=64)
        seq = Sequence(slot=0, pages=[0, 1, 2])
        logits = [prefill(model, caches, seq, ids)]
        for _ in range(3):
            logits.append(step(model, caches, [(seq, [int(logits[-1][-1].argmax())], True)])[0])
        outs.append(torch.cat(logits))
    if packed.linear_kind == "onednn":
        assert torch.equal(outs[0], outs[1])
    else:  # two bf16 paths apart by at most 2 bf16 ulps at the largest logit (both are ~1.6 from fp32 here)
        ulp = 2.0 ** (math.floor(math.log2(outs[0].abs().max().item())) - 7)
        torch.testing.assert_close(outs[0], outs[1], atol=2 * ulp, rtol=2e-2)
