"""Block-FP8 weights (the format of Qwen's -FP8 models): e4m3 codes with one fp32 scale per 128 x 128 block.

    q, scale_inv = quantize_fp8(w)                 # w [N, K] -> q [N, K] float8_e4m3fn, scale_inv [ceil(N/128), ceil(K/128)]
    dequantize_fp8(q, scale_inv, dtype)            # (q * scale) in fp32, rounded once to dtype: transformers' formula
    linear_fp8_reference(x, q, scale_inv)          # the plain-torch product, block by block (the oracle)
    Fp8Weight(q, row_scale).pack(ext, path)        # packed once for the compiled kernel (csrc/linear_fp8.cpp)
    SplitWeight([part, ...])                       # a fused projection whose parts cannot share one packing

The kernel's sum (csrc/linear_fp8.cpp): y[m, n] = sum over k blocks (ascending) of scale[n, kb] * p[m, n, kb],
p the fp32 dot product of the block's 128 k; the reference computes the same terms with torch matmuls (their
own order inside a block), so the two agree to fp32 rounding, not bit for bit (tests/test_fp8.py). Against
the dequantized bf16 model an FP8 model differs by the bf16 rounding of each dequantized weight (2^-9 relative),
which the kernel never does (docs/fp8.md states the logit tolerance).

Scales are applied per 16 output columns (one column block of the kernel): a fused projection packs into one
Fp8Weight when every part but the last has a multiple of 16 rows, which every Qwen3.5 projection has; otherwise,
and where fp8 and bf16 parts meet (Qwen keeps in_proj_a / in_proj_b in bf16 beside an fp8 in_proj_qkv / z), it
is a SplitWeight: one product per part, concatenated (a column's bits do not depend on its neighbours).
"""
from __future__ import annotations

import functools
import logging
import platform
import threading
import time
from pathlib import Path

import torch

from .cpu_kernels import build_name, cpu_flags  # one reading of /proc/cpuinfo for every compiled kernel
from .build_notice import build_notice
from .int4 import Int4Weight, cat_int4
from .packed import PackedWeight, linear_packed

log = logging.getLogger("deltaserve")

BLOCK = 128  # the scale block, both dims (weight_block_size [128, 128])
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
QUANTIZE_BAND_BYTES = 64 << 20  # quantize_fp8's fp32 working set
COLS = 16  # output columns per kernel column block: the scale granularity of a packed weight

# the quantized linears' extension: block-FP8 (linear_fp8.cpp) and int4 (linear_int4.cpp, ops/int4.py), one module
_SOURCES = [Path(__file__).with_name("csrc") / f for f in ("linear_fp8.cpp", "linear_int4.cpp")]
_lock = threading.Lock()
_exts: dict[str, object] = {}  # build -> the module, or the exception that stopped its build


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---- the format --------------------------------------------------------------------------------------------

