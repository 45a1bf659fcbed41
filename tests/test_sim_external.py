"""`deltaserve simulate external`: LLMServingSim's bundle format as a latency model (sim/external.py), our scheduler
replaying another engine's run (sim/external_replay.py) and the request-by-request comparison (external_compare.py).

Every table here is synthetic and multilinear in its keys, so interpolation must reproduce it exactly."""
from __future__ import annotations

import csv
import json
import os

import pytest
import yaml

from deltaserve.config import ConfigError
from deltaserve.scheduler import Request
from deltaserve.scheduler.build import resolve_shape
from deltaserve.sim import main as simulate_main
from deltaserve.sim.external import LAYER_OPS, Comm, ExternalBundle, ExternalLatency, ScatteredGrid
from deltaserve.sim.external_compare import (Timing, compare, main as external_main, measured_timing,
                                             read_reference_summary, simulated_timing, table)
from deltaserve.sim.external_replay import (ExternalRequest, ForeignEngine, dense_model_config, dense_weight_bytes,
                                            kv_all_ranks, read_workload, replay, vllm_kv_bytes)
from deltaserve.sim.latency import StepShape
from deltaserve.sim.report import RequestRecord

MiB = 1 << 20
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
         "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 64,
         "vocab_size": 1000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
         "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
AXES = {"pc": "raw pc value (profiled grid point)",
        "n_bins": [0, 2, 4, 8, 1000000], "n_labels": ["n<=2", "n<=4", "n<=8", "n>8"],
        "skew_rate_bins": [-0.01, 0.05, 0.4, 1.01], "skew_rate_labels": ["sr<=5%", "sr<=40%", "sr>40%"],
        "kv_big_bins": [0, 1024, 4096, 1000000000], "kv_big_labels": ["kvB<=1k", "kvB<=4k", "kvB>4k"],
        "kp_bins": [-1, 0, 512, 1000000000], "kp_labels": ["kp=0", "kp<=512", "kp>512"]}


def f_decode(n, kv):  # pure decode: one attention layer, us
    return 5 + 0.01 * n * kv


def f_mixed(pc, kp, n, kv):  # a prefill chunk in the batch: another kernel path (+3 us, twice the decode slope)
    return 8 + 0.002 * pc * kp + 0.003 * pc + 0.02 * n * kv


def layer_op(t):
    return 1 + 0.01 * t


def write_bundle(root, skew: bool = True, extra_op: str | None = None, tps: tuple[int, ...] = (1,)) -> str:
    """A bundle like LLMServingSim's: meta.yaml + tp<N>/{dense,attention,per_sequence,skew_fit}.csv (the same
    tables for every N)."""
    for tp in tps:
        _write_tables(os.path.join(root, f"tp{tp}"), extra_op)
    meta = {"vllm_version": "0.19.0", "architecture": "llama", "tp_degrees": list(tps),
            "skew_fit": {"enabled": skew, "bucket_axes": AXES,
                         "per_tp": {tp: {"alpha_default": 0.1, "bucket_table": f"tp{tp}/skew_fit.csv"} for tp in tps}}}
    with open(os.path.join(root, "meta.yaml"), "w") as f:
        yaml.safe_dump(meta, f)
    return str(root)


