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

import ctypes
import json
import logging
import math
import os
from collections.abc import Callable

import torch

from ..config import ConfigError, ModelConfig, VisionConfig, tied_head_streamed
from ..safetensors_header import read_header
from . import fused, quant
from .errors import WeightsError
from .ops.fp8 import fuse
from .qwen3_5 import HybridModel, torch_dtype
from .vision import VisionModel

VISION_PREFIXES = ("model.visual.", "visual.")

log = logging.getLogger("deltaserve.model.loader")

FP32_PARAMS = ("A_log", "dt_bias")  # GDN decay parameters stay float32 whatever the weight dtype


# ---- reading ---------------------------------------------------------------------------------------------

SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                      "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
                      "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def _read_header(fname: str) -> tuple[dict, int]:
    """(the safetensors header of fname: name -> dtype, shape, data_offsets; where its data starts)."""
    try:
        return read_header(fname)
    except ValueError as e:
        raise WeightsError(str(e)) from None


class _Weights:
    """The tensors of a model directory, each read on demand into memory of its own; records which were used.

    Invariant: nothing of a checkpoint file is mapped into the process. Each tensor is read (pread) into a
    fresh tensor that the caller owns, so once the loader has converted it (fused, packed, quantized) and
    dropped it, no byte of the file stays resident on the process's account; safetensors' own reader would
    hand out views of one private mapping of the whole file, which any surviving view (a norm weight, a tied
    embedding) keeps resident for the life of the model. At any moment the loader holds what it has placed
    plus the tensors of one layer."""

    def __init__(self, path: str):
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            fnames = sorted({os.path.join(path, v) for v in weight_map.values()})
        else:
            fnames = [os.path.join(path, n) for n in sorted(os.listdir(path)) if n.endswith(".safetensors")]
            if not fnames:
                raise WeightsError(f"no safetensors weights in {path}")
        self._index: dict[str, tuple[str, torch.dtype, tuple[int, ...], int, int]] = {}
        for fname in fnames:
            header, base = _read_header(fname)
            for k, info in header.items():
                if os.path.exists(index) and os.path.join(path, weight_map.get(k, "")) != fname:
                    continue  # the index names another shard for it
                dtype = SAFETENSORS_DTYPES.get(info["dtype"])
                if dtype is None:
                    raise WeightsError(f"{fname}: tensor {k} has dtype {info['dtype']}, which deltaserve does not read")
                start, end = info["data_offsets"]
                self._index[k] = (fname, dtype, tuple(info["shape"]), base + start, base + end)
        if os.path.exists(index):
            missing = sorted(set(weight_map) - set(self._index))
            if missing:
                raise WeightsError(f"{index} names tensors its shards do not hold: {', '.join(missing[:5])}")
        self._fds: dict[str, int] = {}
        self.used: set[str] = set()
        self.read_bytes = 0  # read so far

    def names(self) -> list[str]:
        return list(self._index)

    def nbytes(self, key: str) -> int:
        _, _, _, start, end = self._index[key]
        return end - start

    def shape(self, key: str) -> tuple[int, ...]:
        return self._index[key][2]

    def get(self, key: str) -> torch.Tensor:
        """The stored tensor, read into new memory (a tensor no one else references)."""
        return self.get_rows(key)

    def get_rows(self, key: str, r0: int = 0, r1: int | None = None) -> torch.Tensor:
        """Rows r0..r1 (along the first dim; all by default) of the stored tensor, read into new memory."""
        fname, dtype, shape, start, end = self._index[key]
        if r1 is not None or r0:
            row = (end - start) // shape[0] if shape and shape[0] else 0
            r1 = shape[0] if r1 is None else r1
            start, end, shape = start + r0 * row, start + r1 * row, (r1 - r0, *shape[1:])
        n = end - start
        out = torch.empty(n, dtype=torch.uint8)
        fd = self._fds.get(fname)
        if fd is None:
            fd = self._fds[fname] = os.open(fname, os.O_RDONLY)
        done = 0
        while done < n:  # preadv reads at most ~2 GiB per call
            buf = (ctypes.c_ubyte * (n - done)).from_address(out.data_ptr() + done)
            got = os.preadv(fd, [buf], start + done)
            if got <= 0:
                raise WeightsError(f"{fname}: truncated at tensor {key} ({done} of {n} bytes read)")
            done += got
        self.used.add(key)
        self.read_bytes += n
        t = out.view(dtype)
        if math.prod(shape) != t.numel():
            raise WeightsError(f"{fname}: tensor {key} holds {n} bytes, its shape {list(shape)} needs another size")
        return t.reshape(shape)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


