"""Int4 weights: 4-bit codes with a scale and an integer zero per output row and group of k.

    w[n, k] = scale[n, g] * (code[n, k] - zero[n, g]),  g = k // group,  code in 0..15,  zero in 0..16

the meaning of a GPTQ-Int4 checkpoint's tensors (model/gptq.py unpacks them into this form) and of `--quantize int4`
at load (quantize_int4: round to nearest, symmetric with zero 8 or with a zero point per group).

    quantize_int4(w, group, sym)                  # w [N, K] -> (codes, zeros, scales)
    dequantize_int4(codes, zeros, scales, group, dtype)   # the stored weight: (code - zero) * scale in fp32, rounded once
    linear_int4_reference(x, codes, zeros, scales, group) # the compiled kernel's terms in plain torch: its very bits
    Int4Weight(codes, zeros, scales, group).pack(ext)     # packed once for csrc/linear_int4.cpp
    embedding_int4(ids, w)                        # rows of the dequantized weight, read from the packing (a tied head)

The kernel (csrc/linear_int4.cpp) quantizes each activation row to int8 per min(group, 128) k (that row's own absmax / 127,
round half to even), sums code x activation in integers (exact), and scales per 32 k and per group in fp32 in one
fixed order. linear_int4_reference does the same operations with torch, so the kernel, every one of its paths,
and the reference agree bit for bit, at any batch and any thread count. Against the dequantized weight's bf16
product the difference is the activations' int8 rounding (docs/int4.md states it, measured).
"""
from __future__ import annotations

import torch

SUB = 32  # the smallest group and activation sub-block
SUB_MAX = 128  # the largest activation sub-block: one int8 scale per row and min(group, 128) k
COLS = 16  # output rows per packed column block
GROUPS = (32, 64, 128, 256)  # group sizes the kernel takes (any multiple of 32 would do; these are what formats use)
BAND_BYTES = 32 << 20  # quantize_int4's fp32 working set, per copy


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def whole_row_group(k: int) -> int:
    """The group of a per-channel weight (one scale per row): K rounded up to a group size the kernel takes."""
    return cdiv(k, SUB) * SUB if k <= SUB_MAX else cdiv(k, SUB_MAX) * SUB_MAX


# ---- the format --------------------------------------------------------------------------------------------

