"""The compiled bf16 linear (ops/csrc/linear_bf16.cpp through ops/linear.py) against the fp32 reference on
awkward shapes (outputs not a multiple of 16, one k pair, row counts around the 8-row tile), bit-for-bit batch
and thread-count invariance, and the fallbacks (odd input dim -> oneDNN, fp32 -> F.linear). The amx set's
linear (ops/csrc/linear_bf16_amx.cpp) the same way around its 16-row tiles and 32-wide k chunks."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deltaserve.model.ops import cpu_kernels, packed
from deltaserve.model.ops.linear import linear
from deltaserve.model.ops.packed import PackedWeight
from tests.util import assert_linear_rows_batch_invariant


@pytest.fixture(scope="module", params=cpu_kernels.ISAS)
def ext(request):
    """The compiled kernels of each instruction set this CPU executes (amx: AMX tiles; avx512bf16: vdpbf16ps;
    avx512, avx2: bf16 widened to fp32); a set it cannot execute skips, saying which."""
    why = cpu_kernels.cannot_execute(request.param)
    if why:
        pytest.skip(why)
    mod = cpu_kernels.load_extension(request.param)  # a build error fails with the compiler's message
    assert mod.bf16_linear_available() and mod.kernel_isa() == request.param
    return mod


def rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.parametrize("N,K", [(1, 2), (15, 64), (16, 256), (17, 62), (100, 1030), (776, 256), (4099, 512)])
@pytest.mark.parametrize("M", [1, 7, 8, 9, 17, 64])
def test_matches_fp32_reference(ext, N, K, M):
    w, x = rand(N, K, seed=N + K), rand(M, K, seed=M)
    pw = PackedWeight(w, ext)
    assert pw.kind == "cpp" and pw.packed.shape == ((N + 15) // 16, K // 2, 16, 2)
    y = linear(x, pw)
    assert y.shape == (M, N) and y.dtype == torch.bfloat16
    ref = F.linear(x.float(), w.float())  # exact products, fp32 sums: ours differs by the sum order and one rounding
    torch.testing.assert_close(y.float(), ref, atol=1e-3 * K ** 0.5, rtol=8e-3)


def test_leading_dims_and_empty(ext):
    w = rand(40, 96, seed=1)
    pw = PackedWeight(w, ext)
    x = rand(3, 5, 96, seed=2)
    assert torch.equal(linear(x, pw), linear(x.reshape(15, 96), pw).view(3, 5, 40))
    assert linear(x[:0].reshape(0, 96), pw).shape == (0, 40)


@pytest.mark.parametrize("N,K", [(776, 256), (1000, 1024), (48, 3584)])
def test_rows_are_batch_and_thread_invariant(ext, N, K):
    """Each row alone, in any batch, at any thread count: the same bits."""
    pw = PackedWeight(rand(N, K, seed=3), ext)
    assert_linear_rows_batch_invariant(linear, rand(41, K, seed=4), pw)


def test_fallbacks_and_errors(ext):
    odd = PackedWeight(rand(32, 33, seed=5), ext)
    # the kernel pairs k: an odd input dim stays with oneDNN, or F.linear where oneDNN has no bf16 (AVX2 only)
    assert odd.kind == ("onednn" if packed.can_prepack(torch.bfloat16, torch.device("cpu")) else "plain")
    x = rand(4, 33, seed=6)
    torch.testing.assert_close(linear(x, odd).float(), F.linear(x.float(), rand(32, 33, seed=5).float()),
                               atol=3e-2, rtol=1e-2)
    pw = PackedWeight(rand(32, 64, seed=7), ext)
    with pytest.raises(RuntimeError, match="x must be"):
        linear(rand(4, 64, seed=8).float(), pw)
    with pytest.raises(RuntimeError, match="inputs"):
        linear(rand(4, 62, seed=8), pw)


def test_every_instruction_set_gives_the_same_bits():
    """The widened paths add each k pair as vdpbf16ps does (odd product, then even; exact products), so on
    normal numbers every vdpbf16ps-ordered set this CPU executes gives the same bits, for decode and prefill row
    counts. amx sums 32-wide k chunks its own way: the amx tests below hold it to the reference instead."""
    isas = [i for i in cpu_kernels.ISAS if i != "amx" and cpu_kernels.cannot_execute(i) is None]
    if len(isas) < 2:
        pytest.skip(f"this CPU executes only {isas}: nothing to compare")
    mods = {i: cpu_kernels.load_extension(i) for i in isas}
    for N, K, M in [(17, 62, 1), (776, 256, 9), (300, 1030, 64)]:
        w, x = rand(N, K, seed=N), rand(M, K, seed=K)
        ys = {i: linear(x, PackedWeight(w, m)) for i, m in mods.items()}
        for i in isas[1:]:
            assert torch.equal(ys[i], ys[isas[0]]), (i, isas[0], N, K, M)


def test_odd_input_dim_without_onednn_bf16_stays_on_f_linear(ext, monkeypatch):
    """An AVX2-only CPU has no oneDNN bf16: a weight the compiled kernel cannot take (odd input dim) is kept
    as it is and runs through F.linear (its bits), instead of a oneDNN packing that would fall back slowly."""
    monkeypatch.setattr(packed, "can_prepack", lambda dtype, device: False)
    w, x = rand(32, 33, seed=5), rand(4, 33, seed=6)
    pw = PackedWeight(w, ext)
    assert pw.kind == "plain"
    assert torch.equal(linear(x, pw), F.linear(x, w))
    assert PackedWeight(rand(32, 64, seed=7), ext).kind == "cpp"


# ---- the amx set: AMX tiles for every row count ----------------------------------------------------------

@pytest.fixture(scope="module")
def amx():
    """The amx set's kernels (the avx512bf16 build with linear_bf16 on AMX tiles), or a skip saying why this
    CPU or its kernel cannot run them (flags, or the tile-data permission refused)."""
    why = cpu_kernels.cannot_execute("amx")
    if why:
        pytest.skip(why)
    mod = cpu_kernels.load_extension("amx")
    assert mod.kernel_isa() == "amx" and mod.linear_bf16 is mod.base.linear_bf16_amx
    return mod


@pytest.mark.parametrize("K", [2, 30, 34, 64, 130, 1030])
@pytest.mark.parametrize("N", [1, 17, 100])
def test_amx_matches_the_rounded_reference(amx, N, K):
    """Rows around the 16-row tile and the 32-row block, outputs off the 16-column block, k off the 32-wide
    chunk (K < 32: the tail alone): within 2 bf16 units of the fp32 product rounded once (sum order and one
    rounding; atol for sums that cancel), and mostly equal to it."""
    w = rand(N, K, seed=N + K)
    pw = PackedWeight(w, amx)
    exact = 0
    for M in (1, 3, 15, 16, 17, 33, 100):
        x = rand(M, K, seed=M)
        y = linear(x, pw)
        assert y.shape == (M, N) and y.dtype == torch.bfloat16
        ref = (x.float() @ w.float().T).bfloat16()
        torch.testing.assert_close(y.float(), ref.float(), atol=1e-3 * K ** 0.5, rtol=8e-3)
        exact += int((y == ref).sum())
    assert exact >= 0.99 * N * (1 + 3 + 15 + 16 + 17 + 33 + 100)  # a rounding flips only near a tie (measured: <0.1%)


@pytest.mark.parametrize("N,K", [(17, 34), (100, 130), (48, 3584), (776, 1024)])
def test_amx_rows_are_batch_and_thread_invariant(amx, N, K):
    """A row alone (a one-row tile) has the same bits as inside a batch of any size, at any position (a tile of
    fewer than 16 rows, a full 16-row tile, the padded last tile, either tile of a 32-row block), beside other
    rows, on 1 or 2 threads (a thread's share of column blocks changes the block shapes, 1x3 / 1x2 / 2x2)."""
    pw = PackedWeight(rand(N, K, seed=3), amx)
    row = rand(1, K, seed=21)
    n = torch.get_num_threads()
    try:
        alone = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            alone[threads] = linear(row, pw)[0]
        assert torch.equal(alone[1], alone[2])
        for M in (2, 3, 15, 16, 17, 33, 100):
            others = rand(M, K, seed=100 + M)
            for pos in sorted({0, M // 2, M - 1, min(16, M - 1), min(31, M - 1)}):
                x = others.clone()
                x[pos] = row[0]
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    assert torch.equal(linear(x, pw)[pos], alone[1]), (M, pos, threads)
    finally:
        torch.set_num_threads(n)


def test_amx_tail_alone_is_vdpbf16ps_order(amx):
    """Below 32 inputs there is no AMX chunk: the K tail is added with vdpbf16ps in ascending pair order from
    zero, which is the avx512bf16 linear's order, so the bits are that linear's; from 32 inputs on they are
    AMX's own (and must still match the reference, above)."""
    vdp = cpu_kernels.load_extension("avx512bf16")
    for K in (2, 30):
        w, x = rand(100, K, seed=K), rand(33, K, seed=K + 1)
        assert torch.equal(linear(x, PackedWeight(w, amx)), linear(x, PackedWeight(w, vdp)))
    w, x = rand(776, 1024, seed=5), rand(64, 1024, seed=6)  # 50K outputs: some round the other way
    assert not torch.equal(linear(x, PackedWeight(w, amx)), linear(x, PackedWeight(w, vdp)))


@pytest.mark.parametrize("N,K", [(1, 2), (17, 62), (100, 1030), (4099, 512)])
def test_packing_is_the_documented_permutation(ext, N, K):
    """pack_bf16_weight: [N, K] -> [ceil(N/16), K/2, 16, 2], element [b, p, c, j] = w[16 b + c, 2 p + j], the rows
    past N zero; also from a non-contiguous weight."""
    w = rand(N, K, seed=N + K)
    nblk = -(-N // 16)
    ref = torch.zeros(nblk * 16, K, dtype=torch.bfloat16)
    ref[:N] = w
    ref = ref.view(nblk, 16, K // 2, 2).transpose(1, 2)
    assert torch.equal(ext.pack_bf16_weight(w).view(torch.int16), ref.contiguous().view(torch.int16))
    wide = rand(N, K + 6, seed=1)
    wide[:, :K] = w
    assert torch.equal(ext.pack_bf16_weight(wide[:, :K]).view(torch.int16), ref.contiguous().view(torch.int16))
