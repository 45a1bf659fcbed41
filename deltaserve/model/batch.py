"""The model's view of one step: a flat batch of tokens cut into per-sequence spans, and the caches.

Built by the model runner from a StepPlan; consumed by the model's forward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class Span:
    """One sequence's tokens inside the flat batch: rows start .. start + length - 1."""

    start: int
    length: int
    pos: int  # absolute position of the first token (= tokens of this sequence already in the caches)
    slot: int  # GDN state slot
    page_ids: torch.Tensor  # [num_pages] int64, the attention page table covering pos + length tokens
    is_decode: bool
    # checkpoints taken inside this prefill span: (absolute position p, location), the state of every GDN layer
    # after exactly token p - 1 (pos < p < pos + length, p on the 64-token grid) goes to Caches.save_state
    saves: tuple[tuple[int, tuple[int, ...]], ...] = ()


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    spans: list[Span]  # in flat order; prefill spans first, then decode spans

    @property
    def decode_spans(self) -> list[Span]:
        return [s for s in self.spans if s.is_decode]

    @property
    def prefill_spans(self) -> list[Span]:
        return [s for s in self.spans if not s.is_decode]


@dataclass
class Caches:
    """Tensors the layers read and write. The runner owns the storage; these are views.

    kv[a]:   attention layer a (a-th full-attention layer), [num_pages, 2, block_size, kv_heads, head_dim]
             in the KV dtype; [:, 0] keys, [:, 1] values.
    conv[l]: GDN layer l (l-th linear-attention layer), [num_slots, kernel - 1, conv_dim] in the conv dtype;
             the last kernel-1 conv inputs, oldest first.
    ssm[l]:  GDN layer l, [num_slots, num_v_heads, v_head_dim, k_head_dim] float32 recurrent state
             (the transpose of transformers' [.., dk, dv] layout: reductions over dk are contiguous).
    """

    kv: list[torch.Tensor]
    conv: list[torch.Tensor]
    ssm: list[torch.Tensor]
    block_size: int
    # save_state(l, location, conv [K-1, conv_dim], ssm [Hv, dv, dk] fp32): store GDN layer l's state at a
    # checkpoint location (the runner's CacheStore.save_layer); needed by spans with saves
    save_state: Callable[[int, tuple[int, ...], torch.Tensor, torch.Tensor], None] | None = None
