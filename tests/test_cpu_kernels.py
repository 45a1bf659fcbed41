"""The compiled CPU decode kernels (deltaserve/model/ops/cpu_kernels.py) against the plain-torch ops they
replace, on awkward shapes: paged attention (lengths 1, 63, 65, 1000 mixed in one call, GQA, shuffled pages,
fp32 at 1e-5, bf16 at 1e-2), the GDN step (non-consecutive slots, grouped heads, at 1e-5 in fp32) and the
conv step (bit-identical); batch invariance bit for bit; and a model step through both paths."""
from __future__ import annotations

import pytest
import torch

from deltaserve.model.ops import cpu_kernels
from deltaserve.model.ops.attention import decode_attention, kv_gather
from deltaserve.model.ops.conv import causal_conv1d_prefill, causal_conv1d_step
from deltaserve.model.ops.gdn import gated_delta_rule_reference, recurrent_gated_delta_rule_step
from deltaserve.model.ops.pointwise import silu


def _kernels(isa: str):
    why = cpu_kernels.cannot_execute(isa)
    if why:
        pytest.skip(why)
    # a build error fails here with the compiler's message: a CPU that executes the set must get its kernels
    k = cpu_kernels.select_decode_kernels("cpu", torch.float32, "cpp", isa)
    assert k.isa == isa and k.ext.kernel_isa() == isa
    return k


@pytest.fixture(scope="module", params=[i for i in cpu_kernels.ISAS if i not in cpu_kernels.ISA_BUILD])
def kern(request):
    """The compiled kernels of each build this CPU executes (a set it cannot execute skips, saying which and
    why). amx is left out: its decode kernels and norms are the avx512bf16 build's, tested there."""
    return _kernels(request.param)


@pytest.fixture(scope="module", params=cpu_kernels.ISAS)
def kern_any(request):
    """Each instruction set this CPU executes, amx too: for the tests that run its bf16 linear."""
    return _kernels(request.param)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


# ---- paged decode attention ------------------------------------------------------------------------------

