"""Decode-only steps in one compiled call for the whole model (ops/csrc/decode_layers.cpp DecodeModel).

A tiny model's decode step spent most of its time between kernels: ~25 op-table calls per layer (each a Python
call and a few ATen dispatches), a module call per layer and ~20 small ATen ops building the step's tensors.
When every row of a step is a decode row and the model runs on its own op table, decode_step runs the embedding
lookup, every layer and the final norm as one call of the compiled kernels, which runs the same kernels in the
same order on the same tensors as the op-table path (qwen3_5.py, layers.py): the bits are that path's exactly
(tests/test_fused_decode.py), so a decode row is the same whether its step was fused or shared with prefill rows
(the batch-invariance and hit == cold gates rest on that).

A model qualifies when every layer does: projections bf16 weights packed for the compiled linear (kind "cpp")
by one module, a plain GDN or attention mixer (not a tensor-parallel wrapper), a dense MLP, bf16 norms; and the
caches are bf16 (conv, KV) and fp32 (GDN state), checked by every call. Anything else takes the op-table path.
The profiler's op table (a timed copy) never takes this path, so its timings stay per op.
"""
from __future__ import annotations

import torch

from .batch import long_tensor
from .ops.cpu_kernels import tap_major
from .ops.linear import PackedWeight


def _packed(*ws) -> bool:
    """Packed for the compiled linear, all by one module (the one ops/linear.py calls them with)."""
    return all(isinstance(w, PackedWeight) and w.kind == "cpp" and w.ext is ws[0].ext for w in ws)


def _on_amx(w: PackedWeight) -> bool:
    """Whether ops/linear.py multiplies this weight on AMX tiles (the amx set's linear_bf16 is linear_bf16_amx)."""
    return w.ext.kernel_isa() == "amx"


def _layer(layer) -> tuple | None:
    """(is_gdn, weights, dims, eps, scale, packed weights) for DecodeModel.add_*, or None: the layer does not
    qualify."""
    from .layers import AttentionMixer, DenseMLP, GDNMixer

    mlp = layer.mlp
    if type(mlp) is not DenseMLP or layer.input_layernorm.dtype != torch.bfloat16:
        return None
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if layer.is_gdn:
        m = layer.linear_attn
        if type(m) is not GDNMixer:
            return None
        packed = (m.in_proj, m.out_proj, mlp.gate_up, mlp.down)
        if not _packed(*packed) or m.dt_bias.dtype != torch.float32 or m.norm_weight.dtype != torch.bfloat16:
            return None
        w = norms + [m.in_proj.packed, tap_major(m.conv_weight), m.dt_bias, m._neg_decay(), m.norm_weight,
                     m.out_proj.packed]
        dims = [m.in_proj.shape[0], m.conv_dim, m.value_dim, m.hv, m.hk, m.dk, m.dv, m.out_proj.shape[0]]
        scale = 0.0
    else:
        m = layer.self_attn
        if type(m) is not AttentionMixer:
            return None
        packed = (m.qkv_proj, m.o_proj, mlp.gate_up, mlp.down)
        if not _packed(*packed) or m.q_norm.dtype != torch.bfloat16:
            return None
        w = norms + [m.qkv_proj.packed, m.q_norm, m.k_norm, m.o_proj.packed]
        dims = [m.qkv_proj.shape[0], m.hq, m.hkv, m.d, m.o_proj.shape[0]]
        scale = m.scale
    return (layer.is_gdn, w + [mlp.gate_up.packed, mlp.down.packed], dims + [mlp.gate_up.shape[0], mlp.down.shape[0]],
            layer.eps, scale, packed)


def _versions(sources: tuple) -> tuple:
    return tuple(t._version for t in sources)


def decode_program(model):
    """The model's DecodeModel, or None: it does not qualify. Built on first use, and again when the kernels, the
    packing, or the embedding or final norm tensor changed, or a source of its derived weights (the conv weights
    it holds tap-major, the A_log it holds as -exp(A_log)) was changed in place."""
    base = (id(model.decode_kernels), model.linear_kind, id(model.embed_tokens), id(model.norm))
    cached = model.__dict__.get("_decode_program")  # (base, sources, their versions, program)
    if cached is not None and cached[0] == base and cached[2] == _versions(cached[1]):
        return cached[3]
    kernels = model.decode_kernels
    program, sources = None, ()
    if (kernels is not None and kernels.compiled and model.dtype == torch.bfloat16
            and model.embed_tokens.is_contiguous() and model.norm.dtype == torch.bfloat16):
        plans = [_layer(layer) for layer in model.layers]
        amx = {_on_amx(p[5][0]) for p in plans if p is not None}
        exts = {id(p[5][0].ext) for p in plans if p is not None}
        if plans and all(p is not None for p in plans) and len(amx) == 1 and len(exts) == 1:
            ext = plans[0][5][0].ext
            program = ext.DecodeModel(model.embed_tokens, model.norm, model.config.rms_norm_eps, amx.pop())
            for is_gdn, w, dims, eps, scale, _ in plans:
                if is_gdn:
                    program.add_gdn(w, dims, eps)
                else:
                    program.add_attention(w, dims, eps, scale)
            sources = tuple(t for layer in model.layers if layer.is_gdn
                            for t in (layer.linear_attn.conv_weight, layer.linear_attn.A_log))
    model._decode_program = (base, sources, _versions(sources), program)
    return program


def decode_step(model, batch, caches) -> torch.Tensor | None:
    """hidden [B, H] (final norm applied) for a step whose every span is a decode span, its rows in order, in one
    compiled call; None when the step is not one or the model does not qualify (the caller takes the op-table
    path)."""
    spans = batch.spans
    if not spans or not spans[0].is_decode:  # prefill spans come first
        return None
    program = decode_program(model)
    if program is None:
        return None
    batch.check(caches.block_size)  # every span a one-token decode span now
    if any(s.start != i for i, s in enumerate(spans)):
        return None
    slots = long_tensor([s.slot for s in spans])
    lengths = long_tensor([s.pos + 1 for s in spans])
    cos, sin = model.rotary(batch.positions, max(s.pos for s in spans) + 1)
    return program.run(batch.input_ids, caches.conv, caches.ssm, caches.kv, slots, cos, sin,
                       batch.decode_page_table(), lengths)
