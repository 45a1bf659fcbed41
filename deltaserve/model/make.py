"""make_random_model: a model directory of seeded random weights in Hugging Face format (config.json +
model.safetensors).

Same bytes on every machine: values come from torch.rand on a CPU torch.Generator (24-bit integers scaled
by powers of two: no transcendental functions, no fused multiply-adds), then one multiply by a Python
float and a cast, each correctly rounded. GDN decay parameters come from a fixed table of dyadic values.

Initialisation: uniform with std 0.02 for projections and embeddings; conv weights uniform in
+-1/sqrt(kernel) (PyTorch's Conv1d default); zero-centred RMSNorm weights 0 and the gated GDN norm 1
(neutral); A_log in [0, 2.75] (A = exp(A_log) in [1, 15.6]) and dt_bias in [-6.875, -2.25] (softplus(dt_bias)
~ 0.001-0.1, Mamba's dt range), stored float32.
"""
from __future__ import annotations

import ctypes
import dataclasses
import json
import math
import os
import struct

import torch

from ..config import MULTIMODAL_MODEL_TYPES, ModelConfig, VisionConfig
from ..presets import MEDIA_KEYS
from .layers import is_moe_layer
from .ops.fp8 import quantize_fp8
from .qwen3_5 import torch_dtype

STD = 0.02
_DRAW = 1 << 22  # values drawn per torch.rand call (fixed: the stream must not depend on it changing)


def _uniform(gen: torch.Generator, shape: tuple[int, ...], bound: float, dtype: torch.dtype) -> torch.Tensor:
    """Uniform in [-bound, bound), computed in float32 and cast to dtype, deterministic across machines."""
    n = math.prod(shape)
    out = torch.empty(n, dtype=dtype)
    for s in range(0, n, _DRAW):
        u = torch.rand(min(_DRAW, n - s), generator=gen, dtype=torch.float32)
        out[s:s + u.numel()] = ((u * 2.0 - 1.0) * bound).to(dtype)
    return out.reshape(shape)


def _specs(cfg: ModelConfig, prefix: str) -> list[tuple[str, tuple[int, ...], str]]:
    """(tensor name, shape, init) in the Hugging Face format of cfg.model_type."""
    H, V = cfg.hidden_size, cfg.vocab_size
    out = [(prefix + "embed_tokens.weight", (V, H), "normal")]
    for i, kind in enumerate(cfg.layer_types):
        p = f"{prefix}layers.{i}."
        out += [(p + "input_layernorm.weight", (H,), "zeros"), (p + "post_attention_layernorm.weight", (H,), "zeros")]
        if kind == "linear_attention":
            a = p + "linear_attn."
            hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
            dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
            if cfg.model_type == "qwen3_next":
                out += [(a + "in_proj_qkvz.weight", (2 * hk * dk + 2 * hv * dv, H), "normal"),
                        (a + "in_proj_ba.weight", (2 * hv, H), "normal")]
            else:
                out += [(a + "in_proj_qkv.weight", (cfg.conv_dim, H), "normal"),
                        (a + "in_proj_z.weight", (hv * dv, H), "normal"),
                        (a + "in_proj_b.weight", (hv, H), "normal"),
                        (a + "in_proj_a.weight", (hv, H), "normal")]
            out += [(a + "conv1d.weight", (cfg.conv_dim, 1, cfg.linear_conv_kernel_dim), "conv"),
                    (a + "A_log", (hv,), "A_log"), (a + "dt_bias", (hv,), "dt_bias"),
                    (a + "norm.weight", (dv,), "ones"), (a + "out_proj.weight", (H, hv * dv), "normal")]
        else:
            a = p + "self_attn."
            hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
            out += [(a + "q_proj.weight", (2 * hq * d, H), "normal"), (a + "k_proj.weight", (hkv * d, H), "normal"),
                    (a + "v_proj.weight", (hkv * d, H), "normal"), (a + "q_norm.weight", (d,), "zeros"),
                    (a + "k_norm.weight", (d,), "zeros"), (a + "o_proj.weight", (H, hq * d), "normal")]
        m = p + "mlp."
        if is_moe_layer(cfg, i):
            inter = cfg.moe_intermediate_size
            out.append((m + "gate.weight", (cfg.num_experts, H), "normal"))
            for e in range(cfg.num_experts):
                out += [(f"{m}experts.{e}.gate_proj.weight", (inter, H), "normal"),
                        (f"{m}experts.{e}.up_proj.weight", (inter, H), "normal"),
                        (f"{m}experts.{e}.down_proj.weight", (H, inter), "normal")]
            if cfg.shared_expert_intermediate_size:
                si = cfg.shared_expert_intermediate_size
                out += [(m + "shared_expert.gate_proj.weight", (si, H), "normal"),
                        (m + "shared_expert.up_proj.weight", (si, H), "normal"),
                        (m + "shared_expert.down_proj.weight", (H, si), "normal"),
                        (m + "shared_expert_gate.weight", (1, H), "normal")]
        else:
            out += [(m + "gate_proj.weight", (cfg.intermediate_size, H), "normal"),
                    (m + "up_proj.weight", (cfg.intermediate_size, H), "normal"),
                    (m + "down_proj.weight", (H, cfg.intermediate_size), "normal")]
    out.append((prefix + "norm.weight", (H,), "zeros"))
    if not cfg.tie_word_embeddings:
        out.append(("lm_head.weight", (V, H), "normal"))
    return out + _mtp_specs(cfg, prefix)


