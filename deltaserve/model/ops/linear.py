"""linear(x, w): every projection's entry point, whatever the weight: a block-FP8 one (fp8.py), an int4 one
(int4.py) or a bf16 / fp32 one, packed or not (packed.py, which says how bf16 weights are packed and why)."""
from __future__ import annotations

import torch

from .fp8 import QUANTIZED, SplitWeight
from .packed import linear_packed


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """x [..., in] @ w^T -> [..., out]. w: a tensor, a PackedWeight, or a quantized weight (Fp8Weight, Int4Weight,
    SplitWeight)."""
    if isinstance(w, (*QUANTIZED, SplitWeight)):
        return w.linear(x)
    return linear_packed(x, w)
