"""The sharding rules: which rows / columns of every HybridModel tensor a tensor-parallel rank holds.

Megatron's scheme, as vLLM and SGLang apply it to Qwen3.5 / Qwen3-Next:

| tensor (HybridModel name) | split | by |
|---|---|---|
| GDN `in_proj` [q, k, v, z, b, a] | column (rows of the weight) | key heads (q, k), value heads (v, z, b, a) |
| GDN `conv_weight` [q, k, v] | per segment | key heads, value heads |
| GDN `A_log`, `dt_bias` | | value heads |
| GDN `norm_weight` [dv] | replicated | (the gated norm is per head: local) |
| GDN `out_proj` | row (columns of the weight) | value heads; one all-reduce |
| attention `qkv_proj` [q+gate, k, v] | column | query heads; KV heads (replicated when fewer than ranks) |
| attention `q_norm`, `k_norm` | replicated | |
| attention `o_proj` | row | query heads; one all-reduce |
| MLP `gate_up`, experts' and shared expert's | column | intermediate size |
| MLP `down`, experts' and shared expert's | row | intermediate size; one all-reduce per MLP / MoE block |
| MoE `router`, `shared_gate` | replicated | (every rank routes the same tokens the same way) |
| `embed_tokens` | replicated | |
| the head (`lm_head`, or the tied embedding) | vocab-parallel | vocabulary rows (padded to tp's multiple); logits gathered |
| layer norms, final norm | replicated | |

Value head h belongs to key head h // (Hv / Hk) and both are cut in contiguous ranges, so a rank's value heads
belong to its own key heads. The loader has already un-interleaved qwen3_next's per-key-head-group
in_proj_qkvz / in_proj_ba into this [q | k | v | z] / [b | a] order (loader.unfuse_qkvz), so the three model
types share one rule. The recurrent state of a value head lives only on its rank.

Pure functions over the loaded state dict (`HybridModel.state_dict()` names); no process group here.
"""
from __future__ import annotations

import dataclasses

import torch

from ..config import ConfigError, ModelConfig
from ..memory.sizing import cdiv


