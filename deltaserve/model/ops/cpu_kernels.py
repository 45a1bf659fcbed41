"""C++ CPU kernels (csrc/: decode_kernels.cpp, linear_bf16.cpp, linear_bf16_amx.cpp, norm.cpp), compiled once per machine with torch's
cpp_extension, and the choice between them and the plain-torch ops, made once when a model is built.

    kernels = select_decode_kernels(device, dtype)     # DecodeKernels; logs one line
    kernels.attention(q [B, Hq, D], kv, page_table [B, maxp], lengths [B], scale) -> [B, Hq, D]
    kernels.gdn_step(q, k [B, Hk, dk], v [B, H, dv], g [B, H] fp32, beta [B, H], state [S, H, dv, dk] fp32,
                     slots [B]) -> out [B, H, dv]   (state slots updated in place)
    kernels.conv_step(x [T, C], rows [B], weight [C, K], state [S, K-1, C], slots [B]) -> silu(conv) [B, C]
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

Instruction sets (`--cpu-isa`, or DELTASERVE_CPU_ISA; auto, the default, takes the first this CPU executes):
    amx         the avx512bf16 build with linear_bf16 on AMX tiles (linear_bf16_amx) for every row count
    avx512bf16  linear_bf16 on vdpbf16ps; decode kernels on AVX-512
    avx512      AVX-512 without BF16: bf16 weights widened to fp32 in registers, fp32 fmas
    avx2        AVX2 + FMA: the same widening on 8 lanes; decode kernels on AVX2
    generic     not x86: the kernels' plain C++ loops, no compiled linear (oneDNN / F.linear)
Each is its own build of the same sources (the -march level of ISA_FLAGS: a binary never holds an
instruction outside its set, so any CPU with the set runs it), so one process can load several (the tests
run every set this CPU executes against the torch references). Every set keeps each output's fixed
summation order: rows are batch-invariant on all of them.

amx is not a build of its own: it loads the avx512bf16 build (whose linear_bf16_amx.cpp holds the AMX
instructions in functions of their own target) and serves its linear through linear_bf16_amx (AmxExtension).
It needs the CPU's amx_tile + amx_bf16 flags and the Linux kernel's permission to use the tile data
(arch_prctl ARCH_REQ_XCOMP_PERM, asked once per process: amx_refusal); where either is missing it is not
executable and auto takes avx512bf16. Its bits differ from the other sets' in the last place (TDPBF16PS sums
a 32-wide k chunk its own way), so it runs AMX at every row count, one row too: a row's bits never depend
on which path a step's size would have chosen.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ...config import CPU_ISA_CHOICES
from . import conv, gdn, pointwise
from .attention import apply_rotary
from .build_notice import build_notice
from .attention import prefill_attention as prefill_attention_torch
from .norm import rms_norm as rms_norm_torch
from .norm import rms_norm_gated as rms_norm_gated_torch

log = logging.getLogger("deltaserve")

ENV = "DELTASERVE_DECODE_KERNELS"
MODES = ("auto", "cpp", "torch")
ISA_ENV = "DELTASERVE_CPU_ISA"
ISAS = ("amx", "avx512bf16", "avx512", "avx2")  # fastest first: auto takes the first this CPU executes
ISA_CHOICES = CPU_ISA_CHOICES  # --cpu-isa's choices (config.py holds them: it imports no torch)
assert ISA_CHOICES == ("auto",) + ISAS + ("generic",)
# the build a set loads, where it is not its own: amx is the avx512bf16 build's linear_bf16_amx
ISA_BUILD = {"amx": "avx512bf16"}
# the compiler's -march level per build, and the /proc/cpuinfo flags each set may emit instructions of
ISA_FLAGS = {"avx512bf16": ["-march=x86-64-v4", "-mavx512bf16"], "avx512": ["-march=x86-64-v4"],
             "avx2": ["-march=x86-64-v3"], "generic": ["-march=native"]}
_V3 = {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe"}  # abm: lzcnt
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
ISA_NEEDS = {"amx": _V4 | {"avx512_bf16", "amx_tile", "amx_bf16"}, "avx512bf16": _V4 | {"avx512_bf16"},
             "avx512": _V4, "avx2": _V3}
ISA_WHAT = {"amx": "AMX tiles for the bf16 linear at every row count, AVX-512 decode kernels",
            "avx512bf16": "AVX512-BF16 dot products",
            "avx512": "AVX-512, bf16 weights widened to fp32 in registers",
            "avx2": "AVX2 + FMA, bf16 weights widened to fp32 in registers",
            "generic": "plain C++ loops, no compiled linear"}
# The build's name carries the source folder's: torch keys its extension cache by name, and two checkouts (git
# worktrees, a CI checkout beside a dev one) under one name would rebuild over each other at every load.
_TREE = hashlib.sha1(str(Path(__file__).resolve().parent).encode()).hexdigest()[:8]


def build_name(stem: str, build: str) -> str:
    """The extension-cache name of one compiled build: stem, instruction-set build, this checkout's tag."""
    return f"{stem}_{build}_{_TREE}"


