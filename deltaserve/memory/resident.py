"""What a `deltaserve serve` process holds resident on a CPU: the weights as it runs them, the pool, and the rest.

Torch-free: the figures come from a checkpoint's safetensors headers and its config, so `deltaserve plan` and the
engine's check before loading (engine/llm_engine.py) agree with what the loader then holds
(HybridModel.held_weight_bytes; tests/test_load_memory.py holds both to a real server's VmRSS).

    weights_as_run(model_dir, cfg, "bfloat16", images=True, mtp=False, quantize_head="none") -> bytes or None
    resident = weights_as_run(...) + pool bytes + RUNTIME_BYTES
    peak while loading ~ resident + largest_tensor(model_dir, cfg, images=..., mtp=...)
"""
from __future__ import annotations

import glob
import json
import os

from ..config import ConfigError, ModelConfig, tied_head_streamed
from ..safetensors_header import read_header
from . import sizing as S

# What the process holds besides the weights and the pool: the interpreter, torch, the compiled kernels, the
# tokenizer, the HTTP server and a step's scratch: 0.66-0.75 GB measured after load and one request on the 0.8B
# and 4B shapes, bf16 and block-FP8, with a 1 GiB pool.
RUNTIME_BYTES = 720 * 2**20
FP8_RUN_SCALE = (16, 128)  # linear_fp8's packed scales: one fp32 per 16 outputs x 128 inputs
PACK_ROWS = 16  # the compiled linear_bf16 packs output rows in blocks of 16 (ops/packed.py): a fused group pads up
VISION_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.")
MTP_PREFIXES = ("mtp.", "model.mtp.")


