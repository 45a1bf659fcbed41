"""Position-independent activations.

ATen's fp32 sigmoid / silu / softplus kernels take a vectorised path for most elements and a scalar
path for the tail of each contiguous run (and of each thread's share); the two paths differ in the last
bit. An element's result then depends on where it sits in the tensor, i.e. on what else is in the
batch, which breaks "concurrent == solo" and "hit == cold" bit-exactness. exp and log1p go through
MKL VML (fp32) or whole-vector Sleef loops with partial loads (bf16) and are position-independent, as
are +, -, *, /. So the activations are built from those, in fp32, and cast back to the input dtype.
Measured on this machine (torch 2.13 CPU); tests/test_ops.py checks it.
"""
from __future__ import annotations

import torch


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)), computed in fp32, returned in x's dtype."""
    xf = x.float()
    return (1.0 / (1.0 + torch.exp(-xf))).to(x.dtype)


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) = x / (1 + exp(-x)), computed in fp32, returned in x's dtype."""
    xf = x.float()
    return (xf / (1.0 + torch.exp(-xf))).to(x.dtype)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + exp(x)), linear above 20 (torch's beta=1, threshold=20), computed in fp32, returned in x's dtype."""
    xf = x.float()
    return torch.where(xf > 20.0, xf, torch.log1p(torch.exp(xf))).to(x.dtype)


def gdn_gates(b: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor,
              neg_decay: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The GDN gates of every token: b, a [T, Hv] (in_proj's columns); dt_bias, neg_decay (-exp(A_log)) [Hv]
    fp32 -> (g = neg_decay * softplus(a + dt_bias) [T, Hv] fp32, beta = sigmoid(b) [T, Hv] in b's dtype).
    The reference of the compiled gdn_gates (csrc/pointwise.cpp)."""
    return neg_decay * softplus(a.float() + dt_bias), sigmoid(b)


def gate_output(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Gated attention's output o * sigmoid(gate), o and gate [T, N]; the reference of the compiled one."""
    return o * sigmoid(gate)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu [T, 2I] = [gate | up] -> silu(gate) * up [T, I]: the MLP's activation, the reference of the compiled one."""
    gate, up = gu.chunk(2, dim=-1)
    return silu(gate) * up