def _write_tables(tp1: str, extra_op: str | None) -> None:
    os.makedirs(tp1, exist_ok=True)
    toks = [1, 8, 64, 512, 2048]
    with open(os.path.join(tp1, "dense.csv"), "w") as f:
        f.write("layer,tokens,time_us\n")
        for op in list(LAYER_OPS) + ([extra_op] if extra_op else []):
            f.writelines(f"{op},{t},{layer_op(t)}\n" for t in toks)
        f.writelines(f"embedding,{t},{5 + 0.001 * t}\n" for t in toks)
        f.writelines(f"final_layernorm,{t},{3 + 0.002 * t}\n" for t in toks)
    with open(os.path.join(tp1, "per_sequence.csv"), "w") as f:
        f.write("layer,sequences,time_us\n")
        for s in (1, 8, 64, 256):
            f.write(f"lm_head,{s},{100 + s}\nsampler,{s},{10 + 0.5 * s}\n")
    kvs = [16, 64, 256, 1024, 4096, 16384]
    ns = [1, 2, 4, 8, 16, 64, 128]
    with open(os.path.join(tp1, "attention.csv"), "w") as f:
        f.write("prefill_chunk,kv_prefill,n_decode,kv_decode,time_us\n")
        f.writelines(f"0,0,{n},{kv},{f_decode(n, kv)}\n" for n in ns for kv in kvs)
        for pc in (16, 64, 256, 1024, 2048):  # the x2 lattice
            for kp in (0, 64, 512, 4096):
                f.write(f"{pc},{kp},0,0,{f_mixed(pc, kp, 0, 0)}\n")
                f.writelines(f"{pc},{kp},{n},{kv},{f_mixed(pc, kp, n, kv)}\n" for n in ns for kv in kvs)
        for pc in (96, 384):  # a sparser x1.5 lattice: fewer contexts, not the short ones
            for kp in (0, 768):
                f.write(f"{pc},{kp},0,0,{f_mixed(pc, kp, 0, 0)}\n")
                f.writelines(f"{pc},{kp},{n},{kv},{f_mixed(pc, kp, n, kv)}\n" for n in ns for kv in (512, 768))
    with open(os.path.join(tp1, "skew_fit.csv"), "w") as f:
        f.write("pc,n_label,skew_rate_label,kv_big_label,kp_label,alpha,n_samples\n")
        f.write("0,n<=4,sr<=40%,kvB<=1k,kp=0,0.5,4\n64,n<=4,sr<=40%,kvB<=1k,kp=0,0.25,4\n"
                "16,n>8,sr>40%,kvB>4k,kp>512,0.9,1\n")


@pytest.fixture
def lat(tmp_path):
    return ExternalLatency(ExternalBundle(write_bundle(tmp_path / "b")), layers=2)


# ---------------------------------------------------------------------------------------------- the reader

def test_scattered_grid_is_exact_on_multilinear_data_over_a_union_of_lattices():
    pts = [((x, y), 1 + 2 * x + 3 * y + 0.5 * x * y) for x in (0, 2, 4) for y in (0, 10)]
    pts += [((3, y), 1 + 6 + 3 * y + 1.5 * y) for y in (5, 20)]  # x = 3 has other y's than its neighbours
    g = ScatteredGrid(pts)
    for x, y in [(1, 5), (3, 7), (2.5, 15), (4, 0), (3.5, 2)]:
        assert g(x, y) == pytest.approx(1 + 2 * x + 3 * y + 0.5 * x * y)
    assert g(6, 10) == pytest.approx(1 + 12 + 30 + 30)  # beyond the last x: the last segment's slope
    assert ScatteredGrid([((0,), 5.0), ((1,), 1.0)])(10) == 0.0  # never negative
    with pytest.raises(ValueError):
        g(1)


def test_dense_ops_are_per_layer_calls_times_layers_plus_once_per_step(tmp_path):
    b = ExternalBundle(write_bundle(tmp_path / "b"))
    for layers in (2, 32):
        lm = ExternalLatency(b, layers=layers)
        t = 10
        per_layer = sum(LAYER_OPS.values()) * layer_op(t)  # layernorm twice: input + post-attention
        assert lm.dense(t) == pytest.approx(5 + 0.001 * t + 3 + 0.002 * t + layers * per_layer)
    assert LAYER_OPS["layernorm"] == 2 and sum(LAYER_OPS.values()) == 8


def test_head_counts_every_sequence_of_the_step(lat):
    s = StepShape(prefill=[(300, 0)], decode_ctx=[100, 200], n_sample=2)  # a partial prefill: no sample
    assert lat.parts_us(s)["head"] == pytest.approx(100 + 3 + 10 + 1.5)


def test_attention_pure_decode_mixed_and_the_kernel_regime(lat):
    assert lat.attention_us(StepShape([], [100, 100, 100], 3)) == pytest.approx(f_decode(3, 100))
    assert lat.attention_us(StepShape([(100, 64)], [50, 50], 2)) == pytest.approx(f_mixed(100, 64, 2, 50))
    # a chunk shorter than the smallest profiled one is the mixed kernel at that chunk, not a blend toward decode
    assert lat.attention_us(StepShape([(4, 0)], [], 1)) == pytest.approx(f_mixed(16, 0, 0, 0))
    assert lat.attention_us(StepShape([(4, 0)], [300], 2)) == pytest.approx(f_mixed(16, 0, 1, 300))
    # the sparse x1.5 slices: pc 96 has contexts 512 / 768 only, and its neighbours' grid brackets the rest
    assert lat.attention_us(StepShape([(120, 700)], [600] * 8, 9)) == pytest.approx(f_mixed(120, 700, 8, 600))
    # further prefills add their prefill-only row above the smallest batch (one launch per layer)
    two = lat.attention_us(StepShape([(20, 30), (100, 0)], [], 2))
    assert two == pytest.approx(f_mixed(100, 0, 0, 0) + f_mixed(20, 30, 0, 0) - f_mixed(16, 0, 0, 0))
    s = StepShape([(100, 0)], [10], 2)
    assert lat.parts_us(s)["attention"] == pytest.approx(2 * lat.attention_us(s))  # per layer, times layers


