"""Frozen configuration: the model's geometry (from a Hugging Face config.json) and the engine's flags.

No torch here: the planner, the scheduler and the simulator read these too.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from .errors import ConfigError

# --cache-layout's choices, the default first; memory/layouts.py holds a class for each
LAYOUT_NAMES = ("runs", "in-page", "per-block")
MODEL_DTYPES = ("bfloat16", "float16", "float32")  # what the model runs in


def resolve_dtype(requested: str, mc: "ModelConfig") -> str:
    """--dtype auto = the model's dtype; anything the engine cannot run falls back to bfloat16."""
    d = mc.dtype if requested == "auto" else requested
    return d if d in MODEL_DTYPES else "bfloat16"

SUPPORTED_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
MULTIMODAL_MODEL_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
MODEL_DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")  # --dtype
EVICTIONS = ("lru", "value")  # --eviction: memory/eviction.py EVICTION_POLICIES
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class ModelConfig:
    """The text model's geometry. Built by from_hf(); field names follow transformers' configs."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]  # "linear_attention" (GDN) or "full_attention"
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    intermediate_size: int = 0  # dense MLP; 0 on MoE-only models
    # MoE (qwen3_5_moe_text, qwen3_next); num_experts == 0 means dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    dtype: str = "bfloat16"  # the model's weight dtype
    mamba_ssm_dtype: str | None = None  # the recurrent state dtype the config declares, if any
    eos_token_id: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    mtp_num_hidden_layers: int = 0  # the multi-token-prediction layers the checkpoint carries (mtp.*)

    # ---- derived geometry ----
    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def attn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def conv_dim(self) -> int:
        """Channels of the GDN causal conv: q, k (key heads) and v (value heads)."""
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, i: int) -> bool:
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % max(self.decoder_sparse_step, 1) == 0)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """From a config.json dict. The multimodal qwen3_5 / qwen3_5_moe configs give their text_config."""
        model_type = hf.get("model_type")
        if model_type in MULTIMODAL_MODEL_TYPES:
            text = dict(hf.get("text_config") or {})
            text.setdefault("model_type", MULTIMODAL_MODEL_TYPES[model_type])
            for k in ("tie_word_embeddings", "dtype", "torch_dtype", "eos_token_id"):
                if k in hf and k not in text:
                    text[k] = hf[k]
            if "tie_word_embeddings" in hf:  # the multimodal model ties (or not) by its own flag, not the text's
                text["tie_word_embeddings"] = hf["tie_word_embeddings"]
            hf, model_type = text, text["model_type"]
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {model_type!r}; deltaserve serves "
                f"{', '.join(SUPPORTED_MODEL_TYPES + tuple(MULTIMODAL_MODEL_TYPES))}")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        prf = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        n = int(hf["num_hidden_layers"])
        layer_types = hf.get("layer_types")
        if layer_types is None:
            interval = int(hf.get("full_attention_interval", 4))
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
        if len(layer_types) != n:
            raise ConfigError(f"layer_types has {len(layer_types)} entries for {n} layers")
        bad = set(layer_types) - {"linear_attention", "full_attention"}
        if bad:
            raise ConfigError(f"unknown layer types {sorted(bad)}")
        eos = hf.get("eos_token_id")
        eos = () if eos is None else (tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),))
        dtype = hf.get("dtype") or hf.get("torch_dtype") or "bfloat16"
        return cls(
            model_type=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            num_hidden_layers=n,
            layer_types=tuple(layer_types),
            num_attention_heads=int(hf["num_attention_heads"]),
            num_key_value_heads=int(hf["num_key_value_heads"]),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            partial_rotary_factor=float(prf),
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            linear_conv_kernel_dim=int(hf["linear_conv_kernel_dim"]),
            linear_key_head_dim=int(hf["linear_key_head_dim"]),
            linear_value_head_dim=int(hf["linear_value_head_dim"]),
            linear_num_key_heads=int(hf["linear_num_key_heads"]),
            linear_num_value_heads=int(hf["linear_num_value_heads"]),
            intermediate_size=int(hf.get("intermediate_size") or 0),
            num_experts=int(hf.get("num_experts") or 0),
            num_experts_per_tok=int(hf.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(hf.get("moe_intermediate_size") or 0),
            shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0),
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            decoder_sparse_step=int(hf.get("decoder_sparse_step", 1) or 1),
            mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
            dtype=str(dtype).replace("torch.", ""),
            mamba_ssm_dtype=hf.get("mamba_ssm_dtype"),
            eos_token_id=eos,
            bos_token_id=hf.get("bos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
            mtp_num_hidden_layers=int(hf.get("mtp_num_hidden_layers") or hf.get("num_nextn_predict_layers") or 0),
        )

    @classmethod
    def from_path(cls, path: str) -> "ModelConfig":
        """A model directory or a config.json file."""
        f = os.path.join(path, "config.json") if os.path.isdir(path) else path
        with open(f) as fh:
            return cls.from_hf(json.load(fh))


class VisionConfigIncomplete(ConfigError):
    """A vision_config without a field the encoder's geometry needs (`missing`: their names, in order)."""

    def __init__(self, missing: list[str]):
        self.missing = list(missing)
        super().__init__(f"vision_config lacks {', '.join(self.missing)} (the vision encoder's geometry needs "
                         f"{', '.join(VISION_REQUIRED)})")


