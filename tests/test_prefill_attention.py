"""The compiled prefill attention (ops/csrc/prefill_attention.cpp: the avx512bf16 build's vdpbf16ps, the avx512
and avx2 builds' widened fmas) against the plain fp32 reference (ops/attention.py attention_reference) on awkward shapes,
the torch path beside it; a row's bits independent of the chunk it came in, of the other rows and of the thread
count (bit for bit); the op table's choice between the two paths."""
from __future__ import annotations

import pytest
import torch

from deltaserve.model.ops import cpu_kernels
from deltaserve.model.ops.attention import attention_reference, prefill_attention


COMPILED = ("avx512bf16", "avx512", "avx2")  # the builds that hold it (the amx set loads avx512bf16's)


@pytest.fixture(scope="module", params=COMPILED)
def ext(request):
    """Each build that holds the compiled prefill attention; a set this CPU cannot execute skips, saying which."""
    why = cpu_kernels.cannot_execute(request.param)
    if why:
        pytest.skip(why)
    mod = cpu_kernels.load_extension(request.param)
    assert mod.prefill_attention_available()
    return mod


def qkv(n, pos, hq, hkv, d, seed, extra=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, hq, d, generator=g).to(torch.bfloat16)
    k = torch.randn(pos + n + extra, hkv, d, generator=g).to(torch.bfloat16)
    v = torch.randn(pos + n + extra, hkv, d, generator=g).to(torch.bfloat16)
    return q, k, v


# n around the 8-row work item and the 32-key block; pos inside and on block edges; GQA groups 1, 2, 4, 8
@pytest.mark.parametrize("n,pos", [(1, 0), (1, 31), (7, 0), (9, 1), (33, 0), (40, 32), (65, 63), (100, 200)])
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 128), (8, 2, 256), (2, 2, 64), (16, 2, 32), (3, 1, 96)])
def test_matches_fp32_reference(ext, n, pos, hq, hkv, d):
    q, k, v = qkv(n, pos, hq, hkv, d, seed=n * 1000 + pos + d, extra=5)  # rows past pos + n are never read
    scale = d ** -0.5
    ref = attention_reference(q, k, v, pos, scale).float()
    out = ext.prefill_attention(q, k, v, pos, scale)
    assert out.shape == (n, hq, d) and out.dtype == torch.bfloat16
    # bf16 probabilities and one bf16 rounding of the output, as the torch path (SDPA) has
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(prefill_attention(q, k, v, pos, scale).float(), ref, atol=2e-2, rtol=2e-2)


def test_strided_views_of_a_projection(ext):
    """q, k, v as views of one [T, width] projection (the layer's case: a fresh prefill reads them in place)."""
    T, hq, hkv, d = 50, 4, 2, 128
    proj = torch.randn(T, (2 * hq + 2 * hkv) * d, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    q = proj[:, :hq * d].view(T, hq, d)
    k = proj[:, 2 * hq * d:(2 * hq + hkv) * d].view(T, hkv, d)
    v = proj[:, (2 * hq + hkv) * d:].view(T, hkv, d)
    assert not k.is_contiguous()
    out = ext.prefill_attention(q, k, v, 0, 0.1)
    assert torch.equal(out, ext.prefill_attention(q.contiguous(), k.contiguous(), v.contiguous(), 0, 0.1))
    torch.testing.assert_close(out.float(), attention_reference(q, k, v, 0, 0.1).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("cuts", [(1,), (17,), (32, 33), (64, 100, 101, 150)])
def test_rows_do_not_depend_on_the_chunk(ext, cuts):
    """A sequence prefilled whole or in chunks cut anywhere (not only on a tile grid): the same bits per row,
    and a row alone equals that row inside any call (the hit == cold gates rest on it)."""
    n, hq, hkv, d = 160, 8, 2, 128
    q, k, v = qkv(n, 0, hq, hkv, d, seed=7)
    whole = ext.prefill_attention(q, k, v, 0, 0.09)
    parts, a = [], 0
    for b in (*cuts, n):
        parts.append(ext.prefill_attention(q[a:b], k, v, a, 0.09))
        a = b
    assert torch.equal(torch.cat(parts), whole)
    for p in (0, 31, 32, 97, 159):
        assert torch.equal(ext.prefill_attention(q[p:p + 1], k, v, p, 0.09)[0], whole[p])


def test_thread_count_does_not_change_bits(ext):
    q, k, v = qkv(300, 700, 4, 2, 128, seed=9)
    threads = torch.get_num_threads()  # the suite's workers run on one thread each (conftest.py): set both here
    try:
        torch.set_num_threads(1)
        one = ext.prefill_attention(q, k, v, 700, 0.09)
        torch.set_num_threads(2)
        two = ext.prefill_attention(q, k, v, 700, 0.09)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_refuses_what_it_cannot_do(ext):
    q, k, v = qkv(4, 0, 4, 2, 128, seed=1)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ext.prefill_attention(q.float(), k.float(), v.float(), 0, 0.1)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ext.prefill_attention(q[..., :48], k[..., :48], v[..., :48], 0, 0.1)
    with pytest.raises(RuntimeError, match="fewer than pos"):
        ext.prefill_attention(q, k, v, 1, 0.1)
    with pytest.raises(RuntimeError, match="Hkv dividing Hq"):
        ext.prefill_attention(q[:, :3], k, v, 0, 0.1)


@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
def test_op_table_takes_the_compiled_path_where_the_build_has_it(isa):
    """Each set's op table: the compiled kernel on every x86 build (amx loads avx512bf16's) for bf16 with a head
    dim that is a multiple of 32; the torch path (its exact bits) everywhere else."""
    why = cpu_kernels.cannot_execute(isa)
    if why:
        pytest.skip(why)
    kernels = cpu_kernels.select_decode_kernels("cpu", torch.bfloat16, "cpp", isa)
    assert kernels.prefill_attention_compiled == (isa in ("amx", *COMPILED))
    q, k, v = qkv(20, 3, 4, 2, 128, seed=2)
    got = kernels.prefill_attention(q, k, v, 3, 0.1)
    if kernels.prefill_attention_compiled:
        assert torch.equal(got, kernels.ext.prefill_attention(q, k, v, 3, 0.1))
    else:
        assert torch.equal(got, prefill_attention(q, k, v, 3, 0.1))
    for args in ((q.float(), k.float(), v.float()), (q[..., :48], k[..., :48], v[..., :48])):
        assert torch.equal(kernels.prefill_attention(*args, 3, 0.1), prefill_attention(*args, 3, 0.1))
