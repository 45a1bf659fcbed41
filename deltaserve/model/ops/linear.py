"""linear(x, w): F.linear, or oneDNN's prepacked linear when w is a PackedWeight.

On this CPU, F.linear streams weights at ~12-14 GB/s at decode sizes; weights prepacked once with oneDNN
reach ~18-23 GB/s (CPU-NOTES). For bf16 the prepacked product has the same bits as F.linear, for every
row count (tests/test_ops.py checks it), so packing changes speed only. fp32 is left to F.linear.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class PackedWeight:
    """A [out, in] weight reordered once into oneDNN's blocked layout (CPU only)."""

    def __init__(self, w: torch.Tensor):
        self.shape = tuple(w.shape)
        self.dtype = w.dtype
        self.device = w.device
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), None)


def can_prepack(dtype: torch.dtype, device: torch.device) -> bool:
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def linear(x: torch.Tensor, w: torch.Tensor | PackedWeight) -> torch.Tensor:
    """x [..., in] @ w^T -> [..., out]."""
    if isinstance(w, PackedWeight):
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w.packed, None, "none", [], "")
    return F.linear(x, w)
