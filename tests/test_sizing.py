"""The memory arithmetic (deltaserve.memory.sizing) against published figures (vLLM, vllm-gaudi) and the shipped presets. Pure Python."""
from __future__ import annotations

import math

import pytest

from deltaserve.memory import sizing as S
from deltaserve.config import ConfigError, ModelConfig
from deltaserve.presets import ALIASES, load_preset, preset_names, preset_source


def model(name: str, **override) -> ModelConfig:
    hf = load_preset(name)
    hf.update(override)
    return ModelConfig.from_hf(hf)


def geo(name: str, tp: int = 1, kv: str | None = None, conv: str | None = None, ssm: str | None = None,
        spec: int = 0, **override) -> S.Geometry:
    m = model(name, **override)
    d = S.resolve_cache_dtypes(m)
    return S.geometry(m, kv or d.kv, conv or d.conv, ssm or d.ssm, tp=tp, num_speculative_tokens=spec)


# ---------------------------------------------------------------- Qwen3.5-27B (= Qwen3.6-27B): vLLM's published block rule

def test_27b_state_and_kv_bytes():
    g = geo("qwen3.5-27b")
    assert (g.n_gdn_layers, g.n_attn_layers) == (48, 16)
    assert g.gdn_conv_bytes == 61_440  # conv_dim 10,240 x 3 rows x bf16
    assert g.gdn_ssm_bytes == 3_145_728  # 48 heads x 128 x 128 x fp32
    assert g.gdn_state_bytes == 3_207_168
    assert g.gdn_state_bytes_per_seq == 48 * 3_207_168 == 153_944_064
    assert round(g.gdn_state_bytes_per_seq / 1e6, 1) == 153.9
    assert g.kv_bytes_per_token_per_layer == 4_096
    assert g.kv_bytes_per_token == 65_536
    assert g.gdn_ssm_bytes / g.gdn_state_bytes > 0.98  # "the recurrent state is ~98%"


def test_27b_block_sizes_at_vllm_alignments():
    g = geo("qwen3.5-27b")
    assert S.hybrid_block_size(g, 16) == 16 * math.ceil(3_207_168 / (16 * 4_096)) == 784
    assert S.hybrid_block_size(g, 128) == 896
    # vLLM: alignment = max(kernel, --block-size): Gaudi's --block-size 128 on a 16-kernel gives 896 too
    assert S.resolve_block_size(g, 16, 16) == 784
    assert S.resolve_block_size(g, 16, 128) == 896
    assert S.resolve_block_size(g, 128, 16) == 896
    assert S.resolve_block_size(g, S.ENGINE_KERNEL_ALIGNMENT, 16) == 832
    assert 784 * 4_096 - 3_207_168 == 4_096  # the page padding at 784


def test_27b_align_mode_pages_per_request():
    g = geo("qwen3.5-27b")
    per_layer = S.gdn_pages_per_layer("align")
    assert per_layer == 2
    assert g.n_gdn_layers * per_layer == 96
    assert S.cdiv(96, g.n_attn_layers) == 6  # "48 mamba layers x 2 pages = 96 pages per request -> 6 blocks"
    assert S.gdn_pages_per_layer("none") == 1
    assert S.gdn_pages_per_layer("none", num_speculative_tokens=2) == 3
    assert S.gdn_pages_per_layer("align", num_speculative_tokens=1) == 3
    assert S.gdn_pages_per_layer("all", 0, max_model_len=262_144, block_size=784) == S.cdiv(262_144, 784)
    with pytest.raises(ConfigError):
        S.gdn_pages_per_layer("sometimes")


def test_tp2_halves_both_pages_and_keeps_the_block():
    g1, g2 = geo("qwen3.5-27b"), geo("qwen3.5-27b", tp=2)
    assert g2.gdn_conv_bytes * 2 == g1.gdn_conv_bytes
    assert g2.gdn_ssm_bytes * 2 == g1.gdn_ssm_bytes
    assert g2.kv_bytes_per_token_per_layer * 2 == g1.kv_bytes_per_token_per_layer
    assert S.hybrid_block_size(g2, 16) == 784
    assert S.hybrid_block_size(g2, 128) == 896


def test_tp_beyond_kv_heads_replicates_and_bad_tp_raises():
    g8 = geo("qwen3.5-27b", tp=8)  # 4 KV heads: one replicated head per rank
    assert g8.kv_bytes_per_token_per_layer == 2 * 1 * 256 * 2
    with pytest.raises(ConfigError):
        geo("qwen3.5-27b", tp=3)


def test_kv_groups_follow_vllm():
    m = model("qwen3.5-27b")
    groups = S.kv_groups(m)
    assert [k for k, _ in groups] == ["attention", "gdn", "gdn", "gdn"]
    assert all(len(ls) == 16 for _, ls in groups)
    assert groups[0][1] == tuple(range(3, 64, 4))
    assert sorted(i for _, ls in groups[1:] for i in ls) == [i for i in range(64) if (i + 1) % 4]


