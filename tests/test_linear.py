"""The compiled bf16 linear (ops/csrc/linear_bf16.cpp through ops/linear.py) against the fp32 reference on
awkward shapes (outputs not a multiple of 16, one k pair, row counts around the 8-row tile), bit-for-bit batch
and thread-count invariance, and the fallbacks (odd input dim -> oneDNN, fp32 -> F.linear)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deltaserve.model.ops import cpu_kernels
from deltaserve.model.ops.linear import PackedWeight, linear


@pytest.fixture(scope="module", params=cpu_kernels.ISAS)
def ext(request):
    """The compiled kernels of each instruction set this CPU executes (avx512bf16: vdpbf16ps; avx512, avx2:
    bf16 widened to fp32); a set it cannot execute skips, saying which."""
    why = cpu_kernels.cannot_execute(request.param)
    if why:
        pytest.skip(why)
    try:
        mod = cpu_kernels.load_extension(request.param)
    except Exception as e:  # noqa: BLE001 - no compiler here: oneDNN's packing is what runs
        pytest.skip(f"C++ kernels unavailable: {e}")
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
    x = rand(41, K, seed=4)
    full = linear(x, pw)
    for m in (0, 7, 8, 9, 40):
        assert torch.equal(linear(x[m:m + 1], pw)[0], full[m])
    assert torch.equal(linear(x[5:22], pw), full[5:22])
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = linear(x, pw)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(one, full)


def test_fallbacks_and_errors(ext):
    odd = PackedWeight(rand(32, 33, seed=5), ext)
    assert odd.kind == "onednn"  # the kernel pairs k: an odd input dim stays with oneDNN
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
    normal numbers every set this CPU executes gives the same bits, for decode and prefill row counts."""
    isas = [i for i in cpu_kernels.ISAS if cpu_kernels.cannot_execute(i) is None]
    if len(isas) < 2:
        pytest.skip(f"this CPU executes only {isas}: nothing to compare")
    try:
        mods = {i: cpu_kernels.load_extension(i) for i in isas}
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"C++ kernels unavailable: {e}")
    for N, K, M in [(17, 62, 1), (776, 256, 9), (300, 1030, 64)]:
        w, x = rand(N, K, seed=N), rand(M, K, seed=K)
        ys = {i: linear(x, PackedWeight(w, m)) for i, m in mods.items()}
        for i in isas[1:]:
            assert torch.equal(ys[i], ys[isas[0]]), (i, isas[0], N, K, M)


def test_odd_input_dim_without_onednn_bf16_stays_on_f_linear(ext, monkeypatch):
    """An AVX2-only CPU has no oneDNN bf16: a weight the compiled kernel cannot take (odd input dim) is kept
    as it is and runs through F.linear (its bits), instead of a oneDNN packing that would fall back slowly."""
    from deltaserve.model.ops import linear as linear_mod

    monkeypatch.setattr(linear_mod, "can_prepack", lambda dtype, device: False)
    w, x = rand(32, 33, seed=5), rand(4, 33, seed=6)
    pw = PackedWeight(w, ext)
    assert pw.kind == "plain"
    assert torch.equal(linear(x, pw), F.linear(x, w))
    assert PackedWeight(rand(32, 64, seed=7), ext).kind == "cpp"
