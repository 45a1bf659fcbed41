"""Int4 weights (docs/int4.md): the compiled linear_int4 (csrc/linear_int4.cpp) gives the torch reference's bits
(ops/int4.py linear_int4_reference: the kernel's own integer sums and fp32 steps) on every path of every build this
CPU executes, on awkward shapes (row counts around the tiles, N not a multiple of 16, K not a multiple of the group,
groups of 32 and 128, zero points); rows are batch- and thread-invariant bit for bit; the activations' int8 codes
equal the reference quantizer's; the format's meaning (every nibble, zeros, partial groups) is exact; --quantize int4
at load, the head in int4, the decode program, hit == cold, drafted == plain, and the logits' tolerance against the
bf16 model the weights were made from (measured, docs/int4.md)."""
from __future__ import annotations

import random

import pytest
import torch

from deltaserve.config import ConfigError, EngineConfig
from deltaserve.model.ops import fp8, int4
from deltaserve.model.ops.int4 import (Int4Weight, dequantize_int4, linear_int4_reference, quantize_activations,
                                       quantize_int4)
from deltaserve.model.ops.linear import linear
from util import (assert_linear_rows_batch_invariant, greedy, make_llm, prefill_logits, random_tokens, run,
                  signature)


@pytest.fixture(scope="module")
def ext():
    return fp8.load_fp8_extension()  # a build error fails with the compiler's message, never a skip


def build_paths() -> list[str]:
    """"build/path" for every int4 path of every build this CPU executes (avx512: vnni, amx where it may run, and
    scalar; avx2: avx-vnni where the CPU has AVX-VNNI, avx2 and scalar; generic: scalar)."""
    return [f"{b}/{p}" for b in fp8.executable_builds() for p in fp8.load_fp8_extension(b).int4_paths()]


def ext_path(build_path: str):
    build, path = build_path.split("/")
    return fp8.load_fp8_extension(build), path


