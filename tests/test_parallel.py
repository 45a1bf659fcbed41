"""Tensor parallelism gates: two ranks over gloo on this machine.

- TP=2 logits equal TP=1 within 1e-5 (max abs, fp32) and greedy tokens are equal, for the three model types;
- a prefix-cache hit under TP=2 equals its cold twin bit for bit (bf16: the batch-invariant path);
- preemption and resume under TP=2 give the tokens of the uninterrupted runs;
- a killed worker, or one that stops answering, ends the engine with TensorParallelError, not a hang;
- head counts that do not divide are refused with the numbers; the pool is sized per rank.
"""
from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.config import ConfigError, ModelConfig
from tp_models import MODEL_TYPES, make_tp_model
from util import MiB, greedy, random_tokens, run, signature


def _record_logits(llm: LLM) -> dict:
    """(request id, position) -> the logits rank 0 sampled from, for every step the engine runs."""
    rec, runner = {}, llm.engine.runner
    execute = runner.execute

    def recording(plan):
        out = execute(plan)
        rows = dict(zip(out.owners, out.sample if out.owners else ()))
        for w in plan.work:
            if w.request_id in rows:
                rec[(w.request_id, w.start_pos + len(w.token_ids))] = rows[w.request_id].clone()
        return out

    llm.engine.runner.execute = recording
    return rec


def _llm(path: str | None = None, **kw) -> LLM:
    args = dict(num_threads=1, kv_cache_memory=32 * MiB, max_num_seqs=6, max_num_batched_tokens=256, seed=0)
    args.update(kw)
    return LLM(model=path, **args)


@pytest.mark.parametrize("model_type,overrides", [pytest.param(t, {}, id=t) for t in MODEL_TYPES]
                         + [pytest.param("qwen3_5_text", {"num_key_value_heads": 1}, id="qwen3_5_text-one-kv-head")])
def test_tp2_logits_and_greedy_tokens_equal_tp1(model_type, overrides, tmp_path):
    """fp32: TP=2's logits within 1e-5 of TP=1's, the same greedy tokens (one-kv-head: the KV head replicated on
    both ranks, each rank's query heads reading it)."""
    path = make_tp_model(model_type, str(tmp_path / model_type), **overrides)
    rng = random.Random(1)
    prompts = [random_tokens(rng, n, vocab=300) for n in (3, 70, 150)]  # under a block, over one, chunked
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    got = {}
    for tp in (1, 2):
        llm = _llm(path, tensor_parallel_size=tp, max_num_batched_tokens=64)  # a 150-token prompt in 3 chunks
        try:
            rec = _record_logits(llm)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            got[tp] = rec, [o.outputs[0].token_ids for o in outs]
        finally:
            llm.engine.shutdown()
    (one, tokens1), (two, tokens2) = got[1], got[2]
    assert tokens1 == tokens2
    assert sorted(one) == sorted(two) and len(one) == 3 * 6
    diff = max((one[k] - two[k]).abs().max().item() for k in one)
    assert diff <= 1e-5, f"{model_type}: TP=2 logits differ from TP=1 by {diff}"
    assert max(one[k].abs().max().item() for k in one) > 1.0  # not a comparison of near-zero logits
    assert all(one[k].shape == (301,) for k in one)  # the padded head's rows are cut off


@pytest.fixture(scope="module")
def tiny_tp2():
    llm = _llm(None, tensor_parallel_size=2, kv_cache_memory=64 * MiB)
    yield llm
    llm.engine.shutdown()


def test_prefix_hit_under_tp2_equals_its_cold_twin_bit_for_bit(tiny_tp2):
    rng = random.Random(2)
    base = random_tokens(rng, 300)
    turn = base + random_tokens(rng, 90)
    params = greedy(max_tokens=6)
    run(tiny_tp2, [base], salt="shared")
    hit = run(tiny_tp2, [turn], salt="shared", params=params)[0]
    cold = run(tiny_tp2, [turn], salt="cold", params=params)[0]
    assert hit.num_cached_tokens >= 256 and cold.num_cached_tokens == 0
    assert signature(hit) == signature(cold)
    s = tiny_tp2.engine.stats()
    assert s.checkpoints_restored > 0 and s.pages_used == 0 and s.slots_used == 0


def test_pool_is_sized_per_rank(tiny_tp2):
    from deltaserve.memory.sizing import geometry

    eng = tiny_tp2.engine
    one, two = (geometry(eng.model_config, "bfloat16", "bfloat16", "float32", tp=tp) for tp in (1, 2))
    assert eng.pool.slot_bytes == two.gdn_state_bytes_per_seq == one.gdn_state_bytes_per_seq // 2
    assert eng.pool.page_bytes == eng.block_size * two.kv_bytes_per_token_per_layer
    assert eng.store.nbytes() <= 64 * MiB  # the per-rank budget is this rank's real pool
    from deltaserve.tools.planner import plan  # the planner's per-rank figures are the engine's pool

    planned = plan(eng.model_path, budget_bytes=64 * MiB, tensor_parallel_size=2, max_num_seqs=6)["pools"]["runs"]
    assert (planned["num_pages"], planned["slot_bytes"], planned["block_size"]) == \
        (eng.pool.num_pages, eng.pool.slot_bytes, eng.block_size)


