"""ShardedModel: one tensor-parallel rank's HybridModel.

It is a HybridModel of the rank's geometry (sharding.rank_config: heads and intermediate widths divided by tp),
so the layers, the ops and the caches run unchanged on the rank's heads; what tensor parallelism adds is three
collectives:

- after every token mixer (GDN out_proj, attention o_proj) and every MLP / MoE block (down projections), whose
  outputs are partial sums over the rank's heads or intermediate columns: an all-reduce (RowParallel);
- after the head, whose logits are the rank's vocabulary rows: an all-gather (compute_logits).

Every rank runs the same forward on the same batch; after each all-reduce the residual stream is bit-identical
on every rank (the reduction's result is broadcast, not recomputed), so the replicated norms, router and
embedding agree bit for bit and every rank takes the same MoE routing.
"""
from __future__ import annotations

import torch
from torch import nn

from ..config import ConfigError, ModelConfig
from ..model.layers import empty_param
from ..model.qwen3_5 import HybridModel
from .sharding import rank_config, shard_state_dict, vocab_rows


class RowParallel(nn.Module):
    """A module whose output is one rank's partial sum, all-reduced to the whole. Wraps a token mixer or an MLP
    after its weights are loaded (the wrapped module keeps its parameters, under `inner.`)."""

    def __init__(self, inner: nn.Module, group):  # group: parallel.group.Group
        super().__init__()
        self.inner = inner
        self.group = group

    def forward(self, *args, **kwargs) -> torch.Tensor:
        out = self.inner(*args, **kwargs)  # [T, H] partial sum
        return self.group.all_reduce(out.contiguous())


class ShardedModel(HybridModel):
    """Rank `rank` of `tp`. full: the whole model's geometry; self.config is the rank's (the caches' shapes).
    The embedding is whole; lm_head holds vocab_rows(V, tp) rows (zero padded on the last rank)."""

    def __init__(self, full: ModelConfig, dtype, tp: int, rank: int):
        super().__init__(rank_config(full, tp), dtype)
        self.full_config = full
        self.tp, self.rank = tp, rank
        self.group = None  # the process group of the collectives, set by connect()
        self.lm_head = empty_param(vocab_rows(full.vocab_size, tp), full.hidden_size, dtype=self.dtype)

    def connect(self, group) -> "ShardedModel":
        """Wrap every mixer and MLP in RowParallel over `group` (after load_state_dict: the names change)."""
        self.group = group
        for layer in self.layers:
            if layer.is_gdn:
                layer.linear_attn = RowParallel(layer.linear_attn, group)
            else:
                layer.self_attn = RowParallel(layer.self_attn, group)
            layer.mlp = RowParallel(layer.mlp, group)
        return self

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] (the same on every rank) -> logits [N, vocab] float32, gathered on every rank."""
        local = super().compute_logits(hidden).contiguous()  # [N, vocab_rows]
        return torch.cat(self.group.all_gather(local), dim=1)[:, :self.full_config.vocab_size]


def build_sharded(full_sd: dict[str, torch.Tensor], full: ModelConfig, dtype, tp: int, rank: int,
                  device) -> ShardedModel:
    """Rank `rank`'s model from the full model's state dict: slice (sharding.shard_state_dict), check every
    shape against the rank's model, load, move to device. Not yet connected (see ShardedModel.connect)."""

    with torch.device("meta"):
        model = ShardedModel(full, dtype, tp, rank)
    sd = shard_state_dict(full_sd, full, tp, rank)
    want = model.state_dict()
    missing = sorted(set(want) - set(sd))
    if missing:  # the loader kept them in another form (block-FP8 weights are not parameters)
        raise ConfigError(f"tensor parallelism is not supported for these weights yet: {', '.join(missing[:4])}"
                          f"{' ...' if len(missing) > 4 else ''} are not plain tensors of the model (quantized?)")
    for name, t in sd.items():
        if name not in want or tuple(want[name].shape) != tuple(t.shape) or want[name].dtype != t.dtype:
            raise ConfigError(f"rank {rank}: shard of {name} is {tuple(t.shape)} {t.dtype}, the rank's model "
                              f"wants {None if name not in want else (tuple(want[name].shape), want[name].dtype)}")
    model.load_state_dict(sd, strict=True, assign=True)
    model.eval()
    return model.to(device)


def describe(full: ModelConfig, tp: int) -> str:
    """One log line: what each rank holds."""
    r = rank_config(full, tp)
    return (f"tensor parallel {tp}: each rank holds {r.linear_num_key_heads}/{full.linear_num_key_heads} GDN key "
            f"heads, {r.linear_num_value_heads}/{full.linear_num_value_heads} value heads, "
            f"{r.num_attention_heads}/{full.num_attention_heads} query heads, {r.num_key_value_heads}/"
            f"{full.num_key_value_heads} KV heads{' (replicated)' if full.num_key_value_heads < tp else ''}, "
            f"{vocab_rows(full.vocab_size, tp)}/{full.vocab_size} head rows")