# ---------------------------------------------------------------- tiny: 128 in bf16, 64 in fp32

def test_tiny_block_at_engine_alignment():
    m = model("tiny")
    assert (len(m.gdn_layers), len(m.attn_layers)) == (6, 2)
    assert m.layer_types[:4] == ("linear_attention",) * 3 + ("full_attention",)
    g = geo("tiny")
    assert g.kv_bytes_per_token_per_layer == 1_024  # 2 x 2 KV heads x 128 x bf16
    assert g.gdn_state_bytes == 512 * 3 * 2 + 4 * 64 * 64 * 4 == 68_608
    assert S.hybrid_block_size(g, S.ENGINE_KERNEL_ALIGNMENT) == 128
    assert S.resolve_block_size(g, S.ENGINE_KERNEL_ALIGNMENT, 16) == 128
    g32 = geo("tiny", dtype="float32")  # everything in fp32
    assert S.hybrid_block_size(g32, S.ENGINE_KERNEL_ALIGNMENT) == 64
    g_kv32 = geo("tiny", kv="float32")  # only the KV cache in fp32
    assert S.hybrid_block_size(g_kv32, S.ENGINE_KERNEL_ALIGNMENT) == 64


def test_tiny_preset_fields():
    hf = load_preset("tiny")
    assert hf["model_type"] == "qwen3_5_text"
    for k, v in dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=128, partial_rotary_factor=0.25, linear_num_key_heads=2, linear_num_value_heads=4,
                     linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, vocab_size=4096,
                     tie_word_embeddings=True, dtype="bfloat16", mamba_ssm_dtype="float32",
                     max_position_embeddings=262144, rms_norm_eps=1e-6, eos_token_id=1).items():
        assert hf[k] == v, k
    m = ModelConfig.from_hf(hf)
    assert m.rotary_dim == 32 and m.eos_token_id == (1,)


# ---------------------------------------------------------------- dtypes: 'auto' as vLLM resolves it

def test_dtype_resolution_qwen35_takes_config_ssm_dtype():
    d = S.resolve_cache_dtypes(model("qwen3.5-27b"))
    assert (d.model, d.kv, d.conv, d.ssm) == ("bfloat16", "bfloat16", "bfloat16", "float32")
    d = S.resolve_cache_dtypes(model("qwen3.5-27b"), mamba_ssm_cache_dtype="bfloat16")
    assert d.ssm == "bfloat16"
    d = S.resolve_cache_dtypes(model("qwen3.5-27b"), kv_cache_dtype="fp8_e4m3")
    assert d.kv == "fp8"


def test_dtype_resolution_qwen3_next_falls_back_to_conv_dtype():
    m = model("qwen3-next-80b-a3b")
    assert m.mamba_ssm_dtype is None
    d = S.resolve_cache_dtypes(m)
    assert d.ssm == d.conv == "bfloat16"
    d = S.resolve_cache_dtypes(m, mamba_cache_dtype="float32")  # auto SSM follows the conv dtype
    assert d.ssm == "float32"
    g = geo("qwen3-next-80b-a3b")
    assert g.gdn_ssm_bytes == 32 * 128 * 128 * 2
    assert S.hybrid_block_size(g, 16) == 544


def test_fp8_kv_doubles_the_block_and_all_mode_aligns_to_the_chunk():
    g = geo("qwen3.5-27b", kv="fp8")
    assert g.kv_bytes_per_token_per_layer == 2_048
    assert S.resolve_block_size(g, 16) == 16 * S.cdiv(3_207_168, 16 * 2_048) == 1_568
    g = geo("qwen3.5-27b")
    assert S.resolve_block_size(g, 16, 16, "all") == 64 * S.cdiv(S.cdiv(3_207_168, 4_096), 64) == 832
    assert S.resolve_block_size(g, 16, 16, "all", mamba_chunk_size=256) == 1024


def test_speculative_tokens_add_conv_rows():
    g0, g2 = geo("qwen3.5-27b"), geo("qwen3.5-27b", spec=2)
    assert g2.gdn_conv_bytes == g0.gdn_conv_bytes // 3 * 5
    assert g2.gdn_ssm_bytes == g0.gdn_ssm_bytes


def test_dtype_names():
    assert S.normalize_dtype("torch.bfloat16") == "bfloat16"
    assert S.normalize_dtype("bf16") == "bfloat16"
    assert S.dtype_bytes("fp8_e5m2") == 1
    with pytest.raises(ConfigError):
        S.normalize_dtype("int3")


# ---------------------------------------------------------------- other published geometries

def test_moe_blocks_match_seed_000():
    # vllm-gaudi serves Qwen3.5/3.6-35B-A3B with 1152-token blocks (alignment 128)
    g = geo("qwen3.5-35b-a3b")
    assert g.gdn_state_bytes == 2_146_304
    assert S.hybrid_block_size(g, 128) == 1152
    assert S.hybrid_block_size(geo("qwen3.5-397b-a17b"), 128) == 2176


