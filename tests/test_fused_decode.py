"""Decode-only steps in one compiled call for the whole model (deltaserve/model/fused.py, ops/csrc/decode_layers.cpp)
give the op-table path's bits exactly: logits and every cache (KV pages, conv and GDN state slots) after several
decode steps of three sequences in non-consecutive slots; a decode row computed in a fused step equals the same
row computed in a step shared with a prefill chunk (op-table path); and the fused path is really taken."""
from __future__ import annotations

import pytest
import torch

import deltaserve.model.fused as program

DECODE_STEP = program.decode_step  # what the spies wrap (a run after another wraps this, not the earlier spy)

from tests.test_cpu_kernels import kern_any  # noqa: F401 - the fixture: every instruction set this CPU executes


@pytest.fixture(scope="module", params=["bf16", "fp8", "fp8-head", "int4-head"])
def model(request, kern_any):  # noqa: F811
    """The tiny model on this set's kernels, its linears packed by this set's build (as the loader does): bf16, or
    the block-FP8 checkpoint (fp8 projections, and the GDN in_proj split into fp8 rows and bf16 b / a rows), or bf16
    with its tied head quantized (--quantize-head fp8 / int4: the program's embedding is then the staging rows)."""
    from deltaserve.embedded.model import ensure_model
    from deltaserve.model.loader import load_model
    from deltaserve.model.ops.fp8 import Fp8Weight, SplitWeight

    path = request.getfixturevalue("fp8_tiny") if request.param == "fp8" else ensure_model("tiny", seed=0)
    m = load_model(path, dtype="bfloat16", prepack=False)
    m.select_decode_kernels("cpp", kern_any.isa)
    head = request.param[:-5] if request.param.endswith("-head") else "none"
    assert m.prepack_linears(quantize_head=head) and m.linear_kind == "cpp"
    assert m.embed_tokens is None  # tiny is tied: the packed or quantized head is the embedding too
    if request.param == "fp8":
        gdn = next(layer for layer in m.layers if layer.is_gdn)
        assert isinstance(gdn.mlp.down, Fp8Weight) and isinstance(gdn.linear_attn.in_proj, SplitWeight)
    return m


def _spy_decode_step(monkeypatch, fused: bool) -> list[bool]:
    """Route the model's decode_step through a spy (None, the op-table path, where not fused); the returned list
    gets, per call, whether the compiled call computed the step."""
    calls: list[bool] = []

    def spy(*a):
        out = DECODE_STEP(*a) if fused else None
        calls.append(out is not None)
        return out

    monkeypatch.setattr(program, "decode_step", spy)
    return calls


def _run(model, fused: bool, monkeypatch, with_prefill_at: int | None = None, rows: tuple[int, ...] = (3,) * 5):
    from model_driver import Sequence, make_caches, step

    calls = _spy_decode_step(monkeypatch, fused)
    caches = make_caches(model, num_slots=5, num_pages=16, block_size=64)
    seqs = [Sequence(slot=4, pages=[5, 1]), Sequence(slot=0, pages=[0, 7]), Sequence(slot=2, pages=[4, 2, 9])]
    ids = list(range(100, 170))
    out = step(model, caches, [(s, ids[:n], False) for s, n in zip(seqs, (70, 37, 66))])  # 66: a page edge next
    toks = [int(o[-1].argmax()) for o in out]
    late = Sequence(slot=1, pages=[3, 6])
    logits = []
    for t, n in enumerate(rows):  # the first n sequences decode (the others wait, their caches as they were)
        work = [(s, [tok], True) for s, tok in zip(seqs[:n], toks)]
        if t == with_prefill_at:
            work.append((late, ids[:20], False))
        out = step(model, caches, work)
        logits.append(torch.cat([o[-1:] for o in out[:n]]))
        toks[:n] = [int(o[-1].argmax()) for o in out[:n]]
    return torch.cat(logits), caches, calls