def paged_batch(lengths, Hq, Hkv, D, bs, dtype, seed=0):
    """A pool with NaN in every row no sequence owns, shuffled page tables padded with page 0 -> q, kv, table, lens."""
    g = gen(seed)
    need = [-(-L // bs) for L in lengths]
    P = sum(need) + 3
    kv = torch.full((P, 2, bs, Hkv, D), float("nan"), dtype=dtype)
    perm = torch.randperm(P, generator=g)
    table = torch.zeros(len(lengths), max(need), dtype=torch.long)
    used = 0
    for b, (L, n) in enumerate(zip(lengths, need)):
        pages = perm[used:used + n]
        used += n
        table[b, :n] = pages
        k = torch.randn(L, Hkv, D, generator=g).to(dtype)
        v = torch.randn(L, Hkv, D, generator=g).to(dtype)
        for t in range(L):
            kv[pages[t // bs], 0, t % bs] = k[t]
            kv[pages[t // bs], 1, t % bs] = v[t]
    q = torch.randn(len(lengths), Hq, D, generator=g).to(dtype)
    return q, kv, table, torch.tensor(lengths, dtype=torch.long)


def torch_attention(q, kv, table, lens, scale):
    return torch.stack([decode_attention(q[b], *kv_gather(kv, table[b], int(lens[b])), scale) for b in range(q.shape[0])])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Hq,Hkv,D", [(4, 2, 128), (8, 2, 256), (2, 2, 64), (6, 2, 16), (3, 1, 40)])
def test_paged_attention_matches_torch(kern, dtype, Hq, Hkv, D):
    lengths = [1, 63, 65, 1000, 7]
    q, kv, table, lens = paged_batch(lengths, Hq, Hkv, D, bs=16, dtype=dtype, seed=D + Hq)
    scale = D ** -0.5
    out = kern.attention(q, kv, table, lens, scale)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out, torch_attention(q, kv, table, lens, scale), **TOL[dtype])
    # batch-invariant: each sequence alone gives the same bits
    for b in range(len(lengths)):
        alone = kern.attention(q[b:b + 1].clone(), kv, table[b:b + 1, :-(-lengths[b] // 16)].clone(), lens[b:b + 1], scale)
        assert torch.equal(alone[0], out[b]), b


def test_paged_attention_rejects_bad_tables(kern):
    q, kv, table, lens = paged_batch([5, 20], 4, 2, 32, bs=16, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="page table"):
        kern.attention(q, kv, table, torch.tensor([5, 40]), 0.1)
    table[1, 1] = kv.shape[0]
    with pytest.raises(RuntimeError, match="page id"):
        kern.attention(q, kv, table, lens, 0.1)


# ---- GDN recurrent step ------------------------------------------------------------------------------------

def gdn_step_inputs(B, H, Hk, dk, dv, dtype, seed):
    g = gen(seed)
    q = torch.randn(B, Hk, dk, generator=g).to(dtype)
    k = torch.randn(B, Hk, dk, generator=g).to(dtype)
    v = torch.randn(B, H, dv, generator=g).to(dtype)
    decay = -torch.rand(B, H, generator=g) * 0.3
    beta = torch.rand(B, H, generator=g).to(dtype)
    return q, k, v, decay, beta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,Hk,dk,dv", [(4, 2, 64, 64), (16, 16, 128, 128), (4, 2, 32, 16), (3, 1, 20, 12)])
def test_gdn_step_matches_torch_through_slots(kern, dtype, H, Hk, dk, dv):
    S = 9
    slots = torch.tensor([7, 2, 3, 0, 5])  # not consecutive, not sorted
    state0 = torch.randn(S, H, dv, dk, generator=gen(1)) * 0.2
    q, k, v, g, beta = gdn_step_inputs(len(slots), H, Hk, dk, dv, dtype, seed=dk)
    ref_state = state0[slots].clone()
    ref = recurrent_gated_delta_rule_step(q, k, v, g, beta, ref_state)
    state = state0.clone()
    out = kern.gdn_step(q, k, v, g, beta, state, slots)
    assert out.dtype == dtype and out.shape == (len(slots), H, dv)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    torch.testing.assert_close(state[slots], ref_state, atol=1e-5, rtol=1e-5)
    others = [i for i in range(S) if i not in slots.tolist()]
    assert torch.equal(state[others], state0[others])  # slots not named are untouched
    # batch-invariant: each sequence alone gives the same bits
    for b in range(len(slots)):
        solo = state0.clone()
        o = kern.gdn_step(*(x[b:b + 1].clone() for x in (q, k, v, g, beta)), solo, slots[b:b + 1])
        assert torch.equal(o[0], out[b]) and torch.equal(solo[slots[b]], state[slots[b]])


def test_gdn_steps_follow_the_token_loop(kern):
    """20 steps through the kernel == the float64 token loop (transformers' recurrent form)."""
    L, H, Hk, dk, dv = 20, 4, 2, 64, 32
    q, k, v, g, beta = gdn_step_inputs(L, H, Hk, dk, dv, torch.float32, seed=3)
    init = torch.randn(H, dv, dk, generator=gen(4)) * 0.2
    state = torch.zeros(3, H, dv, dk)
    state[2] = init
    outs = [kern.gdn_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], state, torch.tensor([2]))
            for t in range(L)]
    ref, ref_state = gated_delta_rule_reference(q, k, v, g, beta, initial_state=init, compute_dtype=torch.float64)
    torch.testing.assert_close(torch.cat(outs).double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state[2].double(), ref_state, atol=1e-5, rtol=1e-5)


# ---- conv step ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_step_bit_identical_to_the_compiled_prefill(kern, dtype):
    """The compiled step equals the prefill with the compiled silu (what the op table runs) bit for bit, the
    torch step (torch's exp in the silu) within a few ulp; states equal exactly, other slots untouched."""
    g = gen(5)
    L, C, K, S = 40, 48, 4, 5
    x = torch.randn(L, 2, C, generator=g).to(dtype)  # two sequences, token-major
    w = torch.randn(C, K, generator=g).to(dtype)
    slots = torch.tensor([3, 1])
    state = torch.randn(S, K - 1, C, generator=g).to(dtype)
    state[slots] = 0
    keep = state.clone()
    ref_state = torch.zeros(2, K - 1, C, dtype=dtype)
    outs = []
    for t in range(L):
        rows = torch.tensor([1, 0])  # the step's rows in another order than the slots
        xt = torch.stack([x[t, 1], x[t, 0]])  # [2, C]: row 0 = sequence 1, row 1 = sequence 0
        o = kern.conv_step(xt, rows, w, state, slots)  # o[i] is sequence i (slot slots[i])
        ref = causal_conv1d_step(x[t], w, ref_state)
        tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=0, rtol=2 ** -7)
        torch.testing.assert_close(o, ref, **tol)
        outs.append(o)
    for i in range(2):
        whole, whole_state = causal_conv1d_prefill(x[:, i], w, silu_into=kern.silu_into)
        assert torch.equal(torch.stack([o[i] for o in outs]), whole)
        assert torch.equal(state[slots[i]], whole_state)
    assert torch.equal(state[[0, 2, 4]], keep[[0, 2, 4]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("L,C,K", [(1, 5, 4), (2, 17, 4), (3, 48, 4), (67, 33, 3), (130, 100, 2), (40, 6144, 4)])
def test_conv_prefill_bit_identical_to_the_torch_form(kern, dtype, L, C, K):
    """The compiled conv prefill (csrc/conv_prefill.cpp) equals the torch form with the compiled silu bit for bit,
    on awkward shapes (fewer tokens than taps, channel counts off the vector width, a row-strided view, with and
    without a state), its new state too; and split anywhere, it gives the whole call's bits."""
    g = gen(8)
    wide = torch.randn(L, C + 3, generator=g).to(dtype)
    x = wide[:, 1:C + 1]  # a column slice: row stride C + 3, as the projections' slices are
    w = torch.randn(C, K, generator=g).to(dtype)
    for state in (None, torch.randn(K - 1, C, generator=g).to(dtype)):
        out, new = kern.conv_prefill(x, w, state)
        ref, ref_new = causal_conv1d_prefill(x, w, state, silu_into=kern.silu_into)
        assert out.dtype == dtype and torch.equal(out, ref) and torch.equal(new, ref_new)
        cut = L // 3
        a, sa = kern.conv_prefill(x[:cut], w, state)
        b, sb = kern.conv_prefill(x[cut:], w, sa)
        assert torch.equal(torch.cat([a, b]), out) and torch.equal(sb, new)


@pytest.mark.parametrize("C", [1, 7, 16, 17, 100])
def test_silu_into_matches_torch_and_is_position_independent(kern, C):
    g = gen(6)
    acc = torch.randn(9, C, generator=g) * 6
    acc[0, :2] = torch.tensor([-100.0, 100.0])[:C]  # past the exp clamps
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.empty(9, C, dtype=dtype)
        kern.silu_into(acc, out)
        torch.testing.assert_close(out, silu(acc).to(dtype), atol=1e-6, rtol=4e-6 if dtype == torch.float32 else 2 ** -8)
        alone = torch.empty(1, C, dtype=dtype)
        kern.silu_into(acc[4:5], alone)
        assert torch.equal(alone, out[4:5])
        rolled = torch.empty(9, C, dtype=dtype)
        kern.silu_into(acc.roll(3, 1), rolled)
        assert torch.equal(rolled, out.roll(3, 1))
    strided = torch.empty(9, 2 * C)
    kern.silu_into(acc, strided[:, :C])  # a column slice written in place
    expect = torch.empty(9, C)
    kern.silu_into(acc, expect)
    assert torch.equal(strided[:, :C], expect)


# ---- selection and a model step ----------------------------------------------------------------------------

def test_selection_modes(monkeypatch):
    monkeypatch.setenv(cpu_kernels.ENV, "torch")
    assert cpu_kernels.select_decode_kernels("cpu", torch.bfloat16) is cpu_kernels.TORCH
    assert cpu_kernels.select_decode_kernels("cpu", torch.float16, "auto") is cpu_kernels.TORCH
    with pytest.raises(ValueError, match=cpu_kernels.ENV):
        cpu_kernels.select_decode_kernels("cpu", torch.float32, "fast")


def test_isa_choice_follows_the_cpu_flags(monkeypatch):
    """auto takes the fastest set the flags allow; a named set the CPU lacks is an error naming the missing
    flags and the sets it runs (an AVX2-only EPYC, an AVX-512 CPU without BF16, this CPU)."""
    epyc = frozenset(cpu_kernels.ISA_NEEDS["avx2"] | {"sse4_2"})
    skylake = frozenset(cpu_kernels.ISA_NEEDS["avx512"])
    assert cpu_kernels.executable_isas(epyc) == ("avx2",)
    assert cpu_kernels.resolve_isa("auto", epyc) == "avx2"
    assert cpu_kernels.resolve_isa("auto", skylake) == "avx512"
    assert cpu_kernels.resolve_isa("avx2", skylake) == "avx2"
    with pytest.raises(ValueError, match=r"avx512bf16: this CPU cannot execute it \(missing .*avx512_bf16.*avx512f"):
        cpu_kernels.resolve_isa("avx512bf16", epyc)
    with pytest.raises(ValueError, match="it runs: avx2"):
        cpu_kernels.resolve_isa("avx512", epyc)
    with pytest.raises(ValueError, match="must be one of"):
        cpu_kernels.resolve_isa("sse2")
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "avx2")
    assert cpu_kernels.resolve_isa() == "avx2"  # the process's choice (the engine's --cpu-isa sets it)
    monkeypatch.delenv(cpu_kernels.ISA_ENV)
    assert cpu_kernels.resolve_isa() == cpu_kernels.executable_isas()[0]


def test_amx_needs_the_flags_and_the_kernels_permission(monkeypatch):
    """amx: the AMX flags and the Linux kernel's permission to use the tile data. Refused (an older kernel, a
    VM that hides the state), auto takes avx512bf16 and --cpu-isa amx is an error saying why."""
    sapphire = frozenset(cpu_kernels.ISA_NEEDS["amx"])
    zen4 = sapphire - {"amx_tile", "amx_bf16"}
    monkeypatch.setattr(cpu_kernels, "amx_refusal", lambda: None)
    assert cpu_kernels.executable_isas(sapphire) == cpu_kernels.ISAS
    assert cpu_kernels.resolve_isa("auto", sapphire) == "amx"
    assert cpu_kernels.resolve_isa("auto", zen4) == "avx512bf16"
    with pytest.raises(ValueError, match=r"amx: this CPU cannot execute it \(missing amx_bf16, amx_tile\)"):
        cpu_kernels.resolve_isa("amx", zen4)
    refused = "the Linux kernel refused the AMX tile data permission (arch_prctl ARCH_REQ_XCOMP_PERM: test)"
    monkeypatch.setattr(cpu_kernels, "amx_refusal", lambda: refused)
    assert cpu_kernels.resolve_isa("auto", sapphire) == "avx512bf16"
    with pytest.raises(ValueError, match=r"amx: this CPU cannot execute it \(the Linux kernel refused .*: test\)\); "
                                         r"it runs: avx512bf16, avx512, avx2"):
        cpu_kernels.resolve_isa("amx", sapphire)


def test_engine_picks_amx_here_and_logs_it(caplog):
    """Where this CPU and kernel run amx, the engine takes it by default, logs it, and packs every bf16
    projection and the head for linear_bf16_amx."""
    import logging

    from deltaserve.config import EngineConfig
    from deltaserve.engine.llm_engine import LLMEngine

    why = cpu_kernels.cannot_execute("amx")
    if why:
        pytest.skip(why)
    with caplog.at_level(logging.INFO, logger="deltaserve"):
        engine = LLMEngine(EngineConfig(device="cpu", dtype="bfloat16", kv_cache_memory=64 << 20))
    try:
        assert engine.cpu_kernels == "amx"
        assert "cpu kernels: amx (AMX tiles" in caplog.text and "from the CPU's flags" in caplog.text
        model = engine.model
        assert model.linear_kind == "cpp" and model.packed_head.ext.linear_bf16 is model.packed_head.ext.base.linear_bf16_amx
    finally:
        engine.shutdown()


def test_engine_refuses_a_set_the_cpu_lacks(monkeypatch):
    """--cpu-isa avx512bf16 on an AVX2-only CPU: a ConfigError naming what is missing, before any model loads."""
    from deltaserve.config import ConfigError, EngineConfig
    from deltaserve.engine.llm_engine import LLMEngine

    with pytest.raises(ConfigError, match="--cpu-isa must be one of"):
        EngineConfig(cpu_isa="sse2")
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset(cpu_kernels.ISA_NEEDS["avx2"]))
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "auto")
    with pytest.raises(ConfigError, match=r"avx512bf16: this CPU cannot execute it .*it runs: avx2"):
        LLMEngine(EngineConfig(cpu_isa="avx512bf16", device="cpu"))


def test_model_decode_steps_match_torch_path(kern):
    """Prefill two sequences, then decode steps (slots 2 and 0, a prefill chunk sharing a step) through the
    compiled kernels and through torch: logits agree (fp32 model)."""
    from deltaserve.embedded.model import ensure_model
    from deltaserve.model.loader import load_model
    from model_driver import Sequence, make_caches, step

    model = load_model(ensure_model("tiny", seed=0), dtype="float32")
    logits = {}
    for mode in ("torch", "cpp"):
        model.select_decode_kernels(mode, kern.isa)
        caches = make_caches(model, num_slots=3, num_pages=12, block_size=64)
        a, b, c = Sequence(slot=2, pages=[5, 1, 9]), Sequence(slot=0, pages=[0, 7, 3]), Sequence(slot=1, pages=[4, 2])
        ids = list(range(100, 170))
        out = step(model, caches, [(a, ids, False), (b, ids[:37], False)])
        toks = [int(out[0][-1].argmax()), int(out[1][-1].argmax())]
        rows = []
        for t in range(6):
            work = [(a, [toks[0]], True), (b, [toks[1]], True)]
            if t == 2:
                work.append((c, ids[:20], False))
            out = step(model, caches, work)
            rows.append(torch.cat([out[0], out[1]]))
            toks = [100 + t, 200 + t]  # fixed inputs: both paths see the same tokens
        logits[mode] = torch.stack(rows)
    model.select_decode_kernels()
    torch.testing.assert_close(logits["cpp"], logits["torch"], atol=1e-4, rtol=1e-4)


def test_bf16_model_rows_are_batch_invariant(kern_any):
    """The bf16 model on this set's kernels and packed linear (what the engine serves): a sequence's logits
    are the same bits decoded alone and beside two others, in another slot and at another row position (the
    cache's hit == cold gates rest on it)."""
    from deltaserve.embedded.model import ensure_model
    from deltaserve.model.loader import load_model
    from model_driver import Sequence, make_caches, step

    model = load_model(ensure_model("tiny", seed=0), dtype="bfloat16", prepack=False)
    model.select_decode_kernels("cpp", kern_any.isa)
    assert model.prepack_linears() and model.linear_kind == "cpp"
    assert model.packed_head.ext.kernel_isa() == kern_any.isa  # amx: the projections run linear_bf16_amx
    ids = list(range(100, 170))

    def run(others: bool) -> torch.Tensor:
        caches = make_caches(model, num_slots=3, num_pages=12, block_size=64)
        a = Sequence(slot=2 if others else 0, pages=[5, 1] if others else [0, 1])
        b, c = Sequence(slot=0, pages=[0, 7]), Sequence(slot=1, pages=[4, 2])
        work = ([(b, ids[:37], False), (a, ids, False), (c, ids[:5], False)] if others else [(a, ids, False)])
        out = step(model, caches, work)
        ia = 1 if others else 0
        rows, tok = [out[ia][-1]], int(out[ia][-1].argmax())
        for t in range(4):
            work = [(b, [7 + t], True), (a, [tok], True), (c, [9], True)] if others else [(a, [tok], True)]
            out = step(model, caches, work)
            rows.append(out[ia][-1])
            tok = int(out[ia][-1].argmax())
        return torch.stack(rows)

    assert torch.equal(run(False), run(True))


# ---- fused RMSNorm ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [1, 15, 16, 17, 64, 256, 1000])
def test_rms_norm_matches_torch_and_is_row_invariant(kern, dtype, D):
    from deltaserve.model.ops.norm import rms_norm

    g = gen(D)
    x = (3 * torch.randn(37, D, generator=g)).to(dtype)
    w = (0.1 * torch.randn(D, generator=g)).to(dtype)
    y = kern.rms_norm(x, w, 1e-6)
    assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous()
    torch.testing.assert_close(y.float(), rms_norm(x, w, 1e-6).float(), **TOL[dtype])
    for r in (0, 16, 36):
        assert torch.equal(kern.rms_norm(x[r:r + 1], w, 1e-6)[0], y[r])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_reads_strided_head_views(kern, dtype):
    """The q / k views of the attention projection ([T, H, D] with row and head strides) are read in place."""
    from deltaserve.model.ops.norm import rms_norm

    T, H, D = 5, 3, 32
    proj = torch.randn(T, 2 * H * D + 7, generator=gen(1)).to(dtype)
    q = proj[:, :2 * H * D].view(T, H, 2 * D)[..., :D]  # every other D-slice, like the query / gate split
    k = proj[:, 7:7 + H * D].view(T, H, D)
    w = torch.randn(D, generator=gen(2)).to(dtype)
    for v in (q, k):
        torch.testing.assert_close(kern.rms_norm(v, w, 1e-6).float(), rms_norm(v, w, 1e-6).float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_sum_has_torch_bits(kern, dtype):
    from deltaserve.model.ops.norm import rms_norm

    x, h = (torch.randn(9, 48, generator=gen(s)).to(dtype) for s in (3, 4))
    w = torch.randn(48, generator=gen(5)).to(dtype)
    s, y = kern.add_rms_norm(x, h, w, 1e-6)
    assert torch.equal(s, x + h)
    torch.testing.assert_close(y.float(), rms_norm(x + h, w, 1e-6).float(), **TOL[dtype])
    assert torch.equal(cpu_kernels.TORCH.add_rms_norm(x, h, w, 1e-6)[1], rms_norm(x + h, w, 1e-6))


# ---- the activations (csrc/pointwise.cpp, norm.cpp's gated and q/k norms) ----------------------------------

def _rows_and_rolled(fn, *xs, roll=5):
    """fn on row-strided inputs; every row alone; and the inputs with their columns rolled (each element at
    another lane / in another block, the tail included). Returns (full output, rows, rolled output)."""
    full = fn(*xs)
    alone = [fn(*(x[r:r + 1] for x in xs)) for r in range(xs[0].shape[0])]
    rolled = fn(*(x.roll(roll, dims=-1) for x in xs))
    return full, alone, rolled


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H", [1, 7, 16, 17, 48])
def test_gdn_gates_match_torch_and_are_position_independent(kern, dtype, H):
    from deltaserve.model.ops.pointwise import gdn_gates

    T = 9
    proj = (torch.randn(T, 2 * H + 5, generator=gen(H)) * 12).to(dtype)  # past softplus' threshold of 20 too
    proj[0, :2 * H] = torch.linspace(-100, 100, 2 * H).to(dtype)  # and the exp clamps
    b, a = proj[:, 3:3 + H], proj[:, 3 + H:3 + 2 * H]
    dt_bias = torch.randn(H, generator=gen(1)) - 3
    neg_decay = -torch.rand(H, generator=gen(2)) * 10
    g, beta = kern.gdn_gates(b, a, dt_bias, neg_decay)
    rg, rbeta = gdn_gates(b, a, dt_bias, neg_decay)
    assert g.dtype == torch.float32 and beta.dtype == dtype
    torch.testing.assert_close(g, rg, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(beta.float(), rbeta.float(), **TOL[dtype])
    for r in (0, 4, 8):
        g1, b1 = kern.gdn_gates(b[r:r + 1], a[r:r + 1], dt_bias, neg_decay)
        assert torch.equal(g1[0], g[r]) and torch.equal(b1[0], beta[r])
    g2, b2 = kern.gdn_gates(b.roll(3, -1), a.roll(3, -1), dt_bias.roll(3), neg_decay.roll(3))
    assert torch.equal(g2, g.roll(3, -1)) and torch.equal(b2, beta.roll(3, -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("I", [1, 15, 16, 17, 100])
def test_silu_mul_and_gate_output_match_torch_and_are_position_independent(kern, dtype, I):
    from deltaserve.model.ops.pointwise import gate_output, silu

    gu = (torch.randn(6, 2 * I, generator=gen(I)) * 6).to(dtype)
    gu[0, :I] = torch.linspace(-120, 120, I).to(dtype)
    y = kern.ext.silu_mul(gu)
    torch.testing.assert_close(y.float(), (silu(gu[:, :I]) * gu[:, I:]).float(), **TOL[dtype])
    assert all(torch.equal(kern.ext.silu_mul(gu[r:r + 1])[0], y[r]) for r in range(6))
    rolled = torch.cat([gu[:, :I].roll(4, -1), gu[:, I:].roll(4, -1)], dim=1)
    assert torch.equal(kern.ext.silu_mul(rolled), y.roll(4, -1))

    proj = (torch.randn(6, 3 * I, generator=gen(I + 1)) * 6).to(dtype)
    o, gate = proj[:, :I].contiguous(), proj[:, I:2 * I]  # the gate: a row-strided view, as in attention
    full, alone, rolled = _rows_and_rolled(kern.gate_output, o, gate)
    torch.testing.assert_close(full.float(), gate_output(o, gate).float(), **TOL[dtype])
    assert all(torch.equal(a[0], full[r]) for r, a in enumerate(alone)) and torch.equal(rolled, full.roll(5, -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,D", [(1, 16), (4, 17), (3, 64), (2, 128)])
def test_gated_rms_norm_matches_torch_and_is_row_invariant(kern, dtype, H, D):
    from deltaserve.model.ops.norm import rms_norm_gated

    T = 7
    x = (3 * torch.randn(T, H, D, generator=gen(D))).to(dtype)
    proj = (3 * torch.randn(T, H * D + 9, generator=gen(D + 1))).to(dtype)
    z = proj[:, 9:]  # in_proj's gate columns: a row-strided view
    w = (1 + 0.1 * torch.randn(D, generator=gen(3))).to(dtype)
    y = kern.rms_norm_gated(x, z, w, 1e-6)
    assert y.shape == (T, H * D) and y.dtype == dtype
    ref = rms_norm_gated(x.reshape(T * H, D), z.reshape(T * H, D), w, 1e-6).view(T, H * D)
    torch.testing.assert_close(y.float(), ref.float(), **TOL[dtype])
    torch.testing.assert_close(cpu_kernels.TORCH.rms_norm_gated(x, z, w, 1e-6), ref, atol=0, rtol=0)
    assert all(torch.equal(kern.rms_norm_gated(x[r:r + 1], z[r:r + 1], w, 1e-6)[0], y[r]) for r in range(T))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D,P", [(32, 32), (64, 16), (40, 10), (256, 64)])
def test_qk_norm_rope_has_the_bits_of_norm_then_torch_rotary(kern, dtype, D, P):
    """The compiled q/k norm + rotary equals apply_rotary over the compiled rms_norm bit for bit (partial
    rotary, strided head views as the attention projection's)."""
    from deltaserve.model.ops.attention import apply_rotary, rotary_cos_sin, rotary_inv_freq

    T, H = 6, 3
    proj = torch.randn(T, 2 * H * D, generator=gen(D)).to(dtype)
    q = proj.view(T, H, 2 * D)[..., :D]
    w = (0.1 * torch.randn(D, generator=gen(P))).to(dtype)
    cos, sin = rotary_cos_sin(torch.arange(50, 50 + T), rotary_inv_freq(P, 1e6), dtype)
    y = kern.qk_norm_rope(q, w, 1e-6, cos, sin)
    assert y.is_contiguous() and y.shape == (T, H, D)
    assert torch.equal(y, apply_rotary(kern.rms_norm(q, w, 1e-6), cos, sin))


# ---- greedy sampling's argmax --------------------------------------------------------------------------------

@pytest.mark.parametrize("V", [1, 7, 16, 17, 100, 4096])
def test_argmax_rows_is_torch_argmax(kern, V):
    """The same index as torch.argmax(dim=-1): first of tied maxima, first NaN, all -inf, +inf, any row stride."""
    g = gen(11)
    x = torch.randn(12, V, generator=g)
    x[1] = 3.0  # all tied: the first
    x[2] = -float("inf")
    if V > 3:
        x[3, [V // 2, V - 1]] = x[3].max() + 1  # a tie between two maxima
        x[4, [V - 2, 1]] = float("nan")  # NaN counts as the largest: the first NaN
        x[5, V - 1] = float("inf")
        x[6, :] = torch.tensor(-0.0)
        x[6, V - 1] = 0.0  # -0.0 == 0.0: the first
    x[7, -1] = float("nan")
    wide = torch.randn(12, V + 5, generator=g)
    wide[:, :V] = x
    for rows in (x, wide[:, :V]):  # contiguous and row-strided
        assert torch.equal(kern.argmax(rows), torch.argmax(rows, dim=-1))
