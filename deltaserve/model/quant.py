"""Quantized models: which quantization_config deltaserve loads, and how its tensors become layer weights.

Supported: Hugging Face block-FP8 (below) and GPTQ-Int4, the format of Qwen's -GPTQ-Int4 models (model/gptq.py:
quant_method "gptq", 4 bits, X.qweight / X.qzeros / X.scales / X.g_idx unpacked into an Int4Weight by gptq_take).

Block-FP8, the format of Qwen's -FP8 models (transformers' FineGrainedFP8Config):

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128], "modules_to_not_convert": [...]}

Each quantized linear X holds X.weight (float8_e4m3fn [N, K]) and X.weight_scale_inv (fp32 or bf16
[ceil(N/128), ceil(K/128)]: weight = codes * scale, block by block); every other tensor is in the model dtype.
modules_to_not_convert follows transformers' matching (a prefix up to a module boundary, a regex with the same
boundary, or a suffix); a tensor quantized in a module the list names is an error. Anything else (another
quant_method, fmt, block size, static activation scales, ue8m0 scales) is refused with a ConfigError that says
what is supported. The loader (loader.py) reads through fp8_take and stacks parts with ops/fp8.py fuse.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..config import ConfigError
from .errors import WeightsError
from .gptq import SUPPORTED as GPTQ_SUPPORTED
from .gptq import GptqSpec, read_gptq, unpack_gptq
from .ops.fp8 import BLOCK, FP8, Fp8Weight, SplitWeight, dequantize_weight, fp8_kernel, is_quantized  # noqa: F401
from .ops.int4 import Int4Weight

FP8_SUPPORTED = ("block-FP8: quant_method 'fp8', fmt 'e4m3', weight_block_size [128, 128], activation_scheme "
                 "'dynamic', weight_scale_inv in fp32 or bf16 (the format of Qwen's -FP8 models)")
SUPPORTED = f"{FP8_SUPPORTED}; or {GPTQ_SUPPORTED}"
_KEYS = {"quant_method", "fmt", "activation_scheme", "weight_block_size", "modules_to_not_convert", "ignored_layers",
         "scale_fmt", "modules_to_convert", "dequantize", "expert_dtype"}


@dataclass(frozen=True)
class Fp8Spec:
    """A model's block-FP8 quantization_config (validated)."""

    not_convert: tuple[str, ...] = ()
    name = "block-FP8"

    def converts(self, module: str) -> bool:
        """transformers' should_convert_module: a pattern matching the module's name from its start up to a module
        boundary, as a regex with that boundary, or as a suffix, keeps it unquantized."""
        boundary = r"(?:(?<=\.)|(?=\.|$))"
        return not any(re.match(rf"(?:{p}){boundary}", module) or module.endswith(p) for p in self.not_convert)


def read_quantization(hf: dict) -> Fp8Spec | GptqSpec | None:
    """The model's quantization (config.json's quantization_config, top level or in text_config): an Fp8Spec, a
    GptqSpec (model/gptq.py read_gptq), or None when it has none. Raises ConfigError naming what is supported for
    anything else."""
    qc = hf.get("quantization_config") or (hf.get("text_config") or {}).get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ConfigError(f"quantization_config must be an object; deltaserve loads {SUPPORTED}")

    def refuse(what: str) -> ConfigError:
        return ConfigError(f"quantization_config: {what} is not supported; deltaserve loads {SUPPORTED}")

    method = qc.get("quant_method")
    if method == "gptq":
        return read_gptq(qc)
    if method != "fp8":
        raise refuse(f"quant_method {method!r}")
    unknown = sorted(set(qc) - _KEYS)
    if unknown:
        raise refuse(f"key {', '.join(map(repr, unknown))}")
    if str(qc.get("fmt", "e4m3")).lower() != "e4m3":
        raise refuse(f"fmt {qc['fmt']!r}")
    if str(qc.get("activation_scheme", "dynamic")).lower() != "dynamic":
        raise refuse(f"activation_scheme {qc['activation_scheme']!r} (static activation scales)")
    if list(qc.get("weight_block_size") or []) != [BLOCK, BLOCK]:
        raise refuse(f"weight_block_size {qc.get('weight_block_size')!r}")
    if qc.get("scale_fmt", "float") != "float":
        raise refuse(f"scale_fmt {qc['scale_fmt']!r}")
    if qc.get("expert_dtype", "fp8") != "fp8":
        raise refuse(f"expert_dtype {qc['expert_dtype']!r}")
    if qc.get("modules_to_convert"):
        raise refuse("modules_to_convert (quantized embeddings)")
    skip = qc.get("modules_to_not_convert", qc.get("ignored_layers")) or []
    if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
        raise ConfigError("quantization_config.modules_to_not_convert must be a list of module names")
    return Fp8Spec(tuple(skip))


