"""Each model op against its reference (and transformers' own code where it exists), on awkward shapes,
plus the bit-exactness properties the prefix cache relies on (chunk grid, tiles, batch invariance)."""
from __future__ import annotations

import pytest
import torch

from deltaserve.model.ops import gdn as gdn_mod
from deltaserve.model.ops.attention import (
    apply_rotary,
    attention_reference,
    decode_attention,
    kv_gather,
    kv_write,
    page_slots,
    prefill_attention,
    rotary_cos_sin,
    rotary_inv_freq,
)
from deltaserve.model.ops.conv import (
    causal_conv1d_prefill,
    causal_conv1d_reference,
    causal_conv1d_step,
)
from deltaserve.model.ops.gdn import (
    chunk_gated_delta_rule,
    gated_delta_rule_reference,
    recurrent_gated_delta_rule_step,
)
from deltaserve.model.ops.mlp import moe, moe_reference, swiglu, swiglu_reference
from deltaserve.model.ops.norm import rms_norm, rms_norm_gated

LENGTHS = [1, 63, 65, 1000]


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def gdn_inputs(L, H=4, Hk=2, dk=32, dv=16, seed=0, dtype=torch.float32):
    g = gen(seed)
    q = torch.randn(L, Hk, dk, generator=g).to(dtype)
    k = torch.randn(L, Hk, dk, generator=g).to(dtype)
    v = torch.randn(L, H, dv, generator=g).to(dtype)
    decay = -torch.rand(L, H, generator=g) * 0.3  # log decay <= 0, fp32 as the model computes it
    beta = torch.rand(L, H, generator=g).to(dtype)
    return q, k, v, decay, beta


def rand_state(H=4, dv=16, dk=32, seed=1):
    return torch.randn(H, dv, dk, generator=gen(seed)) * 0.2


# ---- norms ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norms_match_transformers(dtype):
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        Qwen3_5RMSNorm,
        Qwen3_5RMSNormGated,
    )

    g = gen()
    x = (torch.randn(37, 5, 48, generator=g) * 3).to(dtype)
    z = torch.randn(37, 5, 48, generator=g).to(dtype)
    w = (torch.randn(48, generator=g) * 0.5).to(dtype)
    ref = Qwen3_5RMSNorm(48, eps=1e-6).to(dtype)
    ref.weight.data.copy_(w)
    refg = Qwen3_5RMSNormGated(48, eps=1e-6).to(dtype)
    refg.weight.data.copy_(w)
    with torch.no_grad():
        assert torch.equal(rms_norm(x, w, 1e-6), ref(x))
        # the gate's silu is the position-independent one (pointwise.py): equal up to its last-bit rounding
        tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1e-2}
        torch.testing.assert_close(rms_norm_gated(x, z, w, 1e-6), refg(x, z), **tol)


# ---- position-independent activations ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activations_do_not_depend_on_position(dtype):
    """An element's activation is the same whatever tensor it sits in (batch invariance needs this)."""
    import torch.nn.functional as F

    from deltaserve.model.ops.pointwise import sigmoid, silu, softplus

    x = (torch.randn(40000, generator=gen()) * 6).to(dtype)
    for fn, ref in ((sigmoid, torch.sigmoid), (silu, F.silu), (softplus, F.softplus)):
        whole = fn(x)
        assert torch.equal(torch.cat([fn(x[i:i + 1]) for i in range(100)]), whole[:100])
        assert torch.equal(torch.cat([fn(x[i:i + 37]) for i in range(0, 3700, 37)]), whole[:3700])
        assert torch.equal(fn(x[7:39999]), whole[7:39999])
        torch.testing.assert_close(whole.float(), ref(x.float()).to(dtype).float(), atol=1e-6, rtol=1e-2)


