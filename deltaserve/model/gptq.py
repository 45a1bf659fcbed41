"""GPTQ-Int4 checkpoints (the format of Qwen's -GPTQ-Int4 models): reading the quantization_config and unpacking a
quantized linear's tensors into an Int4Weight (ops/int4.py).

    "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": true, "desc_act": false,
                            "checkpoint_format": "gptq",   # optional; "gptq_v2" stores the zeros themselves
                            "dynamic": {"lm_head": {}, "model.language_model.embed_tokens": {},
                                        "-:.*attn.*": {}, "-:.*shared_expert.*": {}, "-:.*mtp.*": {},
                                        "-:.*visual.*": {}}}

A quantized linear X (K inputs, N outputs, group size G) holds, instead of X.weight:

    X.qweight  int32 [K / 8, N]          nibble i (bits 4i..4i+3) of qweight[r, n] is the code of (k = 8r + i, n)
    X.qzeros   int32 [ceil(K / G), N / 8] nibble i of qzeros[g, j] is the zero of output n = 8j + i
    X.scales   fp16 / bf16 [ceil(K / G), N]
    X.g_idx    int32 [K] (optional)      the group of input k; only the trivial k // G is read

    w[k, n] = scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n])

checkpoint_format "gptq" (v1, the default) stores zero - 1 (a symmetric file holds 7 in every zero nibble, so the
zero is 8); "gptq_v2" stores the zero. `dynamic` maps regexes, tried in order with re.match on the module name, to
"-:" (the module stays unquantized) or to overrides of bits / group_size / sym / desc_act (accepted where they
equal the defaults). Which modules are quantized is read from the file: a module is int4 iff it holds .qweight.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..config import ConfigError
from .errors import WeightsError
from .ops.int4 import SUB, Int4Weight, cdiv, whole_row_group

SUPPORTED = ("GPTQ-Int4: quant_method 'gptq', bits 4, group_size a multiple of 32 (or -1: one group per row), "
             "sym true or false, desc_act false (or true with a trivial g_idx), checkpoint_format 'gptq' or "
             "'gptq_v2', int32 packing, no bias, an unquantized lm_head (the format of Qwen's -GPTQ-Int4 models)")
_OVERRIDES = ("bits", "group_size", "sym", "desc_act")
_FORMATS = {"gptq": False, "gptq_v2": True}  # checkpoint_format -> zeros stored as themselves
SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # nibble i at bits 4i..4i+3


@dataclass(frozen=True)
class GptqSpec:
    """A model's GPTQ quantization_config (validated). dynamic: (regex, excluded) in the config's order."""

    bits: int = 4
    group_size: int = 128
    sym: bool = True
    desc_act: bool = False
    v2: bool = False
    dynamic: tuple[tuple[str, bool], ...] = ()
    name = "GPTQ-Int4"

    def converts(self, module: str) -> bool:
        """Whether the dynamic rules leave `module` quantized (vLLM's get_dynamic_override): the first pattern that
        re.match-es the name decides; a "-:" one excludes it, a positive one keeps it quantized (its overrides
        equal the defaults: read_gptq refuses others); none matching: quantized."""
        for pattern, excluded in self.dynamic:
            if re.match(pattern, module):
                return not excluded
        return True


def read_gptq(qc: dict) -> GptqSpec:
    """GptqSpec of a quant_method "gptq" quantization_config; ConfigError naming what is supported otherwise.
    Keys that do not change the tensors' meaning (damp_percent, true_sequential, static_groups, meta, ...) are
    accepted as they are."""

    def refuse(what: str) -> ConfigError:
        return ConfigError(f"quantization_config: {what} is not supported; deltaserve loads {SUPPORTED}")

    if qc.get("quant_method") != "gptq":
        raise refuse(f"quant_method {qc.get('quant_method')!r}")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise refuse(f"bits {bits!r}")
    group = qc.get("group_size", 128)
    if not isinstance(group, int) or isinstance(group, bool) or not (group == -1 or (group > 0 and group % SUB == 0 and (group <= 128 or group % 128 == 0))):
        raise refuse(f"group_size {group!r} (the int4 kernel takes groups of a multiple of 32 k, of 128 above 128)")
    sym, desc_act = qc.get("sym", True), qc.get("desc_act", False)
    if not isinstance(sym, bool) or not isinstance(desc_act, bool):
        raise refuse(f"sym {sym!r} / desc_act {desc_act!r} (booleans)")
    fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
    if fmt not in _FORMATS:
        raise refuse(f"checkpoint_format {fmt!r}")
    if qc.get("is_marlin_format"):
        raise refuse("is_marlin_format (a Marlin-repacked checkpoint)")
    if str(qc.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":
        raise refuse(f"pack_dtype {qc['pack_dtype']!r}")
    if qc.get("lm_head", False) is not False:
        raise refuse("lm_head true (a quantized head; --quantize-head int4 quantizes it at load)")
    for key in ("adapter", "rotation"):
        if qc.get(key):
            raise refuse(f"{key} {qc[key]!r}")
    dynamic = qc.get("dynamic") or {}
    if not isinstance(dynamic, dict):
        raise ConfigError("quantization_config.dynamic must be an object of regex -> overrides")
    defaults = {"bits": 4, "group_size": group, "sym": sym, "desc_act": desc_act}
    rules = []
    for key, overrides in dynamic.items():
        excluded = key.startswith("-:")
        pattern = key[2:] if excluded or key.startswith("+:") else key
        try:
            re.compile(pattern)
        except re.error as e:
            raise ConfigError(f"quantization_config.dynamic: {key!r} is not a regex ({e})") from None
        if not excluded and isinstance(overrides, dict):
            for k, v in overrides.items():
                if k in _OVERRIDES and v != defaults[k]:
                    raise refuse(f"dynamic {key!r} overriding {k} to {v!r} (the config's is {defaults[k]!r})")
                if k not in _OVERRIDES and k not in ("damp_percent", "damp_auto_increment", "mse", "v2",
                                                     "v2_alpha", "static_groups", "true_sequential"):
                    raise refuse(f"dynamic {key!r} override {k!r}")
        rules.append((pattern, excluded))
    return GptqSpec(bits, group, sym, desc_act, _FORMATS[fmt], tuple(rules))


def unpack_nibbles(t: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 t -> its 8 nibbles (uint8, nibble i = bits 4i..4i+3) laid out along `dim` (0: [R, C] -> [8R, C];
    1: [R, C] -> [R, 8C]), nibble i of element j at position 8j + i."""
    if dim == 0:
        n = (t[:, None, :] >> SHIFTS[None, :, None]) & 0xF  # [R, 8, C]
        return n.reshape(-1, t.shape[1]).to(torch.uint8)
    n = (t[:, :, None] >> SHIFTS[None, None, :]) & 0xF  # [R, C, 8]
    return n.reshape(t.shape[0], -1).to(torch.uint8)


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                spec: GptqSpec, name: str) -> Int4Weight:
    """A GPTQ linear's tensors (the module docstring) as an Int4Weight: codes [N, K], zeros [N, G] (v1: the stored
    nibble + 1, 1..16; v2: the nibble), scales [N, G] fp32 (fp16 / bf16 widen exactly). name: the module, for the
    WeightsError raised on an inconsistent set."""

    def bad(what: str) -> WeightsError:
        return WeightsError(f"{name}: {what}")

    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise bad(f"qweight is {qweight.dtype} {tuple(qweight.shape)}; GPTQ-Int4 packs 8 codes per int32, [K / 8, N]")
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    group = spec.group_size if spec.group_size != -1 else whole_row_group(K)  # per-channel: one group per row
    G = cdiv(K, group)
    if qzeros.dtype != torch.int32 or tuple(qzeros.shape) != (G, cdiv(N, 8)) or N % 8:
        raise bad(f"qzeros is {qzeros.dtype} {tuple(qzeros.shape)}; a [{K}, {N}] weight in groups of "
                  f"{spec.group_size} needs int32 [{G}, {N // 8}] (N a multiple of 8)")
    if scales.dtype not in (torch.float16, torch.bfloat16, torch.float32) or tuple(scales.shape) != (G, N):
        raise bad(f"scales is {scales.dtype} {tuple(scales.shape)}; needs fp16 / bf16 [{G}, {N}]")
    if g_idx is not None:
        if tuple(g_idx.shape) != (K,) or g_idx.dtype not in (torch.int32, torch.int64):
            raise bad(f"g_idx is {g_idx.dtype} {tuple(g_idx.shape)}; needs int32 [{K}]")
        if not torch.equal(g_idx.long(), torch.arange(K) // group):
            raise bad(f"g_idx is not k // {group} (act-order, desc_act {str(spec.desc_act).lower()}): the int4 kernel "
                      "takes contiguous groups only; a checkpoint quantized with desc_act true and its columns "
                      "reordered is not supported")
    codes = unpack_nibbles(qweight, 0).t().contiguous()  # [N, K]
    zeros = unpack_nibbles(qzeros, 1).t().contiguous()  # [N, G]
    if not spec.v2:
        zeros += 1  # v1 stores zero - 1
    s = scales.float().t().contiguous()
    if not torch.isfinite(s).all():
        raise bad("scales hold a non-finite value")
    try:
        return Int4Weight(codes, zeros, s, group)
    except ValueError as e:
        raise bad(str(e)) from None


def pack_nibbles(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """The inverse of unpack_nibbles: uint8 values 0..15 -> int32 with 8 per element along dim."""
    c = codes.to(torch.int64)
    if dim == 0:
        c = c.view(-1, 8, c.shape[1]) << SHIFTS.long()[None, :, None]
        packed = c.sum(dim=1)
    else:
        c = c.view(c.shape[0], -1, 8) << SHIFTS.long()[None, None, :]
        packed = c.sum(dim=2)
    return torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)


def quantize_gptq(w: torch.Tensor, group: int = 128) -> dict[str, torch.Tensor]:
    """w [N, K] (K a multiple of 8, N of 8) -> {"qweight", "qzeros", "scales", "g_idx"} in Qwen's GPTQ-Int4 layout:
    symmetric, v1 (every zero nibble 7), fp16 scales. Round to nearest, no calibration: a format test's writer,
    not a quality quantizer. scale = amax * 2 / 15 rounded to fp16 first (0 -> 1), codes from that rounded scale:
    clamp(round(w / scale) + 8, 0, 15)."""
    N, K = w.shape
    assert K % 8 == 0 and N % 8 == 0, w.shape
    G = cdiv(K, group)
    wf = torch.zeros(N, G * group, dtype=torch.float32)
    wf[:, :K] = w.float()
    blocks = wf.view(N, G, group)
    scale = (blocks.abs().amax(dim=2) * 2 / 15).to(torch.float16)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (torch.round(blocks / scale.float()[:, :, None]) + 8).clamp(0, 15).to(torch.uint8)
    codes = codes.view(N, G * group)[:, :K]
    return {"qweight": pack_nibbles(codes.t().contiguous(), 0),
            "qzeros": pack_nibbles(torch.full((G, N), 7, dtype=torch.uint8), 1),
            "scales": scale.t().contiguous(),
            "g_idx": (torch.arange(K, dtype=torch.int32) // group).to(torch.int32)}
