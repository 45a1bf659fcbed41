"""`deltaserve plan` (deltaserve.tools.planner): CLI, JSON keys, warnings, model inputs, the layouts at one budget."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest

from deltaserve.tools import planner as P
from deltaserve.presets import load_preset

REQUIRED_KEYS = {
    "block_size", "page_padding_bytes", "gdn_conv_bytes_per_layer", "gdn_ssm_bytes_per_layer",
    "gdn_state_bytes_per_layer", "gdn_state_bytes_per_seq", "kv_bytes_per_token", "kv_groups",
    "gdn_pages_per_request", "gdn_blocks_per_request", "pool_tokens", "max_concurrent_seqs", "warnings",
}


def run_json(capsys, *argv: str) -> dict:
    assert P.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_keys_and_27b_figures(capsys):
    r = run_json(capsys, "--model", "qwen3.5-27b", "--device", "cuda", "--budget", "20GB", "--max-num-seqs", "4")
    assert REQUIRED_KEYS <= set(r)
    assert r["block_size"] == 784 and r["page_padding_bytes"] == 4_096
    assert (r["gdn_conv_bytes_per_layer"], r["gdn_ssm_bytes_per_layer"]) == (61_440, 3_145_728)
    assert r["gdn_state_bytes_per_layer"] == 3_207_168 and r["gdn_state_bytes_per_seq"] == 153_944_064
    assert r["kv_bytes_per_token"] == 65_536
    assert r["gdn_pages_per_layer"] == 2 and r["gdn_pages_per_request"] == 96 and r["gdn_blocks_per_request"] == 6
    assert [g["kind"] for g in r["kv_groups"]] == ["attention", "gdn", "gdn", "gdn"]
    assert set(r["pool_tokens"]) == {"in-page", "runs", "per-block", "per-block-group"}
    assert r["pool_tokens"]["in-page"] % 784 == 0
    assert r["engine_block_size"] == 832
    assert any("prompts shorter than 16 tokens never hit: a hit is a whole number of 16-token pages" in w
               for w in r["warnings"])  # the runs layout: its pages, not the 784-token hybrid block
    assert any("state dtype differs from weight dtype" in w for w in r["warnings"])


def test_table_prints_the_seed_log_line(capsys):
    assert P.main(["--model", "qwen3.5-27b", "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "48 mamba layer(s) x 2 page(s) = 96 page(s) per request (align mode) -> 6 block(s)" in out
    assert "16 * cdiv(3,207,168, 16 * 4,096) = 784 tokens" in out
    assert "61,440 conv + 3,145,728 recurrent = 3,207,168 B" in out
    assert "153.9 MB" in out
    assert "no --budget or --device-memory given" in out


def test_gaudi_block_size_and_tp2(capsys):
    assert run_json(capsys, "--model", "qwen3.5-27b", "--device", "cuda", "--block-size", "128")["block_size"] == 896
    assert run_json(capsys, "--model", "qwen3.5-27b", "--device", "gaudi")["block_size"] == 896
    assert run_json(capsys, "--model", "qwen3.5-27b", "--kernel-alignment", "128")["block_size"] == 896
    r1 = run_json(capsys, "--model", "qwen3.5-27b", "--device", "cuda")
    r2 = run_json(capsys, "--model", "qwen3.5-27b", "--device", "cuda", "--tensor-parallel-size", "2")
    assert r2["block_size"] == 784
    assert r2["gdn_state_bytes_per_layer"] * 2 == r1["gdn_state_bytes_per_layer"]
    assert r2["page_bytes"] * 2 == r1["page_bytes"]


def test_tiny_is_the_default_and_uses_the_engine_alignment(capsys):
    r = run_json(capsys)
    assert r["model"]["name"] == "tiny" and r["kernel_alignment"] == 64 and r["block_size"] == 128
    assert run_json(capsys, "--dtype", "float32")["block_size"] == 64
    assert run_json(capsys, "--kv-cache-dtype", "float32")["block_size"] == 64
    assert run_json(capsys, "--device", "cpu")["block_size"] == 128


def test_in_page_pool_is_at_least_1_9x_per_block_for_the_08b_shape(capsys):
    # 4 GiB per rank, 16 running sequences: the state tensors are a large share of what a page costs
    r = run_json(capsys, "--model", "qwen3.5-0.8b-shape", "--budget", "4GiB", "--max-num-seqs", "16")
    pt = r["pool_tokens"]
    assert r["block_size"] == 576
    assert pt["in-page"] >= 1.9 * pt["per-block"]
    assert pt["in-page"] >= 1.9 * pt["per-block-group"]  # also against one group state per page
    assert r["pool_ratio_in_page_to_per_block"] == pytest.approx(pt["in-page"] / pt["per-block"])


def test_seed_000_budget_reproduces_the_documented_figures(capsys):
    # docs/planner.md: the budget that holds vllm-gaudi's measured in-page pool (288,446 tokens of KV) plus 4 live slots
    budget = 288_446 * 65_536 + 4 * 153_944_064
    r = run_json(capsys, "--model", "qwen3.5-27b", "--device", "gaudi", "--budget", str(budget),
                 "--max-num-seqs", "4", "--max-model-len", "262144")
    pt = r["pool_tokens"]
    assert (pt["in-page"], pt["per-block-group"], pt["per-block"]) == (287_616, 153_216, 78_848)
    assert abs(pt["per-block-group"] / 150_775 - 1) < 0.02  # vllm-gaudi's per-block layout measured 150,775 tokens
    assert r["max_concurrent_seqs"]["in-page"] == 1 and r["max_concurrent_seqs"]["per-block-group"] == 0


def test_pool_shorter_than_max_model_len_warns(capsys):
    r = run_json(capsys, "--budget", "32MiB", "--max-num-seqs", "4")
    assert any("less than --max-model-len" in w for w in r["warnings"])
    r = run_json(capsys, "--budget", "1MiB", "--max-num-seqs", "16")
    assert r["pool_tokens"]["in-page"] == 0
    assert any("does not cover" in w for w in r["warnings"])


def test_ssm_override_and_qwen3_next(capsys):
    r = run_json(capsys, "--model", "qwen3.5-27b", "--mamba-ssm-cache-dtype", "bfloat16")
    assert r["gdn_ssm_bytes_per_layer"] == 3_145_728 // 2
    assert any("overrides the config's mamba_ssm_dtype" in w for w in r["warnings"])
    r = run_json(capsys, "--model", "qwen3-next-80b-a3b", "--device", "cuda")
    assert r["dtypes"]["mamba_ssm_cache"] == "bfloat16" and r["block_size"] == 544
    assert not any("state dtype differs" in w for w in r["warnings"])
    r = run_json(capsys, "--model", "qwen3.5-27b", "--device", "cuda", "--mamba-cache-mode", "none",
                 "--num-speculative-tokens", "1")
    assert r["gdn_pages_per_layer"] == 2 and r["gdn_blocks_per_request"] == 6
    assert not any("never hit" in w for w in r["warnings"])


def _write_safetensors(path: str, tensors: dict[str, tuple[str, list[int], int]]) -> int:
    """A header-only-valid safetensors file: name -> (dtype, shape, itemsize). Returns the data bytes."""
    header, offset = {}, 0
    for name, (dtype, shape, itemsize) in tensors.items():
        n = itemsize
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + b"\0" * offset)
    return offset


def test_checkpoint_directory_with_multimodal_config(tmp_path, capsys):
    text = load_preset("tiny")
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text}))
    _write_safetensors(str(tmp_path / "model-00001.safetensors"), {
        "model.language_model.embed_tokens.weight": ("BF16", [4096, 256], 2),
        "mtp.fc.weight": ("BF16", [256, 512], 2),
    })
    _write_safetensors(str(tmp_path / "model-00002.safetensors"), {"model.norm.weight": ("F32", [256], 4)})
    r = run_json(capsys, "--model", str(tmp_path), "--device-memory", "100MB", "--gpu-memory-utilization", "0.5")
    assert r["model"]["kind"] == "checkpoint" and r["model"]["model_type"] == "qwen3_5_text"
    assert r["block_size"] == 128
    assert r["weight_bytes"] == 4096 * 256 * 2 + 256 * 4  # the MTP head is left out
    assert r["weight_bytes_skipped"] == 256 * 512 * 2
    assert r["budget_bytes"] == 50_000_000 - r["weight_bytes"]
    assert any("runtime reserves are not modeled" in w for w in r["warnings"])
    r = run_json(capsys, "--model", str(tmp_path / "config.json"), "--device-memory", "100MB",
                 "--gpu-memory-utilization", "0.5", "--reserve", "10MB")
    assert r["model"]["kind"] == "config" and r["budget_bytes"] == 40_000_000 - r["weight_bytes"]


def _multimodal_config(path, vision: dict) -> None:
    text = load_preset("qwen3.5-0.8b-shape")
    text.pop("vision_config")
    path.write_text(json.dumps({"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
                                "text_config": text, "vision_config": vision}))


def test_incomplete_vision_config_plans_the_text_model(tmp_path, capsys):
    """A vision_config without the encoder's geometry: the text model is planned and the encoder flagged unknown
    (vision_params null, a warning naming the missing fields), not a KeyError."""
    from deltaserve.config import VisionConfig, VisionConfigIncomplete

    full = load_preset("qwen3.5-0.8b-shape")["vision_config"]
    _multimodal_config(tmp_path / "full.json", full)
    whole = run_json(capsys, "--model", str(tmp_path / "full.json"), "--budget", "1GiB")
    assert whole["vision_params"] > 0 and not any("vision_config" in w for w in whole["warnings"])
    part = {k: v for k, v in full.items() if k not in ("depth", "num_heads")}
    _multimodal_config(tmp_path / "part.json", part)
    r = run_json(capsys, "--model", str(tmp_path / "part.json"), "--budget", "1GiB")
    assert r["vision_params"] is None and r["num_params"] == whole["num_params"] - whole["vision_params"]
    assert r["pool_tokens"] == whole["pool_tokens"]  # the cache does not depend on the encoder
    [w] = [w for w in r["warnings"] if "vision_config" in w]
    assert "lacks depth, num_heads" in w and "left out of the weight bytes" in w
    assert "left out" in r["weight_source"]
    # the weights from safetensors (the encoder's included, whatever its config says): nothing is left out
    _multimodal_config(tmp_path / "config.json", part)
    _write_safetensors(str(tmp_path / "model.safetensors"), {"model.visual.w": ("BF16", [64, 64], 2)})
    r = run_json(capsys, "--model", str(tmp_path), "--budget", "1GiB")
    [w] = [w for w in r["warnings"] if "vision_config" in w]
    assert "lacks depth, num_heads" in w and "left out" not in w and r["weight_bytes"] == 64 * 64 * 2
    assert P.main(["--model", str(tmp_path / "part.json"), "--budget", "1GiB"]) == 0  # the table too
    assert "lacks depth, num_heads" in capsys.readouterr().out
    with pytest.raises(VisionConfigIncomplete, match="lacks depth, num_heads"):  # the engine's reading names them
        VisionConfig.from_path(str(tmp_path / "part.json"))


def test_budget_from_parameter_count(capsys):
    r = run_json(capsys, "--model", "qwen3.5-27b", "--device-memory", "80GiB", "--num-params", "27B")
    assert r["weight_bytes"] == 54 * 10**9
    assert r["budget_bytes"] == int(80 * 2**30 * 0.9) - 54 * 10**9
    r = run_json(capsys, "--model", "qwen3.5-27b", "--device-memory", "40GB", "--tensor-parallel-size", "2")
    # each rank: the whole embedding, a head of cdiv(vocab, 2) rows, half of the rest (untied 27B: 2 vocab tables)
    from deltaserve.config import ModelConfig
    from deltaserve.presets import load_preset

    m = ModelConfig.from_hf(load_preset("qwen3.5-27b"))
    table = m.vocab_size * m.hidden_size * 2
    assert not m.tie_word_embeddings
    assert r["weight_bytes_per_rank"] == -(-(r["weight_bytes"] - 2 * table) // 2) + table + table // 2
    assert r["weight_bytes_per_rank"] > -(-r["weight_bytes"] // 2)
    r = run_json(capsys, "--model", "qwen3.5-27b", "--device-memory", "16GB")
    assert r["budget_bytes"] == 0 and any("leave no room" in w for w in r["warnings"])


def test_errors_return_2(capsys):
    assert P.main(["--model", "no-such-model"]) == 2
    assert "neither a directory" in capsys.readouterr().err
    assert P.main(["--model", "qwen3.5-27b", "--tensor-parallel-size", "3"]) == 2
    with pytest.raises(SystemExit):
        P.main(["--budget", "lots"])


def test_parse_sizes():
    assert P.parse_bytes("20GB") == 20 * 10**9
    assert P.parse_bytes("96GiB") == 96 * 2**30
    assert P.parse_bytes("1.5e9") == 1_500_000_000
    assert P.parse_count("256Ki") == 262_144
    assert P.parse_count("27B") == 27 * 10**9


def test_no_torch_import():
    code = "import sys, deltaserve.tools.planner, deltaserve.memory.sizing, deltaserve.presets; assert 'torch' not in sys.modules"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


def test_the_vision_encoder_counts_in_the_weights(capsys):
    """The 0.8B stand-in carries the real vision tower's geometry: its ~100M parameters join the weights."""
    r = run_json(capsys, "--model", "qwen3.5-0.8b-shape", "--budget", "4GiB")
    assert 100e6 < r["vision_params"] < 101e6
    assert r["num_params"] > r["vision_params"] and "vision encoder" in r["weight_source"]
    assert run_json(capsys, "--model", "qwen3.5-27b", "--budget", "4GiB")["vision_params"] == 0  # a text preset


