"""The decoder layers of the hybrid models: GDN (linear attention) and gated full attention token mixers,
dense SwiGLU / sparse MoE channel mixers. Weights are held fused (one GEMM per projection group); the
loader (loader.py) maps the stored tensors onto these names.

Linear layers run over all T tokens of a step at once; GDN prefill runs per sequence (conv + chunked
rule from the sequence's slot, absolute grid), GDN decode is batched over the step's decode sequences;
attention writes K/V into the paged pool, then prefill spans attend tile by tile and decode spans one by one
(plain torch) or all in one call through their page tables (the compiled kernels, ops/cpu_kernels.py).
Every op is called through the step context's table (ctx.ops, ops/table.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..config import ModelConfig
from .batch import ForwardBatch
from .ops.cpu_kernels import TORCH, DecodeKernels
from .ops.packed import PackedWeight
from .ops.table import Ops


def empty_param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    """An uninitialized, frozen parameter (the loader assigns the weights)."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def prepack(module: nn.Module, names: tuple[str, ...], ext=None) -> None:
    """Replace module's weights `names` by PackedWeights (3D expert stacks: a list, one per expert); ext: the
    compiled kernels' module for the "cpp" packing, None for oneDNN's (ops/linear.py). The original
    parameters are dropped (they leave the state_dict)."""
    for name in names:
        w = module._parameters.pop(name)
        setattr(module, name, [PackedWeight(x, ext) for x in w] if w.dim() == 3 else PackedWeight(w, ext))


@dataclass
class StepContext:
    """Per-step tensors shared by every layer, built once per forward from the ForwardBatch."""

    batch: ForwardBatch
    cos: torch.Tensor  # [T, rotary_dim] model dtype
    sin: torch.Tensor
    kv_pages: torch.Tensor  # [T] the page each token's K/V goes to
    kv_rows: torch.Tensor  # [T] the row inside that page
    decode_rows: torch.Tensor | None  # [B] flat rows of the decode tokens
    decode_slots: torch.Tensor | None  # [B] their GDN slots
    decode_slot_range: tuple[int, int] | None = None  # (a, b) when decode_slots == a, a+1, .., b-1: update in place
    kernels: DecodeKernels = TORCH  # the decode ops (ops/cpu_kernels.py), chosen once per model
    ops: Ops = None  # every op the layers call (ops/table.py): the model's, or a caller's (the profiler's timed copy)
    save_state: object = None  # Caches.save_state: where the checkpoints taken inside a prefill span go
    decode_page_table: torch.Tensor | None = None  # [B, max pages] int64, the decode spans' page tables, padded
    decode_lengths: torch.Tensor | None = None  # [B] int64, positions each decode token attends (pos + 1)
    decode_all: bool = False  # every row of the step is a decode row, in order (decode_rows == 0..T-1): the
    #                           gathers by decode_rows and the scatters back are identities and are skipped
    # a step with verify spans (decode spans of several tokens): the GDN layers step the decode rows in waves,
    # wave j holding the j-th token of every decode span that long: (rows [B_j], slots [B_j], their slot range)
    decode_waves: list[tuple[torch.Tensor, torch.Tensor, tuple[int, int] | None]] | None = None
    log_state: object = None  # Caches.log_state: the state after each wave's tokens, for the rollback


