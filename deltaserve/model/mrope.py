"""Multimodal rotary positions (M-RoPE) of the Qwen3.5 text model: where images sit in a prompt.

Every token has three rotary positions (t, h, w). A text token has all three equal; an image of merged grid
gh x gw starting at prompt index s gets t = p, h = p + row, w = p + col, where p is the position the
previous text would have continued with, and the text after it resumes at p + max(gh, gw). A sequence's
positions therefore run behind its token indices by `shift` after its images (shift = sum of
max(gh, gw) - gh * gw over the images before; transformers' get_rope_index returns its final value as
rope_deltas). Generated tokens are text: position index + shift, on all three axes.

The text model's rotary halves are split between the axes by mrope_section (t, h, w), interleaved:
frequency j (of rotary_dim / 2) follows h when j % 3 == 1 and j < 3 * section[1], w when j % 3 == 2 and
j < 3 * section[2], t otherwise. A column of cos / sin depends on one position only, so the table the
model keeps per position (ops/attention.py RotaryTable) serves every axis: mrope_cos_sin picks each
column from the row of its axis' position, and a text token's values are bit-identical to plain RoPE.

ImageSpan and positions() are pure Python (the runner computes a chunk's positions without the rest of the
prompt); mrope_cos_sin is the torch side, mrope_cos_sin_reference transformers' formula.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ImageSpan:
    """An image's placeholder run in a prompt: tokens offset .. offset + gh * gw - 1, row-major over the merged
    grid gh x gw (the vision encoder's output order)."""

    offset: int
    gh: int
    gw: int

    @property
    def length(self) -> int:
        return self.gh * self.gw

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def shift(self) -> int:
        """How far the positions after this image run behind the token indices, from this image alone."""
        return max(self.gh, self.gw) - self.length


def final_shift(images: list[ImageSpan]) -> int:
    """The shift of every token after the last image (transformers' rope_deltas)."""
    return sum(im.shift for im in images)


def positions(images: list[ImageSpan], start: int, end: int) -> tuple[list[int], list[int], list[int]]:
    """The (t, h, w) rotary positions of token indices start .. end - 1 of a sequence whose images (sorted,
    not overlapping) are `images`; indices past the prompt are text."""
    assert all(a.end <= b.offset for a, b in zip(images, images[1:])), "images sorted and apart"
    t, h, w = [], [], []
    shift, k = 0, 0
    while k < len(images) and images[k].end <= start:
        shift += images[k].shift
        k += 1
    i = start
    while i < end:
        im = images[k] if k < len(images) else None
        if im is None or i < im.offset:  # text up to the next image (or the end)
            stop = end if im is None else min(end, im.offset)
            r = range(i + shift, stop + shift)
            t.extend(r)
            h.extend(r)
            w.extend(r)
            i = stop
            continue
        p = im.offset + shift  # where the text before this image would have continued
        stop = min(end, im.end)
        for j in range(i - im.offset, stop - im.offset):
            t.append(p)
            h.append(p + j // im.gw)
            w.append(p + j % im.gw)
        i = stop
        if i == im.end:
            shift += im.shift
            k += 1
    return t, h, w


def axis_of_columns(half: int, section: tuple[int, ...]) -> torch.Tensor:
    """[half] int64: which axis (0 t, 1 h, 2 w) each rotary frequency follows (interleaved sections)."""
    assert sum(section) == half, f"mrope_section {section} does not cover the {half} rotary frequencies"
    axis = torch.zeros(half, dtype=torch.long)
    j = torch.arange(half)
    axis[(j % 3 == 1) & (j < 3 * section[1])] = 1
    axis[(j % 3 == 2) & (j < 3 * section[2])] = 2
    return axis


def mrope_cos_sin(table, pos3: torch.Tensor, section: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """pos3 [3, T] int64 -> cos, sin [T, rotary_dim] from a RotaryTable (each column from its axis' row)."""
    end = int(pos3.max()) + 1 if pos3.numel() else 0
    cs = [table(pos3[a], end) for a in range(3)]
    half = cs[0][0].shape[-1] // 2
    axis = axis_of_columns(half, section).to(pos3.device)
    full = torch.cat([axis, axis])  # the table repeats its frequencies on the second half
    pick = lambda xs: torch.where(full == 0, xs[0], torch.where(full == 1, xs[1], xs[2]))
    return pick([c for c, _ in cs]), pick([s for _, s in cs])


def mrope_cos_sin_reference(pos3: torch.Tensor, inv_freq: torch.Tensor, section: tuple[int, ...],
                            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Qwen3_5TextRotaryEmbedding on pos3 [3, T]: angles per axis, the interleaved
    recomposition, cos / sin in fp32 then cast."""
    freqs = pos3[..., None].float() * inv_freq.float()  # [3, T, half]
    out = freqs[0].clone()
    for dim in (1, 2):
        idx = slice(dim, section[dim] * 3, 3)
        out[..., idx] = freqs[dim, ..., idx]
    emb = torch.cat((out, out), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)