def test_int4_weights_match_what_the_loaded_model_holds(tmp_path, capsys):
    """`--quantization gptq-int4` / `int4` count int4 linears as linear_int4 holds them (69 B per row and 128 k):
    the tiny GPTQ checkpoint's plan (from its headers, and from the config alone) and the tiny model under
    --quantize int4 are within 10% of HybridModel.held_weight_bytes (the header count is exact); the published
    shapes' GPTQ figures sit between int4-everywhere and block-FP8 (the 35B-A3B's experts are most of it)."""
    from deltaserve.embedded.model import ensure_model, make_model
    from deltaserve.model.loader import load_model

    d = make_model("tiny", str(tmp_path / "tiny-gptq"), quantize="gptq-int4")
    held = load_model(d).held_weight_bytes()["total"]
    r = P.plan(d, budget_bytes=1 << 28)
    assert r["weight_quantization"] == "gptq-int4" and r["serve"]["weight_bytes"] == held
    estimate = P.plan("tiny", quantization="gptq-int4", budget_bytes=1 << 28)["serve"]["weight_bytes"]
    assert abs(estimate - held) <= 0.1 * held, (estimate, held)
    held4 = load_model(ensure_model("tiny"), quantize="int4").held_weight_bytes()["total"]
    r4 = P.plan(ensure_model("tiny"), quantization="int4", budget_bytes=1 << 28)
    assert r4["weight_quantization"] == "int4" and abs(r4["serve"]["weight_bytes"] - held4) <= 0.1 * held4, \
        (r4["serve"]["weight_bytes"], held4)
    for preset in ("qwen3.5-4b-shape", "qwen3.5-27b", "qwen3.5-35b-a3b"):
        w = {q: P.plan(preset, quantization=q, budget_bytes=1 << 34)["weight_bytes"] for q in ("int4", "gptq-int4")}
        w[None] = P.plan(preset, budget_bytes=1 << 34)["weight_bytes"]
        assert w["int4"] < w["gptq-int4"] < 0.65 * w[None], (preset, w)
    r = run_json(capsys, "--model", "qwen3.5-35b-a3b", "--quantization", "gptq-int4", "--budget", "4GiB")
    assert r["weight_quantization"] == "gptq-int4" and "GPTQ-Int4" in r["weight_source"]