def test_skew_correction_reads_the_bucket_and_defaults(tmp_path, lat):
    # contexts 100, 100, 400: mean 200, skew rate (200 - 100) / 300 = 1/3 -> sr<=40%, max 400 -> kvB<=1k, n<=4
    uneven = [100, 100, 400]
    t_mean, t_max = f_decode(3, 200), f_decode(3, 400)
    assert lat.attention_us(StepShape([], uneven, 3)) == pytest.approx(t_mean + 0.5 * (t_max - t_mean))
    # with a 50-token chunk: bucket pc 64 (nearest in log2 among 16, 64, 256, ...), alpha 0.25
    m_mean, m_max = f_mixed(50, 0, 3, 200), f_mixed(50, 0, 3, 400)
    assert lat.attention_us(StepShape([(50, 0)], uneven, 4)) == pytest.approx(m_mean + 0.25 * (m_max - m_mean))
    assert lat.skew.pc_point(50) == 64 and lat.skew.pc_point(20) == 16 and lat.skew.pc_point(0) == 0
    # a bucket the fit does not have: alpha_default (0.1); max 3000 -> kvB<=4k
    d_mean, d_max = f_decode(3, 1100), f_decode(3, 3000)
    assert lat.attention_us(StepShape([], [150, 150, 3000], 3)) == pytest.approx(d_mean + 0.1 * (d_max - d_mean))
    assert lat.attention_us(StepShape([], [300, 300], 2)) == pytest.approx(f_decode(2, 300))  # even: none
    off = ExternalLatency(ExternalBundle(write_bundle(tmp_path / "noskew", skew=False)), layers=2)
    assert off.attention_us(StepShape([], uneven, 3)) == pytest.approx(t_mean)
    right = lat.skew.alpha(0, 0, 4, 1024, 0.4)  # bins are right-inclusive: n 4 -> n<=4, 1024 -> kvB<=1k, 0.4 -> sr<=40%
    assert right == 0.5


def test_tp_collectives_and_bundle_errors(tmp_path):
    c = Comm(2, bandwidth=1e9, latency=1e-6)
    assert c.all_reduce_us(1000) == pytest.approx(2 + 1)
    assert c.all_gather_us(1000) == pytest.approx(1 + 0.5)
    assert Comm(1).all_reduce_us(1e9) == 0.0
    b = ExternalBundle(write_bundle(tmp_path / "b"))
    lm = ExternalLatency(b, 2, hidden_size=256, vocab_size=1000, dtype_bytes=2, comm=c)
    s = StepShape([], [10, 10], 2)
    assert lm.parts_us(s)["comm"] == pytest.approx(5 * c.all_reduce_us(2 * 256 * 2) + c.all_gather_us(2 * 1000 * 2))
    with pytest.raises(ConfigError, match="link bandwidth"):
        ExternalLatency(b, 2, comm=Comm(2))
    with pytest.raises(ConfigError, match="no tables for TP 2"):
        ExternalBundle(str(tmp_path / "b"), tp=2)
    with pytest.raises(ConfigError, match="q_norm"):
        ExternalLatency(ExternalBundle(write_bundle(tmp_path / "qk", extra_op="q_norm")), 2)
    with open(tmp_path / "b" / "tp1" / "per_sequence.csv", "w") as f:
        f.write("op,sequences,time_us\n")
    with pytest.raises(ConfigError, match="columns"):
        ExternalBundle(str(tmp_path / "b"))
    with pytest.raises(ConfigError, match="no meta.yaml"):
        ExternalBundle(str(tmp_path))


# ---------------------------------------------------------------------------------------------- the replay