def check_divisible(cfg: ModelConfig, tp: int) -> None:
    """Raise ConfigError naming the numbers when cfg's heads or widths do not split over tp ranks."""
    if tp < 1:
        raise ConfigError(f"tensor-parallel size must be >= 1, not {tp}")
    bad = []
    for what, n in (("linear_num_key_heads (GDN key heads)", cfg.linear_num_key_heads),
                    ("linear_num_value_heads (GDN value heads)", cfg.linear_num_value_heads),
                    ("num_attention_heads", cfg.num_attention_heads),
                    ("intermediate_size", cfg.intermediate_size),
                    ("moe_intermediate_size", cfg.moe_intermediate_size),
                    ("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size)):
        if n % tp:
            bad.append(f"{what} {n}")
    kv = cfg.num_key_value_heads
    if kv % tp and tp % kv:
        bad.append(f"num_key_value_heads {kv} (neither divides by it nor divides it, so KV heads can be neither "
                   f"split nor replicated)")
    if bad:
        raise ConfigError(f"tensor-parallel size {tp} does not divide {cfg.model_type}'s " + "; ".join(bad)
                          + "; choose a tensor-parallel size that divides them")


def rank_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The geometry one rank's HybridModel has: every head count and intermediate width divided by tp (KV heads
    at least 1: replicated), the hidden size and the vocabulary whole (the embedding is replicated; the head's
    rows are ShardedModel's own), untied (the rank's head is a slice, not the embedding)."""
    check_divisible(cfg, tp)
    return dataclasses.replace(
        cfg, num_attention_heads=cfg.num_attention_heads // tp,
        num_key_value_heads=max(1, cfg.num_key_value_heads // tp),
        linear_num_key_heads=cfg.linear_num_key_heads // tp, linear_num_value_heads=cfg.linear_num_value_heads // tp,
        intermediate_size=cfg.intermediate_size // tp, moe_intermediate_size=cfg.moe_intermediate_size // tp,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // tp, tie_word_embeddings=False)


def vocab_rows(vocab: int, tp: int) -> int:
    """Head rows per rank: cdiv(vocab, tp); the last rank's slice is padded with zero rows (sliced off after
    the gather)."""
    return cdiv(vocab, tp)


def _pieces(t: torch.Tensor, sizes: list[int], parts: list[int], index: list[int], dim: int) -> torch.Tensor:
    """Concatenate, for each consecutive segment of `sizes` along dim, piece index[i] of it cut into parts[i]."""
    assert sum(sizes) == t.shape[dim], f"segments {sizes} do not cover {t.shape[dim]} along dim {dim}"
    out, start = [], 0
    for size, n, i in zip(sizes, parts, index):
        assert size % n == 0, f"segment of {size} does not cut into {n}"
        step = size // n
        out.append(t.narrow(dim, start + i * step, step))
        start += size
    return torch.cat(out, dim).contiguous()


def shard_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s tensors of a full HybridModel state dict (names as HybridModel.state_dict() gives them),
    for a model built as ShardedModel(rank_config(cfg, tp), ...). Every tensor has a rule; an unknown name
    raises (a new parameter must get a sharding rule, not be replicated by accident)."""
    check_divisible(cfg, tp)
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} outside [0, {tp})")
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    kv_parts, kv_index = (tp, rank) if hkv % tp == 0 else (hkv, rank // (tp // hkv))  # split, or replicate
    r = lambda n: ([n], [tp], [rank])  # noqa: E731 - one segment cut into tp pieces
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        leaf = name.rsplit(".", 1)[-1]
        if not isinstance(t, torch.Tensor) or type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise ConfigError(f"tensor parallelism cannot shard {name} ({type(t).__name__}): only plain "
                              f"weights are supported")
        if name in ("embed_tokens", "norm") or leaf in ("input_layernorm", "post_attention_layernorm", "norm_weight",
                                                         "q_norm", "k_norm", "router", "shared_gate"):
            out[name] = t.contiguous()  # replicated
        elif leaf == "in_proj":
            out[name] = _pieces(t, [hk * dk, hk * dk, hv * dv, hv * dv, hv, hv], [tp] * 6, [rank] * 6, 0)
        elif leaf == "conv_weight":
            out[name] = _pieces(t, [hk * dk, hk * dk, hv * dv], [tp] * 3, [rank] * 3, 0)
        elif leaf in ("A_log", "dt_bias"):
            out[name] = _pieces(t, *r(hv), 0)
        elif leaf == "out_proj":
            out[name] = _pieces(t, *r(hv * dv), 1)
        elif leaf == "qkv_proj":
            out[name] = _pieces(t, [2 * hq * d, hkv * d, hkv * d], [tp, kv_parts, kv_parts],
                                [rank, kv_index, kv_index], 0)
        elif leaf == "o_proj":
            out[name] = _pieces(t, *r(hq * d), 1)
        elif leaf in ("gate_up", "shared_gate_up", "experts_gate_up"):
            dim = t.dim() - 2  # [2I, H] or [E, 2I, H]
            half = t.shape[dim] // 2
            out[name] = _pieces(t, [half, half], [tp, tp], [rank, rank], dim)
        elif leaf in ("down", "shared_down", "experts_down"):
            out[name] = _pieces(t, *r(t.shape[-1]), t.dim() - 1)  # [H, I] or [E, H, I]
        elif name == "lm_head":
            out[name] = _head_rows(t, tp, rank)
        else:
            raise ConfigError(f"no tensor-parallel sharding rule for {name}")
    if "lm_head" not in sd:  # tied: the head is the embedding's rows
        out["lm_head"] = _head_rows(sd["embed_tokens"], tp, rank)
    return out


def _head_rows(w: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Rows [rank * n, (rank + 1) * n) of the [V, H] head, n = vocab_rows(V, tp), zero-padded past V."""
    V, n = w.shape[0], vocab_rows(w.shape[0], tp)
    part = w[min(V, rank * n): min(V, (rank + 1) * n)]
    if part.shape[0] < n:
        part = torch.cat([part, part.new_zeros(n - part.shape[0], *w.shape[1:])])
    return part.contiguous()