VISION_REQUIRED = ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size")


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower of a multimodal Qwen3.5 checkpoint (config.json's vision_config, transformers'
    Qwen3_5VisionConfig) and the token ids the text side marks images with. None on a text-only model."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    num_position_embeddings: int = 2304
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    image_token_id: int = 248056
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054
    mrope_section: tuple[int, ...] = (11, 11, 10)  # the text model's rotary halves per axis (t, h, w)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merge_unit(self) -> int:
        """Patches per merged token (one LLM token per merge_unit patches)."""
        return self.spatial_merge_size ** 2

    def num_params(self) -> int:
        """Weights of the encoder (the planner counts them): patch embed, position table, blocks, merger."""
        e, i, m = self.hidden_size, self.intermediate_size, self.hidden_size * self.merge_unit
        patch = e * self.in_channels * self.temporal_patch_size * self.patch_size ** 2 + e
        block = 4 * e + (3 * e * e + 3 * e) + (e * e + e) + (e * i + i) + (i * e + e)
        merger = 2 * e + (m * m + m) + (m * self.out_hidden_size + self.out_hidden_size)
        return patch + self.num_position_embeddings * e + self.depth * block + merger

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "VisionConfig | None":
        """From a multimodal config.json dict (qwen3_5 / qwen3_5_moe with a vision_config); None otherwise.
        ConfigError for what the encoder does not implement (deepstack features, non-interleaved M-RoPE);
        VisionConfigIncomplete (a ConfigError) naming the geometry fields the vision_config lacks."""
        v = hf.get("vision_config")
        if not v or hf.get("model_type") not in (*MULTIMODAL_MODEL_TYPES, *MULTIMODAL_MODEL_TYPES.values()):
            return None  # a text config with a vision_config beside it is a preset's form (make.py multimodal_form)
        if v.get("deepstack_visual_indexes"):
            raise ConfigError("vision_config.deepstack_visual_indexes is not supported (Qwen3.5 has none)")
        text = hf.get("text_config") or (hf if hf.get("model_type") in MULTIMODAL_MODEL_TYPES.values() else {})
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        if rope.get("mrope_interleaved") is False:
            raise ConfigError("mrope_interleaved=false is not supported (Qwen3.5 interleaves its M-RoPE sections)")
        missing = [k for k in VISION_REQUIRED if v.get(k) is None]
        if missing:
            raise VisionConfigIncomplete(missing)
        vrope = v.get("rope_parameters") or {}
        return cls(depth=int(v["depth"]), hidden_size=int(v["hidden_size"]),
                   intermediate_size=int(v["intermediate_size"]), num_heads=int(v["num_heads"]),
                   out_hidden_size=int(v["out_hidden_size"]), in_channels=int(v.get("in_channels", 3)),
                   patch_size=int(v.get("patch_size", 16)), temporal_patch_size=int(v.get("temporal_patch_size", 2)),
                   spatial_merge_size=int(v.get("spatial_merge_size", 2)),
                   num_position_embeddings=int(v.get("num_position_embeddings", 2304)),
                   hidden_act=str(v.get("hidden_act", "gelu_pytorch_tanh")),
                   rope_theta=float(vrope.get("rope_theta", 10000.0)),
                   image_token_id=int(hf.get("image_token_id", 248056)),
                   vision_start_token_id=int(hf.get("vision_start_token_id", 248053)),
                   vision_end_token_id=int(hf.get("vision_end_token_id", 248054)),
                   mrope_section=tuple(int(x) for x in rope.get("mrope_section", (11, 11, 10))))

    @classmethod
    def from_path(cls, path: str) -> "VisionConfig | None":
        f = os.path.join(path, "config.json") if os.path.isdir(path) else path
        with open(f) as fh:
            return cls.from_hf(json.load(fh))