def test_dense_config_weights_and_kv_budget():
    mc = dense_model_config(LLAMA)
    assert mc.layer_types == ("full_attention",) * 2 and not mc.gdn_layers
    h = 256
    per_layer = h * 4 * 64 * 2 + 2 * h * 2 * 64 + 3 * h * 512
    assert dense_weight_bytes(mc, 2) == (2 * 1000 * h + 2 * per_layer + 2 * 2 * h + h) * 2
    assert vllm_kv_bytes(1000, 0.9, 100) == 800
    with pytest.raises(ConfigError):
        vllm_kv_bytes(100, 0.5, 60)
    assert kv_all_ranks(mc, 1000, 2) == 2000  # a rank holds half the KV heads: the same bytes hold twice the tokens
    with pytest.raises(ConfigError, match="reads decoders"):
        dense_model_config({**LLAMA, "model_type": "qwen3_5_text"})


def test_foreign_engine_keeps_vllm_block_and_cuts_chunks_at_the_budget():
    mc = dense_model_config(LLAMA)
    shape, sched = ForeignEngine(max_num_seqs=8, max_num_batched_tokens=100).build(mc, 64 * MiB, "bfloat16")
    assert shape.block_size == 16  # cuda's kernel alignment, where this engine's own rounds up to 64
    assert resolve_shape(mc, kv_cache_memory=64 * MiB, max_num_seqs=8, enable_prefix_caching=False).block_size == 64
    for i in range(3):
        sched.add(Request(f"d{i}", [1] * 10, max_tokens=50))
    sched.update(sched.schedule(), {f"d{i}": 11 for i in range(3)})  # three prompts in, decoding now
    sched.add(Request("long", [1] * 500, max_tokens=5))
    plan = sched.schedule()
    work = {w.request_id: len(w.token_ids) for w in plan.work}
    assert work == {"d0": 1, "d1": 1, "d2": 1, "long": 97}  # not floored to 64 (vLLM has no GDN grid)


class ConstStep:
    def __init__(self, us):
        self.us = us

    def shape_us(self, s, now=0.0):
        return self.us


def _first_tokens(reqs, async_scheduling, max_num_seqs):
    mc = dense_model_config(LLAMA)
    _, sched = ForeignEngine(max_num_seqs=max_num_seqs, max_num_batched_tokens=256).build(mc, 64 * MiB, "bfloat16")
    recs, st = replay(sched, ConstStep(10_000), reqs, async_scheduling)
    return {r.request_id: (round(r.first_token, 6), round(r.finish, 6)) for r in recs}, st


def test_async_scheduling_sees_arrivals_and_freed_seats_one_step_later():
    # B arrives while A's first step runs: the plan for step 2 was made when step 1 started
    reqs = [ExternalRequest(0, 0.0, (1,) * 8, 3), ExternalRequest(1, 0.005, (1,) * 8, 2)]
    sync, _ = _first_tokens(reqs, False, 4)
    asy, _ = _first_tokens(reqs, True, 4)
    assert sync["req-1"][0] == pytest.approx(0.02) and asy["req-1"][0] == pytest.approx(0.03)
    # A finishes in step 2 and keeps its seat in the plan for step 3, so B (waiting for a seat) joins step 4
    reqs = [ExternalRequest(0, 0.0, (1,) * 8, 2), ExternalRequest(1, 0.0, (1,) * 8, 6),
            ExternalRequest(2, 0.0, (1,) * 8, 2)]
    sync, _ = _first_tokens(reqs, False, 2)
    asy, st = _first_tokens(reqs, True, 2)
    assert sync["req-2"][0] == pytest.approx(0.03) and asy["req-2"][0] == pytest.approx(0.04)
    assert asy["req-1"] == sync["req-1"] == (0.01, 0.06)
    # nothing else to run: the engine plans again at once (no step in flight to plan behind)
    one, _ = _first_tokens([ExternalRequest(0, 0.0, (1,) * 8, 2), ExternalRequest(1, 1.0, (1,) * 8, 2)], True, 1)
    assert one["req-1"] == (1.01, 1.02) and st["steps"] == 6


# ---------------------------------------------------------------------------------------------- the comparison

