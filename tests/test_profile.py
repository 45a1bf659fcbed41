"""The profiler: a quick bundle of the tiny model on this machine, its tables, coverage, and the latency model
built from it; the instrumented forward conserves time."""
from __future__ import annotations

import os
import time

import pytest
import torch

from deltaserve.config import ModelConfig  # noqa: E402
from deltaserve.profile import make_engine  # noqa: E402
from deltaserve.profile.coverage import coverage, format_coverage  # noqa: E402
from deltaserve.profile.grid import make_grid  # noqa: E402
from deltaserve.profile.instrument import Instrument  # noqa: E402
from deltaserve.profile.profiler import Profiler  # noqa: E402
from deltaserve.profile.run import profile  # noqa: E402
from deltaserve.sim.bundle import GDN_KERNELS, TABLES, load_bundle  # noqa: E402
from deltaserve.sim.latency import LatencyModel, StepShape  # noqa: E402

MiB = 1 << 20


@pytest.fixture(scope="module")
def engine():
    return make_engine(preset="tiny", num_threads=1, max_num_seqs=4, max_num_batched_tokens=128,
                       kv_cache_memory=32 * MiB)


@pytest.fixture(scope="module")
def bundle_dir(engine, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("prof") / "tiny")
    profile(engine, out, quick=True, repeats=2, max_context=512, progress=False, source="preset:tiny")
    return out


def test_quick_bundle_has_every_table_and_the_meta(bundle_dir, engine):
    for name in TABLES:
        assert os.path.exists(os.path.join(bundle_dir, name)), name
    b = load_bundle(bundle_dir)
    m = b.meta
    assert m["model"]["model_type"] == "qwen3_5_text" and m["layers"] == {"gdn": 6, "attention": 2, "total": 8}
    assert b.block_size(1) == engine.block_size == 64 and b.block_size(2) is not None  # the runs layout
    assert m["engine_resolved"]["per_tp"][1]["layout"] == "runs"
    assert m["dtypes"] == {"model": "bfloat16", "kv": "bfloat16", "conv": "bfloat16", "ssm": "float32"}
    assert m["versions"]["torch"] and m["hardware"]["torch_threads"] == 1 and m["profile"]["timer"] == "cpu"
    cal = m["calibration"]
    assert cal["steps"] > 10 and cal["fixed_us"] >= 0 and cal["per_seq_us"] >= 0 and cal["wall_per_cpu"] > 0
    assert b.config.get("text_config", b.config)["num_hidden_layers"] == 8  # the text model's (a multimodal config nests it)
    assert ModelConfig.from_hf(b.config).num_hidden_layers == 8


def test_vision_encoder_is_timed_per_image_by_its_patches(bundle_dir):
    """tiny has a vision tower: one image through the encoder at each grid of the quick profile, its time growing
    with the patches, read back by the latency model (what a simulated image request pays)."""
    rows = load_bundle(bundle_dir).rows("vision_encoder.csv")
    assert [r["tokens"] for r in rows] == [64, 196, 784] and all(r["patches"] == 4 * r["tokens"] for r in rows)
    assert all(r["time_us"] > 0 for r in rows) and rows[-1]["time_us"] > rows[0]["time_us"]
    lm = LatencyModel(load_bundle(bundle_dir))
    shape = StepShape(prefill=[(256, 0)], decode_ctx=[], n_sample=1, encoder_images=(196,))
    assert lm.encoder_us(shape) == pytest.approx(rows[1]["time_us"])


def test_gdn_kernels_are_kept_apart_by_regime(bundle_dir):
    b = load_bundle(bundle_dir)
    rows = b.rows("linear_attention.csv")
    for r in rows:
        if r["kernel"] in GDN_KERNELS:
            assert r["regime"] == GDN_KERNELS[r["kernel"]], r
            assert (r["n_decode"] == 0) if r["regime"] == "prefill" else (r["prefill_tokens"] == 0)
            assert r["time_us"] > 0
    assert {r["regime"] for r in rows} == {"prefill", "decode", "mixed"}
    dense = {r["kernel"] for r in b.rows("dense.csv")}
    assert not dense & set(GDN_KERNELS)  # regime-dependent kernels never sit in dense
    assert {"gdn_in_proj", "gdn_out_proj", "gdn_norm", "gdn_glue", "mlp", "lm_head", "sampler"} <= dense