# bytes read between trims: each trim hands back the freed pages, which the next groups then fault in afresh
# (a few us per 4 KiB page), so trimming after every layer costs load time; this bounds what the holes add to
# the peak to about this much read (and its conversion copies)
TRIM_EVERY = 512 << 20


def _release_free_heap() -> None:
    """Hand the heap the load freed (a layer's stored tensors and conversion copies) back to the OS, after each
    group. The engine tunes glibc to keep allocations below 1 GiB on the heap and never to trim it
    (runner/platform.py tune_allocator). Each layer's buffers then leave holes that the next layer's
    differently sized ones do not fill, and the resident set grows with the model: 11.7 GB resident for a
    7 GB model on the main thread. malloc_trim returns the free pages wherever they sit (every TRIM_EVERY
    bytes read, and once at the end). A no-op off glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


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
            if a + "in_proj_qkvz.qweight" in keys or a + "in_proj_ba.qweight" in keys:
                raise WeightsError(f"{a}in_proj_qkvz: GPTQ qwen3_next GDN projections are not supported")
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


def load_model(path: str, dtype: str = "auto", device: str | torch.device = "cpu",
               prepack: bool | None = None, dequantize: bool = False, quantize_head: str = "none",
               mtp: bool = False, vision: bool = True, quantize: str = "none") -> HybridModel:
    """A HybridModel from a model directory. dtype: auto (the config's) | bfloat16 | float16 | float32.

    prepack: pack the projection weights once for a faster bf16 GEMM (HybridModel.prepack_linears: the
    compiled linear_bf16, else oneDNN's layout); None = wherever it applies (bf16 on a CPU).
    Block-FP8 models (model/quant.py): the linears stay fp8 for the compiled linear_fp8 (bf16 on a CPU);
    dequantize=True, another dtype or device, or no compiled kernel: dequantized to the model dtype at load.
    GPTQ-Int4 models (model/gptq.py): each module holding .qweight becomes an Int4Weight for the compiled
    linear_int4 (bf16 on a CPU, packed); dequantize=True, another dtype or device, prepack=False or no compiled
    kernel: dequantized to the model dtype at load.
    quantize_head: "none" | "fp8" | "int4" (the head quantized when packed: HybridModel.prepack_linears).
    quantize: "none" | "int4" | "int4-g32": every projection of the text model quantized to int4 as each layer is
    placed (a block-FP8 checkpoint's are dequantized first), run by the compiled linear_int4 (ops/int4.py);
    ConfigError where the model is not bf16 on the CPU, packed.
    mtp: load the multi-token-prediction layers too (model.mtp, model/mtp.py: speculative decoding); WeightsError
    where the model has none.
    vision: load the vision encoder of a multimodal checkpoint (False: images are off, its tensors are skipped
    unread and take no memory).
    Weights are streamed (_load): nothing of the checkpoint's files stays mapped or referenced once it returns.
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
    try:
        return _load(path, cfg, spec, tdtype, torch.device(device), weights, vc, prepack, dequantize, quantize_head,
                     mtp, vision, quantize)
    finally:
        weights.close()


def _load(path: str, cfg: ModelConfig, spec, tdtype: torch.dtype, device: torch.device, weights: _Weights,
          vc: VisionConfig | None, prepack: bool | None, dequantize: bool, quantize_head: str, mtp: bool,
          vision: bool, quantize: str = "none") -> HybridModel:
    """load_model's work, streamed: the model is built on the meta device, then each group of parameters (the
    embedding, each layer, the head, the vision tower) is read, converted to the layout it runs in (fused,
    fp8-kept or dequantized, packed) and placed, before the next group is read. What is held at once beyond the
    placed model is one group's stored tensors and their converted copies (one layer's, or the embedding)."""
    vision_keys = {k[len(p):]: k for k in weights.names() for p in VISION_PREFIXES if k.startswith(p)}
    if vc is not None and not vision_keys:
        log.info("config.json has a vision_config but the checkpoint no vision tensors: serving text only")
        vc = None
    elif vc is not None and not vision:
        log.info("images are off (--limit-mm-per-prompt image=0): the vision encoder is not loaded")
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
    if mtp and "mtp.fc.weight" not in by_text:
        raise WeightsError(f"model {path} stores no mtp.* tensors (its config says {cfg.mtp_num_hidden_layers} "
                           "MTP layer(s)): speculative decoding with method mtp needs them")

    def take(name: str) -> torch.Tensor:
        if name not in by_text:
            module = name[:-len(".weight")] if name.endswith(".weight") else None
            if module is not None and module + ".qweight" in by_text:  # GPTQ: X.qweight, X.qzeros, X.scales, X.g_idx
                if name in ("lm_head.weight", "model.embed_tokens.weight"):
                    raise WeightsError(f"model {path}: {module} is GPTQ-quantized; deltaserve loads a GPTQ model's "
                                       "embedding and head unquantized (--quantize-head int4 quantizes the head)")
                stored = {by_text[k]: by_text[k] for k in (f"{module}.{p}" for p in (*quant.GPTQ_PARTS, "bias"))
                          if k in by_text}
                return quant.gptq_take(by_text[module + ".qweight"][:-len(".qweight")], stored, weights.get, spec,
                                       path)
            raise WeightsError(f"model {path} is missing tensor {name!r}")
        if name.endswith(".weight") and name[:-len("weight")] + "qweight" in by_text:
            raise WeightsError(f"model {path}: {by_text[name]} beside a GPTQ qweight: a module holds one or the other")
        scale = name + "_scale_inv"  # block-FP8: the weight's scales travel with it (model/quant.py)
        return quant.fp8_take(by_text[name], weights.get(by_text[name]),
                              weights.get(by_text[scale]) if scale in by_text else None, spec, path)

    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}  # meta tensors: no memory
    # the compiled quantized linears (fp8 and int4: one module), where the checkpoint's quantized weights stay as
    # they are; None: they are dequantized to the model dtype as each group is placed. GPTQ-Int4 also needs the
    # packing (an unpacked Int4Weight runs the torch reference: bit-exact but far too slow to serve)
    gptq = isinstance(spec, quant.GptqSpec)
    fp8 = None
    if spec is not None and not dequantize and tdtype == torch.bfloat16 and device.type == "cpu" and \
            quantize == "none" and not (gptq and prepack is False):
        fp8 = quant.fp8_kernel()
    placed: set[str] = set()

    def place(sd: dict[str, object]) -> None:
        """Check the group's shapes, convert its tensors to what the model runs (dtype, device; fp8 kept or
        dequantized) and put them in the model; the caller drops sd, the last reference to what was read."""
        quantized = {}
        for name, t in sd.items():
            want = expected.get(name)
            if want is None or name in placed:
                raise WeightsError(f"model {path}: tensor for {name}, which the model does not have or has twice")
            if quant.shape_of(t) != want:
                raise WeightsError(f"tensor for {name} has shape {quant.shape_of(t)}, config implies {want}")
            if fp8 is None:
                t = quant.dequantize(t, tdtype)
            placed.add(name)
            if not isinstance(t, torch.Tensor):
                quantized[name] = t
                continue
            t = t.to(device=device, dtype=torch.float32 if name.rsplit(".", 1)[-1] in FP32_PARAMS else tdtype)
            prefix, _, attr = name.rpartition(".")
            module = model.get_submodule(prefix) if prefix else model
            module._parameters[attr] = torch.nn.Parameter(t.contiguous(), requires_grad=False)
        quant.install(model, quantized)

    place({"norm": take("model.norm.weight")})  # the model's device is its norm's
    model.select_decode_kernels()  # once, at start-up: compiled CPU decode kernels or plain torch (logged)
    for flag, value in (("--quantize-head", quantize_head), ("--quantize", quantize)):
        if value != "none" and (prepack is False or tdtype != torch.bfloat16 or model.device.type != "cpu"):
            raise ConfigError(f"{flag} {value} needs bf16 weights on the CPU, packed (this model: "
                              f"{tdtype} on {model.device.type})".replace("torch.", ""))
    packing = model.packing(quantize_head, quantized=fp8 is not None, quantize=quantize) \
        if prepack is not False else None
    if quantize != "none" and packing is None:  # never serve bf16 weights the user asked to have in int4
        raise ConfigError(f"--quantize {quantize}: this model cannot be packed here (bf16 weights on a CPU are needed)")
    if gptq and packing is None:
        fp8 = None  # nothing would pack the int4 weights: dequantized (place reads fp8 as each group comes)
    # a tied head packed for the compiled linear_bf16 or quantized is the embedding too (HybridModel.embed): it is
    # made at the end from the checkpoint a band of rows at a time (pack_head), never held whole beside its packing
    stored_embed = by_text.get("model.embed_tokens.weight")
    head_rows = None
    if (packing is not None and stored_embed is not None and "model.embed_tokens.weight_scale_inv" not in by_text
            and tied_head_streamed(cfg, quantize_head, compiled_linear=packing.ext is not None)):
        if weights.shape(stored_embed) != expected["embed_tokens"]:
            raise WeightsError(f"tensor for embed_tokens has shape {weights.shape(stored_embed)}, config implies "
                               f"{expected['embed_tokens']}")
        head_rows = lambda r0, r1: weights.get_rows(stored_embed, r0, r1).to(tdtype)  # noqa: E731
        placed.add("embed_tokens")  # by pack_head, from the file
        weights.used.add(stored_embed)
        model.embed_tokens = None  # its meta placeholder: the head will be the embedding
    else:
        place({"embed_tokens": take("model.embed_tokens.weight")})
    if spec is not None:
        kept = "linears kept in fp8 for the compiled linear_fp8" if not gptq else \
            "MLP / expert linears kept in int4 for the compiled linear_int4"
        log.info("%s weights: %s", spec.name, kept if fp8 is not None else f"dequantized to {tdtype} at load")

    trimmed = [0]  # weights.read_bytes at the last trim

    def pack(root: torch.nn.Module) -> None:
        if packing is not None:  # the vision encoder stays bf16 under --quantize (it is the text model's flag)
            for module in root.modules():
                model.pack_module(module, packing._replace(int4_group=0) if root is model.visual else packing)
        if weights.read_bytes - trimmed[0] >= TRIM_EVERY:  # the groups' freed buffers, off the resident set
            _release_free_heap()
            trimmed[0] = weights.read_bytes

    for i in range(cfg.num_hidden_layers):  # one layer read, converted, packed at a time
        place(_layer_tensors(cfg, model, i, text_keys, take))
        pack(model.layers[i])
    if cfg.tie_word_embeddings:
        if "lm_head.weight" in by_text:
            weights.used.add(by_text["lm_head.weight"])
            log.info("tie_word_embeddings: ignoring the model's lm_head.weight (the embedding is the head)")
    else:
        place({"lm_head": take("lm_head.weight")})
    if mtp:
        place({"mtp.fc": take("mtp.fc.weight"), "mtp.norm": take("mtp.norm.weight"),
               "mtp.pre_fc_norm_embedding": take("mtp.pre_fc_norm_embedding.weight"),
               "mtp.pre_fc_norm_hidden": take("mtp.pre_fc_norm_hidden.weight")})
        for i, layer in enumerate(model.mtp.layers):
            place(_layer_tensors(cfg, model, i, text_keys, take, f"mtp.layers.{i}.", f"mtp.layers.{i}.", layer))
        pack(model.mtp)
    if vc is not None:  # the encoder's names are the checkpoint's under model.visual.
        want = {k[len("visual."):] for k in expected if k.startswith("visual.")}
        missing, extra = sorted(want - set(vision_keys)), sorted(set(vision_keys) - want)
        if missing or extra:
            raise WeightsError(f"model {path}: vision tensors missing {missing[:5]}, unknown {extra[:5]}")
        for k, stored in vision_keys.items():
            place({"visual." + k: weights.get(stored)})
        pack(model.visual)
        log.info("loaded the vision encoder: %d tensors (model.visual.*), %d blocks", len(vision_keys), vc.depth)

    unknown = sorted(by_text[k] for k in text_keys if by_text[k] not in weights.used)
    if unknown:
        more = f" (and {len(unknown) - 10} more)" if len(unknown) > 10 else ""
        raise WeightsError(f"model {path} has tensors deltaserve does not know: {', '.join(unknown[:10])}{more}")
    unplaced = sorted(set(expected) - placed)
    if unplaced:  # load_state_dict(strict=True)'s check, for the groups placed one by one
        raise WeightsError(f"model {path}: no tensor for {', '.join(unplaced[:10])}")
    if skipped["vision"]:
        log.info("skipped %d vision tensors (model.visual.*): deltaserve serves the text model", skipped["vision"])
    if skipped["mtp"]:
        log.info("skipped %d multi-token-prediction tensors (mtp.*): not used", skipped["mtp"])

    model.eval()
    model = model.to(device)  # the buffers (the weights are on it already)
    _release_free_heap()
    if packing is not None:
        pack(model)  # anything a group above left unpacked (none today): the state prepack_linears leaves
        model.pack_head(packing, quantize_head, rows=head_rows)
        _release_free_heap()
        log.info("bf16 projections and head packed for %s", f"the compiled linear_bf16 ({model.decode_kernels.isa})"
                 if model.linear_kind == "cpp" else "oneDNN" if model.linear_kind == "onednn" else "F.linear")
    if fused.decode_program(model) is not None:  # built now, not in the first decode step
        log.info("decode-only steps: the whole model in one compiled call (model/fused.py)")
    return model