def test_the_measured_runs_definitions():
    d = {"queued_ts": 10.0, "first_token_ts": 10.5, "last_token_ts": 12.5, "output_toks": 5}
    t = measured_timing(d)
    assert (t.ttft, t.tpot, t.latency) == (0.5, 0.5, 2.5)
    assert measured_timing({**d, "output_toks": 1}).tpot is None
    r = RequestRecord("r", None, 0, 1.0, 10, 5, first_token=1.5, finish=3.5, output_tokens=5)
    s = simulated_timing(r)
    assert (s.ttft, s.tpot, s.latency) == (0.5, 0.5, 2.5)
    assert simulated_timing(RequestRecord("r", None, 0, 1.0, 10, 5)) is None
    real = [Timing(1.0, 0.1, 10.0), Timing(3.0, 0.3, 20.0)]
    sim = [Timing(1.1, 0.1, 11.0), Timing(2.7, 0.33, 20.0)]
    c = compare(real, sim)
    assert c["ttft"]["Mean"] == pytest.approx((2.0, 1.9, -5.0))
    assert c["ttft"]["Median"][0] == pytest.approx(2.0)
    assert c["tpot"]["P90"][0] == pytest.approx(0.1 + 0.9 * 0.2)
    assert c["latency"]["per-request |err| median %"] == pytest.approx(5.0)
    assert compare(real, [sim[0], None])["compared"] == 1


def test_reference_summary_is_read_and_shown_beside(tmp_path):
    p = tmp_path / "summary.txt"
    p.write_text("Metric   vLLM   Sim   Diff%\n-----\nTTFT Mean   1000.0   960.0   -4.0%\n"
                 "TPOT P99   37.3   37.6   +0.6%\n")
    ref = read_reference_summary(str(p))
    assert ref[("ttft", "Mean")] == (1000.0, 960.0, -4.0) and ref[("tpot", "P99")][2] == 0.6
    out = table(compare([Timing(1.0, 0.1, 10.0)], [Timing(1.0, 0.1, 10.0)]), ref)
    assert "LLMServingSim" in out and "-4.0%" in out and "TTFT Mean" in out
    (tmp_path / "other.txt").write_text("nothing like a summary\n")
    with pytest.raises(ConfigError):
        read_reference_summary(str(tmp_path / "other.txt"))


