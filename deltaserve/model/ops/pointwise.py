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