def _check_keys(cls, kwargs: dict[str, Any]) -> None:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} option(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")


# ---------------------------------------------------------------- parsing flag values

_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?(?:e[0-9]+)?)\s*([kmgt]?)(i?)(b?)\s*", re.IGNORECASE)


def parse_bytes(text: str | int) -> int:
    """A byte count: '4294967296', '4G' or '4GiB' (powers of 1024), '20GB' (powers of 1000), '1.5e9'."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = _SIZE.fullmatch(str(text))
    if not m or (m.group(3) and not m.group(2)):
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r} (e.g. 4294967296, 4G, 512MiB, 20GB)")
    unit, binary = m.group(2).lower(), bool(m.group(3)) or not m.group(4)
    power = "kmgt".index(unit) + 1 if unit else 0
    return int(float(m.group(1)) * ((1 << 10) if binary else 1000) ** power)


def parse_count(text: str | int) -> int:
    """A count: '262144', '256k' (1000s), '256Ki' (1024s), '27B' (billions), '1.5e9'."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    units = {"": 1, "k": 10**3, "ki": 2**10, "m": 10**6, "mi": 2**20, "b": 10**9, "g": 10**9, "t": 10**12}
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in units:
        raise argparse.ArgumentTypeError(f"not a count: {text!r} (e.g. 262144, 256Ki, 27B)")
    return int(float(m.group(1)) * units[m.group(2).lower()])


# ---------------------------------------------------------------- the engine's flags

@dataclass(frozen=True)
class Flag:
    """How an EngineConfig field appears on every command line (each command builds its flags from these).

    parse: the value's parser (the same in every command); replica: a simulated replica takes it too (the
    scheduling and memory flags); the rest need a real engine (a model to load, a device, threads...)."""

    help: str
    parse: Callable[[str], Any] | None = None  # None: a boolean --flag / --no-flag
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    aliases: tuple[str, ...] = ()
    replica: bool = False

    def option(self, name: str) -> str:
        return "--" + name.replace("_", "-")


def _flag(default: Any, help: str, parse: Callable[[str], Any] | None = str, **kw) -> Any:
    return field(default=default, metadata={"flag": Flag(help, parse, **kw)})


def _optional_int(text: str) -> int | None:
    return None if str(text).lower() in ("none", "auto") else int(text)


MM_MODALITIES = ("image", "video", "audio")  # --limit-mm-per-prompt's keys (vLLM's); deltaserve takes images only
DEFAULT_MM_LIMITS = (("audio", 0), ("image", 16), ("video", 0))


def parse_mm_limits(text: str) -> tuple[tuple[str, int], ...]:
    """--limit-mm-per-prompt: vLLM's JSON ('{"image": 16, "video": 0}') or 'image=16,video=0'; modalities not
    named keep their defaults (image 16, the others 0: not served). Sorted (modality, limit) pairs."""
    text = str(text).strip()
    try:
        given = json.loads(text) if text.startswith("{") else {
            k.strip(): int(v) for k, v in (part.split("=", 1) for part in text.split(",") if part.strip())}
    except (ValueError, TypeError):
        raise argparse.ArgumentTypeError(f"not a limit per modality: {text!r} (e.g. '{{\"image\": 16, \"video\": 0}}')") from None
    if not isinstance(given, dict):
        raise argparse.ArgumentTypeError(f"--limit-mm-per-prompt takes a JSON object, not {text!r}")
    limits = dict(DEFAULT_MM_LIMITS)
    for k, v in given.items():
        if k not in MM_MODALITIES:
            raise argparse.ArgumentTypeError(f"--limit-mm-per-prompt: unknown modality {k!r} ({', '.join(MM_MODALITIES)})")
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise argparse.ArgumentTypeError(f"--limit-mm-per-prompt: {k} needs a whole number >= 0, not {v!r}")
        if k != "image" and v:
            raise argparse.ArgumentTypeError(f"--limit-mm-per-prompt: deltaserve takes images only ({k} must be 0)")
        limits[k] = v
    return tuple(sorted(limits.items()))