class GDNMixer(nn.Module):
    """Gated DeltaNet token mixer.

    in_proj rows: [q (Hk*dk) | k (Hk*dk) | v (Hv*dv) | z (Hv*dv) | b (Hv) | a (Hv)]: value heads grouped
    per key head (value head h belongs to key head h // (Hv // Hk)), qwen3_5's in_proj_qkv/z/b/a stacked.
    conv_weight [conv_dim, K]; A_log, dt_bias [Hv] float32; norm_weight [dv]; out_proj [H, Hv*dv].
    """

    PACKABLE = ("in_proj", "out_proj")

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, gdn_index: int = 0):
        super().__init__()
        self.gdn_index = gdn_index  # this layer's index among the GDN layers (its caches.conv / ssm entry)
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = cfg.conv_dim
        self.kernel = cfg.linear_conv_kernel_dim
        self.eps = cfg.rms_norm_eps
        self.in_proj = empty_param(self.conv_dim + self.value_dim + 2 * self.hv, cfg.hidden_size, dtype=dtype)
        self.conv_weight = empty_param(self.conv_dim, self.kernel, dtype=dtype)
        self.A_log = empty_param(self.hv, dtype=torch.float32)
        self.dt_bias = empty_param(self.hv, dtype=torch.float32)
        self.norm_weight = empty_param(self.dv, dtype=dtype)
        self.out_proj = empty_param(cfg.hidden_size, self.value_dim, dtype=dtype)

    _decay: tuple | None = None  # (A_log's version, -exp(A_log)): computed once, not per step

    def _neg_decay(self) -> torch.Tensor:
        """-exp(A_log) [Hv] fp32 (the per-token decay's factor), recomputed only when A_log changes."""
        key = (self.A_log.data_ptr(), self.A_log._version)
        if self._decay is None or self._decay[0] != key:
            self._decay = (key, -self.A_log.float().exp())
        return self._decay[1]

    def _split_qkv(self, x: torch.Tensor):
        n = x.shape[0]
        q = x[:, :self.key_dim].view(n, self.hk, self.dk)
        k = x[:, self.key_dim:2 * self.key_dim].view(n, self.hk, self.dk)
        v = x[:, 2 * self.key_dim:].view(n, self.hv, self.dv)
        return q, k, v

    def forward(self, h: torch.Tensor, ctx: StepContext, conv_cache: torch.Tensor, ssm_cache: torch.Tensor) -> torch.Tensor:
        """h [T, H] (normed). conv_cache [slots, K-1, conv_dim]; ssm_cache [slots, Hv, dv, dk] fp32."""
        T, ops = h.shape[0], ctx.ops
        proj = ops.linear(h, self.in_proj)
        c, vd, hv = self.conv_dim, self.value_dim, self.hv
        mixed, z = proj[:, :c], proj[:, c:c + vd]
        b, a = proj[:, c + vd:c + vd + hv], proj[:, c + vd + hv:]
        g, beta = ops.gdn_gates(b, a, self.dt_bias, self._neg_decay())  # [T, Hv] fp32, [T, Hv]
        waves = ctx.decode_waves
        core = None if ctx.decode_all and waves is None else torch.empty(T, hv, self.dv, dtype=h.dtype, device=h.device)
        for s in ctx.batch.prefill_spans:
            rows = slice(s.start, s.start + s.length)
            fresh = s.pos == 0  # a new sequence starts from zero states whatever the slot holds
            conv_in = None if fresh else conv_cache[s.slot]
            if s.saves:  # the conv windows before the slot's is overwritten: the last K-1 inputs before each p
                window = torch.cat([conv_in if conv_in is not None else mixed.new_zeros(self.kernel - 1, c),
                                    mixed[rows]])
                windows = [window[p - s.pos: p - s.pos + self.kernel - 1] for p, _ in s.saves]
            x, conv_state = ops.causal_conv1d_prefill(mixed[rows], self.conv_weight, conv_in)
            conv_cache[s.slot].copy_(conv_state)
            q, k, v = self._split_qkv(x)
            states: list = []
            _, state = ops.chunk_gated_delta_rule(q, k, v, g[rows], beta[rows],
                                                  None if fresh else ssm_cache[s.slot], start_pos=s.pos, out=core[rows],
                                                  states_at=tuple(p for p, _ in s.saves), states=states)
            ssm_cache[s.slot].copy_(state)
            for (_, location), w, st in zip(s.saves, windows if s.saves else (), states):
                ctx.save_state(self.gdn_index, location, w, st)
        if waves is not None:
            # verify spans: wave j is the j-th token of each, stepped exactly as a decode step steps its rows (the
            # same ops on the same slots, one token per slot per call), so every row's bits are the decode path's.
            # The conv state after each wave and the recurrence's inputs of the waves after the first go to the log;
            # the recurrent state goes back to the one after the first token, as the compiled call leaves it
            # (CacheStore.log_states: a rollback replays the accepted tokens from the log)
            first = None
            for j, (rows, slots, rng) in enumerate(waves):
                o, x = self._decode(mixed, g, beta, rows, slots, rng, False, ctx, conv_cache, ssm_cache)
                core.index_copy_(0, rows, o)
                if j == 0:
                    first = ssm_cache.index_select(0, slots)
                ctx.log_state(self.gdn_index, j, slots, x, g.index_select(0, rows), beta.index_select(0, rows))
            ssm_cache.index_copy_(0, waves[0][1], first)
        elif ctx.decode_rows is not None:
            o, _ = self._decode(mixed, g, beta, ctx.decode_rows, ctx.decode_slots, ctx.decode_slot_range,
                                ctx.decode_all, ctx, conv_cache, ssm_cache)
            if ctx.decode_all:
                core = o  # [T, Hv, dv]
            else:
                core.index_copy_(0, ctx.decode_rows, o)
        core = ops.rms_norm_gated(core.view(T, hv, self.dv), z, self.norm_weight, self.eps)  # [T, vd]
        return ops.linear(core, self.out_proj)

    def _decode(self, mixed, g, beta, rows, slots, rng, every_row: bool, ctx: StepContext, conv_cache, ssm_cache):
        """One decode token for each of `slots` (rows: their rows of the step; every_row: rows == 0..T-1):
        conv step and recurrent step, the slots' states updated in place. Returns (core [B, Hv, dv], the conv
        output x [B, conv_dim]: the recurrence's q | k | v)."""
        ops = ctx.ops
        # compiled kernels: caches updated in place through the slot ids; torch: in place for consecutive
        # slots, otherwise gather, step, scatter
        fast = ctx.kernels.compiled and ssm_cache.dtype == torch.float32 and conv_cache.dtype == mixed.dtype
        if fast:
            x = ops.conv1d_decode_step(mixed, rows, self.conv_weight, conv_cache, slots)  # [B, conv_dim]
        else:
            conv_state = conv_cache[rng[0]:rng[1]] if rng is not None else conv_cache.index_select(0, slots)
            x = ops.causal_conv1d_step(mixed.index_select(0, rows), self.conv_weight, conv_state)  # [B, conv_dim]
            if rng is None:
                conv_cache.index_copy_(0, slots, conv_state)
        q, k, v = self._split_qkv(x)
        gd, bd = (g, beta) if every_row else (g.index_select(0, rows), beta.index_select(0, rows))  # [B, Hv]
        if fast:
            o = ops.gdn_decode_step(q, k, v, gd, bd, ssm_cache, slots)
        else:
            in_place = rng is not None and ssm_cache.dtype == torch.float32
            state = ssm_cache[rng[0]:rng[1]] if in_place else ssm_cache.index_select(0, slots).float()
            o = ops.recurrent_gated_delta_rule_step(q, k, v, gd, bd, state)
            if not in_place:
                ssm_cache.index_copy_(0, slots, state.to(ssm_cache.dtype))
        return o, x

    def replay(self, kernels, ops, ssm_cache: torch.Tensor, slot: int, x: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor) -> None:
        """The slot's recurrent state stepped through n tokens from their logged inputs (x [n, conv_dim], g, beta
        [n, Hv]; CacheStore.rollback): the decode step's recurrence on each token in order, the same arithmetic
        (and bits) as the verify step's. Compiled: one call (gdn_replay, the state in cache through the tokens);
        else the torch step per token, as _decode's torch path runs it."""
        q, k, v = self._split_qkv(x)
        if kernels.compiled and ssm_cache.dtype == torch.float32 and x.dtype == beta.dtype:
            kernels.gdn_replay(q, k, v, g, beta, ssm_cache, slot)
            return
        state = ssm_cache[slot: slot + 1]
        for i in range(x.shape[0]):
            ops.recurrent_gated_delta_rule_step(q[i: i + 1], k[i: i + 1], v[i: i + 1], g[i: i + 1], beta[i: i + 1],
                                                state)


