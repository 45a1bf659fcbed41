"""Causal depthwise conv1d with SiLU, token-major: the GDN layer's short convolution over q, k, v channels.

Weight [C, K] (the checkpoint's conv1d.weight [C, 1, K] squeezed); state [K-1, C]: the last K-1 inputs,
oldest first. out[t] = silu(sum_j w[:, j] * xpad[t + j]) with xpad = cat(state, x): K shifted
multiply-adds on the token-major input, accumulated in fp32 in the order j = 0 .. K-1 (one mul and one
add per term, never fused), so a token gives the same bits through prefill and through the decode step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .pointwise import silu

SLICE = 1024  # tokens per slice in prefill: keeps the fp32 temporaries small (see CPU-NOTES, glibc mmap)


def _conv_acc(xs: list[torch.Tensor], wt: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """xs[j]: [..., C] the input shifted by j (any float dtype); wt [K, C] fp32 contiguous -> silu(acc) fp32."""
    acc = xs[0].float() * wt[0]
    for j in range(1, len(xs)):
        acc = acc + xs[j].float() * wt[j]
    if bias is not None:
        acc = acc + bias.float()
    return silu(acc)


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None,
                          bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence. x [L, C]; weight [C, K]; state [K-1, C] or None (zeros).

    Returns (out [L, C] in x's dtype, new_state [K-1, C] in x's dtype: the last K-1 inputs of cat(state, x)).
    """
    L, C = x.shape
    K = weight.shape[1]
    if state is None:
        state = x.new_zeros(K - 1, C)
    xp = torch.cat([state.to(x.dtype), x], 0)  # [L + K - 1, C]
    wt = weight.float().t().contiguous()  # [K, C]: each tap a contiguous row
    out = torch.empty_like(x)
    for s in range(0, L, SLICE):
        e = min(s + SLICE, L)
        out[s:e] = _conv_acc([xp[s + j: e + j] for j in range(K)], wt, bias).to(x.dtype)
    new_state = xp[L:].clone()  # [K-1, C]
    return out, new_state


def causal_conv1d_step(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """One token for each of B sequences. x [B, C]; state [B, K-1, C], updated in place. Returns [B, C] in x's dtype."""
    K = weight.shape[1]
    xp = torch.cat([state.to(x.dtype), x.unsqueeze(1)], 1)  # [B, K, C]
    out = _conv_acc([xp[:, j] for j in range(K)], weight.float().t().contiguous(), bias).to(x.dtype)
    state.copy_(xp[:, 1:])
    return out


def causal_conv1d_reference(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None,
                            bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' formulation: F.conv1d over channel-major input, in fp32. Same signature as the prefill."""
    L, C = x.shape
    K = weight.shape[1]
    if state is None:
        state = x.new_zeros(K - 1, C)
    xp = torch.cat([state.to(x.dtype), x], 0)
    y = F.conv1d(xp.float().t().unsqueeze(0), weight.float().unsqueeze(1),
                 None if bias is None else bias.float(), groups=C)  # [1, C, L]
    return F.silu(y[0].t()).to(x.dtype), xp[L:].clone()
