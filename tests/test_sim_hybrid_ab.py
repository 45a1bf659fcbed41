"""`deltaserve simulate hybrid-ab`: the hybrid bundle reader (sim/external_hybrid.py), the closed-loop agent sessions
(sim/sessions.py) and the cache-layout A/B (sim/hybrid_ab.py), on the trimmed excerpt of LLMServingSim's Qwen3.8-27B
tables (deltaserve/sim/tables/qwen3.8-27b, MIT). Expected figures are the tables' rows summed by hand."""
from __future__ import annotations

import shutil

import pytest

from deltaserve.errors import ConfigError
from deltaserve.sim.external_hybrid import HybridBundle, HybridLatency
from deltaserve.sim.hybrid_ab import (
    DEFAULT_BUNDLE,
    SCENARIOS,
    Arm,
    Scenario,
    main,
    model_config,
    pool_bytes,
    run_scenario,
)
from deltaserve.sim.latency import StepShape
from deltaserve.sim.sessions import SessionSpec

FIX = DEFAULT_BUNDLE


@pytest.fixture(scope="module")
def lat():
    return HybridLatency(HybridBundle(FIX), n_attn=16, n_gdn=48)


# ------------------------------------------------------------------------------------------------ the reader

def test_block_size_and_geometry_are_the_bundles():
    assert HybridBundle(FIX).block_size == 784
    mc = model_config()
    assert (len(mc.attn_layers), len(mc.gdn_layers)) == (16, 48)


def test_one_decode_summed_by_hand(lat):
    """64 layers of 2 layernorms, gate_up, act, down; 16 attention layers of qkv, q/k norm + rope, o, glue and the
    attention row; 48 GDN layers of in/out projections, gated norm, glue and the decode regime's two kernels; once
    embedding and final norm; lm_head and sampler for one sequence."""
    every = 2 * 18.2655 + 248.119 + 3.55208 + 121.081
    attn = 98.006 + 2.112 + 45.9523 + 9.23767
    gdn = 123.691 + 45.5326 + 1.38311 + 0.789333
    dense = 3.104 + 18.6563 + 64 * every + 16 * attn + 48 * gdn
    s = StepShape(prefill=[], decode_ctx=[16], n_sample=1)
    parts = lat.parts_us(s)
    assert parts["dense"] == pytest.approx(dense)
    assert parts["attention"] == pytest.approx(16 * 27.518)
    assert parts["gdn"] == pytest.approx(48 * (3.31767 + 2.99733))
    assert parts["head"] == pytest.approx(15249.9 + 101.856)
    assert lat.step_us is not None and lat.shape_us(s) == pytest.approx(sum(parts.values()))


def test_gdn_kernels_by_regime(lat):
    """A kernel that does not fire in a regime is charged nothing there."""
    assert lat.gdn_layer_us(128, 0) == pytest.approx(5.91033 + 11.2317 + 118.26)  # conv, post-conv, chunked
    assert lat.gdn_layer_us(0, 4) == pytest.approx(6.859 + 34.741)  # conv step, recurrent step
    assert lat.gdn_layer_us(128, 4) == pytest.approx(10.2727 + 10.9017 + 118.358 + 40.6933)  # + the mixed decode
    assert lat.gdn_layer_us(0, 0) == 0.0


def test_contexts_beyond_the_grid_grow_linearly(lat):
    """Past the grid's 16,384 a context token costs what the last doubling cost; never negative, monotone."""
    d = lat.decode_slope_us(1)
    assert d == pytest.approx((212.321 - 135.49) / 8192)
    assert lat._attn(0, 0, 1, 32768) == pytest.approx(212.321 + 16384 * d)
    p = lat.prefill_slope_us(1024)
    assert p == pytest.approx((5698.41 - 2957.22) / 8192)
    assert lat._attn(1024, 40000, 0, 0) == pytest.approx(5698.41 + (40000 - 16384) * p)
    prev = 0.0
    for kp in (0, 8192, 16384, 32768, 65536):
        t = lat._attn(784, kp, 3, kp + 784)
        assert t > prev
        prev = t


def _copy(tmp_path):
    dst = tmp_path / "b"
    shutil.copytree(FIX, dst)
    return dst


def test_tables_that_break_the_split_are_refused(tmp_path):
    b = _copy(tmp_path)
    with open(b / "tp1" / "dense.csv", "a") as f:
        f.write("moe_experts,1,5.0\n")
    with pytest.raises(ConfigError, match="moe_experts"):
        HybridLatency(HybridBundle(str(b)), 16, 48)
    b = _copy(tmp_path / "2")
    rows = (b / "tp1" / "linear_attention.csv").read_text().splitlines()
    (b / "tp1" / "linear_attention.csv").write_text("\n".join(r for r in rows if "gdn_decode_mixed" not in r) + "\n")
    with pytest.raises(ConfigError, match="regimes"):
        HybridLatency(HybridBundle(str(b)), 16, 48)
    b = _copy(tmp_path / "3")
    with open(b / "tp1" / "attention.csv", "a") as f:
        f.write("attention,0,0,1,16,2,30.0\n")
    with pytest.raises(ConfigError, match="speculative"):
        HybridLatency(HybridBundle(str(b)), 16, 48)
    b = _copy(tmp_path / "4")
    (b / "meta.yaml").write_text((b / "meta.yaml").read_text().replace("architecture: qwen3_5", "architecture: llama"))
    with pytest.raises(ConfigError, match="llama"):
        HybridBundle(str(b))


# ------------------------------------------------------------------------------------------------ the sessions

