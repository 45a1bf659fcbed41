"""Decode-only steps in one compiled call for the whole model (ops/csrc/decode_layers.cpp DecodeModel).

A tiny model's decode step spent most of its time between kernels: ~25 op-table calls per layer (each a Python
call and a few ATen dispatches), a module call per layer and ~20 small ATen ops building the step's tensors.
When every row of a step is a decode row and the model runs on its own op table, decode_step runs the embedding
lookup, every layer and the final norm as one call of the compiled kernels, which runs the same kernels in the
same order on the same tensors as the op-table path (qwen3_5.py, layers.py): the bits are that path's exactly
(tests/test_fused_decode.py), so a decode row is the same whether its step was fused or shared with prefill rows
(the batch-invariance and hit == cold gates rest on that).

A model qualifies when every layer does: every projection part packed for a compiled linear (bf16 weights for
linear_bf16 by the decode kernels' own build, block-FP8 weights for linear_fp8, one FP8 module for the model), a
plain GDN or attention mixer (not a tensor-parallel wrapper), a dense MLP, bf16 norms; and the caches are bf16
(conv, KV) and fp32 (GDN state), checked by every call. Anything else takes the op-table path.
The profiler's op table (a timed copy) never takes this path, so its timings stay per op.
"""
from __future__ import annotations

import torch

from .batch import long_tensor
from .layers import AttentionMixer, DenseMLP, GDNMixer
from .ops.cpu_kernels import tap_major
from .ops.fp8 import Fp8Weight, SplitWeight
from .ops.int4 import Int4Weight
from .ops.packed import PackedWeight


def _parts(w, ext, fp8_exts: set) -> list | None:
    """The projection as DecodeModel parts [(packed, fp8 scales or None, N, fp8 path)] in output-row order, or
    None: a part is not packed for a compiled kernel (bf16 parts by ext, the decode kernels' build, as
    prepack_linears packs them; fp8 parts by the fp8 kernel, whose module joins fp8_exts)."""
    if isinstance(w, SplitWeight):
        parts = [_parts(p, ext, fp8_exts) for p in w.parts]
        return None if any(p is None for p in parts) else [q for p in parts for q in p]
    if isinstance(w, PackedWeight) and w.kind == "cpp" and w.ext is ext:
        return [(w.packed, None, w.shape[0], "")]
    if isinstance(w, Fp8Weight) and w.packed is not None:
        fp8_exts.add(w.ext)
        return [(w.packed, w.scales, w.shape[0], w.path)]
    if isinstance(w, Int4Weight) and w.packed is not None:  # the same module's linear_int4, by its "int4" path
        fp8_exts.add(w.ext)
        return [(w.packed, w.packed_scales, w.shape[0], w.path)]
    return None


def _layer(layer, ext, fp8_exts: set) -> tuple | None:
    """(is_gdn, weights, projections, dims, eps, scale) for DecodeModel.add_*, or None: the layer does not
    qualify."""

    mlp = layer.mlp
    if type(mlp) is not DenseMLP or layer.input_layernorm.dtype != torch.bfloat16:
        return None
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if layer.is_gdn:
        m = layer.linear_attn
        if type(m) is not GDNMixer or m.dt_bias.dtype != torch.float32 or m.norm_weight.dtype != torch.bfloat16:
            return None
        w = norms + [tap_major(m.conv_weight), m.dt_bias, m._neg_decay(), m.norm_weight]
        projs = (m.in_proj, m.out_proj)
        dims = [m.conv_dim, m.value_dim, m.hv, m.hk, m.dk, m.dv]
        scale = 0.0
    else:
        m = layer.self_attn
        if type(m) is not AttentionMixer or m.q_norm.dtype != torch.bfloat16:
            return None
        w = norms + [m.q_norm, m.k_norm]
        projs = (m.qkv_proj, m.o_proj)
        dims = [m.hq, m.hkv, m.d]
        scale = m.scale
    parts = [_parts(p, ext, fp8_exts) for p in (*projs, mlp.gate_up, mlp.down)]
    if any(p is None for p in parts):
        return None
    return layer.is_gdn, w, parts, dims, layer.eps, scale


def _versions(sources: tuple) -> tuple:
    return tuple(t._version for t in sources)


def _lookup_table(model) -> torch.Tensor | None:
    """The tensor the program looks a token's embedding up in: embed_tokens, or a tied head's bf16 packing where that
    is the embedding; None for a tied head quantized with --quantize-head (rows the program cannot read: staged)."""
    if model.embed_tokens is not None:
        return model.embed_tokens
    head = model.packed_head
    return head.packed if isinstance(head, PackedWeight) else None


def _staging(model, rows: int) -> torch.Tensor:
    """The model's staging rows for a program that cannot look a token's embedding up itself: [R, H] bf16, R >= rows
    (grown by doubling: a new tensor, so the program is built again around it)."""
    stage = model.__dict__.get("_embed_stage")
    if stage is None or stage.shape[0] < rows:
        n = max(64, rows, 2 * stage.shape[0] if stage is not None else 0)
        stage = torch.zeros(n, model.config.hidden_size, dtype=torch.bfloat16)
        model._embed_stage = stage
    return stage


def stage_ids(model, ids: torch.Tensor) -> torch.Tensor:
    """The ids the program looks up: ids as they are, or, where the program's embedding is the staging rows, row i
    for token i after model.embed(ids) (the quantized head's rows, dequantized) is written there."""
    if _lookup_table(model) is not None:
        return ids
    n = ids.numel()
    model._embed_stage[:n].copy_(model.embed(ids))
    return torch.arange(n, dtype=torch.long)


