"""load_model: a HybridModel from a Hugging Face model directory (config.json + safetensors).

Weight layouts read:
- single file (model.safetensors), sharded (model.safetensors.index.json), or any *.safetensors in the dir;
- qwen3_5_text / qwen3_5_moe_text (Qwen3_5ForCausalLM): model.* and lm_head.weight, GDN projections
  apart (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a);
- the multimodal qwen3_5 / qwen3_5_moe models Qwen publishes: the text model under
  model.language_model.*, the vision encoder under model.visual.* (vision.py: loaded where config.json has
  a vision_config, else skipped with one log line), MTP under mtp.* (skipped unless load_model(mtp=True),
  one log line);
- qwen3_next: GDN projections fused and grouped per key head (in_proj_qkvz, in_proj_ba), un-interleaved
  here as transformers' Qwen3NextGatedDeltaNet.fix_query_key_value_ordering does;
- MoE experts either per expert (experts.{e}.gate_proj/up_proj/down_proj.weight, what save_pretrained
  writes) or fused 3D (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]).

Strict: every tensor is used or deliberately skipped (vision, MTP, a tied lm_head); a missing tensor, an
unknown tensor or a wrong shape raises WeightsError naming it.
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable

import torch

from ..config import ConfigError, ModelConfig, VisionConfig
from . import fused, quant
from .errors import WeightsError
from .ops.fp8 import fuse
from .qwen3_5 import HybridModel, torch_dtype
from .vision import VisionModel

VISION_PREFIXES = ("model.visual.", "visual.")

log = logging.getLogger("deltaserve.model.loader")

FP32_PARAMS = ("A_log", "dt_bias")  # GDN decay parameters stay float32 whatever the weight dtype


# ---- reading ---------------------------------------------------------------------------------------------

class _Weights:
    """Lazy access to the tensors of a model directory; records which ones were used."""

    def __init__(self, path: str):
        from safetensors import safe_open

        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = {k: os.path.join(path, v) for k, v in weight_map.items()}
        else:
            names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
            if not names:
                raise WeightsError(f"no safetensors weights in {path}")
            files = {}
            for n in names:
                with safe_open(os.path.join(path, n), "pt") as f:
                    for k in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                        files[k] = os.path.join(path, n)
        self._files = files
        self._handles: dict[str, object] = {}
        self._open = safe_open
        self.used: set[str] = set()

    def names(self) -> list[str]:
        return list(self._files)

    def get(self, key: str) -> torch.Tensor:
        fname = self._files[key]
        h = self._handles.get(fname)
        if h is None:
            h = self._handles[fname] = self._open(fname, "pt", device="cpu")
        self.used.add(key)
        return h.get_tensor(key)


def _text_key(key: str) -> str | None:
    """The stored tensor key in Qwen3_5ForCausalLM naming, or None for a tensor deltaserve skips."""
    if key.startswith("model.language_model."):
        return "model." + key[len("model.language_model."):]
    return key


def _skip_kind(key: str) -> str | None:
    if key.startswith(("model.visual.", "visual.", "model.vision_tower.")):
        return "vision"
    if key.startswith(("mtp.", "model.mtp.")):
        return "mtp"
    return None


# ---- layout conversions ------------------------------------------------------------------------------------

def unfuse_qkvz(w: torch.Tensor, hk: int, dk: int, hv: int, dv: int) -> tuple[torch.Tensor, ...]:
    """qwen3_next in_proj_qkvz [hk * (2dk + 2 r dv), H] (grouped per key head, r = hv / hk) -> q, k, v, z
    in qwen3_5's row order (q [hk*dk], k [hk*dk], v [hv*dv], z [hv*dv]; value head kh * r + j)."""
    r = hv // hk
    g = w.view(hk, 2 * dk + 2 * r * dv, -1)
    q, k, v, z = torch.split(g, [dk, dk, r * dv, r * dv], dim=1)
    return (q.reshape(hk * dk, -1), k.reshape(hk * dk, -1), v.reshape(hv * dv, -1), z.reshape(hv * dv, -1))