def fp8_take(key: str, t: torch.Tensor, scale: torch.Tensor | None, spec: Fp8Spec | None,
             path: str) -> torch.Tensor | Fp8Weight:
    """The stored tensor `key` as the loader hands it on: an Fp8Weight for a quantized linear weight, else t.
    scale: the stored `key`_scale_inv, or None. Raises WeightsError on an inconsistent pair."""

    module = key[:-len(".weight")] if key.endswith(".weight") else key
    if t.dtype != FP8:
        if scale is not None:
            raise WeightsError(f"model {path}: {key} is {t.dtype} but has a weight_scale_inv ({FP8_SUPPORTED})")
        if t.dtype.is_floating_point and t.element_size() == 1:
            raise WeightsError(f"model {path}: {key} is {t.dtype}; deltaserve loads {FP8_SUPPORTED}")
        return t
    if spec is None:
        raise WeightsError(f"model {path}: {key} is float8_e4m3fn but config.json has no quantization_config")
    if not isinstance(spec, Fp8Spec):
        raise WeightsError(f"model {path}: {key} is float8_e4m3fn but config.json's quantization_config is "
                           f"{spec.name}")
    if not key.endswith(".weight") or t.dim() != 2:
        raise WeightsError(f"model {path}: {key} {tuple(t.shape)} is float8; deltaserve loads fp8 only as "
                           "2-D linear weights (X.weight with X.weight_scale_inv; fused 3-D experts are not supported)")
    if scale is None:
        raise WeightsError(f"model {path}: {key} is float8_e4m3fn without {module}.weight_scale_inv")
    if not spec.converts(module):
        raise WeightsError(f"model {path}: {module} is quantized but quantization_config.modules_to_not_convert "
                           "lists it")
    if scale.dtype not in (torch.float32, torch.bfloat16):
        raise WeightsError(f"model {path}: {module}.weight_scale_inv is {scale.dtype}; {FP8_SUPPORTED}")
    try:
        w = Fp8Weight.from_block_scales(t, scale.float(), key)
    except ValueError as e:
        raise WeightsError(f"model {path}: {e}") from None
    nan = ((t.view(torch.uint8) & 0x7F) == 0x7F).sum().item()
    if nan:
        raise WeightsError(f"model {path}: {key} holds {nan} NaN codes")
    return w


GPTQ_PARTS = ("qweight", "qzeros", "scales", "g_idx")


def gptq_take(module: str, stored: dict[str, str], get, spec, path: str) -> Int4Weight | None:
    """A GPTQ-Int4 linear `module` (its stored name) as an Int4Weight, or None where the module holds no .qweight
    (its .weight is read as it is: a bf16 weight is fine wherever it is). stored: tensor name -> its key in the
    checkpoint (present ones only); get(key) reads one (marking it used). Raises WeightsError where the config is
    not GPTQ, the dynamic rules exclude the module, it also holds .weight or a .bias, or a part is missing or
    inconsistent (gptq.unpack_gptq)."""
    if module + ".qweight" not in stored:
        return None
    if not isinstance(spec, GptqSpec):
        raise WeightsError(f"model {path}: {module}.qweight (GPTQ) but config.json's quantization_config is "
                           f"{'absent' if spec is None else spec.name}")
    if not spec.converts(module):
        raise WeightsError(f"model {path}: {module} is quantized (it holds qweight) but quantization_config.dynamic "
                           "excludes it")
    for extra in ("weight", "bias"):
        if module + "." + extra in stored:
            raise WeightsError(f"model {path}: {module} holds qweight and a {extra} ({GPTQ_SUPPORTED})")
    for part in GPTQ_PARTS[:3]:
        if module + "." + part not in stored:
            raise WeightsError(f"model {path}: {module} holds qweight without {module}.{part}")
    t = {p: get(stored[module + "." + p]) if module + "." + p in stored else None for p in GPTQ_PARTS}
    return unpack_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], spec, f"model {path}: {module}")


def stack(parts: list) -> torch.Tensor | list:
    """MoE experts [E, ...]: a stacked tensor, or a list per expert where they are quantized."""
    if any(is_quantized(p) for p in parts):
        return list(parts)
    return torch.stack(parts)


def shape_of(w) -> tuple[int, ...]:
    if isinstance(w, list):
        return (len(w), *shape_of(w[0]))
    return tuple(w.shape)


def dequantize(w, dtype: torch.dtype):
    """A quantized weight (or a list per expert) as a dense tensor in dtype."""
    if isinstance(w, list):
        return torch.stack([dequantize(x, dtype) for x in w])
    return dequantize_weight(w, dtype) if is_quantized(w) else w


def install(model: torch.nn.Module, weights: dict[str, object]) -> None:
    """Replace the model's parameters `weights` (state_dict names) by the quantized objects: they leave the
    state_dict, as prepacked weights do, and the layers reach them by the same attribute."""
    for name, w in weights.items():
        prefix, _, attr = name.rpartition(".")
        mod = model.get_submodule(prefix) if prefix else model
        mod._parameters.pop(attr)
        setattr(mod, attr, w)


def pack(module: torch.nn.Module, fp8_ext, bf16_ext, path: str = "", int4_path: str = "int4") -> int:
    """Pack the quantized weights among module's PACKABLE attributes for the compiled kernels, to run on linear_fp8's
    `path` ("" its default); returns how many."""
    n = 0
    for name in getattr(module, "PACKABLE", ()):
        w = getattr(module, name, None)
        for x in (w if isinstance(w, list) else [w]):
            if isinstance(x, Fp8Weight) and x.packed is None:
                x.pack(fp8_ext, path)
                n += 1
            elif isinstance(x, Int4Weight) and x.packed is None:
                x.pack(fp8_ext, int4_path)
                n += 1
            elif isinstance(x, SplitWeight):
                x.pack(fp8_ext, bf16_ext, path, int4_path)
                n += 1
    return n


def quantized_bytes(model: torch.nn.Module) -> int:
    """Bytes of the quantized weights the model holds (codes + scales, and a SplitWeight's bf16 parts)."""
    from .ops.fp8 import weight_nbytes

    total = 0
    for module in model.modules():
        for name in getattr(module, "PACKABLE", ()):
            w = module.__dict__.get(name)
            for x in (w if isinstance(w, list) else [w]):
                if is_quantized(x):
                    total += weight_nbytes(x)
    return total
