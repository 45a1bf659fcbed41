"""PackedWeight and linear_packed(x, w): F.linear, or a prepacked bf16 GEMM when w is a PackedWeight.

Two packings, chosen once per model (HybridModel.prepack_linears):
- "cpp": the compiled linear_bf16 (ops/csrc/linear_bf16.cpp; AVX512-BF16, or bf16 widened to fp32 on
  AVX-512 / AVX2, with the same bits: cpu_kernels.py chooses the instruction set; on the amx set
  ops/csrc/linear_bf16_amx.cpp, AMX tiles for every row count, the same packing, its own bits). Each output is
  a fixed-order fp32 sum over k, so a row's bits do not depend on the batch; at decode sizes it streams the
  weights at the memory bandwidth, ~1.3-1.6x oneDNN on this machine (docs/benchmarks.md), and on AMX it
  matches oneDNN's AMX speed for prefill (docs/cpu.md). Its bits differ from F.linear's in the last place
  (another summation order); tests/test_linear.py holds it to the fp32 reference.
- "onednn": oneDNN's reordered weights (torch's mkldnn linear ops), where the compiled kernels are missing
  (or the input dim is odd); "plain" (F.linear) where oneDNN has no bf16 either (an AVX2-only CPU).
  F.linear streams weights at ~12-14 GB/s at decode sizes, the reordered ones ~18-23 GB/s (docs/cpu.md); for
  bf16 the product has F.linear's bits for every row count (tests/test_parity.py).
fp32 weights stay on F.linear.

A tied head packed "cpp" is the embedding too (embedding_packed): the packing is a permutation of the weight's
elements with zero rows after the last, so a token's row is read back from it bit for bit and the [V, H]
embedding is not held beside it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class PackedWeight:
    """A [out, in] bf16 weight packed once for the CPU: kind "cpp" (ext.linear_bf16) or "onednn"."""

    def __init__(self, w: torch.Tensor, ext=None):
        self.shape = tuple(w.shape)
        self.dtype = w.dtype
        self.device = w.device
        w = w.detach().contiguous()
        if ext is not None and w.dtype == torch.bfloat16 and w.shape[1] % 2 == 0:
            self.kind, self.ext = "cpp", ext
            self.packed = ext.pack_bf16_weight(w)  # [ceil(out/16), in/2, 16, 2]
        elif not can_prepack(w.dtype, w.device):  # an odd input dim on a CPU without oneDNN bf16
            self.kind, self.ext, self.packed = "plain", None, w
        else:
            self.kind, self.ext = "onednn", None
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w, None)


def pack_in_bands(rows, n: int, band: int, pack) -> list:
    """Pack an [n, ...] weight a band of `band` rows (a multiple of 16) at a time: pack(w[r0:r1]) -> a tuple of
    tensors whose first dim counts 16-row column blocks (every compiled linear's packing), each band's written
    straight into tensors of ceil(n / 16) blocks made at the first band. rows(r0, r1) -> w[r0:r1]. The same bytes as
    packing the whole, without the whole weight (or its unpacked form) held beside the packing. Returns the tensors
    and, per band, what pack returned past them (a band's own small figures: scales, zeros)."""
    assert band % 16 == 0, band
    whole, extras = None, []
    for r in range(0, n, band):
        parts, extra = pack(rows(r, min(n, r + band)))
        if whole is None:
            whole = [torch.empty(-(-n // 16), *t.shape[1:], dtype=t.dtype) for t in parts]
        for t, part in zip(whole, parts):
            t[r // 16: r // 16 + part.shape[0]] = part
        extras.append(extra)
    return [whole, extras]


def pack_bf16_rows(rows, shape: tuple[int, int], ext, band: int = 8192) -> PackedWeight:
    """PackedWeight(w, ext) of the compiled linear_bf16 ("cpp"), made from rows(r0, r1) -> w[r0:r1] (bf16) a band
    of rows at a time (pack_in_bands): a tied head streamed from the checkpoint by the loader."""
    N, K = shape
    assert K % 2 == 0, K
    out = PackedWeight.__new__(PackedWeight)
    out.shape, out.dtype, out.device, out.kind, out.ext = (N, K), torch.bfloat16, torch.device("cpu"), "cpp", ext
    (out.packed,), _ = pack_in_bands(rows, N, band, lambda w: ((ext.pack_bf16_weight(
        w.to(torch.bfloat16).contiguous()),), None))
    return out


def embedding_packed(ids: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """F.embedding(ids, the weight w was packed from), read from the "cpp" packing [ceil(V/16), H/2, 16, 2]:
    row r is packed[r // 16, :, r % 16, :]. The same bits (a copy). ids of any shape -> [*ids.shape, H]."""
    assert w.kind == "cpp", "only the compiled linear_bf16's packing is a layout to read rows from"
    flat = ids.reshape(-1)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= w.shape[0]):
        raise IndexError(f"token id outside the vocabulary of {w.shape[0]}")
    rows = w.packed[flat // 16, :, flat % 16, :]  # [n, H/2, 2]: the two advanced indices' dim comes first
    return rows.reshape(*ids.shape, w.shape[1])


def can_prepack(dtype: torch.dtype, device: torch.device) -> bool:
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def linear_packed(x: torch.Tensor, w: torch.Tensor | PackedWeight) -> torch.Tensor:
    """x [..., in] @ w^T -> [..., out] for a bf16 / fp32 weight, packed or not."""
    if isinstance(w, PackedWeight):
        if w.kind == "cpp":
            n = w.shape[0]
            if x.dim() == 2:  # every projection of a step: no reshape round trip (two dispatches per call)
                return w.ext.linear_bf16(x, w.packed, n)
            return w.ext.linear_bf16(x.reshape(-1, x.shape[-1]), w.packed, n).view(*x.shape[:-1], n)
        if w.kind == "plain":
            return F.linear(x, w.packed)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w.packed, None, "none", [], "")
    return F.linear(x, w)