def test_coverage_reports_nothing_missing(bundle_dir):
    b = load_bundle(bundle_dir)
    cov = coverage(b)
    assert cov["missing"] == [] and cov["calibrated"]
    text = format_coverage(b, cov)
    assert "gdn_conv_decode" in text and "does not fire" in text and "tp1=64" in text


def test_latency_model_from_a_profiled_bundle(bundle_dir):
    lm = LatencyModel(load_bundle(bundle_dir))
    a = lm.shape_us(StepShape([(16, 0)], [], 1))
    b = lm.shape_us(StepShape([(128, 0)], [], 1))
    d1 = lm.shape_us(StepShape([], [200], 1))
    d4 = lm.shape_us(StepShape([], [200] * 4, 4))
    assert 0 < a < b and 0 < d1 < d4


def test_instrumented_forward_conserves_time(engine):
    prof = Profiler(engine, make_grid(True, 128, 4, 512, 2), progress=False)
    work = prof.work([(40, 0, False), (1, 99, True), (1, 150, True)])
    batch = engine.runner.build_batch(work)
    model, plain_ops = engine.model, engine.model.ops
    with torch.inference_mode(), Instrument(model, time.perf_counter) as ins:
        t = time.perf_counter()
        ins.forward(batch, engine.store.caches())
        total = (time.perf_counter() - t) * 1e6
        ev = ins.take()
    kinds = {k for k, _, _ in ev}
    assert {"gdn_conv_prefill", "gdn_prefill", "gdn_conv_decode", "gdn_decode", "attn_prefill", "attn_decode",
            "mlp", "gdn_in_proj", "attn_qkv_proj", "model", "layer"} <= kinds
    assert sum(us for _, _, us in ev) == pytest.approx(total, rel=0.05)
    dec = sorted(key for k, key, _ in ev if k == "attn_decode")
    if model.decode_kernels.compiled:  # one call per attention layer for all decode sequences, keyed by B
        assert dec == [2, 2]
    else:  # one call per sequence, keyed by its context length
        assert dec == [100, 100, 151, 151]
    # and the model is its plain self: its own op table, no hooks left on any module
    assert model.ops is plain_ops and all(not getattr(m, "_forward_hooks") and not getattr(m, "_forward_pre_hooks")
                                          for m in model.modules())


def test_every_op_has_a_kernel_name(engine):
    """An op the profiler cannot name is refused, so a new or renamed op never hides its time in its caller's."""
    import dataclasses

    from deltaserve.model.ops.table import Ops

    @dataclasses.dataclass(frozen=True)
    class MoreOps(Ops):
        fresh_op: object = None

    model, plain = engine.model, engine.model.ops
    try:
        model.ops = MoreOps(**{n: getattr(plain, n) for n in Ops.names()}, fresh_op=lambda x: x)
        with pytest.raises(RuntimeError, match="fresh_op"):
            Instrument(model, time.perf_counter)
    finally:
        model.ops = plain
    Instrument(model, time.perf_counter)  # the real table: every op named


def test_every_kernel_the_latency_model_needs_gets_time(bundle_dir):
    """Each kernel the latency model prices (sim/bundle.py) was measured at > 0 somewhere in a profile."""
    from deltaserve.sim.bundle import ATTENTION_KERNELS, DENSE_KERNELS

    b = load_bundle(bundle_dir)
    timed: dict[str, float] = {}
    for table in ("dense.csv", "linear_attention.csv", "attention.csv"):
        for r in b.rows(table):
            timed[r["kernel"]] = max(timed.get(r["kernel"], 0.0), float(r["time_us"]))
    needed = set(DENSE_KERNELS) | set(GDN_KERNELS) | set(ATTENTION_KERNELS)
    assert {k for k in needed if timed.get(k, 0.0) <= 0} == set()