def _mtp_specs(cfg: ModelConfig, prefix: str) -> list[tuple[str, tuple[int, ...], str]]:
    """The MTP layers (mtp.*, model/mtp.py), last: a preset that gains them keeps every other tensor's values. Each
    is a full-attention decoder layer stored under mtp.layers.{i} with the model's MLP kind."""
    if not cfg.mtp_num_hidden_layers:
        return []
    H = cfg.hidden_size
    out = [("mtp.fc.weight", (H, 2 * H), "normal"), ("mtp.pre_fc_norm_embedding.weight", (H,), "zeros"),
           ("mtp.pre_fc_norm_hidden.weight", (H,), "zeros")]
    n = cfg.num_hidden_layers
    for i in range(cfg.mtp_num_hidden_layers):
        as_layer = dataclasses.replace(cfg, num_hidden_layers=n + i + 1, mtp_num_hidden_layers=0,
                                       layer_types=tuple(["linear_attention"] * (n + i)) + ("full_attention",))
        layer = [(name.replace(f"{prefix}layers.{n + i}.", f"mtp.layers.{i}."), shape, init)
                 for name, shape, init in _specs(as_layer, prefix) if name.startswith(f"{prefix}layers.{n + i}.")]
        out += layer
    out.append(("mtp.norm.weight", (H,), "zeros"))
    return out