def test_fused_decode_has_the_op_table_bits(model, monkeypatch):
    m = model
    fused, fc, calls = _run(m, True, monkeypatch)
    plain, pc, _ = _run(m, False, monkeypatch)
    assert calls == [False] + [True] * 5  # the prefill step took the op-table path, every decode step the program
    assert torch.equal(fused, plain)
    for a, b in zip(fc.kv + fc.conv + fc.ssm, pc.kv + pc.conv + pc.ssm):
        assert torch.equal(a, b)


def test_the_program_keeps_the_bits_as_the_row_count_changes(model, monkeypatch):
    """The program's buffers are made for the most rows seen and their views once per row count: steps of 1, 3, 2,
    3 and 1 rows (buffers made for 1, then again for 3; views kept for 3 and made for 2) give the op-table bits."""
    rows = (1, 3, 2, 3, 1, 2)
    model.__dict__.pop("_decode_program", None)  # a new program: its first buffers are made for one row
    fused, fc, calls = _run(model, True, monkeypatch, rows=rows)
    plain, pc, _ = _run(model, False, monkeypatch, rows=rows)
    assert calls == [False] + [True] * len(rows)
    assert torch.equal(fused, plain)
    for a, b in zip(fc.kv + fc.conv + fc.ssm, pc.kv + pc.conv + pc.ssm):
        assert torch.equal(a, b)


def test_a_decode_row_is_the_same_in_a_fused_and_a_mixed_step(model, monkeypatch):
    m = model
    fused, _, _ = _run(m, True, monkeypatch)
    mixed, _, calls = _run(m, True, monkeypatch, with_prefill_at=2)
    assert calls == [False, True, True, False, True, True]  # the step with a prefill chunk: the op-table path
    assert torch.equal(fused, mixed)


def test_layers_that_do_not_qualify_take_the_op_table_path(monkeypatch):
    """fp32 weights (F.linear, not the packed kernel) never take the compiled call; the torch kernels neither."""
    from deltaserve.embedded.model import ensure_model
    from deltaserve.model.loader import load_model
    from model_driver import greedy

    fp32 = load_model(ensure_model("tiny", seed=0), dtype="float32")
    seen = []
    real = program.decode_step
    monkeypatch.setattr(program, "decode_step", lambda *a: seen.append(real(*a)))
    greedy(fp32, list(range(100, 120)), 3)
    assert seen and all(s is None for s in seen)
    seen.clear()
    m = load_model(ensure_model("tiny", seed=0), dtype="bfloat16")
    m.select_decode_kernels("torch")
    greedy(m, list(range(100, 120)), 3)
    assert seen and all(s is None for s in seen)  # the torch kernels: no program


def test_the_program_follows_weights_changed_in_place(model, monkeypatch):
    """A_log and the conv weight are held derived (-exp(A_log), tap-major): changed in place, the program is
    rebuilt and keeps the op-table path's bits."""
    m = model
    mixer = m.layers[0].linear_attn
    keep = mixer.A_log.clone(), mixer.conv_weight.clone()
    before, _, _ = _run(m, True, monkeypatch)
    try:
        mixer.A_log.add_(0.5)
        mixer.conv_weight.mul_(0.5)
        fused, _, calls = _run(m, True, monkeypatch)
        plain, _, _ = _run(m, False, monkeypatch)
        assert calls == [False] + [True] * 5
        assert torch.equal(fused, plain) and not torch.equal(fused, before)
    finally:
        mixer.A_log.copy_(keep[0])
        mixer.conv_weight.copy_(keep[1])


# ---- verify spans (speculative decoding: docs/speculative.md) ----------------------------------------------------

def _with_state_log(caches, positions: int):
    """caches with the runner's state log (CacheStore.enable_state_log's tensors), written by CacheStore.log_states
    (the op-table path's writer) or by the compiled verify step itself; and the store, for CacheStore.rollback."""
    import functools
    from types import SimpleNamespace

    from deltaserve.runner.cache import CacheStore

    store = SimpleNamespace(conv=caches.conv, ssm=caches.ssm)
    CacheStore.enable_state_log(store, positions)
    caches.log_conv, caches.log_x, caches.log_g, caches.log_beta = store.log_conv, store.log_x, store.log_g, \
        store.log_beta
    caches.log_state = functools.partial(CacheStore.log_states, store)
    return caches, store