def host_memory() -> tuple[int, int]:
    """(MemTotal, MemAvailable) of this machine in bytes, from /proc/meminfo ((0, 0) where there is none)."""
    got = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("MemTotal", "MemAvailable"):
                    got[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return got.get("MemTotal", 0), got.get("MemAvailable", 0)


def safetensors_header(path: str) -> dict:
    """The tensors of one .safetensors file: name -> dtype, shape, data_offsets (ConfigError if unreadable)."""
    try:
        return read_header(path)[0]
    except ValueError as e:
        raise ConfigError(str(e)) from None


def fp8_run_bytes(n: int, k: int) -> int:
    """A block-FP8 [n, k] weight as linear_fp8 holds it: 1 B codes and its packed scales."""
    return n * k + S.cdiv(n, FP8_RUN_SCALE[0]) * S.cdiv(k, FP8_RUN_SCALE[1]) * 4


def packing_padding(m: ModelConfig, dtype_bytes: int, mlp: bool = True) -> int:
    """Bytes the bf16 packing adds: each fused projection's rows rounded up to PACK_ROWS (the GDN in_proj's
    q|k|v|z|b|a rows are seldom a multiple; the other projections of the published shapes are). mlp=False: the
    dense MLP is not bf16 (a GPTQ-Int4 model's: int4_run_bytes counts its padding)."""
    def pad(rows: int, cols: int) -> int:
        return (S.cdiv(rows, PACK_ROWS) * PACK_ROWS - rows) * cols * dtype_bytes

    H = m.hidden_size
    total = 0
    for i, kind in enumerate(m.layer_types):
        if kind == "linear_attention":
            vd = m.linear_num_value_heads * m.linear_value_head_dim
            total += pad(m.conv_dim + vd + 2 * m.linear_num_value_heads, H) + pad(H, vd)
        else:
            hq, hkv, d = m.num_attention_heads, m.num_key_value_heads, m.head_dim
            total += pad((2 * hq + 2 * hkv) * d, H) + pad(H, hq * d)
        if mlp and not m.is_moe_layer(i) and m.model_type != "qwen3_5_moe_text":
            total += pad(2 * m.intermediate_size, H) + pad(H, m.intermediate_size)
    return total


def head_extra(m: ModelConfig, model_dtype: str, quantize_head: str = "none") -> int:
    """Bytes the head adds to the stored weights as run: a tied bf16 head's packing, which serves as the
    embedding too (its zero rows up to a multiple of 16 only), or the head in block-FP8 / int4 (--quantize-head) in
    place of the bf16 head: of an untied lm_head, or of a tied embedding, whose lookups then read the quantized
    rows (HybridModel.embed): held once either way."""
    bf16_head = m.vocab_size * m.hidden_size * S.dtype_bytes(model_dtype)
    if quantize_head == "fp8":
        return fp8_run_bytes(m.vocab_size, m.hidden_size) - bf16_head
    if quantize_head == "int4":
        return S.int4_run_bytes(m.vocab_size, m.hidden_size) - bf16_head
    if model_dtype == "bfloat16" and m.tie_word_embeddings:
        return (S.cdiv(m.vocab_size, 16) * 16 - m.vocab_size) * m.hidden_size * S.dtype_bytes(model_dtype)
    return 0


def weights_as_run(model_dir: str, m: ModelConfig, model_dtype: str, *, images: bool = True, mtp: bool = False,
                   quantize_head: str = "none", quantize: str = "none") -> int | None:
    """The weights as `deltaserve serve` holds them on a CPU (model/loader.py), from the safetensors headers in
    model_dir (None where it has none): fp8 codes with linear_fp8's scales, bf16 linears packed (the same bytes
    and the packing's row padding), the vision encoder only while images are on, the MTP layers only for
    speculative decoding, a tied checkpoint's lm_head.weight ignored, and the head as head_extra says.
    quantize "int4" / "int4-g32" (int4 at load, of a bf16 checkpoint): the text model's projections as linear_int4
    holds them (sizing.int4_weight_bytes) in place of their stored bytes."""
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        return None
    total, fp8, gptq = 0, False, False
    group = gptq_group(model_dir)
    headers = [safetensors_header(path) for path in files]
    int4 = {n[:-len(".qweight")] for h in headers for n in h if n.endswith(".qweight")}  # across the shards
    for header in headers:
        for name, info in header.items():
            if name.endswith("_scale_inv"):
                fp8 = True  # counted with their weight, in the kernel's layout
                continue
            if not _loaded(name, m, images, mtp):
                continue
            module, _, leaf = name.rpartition(".")
            if module in int4 and leaf in GPTQ_PARTS:  # GPTQ-Int4: the weight packed for linear_int4
                gptq = True
                if leaf == "qweight":
                    k8, n = info["shape"]
                    total += S.int4_run_bytes(n, 8 * k8, group if group > 0 else S.cdiv(8 * k8, 32) * 32)
                continue
            if info["dtype"] == "F8_E4M3" and len(info["shape"]) == 2:
                total += fp8_run_bytes(*info["shape"])
            else:
                start, end = info["data_offsets"]
                total += end - start
    if quantize != "none" and not fp8 and not gptq:  # every projection int4: no bf16 packing padding either
        group = 32 if quantize == "int4-g32" else S.INT4_GROUP
        total += S.int4_weight_bytes(m, model_dtype, "int4", group)[0] - S.param_count(m) * S.dtype_bytes(model_dtype)
    elif model_dtype == "bfloat16" and not fp8:
        total += packing_padding(m, S.dtype_bytes(model_dtype), mlp=not gptq)
    return total + head_extra(m, model_dtype, quantize_head)


def largest_tensor(model_dir: str, m: ModelConfig, *, images: bool = True, mtp: bool = False,
                   quantize_head: str = "none") -> int:
    """The bytes (as stored) of the largest tensor the loader reads whole from model_dir: loading holds one such
    tensor beside what it has placed, so the peak while loading is the resident figure plus about this much. A tied
    embedding the loader streams a band of rows at a time (model/loader.py: a head quantized with --quantize-head;
    also one packed for the compiled linear_bf16, which this count leaves in: an upper bound) does not count. 0
    without safetensors files."""
    streamed = tied_head_streamed(m, quantize_head, compiled_linear=False)
    largest = 0
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        for name, info in safetensors_header(path).items():
            if streamed and name.endswith("embed_tokens.weight"):
                continue
            if _loaded(name, m, images, mtp):
                start, end = info["data_offsets"]
                largest = max(largest, end - start)
    return largest


def _loaded(name: str, m: ModelConfig, images: bool, mtp: bool) -> bool:
    """Whether the loader reads header entry `name`: not the metadata, the MTP layers only for speculative
    decoding, the vision encoder only while images are on, and never a tied checkpoint's lm_head.weight (the
    embedding is the head)."""
    return not (name == "__metadata__" or (name.startswith(MTP_PREFIXES) and not mtp)
                or (name.startswith(VISION_PREFIXES) and not images)
                or (name == "lm_head.weight" and m.tie_word_embeddings))


GPTQ_PARTS = ("qweight", "qzeros", "scales", "g_idx")


def gptq_group(model_dir: str) -> int:
    """The group_size of model_dir's GPTQ quantization_config (128 where it has none)."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            hf = json.load(f)
    except (OSError, ValueError):
        return S.INT4_GROUP
    qc = hf.get("quantization_config") or (hf.get("text_config") or {}).get("quantization_config") or {}
    group = qc.get("group_size", S.INT4_GROUP) if qc.get("quant_method") == "gptq" else S.INT4_GROUP
    return group if isinstance(group, int) else S.INT4_GROUP
