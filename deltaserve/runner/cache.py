"""The cache tensors: the page pool, the live GDN slots, and (checkpoints beside the pool) their tensor.

Storage is raw bytes so one page can hold either attention K/V or GDN states; every copy between a
slot and a checkpoint is a byte copy (bit-exact, NaN encodings included).

  pool[i]:  [num_pages, page_bytes] uint8, layer position i (i < group_size)
            attention layer a reads pool[a] as [num_pages, 2, block_size, kv_heads, head_dim] (kv dtype);
            checkpoints in pool pages (layouts.py): GDN layer l of group g = l // group_size keeps its state
            as one byte stream, [0, conv_bytes) conv then [conv_bytes, state_bytes) recurrent, cut into
            page_bytes pieces, piece j at pool[l % group_size][location[g * pages_per_state + j]] (in-page: one
            piece, pages_per_state = 1).
  conv[l]:  [num_slots, kernel - 1, conv_dim] conv dtype   (live state of GDN layer l)
  ssm[l]:   [num_slots, v_heads, v_dim, k_dim] float32      (live state of GDN layer l)
  checkpoints beside the pool (per-block layout): ckpt_conv[l] / ckpt_ssm[l] shaped like conv/ssm with num_pages
            rows, row p holding the checkpoint of the block in attention page p.
"""
from __future__ import annotations

import torch

from ..config import ModelConfig
from ..model.batch import Caches
from ..scheduler.plan import StateCopy
from ..memory.sizing import Pool


