"""The Qwen3.5 vision encoder (transformers' Qwen3_5VisionModel): pixels -> one embedding per merged token.

    VisionModel(vc, dtype)(pixel_values [N, C*Tp*P*P], grids [(t, h, w), ...]) -> [N / merge_unit, out_hidden]

Input rows are the image processor's patches, already in merge-block order (each run of merge_unit rows is
one 2x2 block of neighbouring patches, which the merger folds into one LLM token). Per image: patch embed
(a Conv3d whose kernel equals its stride: one linear over the flattened patch), plus the learned position
table resampled bilinearly (align_corners) to the image's grid, then `depth` pre-LayerNorm blocks of
bidirectional attention with 2D rotary (rows rotate the first quarter-pairs, columns the next), attending
only inside their own image, then the merger (LayerNorm, fold merge_unit rows, fc1, exact GELU, fc2).
Qwen3.5 has no deepstack outputs (VisionConfig refuses configs that ask for them).

Parameter names are the checkpoint's under model.visual. (loader.py strips the prefix). The references the
tests hold this against: transformers' Qwen3_5VisionModel, and pos_embed_reference (F.interpolate) for the
position resampling.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import VisionConfig
from .layers import empty_param


def _linear(name_out: int, name_in: int, dtype: torch.dtype) -> nn.ParameterDict:
    return nn.ParameterDict({"weight": empty_param(name_out, name_in, dtype=dtype), "bias": empty_param(name_out, dtype=dtype)})


def _norm(dim: int, dtype: torch.dtype) -> nn.ParameterDict:
    return nn.ParameterDict({"weight": empty_param(dim, dtype=dtype), "bias": empty_param(dim, dtype=dtype)})


def _act(name: str):
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    if name in ("gelu", "gelu_python"):
        return F.gelu
    if name == "silu":
        return F.silu
    raise ValueError(f"vision hidden_act {name!r} is not supported")


def merge_order(h: int, w: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) [h*w] of the patches in merge-block order: block (by, bx) row-major, inside it (iy, ix)."""
    r = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
    c = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
    return r.permute(0, 2, 1, 3).reshape(-1), c.permute(0, 2, 1, 3).reshape(-1)