def random_state_dict(hf_config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """The tensors (Hugging Face names, config dtype; A_log / dt_bias float32) of a random model."""
    return dict(_random_tensors(hf_config, seed))


def _random_tensors(hf_config: dict, seed: int = 0):
    """random_state_dict's tensors one at a time, in their order (the generator's): (name, tensor)."""
    cfg = ModelConfig.from_hf(hf_config)
    dtype = torch_dtype(cfg.dtype)
    prefix = "model.language_model." if hf_config.get("model_type") in MULTIMODAL_MODEL_TYPES else "model."
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, shape, init in _specs(cfg, prefix):
        if init == "normal":
            t = _uniform(gen, shape, STD * math.sqrt(3.0), dtype)
        elif init == "conv":
            t = _uniform(gen, shape, 1.0 / math.sqrt(cfg.linear_conv_kernel_dim), dtype)
        elif init == "zeros":
            t = torch.zeros(shape, dtype=dtype)
        elif init == "ones":
            t = torch.ones(shape, dtype=dtype)
        elif init == "A_log":  # k/8 for k in 0..22: A in [1, 15.6]
            t = torch.tensor([((h * 7) % 23) / 8.0 for h in range(shape[0])], dtype=torch.float32)
        elif init == "dt_bias":  # -2.25 - k/8 for k in 0..37
            t = torch.tensor([-2.25 - ((h * 5) % 38) / 8.0 for h in range(shape[0])], dtype=torch.float32)
        else:  # pragma: no cover
            raise AssertionError(init)
        yield name, t.contiguous()
    vc = VisionConfig.from_hf(hf_config)
    if vc is not None:  # drawn after the text model's tensors: those stay what they were without a vision tower
        yield from _vision_tensors(vc, gen, dtype)


def _tensor_layout(hf_config: dict) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of each tensor _random_tensors yields, in its order, without drawing any."""
    cfg = ModelConfig.from_hf(hf_config)
    dtype = torch_dtype(cfg.dtype)
    prefix = "model.language_model." if hf_config.get("model_type") in MULTIMODAL_MODEL_TYPES else "model."
    out = [(name, shape, torch.float32 if init in ("A_log", "dt_bias") else dtype)
           for name, shape, init in _specs(cfg, prefix)]
    vc = VisionConfig.from_hf(hf_config)
    if vc is not None:
        out += [("model.visual." + k, shape, dtype) for k, shape in _vision_shapes(vc).items()]
    return out


def _vision_shapes(vc: VisionConfig) -> dict[str, tuple[int, ...]]:
    from .vision import VisionModel

    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in VisionModel(vc).state_dict().items()}


def _vision_tensors(vc: VisionConfig, gen: torch.Generator, dtype: torch.dtype):
    """model.visual.* of a random vision encoder: LayerNorms neutral (1, 0), biases 0, matrices with std
    1/sqrt(fan in) (activations keep their scale through the blocks), the position table std 0.02 and the
    merger's last projection scaled so an image token's embedding is the size of a text token's (std 0.02)."""
    for k, shape in _vision_shapes(vc).items():
        if len(shape) == 1:
            t = torch.ones(shape, dtype=dtype) if "norm" in k and k.endswith("weight") else torch.zeros(shape, dtype=dtype)
        else:
            fan_in = math.prod(shape[1:])
            std = 0.02 if k.startswith("pos_embed") else (0.04 if k.startswith("merger.linear_fc2") else 1.0) / math.sqrt(fan_in)
            t = _uniform(gen, shape, std * math.sqrt(3.0), dtype)
        yield "model.visual." + k, t.contiguous()


# the linears Qwen's -FP8 models quantize (by the last part of the module name); the rest stays in the
# model dtype: embeddings, the head, norms, conv1d, A_log / dt_bias, in_proj_a / in_proj_b (in_proj_ba), the
# MoE router (mlp.gate) and the shared-expert gate
FP8_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_qkvz", "out_proj",
               "gate_proj", "up_proj", "down_proj")
QUANTIZE = ("fp8", "gptq-int4")
# the linears Qwen's -GPTQ-Int4 models quantize: the dense MLP's and the routed experts' (the shared expert, every
# attention and GDN projection, the MTP layer and the vision tower stay bf16: GPTQ_DYNAMIC's exclusions)
GPTQ_LINEARS = ("gate_proj", "up_proj", "down_proj")
GPTQ_GROUP = 128


def _fp8_module(name: str, shape: tuple[int, ...]) -> str | None:
    """The module whose weight `name` block-FP8 quantizes (None: the tensor stays as it is)."""
    module, _, leaf = name.rpartition(".")
    return module if leaf == "weight" and len(shape) == 2 and module.rsplit(".", 1)[-1] in FP8_LINEARS else None


def _not_converted(names: list[tuple[str, tuple[int, ...]]]) -> list[str]:
    """modules_to_not_convert for a model of these (name, shape) tensors: every other linear module (as
    transformers matches them), the vision tower (model.visual) as a whole."""
    keep: list[str] = ["lm_head"]
    for name, shape in names:
        module, _, leaf = name.rpartition(".")
        kind = module.rsplit(".", 1)[-1]
        if _fp8_module(name, shape) is not None:
            continue
        if name.startswith("model.visual.") and "model.visual" not in keep:  # the vision tower stays unquantized
            keep.append("model.visual")
        elif leaf == "weight" and len(shape) == 2 and kind in ("in_proj_a", "in_proj_b", "in_proj_ba", "gate",
                                                              "shared_expert_gate", "embed_tokens"):
            keep.append(module)
    return keep


