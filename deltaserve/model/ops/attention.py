"""Gated full attention's pieces: partial rotary, the paged KV pool, prefill and decode attention.

Paged KV pool of one attention layer: kv [num_pages, 2, block_size, kv_heads, head_dim]; [:, 0] keys,
[:, 1] values. Position p of a sequence lives in page page_ids[p // block_size], row p % block_size.

Bit-exactness:
- prefill_attention computes queries in tiles of TILE rows anchored at absolute positions: tile
  [t, t + TILE) ∩ span attends keys [0, min(t + TILE, span end)) under a causal mask, so a row's result
  depends only on its absolute tile, never on where the prefill chunk started (when chunk starts are
  multiples of TILE).
- decode_attention handles one sequence with a plain GQA matmul-softmax-matmul: a request's result does
  not depend on which other sequences share the step.
- The compiled kernels' prefill attention (csrc/prefill_attention.cpp, every x86 build; the op table takes it
  through DecodeKernels.prefill_attention) has this function's contract, and a row's bits depend on no chunk
  start at all; this function is its torch path and the generic build's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

TILE = 64


# ---- rotary ---------------------------------------------------------------------------------------------

def rotary_inv_freq(rotary_dim: int, theta: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """[rotary_dim // 2] float32, transformers' default rope."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float, device=device) / rotary_dim))


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] -> cos, sin [T, rotary_dim] in dtype (computed in fp32 then cast, as transformers)."""
    freqs = positions[:, None].float() * inv_freq.to(device=positions.device, dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class RotaryTable:
    """cos, sin [T, rotary_dim] for any positions, looked up in a table the model keeps. The table is made by
    rotary_cos_sin in blocks of BLOCK positions, each block on its own, so a position's values depend on nothing
    else: not on the other positions of a step, nor on how far the table had grown when it was made (every step,
    prefill and decode, reads the same values for the same position)."""

    BLOCK = 1024

    def __init__(self, inv_freq: torch.Tensor, dtype: torch.dtype):
        self.inv_freq, self.dtype = inv_freq, dtype
        self.cos = self.sin = None  # [n * BLOCK, rotary_dim]

    def __call__(self, positions: torch.Tensor, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64, every one below end -> cos, sin [T, rotary_dim] in the table's dtype."""
        dev = positions.device
        if self.cos is None or self.cos.device != dev:
            self.cos = self.sin = None
            self.inv_freq = self.inv_freq.to(dev)
        have = 0 if self.cos is None else self.cos.shape[0]
        if have < end:
            blocks = [rotary_cos_sin(torch.arange(a, a + self.BLOCK, device=dev), self.inv_freq, self.dtype)
                      for a in range(have, end, self.BLOCK)]
            cos = [c for c, _ in blocks] if self.cos is None else [self.cos] + [c for c, _ in blocks]
            sin = [s for _, s in blocks] if self.sin is None else [self.sin] + [s for _, s in blocks]
            self.cos, self.sin = torch.cat(cos), torch.cat(sin)
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos, sin [T, R] with R <= D: rotates the first R dims of every head (partial rotary)."""
    r = cos.shape[-1]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rot, rest = x[..., :r], x[..., r:]
    return torch.cat([rot * cos + _rotate_half(rot) * sin, rest], dim=-1)


# ---- the paged pool -------------------------------------------------------------------------------------

def page_slots(page_ids: torch.Tensor, positions: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(page index, row) of each position through one sequence's page table."""
    return page_ids[positions // block_size], positions % block_size


def kv_write(kv: torch.Tensor, pages: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """kv [P, 2, bs, Hkv, D]; pages, rows [T]; k, v [T, Hkv, D]: kv[pages[i], 0, rows[i]] = k[i] (and v)."""
    kv[pages, 0, rows] = k.to(kv.dtype)
    kv[pages, 1, rows] = v.to(kv.dtype)


def kv_gather(kv: torch.Tensor, page_ids: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `length` positions of one sequence as contiguous K, V [length, Hkv, D]."""
    bs = kv.shape[2]
    n = -(-length // bs)
    pages = kv.index_select(0, page_ids[:n])  # [n, 2, bs, Hkv, D]
    k = pages[:, 0].reshape(n * bs, *kv.shape[3:])[:length]
    v = pages[:, 1].reshape(n * bs, *kv.shape[3:])[:length]
    return k, v


# ---- attention ------------------------------------------------------------------------------------------

_MASKS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _tile_masks(dtype: torch.dtype, device: torch.device, width: int, tile: int = TILE) -> torch.Tensor:
    """[tile, W] additive mask (0 where allowed, -inf elsewhere) in `dtype`, W >= width a multiple of tile:
    entry (i, c) allowed iff c <= W - tile + i. The mask of the query rows of tile t (positions t + i) over keys
    0 .. e - 1 is the view [rows, W - tile - t : W - tile - t + e]. SDPA turns a boolean mask into exactly
    this float mask, so building it once per dtype changes no bits. Grown on demand, kept per (dtype, device)."""
    key = (dtype, torch.device(device))
    m = _MASKS.get(key)
    if m is None or m.shape[1] < width or m.shape[0] != tile:
        w = max(width, 4096 if m is None else 2 * m.shape[1])
        w = -(-w // tile) * tile
        allowed = torch.arange(w, device=device)[None, :] <= torch.arange(w - tile, w, device=device)[:, None]
        m = torch.zeros(tile, w, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
        if tile == TILE:
            _MASKS[key] = m
    return m


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int, scale: float,
                      tile: int = TILE) -> torch.Tensor:
    """One sequence's prefill chunk. q [n, Hq, D] at absolute positions pos .. pos + n - 1; k, v [>= pos + n,
    Hkv, D] the sequence's keys/values from position 0 (any strides with a contiguous last dim: views of
    the step's projections work). Returns [n, Hq, D] in q's dtype.

    Query tiles anchored at absolute multiples of `tile`; SDPA per tile with an explicit causal mask (a view of
    one cached mask), keys read in place through head-major views (no copy of K/V).
    """
    n = q.shape[0]
    end = pos + n
    kh, vh = k[:end].transpose(0, 1)[None], v[:end].transpose(0, 1)[None]  # [1, Hkv, end, D] views
    gqa = q.shape[1] != kh.shape[1]
    out = torch.empty_like(q)
    t = pos - pos % tile
    masks = _tile_masks(q.dtype, q.device, t + n + tile, tile)
    w = masks.shape[1]
    while t < end:
        qs, qe = max(t, pos), min(t + tile, end)
        qt = q[qs - pos: qe - pos].transpose(0, 1).unsqueeze(0)  # [1, Hq, tq, D]
        c = w - tile - t
        mask = masks[qs - t:qe - t, c:c + qe]  # [tq, qe]: key j allowed for position p iff j <= p
        o = F.scaled_dot_product_attention(qt, kh[:, :, :qe], vh[:, :, :qe], attn_mask=mask, scale=scale,
                                           enable_gqa=gqa)
        out[qs - pos: qe - pos] = o[0].transpose(0, 1)
        t += tile
    return out


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence, one query token. q [Hq, D]; k, v [L, Hkv, D] (all of its keys). Returns [Hq, D].

    transformers' eager order: scores in the model dtype, softmax in fp32, probabilities cast back.
    """
    hq, d = q.shape
    hkv = k.shape[1]
    qh = q.view(hkv, hq // hkv, d)  # [Hkv, G, D]: query head h uses kv head h // G
    scores = torch.matmul(qh, k.permute(1, 2, 0)) * scale  # [Hkv, G, L]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v.transpose(0, 1)).reshape(hq, d)


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int, scale: float) -> torch.Tensor:
    """Plain causal attention for rows at positions pos .. pos + n - 1 over keys 0 .. pos + n - 1, in fp32."""
    n, hq, _d = q.shape
    end = pos + n
    rep = hq // k.shape[1]
    kf = k[:end].float().repeat_interleave(rep, dim=1).transpose(0, 1)  # [Hq, end, D]
    vf = v[:end].float().repeat_interleave(rep, dim=1).transpose(0, 1)
    s = (q.float().transpose(0, 1) @ kf.transpose(-1, -2)) * scale  # [Hq, n, end]
    qpos = torch.arange(pos, end, device=q.device)[:, None]
    s = s.masked_fill(torch.arange(end, device=q.device)[None, :] > qpos, float("-inf"))
    return (torch.softmax(s, -1) @ vf).transpose(0, 1).to(q.dtype)