# ---- conv ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("L", LENGTHS)
def test_conv_prefill_matches_reference(L):
    g = gen(L)
    C, K = 40, 4
    x, w = torch.randn(L, C, generator=g), torch.randn(C, K, generator=g)
    state = torch.randn(K - 1, C, generator=g)
    out, new = causal_conv1d_prefill(x, w, state)
    ref, ref_new = causal_conv1d_reference(x, w, state)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(new, ref_new)
    assert torch.equal(new, torch.cat([state, x])[-(K - 1):])


def test_conv_matches_transformers():
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn

    g = gen()
    x, w = torch.randn(65, 24, generator=g), torch.randn(24, 4, generator=g)
    ref = causal_conv1d_fn(x.t()[None], w, None, activation="silu")[0].t()
    torch.testing.assert_close(causal_conv1d_prefill(x, w)[0], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_prefill_equals_steps_and_splits(dtype):
    g = gen(3)
    L, C, K = 70, 24, 4
    x, w = torch.randn(L, C, generator=g).to(dtype), torch.randn(C, K, generator=g).to(dtype)
    whole, whole_state = causal_conv1d_prefill(x, w)
    # token by token through the decode step, batched with another sequence
    states = torch.zeros(2, K - 1, C, dtype=dtype)
    other = torch.randn(L, C, generator=g).to(dtype)
    steps = [causal_conv1d_step(torch.stack([other[t], x[t]]), w, states)[1] for t in range(L)]
    assert torch.equal(torch.stack(steps), whole)
    assert torch.equal(states[1], whole_state)
    # split anywhere (including a piece shorter than the window), state carried
    a, sa = causal_conv1d_prefill(x[:2], w)
    b, sb = causal_conv1d_prefill(x[2:37], w, sa)
    c, sc = causal_conv1d_prefill(x[37:], w, sb)
    assert torch.equal(torch.cat([a, b, c]), whole) and torch.equal(sc, whole_state)


# ---- gated delta rule ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("L", LENGTHS)
def test_chunked_gdn_matches_token_loop(L):
    args = gdn_inputs(L, seed=L)
    s0 = rand_state()
    out, state = chunk_gated_delta_rule(*args, initial_state=s0)
    ref, ref_state = gated_delta_rule_reference(*args, initial_state=s0, compute_dtype=torch.float64)
    assert out.dtype == torch.float32 and state.dtype == torch.float32 and state.shape == (4, 16, 32)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.double(), ref_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("start_pos", [0, 5, 63, 64, 130])
def test_chunked_gdn_any_start_matches_token_loop(start_pos):
    args = gdn_inputs(200, seed=start_pos)
    s0 = rand_state()
    out, state = chunk_gated_delta_rule(*args, initial_state=s0, start_pos=start_pos)
    ref, ref_state = gated_delta_rule_reference(*args, initial_state=s0, compute_dtype=torch.float64)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.double(), ref_state, atol=1e-5, rtol=1e-5)


