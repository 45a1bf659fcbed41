"""Checkpoint loading: layouts (single, sharded, multimodal-prefixed, fused qwen3_next), strictness, dtypes,
and the seeded random model maker."""
from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltaserve.config import ConfigError
from deltaserve.model.loader import (
    WeightsError,
    fuse_ba,
    fuse_qkvz,
    load_model,
    unfuse_ba,
    unfuse_qkvz,
)
from deltaserve.model.make import make_random_model
from model_driver import Sequence, make_caches, prefill

TEXT = {"vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 16, "intermediate_size": 48, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16,
            "linear_value_head_dim": 8, "linear_num_key_heads": 1, "linear_num_value_heads": 2,
            "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"]}
IDS = list(range(3, 40))


def logits(model, ids=IDS):
    n = -(-len(ids) // 64)
    caches = make_caches(model, num_slots=1, num_pages=n, block_size=64)
    return prefill(model, caches, Sequence(slot=0, pages=list(range(n))), ids)


def hf_logits(model, ids=IDS):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    hf = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**TEXT)).eval()
    path = tmp_path_factory.mktemp("dense")
    hf.save_pretrained(path)
    return hf, str(path)


def rewrite(src: str, dst: str, edit) -> str:
    """Copy a single-file checkpoint, editing its tensor dict."""
    os.makedirs(dst, exist_ok=True)
    sd = load_file(os.path.join(src, "model.safetensors"))
    edit(sd)
    save_file(sd, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f, open(os.path.join(dst, "config.json"), "w") as g:
        g.write(f.read())
    return dst


def test_single_file_loads_and_matches(dense):
    hf, path = dense
    model = load_model(path, dtype="float32")
    assert model.dtype == torch.float32
    assert (logits(model) - hf_logits(hf)).abs().max().item() <= 1e-5


def test_sharded_checkpoint_loads(dense, tmp_path):
    hf, path = dense
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    assert len([n for n in os.listdir(tmp_path) if n.endswith(".safetensors")]) > 2
    assert torch.equal(logits(load_model(str(tmp_path), dtype="float32")), logits(load_model(path, dtype="float32")))


def test_multimodal_checkpoint_loads_vision_with_one_log_line(tmp_path, caplog):
    """The vision encoder loads beside the text model (one log line); text logits are the text model's."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(1)
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32,
                  "num_position_embeddings": 16, "patch_size": 4}
    hf = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=TEXT, vision_config=vision)).eval()
    hf.save_pretrained(tmp_path)
    keys = load_file(str(tmp_path / "model.safetensors")).keys()
    assert any(k.startswith("model.visual.") for k in keys)
    assert any(k.startswith("model.language_model.") for k in keys)
    with caplog.at_level(logging.INFO, logger="deltaserve.model.loader"):
        model = load_model(str(tmp_path), dtype="float32")
    vision_lines = [r for r in caplog.records if "vision" in r.getMessage()]
    assert len(vision_lines) == 1 and "loaded the vision encoder" in vision_lines[0].getMessage()
    assert model.config.model_type == "qwen3_5_text" and model.visual is not None
    assert (logits(model) - hf_logits(hf)).abs().max().item() <= 1e-5


def test_mtp_tensors_skipped_with_log_line(dense, tmp_path, caplog):
    _, path = dense

    def add_mtp(sd):
        sd["mtp.fc.weight"] = torch.zeros(4, 4)
        sd["mtp.layers.0.input_layernorm.weight"] = torch.zeros(4)

    rewrite(path, str(tmp_path), add_mtp)
    with caplog.at_level(logging.INFO, logger="deltaserve.model.loader"):
        model = load_model(str(tmp_path), dtype="float32")
    assert [r for r in caplog.records if "mtp" in r.getMessage()]
    assert torch.equal(logits(model), logits(load_model(path, dtype="float32")))


def test_missing_tensor_is_an_error_naming_it(dense, tmp_path):
    _, path = dense
    rewrite(path, str(tmp_path), lambda sd: sd.pop("model.layers.2.linear_attn.A_log"))
    with pytest.raises(WeightsError, match=r"model\.layers\.2\.linear_attn\.A_log"):
        load_model(str(tmp_path))


def test_unknown_tensor_is_an_error_naming_it(dense, tmp_path):
    _, path = dense
    rewrite(path, str(tmp_path), lambda sd: sd.__setitem__("model.layers.0.mystery.weight", torch.zeros(2)))
    with pytest.raises(WeightsError, match=r"model\.layers\.0\.mystery\.weight"):
        load_model(str(tmp_path))


def test_wrong_shape_is_an_error(dense, tmp_path):
    _, path = dense
    rewrite(path, str(tmp_path), lambda sd: sd.__setitem__("model.norm.weight", torch.zeros(7)))
    with pytest.raises(WeightsError, match="norm"):
        load_model(str(tmp_path))


def test_unknown_model_type_is_a_clear_error(dense, tmp_path):
    _, path = dense
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["model_type"] = "llama"
    with open(tmp_path / "config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ConfigError, match="llama"):
        load_model(str(tmp_path))


def test_unsupported_rope_type_is_a_clear_error(dense, tmp_path):
    _, path = dense
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["rope_parameters"]["rope_type"] = "yarn"
    rewrite(path, str(tmp_path), lambda sd: None)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ConfigError, match="yarn"):
        load_model(str(tmp_path))


def test_dtypes(dense):
    _, path = dense
    bf = load_model(path, dtype="bfloat16")
    assert bf.dtype == torch.bfloat16 and bf.embed_tokens.dtype == torch.bfloat16
    gdn = bf.layers[0].linear_attn
    assert gdn.A_log.dtype == torch.float32 and gdn.dt_bias.dtype == torch.float32
    assert bf.cache_shapes(2, 3, 64)["ssm"][1] == torch.float32
    assert (logits(bf) - logits(load_model(path, dtype="float32"))).abs().max().item() < 0.05
    assert load_model(path).dtype == torch.float32  # auto: the config's dtype (save_pretrained wrote float32)
    with pytest.raises(ConfigError):
        load_model(path, dtype="int8")


def test_qwen3_next_fused_projection_layout_round_trips():
    hk, dk, hv, dv, H = 2, 3, 6, 4, 5
    q, k = torch.randn(hk * dk, H), torch.randn(hk * dk, H)
    v, z = torch.randn(hv * dv, H), torch.randn(hv * dv, H)
    b, a = torch.randn(hv, H), torch.randn(hv, H)
    for x, y in zip(unfuse_qkvz(fuse_qkvz(q, k, v, z, hk, hv), hk, dk, hv, dv), (q, k, v, z)):
        assert torch.equal(x, y)
    for x, y in zip(unfuse_ba(fuse_ba(b, a, hk), hk, hv), (b, a)):
        assert torch.equal(x, y)


# ---- make_random_model ---------------------------------------------------------------------------------------

def _read(path):
    with open(path, "rb") as f:
        return f.read()


def test_make_random_model_is_deterministic_and_loads(tmp_path):
    from deltaserve.presets import load_preset

    cfg = {k: v for k, v in load_preset("tiny").items() if not k.startswith("_")}
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    make_random_model(cfg, str(a), seed=0)
    make_random_model(cfg, str(b), seed=0)
    make_random_model(cfg, str(c), seed=1)
    for name in ("config.json", "model.safetensors"):
        assert _read(a / name) == _read(b / name)
    assert _read(a / "model.safetensors") != _read(c / "model.safetensors")
    model = load_model(str(a))
    assert model.dtype == torch.bfloat16
    out = logits(model, list(range(1, 100)))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"])
def test_made_models_are_hugging_face_checkpoints(tmp_path, model_type):
    """What make_random_model writes loads in transformers too, with the same logits."""
    import transformers

    cfg = dict(TEXT, model_type=model_type, dtype="float32", tie_word_embeddings=model_type == "qwen3_5_text",
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    if model_type != "qwen3_5_text":
        cfg.update(num_experts=3, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)
    make_random_model(cfg, str(tmp_path), seed=3)
    ours = load_model(str(tmp_path))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert (logits(ours) - hf_logits(hf)).abs().max().item() <= 1e-5