def rand(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def weight(N, K, group, sym, seed):
    return Int4Weight(*quantize_int4(rand(N, K, seed=seed, scale=0.05), group, sym), group)


def packed(ext, w: Int4Weight, path: str) -> Int4Weight:
    p = Int4Weight(w.codes, w.zeros, w.scales, w.group)
    p.pack(ext, path)
    return p


SHAPES = [(1, 32), (15, 96), (17, 130), (16, 128), (33, 200), (130, 1024), (48, 3584 // 4)]
GROUPS = [(128, True), (32, False), (64, False), (256, False)]


def cases() -> list[tuple]:
    """(build/path, N, K, group, sym): every shape and group on each build's vector paths; the portable scalar loop,
    compiled once per build, on the first three shapes."""
    return [(bp, N, K, g, sym) for bp in build_paths()
            for N, K in (SHAPES[:3] if bp.endswith("scalar") else SHAPES) for g, sym in GROUPS]


@pytest.mark.parametrize("build_path,N,K,group,sym", cases())
def test_matches_the_reference_bit_for_bit(build_path, N, K, group, sym):
    e, path = ext_path(build_path)
    w = weight(N, K, group, sym, seed=N * 7 + K)
    p = packed(e, w, path)
    G = -(-K // group)
    assert p.packed.shape == (-(-N // 16), G, 16 + group * 8) and p.packed_scales.shape == (-(-N // 16), G, 16)
    for M in (1, 2, 3, 4, 5, 8, 9, 17, 33):  # the vector tiles' row counts and remainders; amx from 16 rows
        x = rand(M, K, seed=M + K).to(torch.bfloat16)
        y = linear(x, p)
        assert y.shape == (M, N) and y.dtype == torch.bfloat16
        assert torch.equal(y, linear_int4_reference(x, w.codes, w.zeros, w.scales, group)), (M, path)
    # and the product is the dequantized weight's within the activations' int8 rounding (docs/int4.md)
    x = rand(9, K, seed=1).to(torch.bfloat16)
    exact = x.float() @ w.dequantize(torch.float32).t()
    err = ((linear(x, p).float() - exact).norm() / exact.norm()).item()
    assert err < 0.02, err


def test_activation_codes_are_the_reference_quantizers(ext):
    """Ties, zeros rows, tiny and huge values, K not a multiple of 32: the kernel's int8 codes, scales and sums
    are quantize_activations' exactly."""
    x = rand(6, 100, seed=3) * torch.tensor([1e-30, 1.0, 1e4, 0.0, 3.0, 1.0])[:, None]
    x[5, :40] = torch.tensor([127.0, 63.5, -63.5, 0.5] * 10)  # halves after the division: round half to even
    x = x.to(torch.bfloat16)
    for kp, sub in ((128, 32), (160, 32), (128, 128), (256, 128), (192, 64)):
        got, want = ext.quantize_int8_rows(x, kp, sub), quantize_activations(x, kp, sub)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        q, s, total = want
        assert (q[3] == 0).all() and (s[3] == 0).all() and (q[:, 100:] == 0).all()
        assert torch.equal(total, q.view(6, -1, sub).sum(-1, dtype=torch.int32))


def test_the_format_means_what_it_says():
    """Every nibble position, zero points 0..16, a partial last group: dequantize_int4 is (code - zero) * scale,
    one fp32 product each, computed by a plain loop; quantize_int4 round-trips values on its grid exactly."""
    N, K, group = 3, 70, 32  # groups of 32, 32, 6
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    codes[0, :16] = torch.arange(16, dtype=torch.uint8)
    zeros = torch.tensor([[0, 8, 16], [7, 1, 15], [8, 8, 8]], dtype=torch.uint8)
    scales = torch.tensor([[0.5, 0.25, 2.0], [1e-3, 3.0, 0.125], [1.0, 1.0, 1.0]])
    got = dequantize_int4(codes, zeros, scales, group, torch.float32)
    for n in range(N):
        for k in range(K):
            want = torch.tensor(float(int(codes[n, k]) - int(zeros[n, k // group]))) * scales[n, k // group]
            assert got[n, k].item() == want.item()  # one fp32 product (exact for fp16 scales, as GPTQ's)
    for sym in (True, False):  # round to nearest: every value within half a step of its group's grid
        c, z, s = quantize_int4(got, group, sym)
        step = s.repeat_interleave(group, 1)[:, :K]
        assert ((dequantize_int4(c, z, s, group, torch.float32) - got).abs() <= step / 2 * (1 + 1e-6)).all()
        assert sym is False or (z == 8).all()


def test_every_nibble_position_reaches_the_kernel(ext):
    """One-hot weights: a code of 15 at one k of one column (zero 0, scale 1) and x = 1 everywhere: the output is
    non-zero in that column only, for every k of a group (each nibble of each packed byte) and every column."""
    N, K, group = 16, 64, 32
    for k in range(K):
        codes = torch.zeros(N, K, dtype=torch.uint8)
        col = k % N
        codes[col, k] = 15
        w = Int4Weight(codes, torch.zeros(N, 2, dtype=torch.uint8), torch.ones(N, 2), group)
        w.pack(ext)
        y = linear(torch.ones(1, K, dtype=torch.bfloat16), w)[0]
        assert y[col].item() == 15.0 and (y.count_nonzero() == 1), (k, y)


@pytest.mark.parametrize("group", [32, 64, 96, 128, 256])
def test_the_largest_sums_do_not_saturate(group):
    """Every code 15, zero 0, and every activation at its extreme code (+-127): each product is 15 * 127, the
    largest the format makes, so a path that sums products in narrower integers (the avx2 path's vpmaddubsw adds
    pairs of them in int16 lanes) is at its limit. Every path gives the reference's bits and the exact value, +-15 K."""
    N, K = 32, 2 * group
    codes = torch.full((N, K), 15, dtype=torch.uint8)
    w = Int4Weight(codes, torch.zeros(N, 2, dtype=torch.uint8), torch.ones(N, 2), group)
    x = torch.ones(2, K, dtype=torch.bfloat16)
    x[1] = -1
    want = linear_int4_reference(x, w.codes, w.zeros, w.scales, group)
    assert (want[0] == 15 * K).all() and (want[1] == -15 * K).all()
    for build_path in build_paths():
        e, path = ext_path(build_path)
        assert torch.equal(linear(x, packed(e, w, path)), want), build_path


@pytest.mark.parametrize("N,K", [(776, 256), (1000, 1024)])
def test_rows_are_batch_and_thread_invariant(N, K):
    for build_path in build_paths():
        e, path = ext_path(build_path)
        w = packed(e, weight(N, K, 128, False, seed=3), path)
        assert_linear_rows_batch_invariant(linear, rand(41, K, seed=4).to(torch.bfloat16), w)


def test_every_path_has_the_same_bits():
    """The integer sums are exact and the fp32 steps one fixed sequence: each path of each build agrees bit for bit."""
    w = weight(100, 1030, 128, False, seed=11)
    x = rand(13, 1030, seed=2).to(torch.bfloat16)
    ys = {bp: linear(x, packed(*ext_path(bp)[:1], w, ext_path(bp)[1])) for bp in build_paths()}
    first = next(iter(ys.values()))
    assert all(torch.equal(y, first) for y in ys.values()), list(ys)


def test_errors(ext):
    w = packed(ext, weight(32, 64, 32, True, seed=5), "int4")
    with pytest.raises(RuntimeError, match="x must be"):
        ext.linear_int4(rand(4, 64, seed=8), w.packed, w.packed_scales, 32, "int4")
    with pytest.raises(RuntimeError, match="packed for 2 groups of 32"):
        ext.linear_int4(rand(4, 130, seed=8).to(torch.bfloat16), w.packed, w.packed_scales, 32, "int4")
    with pytest.raises(RuntimeError, match="not in this build"):
        ext.linear_int4(rand(4, 64, seed=8).to(torch.bfloat16), w.packed, w.packed_scales, 32, "int4:sse9")
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ext.pack_int4_weight(torch.zeros(16, 64, dtype=torch.uint8), torch.zeros(16, 4, dtype=torch.uint8),
                             torch.ones(16, 4), 16)
    with pytest.raises(RuntimeError, match="a code above 15"):
        ext.pack_int4_weight(torch.full((16, 64), 16, dtype=torch.uint8), torch.zeros(16, 2, dtype=torch.uint8),
                             torch.ones(16, 2), 32)
    with pytest.raises(ValueError, match="needs zeros and scales"):
        Int4Weight(torch.zeros(16, 64, dtype=torch.uint8), torch.zeros(16, 1, dtype=torch.uint8), torch.ones(16, 1), 32)


# ---- the model -----------------------------------------------------------------------------------------------



def _rel(a, b):
    return ((a - b).pow(2).mean() / b.pow(2).mean()).sqrt().item()


def test_quantize_int4_at_load_and_its_tolerance(ext):
    """--quantize int4: every projection of the text model an Int4Weight run by linear_int4, the decode program
    built over them, and the head too with --quantize-head int4. Tolerance (docs/int4.md, measured on the tiny
    preset's random weights, which amplify any error through the layers): against a bf16 model holding the very
    same dequantized weights the int4 model's logits differ by the activations' int8 rounding only, relative RMS
    within 3x the bf16-vs-fp32 noise floor (measured 2.2x); against the bf16 model the weights were made from the
    format's own rounding dominates and is what the dequantized model shows too."""
    from deltaserve.embedded.model import ensure_model
    from deltaserve.model import fused
    from deltaserve.model.loader import load_model

    d = ensure_model("tiny")
    m = load_model(d, quantize="int4")
    for w in (m.layers[0].mlp.gate_up, m.layers[0].linear_attn.in_proj, m.layers[3].self_attn.qkv_proj):
        assert isinstance(w, Int4Weight) and w.packed is not None and w.group == 128
    assert (fused.decode_program(m) is not None) == m.decode_kernels.compiled  # int4 parts in the compiled step
    plain, deq, exact = load_model(d, prepack=False), load_model(d, prepack=False), load_model(d, dtype="float32")
    for module in deq.modules():
        for name in getattr(module, "PACKABLE", ()):
            p = module._parameters.get(name)
            if p is not None:
                for w in (p.data if p.dim() == 3 else p.data[None]):
                    w.copy_(dequantize_int4(*quantize_int4(w, 128, sym=False), 128, torch.bfloat16))
    ids = torch.randint(10, 4000, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    y4, yd, yb, y32 = (prefill_logits(x, ids) for x in (m, deq, plain, exact))
    floor = _rel(yb, y32)
    print(f"int4 vs its dequantized bf16 model {_rel(y4, yd):.3f}, bf16 vs fp32 floor {floor:.3f}, int4 vs bf16 "
          f"{_rel(y4, yb):.3f}, dequantized vs bf16 {_rel(yd, yb):.3f}")  # docs/int4.md quotes them
    assert _rel(y4, yd) <= 3 * floor, (_rel(y4, yd), floor)
    assert abs(_rel(y4, yb) - _rel(yd, yb)) <= 2 * floor  # the format's rounding, not the kernel, sets the distance
    # the head in int4 too: a quarter of its bytes, and the embedding too (tiny is tied): the lookups read its rows
    # dequantized, no bf16 copy held beside it
    h = load_model(d, quantize="int4", quantize_head="int4")
    assert isinstance(h.packed_head, Int4Weight) and h.embed_tokens is None
    held, held_m = h.held_weight_bytes(), m.held_weight_bytes()
    assert held["head"] < held_m["head"] / 3 and held["text"] == held_m["text"]  # m: its packed head is the embedding
    V = h.config.vocab_size
    want = dequantize_int4(*quantize_int4(plain.embed(torch.arange(V)), 128, sym=False), 128, torch.bfloat16)
    assert torch.equal(h.embed(torch.arange(V)).view(torch.int16), want.view(torch.int16))
    print(f"int4 head and table vs bf16 {_rel(prefill_logits(h, ids), yb):.3f}")  # docs/int4.md quotes it
    g32 = load_model(d, quantize="int4-g32")
    assert g32.layers[0].mlp.gate_up.group == 32


@pytest.mark.parametrize("head", ["int4", "fp8"])
def test_hit_equals_cold_on_int4(head):
    """The prefix cache's gate on --quantize int4 with the head in int4 or in FP8 (the pair of llama.cpp's 4-bit
    files with a head at least as fine as theirs): the compiled linear_int4 and linear_fp8 are batch-invariant."""
    from test_prefix_cache import _hit_equals_cold

    _hit_equals_cold("in-page", 3 * 128 + 64, quantize="int4", quantize_head=head)


def test_drafted_equals_plain_on_int4(tmp_path):
    """Speculative decoding on an int4 model (the MTP layer quantized as well): drafted == plain."""
    from deltaserve.embedded.model import ensure_model
    from test_speculative import VOCAB, ScriptedDrafter, counted, spec

    path = ensure_model("tiny")
    rng = random.Random(1)
    prompts = [random_tokens(rng, n) for n in (5, 70)]
    params = greedy(max_tokens=12)
    ref = [signature(o) for o in run(make_llm(model=path, enable_prefix_caching=False, quantize="int4"), prompts,
                                     params=params)]
    llm = spec(2, model=path, enable_prefix_caching=False, quantize="int4")
    assert [signature(o) for o in run(llm, prompts, params=params)] == ref
    llm.engine.drafter = ScriptedDrafter({tuple(p): r[0] for p, r in zip(prompts, ref)}, p=0.7, vocab_size=VOCAB)
    got, (drafted, accepted, _) = counted(llm, lambda: [signature(o) for o in run(llm, prompts, params=params)])
    assert got == ref and 0 < accepted < drafted


def test_refusals():
    from deltaserve.embedded.model import ensure_model
    from deltaserve.model.loader import load_model

    with pytest.raises(ConfigError, match="--quantize must be one of none, int4, int4-g32"):
        EngineConfig(quantize="int3")
    with pytest.raises(ConfigError, match="one rank only"):
        EngineConfig(quantize="int4", tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="--quantize int4 needs bf16 weights on the CPU"):
        load_model(ensure_model("tiny"), dtype="float32", quantize="int4")
    with pytest.raises(ConfigError, match="--quantize int4 needs bf16 weights on the CPU"):
        load_model(ensure_model("tiny"), prepack=False, quantize="int4")


def test_bench_linear_runs_an_int4_arm_per_path():
    """`deltaserve bench linear --int4-paths`: an arm per build/path this CPU has (every projection and the head in
    int4 on it), timed beside the bf16 arms; a path this CPU lacks is refused, naming the ones it has."""
    from deltaserve.bench import linear as bench_linear

    paths = build_paths()
    results = bench_linear.run("tiny", [1, 3], 1, int4_paths=paths)
    assert [list(r["int4"]) for r in results] == [paths, paths] and all(ms > 0 for ms in results[0]["int4"].values())
    assert all(f"int4 {bp} ms" in bench_linear.render("tiny", results) for bp in paths)
    with pytest.raises(SystemExit, match="not a path here; this CPU has"):
        bench_linear.run("tiny", [1], 1, int4_paths=["generic/int4:nonesuch"])