def _budget_for_pages(pages: int, tp: int = 2, seqs: int = 6) -> int:
    from deltaserve.embedded.model import ensure_model
    from deltaserve.memory.sizing import geometry, size_pool

    g = geometry(ModelConfig.from_path(ensure_model("tiny")), "bfloat16", "bfloat16", "float32", tp=tp)
    p = size_pool(g, 1 << 30, 64, seqs, "runs")
    return seqs * p.slot_bytes + pages * p.bytes_per_page


def test_preemption_and_resume_under_tp2():
    rng = random.Random(3)
    prompts = [random_tokens(rng, 200 + 60 * i) for i in range(4)]
    params = greedy(max_tokens=40, logprobs=None)
    llm = _llm(None, tensor_parallel_size=2, kv_cache_memory=_budget_for_pages(26), max_num_seqs=6)
    try:
        alone = [signature(run(llm, [p], salt=f"alone-{i}", params=params)[0])[0] for i, p in enumerate(prompts)]
        before = llm.engine.stats().preemptions
        together = run(llm, prompts, salt="together", params=params)
        s = llm.engine.stats()
        assert s.preemptions > before
        assert [signature(o)[0] for o in together] == alone
        assert s.pages_used == 0 and s.slots_used == 0
    finally:
        llm.engine.shutdown()


def _start_and_step(**kw) -> LLM:
    llm = _llm(None, tensor_parallel_size=2, **kw)
    llm.engine.add_request("a", list(range(10, 80)), greedy(max_tokens=50, logprobs=None))
    llm.engine.step()
    return llm


