"""The cache tensors: the page pool, the live GDN slots, and (per-block layout) the checkpoint tensor.

Storage is raw bytes so one page can hold either attention K/V or GDN states; every copy between a
slot and a checkpoint is a byte copy (bit-exact, NaN encodings included).

  pool[i]:  [num_pages, page_bytes] uint8, layer position i (i < group_size)
            attention layer a reads pool[a] as [num_pages, 2, block_size, kv_heads, head_dim] (kv dtype);
            in-page checkpoints: GDN layer l of group g = l // group_size keeps its state at
            pool[l % group_size][page], bytes [0, conv_bytes) conv then [conv_bytes, state_bytes) recurrent.
  conv[l]:  [num_slots, kernel - 1, conv_dim] conv dtype   (live state of GDN layer l)
  ssm[l]:   [num_slots, v_heads, v_dim, k_dim] float32      (live state of GDN layer l)
  per-block layout: ckpt_conv[l] / ckpt_ssm[l] shaped like conv/ssm with num_pages rows.
"""
from __future__ import annotations

import torch

from ..config import ModelConfig
from ..model.batch import Caches
from ..scheduler.plan import StateCopy
from ..sizing import PoolPlan


class CacheStore:
    def __init__(self, m: ModelConfig, plan: PoolPlan, kv_dtype: torch.dtype, conv_dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.plan = plan
        self.block_size = plan.block_size
        n_gdn, n_attn = len(m.gdn_layers), len(m.attn_layers)
        self.group_size = plan.group_size
        self.pool = [torch.zeros(plan.num_pages, plan.page_bytes, dtype=torch.uint8, device=device)
                     for _ in range(plan.group_size if n_attn else 0)]
        kv_shape = (plan.num_pages, 2, plan.block_size, m.num_key_value_heads, m.head_dim)
        self.kv = [self.pool[a].view(kv_dtype).view(kv_shape) for a in range(n_attn)]
        conv_shape = (m.linear_conv_kernel_dim - 1, m.conv_dim)
        ssm_shape = (m.linear_num_value_heads, m.linear_value_head_dim, m.linear_key_head_dim)
        self.conv = [torch.zeros(plan.num_slots, *conv_shape, dtype=conv_dtype, device=device) for _ in range(n_gdn)]
        self.ssm = [torch.zeros(plan.num_slots, *ssm_shape, dtype=torch.float32, device=device) for _ in range(n_gdn)]
        self.per_block = plan.layout == "per-block"
        rows = plan.num_pages if self.per_block else 0
        self.ckpt_conv = [torch.zeros(rows, *conv_shape, dtype=conv_dtype, device=device) for _ in range(n_gdn)] if rows else []
        self.ckpt_ssm = [torch.zeros(rows, *ssm_shape, dtype=torch.float32, device=device) for _ in range(n_gdn)] if rows else []
        self.conv_bytes = self.conv[0][0].numel() * self.conv[0].element_size() if n_gdn else 0
        self.ssm_bytes = self.ssm[0][0].numel() * 4 if n_gdn else 0
        assert not n_gdn or not self.pool or self.conv_bytes + self.ssm_bytes <= plan.page_bytes, \
            "a page must hold one GDN layer state (hybrid block size rule)"

    def caches(self) -> Caches:
        return Caches(kv=self.kv, conv=self.conv, ssm=self.ssm, block_size=self.block_size)

    # ---- plan execution: zeroing and bit-exact state copies ----
    def zero_pages(self, pages: tuple[int, ...]) -> None:
        """Zero every layer position of these pages (and their per-block checkpoints). Slices of consecutive
        page ids are zeroed in place: cost ~ the pages' bytes (index_fill_ here scans the whole pool per call)."""
        if not pages:
            return
        runs, ids = [], sorted(set(pages))
        a = prev = ids[0]
        for p in ids[1:]:
            if p != prev + 1:
                runs.append((a, prev + 1))
                a = p
            prev = p
        runs.append((a, prev + 1))
        for t in self.pool + self.ckpt_conv + self.ckpt_ssm:
            for a, b in runs:
                t[a:b].zero_()

    def zero_slots(self, slots: tuple[int, ...]) -> None:
        for s in slots:
            for t in self.conv + self.ssm:
                t[s].zero_()

    def _page_views(self, l: int, location: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Byte views of GDN layer l's checkpoint at `location` (conv bytes, recurrent bytes)."""
        if self.per_block:
            (page,) = location
            return self.ckpt_conv[l][page].view(torch.uint8).view(-1), self.ckpt_ssm[l][page].view(torch.uint8).view(-1)
        row = self.pool[l % self.group_size][location[l // self.group_size]]
        return row[: self.conv_bytes], row[self.conv_bytes: self.conv_bytes + self.ssm_bytes]

    def save(self, c: StateCopy) -> None:
        """Slot -> checkpoint, every GDN layer."""
        for l in range(len(self.conv)):
            dst_conv, dst_ssm = self._page_views(l, c.location)
            dst_conv.copy_(self.conv[l][c.slot].view(torch.uint8).view(-1))
            dst_ssm.copy_(self.ssm[l][c.slot].view(torch.uint8).view(-1))

    def restore(self, c: StateCopy) -> None:
        """Checkpoint -> slot, every GDN layer."""
        for l in range(len(self.conv)):
            src_conv, src_ssm = self._page_views(l, c.location)
            self.conv[l][c.slot].view(torch.uint8).view(-1).copy_(src_conv)
            self.ssm[l][c.slot].view(torch.uint8).view(-1).copy_(src_ssm)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.pool + self.conv + self.ssm + self.ckpt_conv + self.ckpt_ssm)