def test_session_spec_turns_and_refusals():
    spec = SessionSpec()
    assert spec.turns == 18 and spec.prompt_tokens(17) == 63_816 and spec.prompt_tokens(17) + 200 <= 65_536
    with pytest.raises(ValueError, match="unknown session option"):
        SessionSpec.from_dict({"sessions": 2, "turn_count": 3})
    with pytest.raises(ValueError, match="shared_tokens"):
        SessionSpec(shared_tokens=0)


SMALL = SessionSpec(sessions=4, start_tokens=4096, end_tokens=16384, shared_tokens=2048, new_tokens=1024,
                    output_tokens=16)


def _small(arms, sessions=4, baseline="per-block"):
    from dataclasses import replace
    return Scenario("small", "test", replace(SMALL, sessions=sessions), arms, baseline=baseline,
                    max_num_seqs=sessions)


def test_closed_loop_turns_follow_their_answers(lat):
    """Each turn arrives when its session's previous answer ends; every turn runs; prompts grow as specified."""
    sc = _small((Arm("in-page", "in-page", pool_tokens=120_000),), sessions=2, baseline="in-page")
    run = run_scenario(sc, lat)["in-page"].run
    assert len(run.records) == 2 * SMALL.turns
    by = {(r.session, r.turn): r for r in run.records}
    for (s, t), r in by.items():
        assert r.prompt_tokens == SMALL.prompt_tokens(t) and r.finish is not None
        if t:
            assert r.arrival == by[(s, t - 1)].finish
    assert run.wall_s == max(r.finish for r in run.records)
    assert run.hit_rate() > 0.7  # later turns resume from the previous prompt's checkpoints


def test_pool_bytes_give_the_logged_pool():
    mc = model_config()
    for kind, tokens in (("in-page", 288_446), ("per-block", 332_282), ("off", 291_369)):
        a = Arm(kind, kind, pool_tokens=tokens)
        from deltaserve.scheduler.build import resolve_shape
        shape = resolve_shape(mc, kv_cache_memory=pool_bytes(mc, a, tokens, 4), max_num_seqs=4, cache_layout=a.layout,
                              enable_prefix_caching=a.caching, kernel_alignment=a.alignment, max_model_len=65536)
        assert shape.block_size == 784 and abs(shape.pool.pool_tokens - tokens) <= 784 // 2
    a = Arm("pb", "per-block", pool_tokens=332_282, state_blocks_per_seq=6)  # 6 blocks a seat held back
    from deltaserve.scheduler.build import resolve_shape
    shape = resolve_shape(mc, kv_cache_memory=pool_bytes(mc, a, 332_282, 8), max_num_seqs=8, cache_layout="per-block",
                          kernel_alignment=a.alignment, max_model_len=65536)
    assert abs(shape.pool.pool_tokens - (332_282 - 8 * 6 * 784)) <= 784 // 2


def test_per_block_pool_that_cannot_hold_the_live_context_loses_its_hits(lat):
    """The mechanism: 4 sessions grow to 16K (64K of live context); a per-block pool of 40K tokens cannot hold it, so
    cached prefixes are evicted and later turns recompute (hits collapse, wall and TTFT grow); an in-page pool of
    100K holds it. With 2 sessions (32K) both fit and the arms tie."""
    arms = (Arm("per-block", "per-block", pool_tokens=40_000), Arm("in-page", "in-page", pool_tokens=100_000))
    res = run_scenario(_small(arms), lat)
    pb, ip = res["per-block"].run, res["in-page"].run
    assert ip.hit_rate() > 0.75 and pb.hit_rate() < ip.hit_rate() - 0.2
    assert pb.counters["evictions"] > 0
    assert pb.wall_s > 1.2 * ip.wall_s
    assert sum(pb.later_ttft()) > 2 * sum(ip.later_ttft())
    res = run_scenario(_small(arms, sessions=2), lat)
    pb, ip = res["per-block"].run, res["in-page"].run
    assert pb.hit_rate() == pytest.approx(ip.hit_rate())
    assert pb.wall_s == pytest.approx(ip.wall_s, rel=0.02)


def test_scenarios_are_well_formed():
    names = [s.name for s in SCENARIOS]
    assert names == ["caching-4", "layout-8", "layout-4"]
    with pytest.raises(ConfigError, match="kind"):
        Arm("x", "paged")
    with pytest.raises(ConfigError, match="pool_tokens or same_bytes_as"):
        Arm("x", "runs")
    with pytest.raises(ConfigError, match="state_blocks_per_seq"):
        Arm("x", "per-block", same_bytes_as="y", state_blocks_per_seq=6)


def test_command_prints_the_side_by_side_table(capsys):
    assert main(["--scenario", "layout-4", "--sessions-end", "12000", "--step-scale", "1.4,0.45"]) == 0
    out = capsys.readouterr().out
    assert "### layout-4" in out and "| per-block / in-page |" in out and "(251)" in out and "(254)" in out
    assert "| per-block, state blocks / in-page |" in out
    with pytest.raises(ConfigError, match="PREFILL,DECODE"):
        main(["--scenario", "layout-4", "--step-scale", "2"])


def test_runs_pages_keep_the_prompt_checkpoint_a_next_turn_resumes_from(lat):
    """64-token pages: every 200-token answer completes blocks, whose decode checkpoints replace the prompt's. The
    next turn re-sends the answer as prompt tokens (hashed apart from the request's own output blocks), so the
    prompt's checkpoint is where it resumes: it must not be the first thing evicted (it was, and hits fell to 26%)."""
    from dataclasses import replace
    spec = replace(SMALL, output_tokens=200)
    sc = Scenario("runs", "test", spec, (Arm("runs", "runs", pool_tokens=80_000),), baseline="runs", max_num_seqs=4)
    run = run_scenario(sc, lat)["runs"].run
    assert run.counters["evictions"] > 0  # under pressure
    assert run.hit_rate() > 0.6
