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

import dataclasses
import json
import math
import os

import torch
from safetensors.torch import save_file

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
    cfg = ModelConfig.from_hf(hf_config)
    dtype = torch_dtype(cfg.dtype)
    prefix = "model.language_model." if hf_config.get("model_type") in MULTIMODAL_MODEL_TYPES else "model."
    gen = torch.Generator(device="cpu").manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
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
        sd[name] = t.contiguous()
    vc = VisionConfig.from_hf(hf_config)
    if vc is not None:  # drawn after the text model's tensors: those stay what they were without a vision tower
        sd.update(_vision_tensors(vc, gen, dtype))
    return sd


def _vision_tensors(vc: VisionConfig, gen: torch.Generator, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """model.visual.* of a random vision encoder: LayerNorms neutral (1, 0), biases 0, matrices with std
    1/sqrt(fan in) (activations keep their scale through the blocks), the position table std 0.02 and the
    merger's last projection scaled so an image token's embedding is the size of a text token's (std 0.02)."""
    from .vision import VisionModel

    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in VisionModel(vc).state_dict().items()}
    out = {}
    for k, shape in shapes.items():
        if len(shape) == 1:
            t = torch.ones(shape, dtype=dtype) if "norm" in k and k.endswith("weight") else torch.zeros(shape, dtype=dtype)
        else:
            fan_in = math.prod(shape[1:])
            std = 0.02 if k.startswith("pos_embed") else (0.04 if k.startswith("merger.linear_fc2") else 1.0) / math.sqrt(fan_in)
            t = _uniform(gen, shape, std * math.sqrt(3.0), dtype)
        out["model.visual." + k] = t.contiguous()
    return out


# the linears Qwen's -FP8 models quantize (by the last part of the module name); the rest stays in the
# model dtype: embeddings, the head, norms, conv1d, A_log / dt_bias, in_proj_a / in_proj_b (in_proj_ba), the
# MoE router (mlp.gate) and the shared-expert gate
FP8_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_qkvz", "out_proj",
               "gate_proj", "up_proj", "down_proj")
QUANTIZE = ("fp8",)


def quantize_state_dict(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
    """Block-FP8 (ops/fp8.py quantize_fp8) of every FP8_LINEARS weight of the text model: X.weight becomes
    float8_e4m3fn codes beside X.weight_scale_inv (fp32, one per 128 x 128 block). Returns the tensors and the
    quantization_config, whose modules_to_not_convert names every other linear module (as transformers matches
    them), the vision tower (model.visual) as a whole."""

    out: dict[str, torch.Tensor] = {}
    keep: list[str] = ["lm_head"]
    for name, t in sd.items():
        module, _, leaf = name.rpartition(".")
        kind = module.rsplit(".", 1)[-1]
        if leaf == "weight" and t.dim() == 2 and kind in FP8_LINEARS:
            out[name], out[module + ".weight_scale_inv"] = quantize_fp8(t)
            continue
        out[name] = t
        if name.startswith("model.visual.") and "model.visual" not in keep:  # the vision tower stays unquantized
            keep.append("model.visual")
        elif leaf == "weight" and t.dim() == 2 and kind in ("in_proj_a", "in_proj_b", "in_proj_ba", "gate",
                                                          "shared_expert_gate", "embed_tokens"):
            keep.append(module)
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
          "modules_to_not_convert": keep}
    return out, qc




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
    format, quantize_state_dict), with its quantization_config."""

    if quantize not in (None, *QUANTIZE):
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZE)}, not {quantize!r}")
    config = multimodal_form(dict(hf_config))
    config.setdefault("dtype", "bfloat16")
    sd = random_state_dict(config, seed)
    if quantize == "fp8":
        sd, config["quantization_config"] = quantize_state_dict(sd)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    save_file(sd, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