def _example(tmp_path, measured_rows=None):
    """A small example laid out like theirs: bundle, model config, workload, cluster config, measured run."""
    bundle = write_bundle(tmp_path / "perf")
    (tmp_path / "model.json").write_text(json.dumps(LLAMA))
    lines = []
    for i in range(12):
        n, m = 20 + 37 * i % 300, 3 + (7 * i) % 18
        lines.append({"input_toks": n, "output_toks": m, "arrival_time_ns": 5_000_000 + 100_000 * i,
                      "input_tok_ids": list(range(n)), "output_tok_ids": [0] * m})
    (tmp_path / "trace.jsonl").write_text("".join(json.dumps(d) + "\n" for d in lines))
    (tmp_path / "cluster.json").write_text(json.dumps(
        {"num_nodes": 1, "link_bw": 16, "link_latency": 20000,
         "nodes": [{"num_instances": 1, "instances": [{"model_name": "tiny-llama", "hardware": "X", "tp_size": 1,
                                                        "npu_mem": {"mem_size": 1, "mem_util": 0.9}}]}]}))
    run = tmp_path / "vllm"
    run.mkdir(exist_ok=True)
    (run / "meta.json").write_text(json.dumps({"engine_kwargs": {"max_num_seqs": 4, "max_num_batched_tokens": 128}}))
    rows = measured_rows or [{"request_id": f"bench-{i}", "input_toks": d["input_toks"],
                              "output_toks": d["output_toks"], "queued_ts": 100 + i, "first_token_ts": 100.2 + i,
                              "last_token_ts": 101 + i} for i, d in enumerate(lines)]
    (run / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["--bundle", bundle, "--model-config", str(tmp_path / "model.json"),
            "--trace", str(tmp_path / "trace.jsonl"),
            "--measured", str(run / "requests.jsonl"), "--cluster-config", str(tmp_path / "cluster.json"),
            "--output", str(tmp_path / "out.csv")]
    return args, lines


def test_the_command_end_to_end(tmp_path, capsys):
    args, lines = _example(tmp_path)
    assert simulate_main(["external"] + args) == 0  # routed by `deltaserve simulate`
    out = capsys.readouterr()
    assert "TTFT Mean" in out.out and "Latency P99" in out.out and "12/12 requests compared" in out.out
    assert "max_num_seqs 4, max_num_batched_tokens 128" in out.err  # the measured run's meta.json
    assert "blocks of 16 tokens" in out.err
    with open(tmp_path / "out.csv") as f:
        sim = list(csv.DictReader(f))
    assert len(sim) == 12 and all(float(r["sim_ttft"]) > 0 for r in sim)
    # the simulated run as the "measured" one: every figure agrees exactly, so the definitions are the same
    t0 = 1000.0
    rows = [{"input_toks": d["input_toks"], "output_toks": d["output_toks"],
             "queued_ts": t0 + float(r["arrival"]), "first_token_ts": t0 + float(r["arrival"]) + float(r["sim_ttft"]),
             "last_token_ts": t0 + float(r["arrival"]) + float(r["sim_latency"])} for d, r in zip(lines, sim)]
    args, _ = _example(tmp_path, rows)
    assert external_main(args + ["--quiet", "--max-num-seqs", "4"]) == 0
    out = capsys.readouterr().out
    diffs = [line.split()[4] for line in out.splitlines() if line.split()[:1] in (["TTFT"], ["TPOT"], ["Latency"])]
    assert len(diffs) == 15 and set(diffs) <= {"+0.0%", "-0.0%"}
    assert external_main(args + ["--quiet", "--max-num-seqs", "2"]) == 0  # a flag overrides meta.json: not equal now
    assert any(line.split()[4] not in ("+0.0%", "-0.0%") for line in capsys.readouterr().out.splitlines()
               if line.split()[:2] == ["TTFT", "Mean"])


def test_the_command_with_tensor_parallel_tables(tmp_path, capsys):
    args, _ = _example(tmp_path)
    write_bundle(tmp_path / "perf", tps=(1, 2))  # the same tables at TP 2: only the collectives differ
    assert external_main(args + ["--quiet"]) == 0
    one = list(csv.DictReader(open(tmp_path / "out.csv")))
    assert external_main(args + ["--tp", "2", "--link-bandwidth", "16", "--link-latency", "20"]) == 0
    assert "TP 2" in capsys.readouterr().err
    two = list(csv.DictReader(open(tmp_path / "out.csv")))
    assert all(float(b["sim_latency"]) > float(a["sim_latency"]) for a, b in zip(one, two))


def test_workload_and_measured_errors(tmp_path):
    args, lines = _example(tmp_path)
    assert [r.output_length for r in read_workload(str(tmp_path / "trace.jsonl"), 3)] == [d["output_toks"]
                                                                                         for d in lines[:3]]
    assert read_workload(str(tmp_path / "trace.jsonl"))[1].arrival == pytest.approx(1e-4)
    (tmp_path / "bad.jsonl").write_text(json.dumps({"input_toks": 3, "output_toks": 2}) + "\n")
    with pytest.raises(ConfigError, match="arrival_time_ns"):
        read_workload(str(tmp_path / "bad.jsonl"))
    rows = [{"input_toks": 1, "output_toks": 1, "queued_ts": 0, "first_token_ts": 1, "last_token_ts": 1}] * 12
    args, _ = _example(tmp_path, rows)
    with pytest.raises(ConfigError, match="measured 1 \\+ 1 tokens"):
        external_main(args + ["--quiet"])


REAL = os.environ.get("DELTASERVE_LLMSERVINGSIM")  # the root of LLMServingSim's published data, if present


@pytest.mark.skipif(not REAL or not os.path.isdir(REAL or ""), reason="set DELTASERVE_LLMSERVINGSIM to their data")
def test_the_published_rtxpro6000_llama_run_meets_the_targets(capsys):
    ex = os.path.join(REAL, "bench/examples/RTXPRO6000/Llama-3.1-8B")
    assert external_main(["--bundle", os.path.join(REAL, "profiler/perf/RTXPRO6000/meta-llama/Llama-3.1-8B/bf16"),
                          "--model-config", os.path.join(REAL, "configs/model/meta-llama/Llama-3.1-8B.json"),
                          "--trace", os.path.join(REAL, "workloads/sharegpt-llama-3.1-8b-300-sps10.jsonl"),
                          "--measured", os.path.join(ex, "vllm/requests.jsonl"),
                          "--cluster-config", os.path.join(ex, "config.json"), "--quiet"]) == 0
    diff = {tuple(line.split()[:2]): float(line.split()[4].rstrip("%")) for line in capsys.readouterr().out.splitlines()
            if line.split()[:1] in (["TTFT"], ["TPOT"], ["Latency"])}
    assert abs(diff["TTFT", "Mean"]) <= 3 and abs(diff["TPOT", "Mean"]) <= 1 and abs(diff["Latency", "Mean"]) <= 1.5
    assert max(abs(diff[m, "P90"]) for m in ("TTFT", "TPOT", "Latency")) <= 5