def test_cli_profile_and_coverage(bundle_dir, capsys):
    from deltaserve.profile import main

    assert main(["coverage", bundle_dir]) == 0
    assert "missing: nothing" in capsys.readouterr().out


def test_calibration_fits_the_decode_offset_and_the_cold_decode_after_a_prefill(bundle_dir):
    """Synthetic steps priced by the bundle's own tables plus known extras: the fit gives the extras back,
    and the latency model charges them to decode-only steps (the cold one only right after a prefill)."""
    import random

    from deltaserve.profile.fit import fit_calibration

    lm = LatencyModel(load_bundle(bundle_dir), wall_per_cpu=1.0)
    lm.compute_scale = lm.compute_scale_decode = 1.0  # price the synthetic steps with the bare tables
    lm.fixed_us = lm.per_seq_us = lm.per_prefill_us = lm.decode_fixed_us = lm.after_prefill_us = 0.0
    rng = random.Random(3)
    rows, prev_prefill = [], False
    for i in range(160):
        if i % 5 == 0:
            s = StepShape([(rng.choice([16, 64, 128]), 0)], [200] * rng.randint(0, 2), 1, after_prefill=prev_prefill)
        else:
            n = rng.randint(1, 4)
            s = StepShape([], [rng.randint(50, 400) for _ in range(n)], n, after_prefill=prev_prefill)
        us = lm.shape_us(s) + 30.0 * s.n_seqs + (-200.0 + (900.0 if s.after_prefill else 0.0) if s.decode_only else 0.0)
        rows.append({"_shape": s, "cpu_us": us, "measured_us": us})
        prev_prefill = bool(s.prefill)
    fit = fit_calibration(rows, lm, "cpu")
    assert fit["decode_fixed_us"] == pytest.approx(-200.0, abs=15) and fit["after_prefill_us"] == pytest.approx(900.0, abs=15)
    assert fit["per_seq_us"] == pytest.approx(30.0, abs=5) and abs(fit["total_error_pct"]) < 0.5
    cal = LatencyModel(load_bundle(bundle_dir), wall_per_cpu=1.0)
    cal.decode_fixed_us, cal.after_prefill_us = fit["decode_fixed_us"], fit["after_prefill_us"]
    assert fit["compute_scale"] == fit["compute_scale_decode"] == pytest.approx(1.0, abs=0.01)
    warm, cold = StepShape([], [200], 1), StepShape([], [200], 1, after_prefill=True)
    mixed = StepShape([(16, 0)], [200], 2, after_prefill=True)
    assert cal.shape_us(cold) - cal.shape_us(warm) == pytest.approx(fit["after_prefill_us"])
    bare = LatencyModel(load_bundle(bundle_dir), wall_per_cpu=1.0)
    bare.decode_fixed_us = bare.after_prefill_us = 0.0
    assert cal.overhead_us(mixed) == bare.overhead_us(mixed)  # neither extra touches a step with prompt tokens


def test_a_verify_step_is_priced_as_its_rows(bundle_dir):
    """A speculative verify span (the last token and its k drafts) is k + 1 decode rows, each attending to its own
    context and sampled: priced as four one-token decodes at those contexts, above one decode."""
    from deltaserve.scheduler.plan import SeqWork, StepPlan

    def plan(n: int):
        w = SeqWork("r", tuple(range(n)), 199, 0, (0, 1, 2, 3), True, True, num_drafts=n - 1)
        return StepPlan(work=[w])

    lm = LatencyModel(load_bundle(bundle_dir))
    shape = StepShape.of(plan(4))
    assert shape.decode_ctx == [200, 201, 202, 203] and shape.n_sample == 4 and shape.n_tokens == 4
    assert StepShape.of(plan(1)).decode_ctx == [200]
    assert lm.step_us(plan(4)) == lm.shape_us(StepShape([], [200, 201, 202, 203], 4)) > lm.step_us(plan(1))