def test_a_killed_worker_ends_the_engine_with_a_clear_error():
    llm = _start_and_step()
    worker = llm.engine.parallel.procs[0]
    os.kill(worker.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(Exception) as info:
        for _ in range(50):
            llm.engine.step()
    assert type(info.value).__name__ == "TensorParallelError"
    assert "exited with code -9" in str(info.value) or "connection" in str(info.value).lower()
    assert time.monotonic() - t0 < 10
    with pytest.raises(Exception, match="tensor-parallel"):  # and it stays down, saying why
        llm.engine.step()
    llm.engine.shutdown()
    assert worker.exitcode is not None


def test_a_hung_worker_ends_the_engine_within_the_timeout():
    llm = _start_and_step(distributed_timeout=3.0)
    worker = llm.engine.parallel.procs[0]
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(Exception, match="did not answer within --distributed-timeout 3 s"):
            llm.engine.step()
        assert time.monotonic() - t0 < 3.0 + 6.0
    finally:
        os.kill(worker.pid, signal.SIGKILL)
        llm.engine.shutdown()


def test_shutdown_stops_the_workers():
    llm = _llm(None, tensor_parallel_size=2)
    procs = list(llm.engine.parallel.procs)
    llm.engine.shutdown()
    llm.engine.shutdown()  # idempotent
    assert [p.exitcode for p in procs] == [0]


def test_head_counts_that_do_not_divide_are_refused_with_the_numbers():
    from deltaserve.embedded.model import ensure_model
    from deltaserve.parallel.sharding import check_divisible

    mc = ModelConfig.from_path(ensure_model("tiny"))
    with pytest.raises(ConfigError, match="tensor-parallel size 3 does not divide qwen3_5_text's "
                                          "linear_num_key_heads \\(GDN key heads\\) 2"):
        check_divisible(mc, 3)
    with pytest.raises(ConfigError, match="num_attention_heads 4"):
        LLM(tensor_parallel_size=3, num_threads=1)  # refused before any process starts
    check_divisible(mc, 2)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_shards_put_back_together_are_the_whole_model(model_type, tmp_path):
    """Per-rank slices of every tensor, concatenated along their split dimension (segment by segment), give the
    full tensor back; replicated ones are equal; KV heads fewer than the ranks are replicated."""
    from deltaserve.model.loader import load_model
    from deltaserve.parallel.sharding import rank_config, shard_state_dict

    path = make_tp_model(model_type, str(tmp_path / "m"), num_key_value_heads=1)
    full = load_model(path, dtype="float32", prepack=False)
    mc, sd = full.config, full.state_dict()
    tp = 2
    shards = [shard_state_dict(sd, mc, tp, r) for r in range(tp)]
    rc = rank_config(mc, tp)
    assert (rc.linear_num_key_heads, rc.linear_num_value_heads, rc.num_attention_heads, rc.num_key_value_heads) == \
        (1, 2, 2, 1)
    hk, hv, dk, dv, d = mc.linear_num_key_heads, mc.linear_num_value_heads, 32, 16, mc.head_dim

    def rebuilt(name, sizes, dim):
        """Segment i of the full tensor = rank pieces of segment i, concatenated."""
        per_rank = [s[name] for s in shards]
        segs, offs = [], [0] * tp
        for size in sizes:
            n = size // tp
            segs += [p.narrow(dim, offs[r], n) for r, p in enumerate(per_rank)]
            offs = [o + n for o in offs]
        return torch.cat(segs, dim)

    gdn = next(i for i, t in enumerate(mc.layer_types) if t == "linear_attention")
    att = next(i for i, t in enumerate(mc.layer_types) if t == "full_attention")
    a = f"layers.{gdn}.linear_attn."
    assert torch.equal(rebuilt(a + "in_proj", [hk * dk, hk * dk, hv * dv, hv * dv, hv, hv], 0), sd[a + "in_proj"])
    assert torch.equal(rebuilt(a + "conv_weight", [hk * dk, hk * dk, hv * dv], 0), sd[a + "conv_weight"])
    assert torch.equal(rebuilt(a + "A_log", [hv], 0), sd[a + "A_log"])
    assert torch.equal(rebuilt(a + "out_proj", [hv * dv], 1), sd[a + "out_proj"])
    q = f"layers.{att}.self_attn.qkv_proj"
    for r in range(tp):  # the one KV head on both ranks, each rank its query heads
        assert torch.equal(shards[r][q][2 * 2 * d:], sd[q][2 * 4 * d:])
        assert torch.equal(shards[r][q][:2 * 2 * d], sd[q][r * 2 * 2 * d:(r + 1) * 2 * 2 * d])
    for name, t in sd.items():
        if name.endswith(("gate_up", "down")):
            dim = t.dim() - 2 if name.endswith("gate_up") else t.dim() - 1
            sizes = [t.shape[dim] // 2] * 2 if name.endswith("gate_up") else [t.shape[dim]]
            assert torch.equal(rebuilt(name, sizes, dim), t), name
        elif name.endswith(("norm", "layernorm", "router", "shared_gate", "norm_weight")) or name == "embed_tokens":
            assert all(torch.equal(s[name], t) for s in shards), name
    head = sd.get("lm_head", sd["embed_tokens"])
    assert torch.equal(torch.cat([s["lm_head"] for s in shards])[:mc.vocab_size], head)
    assert shards[1]["lm_head"][-1].abs().sum() == 0  # 301 rows: the last rank's padding row
    with pytest.raises(ConfigError, match="no tensor-parallel sharding rule for layers.0.linear_attn.new_weight"):
        shard_state_dict({**sd, "layers.0.linear_attn.new_weight": torch.zeros(2)}, mc, tp, 0)


def test_two_nodes_meet_through_master_addr_and_port(tmp_path):
    """torchrun's rendezvous: node 1's ranks started apart (`python -m deltaserve.parallel.worker`), node 0's
    engine joins them at --master-addr:--master-port; the tokens are TP=1's, and node 1 exits when node 0 ends."""
    import socket
    import subprocess
    import sys

    path = make_tp_model("qwen3_5_text", str(tmp_path / "m"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
             "--model", path, "--num-threads", "1", "--kv-cache-memory", "32M"]
    node1 = subprocess.Popen([sys.executable, "-m", "deltaserve.parallel.worker", "--node-rank", "1", *flags],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        prompt = [{"prompt_token_ids": random_tokens(random.Random(4), 90, vocab=300)}]
        params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        llm = _llm(path, tensor_parallel_size=2, nnodes=2, master_port=port)
        try:
            assert llm.engine.parallel.procs == []  # rank 1 is node 1's
            two = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        finally:
            llm.engine.shutdown()
        assert node1.wait(30) == 0, node1.stderr.read()[-2000:]
        one = _llm(path).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        assert two == one
    finally:
        if node1.poll() is None:
            node1.kill()


def test_the_builder_sizes_engine_and_simulated_replicas_per_rank():
    from deltaserve.config import EngineConfig
    from deltaserve.embedded.model import ensure_model
    from deltaserve.profile import make_engine
    from deltaserve.scheduler.build import build

    mc = ModelConfig.from_path(ensure_model("tiny"))
    one = build(mc, EngineConfig(), 64 * MiB, "bfloat16")[0]
    engine = build(mc, EngineConfig(tensor_parallel_size=2), 64 * MiB, "bfloat16")[0]
    replica = build(mc, EngineConfig(), 64 * MiB, "bfloat16", tp=2)[0]  # sim/cluster.py: a replica's own tp
    assert engine.pool == replica.pool
    assert engine.pool.slot_bytes * 2 == one.pool.slot_bytes and engine.pool.num_pages > one.pool.num_pages
    with pytest.raises(ConfigError, match="profiles one rank"):
        make_engine(tensor_parallel_size=2)