def _fp8_config(keep: list[str]) -> dict:
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
            "modules_to_not_convert": keep}


def quantize_state_dict(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
    """Block-FP8 (ops/fp8.py quantize_fp8) of every FP8_LINEARS weight of the text model: X.weight becomes
    float8_e4m3fn codes beside X.weight_scale_inv (fp32, one per 128 x 128 block). Returns the tensors and the
    quantization_config, whose modules_to_not_convert names every other linear module (as transformers matches
    them), the vision tower (model.visual) as a whole."""

    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        module = _fp8_module(name, tuple(t.shape))
        if module is not None:
            out[name], out[module + ".weight_scale_inv"] = quantize_fp8(t)
        else:
            out[name] = t
    return out, _fp8_config(_not_converted([(n, tuple(t.shape)) for n, t in sd.items()]))


def gptq_config(prefix: str) -> dict:
    """Qwen's -GPTQ-Int4 quantization_config, its `dynamic` map in its order (the first matching rule decides);
    prefix: the text model's ("model.language_model." in a multimodal checkpoint)."""
    return {"quant_method": "gptq", "bits": 4, "group_size": GPTQ_GROUP, "sym": True, "desc_act": False,
            "dynamic": {"lm_head": {}, prefix + "embed_tokens": {}, "-:.*attn.*": {}, "-:.*shared_expert.*": {},
                        "-:.*mtp.*": {}, "-:.*visual.*": {}}}


def _gptq_module(name: str, shape: tuple[int, ...], spec) -> str | None:
    """The module whose weight `name` GPTQ-Int4 quantizes (None: the tensor stays as it is)."""
    module, _, leaf = name.rpartition(".")
    if leaf != "weight" or len(shape) != 2 or module.rsplit(".", 1)[-1] not in GPTQ_LINEARS:
        return None
    return module if spec.converts(module) else None


def _gptq_layout(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    module = name[:-len(".weight")]
    N, K = shape
    G = -(-K // GPTQ_GROUP)
    return [(module + ".qweight", (K // 8, N), torch.int32), (module + ".qzeros", (G, N // 8), torch.int32),
            (module + ".scales", (G, N), torch.float16), (module + ".g_idx", (K,), torch.int32)]


def _gptq_quantized(tensors, spec):
    """The GPTQ-Int4 writer on a stream of (name, tensor): gptq.quantize_gptq (round to nearest, symmetric, fp16
    scales, v1 zeros) of each _gptq_module weight, in _gptq_layout's order."""
    from .gptq import quantize_gptq

    for name, t in tensors:
        if _gptq_module(name, tuple(t.shape), spec) is None:
            yield name, t
        else:
            q = quantize_gptq(t, GPTQ_GROUP)
            for key, _, _ in _gptq_layout(name, tuple(t.shape)):
                yield key, q[key.rpartition(".")[2]]


def _sorted_config(obj, key: str = ""):
    """The config with its keys sorted (as json's sort_keys), except a GPTQ `dynamic` map, whose order is its
    meaning."""
    if isinstance(obj, list):
        return [_sorted_config(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    items = obj.items() if key == "dynamic" else sorted(obj.items())
    return {k: _sorted_config(v, k) for k, v in items}


_ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3",
              torch.int32: "I32"}


def _write_safetensors(path: str, layout: list[tuple[str, tuple[int, ...], torch.dtype]], tensors,
                       metadata: dict[str, str]) -> None:
    """A safetensors file of the tensors `layout` announces ((name, shape, dtype), in order), drawn from the
    iterable `tensors` ((name, tensor) in the same order) and written as each comes: what is held at once is one
    tensor, not the model."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, shape, dtype in layout:
        n = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    tmp = path + ".partial"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        it = iter(tensors)
        for name, shape, dtype in layout:
            got, t = next(it)
            if got != name or tuple(t.shape) != tuple(shape) or t.dtype != dtype:  # pragma: no cover - a bug here
                raise AssertionError(f"{got} {tuple(t.shape)} {t.dtype} where the header has {name} {shape} {dtype}")
            t = t.contiguous()
            if t.numel():
                f.write((ctypes.c_ubyte * (t.numel() * t.element_size())).from_address(t.data_ptr()))
    os.replace(tmp, path)


def multimodal_form(cfg: dict) -> dict:
    """A text config with a vision_config beside it (a preset's form) as the multimodal config.json
    transformers' Qwen3_5ForConditionalGeneration reads: text_config, vision_config and the token ids at the
    top. Anything else is returned as it is."""
    mt = cfg.get("model_type")
    if "vision_config" not in cfg or mt not in MULTIMODAL_MODEL_TYPES.values():
        return cfg
    text = {k: v for k, v in cfg.items() if k not in MEDIA_KEYS}
    top = {v: k for k, v in MULTIMODAL_MODEL_TYPES.items()}[mt]
    arch = "Qwen3_5MoeForConditionalGeneration" if top == "qwen3_5_moe" else "Qwen3_5ForConditionalGeneration"
    out = {k: cfg[k] for k in MEDIA_KEYS if k in cfg}
    out.update(model_type=top, architectures=[arch], text_config=text,
               tie_word_embeddings=text.get("tie_word_embeddings", False))
    if "dtype" in text:
        out["dtype"] = text["dtype"]
    return out


def make_random_model(hf_config: dict, out_dir: str, seed: int = 0, quantize: str | None = None) -> None:
    """Write config.json and model.safetensors (seeded random weights) to out_dir, in the Hugging Face format
    of hf_config's model_type (qwen3_5_text, qwen3_5_moe_text, qwen3_next, or the text part of qwen3_5 /
    qwen3_5_moe under model.language_model.*). quantize="fp8": the same weights in block-FP8 (Qwen's -FP8
    format, quantize_state_dict), with its quantization_config. quantize="gptq-int4": Qwen's -GPTQ-Int4 layout
    (the dense MLP's and routed experts' gate / up / down as qweight, qzeros, fp16 scales and g_idx, symmetric,
    groups of 128, v1 zeros; everything else bf16) by round to nearest: a test of the format, not a quality
    quantizer (no calibration)."""

    if quantize not in (None, *QUANTIZE):
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZE)}, not {quantize!r}")
    config = multimodal_form(dict(hf_config))
    config.setdefault("dtype", "bfloat16")
    layout = _tensor_layout(config)
    tensors = _random_tensors(config, seed)
    if quantize == "fp8":
        config["quantization_config"] = _fp8_config(_not_converted([(n, s) for n, s, _ in layout]))
        quantized = []
        for name, shape, dtype in layout:
            module = _fp8_module(name, shape)
            if module is None:
                quantized.append((name, shape, dtype))
            else:
                quantized += [(name, shape, torch.float8_e4m3fn),
                              (module + ".weight_scale_inv", (-(-shape[0] // 128), -(-shape[1] // 128)), torch.float32)]
        layout, tensors = quantized, _quantized(tensors)
    elif quantize == "gptq-int4":
        from .gptq import read_gptq

        prefix = "model.language_model." if config.get("model_type") in MULTIMODAL_MODEL_TYPES else "model."
        config["quantization_config"] = gptq_config(prefix)
        spec = read_gptq(config["quantization_config"])
        layout = [x for name, shape, dtype in layout for x in
                  ([(name, shape, dtype)] if _gptq_module(name, shape, spec) is None else _gptq_layout(name, shape))]
        tensors = _gptq_quantized(tensors, spec)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(_sorted_config(config), f, indent=2)
        f.write("\n")
    # streamed, one tensor at a time: a model larger than half the machine's memory can be made
    _write_safetensors(os.path.join(out_dir, "model.safetensors"), layout, tensors, {"format": "pt"})


def _quantized(tensors):
    """quantize_state_dict's rule on a stream of (name, tensor)."""
    for name, t in tensors:
        module = _fp8_module(name, tuple(t.shape))
        if module is None:
            yield name, t
        else:
            q, scale = quantize_fp8(t)
            yield name, q
            yield module + ".weight_scale_inv", scale