def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q [N, K] float8_e4m3fn, scale_inv [ceil(N/128), ceil(K/128)] fp32), DeepSeek / Qwen's rule:
    scale = amax(|block|) / 448 (1 for an all-zero block), q = round(w / scale) to e4m3 (saturating at 448).
    Every step is one correctly rounded fp32 op, so the bytes are the same on every machine."""
    assert w.dim() == 2
    N, K = w.shape
    nb, kb = cdiv(N, BLOCK), cdiv(K, BLOCK)
    q = torch.empty(N, K, dtype=FP8)
    scale = torch.empty(nb, kb, dtype=torch.float32)
    # a band of block rows at a time: a block's bytes depend on that block alone, and the fp32 temporaries stay a
    # band's (a few tens of MB), not several copies of the tensor (2.5 GB each for the 4B shape's head)
    step = max(1, QUANTIZE_BAND_BYTES // (BLOCK * kb * BLOCK * 4))
    for b0 in range(0, nb, step):
        b1 = min(nb, b0 + step)
        r0, r1 = b0 * BLOCK, min(N, b1 * BLOCK)
        wf = torch.zeros((b1 - b0) * BLOCK, kb * BLOCK, dtype=torch.float32)
        wf[:r1 - r0, :K] = w[r0:r1].float()
        blocks = wf.view(b1 - b0, BLOCK, kb, BLOCK)
        amax = blocks.abs().amax(dim=(1, 3))  # [band, kb]
        s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        band = (blocks / s[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        q[r0:r1] = band.view((b1 - b0) * BLOCK, kb * BLOCK)[:r1 - r0, :K]
        scale[b0:b1] = s
    return q, scale


def check_scale_shape(q: torch.Tensor, scale_inv: torch.Tensor, name: str = "weight") -> None:
    N, K = q.shape
    want = (cdiv(N, BLOCK), cdiv(K, BLOCK))
    if scale_inv.dim() != 2 or tuple(scale_inv.shape) != want:
        raise ValueError(f"{name}: weight_scale_inv has shape {tuple(scale_inv.shape)}; a [{N}, {K}] weight in "
                         f"128 x 128 blocks needs {want}")


def row_scales(scale_inv: torch.Tensor, n: int) -> torch.Tensor:
    """[ceil(N/128), KB] block scales -> [N, KB] fp32, one row per output row."""
    return scale_inv.float().repeat_interleave(BLOCK, dim=0)[:n].contiguous()


def dequantize_rows(q: torch.Tensor, row_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q [N, K] e4m3, row_scale [N, KB] -> (q * scale) in fp32, rounded once to dtype."""
    K = q.shape[1]
    s = row_scale.float().repeat_interleave(BLOCK, dim=1)[:, :K]
    return (q.float() * s).to(dtype)