# --quantize-head: how the LM head's weights are held (HybridModel.prepack_linears)
QUANTIZE_HEAD_CHOICES = ("none", "fp8", "int4")
# --quantize: the text model's projections quantized at load (docs/int4.md): int4 in groups of 128 or 32 k
QUANTIZE_CHOICES = ("none", "int4", "int4-g32")

# --cpu-isa: the compiled CPU kernels' instruction sets (deltaserve/model/ops/cpu_kernels.py builds each)
CPU_ISA_CHOICES = ("auto", "amx", "avx512bf16", "avx512", "avx2", "generic")


@dataclass(frozen=True)
class SpeculativeConfig:
    """--speculative-config, as vLLM spells it: {"method": "mtp", "num_speculative_tokens": k}. The model's own
    multi-token-prediction layer drafts k tokens a step; the target verifies them in one pass (docs/speculative.md).
    Unknown keys are errors."""

    method: str = "mtp"
    num_speculative_tokens: int = 1
    # drafts per step by each request's acceptance (engine/speculative.py Acceptance); false: always
    # num_speculative_tokens (the worst case of a drafter that is always wrong, as a benchmark measures it)
    adaptive: bool = True
    # with adaptive: a step's rows (each decoding request's own row and its drafts) up to which verifying costs about
    # what a plain decode step costs (the linears stream their weights once for a few rows; past that each row adds
    # its arithmetic); the drafts are cut, least likely first, to fit. 0: no cap
    max_verify_rows: int = 8

    METHODS = ("mtp",)

    def __post_init__(self) -> None:
        if self.method not in self.METHODS:
            raise ConfigError(f"--speculative-config: method must be one of {', '.join(self.METHODS)}, not "
                              f"{self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ConfigError(f"--speculative-config: num_speculative_tokens must be an integer in [1, 16], not {k!r}")
        if not isinstance(self.adaptive, bool):
            raise ConfigError(f"--speculative-config: adaptive must be true or false, not {self.adaptive!r}")
        r = self.max_verify_rows
        if not isinstance(r, int) or isinstance(r, bool) or r < 0:
            raise ConfigError(f"--speculative-config: max_verify_rows must be an integer >= 0 (0 = no cap), not {r!r}")

    @classmethod
    def parse(cls, value: "str | dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """A JSON object (the flag's text), a dict or a SpeculativeConfig; None / "" / "null" = off."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            if value.strip() in ("", "null", "none", "None"):
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--speculative-config is not a JSON object: {e}") from None
        if not isinstance(value, dict):
            raise ConfigError("--speculative-config must be a JSON object, e.g. "
                              '\'{"method": "mtp", "num_speculative_tokens": 2}\'')
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"--speculative-config: unknown key(s) {', '.join(map(repr, unknown))} (known: "
                              f"{', '.join(sorted(known))})")
        return cls(**value)


def _speculative(text: str) -> "SpeculativeConfig | None":
    try:
        return SpeculativeConfig.parse(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# whole-number flags with a floor, in the order they are checked: (field, least value, what the floor means)
_AT_LEAST = (("max_num_seqs", 1, ""), ("max_num_batched_tokens", 1, ""), ("prefill_merge_tokens", 0, " (0 = no limit)"),
             ("block_size", 1, ""), ("checkpoint_grid", 0, " (0 = off)"), ("reprefill_job_tokens", 1, ""),
             ("max_model_len", 2, ""), ("num_threads", 1, ""), ("max_output_tokens", 0, " (0 = no cap)"),
             ("resume_points", 0, ""), ("resume_point_bytes", 0, " (0 = an eighth of the pool)"))


@dataclass(frozen=True)
class EngineConfig:
    """The engine's flags (vLLM's names). Unknown keys are errors (see from_kwargs).

    Each field's Flag is its one definition on the command line: `deltaserve generate | serve | profile |
    simulate` (and the benchmarks) build their engine flags with add_engine_args()."""

    model: str | None = _flag(None, "the model: a directory (config.json + safetensors) or a Hugging Face Hub id "
                              "(ORG/NAME: from the Hub cache, downloaded once; HF_HOME, HF_HUB_OFFLINE, HF_TOKEN "
                              "as huggingface_hub reads them); default: the embedded model", metavar="DIR|ID")
    revision: str | None = _flag(None, "the Hub revision (branch, tag or commit) of a --model given by Hub id "
                                 "(default: main)", metavar="REV")
    tokenizer: str | None = _flag(None, "the tokenizer and chat template: a directory or a Hub id (default: the "
                                  "model's)", metavar="DIR|ID")
    preset: str = _flag("tiny", "embedded model preset when --model is not given (tiny, qwen3.5-0.8b-shape, ...)",
                        metavar="NAME")
    dtype: str = _flag("auto", "weights, activations, KV and conv state (auto = the model's)",
                       choices=MODEL_DTYPE_CHOICES, replica=True)
    quantize_head: str = _flag("none", "the LM head: none (as the model holds it), fp8 (block-FP8 at load, "
                               "as a -FP8 model's linears; a decode step reads half the head's bytes) or int4 "
                               "(groups of 128 with a zero point, a quarter of the bytes); the logits change by "
                               "the format's rounding; CPU, bf16, one rank", choices=QUANTIZE_HEAD_CHOICES)
    quantize: str = _flag("none", "the text model's projections at load: none (as the checkpoint holds them), "
                          "int4 (4-bit codes with a scale and zero per 128 k, 4.31 bits a weight) or int4-g32 (per "
                          "32 k, 5.25 bits, closer to the bf16 model); bf16 or FP8 checkpoints; CPU, one rank "
                          "(docs/int4.md)", choices=QUANTIZE_CHOICES)
    max_model_len: int | None = _flag(None, "longest prompt + completion (default: min(the model's "
                                      "max_position_embeddings, what one request can hold in the pool))",
                                      parse_count, metavar="N", replica=True)
    max_num_seqs: int = _flag(16, "running sequences at once (= live GDN slots)", int, metavar="N", replica=True)
    max_num_batched_tokens: int = _flag(2048, "tokens per step (prefill chunks + decodes)", int, metavar="N",
                                        replica=True)
    prefill_merge_tokens: int = _flag(256, "a waiting prompt joins a step only while the step's prefill tokens "
                                      "are below this (0 = no limit)", int, metavar="N", replica=True)
    kv_cache_memory: int | None = _flag(None, "bytes for the whole cache pool (pages + GDN slots), e.g. 2G, 512MiB, "
                                        "20GB; default: --memory-utilization of the device's memory (at most 2 GiB "
                                        "on a CPU), or what --max-model-len needs where that is more",
                                        parse_bytes, metavar="BYTES", replica=True)
    memory_utilization: float = _flag(0.5, "fraction of device memory for the pool when --kv-cache-memory is "
                                      "not given", float, metavar="FRACTION", aliases=("--gpu-memory-utilization",))
    block_size: int = _flag(16, "vLLM's --block-size; the engine's page is derived from it (a multiple of 64)",
                            int, metavar="N", replica=True)
    enable_prefix_caching: bool = _flag(True, "hybrid prefix caching (GDN checkpoints)", None, replica=True)
    cache_layout: str = _flag(LAYOUT_NAMES[0], "where GDN checkpoints live (docs/design.md)", choices=LAYOUT_NAMES,
                              replica=True)
    checkpoint_grid: int = _flag(128, "also checkpoint every N tokens inside prefill chunks while the pool has free "
                                 "pages, so later requests that share a prefix hit near its end (rounded up to "
                                 "a multiple of the page; 0 = off)", int, metavar="N", replica=True)
    resume_points: int = _flag(48, "the most resume points one request keeps: checkpoints where a later request may "
                               "resume, taken by source priority (client-declared, structural, learned, then the "
                               "grid, spread over the prompt); docs/design.md", int, metavar="N", replica=True)
    resume_point_bytes: int = _flag(0, "also at most this many bytes of resume-point checkpoints per request (0: "
                                    "an eighth of the pool)", parse_bytes, metavar="BYTES", replica=True)
    eviction: str = _flag("lru", "which cached page goes first under pressure: lru (least recently released; "
                          "checkpoints replaced and never hit before all) or value (the least recompute spared per "
                          "page, weighed with hits and recency)", choices=EVICTIONS, replica=True)
    reprefill_outputs: bool = _flag(True, "recompute finished requests' generated tokens through the prefill path in "
                                    "spare step budget and cache them, so a next turn that contains them hits, bit "
                                    "for bit as a cold run", None, replica=True)
    reprefill_job_tokens: int = _flag(256, "the most tokens one --reprefill-outputs job computes in a step (at least a "
                                      "page)", int, metavar="N", replica=True)
    cache_disk: str | None = _flag(None, "a directory for a second prefix-cache tier on local disk: pages and GDN "
                                   "checkpoints evicted from the pool (and every cached one at shutdown) are written "
                                   "there and read back on a hit, across restarts (docs/design.md; the simulator "
                                   "models the tier and writes nothing)", metavar="DIR", replica=True)
    cache_disk_bytes: int = _flag(16 << 30, "the --cache-disk tier's budget; over it, records go by --eviction",
                                  parse_bytes, metavar="BYTES", replica=True)
    strict_max_tokens: bool = _flag(False, "refuse a request whose max_tokens exceeds what is left of the context "
                                    "(400) instead of clamping it to what is left", None)
    max_output_tokens: int = _flag(0, "the most tokens any request generates: a larger max_tokens is lowered to it "
                                   "(finish_reason length), as llama-server's --n-predict (0 = no cap)", int,
                                   metavar="N")
    max_num_encoder_input_tokens: int | None = _flag(None, "image tokens the vision encoder makes in one step (a "
                                                      "request's images are encoded together, in the step that "
                                                      "first reaches one; the first in a step always may); "
                                                      "default --max-num-batched-tokens", _optional_int, metavar="N")
    limit_mm_per_prompt: tuple = _flag(DEFAULT_MM_LIMITS, "the most images (videos, audio: 0, not served) one "
                                       "request may carry, vLLM's JSON: '{\"image\": 16, \"video\": 0}'; more is a "
                                       "400 naming the limit", parse_mm_limits, metavar="JSON")
    mm_processor_cache_gb: float = _flag(1.0, "GiB of preprocessed images kept by a digest of their encoded bytes "
                                         "(the data URL, base64 or file a request sends), least recently used out "
                                         "first, so an image sent again skips decoding, resizing and hashing; 0 = "
                                         "off (vLLM's name; its default is 4)", float, metavar="GIB")
    seed: int = _flag(0, "seed of the embedded model's weights and of unseeded sampling", int, metavar="N")
    num_threads: int | None = _flag(None, "torch CPU threads (default: torch's)", _optional_int, metavar="N",
                                    replica=True)
    device: str = _flag("auto", "where the model runs", choices=("auto", "cpu", "cuda"))
    cpu_isa: str = _flag("auto", "instruction set of the compiled CPU kernels: auto = the fastest this CPU executes "
                         "(amx, then avx512bf16, avx512, avx2); a set it cannot execute is an error",
                         choices=CPU_ISA_CHOICES)
    speculative_config: SpeculativeConfig | None = _flag(
        None, 'speculative decoding, as vLLM spells it: \'{"method": "mtp", "num_speculative_tokens": K}\' (the '
        "model's MTP layer drafts K tokens a step, the model verifies them in one pass; the outputs are plain "
        "decoding's, bit for bit; docs/speculative.md)", _speculative, metavar="JSON")
    # tensor parallelism (deltaserve/parallel/, docs/parallel.md): torchrun's rendezvous names
    tensor_parallel_size: int = _flag(1, "ranks the model is sharded over (torch.distributed: gloo on CPU, nccl on "
                                      "CUDA); rank 0 schedules and samples", int, metavar="N", aliases=("-tp",))
    nnodes: int = _flag(1, "machines the ranks span (tensor-parallel size divides by it)", int, metavar="N")
    node_rank: int = _flag(0, "this machine's index; node 0 runs the engine, the others only serve their ranks",
                           int, metavar="N")
    master_addr: str = _flag("127.0.0.1", "address of node 0, where the ranks meet", metavar="HOST")
    master_port: int | None = _flag(None, "port on node 0 where the ranks meet (default: a free port, one machine "
                                    "only)", _optional_int, metavar="PORT")
    distributed_timeout: float = _flag(120.0, "seconds a rank waits for another before the engine ends with an "
                                       "error", float, metavar="SECONDS")

    def mm_limit(self, modality: str) -> int:
        """--limit-mm-per-prompt's limit for one modality."""
        return dict(self.limit_mm_per_prompt).get(modality, 0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if self.speculative_config is not None and self.tensor_parallel_size > 1:
            raise ConfigError("--speculative-config runs on one rank only: drop it or --tensor-parallel-size")
        if isinstance(self.limit_mm_per_prompt, (str, dict)):  # from_kwargs / LLM(**args): the flag's spellings
            text = self.limit_mm_per_prompt if isinstance(self.limit_mm_per_prompt, str) else json.dumps(self.limit_mm_per_prompt)
            try:
                object.__setattr__(self, "limit_mm_per_prompt", parse_mm_limits(text))
            except argparse.ArgumentTypeError as e:
                raise ConfigError(str(e)) from None
        if self.dtype not in MODEL_DTYPE_CHOICES:
            raise ConfigError(f"--dtype must be one of {', '.join(MODEL_DTYPE_CHOICES)}, not {self.dtype!r}")
        if self.cache_layout not in LAYOUT_NAMES:
            raise ConfigError(f"--cache-layout must be one of {', '.join(LAYOUT_NAMES)}, not {self.cache_layout!r}")
        for name, least, note in _AT_LEAST:
            value = getattr(self, name)
            if value is not None and value < least:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= {least}{note}")
        if not 0 < self.memory_utilization <= 1:
            raise ConfigError("--memory-utilization must be in (0, 1]")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ConfigError("--kv-cache-memory must be a positive number of bytes")
        if self.eviction not in EVICTIONS:
            raise ConfigError(f"--eviction must be one of {', '.join(EVICTIONS)}, not {self.eviction!r}")
        if self.quantize_head not in QUANTIZE_HEAD_CHOICES:
            raise ConfigError(f"--quantize-head must be one of {', '.join(QUANTIZE_HEAD_CHOICES)}, not "
                              f"{self.quantize_head!r}")
        if self.quantize_head != "none" and self.tensor_parallel_size > 1:
            raise ConfigError(f"--quantize-head {self.quantize_head} runs on one rank only: drop it or "
                              "--tensor-parallel-size")
        if self.quantize not in QUANTIZE_CHOICES:
            raise ConfigError(f"--quantize must be one of {', '.join(QUANTIZE_CHOICES)}, not {self.quantize!r}")
        if self.quantize != "none" and self.tensor_parallel_size > 1:
            raise ConfigError(f"--quantize {self.quantize} runs on one rank only (the packed int4 weights are not "
                              "sharded): drop it or --tensor-parallel-size")
        if self.cpu_isa not in CPU_ISA_CHOICES:
            raise ConfigError(f"--cpu-isa must be one of {', '.join(CPU_ISA_CHOICES)}, not {self.cpu_isa!r}")
        if self.tensor_parallel_size < 1 or self.nnodes < 1 or self.tensor_parallel_size % self.nnodes:
            raise ConfigError(f"--tensor-parallel-size {self.tensor_parallel_size} must be >= 1 and divide by "
                              f"--nnodes {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank {self.node_rank} must be in [0, --nnodes {self.nnodes})")
        if self.nnodes > 1 and self.master_port is None:
            raise ConfigError("--nnodes > 1 needs --master-port (and --master-addr) so the machines can meet")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ConfigError(f"--master-port {self.master_port} is not a port number")
        if not self.mm_processor_cache_gb >= 0:  # NaN too
            raise ConfigError("--mm-processor-cache-gb must be >= 0 (0 = off)")
        if self.cache_disk_bytes <= 0:
            raise ConfigError("--cache-disk-bytes must be a positive number of bytes")
        if self.cache_disk and (not self.enable_prefix_caching or self.tensor_parallel_size > 1):
            raise ConfigError("--cache-disk needs prefix caching on and one rank (--tensor-parallel-size 1)")
        if self.distributed_timeout <= 0:
            raise ConfigError("--distributed-timeout must be > 0 seconds")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        _check_keys(cls, kwargs)
        return cls(**kwargs)


ENGINE_FLAGS: dict[str, Flag] = {f.name: f.metadata["flag"] for f in dataclasses.fields(EngineConfig)}
ENGINE_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
REPLICA_FLAGS: tuple[str, ...] = tuple(n for n, f in ENGINE_FLAGS.items() if f.replica)


def add_engine_args(parser: argparse.ArgumentParser, names: Iterable[str] | None = None,
                    title: str = "engine") -> None:
    """Add the engine flags `names` (default all) to parser, as their Flags define them. A flag that is not
    given leaves no attribute (argparse.SUPPRESS), so engine_args() returns what the user said and the
    defaults stay EngineConfig's own."""
    g = parser.add_argument_group(title)
    for name in (ENGINE_FLAGS if names is None else names):
        fl, default = ENGINE_FLAGS[name], ENGINE_DEFAULTS[name]
        shown = "on" if default is True else "off" if default is False else default
        kw: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS,
                              "help": fl.help if default is None else f"{fl.help} (default: {shown})"}
        if fl.parse is None:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw.update(type=fl.parse, choices=fl.choices, metavar=fl.metavar)
        g.add_argument(fl.option(name), *fl.aliases, **kw)


def engine_argv(kwargs: dict[str, Any]) -> list[str]:
    """The command-line flags that give EngineConfig.from_kwargs(**kwargs)'s values (None: left at the default):
    what a benchmark passes to `deltaserve serve` for an arm it also runs in-process."""
    argv: list[str] = []
    for name, value in kwargs.items():
        fl = ENGINE_FLAGS[name]  # KeyError: not an engine flag
        if value is None:
            continue
        if fl.parse is None:
            argv.append(fl.option(name) if value else "--no-" + fl.option(name)[2:])
        elif isinstance(value, tuple):  # (key, value) pairs: --limit-mm-per-prompt's form
            argv += [fl.option(name), ",".join(f"{k}={v}" for k, v in value)]
        else:
            argv += [fl.option(name), str(value)]
    return argv


def engine_args(ns: argparse.Namespace) -> dict[str, Any]:
    """The engine flags given on the command line (EngineConfig names), and only those."""
    return {n: getattr(ns, n) for n in ENGINE_FLAGS if hasattr(ns, n)}


ENV_PREFIX = "DELTASERVE_"
_ENV_TRUE, _ENV_FALSE = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


def env_var(name: str) -> str:
    """The environment variable that mirrors engine flag `name`: --max-model-len -> DELTASERVE_MAX_MODEL_LEN."""
    return ENV_PREFIX + name.upper()


def env_engine_args(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """The engine flags set in the environment as DELTASERVE_<FLAG> (vLLM's VLLM_* habit, for containers and
    service files), parsed as the flag parses them; a flag on the command line wins over its variable
    (`serve` and `generate` merge them so). ConfigError naming the variable for a value the flag refuses."""
    environ = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for name, fl in ENGINE_FLAGS.items():
        text = environ.get(env_var(name))
        if text is None or text == "":
            continue
        try:
            if fl.parse is None:
                if text.strip().lower() not in _ENV_TRUE + _ENV_FALSE:
                    raise argparse.ArgumentTypeError(f"not a boolean (one of {', '.join(_ENV_TRUE + _ENV_FALSE)})")
                value: Any = text.strip().lower() in _ENV_TRUE
            else:
                value = fl.parse(text)
                if fl.choices is not None and value not in fl.choices:
                    raise argparse.ArgumentTypeError(f"must be one of {', '.join(fl.choices)}")
        except (argparse.ArgumentTypeError, ValueError) as e:
            raise ConfigError(f"{env_var(name)}={text!r} (--{name.replace('_', '-')}): {e}") from None
        out[name] = value
    return out


def tied_head_streamed(m: ModelConfig, quantize_head: str, compiled_linear: bool) -> bool:
    """Whether the loader (model/loader.py, by this rule) streams a tied embedding from the file a band of rows at a
    time instead of reading it whole: where the head is quantized (--quantize-head), or packed for the compiled
    linear_bf16 (compiled_linear; an even hidden size), the head then being the embedding too. Before loading,
    whether the compiled linear will be there is not known: memory/resident.py largest_tensor assumes it is not (an
    upper bound)."""
    return m.tie_word_embeddings and (quantize_head != "none" or (compiled_linear and m.hidden_size % 2 == 0))