class AttentionMixer(nn.Module):
    """Gated full attention. qkv_proj rows: [q_proj (per head: D query rows then D gate rows) | k_proj | v_proj];
    q_norm, k_norm [D] zero-centred RMSNorm; partial rotary on the first rotary_dim dims; out = o_proj(attn * sigmoid(gate))."""

    PACKABLE = ("qkv_proj", "o_proj")

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.scale = self.d ** -0.5
        self.qkv_proj = empty_param((2 * self.hq + 2 * self.hkv) * self.d, cfg.hidden_size, dtype=dtype)
        self.q_norm = empty_param(self.d, dtype=dtype)
        self.k_norm = empty_param(self.d, dtype=dtype)
        self.o_proj = empty_param(cfg.hidden_size, self.hq * self.d, dtype=dtype)

    def project(self, h: torch.Tensor, ops) -> tuple[torch.Tensor, ...]:
        """One fused projection of h [T, H] split into q [T, Hq, D], the output gate [T, Hq*D], k and v [T, Hkv, D]."""
        T, hq, hkv, d = h.shape[0], self.hq, self.hkv, self.d
        proj = ops.linear(h, self.qkv_proj)
        qg = proj[:, :2 * hq * d].view(T, hq, 2 * d)
        k = proj[:, 2 * hq * d:(2 * hq + hkv) * d].view(T, hkv, d)
        v = proj[:, (2 * hq + hkv) * d:].view(T, hkv, d)
        return qg[..., :d], qg[..., d:].reshape(T, hq * d), k, v

    def forward(self, h: torch.Tensor, ctx: StepContext, kv_cache: torch.Tensor) -> torch.Tensor:
        """h [T, H] (normed); kv_cache [pages, 2, block_size, Hkv, D]."""
        T, ops = h.shape[0], ctx.ops
        hq, d = self.hq, self.d
        q, gate, k, v = self.project(h, ops)
        q = ops.qk_norm_rope(q, self.q_norm, self.eps, ctx.cos, ctx.sin)
        k = ops.qk_norm_rope(k, self.k_norm, self.eps, ctx.cos, ctx.sin)
        ops.kv_write(kv_cache, ctx.kv_pages, ctx.kv_rows, k, v)
        batched = ctx.kernels.compiled and ctx.decode_rows is not None
        out = None if batched and ctx.decode_all else torch.empty(T, hq, d, dtype=h.dtype, device=h.device)
        for s in ctx.batch.spans:
            if s.is_decode and batched:
                continue  # all decode spans in one call below
            rows = slice(s.start, s.start + s.length)
            if not s.is_decode and s.pos == 0 and kv_cache.dtype == k.dtype:
                # a fresh prefill attends only its own keys, just written: read them from the projections
                out[rows] = ops.prefill_attention(q[rows], k[rows], v[rows], 0, self.scale)
                continue
            keys, values = ops.kv_gather(kv_cache, s.page_ids, s.pos + s.length)
            if s.is_decode:  # a verify span: each token attends as its own decode step would, to pos + j + 1 keys
                for j in range(s.length):
                    n = s.pos + j + 1
                    out[s.start + j] = ops.decode_attention(q[s.start + j], keys[:n], values[:n], self.scale)
            else:
                out[rows] = ops.prefill_attention(q[rows], keys, values, s.pos, self.scale)
        if batched:  # K/V read in place through the page tables
            qd = q.contiguous() if ctx.decode_all else q.index_select(0, ctx.decode_rows)
            o = ops.paged_decode_attention(qd, kv_cache, ctx.decode_page_table, ctx.decode_lengths,
                                           self.scale)  # [B, Hq, D]
            if ctx.decode_all:
                out = o
            else:
                out.index_copy_(0, ctx.decode_rows, o)
        out = ops.gate_output(out.view(T, hq * d), gate)
        return ops.linear(out, self.o_proj)