def _verify_run(model, fused: bool, monkeypatch, drafts: tuple[tuple[int, ...], ...], positions: int = 3):
    """Three sequences prefilled, then verify steps: at step t sequence i decodes its last token and drafts[t][i]
    draft tokens (0: a plain one-token span; None: it waits), every draft kept (the next step goes on after it,
    once CacheStore.rollback has replayed the drafts into the slot, as the engine does).
    Returns the logits of every step's rows, the caches, a copy of the state log after each step and which steps
    the compiled call computed."""
    from deltaserve.runner.cache import CacheStore
    from model_driver import Sequence, make_caches, step

    calls = _spy_decode_step(monkeypatch, fused)
    caches, store = _with_state_log(make_caches(model, num_slots=5, num_pages=16, block_size=64), positions)
    seqs = [Sequence(slot=4, pages=[5, 1]), Sequence(slot=0, pages=[0, 7]), Sequence(slot=2, pages=[4, 2, 9])]
    ids = list(range(100, 170))
    out = step(model, caches, [(s, ids[:n], False) for s, n in zip(seqs, (70, 61, 62))])  # 61, 62: page edges next
    toks = [int(o[-1].argmax()) for o in out]
    logits, logs = [], []
    for t, ks in enumerate(drafts):
        work = [(s, [tok] + [(tok * 7 + 13 * j + t) % 4000 for j in range(1, k + 1)], True)
                for s, tok, k in zip(seqs, toks, ks) if k is not None]
        out = step(model, caches, work)
        logits.append(torch.cat(out))
        logs.append([t.clone() for t in caches.log_conv + caches.log_x + caches.log_g + caches.log_beta])
        j = 0
        for i, k in enumerate(ks):
            if k:
                CacheStore.rollback(store, seqs[i].slot, k, model.replay_gdn)
            if k is not None:
                toks[i] = int(out[j][-1].argmax())
                j += 1
    return torch.cat(logits), caches, logs, calls


@pytest.mark.parametrize("drafts", [
    ((1,), (2,), (3,), (3,)),  # batch 1, k = 1, 2, 3
    ((3, 1, 2), (2, None, 3), (0, 3, 1), (3, 3, 3), (1, 0, None)),  # mixed span lengths, plain spans among them
], ids=["batch1", "mixed"])
def test_the_compiled_verify_step_has_the_op_table_bits(model, monkeypatch, drafts):
    """Verify spans in the compiled call (DecodeModel.run_verify): every row's logits, the KV pages, the conv and GDN
    slots and the state log after every step are the op-table path's bits; the steps really took the call."""
    fused, fc, flog, calls = _verify_run(model, True, monkeypatch, drafts)
    plain, pc, plog, _ = _verify_run(model, False, monkeypatch, drafts)
    assert calls == [False] + [True] * len(drafts)
    assert torch.equal(fused, plain)
    for a, b in zip(fc.kv + fc.conv + fc.ssm, pc.kv + pc.conv + pc.ssm):
        assert torch.equal(a, b)
    for step_f, step_p in zip(flog, plog):
        for a, b in zip(step_f, step_p):
            assert torch.equal(a, b)
    assert any(t.abs().sum() > 0 for t in flog[-1])  # the log was written


def test_a_verify_step_without_a_state_log_takes_the_op_table_path(model):
    """No log tensors (a caller that logs through log_state alone): the compiled call declines the step."""
    from deltaserve.model.batch import ForwardBatch
    from model_driver import make_caches

    caches = make_caches(model, num_slots=2, num_pages=4, block_size=64)
    batch = ForwardBatch.build([([5, 6, 7], 10, 1, [0], True, ())])
    assert program.decode_step(model, batch, caches) is None