def dequantize_fp8(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The stored weight in dtype: transformers' Fp8Dequantize formula ((q.float() * s).to(dtype)) with the
    block grid of the format (the last block of a dim may be partial)."""
    check_scale_shape(q, scale_inv)
    return dequantize_rows(q, row_scales(scale_inv, q.shape[0]), dtype)


def linear_fp8_reference(x: torch.Tensor, q: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ dequant(q [N, K])^T -> [M, N] in x's dtype: per k block a fp32 product of the exact fp8
    values, scaled per output row, summed over blocks in ascending order (the kernel's terms, csrc/linear_fp8.cpp)."""
    M, K = x.shape
    xf, qf, s = x.float(), q.float(), row_scale.float()
    y = torch.zeros(M, q.shape[0], dtype=torch.float32, device=x.device)
    for kb in range(cdiv(K, BLOCK)):
        ks = slice(kb * BLOCK, min(K, (kb + 1) * BLOCK))
        y = y + (xf[:, ks] @ qf[:, ks].t()) * s[:, kb]
    return y.to(x.dtype)


# ---- the compiled kernel -----------------------------------------------------------------------------------

# builds: the -march level each is compiled for and the /proc/cpuinfo flags it needs (fastest first). A build
# never holds an instruction outside its set, so its cached binary is safe on any CPU that has the set.
_V3 = {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"}
BUILDS = {"avx512": (["-march=x86-64-v4", "-mavx512bf16", "-mavx512vbmi", "-mavx512vnni"],
                     _V3 | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd", "avx512_bf16", "avx512vbmi",
                            "avx512_vnni"}),
          "avx2": (["-march=x86-64-v3"], _V3),
          "generic": ([], set())}


def executable_builds() -> tuple[str, ...]:
    """The builds this CPU executes, fastest first (avx512: the vpermi2b + vdpbf16ps path; avx2 / generic:
    the portable loop, compiled for that level)."""

    flags = cpu_flags()
    x86 = platform.machine() in ("x86_64", "AMD64")
    return tuple(b for b, (_, need) in BUILDS.items() if (x86 or b == "generic") and need <= flags)


def load_fp8_extension(build: str | None = None):
    """The compiled linear_fp8 module of `build` (default: the fastest this CPU executes), built on first call
    and cached in-process and on disk (torch's extension cache). Raises on failure."""
    build = build or executable_builds()[0]
    with _lock:
        if build not in _exts:
            from torch.utils import cpp_extension  # pulls in setuptools: only when a build is first loaded

            if build not in executable_builds():
                raise RuntimeError(f"fp8 build {build!r} needs CPU flags this CPU lacks")
            t0 = time.perf_counter()
            try:
                name = build_name("deltaserve_fp8_kernels", build)
                with build_notice(name, [str(f) for f in _SOURCES], f"the {build} fp8 and int4 linear kernels"):
                    _exts[build] = cpp_extension.load(
                        name=name, sources=[str(f) for f in _SOURCES],
                        extra_cflags=["-O3", *BUILDS[build][0], "-ffp-contract=off", "-fopenmp"],
                        extra_ldflags=["-fopenmp"], verbose=False)
                log.info("fp8 linear: compiled kernel %s, path %s, built or loaded in %.1f s", build,
                         _exts[build].fp8_paths()[0], time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 - no compiler / headers: the caller dequantizes instead
                _exts[build] = e
        ext = _exts[build]
        if isinstance(ext, Exception):
            raise ext
        return ext


# the fp8 build for each instruction set of the decode kernels (cpu_kernels.ISAS): `--cpu-isa avx2` runs the avx2
# code everywhere, so a CPU with more runs what an AVX2-only one would
BUILD_FOR_ISA = {"amx": "avx512", "avx512bf16": "avx512", "avx512": "avx2", "avx2": "avx2", "generic": "generic"}


def build_for(isa: str | None) -> str:
    """The fp8 build for the decode kernels' instruction set: the set's own level where this CPU executes it,
    else the fastest build it does."""
    builds = executable_builds()
    want = BUILD_FOR_ISA.get(isa or "")
    return want if want in builds else builds[0]


def fp8_kernel(isa: str | None = None) -> object | None:
    """The compiled module (the build for the decode kernels' set `isa`, build_for), or None (logged once) where it
    cannot be built."""
    try:
        return load_fp8_extension(build_for(isa))
    except Exception as e:  # noqa: BLE001
        log.warning("fp8 linear: no compiled kernel (%s: %s)", type(e).__name__,
                    str(e).strip().splitlines()[-1] if str(e).strip() else "")
        return None


def path_for(fp8_ext, isa: str) -> str:
    """The linear_fp8 path a model on the decode kernels' instruction set `isa` runs: "amx" (AMX tiles, from a few
    rows on several times the avx512 path's speed, docs/benchmarks.md; its own batch-invariant bits) on the amx
    set where this process may use AMX, else "" (the build's default)."""
    return "amx" if isa == "amx" and "amx" in fp8_ext.fp8_paths() else ""


# ---- weights as the model holds them -----------------------------------------------------------------------

class Fp8Weight:
    """A [N, K] block-FP8 linear weight: e4m3 codes and one fp32 scale per output row and 128-k block
    (row_scale [N, ceil(K/128)], the stored block grid expanded over rows, so fused parts keep theirs).
    Unpacked, linear() runs the torch reference; pack(ext) moves it into the kernel's layout (and drops the
    unpacked codes)."""

    def __init__(self, q: torch.Tensor, row_scale: torch.Tensor):
        assert q.dim() == 2 and q.dtype == FP8, (q.shape, q.dtype)
        assert row_scale.shape == (q.shape[0], cdiv(q.shape[1], BLOCK)) and row_scale.dtype == torch.float32
        self.shape = tuple(q.shape)
        self.dtype = torch.bfloat16  # what the product returns
        self.q, self.row_scale = q.contiguous(), row_scale.contiguous()
        self.ext = self.packed = self.scales = None
        self.path = ""

    @classmethod
    def from_block_scales(cls, q: torch.Tensor, scale_inv: torch.Tensor, name: str = "weight") -> "Fp8Weight":
        """From the codes and the per-block scale_inv as a -FP8 model stores them."""
        check_scale_shape(q, scale_inv, name)
        return cls(q, row_scales(scale_inv, q.shape[0]))

    @property
    def nbytes(self) -> int:
        """Bytes the product streams: the codes plus the scales."""
        if self.packed is not None:
            return self.packed.numel() + self.scales.numel() * 4
        return self.q.numel() + self.row_scale.numel() * 4

    def pack(self, ext, path: str = "") -> None:
        """Into ext's layout, to run on its linear_fp8 path `path` ("" the build's default; path_for)."""
        self.packed, self.scales = ext.pack_fp8_weight(self.q.view(torch.uint8), self.row_scale)
        self.ext, self.q, self.path = ext, None, path  # the codes live on in the packed layout only

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        if self.q is None:
            raise ValueError("dequantize an Fp8Weight before packing it")
        return dequantize_rows(self.q, self.row_scale, dtype)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if self.packed is not None:
            y = self.ext.linear_fp8(x2, self.packed, self.scales, self.shape[0], self.path)
        else:
            y = linear_fp8_reference(x2, self.q, self.row_scale)
        return y.view(*x.shape[:-1], self.shape[0])


def quantize_fp8_packed(rows, shape: tuple[int, int], ext, path: str = "", band: int = 8192) -> Fp8Weight:
    """Fp8Weight.from_block_scales(*quantize_fp8(w)) packed for ext (.pack(ext, path)), made from rows(r0, r1) ->
    w[r0:r1] a band of rows (whole 128-row scale blocks) at a time (packed.pack_in_bands: a block's codes depend on
    that block alone): without the whole weight or its codes held beside the packing (a large head, streamed from
    the checkpoint by the loader)."""
    from .packed import pack_in_bands

    assert band % BLOCK == 0

    first: list[Fp8Weight] = []  # the first band's weight becomes the whole's

    def pack(w):
        part = Fp8Weight.from_block_scales(*quantize_fp8(w))
        part.pack(ext, path)
        first[:] = first or [part]
        return (part.packed, part.scales), part.row_scale

    (packed, scales), row_scales = pack_in_bands(rows, shape[0], band, pack)
    out = first[0]
    out.shape, out.packed, out.scales, out.row_scale = tuple(shape), packed, scales, torch.cat(row_scales)
    return out


@functools.cache
def _group_offsets(kmajor: bool) -> torch.Tensor:
    """[16, 4]: the byte of column c's k kk (0..3) inside a 64-byte group of pack_fp8_weight's layout (its
    group_offset: the AVX2 build packs k-major, the others in the AVX-512 path's lane order)."""
    out = torch.empty(16, 4, dtype=torch.long)
    for c in range(16):
        for kk in range(4):
            q, word = kk // 2, 2 * c + (kk & 1)
            out[c, kk] = (2 * q + (word & 1)) * 16 + word // 2 if kmajor else (word // 8) * 16 + q * 8 + word % 8
    return out


def embedding_fp8(ids: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """Rows ids of w's stored weight in bf16, dequantize_rows' bits, read from the packing where w is packed
    ([ceil(N/16), ceil(K/4), 64] bytes, scales per 16 rows and 128 k: csrc/linear_fp8.cpp pack_fp8_weight, in its
    build's byte order) or from the codes. A tied head quantized with --quantize-head is the embedding too this way,
    held once. ids of any shape -> [*ids.shape, K]."""
    flat = ids.reshape(-1)
    N, K = w.shape
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= N):
        raise IndexError(f"token id outside the vocabulary of {N}")
    if w.packed is None:
        return dequantize_rows(w.q[flat], w.row_scale[flat], torch.bfloat16).reshape(*ids.shape, K)
    offsets = _group_offsets("avx2" in w.ext.fp8_paths())  # only the AVX2 build has the avx2 path
    b = flat // 16
    codes = w.packed[b[:, None], :, offsets[flat % 16]]  # [n, 4, groups]: advanced dims first
    codes = codes.transpose(1, 2).reshape(flat.numel(), -1)[:, :K].contiguous()
    return dequantize_rows(codes.view(FP8), w.scales[b], torch.bfloat16).reshape(*ids.shape, K)


class SplitWeight:
    """A fused projection held as parts (Fp8Weight, Int4Weight, bf16 tensor or its PackedWeight), stacked along the
    output rows: y = cat(part products). Used where the parts cannot share one quantized weight."""

    def __init__(self, parts: list):
        self.parts = list(parts)
        self.shape = (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])
        assert all(p.shape[1] == self.shape[1] for p in self.parts)
        self.dtype = torch.bfloat16

    @property
    def nbytes(self) -> int:
        return sum(weight_nbytes(p) for p in self.parts)

    def pack(self, fp8_ext, bf16_ext, path: str = "", int4_path: str = "int4") -> None:
        """fp8 parts for fp8_ext's linear_fp8 `path`, bf16 parts for bf16_ext; parts packed already stay as they are
        (the streaming loader packs each layer as it is placed, then sweeps the whole model once)."""
        for i, p in enumerate(self.parts):
            if isinstance(p, Fp8Weight) and p.packed is None:
                p.pack(fp8_ext, path)
            elif isinstance(p, Int4Weight) and p.packed is None:
                p.pack(fp8_ext, int4_path)
            elif isinstance(p, torch.Tensor):
                self.parts[i] = PackedWeight(p, bf16_ext)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.cat([p.dequantize(dtype) if isinstance(p, QUANTIZED) else p.to(dtype) for p in self.parts])

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p.linear(x) if isinstance(p, QUANTIZED) else linear_packed(x, p) for p in self.parts], dim=-1)


