"""A tied embedding held once: where the head is packed for the compiled linear_bf16, that packing is the
embedding too (ops/packed.py embedding_packed, the fused decode program's lookup), bit for bit the rows of the
weight it was packed from, and the model keeps no [V, H] copy beside it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deltaserve.model.ops import cpu_kernels
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