@pytest.mark.parametrize("name,billions", [
    ("qwen3.5-0.8b-shape", (0.70, 0.80)), ("qwen3.5-27b", (26.5, 27.5)), ("qwen3.5-35b-a3b", (34.0, 35.5)),
    ("qwen3.5-122b-a10b", (120, 124)), ("qwen3.5-397b-a17b", (390, 400)), ("qwen3-next-80b-a3b", (78, 81)),
])
def test_param_counts_match_the_model_names(name, billions):
    n = S.param_count(model(name)) / 1e9  # text model only (no vision tower, no MTP head)
    assert billions[0] <= n <= billions[1]


def test_08b_shape_geometry():
    m = model("qwen3.5-0.8b-shape")
    assert (m.num_hidden_layers, len(m.gdn_layers), len(m.attn_layers)) == (24, 18, 6)
    assert (m.hidden_size, m.num_attention_heads, m.num_key_value_heads, m.head_dim) == (1024, 8, 2, 256)
    assert (m.linear_num_key_heads, m.linear_num_value_heads, m.linear_key_head_dim) == (16, 16, 128)
    assert m.tie_word_embeddings and m.vocab_size == 248_320 and m.intermediate_size == 3584
    g = geo("qwen3.5-0.8b-shape")
    assert g.gdn_state_bytes == 6144 * 3 * 2 + 16 * 128 * 128 * 4 == 1_085_440
    assert (S.hybrid_block_size(g, 16), S.hybrid_block_size(g, 64), S.hybrid_block_size(g, 128)) == (544, 576, 640)


def test_every_preset_loads_and_cites_its_source():
    assert {"tiny", "qwen3.5-0.8b-shape", "qwen3.5-27b"} <= set(preset_names())
    for name in preset_names(include_aliases=True):
        hf = load_preset(name)
        assert not any(k.startswith("_") for k in hf)
        assert preset_source(name)
        m = ModelConfig.from_hf(hf)
        assert len(m.gdn_layers) == 3 * len(m.attn_layers)
    assert load_preset("qwen3.6-27b") == load_preset(ALIASES["qwen3.6-27b"])
    assert "huggingface.co/Qwen/Qwen3.5-27B" in preset_source("qwen3.5-27b")
    with pytest.raises(KeyError):
        load_preset("qwen9")


# ---------------------------------------------------------------- pools

def test_size_pool_layouts():
    g = geo("qwen3.5-27b")
    budget, slots = 20 * 10**9, 4
    inp = S.size_pool(g, budget, 784, slots, "in-page")
    per = S.size_pool(g, budget, 784, slots, "per-block")
    grp = S.size_pool(g, budget, 784, slots, "per-block", per_block_state="group")
    assert inp.page_bytes == 784 * 4_096 and inp.page_padding_bytes == 4_096
    assert inp.group_size == 16 and inp.num_gdn_groups == 3
    assert inp.per_page_state_bytes == 0
    assert per.per_page_state_bytes == g.gdn_state_bytes_per_seq  # the engine's per-block arm
    assert grp.per_page_state_bytes == 16 * g.gdn_state_bytes
    for p in (inp, per, grp):
        assert p.total_bytes <= budget < p.total_bytes + p.bytes_per_page
        assert p.num_slots == slots and p.slot_bytes == g.gdn_state_bytes_per_seq
    assert inp.pool_tokens > grp.pool_tokens > per.pool_tokens
    with pytest.raises(ConfigError):
        S.size_pool(g, budget, 16, slots, "in-page")  # a 16-token page cannot hold a GDN state
    with pytest.raises(ConfigError):
        S.size_pool(g, budget, 784, slots, "per-block", per_block_state="layer")


def test_pages_per_seq_and_concurrency():
    g = geo("qwen3.5-27b")
    inp = S.size_pool(g, 20 * 10**9, 784, 4, "in-page")
    per = S.size_pool(g, 20 * 10**9, 784, 4, "per-block")
    assert S.pages_per_seq(inp, 784 * 10, "align") == 10 + 3  # + one checkpoint page per GDN group
    assert S.pages_per_seq(inp, 784 * 10, "none") == 10
    assert S.pages_per_seq(per, 784 * 10, "align") == 10
    assert S.max_concurrent_seqs(inp, 1000, "align") == 4  # bounded by the slots
    assert S.max_concurrent_seqs(inp, 262_144, "align") == inp.num_pages // (S.cdiv(262_144, 784) + 3)


def test_engine_block_rounds_the_user_block_to_its_grid():
    g = geo("qwen3.5-27b")
    assert S.engine_block_size(g, 16, "in-page") == 832
    assert S.engine_block_size(g, 100, "in-page") == 128 * S.cdiv(3_207_168, 128 * 4_096) == 896
    assert S.engine_block_size(geo("tiny"), 16, "in-page") == 128
    assert S.engine_block_size(geo("tiny"), 200, "in-page") == 256