def unfuse_ba(w: torch.Tensor, hk: int, hv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """qwen3_next in_proj_ba [hk * 2r, H] (grouped per key head) -> b [hv, H], a [hv, H]."""
    r = hv // hk
    b, a = torch.split(w.view(hk, 2 * r, -1), [r, r], dim=1)
    return b.reshape(hv, -1), a.reshape(hv, -1)


def fuse_qkvz(q, k, v, z, hk: int, hv: int) -> torch.Tensor:
    """The inverse of unfuse_qkvz (used by tests and make.py)."""
    H = q.shape[-1]
    parts = [x.reshape(hk, -1, H) for x in (q, k, v, z)]
    return torch.cat(parts, dim=1).reshape(-1, H)


def fuse_ba(b, a, hk: int) -> torch.Tensor:
    H = b.shape[-1]
    return torch.cat([b.reshape(hk, -1, H), a.reshape(hk, -1, H)], dim=1).reshape(-1, H)


# ---- the mapping: our parameter <- the stored tensors --------------------------------------------------------

Take = Callable[[str], torch.Tensor]


def _layer_tensors(cfg: ModelConfig, model: HybridModel, i: int, keys: set[str], take: Take,
                   p: str | None = None, o: str | None = None, layer=None) -> dict[str, torch.Tensor]:
    """Layer i's parameters (ours, under o) from the stored tensors (under p); an MTP layer passes its own."""
    p, o = p or f"model.layers.{i}.", o or f"layers.{i}."
    layer = layer if layer is not None else model.layers[i]
    sd = {o + "input_layernorm": take(p + "input_layernorm.weight"),
          o + "post_attention_layernorm": take(p + "post_attention_layernorm.weight")}
    if layer.is_gdn:
        a = p + "linear_attn."
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        if a + "in_proj_qkvz.weight" in keys or cfg.model_type == "qwen3_next":
            if a + "in_proj_qkvz.weight_scale_inv" in keys:  # its per-key-head grouping cuts through 128-row blocks
                raise WeightsError(f"{a}in_proj_qkvz: block-FP8 qwen3_next GDN projections are not supported")
            qw, kw, vw, zw = unfuse_qkvz(take(a + "in_proj_qkvz.weight"), hk, dk, hv, dv)
            bw, aw = unfuse_ba(take(a + "in_proj_ba.weight"), hk, hv)
            parts = [qw, kw, vw, zw, bw, aw]
        else:
            parts = [take(a + n + ".weight") for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")]
        sd[o + "linear_attn.in_proj"] = fuse(parts)
        conv = take(a + "conv1d.weight")
        sd[o + "linear_attn.conv_weight"] = conv.reshape(conv.shape[0], -1)
        sd[o + "linear_attn.A_log"] = take(a + "A_log")
        sd[o + "linear_attn.dt_bias"] = take(a + "dt_bias")
        sd[o + "linear_attn.norm_weight"] = take(a + "norm.weight")
        sd[o + "linear_attn.out_proj"] = take(a + "out_proj.weight")
    else:
        a = p + "self_attn."
        sd[o + "self_attn.qkv_proj"] = fuse([take(a + n + ".weight") for n in ("q_proj", "k_proj", "v_proj")])
        sd[o + "self_attn.q_norm"] = take(a + "q_norm.weight")
        sd[o + "self_attn.k_norm"] = take(a + "k_norm.weight")
        sd[o + "self_attn.o_proj"] = take(a + "o_proj.weight")
    m, om = p + "mlp.", o + "mlp."
    if hasattr(layer.mlp, "router"):
        sd[om + "router"] = take(m + "gate.weight")
        if m + "experts.gate_up_proj" in keys:
            sd[om + "experts_gate_up"] = take(m + "experts.gate_up_proj")
            sd[om + "experts_down"] = take(m + "experts.down_proj")
        else:
            E = cfg.num_experts
            sd[om + "experts_gate_up"] = quant.stack([
                fuse([take(f"{m}experts.{e}.gate_proj.weight"), take(f"{m}experts.{e}.up_proj.weight")])
                for e in range(E)])
            sd[om + "experts_down"] = quant.stack([take(f"{m}experts.{e}.down_proj.weight") for e in range(E)])
        if layer.mlp.has_shared:
            s = m + "shared_expert."
            sd[om + "shared_gate_up"] = fuse([take(s + "gate_proj.weight"), take(s + "up_proj.weight")])
            sd[om + "shared_down"] = take(s + "down_proj.weight")
            sd[om + "shared_gate"] = take(m + "shared_expert_gate.weight")
    else:
        sd[om + "gate_up"] = fuse([take(m + "gate_proj.weight"), take(m + "up_proj.weight")])
        sd[om + "down"] = take(m + "down_proj.weight")
    return sd


def _check_supported(hf: dict) -> None:
    """Features of the config that HybridModel does not implement: a clear error rather than wrong logits."""
    text = hf.get("text_config") or hf
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
        raise ConfigError(f"rope_type {rope_type!r} is not supported (deltaserve implements the default rope)")
    if text.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {text['hidden_act']!r} is not supported (silu only)")
    if text.get("attention_bias", False):
        raise ConfigError("attention_bias=true is not supported")
    if text.get("attn_output_gate", True) is False:
        raise ConfigError("attn_output_gate=false is not supported (Qwen3.5 / Qwen3-Next gate the attention output)")


def _mtp_tensors(cfg: ModelConfig, model: HybridModel, keys: set[str], take: Take) -> dict[str, torch.Tensor]:
    """The MTP layers' parameters (model.mtp, model/mtp.py) from mtp.*."""
    sd = {"mtp.fc": take("mtp.fc.weight"), "mtp.norm": take("mtp.norm.weight"),
          "mtp.pre_fc_norm_embedding": take("mtp.pre_fc_norm_embedding.weight"),
          "mtp.pre_fc_norm_hidden": take("mtp.pre_fc_norm_hidden.weight")}
    for i, layer in enumerate(model.mtp.layers):
        sd.update(_layer_tensors(cfg, model, i, keys, take, f"mtp.layers.{i}.", f"mtp.layers.{i}.", layer))
    return sd


def load_model(path: str, dtype: str = "auto", device: str | torch.device = "cpu",
               prepack: bool | None = None, dequantize: bool = False, quantize_head: str = "none",
               mtp: bool = False) -> HybridModel:
    """A HybridModel from a model directory. dtype: auto (the config's) | bfloat16 | float16 | float32.

    prepack: pack the projection weights once for a faster bf16 GEMM (HybridModel.prepack_linears: the
    compiled linear_bf16, else oneDNN's layout); None = wherever it applies (bf16 on a CPU).
    Block-FP8 models (model/quant.py): the linears stay fp8 for the compiled linear_fp8 (bf16 on a CPU);
    dequantize=True, another dtype or device, or no compiled kernel: dequantized to the model dtype at load.
    quantize_head: "none" | "fp8" (the head quantized to block-FP8 when packed: HybridModel.prepack_linears).
    mtp: load the multi-token-prediction layers too (model.mtp, model/mtp.py: speculative decoding); WeightsError
    where the model has none.
    Raises ConfigError (unsupported model type or feature) or WeightsError (missing / unknown / misshapen tensor).
    """
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise WeightsError(f"no config.json in {path}")
    with open(cfg_path) as f:
        hf = json.load(f)
    cfg = ModelConfig.from_hf(hf)
    _check_supported(hf)
    spec = quant.read_quantization(hf)
    if dtype == "auto":
        dtype = cfg.dtype
    tdtype = torch_dtype(dtype)
    if mtp and not cfg.mtp_num_hidden_layers:
        raise WeightsError(f"model {path} has no multi-token-prediction layers (mtp_num_hidden_layers is 0 in its "
                           "config.json): speculative decoding with method mtp needs them")
    vc = VisionConfig.from_hf(hf)
    weights = _Weights(path)
    vision_keys = {k[len(p):]: k for k in weights.names() for p in VISION_PREFIXES if k.startswith(p)}
    if vc is not None and not vision_keys:
        log.info("config.json has a vision_config but the checkpoint no vision tensors: serving text only")
        vc = None
    with torch.device("meta"):
        model = HybridModel(cfg, tdtype, mtp=mtp)
        if vc is not None:
            model.attach_vision(VisionModel(vc, tdtype))

    skipped: dict[str, int] = {"vision": 0, "mtp": 0}
    by_text: dict[str, str] = {}
    for key in weights.names():
        if vc is not None and key in vision_keys.values():
            continue
        kind = _skip_kind(key)
        if kind == "mtp" and mtp:
            by_text[key[len("model."):] if key.startswith("model.mtp.") else key] = key
            continue
        if kind:
            skipped[kind] += 1
            continue
        by_text[_text_key(key)] = key
    text_keys = set(by_text)

    def take(name: str) -> torch.Tensor:
        if name not in by_text:
            raise WeightsError(f"model {path} is missing tensor {name!r}")
        scale = name + "_scale_inv"  # block-FP8: the weight's scales travel with it (model/quant.py)
        return quant.fp8_take(by_text[name], weights.get(by_text[name]),
                              weights.get(by_text[scale]) if scale in by_text else None, spec, path)

    sd: dict[str, torch.Tensor] = {"embed_tokens": take("model.embed_tokens.weight"), "norm": take("model.norm.weight")}
    if cfg.tie_word_embeddings:
        if "lm_head.weight" in by_text:
            weights.used.add(by_text["lm_head.weight"])
            log.info("tie_word_embeddings: ignoring the model's lm_head.weight (the embedding is the head)")
    else:
        sd["lm_head"] = take("lm_head.weight")
    for i in range(cfg.num_hidden_layers):
        sd.update(_layer_tensors(cfg, model, i, text_keys, take))
    if mtp:
        if "mtp.fc.weight" not in by_text:
            raise WeightsError(f"model {path} stores no mtp.* tensors (its config says {cfg.mtp_num_hidden_layers} "
                               "MTP layer(s)): speculative decoding with method mtp needs them")
        sd.update(_mtp_tensors(cfg, model, text_keys, take))
    if vc is not None:  # the encoder's names are the checkpoint's under model.visual.
        want = {k[len("visual."):] for k in model.state_dict() if k.startswith("visual.")}
        missing, extra = sorted(want - set(vision_keys)), sorted(set(vision_keys) - want)
        if missing or extra:
            raise WeightsError(f"model {path}: vision tensors missing {missing[:5]}, unknown {extra[:5]}")
        for k, stored in vision_keys.items():
            sd["visual." + k] = weights.get(stored)
        log.info("loaded the vision encoder: %d tensors (model.visual.*), %d blocks", len(vision_keys), vc.depth)

    unknown = sorted(by_text[k] for k in text_keys if by_text[k] not in weights.used)
    if unknown:
        more = f" (and {len(unknown) - 10} more)" if len(unknown) > 10 else ""
        raise WeightsError(f"model {path} has tensors deltaserve does not know: {', '.join(unknown[:10])}{more}")
    if skipped["vision"]:
        log.info("skipped %d vision tensors (model.visual.*): deltaserve serves the text model", skipped["vision"])
    if skipped["mtp"]:
        log.info("skipped %d multi-token-prediction tensors (mtp.*): not used", skipped["mtp"])

    expected = {k: v for k, v in model.state_dict().items()}
    fp8 = None  # the compiled fp8 kernel, where the fp8 weights stay fp8
    if spec is not None and not dequantize and tdtype == torch.bfloat16 and torch.device(device).type == "cpu":
        fp8 = quant.fp8_kernel()
    for name, t in sd.items():
        want = expected[name]
        if quant.shape_of(t) != tuple(want.shape):
            raise WeightsError(f"tensor for {name} has shape {quant.shape_of(t)}, config implies {tuple(want.shape)}")
        if fp8 is None:
            t = quant.dequantize(t, tdtype)
        if isinstance(t, torch.Tensor):
            sd[name] = t.to(torch.float32 if name.rsplit(".", 1)[-1] in FP32_PARAMS else tdtype).contiguous()
    if spec is not None:
        log.info("block-FP8 weights: %s", "linears kept in fp8 for the compiled linear_fp8" if fp8 is not None
                 else f"dequantized to {tdtype} at load")
    quant.install(model, {n: t for n, t in sd.items() if not isinstance(t, torch.Tensor)})
    model.load_state_dict({n: t for n, t in sd.items() if isinstance(t, torch.Tensor)}, strict=True, assign=True)
    model.eval()
    model = model.to(device)
    model.select_decode_kernels()  # once, at start-up: compiled CPU decode kernels or plain torch (logged)
    if quantize_head != "none" and (prepack is False or tdtype != torch.bfloat16 or model.device.type != "cpu"):
        raise ConfigError(f"--quantize-head {quantize_head} needs bf16 weights on the CPU, packed (this model: "
                          f"{dtype} on {model.device.type})")
    if prepack is not False and model.prepack_linears(quantize_head):
        log.info("bf16 projections and head packed for %s", f"the compiled linear_bf16 ({model.decode_kernels.isa})"
                 if model.linear_kind == "cpp" else "oneDNN" if model.linear_kind == "onednn" else "F.linear")
    if fused.decode_program(model) is not None:  # built now, not in the first decode step
        log.info("decode-only steps: the whole model in one compiled call (model/fused.py)")
    return model