_SOURCES = [Path(__file__).with_name("csrc") / f
            for f in ("decode_kernels.cpp", "linear_bf16.cpp", "linear_bf16_amx.cpp", "norm.cpp", "pointwise.cpp",
                      "decode_layers.cpp", "argmax.cpp", "prefill_attention.cpp", "gdn_prefill.cpp",
                      "conv_prefill.cpp")]
_lock = threading.Lock()
_exts: dict[str, object] = {}  # isa -> the loaded module, or the exception that stopped its build
_build_seconds: dict[str, float] = {}


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (/proc/cpuinfo; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def amx_refusal() -> str | None:
    """None when the Linux kernel lets this process use the AMX tile data, else why not. Asked once per process
    (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: the permission is the process's, every thread
    has it; oneDNN asks the same), and only where the CPU's flags name AMX."""

    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return "AMX tiles need Linux on x86-64"
    libc = ctypes.CDLL(None, use_errno=True)
    sys_arch_prctl, req_xcomp_perm, xtiledata = 158, 0x1023, 18
    if libc.syscall(sys_arch_prctl, req_xcomp_perm, xtiledata) == 0:
        return None
    return ("the Linux kernel refused the AMX tile data permission (arch_prctl ARCH_REQ_XCOMP_PERM: "
            f"{os.strerror(ctypes.get_errno())})")


def _why_not(isa: str, flags: frozenset[str]) -> str | None:
    """Why a CPU with `flags` cannot execute `isa` ("missing ..." flags, or amx's permission refusal), or None."""
    missing = sorted(ISA_NEEDS.get(isa, set()) - flags)
    if missing:
        return f"missing {', '.join(missing)}"
    if isa == "amx":
        return amx_refusal()
    return None


def executable_isas(flags: frozenset[str] | None = None) -> tuple[str, ...]:
    """The instruction sets of ISAS this CPU executes, fastest first; ("generic",) where none (not x86). amx
    also needs the kernel's permission (amx_refusal)."""

    flags = cpu_flags() if flags is None else flags
    found = tuple(i for i in ISAS if _why_not(i, flags) is None)
    if found:
        return found
    return ("generic",) if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86") else ()


def resolve_isa(isa: str | None = None, flags: frozenset[str] | None = None) -> str:
    """isa (default $DELTASERVE_CPU_ISA, else auto) checked against this CPU: auto -> the fastest set it executes;
    a named set it cannot execute -> ValueError naming the missing flags and the sets it can."""
    name = (isa or os.environ.get(ISA_ENV) or "auto").strip().lower()
    if name not in ISA_CHOICES:
        raise ValueError(f"--cpu-isa ({ISA_ENV}) must be one of {', '.join(ISA_CHOICES)}, not {name!r}")
    runs = executable_isas(flags)
    if name == "auto":
        if not runs:
            raise ValueError("this x86 CPU has no AVX2 + FMA: no compiled kernels for it")
        return runs[0]
    if name not in runs:
        why = _why_not(name, cpu_flags() if flags is None else flags) or "missing x86"
        raise ValueError(f"--cpu-isa {name}: this CPU cannot execute it ({why}); it runs: {', '.join(runs) or 'none'}")
    return name


def cannot_execute(isa: str) -> str | None:
    """Why this CPU cannot execute instruction set `isa` (the flags it lacks), or None when it can."""
    if isa in executable_isas():
        return None
    why = _why_not(isa, cpu_flags()) or "missing x86"
    return f"this CPU cannot execute the {isa} kernels ({why})"


def use_isa(isa: str) -> str:
    """The engine's --cpu-isa, made the process's choice once at start-up: checked against this CPU (ValueError
    naming what is missing) and set as $DELTASERVE_CPU_ISA, which every model built afterwards in this process,
    and every process it starts (tensor-parallel ranks), reads. Returns the set resolved ("none" for auto on
    an x86 CPU without AVX2 + FMA: the models there take the torch path, with a warning)."""
    try:
        chosen = resolve_isa(isa)
    except ValueError:
        if (isa or "auto").strip().lower() != "auto":
            raise
        chosen = "none"
    os.environ[ISA_ENV] = isa
    return chosen


def load_extension(isa: str | None = None):
    """The compiled module for instruction set `isa` (resolve_isa; built on first call, then cached in-process and
    on disk; amx: the avx512bf16 build as an AmxExtension). Raises on failure."""
    isa = resolve_isa(isa)
    build = ISA_BUILD.get(isa, isa)
    with _lock:
        if build not in _exts:
            from torch.utils import cpp_extension  # pulls in setuptools: only when a build is first loaded

            t0 = time.perf_counter()
            try:
                name, sources = build_name("deltaserve_kernels", build), [str(p) for p in _SOURCES]
                with build_notice(name, sources, f"the {build} CPU kernels ({len(sources)} C++ files)"):
                    ext = cpp_extension.load(
                        name=name, sources=sources,
                        extra_cflags=["-O3", *ISA_FLAGS[build], "-mtune=native", "-ffp-contract=off", "-fopenmp"],
                        extra_ldflags=["-fopenmp"],  # resolves to the libgomp.so.1 torch already loaded
                        verbose=False,
                    )
                built = ext.kernel_isa()
                if built != (build if build != "generic" else built):
                    raise RuntimeError(f"the {build} build of the kernels reports {built!r}")
                _exts[build] = ext
            except Exception as e:  # noqa: BLE001 - no compiler / headers: the caller falls back
                _exts[build] = e
            _build_seconds[build] = time.perf_counter() - t0
        if isa != build and isa not in _exts:
            _exts[isa] = _exts[build] if isinstance(_exts[build], Exception) else _view(isa, _exts[build])
            _build_seconds[isa] = _build_seconds[build]
        ext = _exts[isa]
        if isinstance(ext, Exception):
            raise ext
        return ext


def _view(isa: str, base):
    """The set `isa` over the build it shares (ISA_BUILD), or the exception that stops it."""
    assert isa == "amx", isa
    try:
        return AmxExtension(base)
    except RuntimeError as e:
        return e


class AmxExtension:
    """The avx512bf16 build as the amx set: every function of that build, with linear_bf16 the AMX one
    (linear_bf16_amx), so PackedWeight and every other caller run it without knowing which set they hold.
    Made only once the build holds the AMX linear and reports that it can run in this process."""

    def __init__(self, base):
        if not hasattr(base, "linear_bf16_amx"):
            raise RuntimeError("the avx512bf16 build of the kernels has no linear_bf16_amx")
        why = base.amx_linear_status()
        if why:
            raise RuntimeError(f"the amx kernels cannot run: {why}")
        self.base = base
        # the build's functions as attributes of this object (a call costs what it costs on the module)
        self.__dict__.update({n: getattr(base, n) for n in dir(base) if not n.startswith("_")})
        self.linear_bf16 = base.linear_bf16_amx
        self.kernel_isa = lambda: "amx"


@dataclass(frozen=True)
class DecodeKernels:
    """Which decode ops a model runs; chosen once (select_decode_kernels)."""

    name: str  # "cpp" or "torch"
    ext: object | None = None
    isa: str = "none"  # the instruction set of the compiled build (ISAS, "generic"); "none" on the torch path

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

    def gdn_replay(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor, slot: int) -> torch.Tensor:
        """One slot's state [S, H, dv, dk] fp32 stepped through the n tokens q, k [n, Hk, dk], v [n, H, dv], g, beta
        [n, H] in order, in one call (a head's state block stays in cache through the tokens): gdn_step's bits for
        each token, as gdn_step on one token at a time (ops/gdn.py recurrent_gated_delta_rule_step, the torch
        form) gives them -> out [n, H, dv]."""
        return self.ext.gdn_replay(q, k, v, g, beta, state, slot)

    def conv_step(self, x: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, state: torch.Tensor,
                  slots: torch.Tensor) -> torch.Tensor:
        """x [T, C] (the step's rows; rows [B] picks the decode tokens); weight [C, K]; state [S, K-1, C] in
        x's dtype (slots [B] updated in place) -> silu(conv) [B, C] in x's dtype: ops/conv.py
        causal_conv1d_step's fp32 mul / add order, then the compiled silu: one row of the compiled prefill's
        (csrc ds::conv_rows; the bits of causal_conv1d_prefill(..., silu_into=self.silu_into))."""
        return self.ext.conv1d_step(x, rows, tap_major(weight), state, slots)

    def conv_prefill(self, x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's causal conv with its silu (ops/conv.py causal_conv1d_prefill's arguments and results):
        compiled (csrc/conv_prefill.cpp, every build) for fp32 / bf16 x with a unit last stride and no bias, in
        one pass per row; else the torch form with the compiled silu. The bits are the same either way, and a
        token's are the decode step's (conv_step)."""
        if bias is not None or not self._rows(x) or x.shape[0] == 0:
            return conv.causal_conv1d_prefill(x, weight, state, bias, silu_into=self.silu_into)
        state = conv.start_state(x, weight.shape[1], state).contiguous()
        return self.ext.conv1d_prefill(x, tap_major(weight), state), conv.last_inputs(state, x)

    def silu_into(self, acc: torch.Tensor, out: torch.Tensor) -> None:
        """out = silu(acc) = acc / (1 + exp(-acc)) in out's dtype, for the conv's fp32 sums acc [T, C] (views with
        a unit last stride are written in place); the torch form is ops/conv.py's silu."""
        self.ext.silu_into(acc, out)

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

    def rms_norm_gated(self, x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """The GDN output norm: x [T, Hv, dv] (the rule's output), z [T, Hv*dv] (in_proj's gate columns, a
        row-strided view), weight [dv] -> [T, Hv*dv]. Compiled: one pass per head row; torch: ops/norm.py."""
        T, H, D = x.shape
        if self._fused_norm(x, weight) and self._rows(z) and z.dtype == x.dtype:
            return self.ext.gated_rms_norm(x, z, weight, eps)
        return rms_norm_gated_torch(x.reshape(T * H, D), z.reshape(T * H, D), weight, eps).view(T, H * D)

    def gdn_gates(self, b: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor,
                  neg_decay: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(g [T, Hv] fp32, beta [T, Hv]) from in_proj's b, a columns [T, Hv] (ops/pointwise.py gdn_gates)."""
        if self._rows(b) and self._rows(a) and a.dtype == b.dtype and dt_bias.dtype == neg_decay.dtype == torch.float32:
            g, beta = self.ext.gdn_gates(b, a, dt_bias.contiguous(), neg_decay.contiguous())
            return g, beta
        return pointwise.gdn_gates(b, a, dt_bias, neg_decay)

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gu [T, 2I] = [gate | up] -> [T, I] (ops/pointwise.py silu_mul); compiled: one pass."""
        return self.ext.silu_mul(gu) if self._rows(gu) else pointwise.silu_mul(gu)

    def qk_norm_rope(self, x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                     sin: torch.Tensor) -> torch.Tensor:
        """apply_rotary(rms_norm(x)) for q or k [T, H, D]; cos, sin [T, P] -> [T, H, D]. Compiled: one pass per
        head row (the norm's bits are rms_norm's compiled ones, the rotary's torch's exactly)."""
        if (self._fused_norm(x, weight) and x.dim() == 3 and cos.dtype == sin.dtype == x.dtype
                and cos.is_contiguous() and sin.is_contiguous()):
            return self.ext.qk_norm_rope(x, weight, eps, cos, sin)
        return apply_rotary(self.rms_norm(x, weight, eps), cos, sin)

    def gate_output(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """o * sigmoid(gate) for o, gate [T, N] (ops/pointwise.py gate_output)."""
        if self._rows(o) and self._rows(gate) and o.dtype == gate.dtype:
            return self.ext.gate_output(o, gate)
        return pointwise.gate_output(o, gate)

    def prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int,
                          scale: float) -> torch.Tensor:
        """One sequence's prefill chunk (ops/attention.py prefill_attention's arguments and result). Compiled where
        the build has it (avx512bf16, which amx loads: vdpbf16ps; avx512 and avx2: widened fp32 fmas) and the call
        is bf16 on the CPU with a head dim that is a multiple of 32: flash form (csrc/prefill_attention.cpp), a row's
        bits independent of the chunk it came in; else the torch path (SDPA per 64-row tile: the generic build).
        Which one is fixed per model (its dtype, head dim and kernels), so a cold run and a hit always take the
        same one."""
        if self.prefill_attention_compiled and q.dtype == k.dtype == v.dtype == torch.bfloat16 \
                and q.device.type == "cpu" and q.shape[-1] % 32 == 0:
            return self.ext.prefill_attention(q, k, v, pos, scale)
        return prefill_attention_torch(q, k, v, pos, scale)

    @functools.cached_property
    def prefill_attention_compiled(self) -> bool:
        """This build has the compiled prefill attention (csrc/prefill_attention.cpp: every x86 build)."""
        return self.ext is not None and self.ext.prefill_attention_available()

    def chunk_gated_delta_rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, initial_state: torch.Tensor | None = None, start_pos: int = 0,
                               use_qk_l2norm: bool = True, out: torch.Tensor | None = None,
                               states_at: tuple[int, ...] = (), states: list | None = None):
        """One sequence's chunked gated delta rule (ops/gdn.py chunk_gated_delta_rule's arguments and results).
        Compiled where the build has it (every x86 build; csrc/gdn_prefill.cpp: the same algebra on the same
        absolute 64-token grid, fp32 loops of its own fixed order) for bf16 q, k, v (and out) on the CPU with
        use_qk_l2norm and head dims of 64, 128, 192 or 256; else the torch path. Which one is fixed per model."""
        L, H, dv = v.shape
        dk = q.shape[-1]
        if not (self.gdn_prefill_compiled and use_qk_l2norm and L > 0 and q.device.type == "cpu"
                and q.dtype == k.dtype == v.dtype == torch.bfloat16 and dk in (64, 128, 192, 256)
                and dv in (64, 128, 192, 256) and (out is None or out.dtype == torch.bfloat16)):
            return gdn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state, start_pos, use_qk_l2norm, out,
                                              states_at, states)
        wanted = gdn.check_call(q, v, start_pos, states_at, states)
        state = gdn.start_state(initial_state, H, dv, dk, q.device)
        if out is None:
            out = torch.empty(L, H, dv, dtype=q.dtype)
        found = self.ext.gdn_chunk_prefill(q, k, v, g.float().contiguous(), beta.float().contiguous(), state,
                                           start_pos, out, wanted)
        if wanted:
            states.extend(found)
        return out, state

    @functools.cached_property
    def gdn_prefill_compiled(self) -> bool:
        """This build has the compiled chunked gated delta rule (csrc/gdn_prefill.cpp: every x86 build)."""
        return self.ext is not None and self.ext.gdn_prefill_available()

    def argmax(self, rows: torch.Tensor) -> torch.Tensor:
        """torch.argmax(rows, dim=-1) for logits rows [N, V] (greedy sampling), compiled where it can run: the
        same answer, ties and NaN included (csrc/argmax.cpp)."""
        if self.ext is not None and rows.dtype == torch.float32 and rows.device.type == "cpu" and rows.dim() == 2 \
                and rows.shape[1] > 0 and rows.stride(1) == 1:
            return self.ext.argmax_rows(rows)
        return torch.argmax(rows, dim=-1)

    def _rows(self, x: torch.Tensor) -> bool:
        """x goes to the compiled activations: loaded kernels, a CPU fp32 / bf16 matrix, unit last stride."""
        return (self.ext is not None and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
                and x.dim() == 2 and x.stride(-1) == 1)

    def _fused_norm(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return (self.ext is not None and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
                and weight.dtype == x.dtype and x.stride(-1) == 1)


def tap_major(weight: torch.Tensor) -> torch.Tensor:
    """The conv weight [C, K] as the compiled conv step reads it: [K, C] fp32, made once per weight (and again
    if it is changed in place), kept on the weight itself."""
    cached = getattr(weight, "_ds_tap_major", None)
    if cached is None or cached[0] != weight._version:
        cached = (weight._version, weight.float().t().contiguous())
        weight._ds_tap_major = cached
    return cached[1]


TORCH = DecodeKernels("torch")


def select_decode_kernels(device: torch.device | str, dtype: torch.dtype, mode: str | None = None,
                          isa: str | None = None) -> DecodeKernels:
    """The decode kernels for a model on `device` in `dtype`. mode (default: $DELTASERVE_DECODE_KERNELS, else
    auto): auto = compiled on CPU for fp32 / bf16, torch otherwise or when the build fails (with a warning);
    cpp = compiled or raise; torch = the plain-torch ops. isa: the instruction set (resolve_isa; a set this CPU
    cannot execute is a ValueError in every mode but torch). Logs the choice."""
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
    asked = (isa or os.environ.get(ISA_ENV) or "auto").strip().lower()
    try:
        chosen = resolve_isa(isa)
    except ValueError:
        if mode == "cpp" or asked != "auto":
            raise  # a set named by the user that this CPU cannot run is their error, not a fallback
        log.warning("decode kernels: torch (this CPU has none of the compiled instruction sets %s)", ", ".join(ISAS))
        return TORCH
    try:
        ext = load_extension(chosen)
    except Exception as e:  # noqa: BLE001
        if mode == "cpp":
            raise
        log.warning("decode kernels: torch (compiling the C++ decode kernels failed: %s: %s)",
                    type(e).__name__, str(e).strip().splitlines()[-1] if str(e).strip() else "")
        return TORCH
    log.info("cpu kernels: %s (%s; %s; this CPU runs %s), built or loaded once per process in %.1f s",
             chosen, ISA_WHAT[chosen], "from the CPU's flags" if asked == "auto" else f"--cpu-isa {asked}",
             ", ".join(executable_isas()), _build_seconds.get(chosen, 0.0))
    return DecodeKernels("cpp", ext, chosen)
