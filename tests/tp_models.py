"""Small seeded fp32 checkpoints of the three model types for the tensor-parallel gates (tests/test_parallel.py).

Weights are drawn as tests/test_parity.py's randomize() draws them (large enough that every part of the model
moves the logits), written in each type's own checkpoint format (qwen3_next: in_proj_qkvz / in_proj_ba grouped
per key head), with the project's small tokenizer. The vocabulary (301) is odd, so the vocab-parallel head is
padded on its last rank.
"""
from __future__ import annotations

import json
import os

import torch

LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"]
COMMON = {"vocab_size": 301, "hidden_size": 64, "num_hidden_layers": 5, "layer_types": LAYER_TYPES,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "linear_conv_kernel_dim": 4,
          "linear_key_head_dim": 32, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
          "linear_num_value_heads": 4, "rms_norm_eps": 1e-6, "dtype": "float32", "max_position_embeddings": 4096,
          "eos_token_id": 1, "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}
EXTRA = {
    "qwen3_5_text": {"intermediate_size": 96, "tie_word_embeddings": True},
    "qwen3_5_moe_text": dict(MOE),
    # a dense layer among the MoE ones, top-k weights not renormalised
    "qwen3_next": dict(MOE, intermediate_size=96, mlp_only_layers=[2], norm_topk_prob=False),
}
MODEL_TYPES = tuple(EXTRA)


def _scaled(name: str, t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    if name.endswith("A_log"):
        return torch.rand(t.shape, generator=g) * 2.5
    if name.endswith("dt_bias"):
        return torch.randn(t.shape, generator=g) - 2.0
    if name.endswith("linear_attn.norm.weight"):
        return 1.0 + 0.2 * torch.randn(t.shape, generator=g)
    if t.dim() == 1:  # zero-centred RMSNorm weights
        return 0.2 * torch.randn(t.shape, generator=g)
    if "embed_tokens" in name:
        return 0.1 * torch.randn(t.shape, generator=g)
    if "conv1d" in name:
        return 0.4 * torch.randn(t.shape, generator=g)
    return 0.7 * torch.randn(t.shape, generator=g) / t.shape[-1] ** 0.5


def make_tp_model(model_type: str, out_dir: str, seed: int = 0, **overrides) -> str:
    """Write a checkpoint of model_type to out_dir; returns out_dir."""
    from safetensors.torch import save_file

    from deltaserve.embedded.model import write_preset_tokenizer
    from deltaserve.model.make import random_state_dict

    config = {"model_type": model_type, **COMMON, **EXTRA[model_type], **overrides}
    sd = random_state_dict(config, seed)
    g = torch.Generator().manual_seed(seed + 1)
    sd = {k: _scaled(k, v, g).to(v.dtype).contiguous() for k, v in sd.items()}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    save_file(sd, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    write_preset_tokenizer(False, out_dir)
    return out_dir
