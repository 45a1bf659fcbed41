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

SLICE = 1024  # tokens per slice in prefill: keeps the fp32 temporaries small (docs/cpu.md: glibc mmap)
SLICE_ELEMS = 1 << 17  # prefill slices of ~SLICE_ELEMS values (>= 64 tokens): temporaries stay cache-sized


def _conv_acc(xs: list[torch.Tensor], wt: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """xs[j]: [..., C] the input shifted by j (any float dtype); wt [K, C] fp32 contiguous -> silu(acc) fp32."""
    acc = xs[0].float() * wt[0]
    for j in range(1, len(xs)):
        acc = acc + xs[j].float() * wt[j]
    if bias is not None:
        acc = acc + bias.float()
    return silu(acc)


def start_state(x: torch.Tensor, K: int, state: torch.Tensor | None) -> torch.Tensor:
    """The conv state a prefill of x [L, C] starts from: state [K-1, C] in x's dtype, or zeros."""
    return x.new_zeros(K - 1, x.shape[1]) if state is None else state.to(x.dtype)


def last_inputs(state: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The state after a prefill of x [L, C] from state [K-1, C]: the last K-1 inputs of cat(state, x)."""
    L, n = x.shape[0], state.shape[0]
    return x[L - n:].clone() if L >= n else torch.cat([state[L:], x])


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None,
                          bias: torch.Tensor | None = None, silu_into=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence. x [L, C]; weight [C, K]; state [K-1, C] or None (zeros). silu_into(acc, out): the activation
    on the fp32 sums (default torch's; the op table passes the compiled one where the kernels are loaded, the one
    their decode step applies).

    Returns (out [L, C] in x's dtype, new_state [K-1, C] in x's dtype: the last K-1 inputs of cat(state, x)).
    """
    L, C = x.shape
    K = weight.shape[1]
    state = start_state(x, K, state)
    # _conv_acc's arithmetic (fp32 products added tap by tap, then silu = acc / (1 + exp(-acc))), slice by slice
    # in cache-sized fp32 buffers reused across slices, written straight into the output
    wt = weight.float().t().contiguous()  # [K, C]: each tap a contiguous row
    bf = None if bias is None else bias.float()
    out = torch.empty_like(x)
    step = max(64, min(SLICE, SLICE_ELEMS // C))
    m0 = min(step, L)
    xbuf = torch.empty(m0 + K - 1, C, dtype=torch.float32, device=x.device)
    acc_buf, tmp_buf = torch.empty(2, m0, C, dtype=torch.float32, device=x.device)
    for s in range(0, L, step):
        e = min(s + step, L)
        m = e - s
        xs = xbuf[:m + K - 1]  # rows s .. e + K - 2 of cat(state, x), in fp32
        if s == 0:
            xs[:K - 1] = state
            xs[K - 1:] = x[:e]
        else:
            xs.copy_(x[s - K + 1:e])
        acc, tmp = torch.mul(xs[:m], wt[0], out=acc_buf[:m]), tmp_buf[:m]
        for j in range(1, K):
            acc.add_(torch.mul(xs[j:j + m], wt[j], out=tmp))
        if bf is not None:
            acc.add_(bf)
        if silu_into is not None:
            silu_into(acc, out[s:e])
        else:
            torch.neg(acc, out=tmp).exp_().add_(1.0)
            torch.div(acc, tmp, out=out[s:e])
    return out, last_inputs(state, x)


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