def test_the_runs_layout_warns_of_its_page_not_the_hybrid_block(capsys):
    """In the runs layout a state spans several pages of the alignment, so a hit is a whole number of pages (64
    tokens), not of the hybrid block (576 tokens on the 0.8B shape): the warning says the unit that holds."""
    r = run_json(capsys, "--model", "qwen3.5-0.8b-shape", "--layout", "runs", "--budget", "2G")
    assert r["block_size"] == 576
    assert any("prompts shorter than 64 tokens never hit: a hit is a whole number of 64-token pages (the runs "
               "layout)" in w for w in r["warnings"]), r["warnings"]


def test_the_peak_while_loading_is_the_resident_figure_and_the_largest_tensor(capsys):
    """Loading holds the largest tensor beside the placed weights (the engine's pre-load check adds it too): without
    headers that is the embedding, vocab x hidden in the model's dtype."""
    r = run_json(capsys, "--model", "qwen3.5-0.8b-shape", "--budget", "1G")
    sv = r["serve"]
    assert sv["loading_bytes"] == 248_320 * 1_024 * 2
    assert sv["peak_loading_bytes"] == sv["resident_bytes"] + sv["loading_bytes"]
    assert P.main(["--model", "qwen3.5-0.8b-shape", "--budget", "1G"]) == 0
    assert f"peak while loading      {sv['peak_loading_bytes']:,} B" in capsys.readouterr().out