QUANTIZED = (Fp8Weight, Int4Weight)  # the weight kinds that hold codes (SplitWeight holds parts)


def weight_nbytes(w) -> int:
    if isinstance(w, (*QUANTIZED, SplitWeight)):
        return w.nbytes
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    return w.packed.numel() * w.packed.element_size()  # PackedWeight


def fuse(parts: list) -> torch.Tensor | Fp8Weight | Int4Weight | SplitWeight:
    """Stack projection parts (tensors, Fp8Weights, Int4Weights, in row order) into what the layer holds: a tensor
    when none is quantized; one Int4Weight when all are int4 with one group size (each row keeps its own scales);
    one Fp8Weight when all are fp8 and every part but the last has a multiple of 16 rows (a column block of the
    packed kernel then never mixes two parts' scales); else a SplitWeight of runs, each run fused."""
    if not any(isinstance(p, QUANTIZED) for p in parts):
        return torch.cat(parts, 0)

    def kind(p):
        return Fp8Weight if isinstance(p, Fp8Weight) else Int4Weight if isinstance(p, Int4Weight) else torch.Tensor

    runs: list[list] = []  # consecutive parts of one kind that fuse into one weight
    for p in parts:
        run = runs[-1] if runs else None
        if run and kind(run[0]) is kind(p) and (kind(p) is torch.Tensor
                                                or kind(p) is Int4Weight and p.group == run[0].group
                                                or kind(p) is Fp8Weight and all(r.shape[0] % COLS == 0 for r in run)):
            run.append(p)
        else:
            runs.append([p])
    fused = [r[0] if len(r) == 1 else
             Fp8Weight(torch.cat([x.q for x in r]), torch.cat([x.row_scale for x in r])) if kind(r[0]) is Fp8Weight
             else cat_int4(r) if kind(r[0]) is Int4Weight else torch.cat(r, 0) for r in runs]
    return fused[0] if len(fused) == 1 else SplitWeight(fused)


def is_quantized(w) -> bool:
    return isinstance(w, (*QUANTIZED, SplitWeight))


def dequantize_weight(w, dtype: torch.dtype) -> torch.Tensor:
    return w.dequantize(dtype)