def quantize_int4(w: torch.Tensor, group: int = 128, sym: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (codes [N, K] uint8 0..15, zeros [N, G] uint8, scales [N, G] fp32), G = ceil(K / group), by
    round to nearest (no calibration). sym: GPTQ's symmetric rule, zero 8, scale = amax * 2 / 15, codes =
    clamp(round(w / scale) + 8, 0, 15); else a zero point per group (scale = (max - min) / 15 over a range that
    holds 0, zero = round(-min / scale)). Every step is one
    correctly rounded fp32 op, so the bytes are the same on every machine."""
    assert w.dim() == 2 and group % SUB == 0, (w.shape, group)
    N, K = w.shape
    G = cdiv(K, group)
    codes = torch.empty(N, K, dtype=torch.uint8)
    zeros = torch.empty(N, G, dtype=torch.uint8)
    scales = torch.empty(N, G, dtype=torch.float32)
    # a band of rows at a time: a row's codes depend on that row alone, and the fp32 temporaries (several copies)
    # stay a band's, not the weight's
    step = max(1, BAND_BYTES // (G * group * 4))
    for r0 in range(0, N, step):
        r1 = min(N, r0 + step)
        codes[r0:r1], zeros[r0:r1], scales[r0:r1] = _quantize_rows(w[r0:r1], group, sym)
    return codes, zeros, scales


def _quantize_rows(w: torch.Tensor, group: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    N, K = w.shape
    G = cdiv(K, group)
    wf = torch.zeros(N, G * group, dtype=torch.float32)
    wf[:, :K] = w.float()
    blocks = wf.view(N, G, group)
    if sym:
        amax = blocks.abs().amax(dim=2)
        scale = amax * 2 / 15
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        zero = torch.full((N, G), 8, dtype=torch.int32)
    else:
        lo = blocks.amin(dim=2).clamp(max=0)
        hi = blocks.amax(dim=2).clamp(min=0)
        scale = (hi - lo) / 15
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        zero = torch.round(-lo / scale).clamp(0, 15).to(torch.int32)
    codes = (torch.round(blocks / scale[:, :, None]) + zero[:, :, None]).clamp(0, 15)
    codes = codes.to(torch.uint8).view(N, G * group)[:, :K]
    return codes, zero.to(torch.uint8), scale


def check_int4(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int, name: str = "weight") -> None:
    N, K = codes.shape
    G = cdiv(K, group)
    if group % SUB or group <= 0 or (group > SUB_MAX and group % SUB_MAX):
        raise ValueError(f"{name}: int4 group size {group}; the kernel takes multiples of 32 (of 128 above 128)")
    if codes.dtype != torch.uint8 or zeros.dtype != torch.uint8 or scales.dtype != torch.float32:
        raise ValueError(f"{name}: int4 codes / zeros must be uint8 and scales fp32")
    if tuple(zeros.shape) != (N, G) or tuple(scales.shape) != (N, G):
        raise ValueError(f"{name}: a [{N}, {K}] int4 weight in groups of {group} needs zeros and scales [{N}, {G}], "
                         f"not {tuple(zeros.shape)} and {tuple(scales.shape)}")


def dequantize_int4(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int,
                    dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The stored weight in dtype: (code - zero) * scale in fp32 (one rounding; none for an fp16 scale, as GPTQ
    files hold: a 5-bit integer times an 11-bit significand fits fp32's 24), rounded once to dtype."""
    K = codes.shape[1]
    z = zeros.float().repeat_interleave(group, dim=1)[:, :K]
    s = scales.float().repeat_interleave(group, dim=1)[:, :K]
    return ((codes.float() - z) * s).to(dtype)


def sub_for(group: int) -> int:
    """The activation sub-block of a group size: min(group, 128) k share one int8 scale."""
    return min(group, SUB_MAX)


def quantize_activations(x: torch.Tensor, kp: int, sub: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq [M, kp] int8, xs [M, kp / sub] fp32, xsum [M, kp / sub] int32), the kernel's rule: per row
    and sub k, xs = amax / 127, xq = round-half-even(x / xs) (0 where amax is 0), zero past K."""
    M, K = x.shape
    xf = torch.zeros(M, kp, dtype=torch.float32)
    xf[:, :K] = x.float()
    b = xf.view(M, kp // sub, sub)
    amax = b.abs().amax(dim=2)
    xs = amax / 127
    safe = torch.where(amax > 0, xs, torch.ones_like(xs))
    q = torch.where(amax[:, :, None] > 0, torch.round(b / safe[:, :, None]), torch.zeros_like(b)).clamp(-127, 127)
    return q.to(torch.int8).view(M, kp), xs, q.sum(dim=2).to(torch.int32)


def linear_int4_reference(x: torch.Tensor, codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                          group: int) -> torch.Tensor:
    """x [M, K] @ dequant(w)^T -> [M, N] in x's dtype, by the kernel's own operations (csrc/linear_int4.cpp): the
    integer sums in float64 (exact: every sum is below 2^20), then the same fp32 steps in the same order."""
    M, K = x.shape
    N = codes.shape[0]
    G = cdiv(K, group)
    sub = sub_for(group)
    kp, nsub = G * group, group // sub
    xq, xs, xsum = quantize_activations(x, kp, sub)
    cf = torch.zeros(N, kp, dtype=torch.float64)
    cf[:, :K] = codes.double()
    # isum[m, n, sb] = sum over the sub-block of code * xq, exactly
    isum = torch.einsum("msk,nsk->mns", xq.double().view(M, kp // sub, sub), cf.view(N, kp // sub, sub))
    z = zeros.double().repeat_interleave(nsub, dim=1)  # [N, SB]
    isum = isum - z[None] * xsum.double()[:, None, :]
    t = isum.float() * xs[:, None, :]  # [M, N, SB], one fp32 rounding each
    y = None
    for sb in range(G * nsub):  # u_b = t_b * scale of b's group, summed in ascending order
        u = t[:, :, sb] * scales[:, sb // nsub].float()[None, :]
        y = u if y is None else y + u
    return y.to(x.dtype)


# ---- weights as the model holds them -----------------------------------------------------------------------

class Int4Weight:
    """A [N, K] int4 linear weight (the module's docstring). Unpacked, linear() runs the reference (the kernel's
    bits, slowly); pack(ext) moves it into the kernel's layout and drops the unpacked codes."""

    def __init__(self, codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int):
        check_int4(codes, zeros, scales, group)
        self.shape = tuple(codes.shape)
        self.dtype = torch.bfloat16  # what the product returns
        self.group = group
        self.codes, self.zeros, self.scales = codes.contiguous(), zeros.contiguous(), scales.contiguous()
        self.ext = self.packed = self.packed_scales = None
        self.path = "int4"

    @classmethod
    def quantize(cls, w: torch.Tensor, group: int = 128, sym: bool = True) -> "Int4Weight":
        return cls(*quantize_int4(w, group, sym), group)

    @property
    def nbytes(self) -> int:
        """Bytes the product streams: codes, zeros and scales."""
        if self.packed is not None:
            return self.packed.numel() + self.packed_scales.numel() * 4
        return self.codes.numel() // 2 + self.zeros.numel() + self.scales.numel() * 4

    def pack(self, ext, path: str = "int4") -> None:
        """Into ext's layout (csrc/linear_int4.cpp), run on its path `path` ("int4": the build's best)."""
        self.packed, self.packed_scales = ext.pack_int4_weight(self.codes, self.zeros, self.scales, self.group)
        self.ext, self.codes, self.path = ext, None, path

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        if self.codes is None:
            raise ValueError("dequantize an Int4Weight before packing it")
        return dequantize_int4(self.codes, self.zeros, self.scales, self.group, dtype)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if self.packed is not None:
            y = self.ext.linear_int4(x2.to(torch.bfloat16), self.packed, self.packed_scales, self.shape[0], self.path)
        else:
            y = linear_int4_reference(x2.to(torch.bfloat16), self.codes, self.zeros, self.scales, self.group)
        return y.to(x.dtype).view(*x.shape[:-1], self.shape[0])


def embedding_int4(ids: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """Rows ids of w's stored weight in bf16, dequantize_int4's bits, read from the packing where w is packed (the
    layout of csrc/linear_int4.cpp's pack_int4_weight: per 16-row column block and group, 16 zero bytes, then 8 k
    per 64-byte chunk, byte 4 * col + i holding k 8c + i low and 8c + 4 + i high) or from the codes. A tied head
    quantized with --quantize-head is the embedding too this way, held once. ids of any shape -> [*ids.shape, K]."""
    flat = ids.reshape(-1)
    N, K = w.shape
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= N):
        raise IndexError(f"token id outside the vocabulary of {N}")
    if w.packed is None:
        rows = dequantize_int4(w.codes[flat], w.zeros[flat], w.scales[flat], w.group)
        return rows.reshape(*ids.shape, K)
    gs = w.group
    NB, G, _ = w.packed.shape
    b, c = flat // COLS, flat % COLS
    zeros = w.packed[b, :, c]  # [n, G]: the two advanced indices' dim comes first
    scales = w.packed_scales[b, :, c]
    body = w.packed[:, :, COLS:].view(NB, G, gs // 8, COLS, 4)[b, :, :, c, :]  # [n, G, chunks, 4]
    codes = torch.stack((body & 15, body >> 4), dim=3).reshape(flat.numel(), G * gs)[:, :K]
    return dequantize_int4(codes, zeros, scales, gs).reshape(*ids.shape, K)


def quantize_int4_packed(rows, shape: tuple[int, int], group: int, sym: bool, ext, path: str = "int4",
                         band: int = 8192) -> Int4Weight:
    """Int4Weight.quantize(w, group, sym) packed for ext (.pack(ext, path)), made from rows(r0, r1) -> w[r0:r1] a
    band of rows at a time (packed.pack_in_bands): without the whole weight, its unpacked codes (a byte a weight) or
    its fp32 copies held at once (a large head, streamed from the checkpoint by the loader)."""
    from .packed import pack_in_bands

    first: list[Int4Weight] = []  # the first band's weight becomes the whole's

    def pack(w):
        part = Int4Weight.quantize(w, group, sym)
        part.pack(ext, path)
        first[:] = first or [part]
        return (part.packed, part.packed_scales), (part.zeros, part.scales)

    (packed, packed_scales), extras = pack_in_bands(rows, shape[0], band, pack)
    out = first[0]
    out.shape, out.packed, out.packed_scales = tuple(shape), packed, packed_scales
    out.zeros, out.scales = torch.cat([z for z, _ in extras]), torch.cat([s for _, s in extras])
    return out


def int4_path_for(ext, isa: str | None) -> str:
    """The linear_int4 path a model on the decode kernels' instruction set `isa` runs: "int4:amx" (AMX-INT8 tiles from
    16 rows on, the same bits) on the amx set where this process may use AMX, else "int4" (the build's best)."""
    from .cpu_kernels import cpu_flags

    return "int4:amx" if isa == "amx" and "int4:amx" in ext.int4_paths() and "amx_int8" in cpu_flags() else "int4"


def cat_int4(parts: list[Int4Weight]) -> Int4Weight:
    """Unpacked int4 weights stacked along the output rows (a fused projection: each row keeps its scales)."""
    assert all(p.codes is not None and p.group == parts[0].group for p in parts)
    return Int4Weight(torch.cat([p.codes for p in parts]), torch.cat([p.zeros for p in parts]),
                      torch.cat([p.scales for p in parts]), parts[0].group)