class CacheStore:
    def __init__(self, m: ModelConfig, pool: Pool, kv_dtype: torch.dtype, conv_dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.block_size = pool.block_size
        n_gdn, n_attn = len(m.gdn_layers), len(m.attn_layers)
        self.group_size = pool.group_size
        self.pool = [torch.zeros(pool.num_pages, pool.page_bytes, dtype=torch.uint8, device=device)
                     for _ in range(pool.group_size if n_attn else 0)]
        kv_shape = (pool.num_pages, 2, pool.block_size, m.num_key_value_heads, m.head_dim)
        self.kv = [self.pool[a].view(kv_dtype).view(kv_shape) for a in range(n_attn)]
        conv_shape = (m.linear_conv_kernel_dim - 1, m.conv_dim)
        ssm_shape = (m.linear_num_value_heads, m.linear_value_head_dim, m.linear_key_head_dim)
        self.conv = [torch.zeros(pool.num_slots, *conv_shape, dtype=conv_dtype, device=device) for _ in range(n_gdn)]
        self.ssm = [torch.zeros(pool.num_slots, *ssm_shape, dtype=torch.float32, device=device) for _ in range(n_gdn)]
        self.beside = not pool.layout.in_pool  # checkpoints in a tensor beside the pool, a row per page
        self.pages_per_state = pool.pages_per_state
        self.page_bytes = pool.page_bytes
        rows = pool.num_pages if self.beside and n_gdn else 0
        self.ckpt_conv = [torch.zeros(rows, *conv_shape, dtype=conv_dtype, device=device) for _ in range(n_gdn)] if rows else []
        self.ckpt_ssm = [torch.zeros(rows, *ssm_shape, dtype=torch.float32, device=device) for _ in range(n_gdn)] if rows else []
        self.conv_bytes = self.conv[0][0].numel() * self.conv[0].element_size() if n_gdn else 0
        self.ssm_bytes = self.ssm[0][0].numel() * 4 if n_gdn else 0
        assert not n_gdn or not self.pool or self.conv_bytes + self.ssm_bytes <= pool.page_bytes * self.pages_per_state, \
            "a GDN layer state must fit its pages (hybrid block size rule, or pages_per_state in the runs layout)"

    def caches(self) -> Caches:
        return Caches(kv=self.kv, conv=self.conv, ssm=self.ssm, block_size=self.block_size, save_state=self.save_layer,
                      log_state=self.log_states, log_conv=self.log_conv, log_x=self.log_x, log_g=self.log_g,
                      log_beta=self.log_beta)

    # ---- the per-position state log of speculative verify steps (docs/speculative.md) ----
    # The conv state is logged whole (K-1 rows); the recurrent state is not: a verify step leaves a slot's recurrent
    # state after its span's first token and logs the recurrence's inputs of the later tokens, which rollback
    # replays for the accepted ones. A state is Hv x dv x dk fp32 (a MB a layer on the 0.8B shape), a token's inputs
    # conv_dim + 2 Hv values: logging states cost a verify step whose drafts are all rejected several MB of writes
    # a layer that a plain decode step does not pay.
    log_conv: list[torch.Tensor] = []  # [l] [num_slots, positions, K-1, conv_dim]: slot s's conv state after token j
    log_x: list[torch.Tensor] = []  # [l] [num_slots, positions, conv_dim]: token j + 1's conv output (q | k | v)
    log_g: list[torch.Tensor] = []  # [l] [num_slots, positions, Hv] float32: token j + 1's gate
    log_beta: list[torch.Tensor] = []  # [l] [num_slots, positions, Hv]: token j + 1's beta

    def enable_state_log(self, positions: int) -> None:
        """Room to log, per slot, every GDN layer's conv state after each of `positions` tokens of a verify span and
        the recurrence's inputs of its tokens 1 .. positions."""
        self.log_conv = [torch.zeros(t.shape[0], positions, *t.shape[1:], dtype=t.dtype, device=t.device)
                         for t in self.conv]
        self.log_x = [torch.zeros(c.shape[0], positions, c.shape[2], dtype=c.dtype, device=c.device)
                      for c in self.conv]
        self.log_g = [torch.zeros(s.shape[0], positions, s.shape[1], dtype=torch.float32, device=s.device)
                      for s in self.ssm]
        self.log_beta = [torch.zeros(s.shape[0], positions, s.shape[1], dtype=c.dtype, device=s.device)
                         for c, s in zip(self.conv, self.ssm)]

    def log_states(self, l: int, j: int, slots: torch.Tensor, x: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor) -> None:
        """Just after the j-th token of their verify spans: GDN layer l's live conv state in `slots` -> log_conv[slots,
        j], and that token's recurrence inputs x [B, conv_dim], g, beta [B, Hv] -> log_x / log_g / log_beta[slots,
        j - 1] (token 0's state stays in the slot: GDNMixer.forward)."""
        positions = self.log_conv[l].shape[1]
        if j < positions:  # the last token's conv state stays in the slot: it needs no entry
            self.log_conv[l][:, j].index_copy_(0, slots, self.conv[l].index_select(0, slots))
        if 1 <= j <= positions:
            self.log_x[l][:, j - 1].index_copy_(0, slots, x.to(self.log_x[l].dtype))
            self.log_g[l][:, j - 1].index_copy_(0, slots, g.float())
            self.log_beta[l][:, j - 1].index_copy_(0, slots, beta.to(self.log_beta[l].dtype))

    def rollback(self, slot: int, j: int, replay) -> None:
        """After a verify step whose tokens 0 .. j were kept: the slot's state <- the one after its token j. The conv
        state from the log (bit copies; j = positions: the slot's own), the recurrent state, left after token 0 by the
        step, stepped through tokens 1 .. j from their logged inputs by replay(l, ssm[l], slot, x, g, beta) (the
        model's GDN layer l: HybridModel.replay_gdn), the very arithmetic the step ran on them."""
        positions = self.log_conv[0].shape[1] if self.log_conv else 0
        for l in range(len(self.conv)):
            if j < positions:
                self.conv[l][slot].copy_(self.log_conv[l][slot, j])
            if j >= 1:
                replay(l, self.ssm[l], slot, self.log_x[l][slot, :j], self.log_g[l][slot, :j],
                       self.log_beta[l][slot, :j])

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

    def _page_views(self, l: int, location: tuple[int, ...]) -> list[torch.Tensor]:
        """Byte views of GDN layer l's checkpoint at `location`, in state order (conv bytes, then recurrent)."""
        if self.beside:
            (page,) = location
            return [self.ckpt_conv[l][page].view(torch.uint8).view(-1), self.ckpt_ssm[l][page].view(torch.uint8).view(-1)]
        k, pos = self.pages_per_state, self.pool[l % self.group_size]
        first, left, views = l // self.group_size * k, self.conv_bytes + self.ssm_bytes, []
        for j in range(k):
            n = min(self.page_bytes, left)
            views.append(pos[location[first + j]][:n])
            left -= n
        assert left == 0, "checkpoint pages too small for the state"
        return views

    def _slot_views(self, l: int, slot: int) -> list[torch.Tensor]:
        return [self.conv[l][slot].view(torch.uint8).view(-1), self.ssm[l][slot].view(torch.uint8).view(-1)]

    def save(self, c: StateCopy) -> None:
        """Slot -> checkpoint, every GDN layer."""
        for l in range(len(self.conv)):
            _copy_bytes(self._page_views(l, c.location), self._slot_views(l, c.slot))

    def save_layer(self, l: int, location: tuple[int, ...], conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """GDN layer l's state taken inside a prefill chunk -> its checkpoint (conv [K-1, conv_dim] in the conv
        dtype, ssm [Hv, dv, dk] float32, both contiguous): the same bytes a slot save of that state writes."""
        assert conv.dtype == self.conv[l].dtype and ssm.dtype == torch.float32 and conv.is_contiguous() \
            and ssm.is_contiguous(), "a checkpoint is the slot's own dtypes and layout"
        _copy_bytes(self._page_views(l, location), [conv.view(torch.uint8).view(-1), ssm.view(torch.uint8).view(-1)])

    def restore(self, c: StateCopy) -> None:
        """Checkpoint -> slot, every GDN layer."""
        for l in range(len(self.conv)):
            _copy_bytes(self._slot_views(l, c.slot), self._page_views(l, c.location))

    def record_views(self, kind: str, location: tuple[int, ...]) -> list[torch.Tensor]:
        """The uint8 views a disk-tier record is made of, in record order (memory/disk_tier.py): "kv" every layer
        position of page location[0]; "ckpt" every GDN layer's state bytes (conv, then recurrent) at a checkpoint
        location. A record is these bytes as they are: what is written is what a load copies back."""
        if kind == "kv":
            (page,) = location
            return [t[page] for t in self.pool]
        return [v for l in range(len(self.conv)) for v in self._page_views(l, location)]

    def read_record(self, kind: str, location: tuple[int, ...]) -> bytes:
        views = self.record_views(kind, location)
        return torch.cat(views).cpu().numpy().tobytes() if views else b""

    def write_record(self, kind: str, location: tuple[int, ...], data) -> None:
        """data: a writable buffer of exactly the record's bytes."""
        views = self.record_views(kind, location)
        if views:
            _copy_bytes(views, [torch.frombuffer(data, dtype=torch.uint8).to(views[0].device)])

    def record_bytes(self, kind: str) -> int:
        """The payload size of a record of `kind` (the same for every record of a store)."""
        if kind == "kv":
            return len(self.pool) * self.page_bytes
        return len(self.conv) * (self.conv_bytes + self.ssm_bytes)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.pool + self.conv + self.ssm + self.ckpt_conv + self.ckpt_ssm
                   + self.log_conv + self.log_x + self.log_g + self.log_beta)


def _copy_bytes(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """Copy the concatenation of the 1-D uint8 views `src` into the concatenation of `dst` (equal totals):
    a state's conv and recurrent parts into / out of the pages it spans, piece by piece."""
    assert sum(t.numel() for t in dst) == sum(t.numel() for t in src), "state byte counts differ"
    i = j = a = b = 0  # dst view i at offset a, src view j at offset b
    while i < len(dst) and j < len(src):
        n = min(dst[i].numel() - a, src[j].numel() - b)
        dst[i][a: a + n].copy_(src[j][b: b + n])
        a, b = a + n, b + n
        if a == dst[i].numel():
            i, a = i + 1, 0
        if b == src[j].numel():
            j, b = j + 1, 0
