"""Decode-only steps, one compiled call per decoder layer (ops/csrc/decode_layers.cpp).

A tiny model's decode step spent most of its time between kernels: ~25 op-table calls per layer, each a
Python call and a few ATen dispatches. When every row of a step is a decode row (StepContext.fused), each
qualifying layer runs as one call of the compiled kernels instead, which runs the same kernels in the same
order on the same tensors as layers.py's path: the bits are the op-table path's exactly
(tests/test_fused_decode.py), so a decode row is the same whether its step was fused or shared with prefill
rows (the batch-invariance and hit == cold gates rest on that).

A layer qualifies when its projections are bf16 weights packed for the compiled linear (kind "cpp"), its
mixer is a plain GDN or attention mixer (not a tensor-parallel wrapper) and its MLP dense; each call also
checks the caches (bf16 conv and KV pools, fp32 GDN state). Anything else takes layers.py's path. The
profiler's op table (a timed copy) never takes this path, so its timings stay per op.
"""
from __future__ import annotations

import torch

from .ops.cpu_kernels import tap_major
from .ops.linear import PackedWeight


def _packed(*ws) -> bool:
    """Packed for the compiled linear, all by one module (the one ops/linear.py calls them with)."""
    return all(isinstance(w, PackedWeight) and w.kind == "cpp" and w.ext is ws[0].ext for w in ws)


def _on_amx(w: PackedWeight) -> bool:
    """Whether ops/linear.py multiplies this weight on AMX tiles (the amx set's linear_bf16 is linear_bf16_amx)."""
    return w.ext.kernel_isa() == "amx"


def _plan(layer) -> tuple | None:
    """(kind, weights, dims, amx) for the compiled call, or None when the layer does not qualify."""
    from .layers import AttentionMixer, DenseMLP, GDNMixer

    mlp = layer.mlp
    if type(mlp) is not DenseMLP or not _packed(mlp.gate_up, mlp.down) or layer.input_layernorm.dtype != torch.bfloat16:
        return None
    tail_w = [mlp.gate_up.packed, mlp.down.packed]
    tail_n = [mlp.gate_up.shape[0], mlp.down.shape[0]]
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if layer.is_gdn:
        m = layer.linear_attn
        if type(m) is not GDNMixer or not _packed(m.in_proj, m.out_proj) or m.dt_bias.dtype != torch.float32:
            return None
        w = norms + [m.in_proj.packed, None, m.dt_bias, None, m.norm_weight, m.out_proj.packed]
        dims = [m.in_proj.shape[0], m.conv_dim, m.value_dim, m.hv, m.hk, m.dk, m.dv, m.out_proj.shape[0]]
        if not _packed(m.in_proj, m.out_proj, mlp.gate_up, mlp.down):
            return None
        return "gdn", w + tail_w, dims + tail_n, _on_amx(mlp.gate_up)
    m = layer.self_attn
    if type(m) is not AttentionMixer or not _packed(m.qkv_proj, m.o_proj):
        return None
    w = norms + [m.qkv_proj.packed, m.q_norm, m.k_norm, m.o_proj.packed]
    dims = [m.qkv_proj.shape[0], m.hq, m.hkv, m.d, m.o_proj.shape[0]]
    if not _packed(m.qkv_proj, m.o_proj, mlp.gate_up, mlp.down):
        return None
    return "attn", w + tail_w, dims + tail_n, _on_amx(mlp.gate_up)


def fused_decode(layer, x: torch.Tensor, ctx, cache: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
    """The layer's decode step as one compiled call (x [B, H] -> [B, H]), or None: take layers.py's path."""
    plan = layer.__dict__.get("_fused_plan", False)
    if plan is False:
        plan = layer._fused_plan = _plan(layer)
    if plan is None or x.dtype != torch.bfloat16:
        return None
    kind, w, dims, amx = plan
    ext = ctx.kernels.ext
    if kind == "gdn":
        conv, ssm = cache
        if conv.dtype != x.dtype or ssm.dtype != torch.float32:
            return None
        m = layer.linear_attn
        w[3], w[5] = tap_major(m.conv_weight), m._neg_decay()  # cached; remade if changed in place
        return ext.gdn_layer_decode(x, w, dims, layer.eps, conv, ssm, ctx.decode_rows, ctx.decode_slots, amx)
    (kv,) = cache
    if kv.dtype != x.dtype:
        return None
    step = [ctx.cos, ctx.sin, ctx.kv_pages, ctx.kv_rows, ctx.decode_page_table, ctx.decode_lengths]
    return ext.attention_layer_decode(x, w, dims, layer.eps, layer.self_attn.scale, kv, step, amx)
