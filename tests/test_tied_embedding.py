"""A tied embedding held once: where the head is packed for the compiled linear_bf16, that packing is the
embedding too (ops/packed.py embedding_packed, the fused decode program's lookup), bit for bit the rows of the
weight it was packed from, and the model keeps no [V, H] copy beside it; where the head is quantized
(--quantize-head fp8 / int4), the lookups read its rows dequantized (embedding_fp8 / embedding_int4), bit for bit
the dequantized weight's rows, from every build's packing."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deltaserve.model.ops import cpu_kernels
from deltaserve.model.ops import fp8
from deltaserve.model.ops.int4 import Int4Weight, embedding_int4
from deltaserve.model.ops.packed import PackedWeight, embedding_packed
from tests.util import make_llm, run, signature


@pytest.fixture(scope="module", params=cpu_kernels.ISAS)
def ext(request):
    why = cpu_kernels.cannot_execute(request.param)
    if why:
        pytest.skip(why)
    return cpu_kernels.load_extension(request.param)


@pytest.mark.parametrize("V,H", [(1, 2), (17, 64), (1000, 96), (4096, 256)])
def test_rows_read_from_the_packing_are_the_embeddings(ext, V, H):
    w = torch.randn(V, H, generator=torch.Generator().manual_seed(V)).to(torch.bfloat16)
    pw = PackedWeight(w, ext)
    ids = torch.tensor([0, V - 1, V // 2, 0, V - 1], dtype=torch.long)
    got = embedding_packed(ids, pw)
    assert torch.equal(got.view(torch.int16), F.embedding(ids, w).view(torch.int16))  # the bits, -0.0 and all
    assert embedding_packed(ids.view(1, -1), pw).shape == (1, 5, H)
    with pytest.raises(IndexError, match=f"outside the vocabulary of {V}"):
        embedding_packed(torch.tensor([V]), pw)


@pytest.mark.parametrize("build", fp8.BUILDS)
@pytest.mark.parametrize("V,H", [(1, 32), (17, 64), (1000, 96), (300, 200), (4099, 256)])
def test_rows_read_from_a_quantized_head_are_its_dequantized_rows(build, V, H):
    """embedding_int4 (groups of 32 and 128, a partial last group) and embedding_fp8 (partial 128-k blocks and
    k pairs) give dequantize's rows bit for bit, from the unpacked codes and from each build's packing (the AVX2
    build packs fp8 k-major, the others in the AVX-512 lane order); an id past the vocabulary is an IndexError."""
    if build not in fp8.executable_builds():
        pytest.skip(f"this CPU does not execute the {build} build")
    ext = fp8.load_fp8_extension(build)
    w = torch.randn(V, H, generator=torch.Generator().manual_seed(V)).to(torch.bfloat16)
    ids = torch.tensor([[0, V - 1, V // 2], [min(16, V - 1), 0, V - 1]])
    bits = lambda t: t.reshape(-1, H).view(torch.int16)
    for group in (32, 128):
        iw = Int4Weight.quantize(w, group, sym=False)
        want = iw.dequantize(torch.bfloat16)[ids.reshape(-1)]
        assert torch.equal(bits(embedding_int4(ids, iw)), bits(want))
        iw.pack(ext)
        got = embedding_int4(ids, iw)
        assert got.shape == (2, 3, H) and torch.equal(bits(got), bits(want))
    with pytest.raises(IndexError, match=f"outside the vocabulary of {V}"):
        embedding_int4(torch.tensor([V]), iw)
    fw = fp8.Fp8Weight.from_block_scales(*fp8.quantize_fp8(w))
    want = fw.dequantize(torch.bfloat16)[ids.reshape(-1)]
    assert torch.equal(bits(fp8.embedding_fp8(ids, fw)), bits(want))
    fw.pack(ext)
    got = fp8.embedding_fp8(ids, fw)
    assert got.shape == (2, 3, H) and torch.equal(bits(got), bits(want))
    with pytest.raises(IndexError, match=f"outside the vocabulary of {V}"):
        fp8.embedding_fp8(torch.tensor([-1]), fw)


@pytest.mark.parametrize("head", ["fp8", "int4"])
def test_a_quantized_tied_head_is_the_embedding_held_once(head, monkeypatch):
    """tiny (tied) with --quantize-head: no embed_tokens, the held bytes are the planner's (memory/resident.py
    weights_as_run: the quantized head in place of the bf16 table), and an engine generates the same tokens through
    the fused decode program (the staged lookups) as through the op-table path."""
    from deltaserve.config import ModelConfig
    from deltaserve.embedded.model import ensure_model
    from deltaserve.memory.resident import weights_as_run
    from deltaserve.model.loader import load_model
    import deltaserve.model.fused as fused

    path = ensure_model("tiny")
    model = load_model(path, vision=False, quantize_head=head)
    assert model.tied and model.embed_tokens is None and "embed_tokens" not in model.state_dict()
    mc = ModelConfig.from_path(path)
    assert model.held_weight_bytes()["total"] == weights_as_run(path, mc, "bfloat16", images=False,
                                                                  quantize_head=head)
    rng = torch.Generator().manual_seed(4)
    V = model.config.vocab_size
    prompts = [[int(t) for t in torch.randint(0, V, (n,), generator=rng)] for n in (40, 130)]
    sigs = []
    taken = []
    real = fused.decode_step
    for fused_on in (True, False):
        monkeypatch.setattr(fused, "decode_step", lambda *a: taken.append(real(*a)) or taken[-1] if fused_on else None)
        llm = make_llm(model=path, quantize_head=head)
        sigs.append([signature(o) for o in run(llm, prompts)])  # prefills, then decode steps
    assert sigs[0] == sigs[1]
    assert any(t is not None for t in taken) or not model.decode_kernels.compiled  # the program ran the decode steps
    # the staging rows grow with a step's rows: a new tensor, and the program is built again around it
    model.__dict__.pop("_embed_stage", None)
    first = fused.decode_program(model, 3)
    if first is not None:
        assert model._embed_stage.shape[0] == 64 and fused.decode_program(model, 64) is first
        assert fused.decode_program(model, 65) is not first and model._embed_stage.shape[0] == 128
        ids = torch.tensor([5, 0, V - 1])
        assert fused.stage_ids(model, ids).tolist() == [0, 1, 2]
        assert torch.equal(model._embed_stage[:3], model.embed(ids))


def test_a_loaded_tied_model_holds_its_embedding_once():
    """tiny (tied) loads with its head packed for the compiled linear and no embed_tokens; its embedding bytes are
    counted once; a decode step through the fused program (the packed lookup in C++) and a prefill step through
    the module path (embedding_packed) give the same tokens as a model whose embedding stayed unpacked."""
    from deltaserve.embedded.model import ensure_model
    from deltaserve.model.loader import load_model

    path = ensure_model("tiny")
    model = load_model(path, vision=False)
    if model.packed_head is None or model.packed_head.kind != "cpp":
        pytest.skip("no compiled linear_bf16 on this machine: the embedding stays as it is")
    assert model.tied and model.embed_tokens is None and "embed_tokens" not in model.state_dict()
    V, H = model.config.vocab_size, model.config.hidden_size
    held = model.held_weight_bytes()
    assert held["head"] == (V + 15) // 16 * 16 * H * 2  # the one copy, in "head"
    plain = load_model(path, vision=False, prepack=False)  # unpacked: embed_tokens and F.embedding
    assert plain.embed_tokens is not None
    ids = torch.arange(0, V, 37)
    assert torch.equal(model.embed(ids).view(torch.int16), plain.embed(ids).view(torch.int16))

    rng = torch.Generator().manual_seed(3)
    prompts = [[int(t) for t in torch.randint(0, V, (n,), generator=rng)] for n in (40, 200)]
    sigs = []
    for packed in (True, False):
        llm = make_llm(model=path)
        if not packed:  # the same engine with its embedding given back as a [V, H] tensor (F.embedding)
            llm.engine.model.embed_tokens = torch.nn.Parameter(plain.embed_tokens.detach().clone(),
                                                               requires_grad=False)
        sigs.append([signature(o) for o in run(llm, prompts)])  # prefills, then fused decode steps
    assert sigs[0] == sigs[1]


def test_packing_in_bands_gives_the_whole_packing(ext):
    """pack_in_bands (the loader streams a tied head through it): bf16, fp8 and int4 packings made band by band,
    several bands and a partial last one, have the bytes of the whole weight packed at once."""
    from deltaserve.model.ops.packed import pack_bf16_rows

    w = torch.randn(1000, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    rows = lambda r0, r1: w[r0:r1]  # noqa: E731
    assert torch.equal(pack_bf16_rows(rows, w.shape, ext, band=64).packed.view(torch.int16),
                       PackedWeight(w, ext).packed.view(torch.int16))
    q8 = fp8.load_fp8_extension(fp8.build_for(ext.kernel_isa()))
    a, b = fp8.quantize_fp8_packed(rows, w.shape, q8, band=256), fp8.Fp8Weight.from_block_scales(*fp8.quantize_fp8(w))
    b.pack(q8)
    assert torch.equal(a.packed, b.packed) and torch.equal(a.scales, b.scales) and torch.equal(a.row_scale, b.row_scale)
    from deltaserve.model.ops.int4 import quantize_int4_packed

    a, b = quantize_int4_packed(rows, w.shape, 128, False, q8, band=128), Int4Weight.quantize(w, 128, sym=False)
    b.pack(q8)
    assert a.shape == b.shape and torch.equal(a.packed, b.packed) and torch.equal(a.packed_scales, b.packed_scales)
    assert torch.equal(a.zeros, b.zeros) and torch.equal(a.scales, b.scales)