class DenseMLP(nn.Module):
    """SwiGLU: gate_up [2I, H] = cat(gate_proj, up_proj); down [H, I]."""

    PACKABLE = ("gate_up", "down")

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype):
        super().__init__()
        self.gate_up = empty_param(2 * inter, hidden, dtype=dtype)
        self.down = empty_param(hidden, inter, dtype=dtype)

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        return ops.swiglu(x, self.gate_up, self.down)


class SparseMoE(nn.Module):
    """router [E, H]; experts_gate_up [E, 2I, H]; experts_down [E, H, I]; shared expert (shared_gate_up,
    shared_down) scaled by sigmoid(shared_gate [1, H] . x)."""

    PACKABLE = ("experts_gate_up", "experts_down", "shared_gate_up", "shared_down")

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, norm_topk_prob: bool):
        super().__init__()
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = norm_topk_prob
        self.router = empty_param(E, H, dtype=dtype)
        self.experts_gate_up = empty_param(E, 2 * I, H, dtype=dtype)
        self.experts_down = empty_param(E, H, I, dtype=dtype)
        self.has_shared = cfg.shared_expert_intermediate_size > 0
        if self.has_shared:
            Is = cfg.shared_expert_intermediate_size
            self.shared_gate_up = empty_param(2 * Is, H, dtype=dtype)
            self.shared_down = empty_param(H, Is, dtype=dtype)
            self.shared_gate = empty_param(1, H, dtype=dtype)

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        if self.has_shared:
            return ops.moe(x, self.router, self.experts_gate_up, self.experts_down, self.top_k, self.norm_topk_prob,
                           self.shared_gate_up, self.shared_down, self.shared_gate)
        return ops.moe(x, self.router, self.experts_gate_up, self.experts_down, self.top_k, self.norm_topk_prob)