def decode_program(model, rows: int = 0):
    """The model's DecodeModel, or None: it does not qualify. rows: the step's, for a program whose embedding is
    staged (stage_ids). Built on first use, and again when the kernels, the
    packing, or the embedding or final norm tensor changed, or a source of its derived weights (the conv weights
    it holds tap-major, the A_log it holds as -exp(A_log)) was changed in place."""
    embed = _lookup_table(model)
    if embed is None:
        embed = _staging(model, rows)
    base = (id(model.decode_kernels), model.linear_kind, id(embed), id(model.norm))
    cached = model.__dict__.get("_decode_program")  # (base, sources, their versions, program)
    if cached is not None and cached[0] == base and cached[2] == _versions(cached[1]):
        return cached[3]
    kernels = model.decode_kernels
    program, sources = None, ()
    if (kernels is not None and kernels.compiled and model.dtype == torch.bfloat16
            and embed.is_contiguous() and model.norm.dtype == torch.bfloat16):
        fp8_exts: set = set()
        plans = [_layer(layer, kernels.ext, fp8_exts) for layer in model.layers]
        fp8 = fp8_exts.pop().linear_fp8_capsule() if len(fp8_exts) == 1 else None
        if plans and all(p is not None for p in plans) and not fp8_exts:  # at most one fp8 module
            # ops/linear.py multiplies bf16 weights on AMX tiles where the set is amx (its linear_bf16)
            program = kernels.ext.DecodeModel(embed, model.norm, model.config.rms_norm_eps,
                                              kernels.ext.kernel_isa() == "amx", fp8, vocab=model.config.vocab_size)
            for is_gdn, w, parts, dims, eps, scale in plans:
                if is_gdn:
                    program.add_gdn(w, parts, dims, eps)
                else:
                    program.add_attention(w, parts, dims, eps, scale)
            sources = tuple(t for layer in model.layers if layer.is_gdn
                            for t in (layer.linear_attn.conv_weight, layer.linear_attn.A_log))
    model._decode_program = (base, sources, _versions(sources), program)
    return program


def decode_step(model, batch, caches) -> torch.Tensor | None:
    """hidden [T, H] (final norm applied) for a step whose every span is a decode span (of one token, or a verify
    span of several), its rows in order, in one compiled call; None when the step is not one or the model does not
    qualify (the caller takes the op-table path)."""
    spans = batch.spans
    if not spans or not spans[0].is_decode:  # prefill spans come first
        return None
    if any(s.length != 1 for s in spans):
        return _verify_step(model, batch, caches)
    program = decode_program(model, len(spans))
    if program is None:
        return None
    batch.check(caches.block_size)  # every span a one-token decode span now
    if any(s.start != i for i, s in enumerate(spans)):
        return None
    slots = long_tensor([s.slot for s in spans])
    lengths = long_tensor([s.pos + 1 for s in spans])
    cos, sin = model.rotary(batch.positions, batch.rope_end or max(s.pos for s in spans) + 1)
    return program.run(stage_ids(model, batch.input_ids), caches.conv, caches.ssm, caches.kv, slots, cos, sin,
                       batch.decode_page_table(), lengths)


def _verify_step(model, batch, caches) -> torch.Tensor | None:
    """decode_step for a step with verify spans (docs/speculative.md): DecodeModel.run_verify over the step's rows in
    wave order (wave j: the j-th token of every span that long, as the op-table path steps the GDN layers), each row
    with its span's slot and page table and its own length (position + 1), the conv states after each wave and the
    recurrence's inputs of the later waves logged into the caches' state log, each slot's recurrent state left after
    its span's first token (runner/cache.py CacheStore.log_states). None where the op-table path must run it (no
    program, no state log)."""
    program = decode_program(model, batch.input_ids.numel())
    n = len(caches.conv)
    if program is None or not n or any(len(t) != n for t in (caches.log_conv, caches.log_x, caches.log_g,
                                                               caches.log_beta)):
        return None
    batch.check(caches.block_size)  # every span a decode span of one token or more now
    order, slots, pos, table_rows, waves = [], [], [], [], []
    start = 0
    for s in batch.spans:
        if s.start != start:
            return None
        start += s.length
    for j in range(max(s.length for s in batch.spans)):
        n = len(order)
        for i, s in enumerate(batch.spans):
            if s.length > j:
                order.append(s.start + j)
                slots.append(s.slot)
                pos.append(s.pos + j)
                table_rows.append(i)
        waves.append(len(order) - n)
    rows = long_tensor(order)
    if len(batch.spans) == 1:  # one span: wave order is the step's order
        ids, positions = batch.input_ids, batch.positions
    else:
        ids, positions = batch.input_ids.index_select(0, rows), batch.positions.index_select(0, rows)
    table = batch.decode_page_table().index_select(0, long_tensor(table_rows))
    cos, sin = model.rotary(positions, batch.rope_end or max(pos) + 1)
    return program.run_verify(stage_ids(model, ids), caches.conv, caches.ssm, caches.kv, long_tensor(slots), cos,
                              sin, table, long_tensor([p + 1 for p in pos]), waves, rows, caches.log_conv,
                              caches.log_x, caches.log_g, caches.log_beta)
