"""Frozen configuration: the model's geometry (from a Hugging Face config.json) and the engine's flags.

No torch here: the planner, the scheduler and the simulator read these too.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
MULTIMODAL_MODEL_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
# Where GDN checkpoints live (sizing.plan_pool): runs (the default) and in-page keep them in pool pages,
# per-block in a tensor beside the pool. The one list every flag, config and pool check uses.
CACHE_LAYOUTS = ("runs", "in-page", "per-block")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "float8_e4m3fn": 1}


class ConfigError(ValueError):
    """A configuration that cannot be served; the message says what to change."""


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
    dtype: str = "bfloat16"  # the checkpoint's weight dtype
    mamba_ssm_dtype: str | None = None  # the recurrent state dtype the config declares, if any
    eos_token_id: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None

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
        )

    @classmethod
    def from_path(cls, path: str) -> "ModelConfig":
        """A checkpoint directory or a config.json file."""
        f = os.path.join(path, "config.json") if os.path.isdir(path) else path
        with open(f) as fh:
            return cls.from_hf(json.load(fh))


def _check_keys(cls, kwargs: dict[str, Any]) -> None:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} option(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")


@dataclass(frozen=True)
class EngineConfig:
    """The engine's flags (vLLM's names). Unknown keys are errors (see from_kwargs)."""

    model: str | None = None  # checkpoint directory; None = the embedded default model
    preset: str = "tiny"  # embedded model preset when model is None
    dtype: str = "auto"  # auto|bfloat16|float16|float32
    max_model_len: int | None = None  # default: min(model's max_position_embeddings, pool)
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    prefill_merge_tokens: int = 256  # waiting prompts join a step while its prefill tokens are below this; 0 = no limit
    kv_cache_memory: int | None = None  # bytes for the whole pool (pages + GDN slots)
    memory_utilization: float = 0.5  # fraction of device memory when kv_cache_memory is unset
    block_size: int = 16  # the user's --block-size; the hybrid block is derived from it
    enable_prefix_caching: bool = True
    cache_layout: str = "runs"  # one of CACHE_LAYOUTS
    seed: int = 0
    num_threads: int | None = None  # torch CPU threads; None = torch's default
    device: str = "auto"  # auto|cpu|cuda

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ConfigError(f"--dtype must be auto, bfloat16, float16 or float32, not {self.dtype!r}")
        if self.cache_layout not in CACHE_LAYOUTS:
            raise ConfigError(f"--cache-layout must be one of {', '.join(CACHE_LAYOUTS)}, not {self.cache_layout!r}")
        if self.max_num_seqs < 1:
            raise ConfigError("--max-num-seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ConfigError("--max-num-batched-tokens must be >= 1")
        if self.prefill_merge_tokens < 0:
            raise ConfigError("--prefill-merge-tokens must be >= 0 (0 = no limit)")
        if not 0 < self.memory_utilization <= 1:
            raise ConfigError("--memory-utilization must be in (0, 1]")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ConfigError("--kv-cache-memory must be a positive number of bytes")
        if self.block_size < 1:
            raise ConfigError("--block-size must be >= 1")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        _check_keys(cls, kwargs)
        return cls(**kwargs)