def is_moe_layer(cfg: ModelConfig, index: int) -> bool:
    """transformers' rule: qwen3_5_moe_text has a sparse MoE block in every layer; qwen3_next follows
    num_experts, mlp_only_layers and decoder_sparse_step (ModelConfig.is_moe_layer)."""
    if cfg.model_type == "qwen3_5_moe_text":
        return True
    return cfg.is_moe_layer(index)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, dtype: torch.dtype, kind: str | None = None):
        """kind: the token mixer ("linear_attention" | "full_attention"), default cfg.layer_types[index]; the MTP
        layer (index past the model's layers) is a full-attention layer."""
        super().__init__()
        kind = kind or cfg.layer_types[index]
        self.is_gdn = kind == "linear_attention"
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = empty_param(cfg.hidden_size, dtype=dtype)
        self.post_attention_layernorm = empty_param(cfg.hidden_size, dtype=dtype)
        if self.is_gdn:
            self.linear_attn = GDNMixer(cfg, dtype, cfg.layer_types[:index].count("linear_attention"))
        else:
            self.self_attn = AttentionMixer(cfg, dtype)
        if is_moe_layer(cfg, index):
            # qwen3_5_moe always renormalises the top-k weights; qwen3_next follows norm_topk_prob
            norm = True if cfg.model_type == "qwen3_5_moe_text" else cfg.norm_topk_prob
            self.mlp = SparseMoE(cfg, dtype, norm)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, dtype)

    def forward(self, x: torch.Tensor, ctx: StepContext, cache: tuple[torch.Tensor, ...]) -> torch.Tensor:
        h = ctx.ops.rms_norm(x, self.input_layernorm, self.eps)
        h = self.linear_attn(h, ctx, *cache) if self.is_gdn else self.self_attn(h, ctx, *cache)
        x, h = ctx.ops.add_rms_norm(x, h, self.post_attention_layernorm, self.eps)
        return x + self.mlp(h, ctx.ops)