def test_chunked_gdn_matches_transformers():
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        torch_chunk_gated_delta_rule,
    )

    q, k, v, g, beta = gdn_inputs(300, seed=7)
    s0 = rand_state()
    ref, ref_state = torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], initial_state=s0.transpose(-1, -2)[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, state = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    torch.testing.assert_close(out, ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, ref_state[0].transpose(-1, -2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_gdn_split_on_grid_is_bit_identical(dtype):
    args = gdn_inputs(300, seed=11, dtype=dtype)
    s0 = rand_state()
    whole, whole_state = chunk_gated_delta_rule(*args, initial_state=s0)
    for cuts in ([64], [128], [64, 192], [128, 256]):
        outs, state, prev = [], s0, 0
        for c in cuts + [300]:
            o, state = chunk_gated_delta_rule(*(x[prev:c] for x in args), initial_state=state, start_pos=prev)
            outs.append(o)
            prev = c
        assert torch.equal(torch.cat(outs), whole), cuts
        assert torch.equal(state, whole_state), cuts


def test_chunked_gdn_split_off_grid_is_close():
    args = gdn_inputs(300, seed=12)
    whole, whole_state = chunk_gated_delta_rule(*args)
    a, sa = chunk_gated_delta_rule(*(x[:37] for x in args))
    b, sb = chunk_gated_delta_rule(*(x[37:] for x in args), initial_state=sa, start_pos=37)
    torch.testing.assert_close(torch.cat([a, b]), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sb, whole_state, atol=1e-5, rtol=1e-5)


def test_chunked_gdn_slices_do_not_change_bits(monkeypatch):
    """Long inputs run in slices anchored at absolute multiples of SLICE; the slice size never changes bits."""
    args = gdn_inputs(700, seed=13)
    big = chunk_gated_delta_rule(*args)
    monkeypatch.setattr(gdn_mod, "SLICE", 128)
    small = chunk_gated_delta_rule(*args)
    part1 = chunk_gated_delta_rule(*(x[:320] for x in args))
    part2 = chunk_gated_delta_rule(*(x[320:] for x in args), initial_state=part1[1], start_pos=320)
    assert torch.equal(big[0], small[0]) and torch.equal(big[1], small[1])
    assert torch.equal(torch.cat([part1[0], part2[0]]), big[0]) and torch.equal(part2[1], big[1])


@pytest.mark.parametrize("slice_", [1024, 128])
def test_chunked_gdn_states_inside_a_call_equal_the_states_of_split_calls(monkeypatch, slice_):
    """states_at gives the state after each grid position inside one call, bit for bit the state that a call
    stopping there returns (what a checkpoint taken inside a prefill chunk relies on), whatever the start
    offset, slice size, and with positions at slice ends and at the call's end."""
    monkeypatch.setattr(gdn_mod, "SLICE", slice_)
    args = gdn_inputs(731, seed=17)  # positions 37 .. 767
    init = rand_state(seed=4)
    start = 37  # an offset into the 64-token grid
    at = (64, 128, 320, 384, 704, 768)
    got: list = []
    out, final = chunk_gated_delta_rule(*args, initial_state=init, start_pos=start, states_at=at, states=got)
    assert len(got) == len(at)
    for p, st in zip(at, got):
        n = p - start
        ref = chunk_gated_delta_rule(*(x[:n] for x in args), initial_state=init, start_pos=start)[1]
        assert torch.equal(st, ref), p
    assert torch.equal(got[-1], final) and torch.equal(out, chunk_gated_delta_rule(*args, initial_state=init,
                                                                                    start_pos=start)[0])
    with pytest.raises(ValueError):
        chunk_gated_delta_rule(*args, start_pos=start, states_at=(100,), states=[])  # not on the grid
    with pytest.raises(ValueError):
        chunk_gated_delta_rule(*args, start_pos=start, states_at=(0,), states=[])  # not inside the call


def test_chunked_gdn_does_not_modify_initial_state():
    args = gdn_inputs(65)
    s0 = rand_state()
    keep = s0.clone()
    chunk_gated_delta_rule(*args, initial_state=s0)
    assert torch.equal(s0, keep)


def test_recurrent_step_matches_token_loop_and_is_batch_invariant():
    lengths = [1, 5, 17]
    seqs = [gdn_inputs(n, seed=20 + n) for n in lengths]
    inits = [rand_state(seed=30 + i) for i in range(len(lengths))]
    states = torch.stack(inits)  # [B, H, dv, dk]
    outs = [[] for _ in lengths]
    solo_states = [s.clone()[None] for s in inits]
    for t in range(max(lengths)):
        live = [i for i, n in enumerate(lengths) if t < n]  # a batch whose membership changes
        batch = [torch.stack([seqs[i][j][t] for i in live]) for j in range(5)]
        st = states[live]
        o = recurrent_gated_delta_rule_step(*batch, st)
        states[live] = st
        for row, i in enumerate(live):
            outs[i].append(o[row])
            solo = recurrent_gated_delta_rule_step(*(seqs[i][j][t:t + 1] for j in range(5)), solo_states[i])
            assert torch.equal(solo[0], o[row]) and torch.equal(solo_states[i][0], states[i])
    for i, n in enumerate(lengths):
        ref, ref_state = gated_delta_rule_reference(*seqs[i], initial_state=inits[i], compute_dtype=torch.float64)
        torch.testing.assert_close(torch.stack(outs[i]).double(), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(states[i].double(), ref_state, atol=1e-5, rtol=1e-5)


def test_recurrent_step_matches_transformers():
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        torch_recurrent_gated_delta_rule,
    )

    q, k, v, g, beta = gdn_inputs(3, seed=5)
    s0 = torch.stack([rand_state(seed=i) for i in range(3)])
    ref, ref_state = torch_recurrent_gated_delta_rule(
        q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], initial_state=s0.transpose(-1, -2),
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    state = s0.clone()
    out = recurrent_gated_delta_rule_step(q, k, v, g, beta, state)
    torch.testing.assert_close(out, ref[:, 0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(state, ref_state.transpose(-1, -2), atol=1e-6, rtol=1e-5)


# ---- attention -----------------------------------------------------------------------------------------------

def test_rotary_matches_transformers():
    from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

    g = gen()
    T, H, D, R = 9, 3, 32, 8
    q, k = torch.randn(T, H, D, generator=g), torch.randn(T, 2, D, generator=g)
    pos = torch.arange(100, 100 + T)
    cos, sin = rotary_cos_sin(pos, rotary_inv_freq(R, 1e6), torch.float32)
    rq, rk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    assert torch.equal(apply_rotary(q, cos, sin), rq[0].transpose(0, 1))
    assert torch.equal(apply_rotary(k, cos, sin), rk[0].transpose(0, 1))


@pytest.mark.parametrize("R", [8, 32, 64])
def test_rotary_table_values_depend_only_on_the_position(R):
    """The model's table (RotaryTable) holds rotary_cos_sin's values, block by block: a position's cos / sin are
    the same whatever else a step looks up and however far the table grew before."""
    from deltaserve.model.ops.attention import RotaryTable

    inv = rotary_inv_freq(R, 1e6)
    block = RotaryTable.BLOCK
    grown, whole = RotaryTable(inv, torch.bfloat16), RotaryTable(inv, torch.bfloat16)
    for end in (3, block + 5, 2 * block + 1):  # grown in three steps against made at once
        grown(torch.arange(end), end)
    whole(torch.arange(2 * block + 1), 2 * block + 1)
    assert torch.equal(grown.cos, whole.cos) and torch.equal(grown.sin, whole.sin)
    pos = torch.tensor([block + 4, 7, 0, block - 1])
    cos, sin = grown(pos, 2 * block + 1)
    for i, p in enumerate(pos.tolist()):
        a, b = grown(torch.tensor([p]), p + 1)
        assert torch.equal(a[0], cos[i]) and torch.equal(b[0], sin[i])
        start = p // block * block  # the block it was made in, made on its own
        c, s = rotary_cos_sin(torch.arange(start, start + block), inv, torch.bfloat16)
        assert torch.equal(cos[i], c[p - start]) and torch.equal(sin[i], s[p - start])
    ref_c, ref_s = rotary_cos_sin(pos, inv, torch.float32)
    torch.testing.assert_close(cos.float(), ref_c, atol=2 ** -8, rtol=0)
    torch.testing.assert_close(sin.float(), ref_s, atol=2 ** -8, rtol=0)


def paged_sequence(L, Hkv=2, D=16, bs=16, seed=0, num_pages=None):
    """K/V of one sequence written into a shuffled page table; returns (kv pool, page table, k, v)."""
    g = gen(seed)
    k, v = torch.randn(L, Hkv, D, generator=g), torch.randn(L, Hkv, D, generator=g)
    n = -(-L // bs)
    num_pages = num_pages or n + 5
    kv = torch.full((num_pages, 2, bs, Hkv, D), float("nan"))  # unwritten rows never read
    pages = torch.randperm(num_pages, generator=g)[:n]
    p, r = page_slots(pages, torch.arange(L), bs)
    kv_write(kv, p, r, k, v)
    return kv, pages, k, v


@pytest.mark.parametrize("L", LENGTHS)
def test_paged_prefill_attention_equals_contiguous_reference(L):
    kv, pages, k, v = paged_sequence(L, seed=L)
    keys, values = kv_gather(kv, pages, L)
    assert torch.equal(keys, k) and torch.equal(values, v)
    q = torch.randn(L, 4, 16, generator=gen(L + 1))
    out = prefill_attention(q, keys, values, 0, 0.25)
    torch.testing.assert_close(out, attention_reference(q, k, v, 0, 0.25), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pos", [1, 63, 65, 128])
def test_prefill_attention_with_cached_prefix(pos):
    L = 300
    kv, pages, k, v = paged_sequence(L, seed=pos)
    keys, values = kv_gather(kv, pages, L)
    q = torch.randn(L - pos, 4, 16, generator=gen(pos))
    out = prefill_attention(q, keys, values, pos, 0.25)
    torch.testing.assert_close(out, attention_reference(q, k, v, pos, 0.25), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_tiles_make_grid_chunks_bit_identical(dtype):
    L = 300
    g = gen(9)
    q = torch.randn(L, 4, 16, generator=g).to(dtype)
    k, v = torch.randn(L, 2, 16, generator=g).to(dtype), torch.randn(L, 2, 16, generator=g).to(dtype)
    whole = prefill_attention(q, k, v, 0, 0.25)
    for cut in (64, 128, 256):
        first = prefill_attention(q[:cut], k[:cut], v[:cut], 0, 0.25)  # keys only as far as the chunk
        second = prefill_attention(q[cut:], k, v, cut, 0.25)
        assert torch.equal(torch.cat([first, second]), whole), cut


@pytest.mark.parametrize("L", LENGTHS)
def test_decode_attention_matches_reference(L):
    kv, pages, k, v = paged_sequence(L, seed=L)
    keys, values = kv_gather(kv, pages, L)
    q = torch.randn(1, 4, 16, generator=gen(L))
    out = decode_attention(q[0], keys, values, 0.25)
    torch.testing.assert_close(out, attention_reference(q, k, v, L - 1, 0.25)[0], atol=1e-5, rtol=1e-5)


# ---- MLP / MoE -----------------------------------------------------------------------------------------------

def test_swiglu_matches_reference():
    g = gen()
    x = torch.randn(65, 32, generator=g)
    gate, up, down = (torch.randn(48, 32, generator=g) * 0.2, torch.randn(48, 32, generator=g) * 0.2,
                      torch.randn(32, 48, generator=g) * 0.2)
    torch.testing.assert_close(swiglu(x, torch.cat([gate, up]), down), swiglu_reference(x, gate, up, down),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm_topk", [True, False])
def test_moe_matches_dense_reference_and_transformers(norm_topk):
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        Qwen3NextSparseMoeBlock,
    )

    cfg = Qwen3NextConfig(hidden_size=32, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
                          shared_expert_intermediate_size=40, norm_topk_prob=norm_topk)
    block = Qwen3NextSparseMoeBlock(cfg).eval()
    g = gen(1)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x = torch.randn(63, 32, generator=g)
    e = block.experts
    args = (block.gate.weight, e.gate_up_proj, e.down_proj, 2, norm_topk,
            torch.cat([block.shared_expert.gate_proj.weight, block.shared_expert.up_proj.weight]),
            block.shared_expert.down_proj.weight, block.shared_expert_gate.weight)
    with torch.no_grad():
        out = moe(x, *args)
        ref = block(x[None])
        ref = (ref[0] if isinstance(ref, tuple) else ref)[0]
        torch.testing.assert_close(out, moe_reference(x, *args), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