def _axis_taps(n: int, side: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bilinear taps of n target points on a `side`-long table, align_corners: (floor, ceil, frac) [n]."""
    src = torch.arange(n, dtype=torch.float32) * ((side - 1) / max(n - 1, 1))
    lo = src.floor().long().clamp(0, side - 1)
    return lo, (lo + 1).clamp(max=side - 1), src - lo.float()


def pos_embed(table: torch.Tensor, h: int, w: int, m: int) -> torch.Tensor:
    """The learned [side*side, E] position table resampled to an h x w grid (bilinear, align_corners) and
    laid out in merge-block order: [h*w, E] float32."""
    side = int(round(table.shape[0] ** 0.5))
    assert side * side == table.shape[0], "the position table is a square grid"
    y0, y1, fy = _axis_taps(h, side)
    x0, x1, fx = _axis_taps(w, side)
    rows, cols = merge_order(h, w, m)
    y0, y1, fy, x0, x1, fx = y0[rows], y1[rows], fy[rows, None], x0[cols], x1[cols], fx[cols, None]
    t = table.float()
    return ((1 - fy) * (1 - fx) * t[y0 * side + x0] + (1 - fy) * fx * t[y0 * side + x1]
            + fy * (1 - fx) * t[y1 * side + x0] + fy * fx * t[y1 * side + x1])


def pos_embed_reference(table: torch.Tensor, h: int, w: int, m: int) -> torch.Tensor:
    """pos_embed through F.interpolate (the plain-torch reference)."""
    side = int(round(table.shape[0] ** 0.5))
    grid = table.float().T.reshape(1, -1, side, side)
    out = F.interpolate(grid, size=(h, w), mode="bilinear", align_corners=True)[0]  # [E, h, w]
    rows, cols = merge_order(h, w, m)
    return out[:, rows, cols].T


def vision_rotary(h: int, w: int, m: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [h*w, head_dim] float32 of the 2D rotary in merge-block order: frequencies over head_dim / 2,
    the row angle on the first half of them, the column angle on the second, the whole repeated twice."""
    half = head_dim // 2
    inv = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half))  # [head_dim / 4]
    rows, cols = merge_order(h, w, m)
    f = torch.cat([rows[:, None].float() * inv, cols[:, None].float() * inv], dim=-1)  # [N, head_dim / 2]
    f = torch.cat([f, f], dim=-1)
    return f.cos(), f.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D] rotated in float32 (as transformers), cast back."""
    xf = x.float()
    x1, x2 = xf[..., : xf.shape[-1] // 2], xf[..., xf.shape[-1] // 2:]
    out = xf * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]
    return out.to(x.dtype)


def _runs(lengths: list[int]) -> list[tuple[int, int]]:
    """(length, count) of each run of equal consecutive lengths."""
    out: list[tuple[int, int]] = []
    for ln in lengths:
        if out and out[-1][0] == ln:
            out[-1] = (ln, out[-1][1] + 1)
        else:
            out.append((ln, 1))
    return out


class VisionBlock(nn.Module):
    def __init__(self, vc: VisionConfig, dtype: torch.dtype):
        super().__init__()
        e = vc.hidden_size
        self.heads = vc.num_heads
        self.norm1, self.norm2 = _norm(e, dtype), _norm(e, dtype)
        self.attn = nn.ModuleDict({"qkv": _linear(3 * e, e, dtype), "proj": _linear(e, e, dtype)})
        self.mlp = nn.ModuleDict({"linear_fc1": _linear(vc.intermediate_size, e, dtype),
                                  "linear_fc2": _linear(e, vc.intermediate_size, dtype)})
        self.act = _act(vc.hidden_act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        n, e = x.shape
        h = F.layer_norm(x, (e,), self.norm1["weight"], self.norm1["bias"], 1e-6)
        qkv = F.linear(h, self.attn["qkv"]["weight"], self.attn["qkv"]["bias"]).view(n, 3, self.heads, -1)
        q, k, v = _rotate(qkv[:, 0], cos, sin), _rotate(qkv[:, 1], cos, sin), qkv[:, 2]
        out, start = [], 0
        # each image attends only to itself, in both directions; a run of images of one size is one call. The
        # inputs are 4-D and contiguous: torch's CPU attention takes its flash kernel then (5-8x faster at
        # 784 patches than the 3-D strided call, which falls back to the math path)
        for ln, count in _runs(lengths):
            s = slice(start, start + ln * count)

            def heads(t: torch.Tensor) -> torch.Tensor:
                return t[s].reshape(count, ln, self.heads, -1).transpose(1, 2).contiguous()

            o = F.scaled_dot_product_attention(heads(q), heads(k), heads(v))
            out.append(o.transpose(1, 2).reshape(ln * count, e))
            start += ln * count
        x = x + F.linear(torch.cat(out), self.attn["proj"]["weight"], self.attn["proj"]["bias"])
        h = F.layer_norm(x, (e,), self.norm2["weight"], self.norm2["bias"], 1e-6)
        h = self.act(F.linear(h, self.mlp["linear_fc1"]["weight"], self.mlp["linear_fc1"]["bias"]))
        return x + F.linear(h, self.mlp["linear_fc2"]["weight"], self.mlp["linear_fc2"]["bias"])


class VisionModel(nn.Module):
    """State dict: patch_embed.proj.{weight [E, C, Tp, P, P], bias}, pos_embed.weight [side^2, E],
    blocks.{i}.{norm1, norm2, attn.qkv, attn.proj, mlp.linear_fc1, mlp.linear_fc2}.{weight, bias},
    merger.{norm, linear_fc1, linear_fc2}.{weight, bias}."""

    def __init__(self, vc: VisionConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config, self.dtype = vc, dtype
        e, m = vc.hidden_size, vc.hidden_size * vc.merge_unit
        self.patch_embed = nn.ModuleDict({"proj": nn.ParameterDict({
            "weight": empty_param(e, vc.in_channels, vc.temporal_patch_size, vc.patch_size, vc.patch_size, dtype=dtype),
            "bias": empty_param(e, dtype=dtype)})})
        self.pos_embed = nn.ParameterDict({"weight": empty_param(vc.num_position_embeddings, e, dtype=dtype)})
        self.blocks = nn.ModuleList(VisionBlock(vc, dtype) for _ in range(vc.depth))
        self.merger = nn.ModuleDict({"norm": _norm(e, dtype), "linear_fc1": _linear(m, m, dtype),
                                     "linear_fc2": _linear(vc.out_hidden_size, m, dtype)})
        self._table_cache: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    @property
    def patch_dim(self) -> int:
        vc = self.config
        return vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2

    def num_tokens(self, grid: tuple[int, int, int]) -> int:
        """LLM tokens an image of patch grid (t, h, w) becomes."""
        t, h, w = grid
        return t * h * w // self.config.merge_unit

    def _tables(self, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The position embedding and rotary cos / sin of an h x w patch grid, kept per grid size and position
        table (the key has the table's storage and version, so a table replaced or changed in place is
        resampled): the same sizes recur, and resampling the table costs as much as a small block."""
        table = self.pos_embed["weight"]
        key = (h, w, table.data_ptr(), table._version)
        if key not in self._table_cache:
            if len(self._table_cache) >= 64:
                self._table_cache.pop(next(iter(self._table_cache)))
            vc, m = self.config, self.config.spatial_merge_size
            c, s = vision_rotary(h, w, m, vc.head_dim, vc.rope_theta)
            self._table_cache[key] = (pos_embed(self.pos_embed["weight"], h, w, m), c, s)
        return self._table_cache[key]

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixel_values [sum t*h*w, patch_dim] (the processor's rows, any float dtype); grids per image ->
        [sum t*h*w / merge_unit, out_hidden] in the model dtype, images in order."""
        vc, m = self.config, self.config.spatial_merge_size
        lengths = [t * h * w for t, h, w in grids]
        if pixel_values.shape != (sum(lengths), self.patch_dim):
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)} do not match grids {grids} "
                             f"({sum(lengths)} patches of {self.patch_dim})")
        if any(h % m or w % m for _, h, w in grids):
            raise ValueError(f"image grids {grids} are not multiples of the merge size {m}")
        dev = self.pos_embed["weight"].device
        proj = self.patch_embed["proj"]
        x = F.linear(pixel_values.to(dev, self.dtype), proj["weight"].reshape(proj["weight"].shape[0], -1), proj["bias"])
        pos, cos, sin = [], [], []
        for t, h, w in grids:  # a video's frames would share one frame's tables; images have t == 1
            p, c, s = self._tables(h, w)
            pos.append(p.repeat(t, 1))
            cos.append(c.repeat(t, 1))
            sin.append(s.repeat(t, 1))
        x = x + torch.cat(pos).to(dev, x.dtype)
        cos, sin = torch.cat(cos).to(dev), torch.cat(sin).to(dev)
        for blk in self.blocks:
            x = blk(x, cos, sin, lengths)
        mg = self.merger
        x = F.layer_norm(x, (vc.hidden_size,), mg["norm"]["weight"], mg["norm"]["bias"], 1e-6)
        x = x.reshape(-1, vc.hidden_size * vc.merge_unit)
        x = F.gelu(F.linear(x, mg["linear_fc1"]["weight"], mg["linear_fc1"]["bias"]))
        return F.linear(x, mg["linear_fc2"]["weight"], mg["linear_fc2"]["bias"])
