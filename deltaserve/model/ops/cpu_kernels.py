"""C++ CPU kernels (csrc/: decode_kernels.cpp, linear_bf16.cpp, norm.cpp), compiled once per machine with torch's
cpp_extension, and the choice between them and the plain-torch ops, made once when a model is built.

    kernels = select_decode_kernels(device, dtype)     # DecodeKernels; logs one line
    kernels.attention(q [B, Hq, D], kv, page_table [B, maxp], lengths [B], scale) -> [B, Hq, D]
    kernels.gdn_step(q, k [B, Hk, dk], v [B, H, dv], g [B, H] fp32, beta [B, H], state [S, H, dv, dk] fp32,
                     slots [B]) -> out [B, H, dv]   (state slots updated in place)
    kernels.conv_step(x [T, C], rows [B], weight [C, K], state [S, K-1, C], slots [B]) -> [B, C]
    kernels.rms_norm(x [R, (H,) D], w [D], eps); kernels.add_rms_norm(x, h [R, D], w, eps) -> (x + h, norm)
    kernels.ext.linear_bf16 through ops/linear.py PackedWeight (kind "cpp"), packed by HybridModel.prepack_linears
The model's layers reach these through its op table (ops/table.py), like every other op.

Each takes every decode sequence of a step in one call, parallel over (sequence, head); each (sequence,
head) is a fixed loop over its own data, so results are batch-invariant. The plain-torch references are
decode_attention (ops/attention.py, one sequence over gathered K/V), recurrent_gated_delta_rule_step
(ops/gdn.py) and causal_conv1d_step (ops/conv.py); tests/test_ops.py compares attention and the GDN step
at a tolerance, and the conv step bit for bit. The norms and the linear serve every row of a step (prefill
too), row by row, so they are batch-invariant as well (tests/test_cpu_kernels.py, tests/test_linear.py).

DELTASERVE_DECODE_KERNELS=torch forces the torch path (cpp: the compiled kernels, failing loudly if they
cannot be built; auto, the default: compiled kernels on CPU, torch if compilation fails). The build lands
in torch's extension cache (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions) and is reused.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .norm import rms_norm as rms_norm_torch
from .pointwise import silu

log = logging.getLogger("deltaserve")

ENV = "DELTASERVE_DECODE_KERNELS"
MODES = ("auto", "cpp", "torch")
_SOURCES = [Path(__file__).with_name("csrc") / f for f in ("decode_kernels.cpp", "linear_bf16.cpp", "norm.cpp")]
_lock = threading.Lock()
_ext = None  # the loaded module, or the exception that stopped the build
_build_seconds: float | None = None


def cpu_fingerprint() -> str:
    """A short hash of this CPU's model and instruction-set flags. The build uses -march=native, so it names
    the build: a cache directory shared between machines of different kinds never serves a binary built
    for another CPU (which could die on an illegal instruction)."""
    import hashlib
    import platform

    info = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        info += "".join(sorted(set(lines)))
    except OSError:
        info += platform.processor()
    return hashlib.sha1(info.encode()).hexdigest()[:10]


def load_extension():
    """The compiled module (built on first call, then cached in-process and on disk). Raises on failure."""
    global _ext, _build_seconds
    with _lock:
        if _ext is None:
            from torch.utils import cpp_extension

            t0 = time.perf_counter()
            try:
                _ext = cpp_extension.load(
                    name=f"deltaserve_decode_kernels_{cpu_fingerprint()}",
                    sources=[str(p) for p in _SOURCES],
                    extra_cflags=["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"],
                    extra_ldflags=["-fopenmp"],  # resolves to the libgomp.so.1 torch already loaded
                    verbose=False,
                )
            except Exception as e:  # noqa: BLE001 - no compiler / headers: the caller falls back
                _ext = e
            _build_seconds = time.perf_counter() - t0
        if isinstance(_ext, Exception):
            raise _ext
        return _ext


@dataclass(frozen=True)
class DecodeKernels:
    """Which decode ops a model runs; chosen once (select_decode_kernels)."""

    name: str  # "cpp" or "torch"
    ext: object | None = None

    @property
    def compiled(self) -> bool:
        return self.ext is not None

    def attention(self, q: torch.Tensor, kv: torch.Tensor, page_table: torch.Tensor, lengths: torch.Tensor,
                  scale: float) -> torch.Tensor:
        """q [B, Hq, D]; kv [P, 2, bs, Hkv, D]; page_table [B, maxp] int64; lengths [B] int64 -> [B, Hq, D]."""
        return self.ext.paged_decode_attention(q, kv, page_table, lengths, scale)

    def gdn_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """q, k [B, Hk, dk]; v [B, H, dv]; g [B, H] fp32; beta [B, H]; state [S, H, dv, dk] fp32 (slots
        updated in place); slots [B] int64 -> out [B, H, dv] in q's dtype."""
        return self.ext.gdn_decode_step(q, k, v, g, beta, state, slots)

    def conv_step(self, x: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, state: torch.Tensor,
                  slots: torch.Tensor) -> torch.Tensor:
        """x [T, C] (the step's rows; rows [B] picks the decode tokens); weight [C, K]; state [S, K-1, C] in
        x's dtype (slots [B] updated in place) -> silu(conv) [B, C] in x's dtype, the bits of
        ops/conv.py causal_conv1d_step (same fp32 mul / add order; silu in torch)."""
        wt = weight.float().t().contiguous()  # [K, C]
        return silu(self.ext.conv1d_step_acc(x, rows, wt, state, slots)).to(x.dtype)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Zero-centred RMSNorm of x [R, D] or [R, H, D] (last dim contiguous; views read in place) -> contiguous.
        Compiled: one pass per row, fixed lane order (batch-invariant, last-place differences from the torch
        op); torch: ops/norm.py rms_norm."""
        if self._fused_norm(x, weight) and x.dim() in (2, 3):
            return self.ext.rms_norm_fused(x, weight, eps)
        return rms_norm_torch(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + h, rms_norm(x + h)) for x, h [R, D]; the sum is rounded to x's dtype as torch's + rounds it."""
        if self._fused_norm(x, weight) and x.dim() == 2 and h.shape == x.shape and h.dtype == x.dtype:
            s, y = self.ext.add_rms_norm_fused(x, h, weight, eps)  # one pass: s rounded, then its norm
            return s, y
        s = x + h
        return s, rms_norm_torch(s, weight, eps)

    def _fused_norm(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return (self.ext is not None and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
                and weight.dtype == x.dtype and x.stride(-1) == 1)


TORCH = DecodeKernels("torch")


def select_decode_kernels(device: torch.device | str, dtype: torch.dtype, mode: str | None = None) -> DecodeKernels:
    """The decode kernels for a model on `device` in `dtype`. mode (default: $DELTASERVE_DECODE_KERNELS, else
    auto): auto = compiled on CPU for fp32 / bf16, torch otherwise or when the build fails (with a warning);
    cpp = compiled or raise; torch = the plain-torch ops. Logs the choice."""
    mode = (mode or os.environ.get(ENV) or "auto").strip().lower()
    if mode not in MODES:
        raise ValueError(f"{ENV} must be one of {', '.join(MODES)}, not {mode!r}")
    dev = torch.device(device)
    usable = dev.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
    if mode == "torch" or (mode == "auto" and not usable):
        why = "forced" if mode == "torch" else f"no compiled kernels for {dev.type} / {dtype}"
        log.info("decode kernels: torch (per-sequence decode_attention, recurrent_gated_delta_rule_step, "
                 "causal_conv1d_step; %s)", why)
        return TORCH
    try:
        ext = load_extension()
    except Exception as e:  # noqa: BLE001
        if mode == "cpp":
            raise
        log.warning("decode kernels: torch (compiling the C++ decode kernels failed: %s: %s)",
                    type(e).__name__, str(e).strip().splitlines()[-1] if str(e).strip() else "")
        return TORCH
    log.info("decode kernels: cpp (paged_decode_attention, gdn_decode_step, conv1d_step; built or loaded once "
             "per process, in %.1f s)", _build_seconds or 0.0)
    return DecodeKernels("cpp", ext)
