"""`deltaserve simulate external` beyond dense llama: the qwen3 reader (q/k norm), the qwen3_moe reader (moe.csv,
expert and data parallelism, the EP collectives), TP all-reduces, and the data-parallel replay behind its router.

The tables are excerpts of LLMServingSim's published RTX PRO 6000 bundles (tests/fixtures/llmservingsim, MIT); the
expected figures are their rows, summed by hand."""
from __future__ import annotations

import json
import os

import pytest

from deltaserve.config import ConfigError
from deltaserve.sim.external import VLLM_CUSTOM_ALL_REDUCE_BYTES, Comm, Experts, ExternalBundle, ExternalLatency
from deltaserve.sim.external_replay import (
    ExternalRequest,
    ForeignEngine,
    LeastLoaded,
    decoder_model_config,
    dense_weight_bytes,
    replay,
)
from deltaserve.sim.latency import StepShape

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "llmservingsim")
QWEN3 = os.path.join(FIX, "qwen3-32b")
MOE = os.path.join(FIX, "qwen3-30b-a3b")


def hf(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


# ------------------------------------------------------------------------------------------------------ qwen3

def test_qwen3_dense_rows_summed_by_hand():
    """64 layers of: 2 layernorms, qkv, the q/k norm row (both norms in one row), rope, o, gate_up, act, down; once
    per step embedding and final norm; per sequence lm_head and sampler. Rows at 16 tokens / 16 sequences."""
    mc = decoder_model_config(hf(QWEN3))
    assert (mc.model_type, mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim) == ("qwen3", 64, 8, 128)
    lat = ExternalLatency(ExternalBundle(QWEN3), mc.num_hidden_layers, mc.hidden_size, mc.vocab_size)
    assert lat.arch == "qwen3"  # from meta.yaml's architecture
    layer = 2 * 2.688 + 74.944 + 2.341 + 3.98933 + 64.1167 + 366.208 + 5.536 + 184.928
    assert lat.dense(16) == pytest.approx(6.85867 + 2.81633 + 64 * layer)
    assert lat.head(16) == pytest.approx(1059.66 + 16.7047)
    # a 16-token prefill alone: the parts add up to one step
    s = StepShape(prefill=[(16, 0)], decode_ctx=[], n_sample=1)
    parts = lat.parts_us(s)
    assert parts["dense"] == pytest.approx(lat.dense(16)) and parts["moe"] == 0.0 and parts["comm"] == 0.0
    assert lat.shape_us(s) == pytest.approx(sum(parts.values()))


def test_qwen3_tables_refused_as_llama_and_llama_as_qwen3():
    """The op set is the architecture's: a qwen3 table read as llama has a q/k norm row nobody would price."""
    with pytest.raises(ConfigError, match="qk_norm"):
        ExternalLatency(ExternalBundle(QWEN3), 64, arch="llama")
    with pytest.raises(ConfigError, match="architecture 'gpt2'"):
        ExternalLatency(ExternalBundle(QWEN3), 64, arch="gpt2")


def test_qwen3_weights_by_hand():
    mc = decoder_model_config(hf(QWEN3))
    h, hd, inter, v, n = 5120, 128, 25600, 151936, 64
    layer = h * 64 * hd * 2 + 2 * h * 8 * hd + 3 * h * inter
    big, small = 2 * v * h + n * layer, n * (2 * h + 2 * hd) + h
    assert dense_weight_bytes(mc, 2) == (big + small) * 2
    assert dense_weight_bytes(mc, 2, tp=2) == (big // 2 + small) * 2


# ------------------------------------------------------------------------------------------------- qwen3_moe

def test_moe_config_and_weights_by_hand():
    mc = decoder_model_config(hf(MOE))
    assert (mc.model_type, mc.num_experts, mc.num_experts_per_tok, mc.moe_intermediate_size, mc.intermediate_size) \
        == ("qwen3_moe", 128, 8, 768, 0)
    h, hd, v, n = 2048, 128, 151936, 48
    attn = h * 32 * hd * 2 + 2 * h * 4 * hd
    experts = 128 * 3 * h * 768
    for ep in (1, 2):
        want = (2 * v * h + n * (attn + experts // ep)) + n * (2 * h + 2 * hd + h * 128) + h
        assert dense_weight_bytes(mc, 2, ep=ep) == want * 2
    with pytest.raises(ConfigError, match="dense layers"):
        decoder_model_config({**hf(MOE), "mlp_only_layers": [0]})


def test_moe_rank_load_and_table_by_hand():
    """A rank of an EP group holds gathered x top_k / ep of the expert-token pairs: moe.csv's row of
    gathered / ep tokens; its activated experts are its E / ep hit by at least one gathered token."""
    e1, e2 = Experts(128, 8, ep=1, dp=1), Experts(128, 8, ep=2, dp=2)
    t, a = e1.rank_load(16)
    assert t == 16 and a == pytest.approx(128 * (1 - (1 - 8 / 128) ** 16))  # 82.4 experts
    t, a = e2.rank_load(256)
    assert t == 128 and a == pytest.approx(64.0, abs=1e-5)  # 256 tokens hit (all but 4e-6 of) the 64 local experts
    mc = decoder_model_config(hf(MOE))
    lat = ExternalLatency(ExternalBundle(MOE), mc.num_hidden_layers, mc.hidden_size, mc.vocab_size, experts=e1)
    assert lat.moe(64, 16) == 424.116 and lat.moe(128, 128) == 849.291  # profiled points, exactly
    a16 = 128 * (1 - (1 - 8 / 128) ** 16)
    assert lat.moe_us(16) == pytest.approx(424.116 + (a16 - 64) / 64 * (817.612 - 424.116))
    layer = 2 * 2.14933 + 14.0053 + 2.01067 + 2.51733 + 9.89867  # no dense MLP rows: the experts are moe.csv's
    assert lat.dense(16) == pytest.approx(6.613 + 2.112 + 48 * layer)
    s = StepShape(prefill=[(16, 0)], decode_ctx=[], n_sample=1)
    assert lat.parts_us(s)["moe"] == pytest.approx(48 * lat.moe_us(16))
    with pytest.raises(ConfigError, match="needs moe.csv and its experts"):
        ExternalLatency(ExternalBundle(MOE), 48)


def test_ep_collectives_by_hand():
    """DP 2 x EP 2 at 64 tokens a rank, padded: the ranks gather 128 tokens; per layer a dispatch all-gather of
    hidden + 128 router logits per token and a combine reduce-scatter of hidden, each a 2-rank ring: one hop of
    latency + half the total bytes."""
    mc = decoder_model_config(hf(MOE))
    bw, hop = 16e9, 20e-6
    ep = Comm(2, bw, hop)
    lat = ExternalLatency(ExternalBundle(MOE), 48, mc.hidden_size, mc.vocab_size, experts=Experts(128, 8, 2, 2),
                          ep_comm=ep)
    s = StepShape(prefill=[], decode_ctx=[100] * 64, n_sample=64)
    dispatch = 1e6 * (hop + 0.5 * 128 * (2048 + 128) * 2 / bw)
    combine = 1e6 * (hop + 0.5 * 128 * 2048 * 2 / bw)
    assert lat.comm_us(s, tokens=64) == pytest.approx(48 * (dispatch + combine))
    # unpadded (an eager step): the experts gather the ranks' own tokens, 64 + 10
    assert lat.comm_us(s, tokens=64, gathered=74) == pytest.approx(
        48 * 1e6 * (2 * hop + 0.5 * 74 * (2 * 2048 + 128) * 2 / bw))
    with pytest.raises(ConfigError, match="expert parallelism 2"):
        ExternalLatency(ExternalBundle(MOE), 48, experts=Experts(128, 8, 2, 2))


def test_tp_all_reduce_one_shot_then_ring():
    """vLLM's custom all-reduce on two ranks is one stage up to its 8 MiB buffer; NCCL's ring above."""
    c = Comm(2, 16e9, 20e-6, VLLM_CUSTOM_ALL_REDUCE_BYTES)
    small, big = 1 << 20, 16 << 20
    assert c.all_reduce_us(small) == pytest.approx(1e6 * (20e-6 + small / 16e9))
    assert c.all_reduce_us(big) == pytest.approx(1e6 * (2 * 20e-6 + big / 16e9))
    assert Comm(4, 16e9, 20e-6, VLLM_CUSTOM_ALL_REDUCE_BYTES).all_reduce_us(small) == pytest.approx(
        1e6 * (6 * 20e-6 + 1.5 * small / 16e9))
    assert Comm(1).all_reduce_us(big) == 0.0


# -------------------------------------------------------------------------------------- data-parallel replay

class StepLog:
    """A latency model that logs what each rank ran (its shape, the tokens it was padded to, the tokens gathered)
    and takes 1 ms a step."""

    def __init__(self):
        self.calls = []

    def shape_us(self, s, now=0.0, tokens=None, gathered=None):
        self.calls.append((len(s.prefill), len(s.decode_ctx), s.n_tokens, tokens, gathered))
        return 1000.0


def test_least_loaded_router_rotates_ties():
    class S:
        def __init__(self, w, r):
            self.num_waiting, self.num_running, self.max_num_seqs = w, r, 8

    r = LeastLoaded(2)
    assert r.pick([S(0, 0), S(0, 0)]) == 0 and r.pick([S(0, 0), S(0, 0)]) == 1  # ties rotate
    assert r.pick([S(0, 1), S(0, 0)]) == 1
    assert r.pick([S(1, 0), S(0, 3)]) == 1  # a waiting request weighs 4 running ones


def test_dp_lockstep_pads_graph_steps_and_gathers_eager_ones(tmp_path):
    """Two ranks: requests alternate between them; a step whose largest rank runs <= dp_pad_tokens tokens pads
    every rank to that count, a larger one runs each rank at its own and gathers the sum."""
    mc = decoder_model_config({**hf(MOE), "num_hidden_layers": 2})
    eng = ForeignEngine(max_num_seqs=4, max_num_batched_tokens=256, enable_prefix_caching=False,
                        async_scheduling=False)
    scheds = [eng.build(mc, 64 << 20, "bfloat16")[1] for _ in range(2)]
    reqs = [ExternalRequest(0, 0.0, tuple(range(10, 110)), 2), ExternalRequest(1, 0.0, tuple(range(200, 210)), 3)]
    log = StepLog()
    recs, st = replay(scheds, log, reqs, async_scheduling=False, dp_pad_tokens=64)
    assert all(r.finish is not None for r in recs) and st["steps"] == 3
    # step 1: rank 0 prefills 100 tokens, rank 1 10: eager (100 > 64), each its own, the experts gather 110
    assert log.calls[:2] == [(1, 0, 100, 100, 110), (1, 0, 10, 10, 110)]
    # step 2: one decode each: a graph step, padded to 1 token a rank, 2 gathered
    assert log.calls[2:4] == [(0, 1, 1, 1, 2), (0, 1, 1, 1, 2)]
    # step 3: rank 0 finished (2 tokens); rank 1 decodes, rank 0 runs a dummy batch padded to 1 token
    assert log.calls[4:6] == [(0, 0, 0, 1, 2), (0, 1, 1, 1, 2)]
    assert recs[0].finish == pytest.approx(0.002) and recs[1].finish == pytest.approx(0.003)
