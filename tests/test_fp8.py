"""Block-FP8 checkpoints (docs/fp8.md): the compiled linear_fp8 (csrc/linear_fp8.cpp) against the plain-torch
reference on awkward shapes (row counts around the tiles, N and K not multiples of 16 / 128, partial scale
blocks, odd K), every e4m3 code exact, bit-for-bit batch and thread invariance; the writer (make-model
--quantize fp8) read back by transformers with dequantized weights equal to ours bit for bit; the loader
(FP8 kept, fused and split projections, dequantize=True) and its refusals; FP8 logits against the
dequantized model within the stated tolerance."""
from __future__ import annotations

import json
import os

import pytest
import torch

from deltaserve.config import ConfigError
from deltaserve.model.ops import fp8
from deltaserve.model.ops.fp8 import Fp8Weight, SplitWeight, dequantize_fp8, fuse, linear_fp8_reference, quantize_fp8
from deltaserve.model.ops.linear import linear
from deltaserve.model.ops.packed import PackedWeight
from tests.util import assert_linear_rows_batch_invariant, prefill_logits, rewrite_checkpoint


@pytest.fixture(scope="module")
def ext():
    return fp8.load_fp8_extension()  # a build error fails with the compiler's message, never a skip


def build_paths() -> list[str]:
    """"build/path" for every path of every build this CPU executes (avx512 with its amx path where AMX may be
    used, avx2, generic), so that each compiled path is tested where it can run."""
    out = []
    for build in fp8.executable_builds():
        # a build error fails the collection with the compiler's message: never fewer builds tested, silently
        out += [f"{build}/{p}" for p in fp8.load_fp8_extension(build).fp8_paths()]
    return out


def ext_path(build_path: str):
    build, path = build_path.split("/")
    return fp8.load_fp8_extension(build), path


