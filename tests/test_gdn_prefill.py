"""The compiled chunked gated delta rule (ops/csrc/gdn_prefill.cpp, every x86 build) against the float64 token
loop (ops/gdn.py gated_delta_rule_reference) on awkward shapes, the torch path beside it; splits on the 64-token
grid and the states it hands out (states_at) bit for bit against one call; thread invariance; the fallbacks."""
from __future__ import annotations

import pytest
import torch

from deltaserve.model.ops import cpu_kernels
from deltaserve.model.ops.gdn import chunk_gated_delta_rule, gated_delta_rule_reference

COMPILED = ("avx512bf16", "avx512", "avx2")


@pytest.fixture(scope="module", params=COMPILED)
def kernels(request):
    why = cpu_kernels.cannot_execute(request.param)
    if why:
        pytest.skip(why)
    k = cpu_kernels.select_decode_kernels("cpu", torch.bfloat16, "cpp", request.param)
    assert k.gdn_prefill_compiled
    return k


def data(L, hk, H, dk, dv, seed):
    g_ = torch.Generator().manual_seed(seed)
    q = torch.randn(L, hk, dk, generator=g_).to(torch.bfloat16)
    k = torch.randn(L, hk, dk, generator=g_).to(torch.bfloat16)
    v = torch.randn(L, H, dv, generator=g_).to(torch.bfloat16)
    g = -torch.rand(L, H, generator=g_) * 0.4
    beta = torch.rand(L, H, generator=g_).to(torch.bfloat16)
    return q, k, v, g, beta


@pytest.mark.parametrize("L,start", [(1, 0), (63, 0), (64, 0), (65, 0), (100, 37), (130, 64), (200, 5)])
@pytest.mark.parametrize("hk,H,dk,dv", [(1, 1, 64, 64), (2, 4, 64, 64), (4, 8, 128, 128), (2, 2, 64, 128)])
@pytest.mark.parametrize("initial", [False, True])
def test_matches_the_token_loop(kernels, L, start, hk, H, dk, dv, initial):
    q, k, v, g, beta = data(L, hk, H, dk, dv, seed=L + start + dk)
    s0 = torch.randn(H, dv, dk, generator=torch.Generator().manual_seed(3)) * 0.1 if initial else None
    out, state = kernels.chunk_gated_delta_rule(q, k, v, g, beta, s0, start_pos=start)
    ref_out, ref_state = gated_delta_rule_reference(q, k, v, g, beta, s0, compute_dtype=torch.float64)
    assert out.shape == (L, H, dv) and out.dtype == torch.bfloat16 and state.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, atol=2e-2, rtol=2e-2)  # bf16 output
    torch.testing.assert_close(state.double(), ref_state, atol=1e-5, rtol=1e-5)
    _, t_state = chunk_gated_delta_rule(q, k, v, g, beta, s0, start_pos=start)  # the torch path, same tolerance
    torch.testing.assert_close(t_state.double(), ref_state, atol=1e-5, rtol=1e-5)
    if s0 is not None:
        assert torch.equal(s0, torch.randn(H, dv, dk, generator=torch.Generator().manual_seed(3)) * 0.1)  # untouched


def test_splits_on_the_grid_and_states_at_are_bit_exact(kernels):
    """A sequence in one call, or cut at multiples of 64 with the state carried: the same bits; the states handed
    out inside a call are the ones a call stopping there returns (the checkpoints the cache stores)."""
    q, k, v, g, beta = data(330, 2, 4, 64, 64, seed=11)
    states: list = []
    out, final = kernels.chunk_gated_delta_rule(q, k, v, g, beta, None, 0, states_at=(256, 128), states=states)
    state, parts, a = None, [], 0
    for b in (64, 128, 256, 330):
        o, state = kernels.chunk_gated_delta_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], state, a)
        parts.append(o)
        if b == 128:
            assert torch.equal(state, states[0])
        if b == 256:
            assert torch.equal(state, states[1])
        a = b
    assert torch.equal(torch.cat(parts), out) and torch.equal(state, final)


def test_writes_into_out_views_and_reads_strided_inputs(kernels):
    q, k, v, g, beta = data(90, 2, 4, 64, 64, seed=5)
    wide = torch.cat([q, k], dim=1)  # [L, 4, 64]: q and k as strided views of one tensor
    core = torch.zeros(90, 4, 64, dtype=torch.bfloat16)
    ref, _ = kernels.chunk_gated_delta_rule(q, k, v, g, beta)
    got, _ = kernels.chunk_gated_delta_rule(wide[:, :2], wide[:, 2:], v, g, beta, out=core)
    assert got.data_ptr() == core.data_ptr() and torch.equal(core, ref)


def test_thread_count_does_not_change_bits(kernels):
    q, k, v, g, beta = data(200, 4, 8, 128, 128, seed=2)
    threads = torch.get_num_threads()  # the suite's workers run on one thread each (conftest.py): set both here
    try:
        torch.set_num_threads(1)
        one = kernels.chunk_gated_delta_rule(q, k, v, g, beta)
        torch.set_num_threads(2)
        two = kernels.chunk_gated_delta_rule(q, k, v, g, beta)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


def test_refuses_bad_states_at(kernels):
    q, k, v, g, beta = data(100, 1, 1, 64, 64, seed=1)
    with pytest.raises(ValueError, match="not chunk boundaries"):
        kernels.chunk_gated_delta_rule(q, k, v, g, beta, states_at=(32,), states=[])
    with pytest.raises(ValueError, match="needs a `states` list"):
        kernels.chunk_gated_delta_rule(q, k, v, g, beta, states_at=(64,))


@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
def test_other_calls_take_the_torch_path(isa):
    """fp32, no qk l2norm, or a head dim the kernel does not take: the torch path's exact bits, on every set."""
    why = cpu_kernels.cannot_execute(isa)
    if why:
        pytest.skip(why)
    kernels = cpu_kernels.select_decode_kernels("cpu", torch.bfloat16, "cpp", isa)
    assert kernels.gdn_prefill_compiled == (isa in ("amx", *COMPILED))
    q, k, v, g, beta = data(70, 2, 4, 64, 64, seed=4)
    cases = [((q.float(), k.float(), v.float(), g, beta.float()), {}), ((q, k, v, g, beta), {"use_qk_l2norm": False}),
             ((q[..., :32], k[..., :32], v, g, beta), {})]
    for args, kw in cases:
        got = kernels.chunk_gated_delta_rule(*args, **kw)
        want = chunk_gated_delta_rule(*args, **kw)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
