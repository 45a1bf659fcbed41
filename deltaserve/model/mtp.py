"""The multi-token-prediction (MTP) layer Qwen3.5 / Qwen3-Next checkpoints carry beside the model (mtp.* tensors,
config mtp_num_hidden_layers), and its own small K/V cache.

The layer predicts the token after next from the model's last hidden state and the next token:

    x = fc(cat(rms_norm(embed(token at p + 1), pre_fc_norm_embedding), rms_norm(h_p, pre_fc_norm_hidden)))
    x = one decoder layer (gated full attention at position p, then the MLP)
    h' = rms_norm(x, norm);  logits = the model's head(h')   (embeddings and head shared with the model)

h_p is the model's output at position p (final norm applied: what HybridModel.forward returns). A second draft
chains on the layer's own output: h' and the first draft give the next one (vLLM's qwen3_next_mtp does the same with
one MTP layer; with several, draft j uses layer j % n).

Stored names (what loader.py reads): mtp.fc.weight [H, 2H], mtp.pre_fc_norm_embedding.weight, mtp.pre_fc_norm_hidden
.weight, mtp.norm.weight [H], mtp.layers.{i}.* (a decoder layer's tensors, full attention).

Drafts only decide how many tokens a step accepts, never which: the model verifies every one (docs/speculative.md),
so the layer's K/V lives in its own dense per-request cache (MTPCache), not in the page pool, and a position the
layer never saw (a prefix-cache hit serves the model's K/V and GDN state, not the MTP layer's) stays zero: drafts get
worse there, outputs do not change.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .layers import AttentionMixer, DecoderLayer, empty_param
from .ops.table import Ops


class MTPCache:
    """One request's K/V of the MTP layers: [layers, capacity, Hkv, D] each, grown by doubling; position p's row is
    written whenever the layer runs at p (a later run at p overwrites an earlier draft's row)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.k = torch.zeros(layers, 256, kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    def reserve(self, end: int) -> None:
        cap = self.k.shape[1]
        if end > cap:
            while cap < end:
                cap *= 2
            grow = lambda t: torch.cat([t, t.new_zeros(t.shape[0], cap - t.shape[1], *t.shape[2:])], dim=1)
            self.k, self.v = grow(self.k), grow(self.v)


class MTPHead(nn.Module):
    """The MTP layers (parameters fc, pre_fc_norm_embedding, pre_fc_norm_hidden, layers.{i}.*, norm)."""

    PACKABLE = ("fc",)

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        H = cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        self.fc = empty_param(H, 2 * H, dtype=dtype)
        self.pre_fc_norm_embedding = empty_param(H, dtype=dtype)
        self.pre_fc_norm_hidden = empty_param(H, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, cfg.num_hidden_layers + i, dtype, kind="full_attention")
                                    for i in range(cfg.mtp_num_hidden_layers))
        self.norm = empty_param(H, dtype=dtype)

    def new_cache(self, cfg: ModelConfig, device: torch.device) -> MTPCache:
        return MTPCache(len(self.layers), cfg.num_key_value_heads, cfg.head_dim, self.fc.dtype
                        if isinstance(self.fc, torch.Tensor) else self.norm.dtype, device)

    def forward(self, model, token_ids: torch.Tensor, hidden: torch.Tensor, start: int, cache: MTPCache,
                step: int = 0) -> torch.Tensor:
        """token_ids [n] (the tokens at start + 1 .. start + n), hidden [n, H] (the model's, or this head's own
        output for a chained draft, at positions start .. start + n - 1) -> this head's output [n, H] (final norm
        applied; model.compute_logits makes the drafts' logits). Writes the K/V of positions start .. start + n - 1
        into cache. step: the draft's index (picks layer step % layers)."""
        ops: Ops = model.ops
        n = token_ids.shape[0]
        e = model.embed(token_ids)
        e = ops.rms_norm(e, self.pre_fc_norm_embedding, self.eps)
        h = ops.rms_norm(hidden, self.pre_fc_norm_hidden, self.eps)
        x = ops.linear(torch.cat([e, h], dim=-1), self.fc)
        li = step % len(self.layers)
        layer = self.layers[li]
        hn = ops.rms_norm(x, layer.input_layernorm, layer.eps)
        a = _attention(layer.self_attn, ops, model, hn, start, cache, li)
        x, hn = ops.add_rms_norm(x, a, layer.post_attention_layernorm, layer.eps)
        x = x + layer.mlp(hn, ops)
        assert x.shape[0] == n
        return ops.rms_norm(x, self.norm, self.eps)


def _attention(m: AttentionMixer, ops: Ops, model, h: torch.Tensor, start: int, cache: MTPCache,
               li: int) -> torch.Tensor:
    """The gated attention of AttentionMixer over a dense cache: positions start .. start + n - 1 attend to
    0 .. their own (the same projections, norms, rotary and gate as the model's attention layers)."""
    T = h.shape[0]
    q, gate, k, v = m.project(h, ops)
    positions = torch.arange(start, start + T, device=h.device)
    cos, sin = model.rotary(positions, start + T)
    q = ops.qk_norm_rope(q, m.q_norm, m.eps, cos, sin)
    k = ops.qk_norm_rope(k, m.k_norm, m.eps, cos, sin)
    cache.reserve(start + T)
    cache.k[li, start:start + T] = k.to(cache.k.dtype)
    cache.v[li, start:start + T] = v.to(cache.v.dtype)
    out = ops.prefill_attention(q, cache.k[li], cache.v[li], start, m.scale)
    out = ops.gate_output(out.reshape(T, m.hq * m.d), gate)
    return ops.linear(out, m.o_proj)
