"""Replay another engine's run on OUR scheduler: a full-attention decoder's geometry (dense or MoE), vLLM's KV
sizing, their trace, and the step loop (with vLLM's async scheduling, and data-parallel ranks in lockstep). No
torch.

The scheduler and memory manager are the engine's own, built by scheduler/build.py with the foreign engine's
settings (ForeignEngine): its kernel alignment (cuda 16, so block 16 stays 16), caching as the run had it (default
off), vLLM's full-sequence admission (VllmScheduler), no merge limit,
chunks cut at the token budget exactly (chunk_grid 1: vLLM has no 64-token GDN grid), recompute preemption
(replay_decode False). What our Scheduler does differently from vLLM V1 and is emulated here, not changed
there: vLLM's async scheduling (on by default in recent vLLM V1 releases) plans step k+1 while step k runs, so

  * a request that arrives while step k runs is first seen by the plan made when k ends, which runs after
    k+1: it waits one more step than in a synchronous loop;
  * a request that finishes in step k still holds its seat (max_num_seqs) in the plan for k+1; its tokens
    are known to be its last, so it is not scheduled again.

The loop plans at the end of each step with the arrivals up to the START of that step and with the seats of
the requests that finished in it held (Scheduler.max_num_seqs lowered for that one call); when such a plan
is empty the engine would be idle, and it plans again at once with everything it knows.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass

from ..config import DTYPE_BYTES, ConfigError, ModelConfig
from ..memory.sizing import geometry, kernel_alignment_for
from ..scheduler import Request, Scheduler
from ..scheduler.build import build_scheduler, resolve_shape
from .latency import StepShape
from .report import RequestRecord

SAMPLED_TOKEN = 11
# decoders whose layers are norm, qkv (+ qwen3's q/k norms), rope, attention, o, norm, then a gated MLP or (qwen3_moe)
# a routed expert block; all full attention
DENSE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
MOE_MODEL_TYPES = ("qwen3_moe",)
MODEL_TYPES = DENSE_MODEL_TYPES + MOE_MODEL_TYPES


def decoder_model_config(hf: dict) -> ModelConfig:
    """A decoder's config.json as ModelConfig: a hybrid with no GDN layers (every layer full attention, the
    linear-attention geometry 0), which sizing, the pool and the memory manager take as they are. A MoE model
    keeps its expert counts (num_experts, num_experts_per_tok, moe_intermediate_size)."""
    mt = hf.get("model_type")
    if mt not in MODEL_TYPES:
        raise ConfigError(f"model_type {mt!r}: the external replay reads decoders ({', '.join(MODEL_TYPES)})")
    need = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"]
    need += ["num_experts", "num_experts_per_tok", "moe_intermediate_size"] if mt in MOE_MODEL_TYPES else \
        ["intermediate_size"]
    missing = [k for k in need if k not in hf]
    if missing:
        raise ConfigError(f"config.json lacks {', '.join(missing)}")
    if mt in MOE_MODEL_TYPES and (hf.get("mlp_only_layers") or int(hf.get("decoder_sparse_step", 1)) != 1):
        raise ConfigError("a qwen3_moe config with dense layers (mlp_only_layers, decoder_sparse_step) is not read")
    n, heads = int(hf["num_hidden_layers"]), int(hf["num_attention_heads"])
    moe = mt in MOE_MODEL_TYPES
    return ModelConfig(
        model_type=mt, vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]), num_hidden_layers=n,
        layer_types=("full_attention",) * n, num_attention_heads=heads,
        num_key_value_heads=int(hf["num_key_value_heads"]),
        head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=float(hf.get("rope_theta", 10000.0)),
        partial_rotary_factor=1.0, max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)), linear_conv_kernel_dim=0,
        linear_key_head_dim=0, linear_value_head_dim=0, linear_num_key_heads=0, linear_num_value_heads=0,
        intermediate_size=0 if moe else int(hf["intermediate_size"]),
        num_experts=int(hf["num_experts"]) if moe else 0,
        num_experts_per_tok=int(hf["num_experts_per_tok"]) if moe else 0,
        moe_intermediate_size=int(hf["moe_intermediate_size"]) if moe else 0,
        dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16").replace("torch.", ""))


dense_model_config = decoder_model_config  # the name the dense-only reader had


def dense_weight_bytes(m: ModelConfig, dtype_bytes: int, tp: int = 1, ep: int = 1) -> int:
    """Weights of one rank: embeddings (+ lm_head unless tied), per layer q/k/v/o and either gate/up/down or (MoE)
    the router and num_experts x gate/up/down, two norms (+ qwen3's q/k norms), the final norm; the matrices split
    over tp, the experts over ep."""
    h, hd = m.hidden_size, m.head_dim
    attn = h * m.num_attention_heads * hd * 2 + 2 * h * m.num_key_value_heads * hd
    if m.num_experts:
        mlp = m.num_experts * 3 * h * m.moe_intermediate_size // ep
        router = h * m.num_experts
    else:
        mlp, router = 3 * h * m.intermediate_size, 0
    big = m.vocab_size * h * (1 if m.tie_word_embeddings else 2) + m.num_hidden_layers * (attn + mlp)
    norms = 2 * h + (2 * hd if m.model_type.startswith("qwen3") else 0)
    small = m.num_hidden_layers * (norms + router) + h
    return (big // tp + small) * dtype_bytes


def vllm_kv_bytes(device_memory: int, utilization: float, weight_bytes: int, reserved: int = 0) -> int:
    """vLLM's KV budget: utilization x device memory, less the weights and what the profiling run reserves
    (activation peak, CUDA graphs; not in the bundle, so `reserved`, default 0: an upper bound)."""
    kv = int(device_memory * utilization) - weight_bytes - reserved
    if kv <= 0:
        raise ConfigError(f"{utilization} x {device_memory:,} bytes leaves nothing for the KV cache after "
                          f"{weight_bytes:,} bytes of weights")
    return kv


def kv_all_ranks(m: ModelConfig, kv_rank_bytes: int, tp: int) -> int:
    """One rank's KV budget as the TP-1 budget holding the same tokens (the pool is sized on the TP-1 geometry):
    a rank keeps its share of the KV heads (all of them once tp exceeds them, as vLLM replicates)."""
    if tp <= 1:
        return kv_rank_bytes
    one, rank = geometry(m, "bfloat16", "bfloat16", "float32"), geometry(m, "bfloat16", "bfloat16", "float32", tp=tp)
    return kv_rank_bytes * one.kv_bytes_per_token_per_layer // rank.kv_bytes_per_token_per_layer


class VllmScheduler(Scheduler):
    """Our Scheduler with vLLM V1's admission rule `scheduler_reserve_full_isl` (vLLM 0.19's default; the published
    runs' resolved config says true): a waiting or preempted request is admitted only when its
    whole sequence so far (prompt + outputs) fits in the allocatable blocks beyond its prefix-cache hit, not just
    its first chunk. Without it a memory-bound run over-admits long prompts on their first chunk and thrashes."""

    reserve_full_isl = True

    def admit(self, req: Request, queue=None, budget: int | None = None) -> bool:
        if self.reserve_full_isl and not req.background:
            mem, bs = self.memory, self.block_size
            hit = None
            if self.caching and not req.skip_cache_lookup:
                nb = (req.num_tokens - 1) // bs  # as Scheduler.admit: a hit leaves a token to sample from
                hit = mem.find_prefix(req.root_hash, req.block_hashes(nb, bs), lambda j: req.tokens(j * bs, (j + 1) * bs),
                                      nb)
            need = mem.pages_for(req.num_tokens) - (hit.num_blocks if hit else 0) + mem.pin_cost(hit)
            if need > mem.num_allocatable():
                return False
        return super().admit(req, queue, budget)


@dataclass(frozen=True)
class ForeignEngine:
    """The settings of the engine being replayed, as our scheduler's options. Defaults: vLLM V1."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    device: str = "cuda"  # sizing.KERNEL_ALIGNMENTS: the attention kernel's smallest block
    enable_prefix_caching: bool = False  # on: our align-mode rules, which end middle chunks on a block boundary
    async_scheduling: bool = True
    reserve_full_isl: bool = True  # vLLM's scheduler_reserve_full_isl (VllmScheduler)
    max_cudagraph_tokens: int = 512  # the largest CUDA-graph batch: data-parallel ranks pad up to it (replay)

    def build(self, mc: ModelConfig, kv_bytes: int, dtype: str):
        """(shape, scheduler) from scheduler/build.py with this engine's rules."""
        shape = resolve_shape(mc, dtype=dtype, block_size=self.block_size, kv_cache_memory=kv_bytes,
                              max_num_seqs=self.max_num_seqs, cache_layout="runs",
                              enable_prefix_caching=self.enable_prefix_caching,
                              kernel_alignment=kernel_alignment_for(self.device))
        memory, _ = build_scheduler(shape, max_num_seqs=self.max_num_seqs,
                                    max_num_batched_tokens=self.max_num_batched_tokens,
                                    enable_prefix_caching=self.enable_prefix_caching)
        # the same Scheduler build_scheduler makes, over its fresh memory manager, with vLLM's admission rule
        sched = VllmScheduler(memory, max_num_seqs=self.max_num_seqs,
                              max_num_batched_tokens=self.max_num_batched_tokens, prefill_merge_tokens=0,
                              checkpoint_grid=0, chunk_grid=1, replay_decode=False)
        sched.reserve_full_isl = self.reserve_full_isl
        return shape, sched


@dataclass(frozen=True)
class ExternalRequest:
    """One line of their workload: arrival (s from the trace's start), prompt tokens, output length."""

    index: int
    arrival: float
    prompt: tuple[int, ...]
    output_length: int


def read_workload(path: str, limit: int | None = None) -> list[ExternalRequest]:
    """LLMServingSim's workload JSONL: input_toks, output_toks, arrival_time_ns (+ input_tok_ids)."""
    out = []
    t0 = None
    with open(path) as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            if limit is not None and len(out) >= limit:
                break
            d = json.loads(line)
            for k in ("input_toks", "output_toks", "arrival_time_ns"):
                if k not in d:
                    raise ConfigError(f"{path}:{i + 1}: no {k!r} (LLMServingSim workload lines have input_toks, "
                                      f"output_toks, arrival_time_ns)")
            n, m = int(d["input_toks"]), int(d["output_toks"])
            ids = d.get("input_tok_ids")
            if ids is not None and len(ids) != n:
                raise ConfigError(f"{path}:{i + 1}: {len(ids)} input_tok_ids for input_toks {n}")
            if n < 1 or m < 1:
                raise ConfigError(f"{path}:{i + 1}: input_toks and output_toks must be >= 1")
            t = float(d["arrival_time_ns"]) * 1e-9
            t0 = t if t0 is None else t0
            out.append(ExternalRequest(len(out), t - t0, tuple(ids) if ids is not None else (1,) * n, m))
    if not out:
        raise ConfigError(f"{path}: no requests")
    return out


class LeastLoaded:
    """vLLM's data-parallel load balancer as LLMServingSim's LOAD router models it: the rank with the least
    4 x waiting + running (over max_num_seqs), scanned from a round-robin start so ties rotate."""

    def __init__(self, n: int):
        self.n, self.next = n, 0

    def pick(self, scheds) -> int:
        best, best_score = 0, float("inf")
        for k in range(self.n):
            r = (self.next + k) % self.n
            s = scheds[r]
            score = (4 * s.num_waiting + s.num_running) / max(s.max_num_seqs, 1)
            if score < best_score:
                best, best_score = r, score
        self.next = (best + 1) % self.n
        return best


def replay(sched, latency, reqs: list[ExternalRequest], async_scheduling: bool = True,
           progress: bool = False, dp_pad_tokens: int = 512) -> tuple[list[RequestRecord], dict]:
    """Serve `reqs` on `sched` (one Scheduler, or one per data-parallel rank) with step times from `latency`;
    (records in trace order, step stats).

    Data-parallel ranks step in lockstep, as vLLM's DP engines do for a MoE model (every rank joins every
    forward: the experts' collectives need them all; a rank with nothing to run runs a dummy batch): a step
    lasts as long as its slowest rank. A step whose largest rank has at most dp_pad_tokens tokens (vLLM's largest
    CUDA-graph size) runs as a graph, every rank padded to that count; a larger one runs eagerly, each rank at its
    own count, the expert layers gathering the sum. Arrivals go to the least-loaded rank (LeastLoaded)."""
    scheds = list(sched) if isinstance(sched, (list, tuple)) else [sched]
    router = LeastLoaded(len(scheds))
    order = sorted(reqs, key=lambda r: (r.arrival, r.index))
    recs = [RequestRecord(f"req-{r.index}", None, 0, r.arrival, len(r.prompt), r.output_length) for r in reqs]
    by_id = {rec.request_id: rec for rec in recs}
    i, now, step_start = 0, 0.0, 0.0
    held = [0] * len(scheds)
    stats = {"steps": 0, "busy_s": 0.0, "peak_kv_pages": 0, "mixed_steps": 0, "multi_prefill_steps": 0}
    next_report = 10.0

    def arrive(until: float) -> None:
        nonlocal i
        while i < len(order) and order[i].arrival <= until:
            r = order[i]
            s = scheds[router.pick(scheds)]
            s.add(Request(f"req-{r.index}", list(r.prompt), max_tokens=r.output_length, arrival_time=r.arrival))
            i += 1

    def plan_with(s, seats_held: int):
        cap = s.max_num_seqs
        s.max_num_seqs = max(0, cap - seats_held)
        try:
            return s.schedule()
        finally:
            s.max_num_seqs = cap

    while True:
        arrive(step_start if async_scheduling else now)
        plans = [plan_with(s, h if async_scheduling else 0) for s, h in zip(scheds, held)]
        if all(p.is_empty() for p in plans):
            arrive(now)  # nothing in flight to plan behind: the engine plans at once with all it knows
            plans = [s.schedule() for s in scheds]
        if all(p.is_empty() for p in plans):
            if i >= len(order):
                break
            now = step_start = max(now, order[i].arrival)
            held = [0] * len(scheds)
            continue
        shapes = [StepShape.of(p) for p in plans]
        if len(scheds) == 1:
            dt = latency.shape_us(shapes[0], now) * 1e-6
        else:
            # ranks pad to the largest rank's tokens when the step runs as a CUDA graph (vLLM's DP padding, only
            # then); otherwise each runs its own tokens and the experts gather the sum
            most = max(sh.n_tokens for sh in shapes)
            if most <= dp_pad_tokens:
                dt = max(latency.shape_us(sh, now, tokens=most, gathered=most * len(shapes)) for sh in shapes)
            else:
                total = sum(sh.n_tokens for sh in shapes)
                dt = max(latency.shape_us(sh, now, tokens=sh.n_tokens, gathered=total) for sh in shapes)
            dt *= 1e-6
        stats["steps"] += 1
        stats["busy_s"] += dt
        stats["mixed_steps"] += any(bool(sh.prefill and sh.decode_ctx) for sh in shapes)
        stats["multi_prefill_steps"] += any(len(sh.prefill) > 1 for sh in shapes)
        stats["peak_kv_pages"] = max(stats["peak_kv_pages"], *(s.memory.num_pages_in_use for s in scheds))
        step_start, now = now, now + dt
        held = [0] * len(scheds)
        for k, (s, plan) in enumerate(zip(scheds, plans)):
            for req in s.update(plan, {w.request_id: SAMPLED_TOKEN for w in plan.work if w.sample}):
                rec = by_id[req.request_id]
                rec.output_tokens += 1
                rec.preemptions = req.num_preemptions
                if rec.first_token is None:
                    rec.first_token = now
                if req.is_finished:
                    rec.finish = now
                    held[k] += 1
        if progress and now >= next_report:
            done = sum(1 for r in recs if r.finish is not None)
            print(f"  simulated {now:6.1f} s: {stats['steps']} steps, {done}/{len(recs)} requests done, "
                  f"{sum(s.num_running for s in scheds)} running, {sum(s.num_waiting for s in scheds)} waiting",
                  file=sys.stderr, flush=True)
            next_report += 10.0
    for rec in recs:
        if rec.finish is None:
            rec.status = "unfinished"
    stats["preemptions"] = sum(s.stats.preemptions for s in scheds)
    return recs, stats


def dtype_bytes_of(mc: ModelConfig) -> int:
    return DTYPE_BYTES.get(mc.dtype, 2)
