"""RMSNorm variants as Qwen3.5 / Qwen3-Next use them: transformers' formulas, fp32 upcast order included.

rms_norm is bit-for-bit Qwen3_5RMSNorm; rms_norm_gated is Qwen3_5RMSNormGated except that its silu is the
position-independent one of pointwise.py (last-bit differences, batch invariance kept)."""
from __future__ import annotations

import torch

from .pointwise import silu


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm (Qwen3_5RMSNorm / Qwen3NextRMSNorm): the weight is stored as w, applied as (1 + w).

    x [..., D] any dtype; weight [D]. Normalises in fp32, multiplies in fp32, casts back to x's dtype
    (Qwen's (x * w).to(dtype), not Llama's x.to(dtype) * w).
    """
    out = x.float()
    out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + eps)
    out = out * (1.0 + weight.float())
    return out.type_as(x)


def rms_norm_gated(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The GDN output norm (Qwen3_5RMSNormGated): norm(x) * w * silu(z), plain weight (stored at 1 = neutral).

    x, z [..., D] in the model dtype; weight [D]. The normalised x is cast back to x's dtype before the
    weight multiply, the gate is applied in fp32, the result is cast to x's dtype: transformers' order.
    """
    dtype = x.dtype
    h = x.float()
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    h = weight * h.to(dtype)
    h = h * silu(z.float())
    return h.to(dtype)
