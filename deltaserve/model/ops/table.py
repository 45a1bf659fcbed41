"""Ops: every op a forward calls, as one table of plain functions, chosen once per model.

The layers call ops only through the step context's table (`ctx.ops.linear(h, w)`), never through module
globals, so whoever runs a forward can hand it another table: the profiler passes `ops.wrapped(timer)`, a
copy whose every entry records its own time, and the model is never patched. A new op is a new field here;
the profiler refuses a table with an op it has no kernel name for (profile/instrument.py, Instrument._rules),
so no op's time can silently land in its caller's.

Each entry has the signature of the function it names (ops/attention.py, conv.py, gdn.py, norm.py, mlp.py,
pointwise.py, linear.py); the activations and norms are DecodeKernels' methods (compiled for every row where
the kernels are loaded, else those torch functions); the decode kernels are DecodeKernels' methods
(cpu_kernels.py), None where the compiled kernels are not loaded (the layers then take the torch path).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable

from .attention import decode_attention, kv_gather, kv_write, prefill_attention
from .conv import causal_conv1d_prefill, causal_conv1d_step
from .cpu_kernels import TORCH, DecodeKernels
from .gdn import chunk_gated_delta_rule, recurrent_gated_delta_rule_step
from .linear import linear
from .mlp import moe, swiglu


@dataclass(frozen=True)
class Ops:
    linear: Callable
    rms_norm: Callable  # (x, w, eps): the layer norms, q/k norms and the final norm
    add_rms_norm: Callable  # (x, h, w, eps) -> (x + h, norm)
    rms_norm_gated: Callable  # (x [T, Hv, dv], z [T, Hv*dv], w, eps) -> [T, Hv*dv]: the GDN output norm
    gdn_gates: Callable  # (b, a [T, Hv], dt_bias, neg_decay) -> (g fp32, beta)
    swiglu: Callable
    moe: Callable
    qk_norm_rope: Callable  # (x [T, H, D], w, eps, cos, sin): rotary(rms_norm(x)) for q or k
    gate_output: Callable  # (o, gate [T, N]) -> o * sigmoid(gate)
    kv_write: Callable
    kv_gather: Callable
    prefill_attention: Callable
    decode_attention: Callable  # torch: one sequence over its gathered K/V
    causal_conv1d_prefill: Callable
    chunk_gated_delta_rule: Callable
    causal_conv1d_step: Callable  # torch decode path
    recurrent_gated_delta_rule_step: Callable  # torch decode path
    paged_decode_attention: Callable | None  # compiled: every decode sequence of a step in one call
    conv1d_decode_step: Callable | None
    gdn_decode_step: Callable | None

    @classmethod
    def for_kernels(cls, kernels: DecodeKernels = TORCH) -> "Ops":
        compiled = kernels.compiled
        return cls(linear=linear, rms_norm=kernels.rms_norm, add_rms_norm=kernels.add_rms_norm,
                   rms_norm_gated=kernels.rms_norm_gated, gdn_gates=kernels.gdn_gates,
                   swiglu=functools.partial(swiglu, act=kernels.silu_mul), moe=moe,
                   qk_norm_rope=kernels.qk_norm_rope, gate_output=kernels.gate_output,
                   kv_write=kv_write, kv_gather=kv_gather,
                   prefill_attention=kernels.prefill_attention if compiled else prefill_attention,
                   decode_attention=decode_attention,
                   causal_conv1d_prefill=kernels.conv_prefill if compiled else causal_conv1d_prefill,
                   chunk_gated_delta_rule=(kernels.chunk_gated_delta_rule if compiled
                                           else chunk_gated_delta_rule),
                   causal_conv1d_step=causal_conv1d_step,
                   recurrent_gated_delta_rule_step=recurrent_gated_delta_rule_step,
                   paged_decode_attention=kernels.attention if compiled else None,
                   conv1d_decode_step=kernels.conv_step if compiled else None,
                   gdn_decode_step=kernels.gdn_step if compiled else None)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def wrapped(self, wrap: Callable[[str, Callable], Callable]) -> "Ops":
        """A copy whose every op is wrap(name, op) (entries that are None stay None)."""
        return dataclasses.replace(self, **{n: wrap(n, getattr(self, n)) for n in self.names()
                                            if getattr(self, n) is not None})