def rand(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def packed(ext, N, K, seed, path=""):
    q, s = quantize_fp8(rand(N, K, seed=seed, scale=0.05))
    ref = Fp8Weight.from_block_scales(q, s)
    w = Fp8Weight.from_block_scales(q, s)
    w.pack(ext, path)
    return w, ref


SHAPES = [(1, 1), (15, 7), (16, 128), (17, 130), (33, 4), (100, 1030), (200, 256), (129, 129), (48, 3584),
          (776, 384)]


@pytest.mark.parametrize("build_path", build_paths() or ["none/none"])
@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("M", [1, 3, 7, 8, 9, 17])
def test_matches_torch_reference(ext, build_path, N, K, M):
    ext, path = ext_path(build_path)
    w, ref = packed(ext, N, K, seed=N * 7 + K, path=path)
    assert w.packed.shape == (-(-N // 16), -(-K // 4), 64) and w.scales.shape == (-(-N // 16), -(-K // 128))
    x = rand(M, K, seed=M).to(torch.bfloat16)
    y = linear(x, w)
    assert y.shape == (M, N) and y.dtype == torch.bfloat16
    want = linear_fp8_reference(x, ref.q, ref.row_scale)  # the same terms, torch's order inside a block
    exact = (x.float() @ ref.dequantize(torch.float32).t())  # fp32 dequantized weights, fp32 sums
    torch.testing.assert_close(y.float(), want.float(), atol=1e-3 * K ** 0.5 * 0.05, rtol=8e-3)
    torch.testing.assert_close(y.float(), exact, atol=2e-3 * K ** 0.5 * 0.05, rtol=8e-3)


@pytest.mark.parametrize("build_path", build_paths() or ["none/none"])
def test_every_code_converts_exactly(ext, build_path):
    """Each of the 254 finite codes (subnormals, both zeros, +-448) times a power-of-two scale, picked out by
    one-hot rows: the kernel's products are exact."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # 254 codes
    K = codes.numel()
    q = codes.view(torch.float8_e4m3fn).repeat(16, 1)  # [16, 254]: column k holds code k
    s = torch.full((1, 2), 2.0 ** -3)
    ext, path = ext_path(build_path)
    w = Fp8Weight.from_block_scales(q, s)
    w.pack(ext, path)
    x = torch.eye(K, dtype=torch.bfloat16)  # row k selects code k
    y = linear(x, w)  # [K, 16]
    want = (codes.view(torch.float8_e4m3fn).float() * 2.0 ** -3).to(torch.bfloat16)
    assert torch.equal(y[:, 0].float(), want.float())  # (-0 comes back as +0: a sum starting from +0)
    assert torch.equal(y, y[:, :1].expand(-1, 16))


@pytest.mark.parametrize("N,K", [(776, 256), (1000, 1024), (48, 3584)])
def test_rows_are_batch_and_thread_invariant(ext, N, K):
    for build_path in build_paths():
        e, path = ext_path(build_path)
        w, _ = packed(e, N, K, seed=3, path=path)
        assert_linear_rows_batch_invariant(linear, rand(41, K, seed=4).to(torch.bfloat16), w)


@pytest.mark.parametrize("N,K", [(17, 130), (100, 1030), (48, 3584), (1, 1)])
def test_avx2_path_has_the_scalar_paths_bits(N, K):
    """The avx2 build's vector path sums in the scalar path's order (exact products, so fma = multiply then add):
    its bits are the scalar path's, at every row count."""
    if "avx2" not in fp8.executable_builds():
        pytest.skip("this CPU does not execute the avx2 build")
    ext = fp8.load_fp8_extension("avx2")
    a, _ = packed(ext, N, K, seed=11, path="avx2")
    b, _ = packed(ext, N, K, seed=11, path="scalar")
    for M in (1, 5, 6, 7, 13):
        x = rand(M, K, seed=M + 40).to(torch.bfloat16)
        assert torch.equal(linear(x, a), linear(x, b)), M


def test_errors(ext):
    w, _ = packed(ext, 32, 64, seed=5)
    with pytest.raises(RuntimeError, match="x must be"):
        linear(rand(4, 64, seed=8), w)
    with pytest.raises(RuntimeError, match="inputs"):
        linear(rand(4, 72, seed=8).to(torch.bfloat16), w)
    nan = torch.zeros(16, 8, dtype=torch.uint8)
    nan[3, 5] = 0xFF
    with pytest.raises(RuntimeError, match="a NaN code at row 3, column 5"):
        ext.pack_fp8_weight(nan, torch.ones(16, 1))
    with pytest.raises(RuntimeError, match="not in this build"):
        ext.linear_fp8(rand(4, 64, seed=8).to(torch.bfloat16), w.packed, w.scales, 32, "sse9")
    q, s = quantize_fp8(rand(32, 64, seed=9))
    row = fp8.row_scales(s, 32).clone()
    row[3, 0] *= 2  # two scales inside one 16-column block
    with pytest.raises(RuntimeError, match="different scales"):
        ext.pack_fp8_weight(q.view(torch.uint8), row)
    with pytest.raises(ValueError, match="weight_scale_inv has shape"):
        Fp8Weight.from_block_scales(q, torch.ones(2, 1))


def test_fuse_and_split(ext):
    """Parts of 16-multiples fuse into one Fp8Weight (each keeps its own block grid); an unaligned part or a
    bf16 part makes a SplitWeight; either way each column equals its part's own product, bit for bit."""
    def part(n, k, seed):
        q, s = quantize_fp8(rand(n, k, seed=seed, scale=0.05 * (seed + 1)))
        return Fp8Weight.from_block_scales(q, s)

    K = 200
    a, b, c = part(144, K, 1), part(40, K, 2), part(8, K, 3)  # 144 = 128 + 16: a's second block is partial
    one = fuse([a, b])
    assert isinstance(one, Fp8Weight) and one.shape == (184, K)
    split = fuse([a, c, b])  # c's 8 rows end a run: b cannot share a column block with them
    assert isinstance(split, SplitWeight) and [p.shape[0] for p in split.parts] == [144 + 8, 40]
    dense = rand(4, K, seed=4).to(torch.bfloat16)
    mixed = fuse([a, dense])
    assert isinstance(mixed, SplitWeight)
    x = rand(5, K, seed=6).to(torch.bfloat16)
    alone = {}
    for name, p in (("a", a), ("b", b), ("c", c)):
        q = Fp8Weight(p.q, p.row_scale)
        q.pack(ext)
        alone[name] = linear(x, q)
    one.pack(ext)
    split.pack(ext, None)
    mixed.pack(ext, None)
    assert torch.equal(linear(x, one), torch.cat([alone["a"], alone["b"]], -1))
    assert torch.equal(linear(x, split), torch.cat([alone["a"], alone["c"], alone["b"]], -1))
    assert torch.equal(linear(x, mixed)[:, :144], alone["a"])


def test_quantize_matches_transformers_dequantize():
    """Our dequantization is transformers' Fp8Dequantize bit for bit (block-aligned shapes, and shapes under one
    block, which is what its grid-derived block size handles)."""
    import accelerate  # noqa: F401 - the test extra has it: missing, the test fails
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    deq = Fp8Dequantize(None)
    for N, K in [(256, 384), (64, 100), (512, 128)]:
        q, s = quantize_fp8(rand(N, K, seed=N + K, scale=0.03))
        theirs = deq._dequantize_one(q, s, torch.bfloat16)
        assert torch.equal(fp8.dequantize_fp8(q, s, torch.bfloat16), theirs)
        assert (q.float().abs() <= fp8.FP8_MAX).all()
        back = fp8.dequantize_fp8(q, s, torch.float32)
        w = rand(N, K, seed=N + K, scale=0.03)
        assert ((back - w).abs() <= s.repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K] * 16).all()


# ---- checkpoints --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    from deltaserve.embedded.model import make_model

    d = str(tmp_path_factory.mktemp("fp8") / "tiny-fp8")
    make_model("tiny", d, quantize="fp8")
    return d


def test_writer_format(fp8_dir):
    from safetensors import safe_open

    with open(os.path.join(fp8_dir, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    assert qc == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                  "modules_to_not_convert": qc["modules_to_not_convert"]}
    assert "lm_head" in qc["modules_to_not_convert"] and "model.language_model.layers.0.linear_attn.in_proj_a" in qc["modules_to_not_convert"]
    assert "model.visual" in qc["modules_to_not_convert"]  # the vision tower stays bf16
    with safe_open(os.path.join(fp8_dir, "model.safetensors"), "pt") as f:
        w = f.get_tensor("model.language_model.layers.0.mlp.down_proj.weight")
        s = f.get_tensor("model.language_model.layers.0.mlp.down_proj.weight_scale_inv")
        assert w.dtype == torch.float8_e4m3fn and w.shape == (256, 512)
        assert s.dtype == torch.float32 and s.shape == (2, 4)
        assert f.get_tensor("model.language_model.layers.0.linear_attn.in_proj_b.weight").dtype == torch.bfloat16
        assert "model.language_model.layers.0.linear_attn.in_proj_b.weight_scale_inv" not in f.keys()


def test_transformers_loads_our_checkpoint_with_our_weights(fp8_dir):
    """transformers reads the writer's checkpoint (on a CPU it dequantizes block-FP8 to bf16 at load: its FP8
    matmuls need a GPU); every dequantized weight equals ours bit for bit."""
    import accelerate  # noqa: F401 - the test extra has it: missing, the test fails
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(fp8_dir)
    theirs = hf.state_dict()
    ck = load_file(os.path.join(fp8_dir, "model.safetensors"))
    quantized = [k for k, t in ck.items() if t.dtype == torch.float8_e4m3fn]
    mtp = [k for k in quantized if k.startswith("mtp.")]  # the MTP layer's linears (transformers skips mtp.*)
    quantized = [k for k in quantized if not k.startswith("mtp.")]
    assert len(quantized) == 50 and len(mtp) == 7
    for k in quantized:  # their causal LM names the multimodal checkpoint's text model model.*
        t = theirs[k.replace("model.language_model.", "model.", 1)]
        assert t.dtype == torch.bfloat16
        assert torch.equal(fp8.dequantize_fp8(ck[k], ck[k + "_scale_inv"], torch.bfloat16), t), k




def test_loader_keeps_fp8_and_logits_match_the_dequantized_model(ext, fp8_dir):
    """Tolerance (docs/fp8.md): against the fp32 model of the same dequantized weights, the FP8 model's logits
    are no further off than the dequantized bf16 model's own (relative RMS), and FP8 vs dequantized bf16 stays
    within 2x that bf16 noise floor and under 0.1 in relative RMS."""
    from deltaserve.model.loader import load_model

    m = load_model(fp8_dir)
    assert isinstance(m.layers[0].mlp.gate_up, Fp8Weight) and m.layers[0].mlp.gate_up.packed is not None
    assert isinstance(m.layers[3].self_attn.qkv_proj, Fp8Weight)
    gdn = m.layers[0].linear_attn.in_proj  # fp8 in_proj_qkv + in_proj_z, bf16 in_proj_b + in_proj_a
    assert isinstance(gdn, SplitWeight) and [p.shape[0] for p in gdn.parts] == [768, 8]
    deq = load_model(fp8_dir, dequantize=True)
    exact = load_model(fp8_dir, dtype="float32")
    assert isinstance(deq.layers[0].mlp.gate_up, PackedWeight)  # dequantized: the bf16 path
    ids = torch.randint(10, 4000, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    y8, yb, y32 = prefill_logits(m, ids), prefill_logits(deq, ids), prefill_logits(exact, ids)
    rel = lambda a, b: ((a - b).pow(2).mean() / b.pow(2).mean()).sqrt().item()
    floor = rel(yb, y32)
    assert rel(y8, y32) <= 1.25 * floor, (rel(y8, y32), floor)
    assert rel(y8, yb) <= min(0.1, 2 * floor), (rel(y8, yb), floor)
    # the unpacked model (the torch reference for every linear) is the FP8 model up to fp32 rounding
    ref = load_model(fp8_dir, prepack=False)
    assert isinstance(ref.layers[0].mlp.gate_up, Fp8Weight) and ref.layers[0].mlp.gate_up.packed is None
    assert rel(prefill_logits(ref, ids[:130]), y8[:130]) < 0.02




@pytest.mark.parametrize("change,match", [
    (lambda c: c["quantization_config"].update(quant_method="awq"), "quant_method 'awq'.*block-FP8.*GPTQ-Int4"),
    (lambda c: c["quantization_config"].update(quant_method="compressed-tensors"), "quant_method 'compressed-tensors'"),
    (lambda c: c["quantization_config"].update(fmt="e5m2"), "fmt 'e5m2'"),
    (lambda c: c["quantization_config"].update(weight_block_size=[64, 64]), r"weight_block_size \[64, 64\]"),
    (lambda c: c["quantization_config"].update(activation_scheme="static"), "activation_scheme 'static'"),
    (lambda c: c["quantization_config"].update(scale_fmt="ue8m0"), "scale_fmt 'ue8m0'"),
    (lambda c: c["quantization_config"].update(bits=4), "key 'bits'"),
    (lambda c: c["quantization_config"]["modules_to_not_convert"].append("model.language_model.layers.0.mlp.down_proj"),
     "down_proj is quantized but quantization_config.modules_to_not_convert lists it"),
    (lambda c: c["quantization_config"]["modules_to_not_convert"].append("model.language_model.layers.*.mlp"),
     "mlp.gate_proj is quantized but"),
    (lambda c: c.pop("quantization_config"), "float8_e4m3fn but config.json has no quantization_config"),
])
def test_refusals_config(fp8_dir, tmp_path, change, match):
    from deltaserve.model.loader import load_model

    d = rewrite_checkpoint(fp8_dir, str(tmp_path / "m"), config=change)
    with pytest.raises(ConfigError, match=match):
        load_model(d, prepack=False)


@pytest.mark.parametrize("change,match", [
    (lambda sd: sd.pop("model.language_model.layers.0.mlp.down_proj.weight_scale_inv"), "float8_e4m3fn without .*down_proj.weight_scale_inv"),
    (lambda sd: sd.update({"model.language_model.layers.0.mlp.down_proj.weight_scale_inv": torch.ones(2, 3)}),
     r"weight_scale_inv has shape \(2, 3\).*needs \(2, 4\)"),
    (lambda sd: sd.update({"model.language_model.layers.0.mlp.down_proj.weight_scale_inv": torch.ones(2, 4, dtype=torch.float16)}),
     "weight_scale_inv is torch.float16"),
    (lambda sd: sd.update({"model.language_model.layers.0.linear_attn.in_proj_a.weight_scale_inv": torch.ones(1, 2)}),
     "in_proj_a.weight is torch.bfloat16 but has a weight_scale_inv"),
    (lambda sd: sd.update({"model.language_model.layers.0.mlp.down_proj.weight": torch.full((256, 512), 0x7F, dtype=torch.uint8)
                           .view(torch.float8_e4m3fn)}), "131072 NaN codes"),
    (lambda sd: sd.update({"model.language_model.layers.0.mlp.up_proj.weight": sd["model.language_model.layers.0.mlp.up_proj.weight"]
                           .to(torch.float8_e5m2)}), "float8_e5m2"),
])
def test_refusals_tensors(fp8_dir, tmp_path, change, match):
    from deltaserve.model.loader import WeightsError, load_model

    d = rewrite_checkpoint(fp8_dir, str(tmp_path / "m"), tensors=change)
    with pytest.raises(WeightsError, match=match):
        load_model(d, prepack=False)


def test_quantization_config_in_text_config_is_read():
    from deltaserve.model.quant import read_quantization

    spec = read_quantization({"text_config": {"quantization_config": {
        "quant_method": "fp8", "weight_block_size": [128, 128], "ignored_layers": ["lm_head", "model.layers.1"]}}})
    assert spec is not None and not spec.converts("lm_head") and not spec.converts("model.layers.1.mlp.up_proj")
    assert spec.converts("model.layers.11.mlp.up_proj") and spec.converts("model.layers.0.mlp.gate_proj")
    assert read_quantization({}) is None


def test_planner_counts_fp8_weight_bytes(fp8_dir):
    """The planner's block-FP8 count (config only) matches the writer's checkpoint, whose A_log / dt_bias are
    fp32 where the count takes the model dtype; plan reads a checkpoint's quantization_config by itself."""
    from deltaserve.memory import sizing as S
    from deltaserve.tools.planner import model_weight_bytes, plan, resolve_model

    m = resolve_model("tiny").config
    fp32_extra = 2 * 2 * m.linear_num_value_heads * len(m.gdn_layers)  # A_log + dt_bias at 4 B, not 2
    counted, q = S.fp8_weight_bytes(m, "bfloat16")
    vision = 2 * resolve_model("tiny").vision.num_params()  # the vision tower, bf16
    assert counted + fp32_extra + vision == model_weight_bytes(fp8_dir).bytes
    assert q == sum(n * k for n, k in S.fp8_linear_shapes(m))
    r = plan("tiny", quantization="fp8", budget_bytes=1 << 28)
    assert r["weight_bytes"] == counted + vision and r["weight_quantization"] == "fp8"
    assert plan(fp8_dir, budget_bytes=1 << 28)["weight_quantization"] == "fp8"
    big = plan("qwen3.5-27b", quantization="fp8", budget_bytes=1 << 34)["weight_bytes"]
    bf16 = plan("qwen3.5-27b", budget_bytes=1 << 34)["weight_bytes"]
    assert 0.5 * bf16 < big < 0.56 * bf16  # the embedding and head stay bf16


def test_the_fp8_build_follows_the_decode_kernels_instruction_set(monkeypatch):
    """--cpu-isa avx2 runs the avx2 fp8 build (as an AVX2-only CPU would), amx / avx512bf16 the avx512 one, avx512
    without BF16 the avx2 one; a set whose build this CPU cannot execute, or no set, gets the fastest it can."""
    monkeypatch.setattr(fp8, "executable_builds", lambda: ("avx512", "avx2", "generic"))
    assert [fp8.build_for(i) for i in ("amx", "avx512bf16", "avx512", "avx2", "generic")] == [
        "avx512", "avx512", "avx2", "avx2", "generic"]
    assert fp8.build_for(None) == fp8.build_for("none") == "avx512"
    monkeypatch.setattr(fp8, "executable_builds", lambda: ("avx2", "generic"))  # an AVX2-only CPU
    assert [fp8.build_for(i) for i in ("amx", "avx2", None)] == ["avx2", "avx2", "avx2"]


# ---- --quantize-head fp8 ---------------------------------------------------------------------------------------

def test_quantize_head_fp8_logits_and_bits(ext, fp8_dir):
    """--quantize-head fp8: the head is quantize_fp8 of the bf16 head (the rule of a -FP8 checkpoint's linears), its
    product is the torch reference's up to fp32 rounding, each row's bits are the same alone and in a batch, and the
    logits stay within FP8's rounding of the bf16 head's (relative RMS < 0.06, the same argmax nearly everywhere;
    docs/fp8.md). tiny is tied: the quantized head is its embedding too (no bf16 copy held), the lookups reading its
    rows dequantized, so the model's logits are those of the same model given a table of those rows (the only
    other change: the table's rounding, whose effect docs/fp8.md states). Both a bf16 and a block-FP8 checkpoint
    take it."""
    from deltaserve.embedded.model import ensure_model
    from deltaserve.model.loader import load_model
    from deltaserve.model.ops.fp8 import row_scales

    rel = lambda a, b: ((a - b).pow(2).mean() / b.pow(2).mean()).sqrt().item()
    for d in (ensure_model("tiny"), fp8_dir):
        plain, m = load_model(d), load_model(d, quantize_head="fp8")
        head, V = m.packed_head, m.config.vocab_size
        assert isinstance(head, Fp8Weight) and head.packed is not None and m.embed_tokens is None
        bf16 = plain.embed(torch.arange(V))
        assert head.shape == tuple(bf16.shape) and m.linear_kind == plain.linear_kind
        q, s = quantize_fp8(bf16)
        assert torch.equal(m.embed(torch.arange(V)).view(torch.int16),  # the lookups: the head's rows dequantized
                           dequantize_fp8(q, s).view(torch.int16))
        h = rand(41, m.config.hidden_size, seed=5).bfloat16()
        y = m.compute_logits(h)
        ref = linear_fp8_reference(h, q, row_scales(s, q.shape[0])).float()
        torch.testing.assert_close(y, ref, atol=2e-2, rtol=1e-2)
        for i in (0, 7, 8, 40):
            assert torch.equal(m.compute_logits(h[i:i + 1])[0], y[i])
        ids = torch.randint(10, 4000, (300,), generator=torch.Generator().manual_seed(0)).tolist()
        y8, yb = prefill_logits(m, ids), prefill_logits(plain, ids)
        m.embed_tokens = torch.nn.Parameter(dequantize_fp8(q, s), requires_grad=False)  # a table of those rows
        assert torch.equal(prefill_logits(m, ids), y8)
        m.embed_tokens = torch.nn.Parameter(bf16, requires_grad=False)  # the bf16 table: the head's rounding alone
        yh = prefill_logits(m, ids)
        agree = lambda a: (a.argmax(-1) == yb.argmax(-1)).float().mean().item()
        print(f"{os.path.basename(d)}: head alone rel RMS {rel(yh, yb):.3f}, same argmax {agree(yh):.0%}; head and "
              f"table {rel(y8, yb):.3f}, {agree(y8):.0%}")  # docs/fp8.md quotes them
        assert rel(yh, yb) < 0.06, rel(yh, yb)
        assert (yh.argmax(-1) == yb.argmax(-1)).float().mean() > 0.9


def test_quantize_head_fp8_serves_and_hits_bit_for_bit(ext):
    """An engine with --quantize-head fp8 generates, and a prefix-cache hit gives the cold run's tokens."""
    from deltaserve.engine.llm import LLM
    from deltaserve.engine.sampling_params import SamplingParams

    llm = LLM(quantize_head="fp8", kv_cache_memory=64 << 20)
    assert isinstance(llm.engine.model.packed_head, Fp8Weight)
    prompt = {"prompt_token_ids": list(range(20, 300))}
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    cold, hit = (llm.generate([prompt], sp, use_tqdm=False)[0] for _ in range(2))
    assert hit.num_cached_tokens >= 256 and hit.outputs[0].token_ids == cold.outputs[0].token_ids


def test_quantize_head_refusals():
    from deltaserve.config import EngineConfig
    from deltaserve.embedded.model import ensure_model
    from deltaserve.model.loader import load_model

    with pytest.raises(ConfigError, match="--quantize-head must be one of none, fp8, int4"):
        EngineConfig(quantize_head="int3")
    with pytest.raises(ConfigError, match="one rank only"):
        EngineConfig(quantize_head="fp8", tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="needs bf16 weights on the CPU"):
        load_model(ensure_model("tiny"), dtype="float32", quantize_head="fp8")


def test_quantize_in_bands_gives_the_bytes_of_the_whole(monkeypatch):
    """quantize_fp8 works a band of block rows at a time (its fp32 temporaries bounded, not several copies of a
    vocabulary-sized head): the codes and scales are those of the whole tensor at once, with ragged last blocks."""
    w = rand(700, 300, seed=5, scale=0.05)
    w[130:140] = 0  # rows of zeros inside a block: its scale from the other rows
    whole = quantize_fp8(w)
    monkeypatch.setattr(fp8, "QUANTIZE_BAND_BYTES", 128 * 3 * 128 * 4 * 2)  # two block rows a band
    banded = quantize_fp8(w)
    assert whole[0].dtype == banded[0].dtype == fp8.FP8 and whole[0].shape == (700, 300)
    assert torch.equal(whole[0].view(torch.uint8), banded[0].view(torch.uint8))
    assert torch.equal(whole[1], banded[1]) and banded[1].shape == (6, 3)
