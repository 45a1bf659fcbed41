"""`deltaserve plan`: the memory arithmetic of a GDN hybrid as a command and a library function.

Uses deltaserve.memory.sizing, the module the engine sizes its pool with, so plan and engine cannot disagree.
Flags follow vLLM's names. Pure Python, no torch: weight bytes come from safetensors headers (an 8-byte
length, then a JSON header) or from the parameter count times the weight dtype.

    deltaserve plan --model qwen3.5-27b --device cuda --budget 20GB
    deltaserve plan --model /ckpt/Qwen3.5-27B --device-memory 96GiB --gpu-memory-utilization 0.6 --json
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import sys
from dataclasses import dataclass
from typing import Any

from ..config import (DEFAULT_MM_LIMITS, ENGINE_DEFAULTS, ENGINE_FLAGS, QUANTIZE_HEAD_CHOICES, ConfigError, ModelConfig,
                      VisionConfig, VisionConfigIncomplete, parse_bytes, parse_count, parse_mm_limits)
from ..memory import resident as R
from ..memory import sizing as S
from ..memory.layouts import REPORT_LAYOUTS
from ..presets import is_preset, load_preset, preset_names, preset_source

# ---------------------------------------------------------------- model and weights

@dataclass(frozen=True)
class ModelSource:
    config: ModelConfig
    name: str  # what --model said
    kind: str  # "preset", "checkpoint" (a model directory: the JSON report's word), "config"
    source: str  # preset citation or file path
    model_dir: str | None  # where safetensors may live
    vision: VisionConfig | None = None  # the vision encoder, whose weights count too (no cache of its own)
    vision_unknown: str | None = None  # why the encoder's size is unknown (an incomplete vision_config), if it is


def _with_vision(src: ModelSource, hf: dict[str, Any]) -> ModelSource:
    """src with its vision encoder read from the config dict. A vision_config that lacks a geometry field leaves
    the text model planned as it is and the encoder flagged unknown (its weights cannot be counted from the
    config); what the encoder does not implement stays a ConfigError."""
    try:
        return dataclasses.replace(src, vision=VisionConfig.from_hf(hf))
    except VisionConfigIncomplete as e:
        return dataclasses.replace(src, vision_unknown=str(e))


def _read_json(path: str) -> dict[str, Any]:
    f = os.path.join(path, "config.json") if os.path.isdir(path) else path
    with open(f) as fh:
        return json.load(fh)


def resolve_model(spec: str | None) -> ModelSource:
    """--model: a preset name, a model directory or a config.json (a multimodal Qwen3.5 config works)."""
    spec = spec or ENGINE_DEFAULTS.get("preset", "tiny")
    if os.path.isdir(spec):
        path = os.path.join(spec, "config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"{spec} is a directory without a config.json")
        return _with_vision(ModelSource(ModelConfig.from_path(spec), spec, "checkpoint", os.path.abspath(path),
                                        spec), _read_json(spec))
    if os.path.isfile(spec):
        d = os.path.dirname(os.path.abspath(spec))
        has_weights = bool(glob.glob(os.path.join(d, "*.safetensors")))
        return _with_vision(ModelSource(ModelConfig.from_path(spec), spec, "config", os.path.abspath(spec),
                                        d if has_weights else None), _read_json(spec))
    if is_preset(spec):
        hf = load_preset(spec)
        return _with_vision(ModelSource(ModelConfig.from_hf(hf), spec, "preset", preset_source(spec), None), hf)
    raise ConfigError(f"--model {spec!r} is neither a directory, a config.json nor a preset; "
                      f"presets: {', '.join(preset_names(include_aliases=True))}")


def _config_quantization(src: ModelSource) -> str | None:
    """"fp8" / "gptq-int4" when the model's config.json declares a block-FP8 / GPTQ quantization_config, else
    None."""
    if src.kind not in ("checkpoint", "config") or not os.path.isfile(src.source):
        return None  # a ModelConfig handed over in code has no config.json to read
    with open(src.source) as f:
        hf = json.load(f)
    qc = hf.get("quantization_config") or (hf.get("text_config") or {}).get("quantization_config") or {}
    return {"fp8": "fp8", "gptq": "gptq-int4"}.get(qc.get("quant_method"))


QUANTIZATIONS = ("fp8", "gptq-int4", "int4")  # --quantization

safetensors_header = R.safetensors_header  # the one header reader (safetensors_header.py), ConfigError on a bad file


@dataclass(frozen=True)
class WeightBytes:
    bytes: int
    source: str
    tensors: int = 0
    skipped_bytes: int = 0


def model_weight_bytes(directory: str, skip_prefixes: tuple[str, ...] = ("mtp.",)) -> WeightBytes | None:
    """Sum the tensor byte ranges of every *.safetensors file in `directory` (None if there are none).

    Tensors whose name starts with one of `skip_prefixes` (the MTP head, which vLLM loads only for
    speculative decoding) are left out and reported as skipped.
    """
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        return None
    total = skipped = count = 0
    for path in files:
        for name, info in safetensors_header(path).items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            if name.startswith(skip_prefixes):
                skipped += end - start
            else:
                total += end - start
                count += 1
    return WeightBytes(total, f"safetensors headers of {len(files)} file(s) in {directory}", count, skipped)


def weights_per_rank(total: int, m: ModelConfig, tp: int, dtype_bytes: int) -> int:
    """Weight bytes one tensor-parallel rank holds (deltaserve/parallel): the embedding whole on every rank, the
    head as cdiv(vocab, tp) rows of its own (tied or not), everything else divided by tp. total counts the
    model's tensors once (a tied head is the embedding's)."""
    if tp == 1:
        return total
    embed = m.vocab_size * m.hidden_size * dtype_bytes
    rest = total - embed - (0 if m.tie_word_embeddings else embed)
    return S.cdiv(max(rest, 0), tp) + embed + S.cdiv(m.vocab_size, tp) * m.hidden_size * dtype_bytes


# ---------------------------------------------------------------- deltaserve serve's resident memory

HOST_HEADROOM = 0.10  # of --host-memory, left to the OS and everything else on the machine


def serve_weight_bytes(src: ModelSource, inputs: PlanInputs, model_dtype: str, stored: WeightBytes) -> WeightBytes:
    """The weights as `deltaserve serve` holds them on a CPU (memory/resident.py weights_as_run, from the
    safetensors headers; HybridModel.held_weight_bytes measures the same): the vision encoder only while images
    are on (--limit-mm-per-prompt), the MTP layers only with speculative tokens, a tied bf16 head held once (its
    packing is the embedding too) or the head in block-FP8 / int4 (--quantize-head). Without headers (a preset, a config, --weight-bytes,
    --num-params): the stored-weight estimate with the same head and vision terms."""
    m = src.config
    images = dict(inputs.limit_mm_per_prompt).get("image", 0) > 0
    total = None
    if src.model_dir is not None and inputs.weight_bytes is None and inputs.num_params is None and \
            inputs.quantization != "int4":
        total = R.weights_as_run(src.model_dir, m, model_dtype, images=images, mtp=inputs.num_speculative_tokens > 0,
                                 quantize_head=inputs.quantize_head)
    how = [f"safetensors headers in {src.model_dir}"] if total is not None else ["the stored-weight estimate"]
    if total is None:
        total = stored.bytes + R.head_extra(m, model_dtype, inputs.quantize_head)
        if not images and src.vision is not None:
            total -= src.vision.num_params() * S.dtype_bytes(model_dtype)
    if inputs.quantize_head == "fp8":
        how.append("the head in block-FP8 (--quantize-head fp8)")
    elif inputs.quantize_head == "int4":
        how.append("the head in int4 (--quantize-head int4)")
    elif model_dtype == "bfloat16" and m.tie_word_embeddings:
        how.append("the tied head held once (its packing serves the embedding's lookups)")
    if src.vision is not None:
        how.append("vision encoder " + ("included" if images else "not loaded (images off)"))
    return WeightBytes(int(total), "; ".join(how))


def loading_bytes(src: ModelSource, inputs: PlanInputs, model_dtype: str) -> int:
    """What loading holds beside the placed weights: the checkpoint's largest tensor (memory/resident.py
    largest_tensor, from the headers), or without headers the embedding, these models' largest tensor."""
    m = src.config
    if src.model_dir is not None:
        images = dict(inputs.limit_mm_per_prompt).get("image", 0) > 0
        found = R.largest_tensor(src.model_dir, m, images=images, mtp=inputs.num_speculative_tokens > 0,
                                 quantize_head=inputs.quantize_head)
        if found:
            return found
    return m.vocab_size * m.hidden_size * S.dtype_bytes(model_dtype)


def _serve_report(weights: WeightBytes, budget: int | None, inputs: PlanInputs, warnings: list[str],
                  loading: int = 0) -> dict:
    """The plan's "serve" key: what a `deltaserve serve` process holds resident (one rank, a CPU), and its peak
    while loading (resident + the largest tensor: the engine's own check before loading adds the same)."""
    resident = None if budget is None else weights.bytes + budget + R.RUNTIME_BYTES
    if resident is not None and inputs.host_memory is not None and resident > inputs.host_memory:
        warnings.append(f"deltaserve serve would hold {resident:,} B resident, more than --host-memory "
                        f"{int(inputs.host_memory):,}")
    return {"weight_bytes": weights.bytes, "weight_source": weights.source, "pool_bytes": budget,
            "runtime_bytes": R.RUNTIME_BYTES, "resident_bytes": resident, "loading_bytes": loading,
            "peak_loading_bytes": None if resident is None else resident + loading,
            "host_memory": None if inputs.host_memory is None else int(inputs.host_memory)}


# ---------------------------------------------------------------- the plan

@dataclass(frozen=True)
class PlanInputs:
    """What a plan is of, beyond the model: `deltaserve plan`'s flags under vLLM's names, per TP rank.

    None leaves a figure to its default: the engine's (block_size, max_num_seqs), the config's
    (max_model_len = max_position_embeddings; quantization = the config.json's quantization_config) or the
    device's (kernel_alignment). Weights come from weight_bytes, else the model's safetensors headers
    (unless num_params is given), else num_params or the config's parameter count times weight_dtype."""

    # memory: the budget directly, or device memory less the weights and reserves
    budget_bytes: int | None = None
    device_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    reserve_bytes: int = 0
    # weights
    weight_bytes: int | None = None
    num_params: int | None = None
    weight_dtype: str | None = None
    # "fp8": the weights in block-FP8 (sizing.fp8_weight_bytes); "gptq-int4": a GPTQ-Int4 checkpoint, "int4":
    # --quantize int4 at load (sizing.int4_weight_bytes: int4 linears as linear_int4 holds them)
    quantization: str | None = None
    # geometry and blocks
    tensor_parallel_size: int = 1
    block_size: int | None = None
    device: str = "deltaserve"
    kernel_alignment: int | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    mamba_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"
    mamba_cache_mode: str = "align"
    mamba_block_size: int | None = None
    num_speculative_tokens: int = 0
    # what the pool must hold, and the layout the warnings refer to
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    layout: str = ENGINE_DEFAULTS["cache_layout"]
    # deltaserve serve on a CPU: the machine's memory, whether images are on, how the head is held
    host_memory: int | None = None
    limit_mm_per_prompt: tuple = DEFAULT_MM_LIMITS
    quantize_head: str = "none"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> PlanInputs:
        """The inputs build_parser's flags name (--budget and --reserve under their own dests)."""
        dest = {"budget_bytes": "budget", "reserve_bytes": "reserve"}
        return cls(**{f.name: getattr(args, dest.get(f.name, f.name)) for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class CacheShape:
    """The per-rank cache geometry a plan sizes its pools from: dtypes, the hybrid block and the pages."""

    dtypes: S.CacheDtypes
    geometry: S.Geometry
    kernel: int  # the attention kernel's alignment (--kernel-alignment, else --device's)
    alignment: int  # max(kernel, --block-size), or this engine's 64-token grid
    block: int  # the hybrid block, in tokens
    engine_block: int  # the block this engine would use in-page
    page_bytes: int  # one page of one layer position
    padding: int  # page bytes a GDN state leaves unused (0 unless both kinds of layer exist)
    groups: list[tuple[str, tuple[int, ...]]]
    group_size: int  # layer positions per KV group
    pages_per_layer: int  # GDN pages one request holds per layer
    gdn_pages: int  # ... over every GDN layer
    gdn_blocks: int  # ... as blocks of group_size layers


def plan(model: str | ModelConfig | ModelSource | None = None, inputs: PlanInputs | None = None,
         **options: Any) -> dict[str, Any]:
    """Everything `deltaserve plan` prints, as a JSON-able dict (keys documented in docs/planner.md).
    options: PlanInputs fields by name, over `inputs` (plan("tiny", budget_bytes=1 << 28))."""
    src = _model_source(model)
    m = src.config
    inputs = _with_defaults(dataclasses.replace(inputs or PlanInputs(), **options), m)
    _check(inputs)
    shape = _cache_shape(m, inputs)
    weights, params, quant = _count_weights(src, inputs, shape.dtypes.model)
    weight_per_rank = weights_per_rank(weights.bytes, m, inputs.tensor_parallel_size, S.dtype_bytes(shape.dtypes.model))
    warnings: list[str] = []
    if src.vision_unknown is not None:
        from_config = params is not None and inputs.num_params is None  # else safetensors or a flag's figure
        warnings.append(f"{src.vision_unknown}: the text model is planned, the vision encoder's size is unknown"
                        + (" and left out of the weight bytes" if from_config else ""))
    serve_weights = serve_weight_bytes(src, inputs, shape.dtypes.model, weights)
    budget, budget_source = _budget(inputs, weight_per_rank, warnings, serve_weights.bytes)
    pools = _layout_pools(shape, budget, inputs)
    warnings += _sizing_warnings(m, inputs, shape, budget, pools)
    return {
        **_shape_report(src, inputs, shape),
        "weight_bytes": weights.bytes, "weight_bytes_per_rank": weight_per_rank, "weight_source": weights.source,
        "weight_quantization": quant,
        "weight_bytes_skipped": weights.skipped_bytes, "num_params": params,
        "vision_params": (src.vision.num_params() if src.vision is not None
                          else None if src.vision_unknown is not None else 0),  # None: unknown
        "budget_bytes": budget, "budget_source": budget_source,
        "max_model_len": inputs.max_model_len, "max_num_seqs": inputs.max_num_seqs,
        "num_slots": inputs.max_num_seqs, "slot_bytes": shape.geometry.gdn_state_bytes_per_seq,
        "layout": inputs.layout, **pools,
        "serve": _serve_report(serve_weights, budget, inputs, warnings,
                               loading_bytes(src, inputs, shape.dtypes.model)),
        "warnings": warnings,
    }


def _model_source(model: str | ModelConfig | ModelSource | None) -> ModelSource:
    if isinstance(model, ModelSource):
        return model
    if isinstance(model, ModelConfig):  # handed over in code: no config.json, no weights
        return ModelSource(model, "<ModelConfig>", "config", "", None)
    return resolve_model(model)


def _with_defaults(inputs: PlanInputs, m: ModelConfig) -> PlanInputs:
    """inputs with tensor_parallel_size, block_size, max_num_seqs and max_model_len as ints (None and a
    max_model_len of 0 take their defaults)."""
    return dataclasses.replace(
        inputs, tensor_parallel_size=int(inputs.tensor_parallel_size),
        block_size=int(inputs.block_size if inputs.block_size is not None else ENGINE_DEFAULTS.get("block_size", 16)),
        max_num_seqs=int(inputs.max_num_seqs if inputs.max_num_seqs is not None
                         else ENGINE_DEFAULTS.get("max_num_seqs", 16)),
        max_model_len=int(inputs.max_model_len or m.max_position_embeddings))


def _check(inputs: PlanInputs) -> None:
    """ConfigError naming the first flag out of range, in the order the flags are checked."""
    for flag, val in (("--tensor-parallel-size", inputs.tensor_parallel_size), ("--block-size", inputs.block_size),
                      ("--max-num-seqs", inputs.max_num_seqs), ("--max-model-len", inputs.max_model_len)):
        if val < 1:
            raise ConfigError(f"{flag} must be >= 1, not {val}")
    if inputs.num_speculative_tokens < 0:
        raise ConfigError("--num-speculative-tokens must be >= 0")
    if inputs.layout not in REPORT_LAYOUTS:
        raise ConfigError(f"--layout must be one of {', '.join(REPORT_LAYOUTS)}, not {inputs.layout!r}")
    if not 0 < inputs.gpu_memory_utilization <= 1:
        raise ConfigError("--gpu-memory-utilization must be in (0, 1]")


def _cache_shape(m: ModelConfig, inputs: PlanInputs) -> CacheShape:
    """Dtypes, per-rank geometry, the hybrid block at the kernel's alignment, and the GDN pages a request holds."""
    mode, user_block = inputs.mamba_cache_mode, inputs.block_size
    dt = S.resolve_cache_dtypes(m, inputs.dtype, inputs.kv_cache_dtype, inputs.mamba_cache_dtype,
                                inputs.mamba_ssm_cache_dtype)
    g = S.geometry(m, dt.kv, dt.conv, dt.ssm, tp=inputs.tensor_parallel_size,
                   num_speculative_tokens=inputs.num_speculative_tokens)
    kernel = int(inputs.kernel_alignment) if inputs.kernel_alignment else S.kernel_alignment_for(inputs.device)
    alignment = S.alignment_for(kernel, user_block)
    engine_block = S.engine_block_size(g, user_block, "in-page", mode)
    if inputs.kernel_alignment is None and kernel == S.ENGINE_KERNEL_ALIGNMENT and mode != "all":
        block = engine_block  # this engine: --block-size rounded up to its 64-token grid
        alignment = S.alignment_for(kernel, S.ENGINE_KERNEL_ALIGNMENT * S.cdiv(user_block, kernel))
    else:
        block = S.resolve_block_size(g, kernel, user_block, mode, inputs.mamba_block_size or None)
    page_bytes = block * g.kv_bytes_per_token_per_layer
    group_size = max(1, g.n_attn_layers) if g.n_attn_layers else max(1, g.n_gdn_layers)
    pages_per_layer = S.gdn_pages_per_layer(mode, inputs.num_speculative_tokens, inputs.max_model_len, block)
    gdn_pages = g.n_gdn_layers * pages_per_layer
    return CacheShape(
        dtypes=dt, geometry=g, kernel=kernel, alignment=alignment, block=block, engine_block=engine_block,
        page_bytes=page_bytes, padding=page_bytes - g.gdn_state_bytes if g.n_gdn_layers and g.n_attn_layers else 0,
        groups=S.kv_groups(m), group_size=group_size, pages_per_layer=pages_per_layer, gdn_pages=gdn_pages,
        gdn_blocks=S.cdiv(gdn_pages, group_size) if gdn_pages else 0)


def _count_weights(src: ModelSource, inputs: PlanInputs,
                   model_dtype: str) -> tuple[WeightBytes, int | None, str | None]:
    """(the weights, the parameters counted when they were, the quantization they were counted at)."""
    m, num_params = src.config, inputs.num_params
    weights: WeightBytes | None = None
    params = None
    if inputs.weight_bytes is not None:
        weights = WeightBytes(int(inputs.weight_bytes), "--weight-bytes")
    elif src.model_dir and num_params is None:
        skip = ("mtp.",) if inputs.num_speculative_tokens == 0 else ()  # speculation loads the MTP head
        weights = model_weight_bytes(src.model_dir, skip)
    quant = inputs.quantization or _config_quantization(src)
    if quant not in (None, *QUANTIZATIONS):
        raise ConfigError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, not {quant!r}")
    if quant == "int4" and inputs.weight_bytes is None and num_params is None:
        weights = None  # quantized at load: the checkpoint's headers hold bf16, the weights as run are int4
    vision = src.vision.num_params() if src.vision is not None else 0  # the encoder stays in the model dtype
    and_vision = f", the vision encoder's {vision:,} included" if vision else \
        ", the vision encoder left out (its size is unknown)" if src.vision_unknown is not None else ""
    if weights is None and quant == "fp8" and num_params is None:
        params = S.param_count(m) + vision
        fp8_bytes, q = S.fp8_weight_bytes(m, model_dtype)
        weights = WeightBytes(fp8_bytes + vision * S.dtype_bytes(model_dtype),
                              f"block-FP8: {q:,} linear parameters x 1 B + a fp32 scale per 128 x 128 "
                              f"block, the other {params - q:,} x {model_dtype} (parameters from config.json"
                              f"{and_vision})")
    if weights is None and quant in ("gptq-int4", "int4") and num_params is None:
        params = S.param_count(m) + vision
        int4_bytes, q = S.int4_weight_bytes(m, model_dtype, quant)
        what = "GPTQ-Int4 (the dense MLP and routed experts)" if quant == "gptq-int4" else \
            "--quantize int4 (every projection)"
        weights = WeightBytes(int4_bytes + vision * S.dtype_bytes(model_dtype),
                              f"{what}: {q:,} linear parameters as linear_int4 holds them (per row and 128 k: "
                              f"64 B codes, a zero byte, a fp32 scale), the other {params - q:,} x {model_dtype} "
                              f"(parameters from config.json{and_vision})")
    if weights is None:
        params = int(num_params) if num_params is not None else S.param_count(m) + vision
        wdt = S.normalize_dtype(inputs.weight_dtype) if inputs.weight_dtype else model_dtype
        how = "--num-params" if num_params is not None else f"parameters counted from config.json{and_vision}"
        weights = WeightBytes(params * S.dtype_bytes(wdt), f"{how} ({params:,}) x {wdt}")
    return weights, params, quant


def _budget(inputs: PlanInputs, weight_per_rank: int, warnings: list[str],
            serve_weights: int = 0) -> tuple[int | None, str | None]:
    """(the cache budget per rank, where it came from); None when neither --budget nor --device-memory is
    given. Appends the warnings the budget raises."""
    if inputs.budget_bytes is not None:
        return int(inputs.budget_bytes), "--budget"
    if inputs.device_memory is None and inputs.host_memory is not None:
        host = int(inputs.host_memory)
        budget = int(host * (1 - HOST_HEADROOM)) - serve_weights - R.RUNTIME_BYTES
        source = (f"--host-memory {host:,} less {HOST_HEADROOM:.0%} headroom - weights as run {serve_weights:,} "
                  f"- runtime {R.RUNTIME_BYTES:,}")
        if budget <= 0:
            warnings.append(f"the weights as run ({serve_weights:,} B) and the runtime ({R.RUNTIME_BYTES:,} B) leave no "
                            f"room for the cache in --host-memory {host:,}")
            budget = 0
        return budget, source
    if inputs.device_memory is None:
        warnings.append("no --budget or --device-memory given (nor --host-memory): pool sizes are not computed")
        return None, None
    memory, util, reserve = inputs.device_memory, inputs.gpu_memory_utilization, int(inputs.reserve_bytes)
    budget = int(memory * util) - weight_per_rank - reserve
    source = (f"--device-memory {memory:,} x --gpu-memory-utilization {util}"
              f" - weights per rank {weight_per_rank:,} - --reserve {reserve:,}")
    if inputs.reserve_bytes == 0:
        warnings.append("runtime reserves are not modeled: activations, CUDA/HPU graphs, the sampler and "
                        "non-torch allocations come out of the same memory (pass --reserve to subtract them)")
    if budget <= 0:
        warnings.append(f"the weights ({weight_per_rank:,} B per rank) leave no room for the cache at "
                        f"--gpu-memory-utilization {util}")
        budget = 0
    return budget, source


def _layout_pools(shape: CacheShape, budget: int | None, inputs: PlanInputs) -> dict[str, Any]:
    """The plan's pool keys: each report layout's pool at the budget (None per layout without one), and the
    in-page to per-block ratio."""
    mode, seq_len = inputs.mamba_cache_mode, inputs.max_model_len
    pools: dict[str, Any] = {}
    pool_tokens: dict[str, int | None] = {}
    pool_blocks: dict[str, int | None] = {}
    concurrent: dict[str, int | None] = {}
    for name, lay in REPORT_LAYOUTS.items():
        if budget is None:
            pool_tokens[name] = pool_blocks[name] = concurrent[name] = None
            continue
        pool = S.size_pool(shape.geometry, budget, lay.page_tokens(shape.alignment, shape.block),
                           inputs.max_num_seqs, lay)
        pool_tokens[name], pool_blocks[name] = pool.pool_tokens, pool.num_pages
        concurrent[name] = S.max_concurrent_seqs(pool, seq_len, mode)
        pools[name] = {**dataclasses.asdict(pool), "layout": lay.name, "pool_tokens": pool.pool_tokens,
                       "bytes_per_page": pool.bytes_per_page, "total_bytes": pool.total_bytes,
                       "pages_per_seq": S.pages_per_seq(pool, seq_len, mode), "note": lay.note,
                       "chosen": lay is REPORT_LAYOUTS[inputs.layout]}
    ratio = None
    if budget is not None and pool_tokens["per-block"]:
        ratio = pool_tokens["in-page"] / pool_tokens["per-block"]
    return {"pool_tokens": pool_tokens, "pool_blocks": pool_blocks, "max_concurrent_seqs": concurrent,
            "pool_ratio_in_page_to_per_block": ratio, "pools": pools}


def _sizing_warnings(m: ModelConfig, inputs: PlanInputs, shape: CacheShape, budget: int | None,
                     pools: dict[str, Any]) -> list[str]:
    """What the figures mean for a deployment: hits, a pool short of the context or the slots, dtypes, TP."""
    g, dt, block, layout = shape.geometry, shape.dtypes, shape.block, inputs.layout
    max_model_len, max_num_seqs, mode = inputs.max_model_len, inputs.max_num_seqs, inputs.mamba_cache_mode
    tp, kernel = inputs.tensor_parallel_size, shape.kernel
    warnings: list[str] = []
    if mode != "none" and g.n_gdn_layers:
        unit, what = ((shape.alignment, "pages") if layout == "runs" else (block, "blocks"))
        warnings.append(f"prompts shorter than {unit} tokens never hit: a hit is a whole number of {unit}-token "
                        f"{what} (the {layout} layout)")
    if budget is not None:
        chosen, concurrent = pools["pool_tokens"][layout], pools["max_concurrent_seqs"][layout]
        short = chosen is not None and chosen < max_model_len
        if short:
            warnings.append(f"the {layout} pool holds {chosen:,} tokens, less than --max-model-len "
                            f"{max_model_len:,}: one full-length sequence does not fit")
        if budget < max_num_seqs * g.gdn_state_bytes_per_seq:
            warnings.append(f"the budget does not cover the {max_num_seqs} live GDN slots "
                            f"({max_num_seqs * g.gdn_state_bytes_per_seq:,} B); lower --max-num-seqs")
        elif not short and concurrent is not None and concurrent < max_num_seqs:
            warnings.append(f"only {concurrent} of --max-num-seqs {max_num_seqs} sequences of "
                            f"{max_model_len:,} tokens fit in the {layout} pool at once")
    if g.n_gdn_layers and (dt.ssm != dt.model or dt.conv != dt.model):
        share = 100.0 * g.gdn_ssm_bytes / g.gdn_state_bytes
        warnings.append(f"state dtype differs from weight dtype: GDN recurrent state {dt.ssm} ({dt.ssm_source}), "
                        f"conv state {dt.conv}, weights {dt.model}; the recurrent state is {share:.1f}% of the "
                        f"GDN state, so its dtype sets the state size")
    ssm_flag = inputs.mamba_ssm_cache_dtype
    if (ssm_flag != "auto" and m.mamba_ssm_dtype
            and S.normalize_dtype(ssm_flag) != S.normalize_dtype(m.mamba_ssm_dtype)):
        warnings.append(f"--mamba-ssm-cache-dtype {ssm_flag} overrides the config's mamba_ssm_dtype "
                        f"{m.mamba_ssm_dtype} (vLLM warns and uses yours); outputs will differ from the reference")
    if tp > m.num_key_value_heads:
        warnings.append(f"--tensor-parallel-size {tp} exceeds the {m.num_key_value_heads} KV heads: each rank "
                        f"holds a replicated KV head")
    if mode == "all":
        warnings.append("mamba_cache_mode all keeps a GDN state per block (pages grow with the context); "
                        "deltaserve's engine implements align")
    if kernel != S.ENGINE_KERNEL_ALIGNMENT and shape.engine_block != block:
        warnings.append(f"these are vLLM's figures at kernel alignment {kernel}; deltaserve's engine aligns to "
                        f"{S.ENGINE_KERNEL_ALIGNMENT} and uses {shape.engine_block}-token blocks in-page "
                        f"({S.ENGINE_KERNEL_ALIGNMENT}-token pages in its default runs layout)")
    return warnings


def _shape_report(src: ModelSource, inputs: PlanInputs, shape: CacheShape) -> dict[str, Any]:
    """The plan's keys up to the weights: the model, the dtypes, the block and the GDN pages."""
    m, dt, g = src.config, shape.dtypes, shape.geometry
    return {
        "model": {
            "name": src.name, "kind": src.kind, "source": src.source, "model_type": m.model_type,
            "num_hidden_layers": m.num_hidden_layers, "gdn_layers": len(m.gdn_layers),
            "attention_layers": len(m.attn_layers), "max_position_embeddings": m.max_position_embeddings,
        },
        "tensor_parallel_size": inputs.tensor_parallel_size,
        "dtypes": {"model": dt.model, "kv_cache": dt.kv, "mamba_cache": dt.conv, "mamba_ssm_cache": dt.ssm,
                   "mamba_ssm_cache_source": dt.ssm_source},
        "device": inputs.device, "kernel_alignment": shape.kernel, "user_block_size": inputs.block_size,
        "alignment": shape.alignment,
        "mamba_cache_mode": inputs.mamba_cache_mode, "num_speculative_tokens": inputs.num_speculative_tokens,
        "block_size": shape.block, "engine_block_size": shape.engine_block,
        "page_bytes": shape.page_bytes, "page_padding_bytes": shape.padding,
        "gdn_conv_bytes_per_layer": g.gdn_conv_bytes, "gdn_ssm_bytes_per_layer": g.gdn_ssm_bytes,
        "gdn_state_bytes_per_layer": g.gdn_state_bytes, "gdn_state_bytes_per_seq": g.gdn_state_bytes_per_seq,
        "kv_bytes_per_token_per_layer": g.kv_bytes_per_token_per_layer, "kv_bytes_per_token": g.kv_bytes_per_token,
        "kv_groups": [{"kind": k, "layers": list(ls)} for k, ls in shape.groups], "group_size": shape.group_size,
        "gdn_pages_per_layer": shape.pages_per_layer, "gdn_pages_per_request": shape.gdn_pages,
        "gdn_blocks_per_request": shape.gdn_blocks,
    }


# ---------------------------------------------------------------- output

def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB" if n >= 1e6 else f"{n / 1e3:,.1f} kB"


def _mib(n: int) -> str:
    if n >= 2**30:
        return f"{n / 2**30:,.2f} GiB"
    return f"{n / 2**20:,.2f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


def format_table(r: dict[str, Any]) -> str:
    """The plan as a readable table."""
    md, dt = r["model"], r["dtypes"]
    out: list[str] = []

    def row(key: str, val: str) -> None:
        out.append(f"{key:<24}{val}")

    row("model", f"{md['name']} ({md['kind']}) · {md['model_type']} · {md['num_hidden_layers']} layers: "
                 f"{md['gdn_layers']} GDN + {md['attention_layers']} attention")
    row("per TP rank", f"--tensor-parallel-size {r['tensor_parallel_size']} (heads divide by it)")
    fp8 = {"fp8": " (linears block-FP8)", "gptq-int4": " (MLP / experts GPTQ-Int4)",
           "int4": " (projections int4)"}.get(r.get("weight_quantization"), "")
    row("dtypes", f"weights {dt['model']}{fp8} · KV {dt['kv_cache']} · conv {dt['mamba_cache']} · "
                  f"SSM {dt['mamba_ssm_cache']} ({dt['mamba_ssm_cache_source']})")
    out.append("")
    conv, ssm, st = r["gdn_conv_bytes_per_layer"], r["gdn_ssm_bytes_per_layer"], r["gdn_state_bytes_per_layer"]
    row("GDN state per layer", f"{conv:,} conv + {ssm:,} recurrent = {st:,} B ({_mib(st)})")
    row("GDN state per sequence", f"{md['gdn_layers']} layers x {st:,} = {r['gdn_state_bytes_per_seq']:,} B "
                                  f"({_mb(r['gdn_state_bytes_per_seq'])})")
    row("KV per token", f"{md['attention_layers']} layers x {r['kv_bytes_per_token_per_layer']:,} = "
                        f"{r['kv_bytes_per_token']:,} B")
    a, kv1 = r["alignment"], r["kv_bytes_per_token_per_layer"]
    how = (f"{a} * cdiv({st:,}, {a} * {kv1:,})" if r["mamba_cache_mode"] != "all"
           else "lcm(chunk, alignment) * cdiv(cdiv(state, KV per token per layer), lcm)")
    row("hybrid block", f"{how} = {r['block_size']} tokens "
                        f"(alignment max(kernel {r['kernel_alignment']}, --block-size {r['user_block_size']}) = {a})")
    if r["engine_block_size"] != r["block_size"]:
        row("", f"deltaserve's engine (alignment {S.ENGINE_KERNEL_ALIGNMENT}): {r['engine_block_size']} tokens")
    row("page", f"{r['page_bytes']:,} B per layer position; GDN state padded by {r['page_padding_bytes']:,} B")
    gdn_groups = [gr for gr in r["kv_groups"] if gr["kind"] == "gdn"]
    attn_groups = [gr for gr in r["kv_groups"] if gr["kind"] == "attention"]
    row("KV groups", f"{len(attn_groups)} attention + {len(gdn_groups)} GDN, {r['group_size']} layers each "
                     "(a block belongs to one group at a time)")
    row("GDN pages per request", f"{md['gdn_layers']} mamba layer(s) x {r['gdn_pages_per_layer']} page(s) = "
                                 f"{r['gdn_pages_per_request']} page(s) per request ({r['mamba_cache_mode']} mode)"
                                 f" -> {r['gdn_blocks_per_request']} block(s)")
    out.append("")
    row("weights", f"{r['weight_bytes']:,} B ({_mib(r['weight_bytes'])}); {r['weight_source']}")
    if r["budget_bytes"] is not None:
        row("budget", f"{r['budget_bytes']:,} B ({_mib(r['budget_bytes'])}) per rank; {r['budget_source']}")
        row("live GDN slots", f"{r['num_slots']} x {r['slot_bytes']:,} B (one per running sequence)")
        out.append("")
        out.append(f"  {'layout':<17}{'pages':>10}{'tokens':>14}  {'seqs @ ' + format(r['max_model_len'], ','):>16}"
                   "  what a page costs")
        for name, p in r["pools"].items():
            mark = "*" if p["chosen"] else " "
            unit = f" x {p['block_size']}" if p["block_size"] != r["block_size"] else ""
            out.append(f"{mark} {(name + unit):<17}{p['num_pages']:>10,}{p['pool_tokens']:>14,}"
                       f"  {r['max_concurrent_seqs'][name]:>16,}  {p['bytes_per_page']:,} B: {p['note']}")
        if r["pool_ratio_in_page_to_per_block"]:
            pg = r["pool_tokens"]
            extra = (f", {pg['in-page'] / pg['per-block-group']:.2f}x per-block-group"
                     if pg.get("per-block-group") else "")
            out.append(f"  in-page holds {r['pool_ratio_in_page_to_per_block']:.2f}x the per-block pool{extra}")
    sv = r["serve"]
    out.append("")
    row("weights as run", f"{sv['weight_bytes']:,} B ({_mib(sv['weight_bytes'])}): deltaserve serve on a CPU; "
                          f"{sv['weight_source']}")
    if sv["resident_bytes"] is not None:
        row("resident", f"{sv['resident_bytes']:,} B ({_mib(sv['resident_bytes'])}) = weights as run + pool "
                        f"{sv['pool_bytes']:,} + runtime {sv['runtime_bytes']:,}"
                        + (f" (of --host-memory {_mib(sv['host_memory'])})" if sv["host_memory"] else ""))
        row("peak while loading", f"{sv['peak_loading_bytes']:,} B ({_mib(sv['peak_loading_bytes'])}) = resident + "
                                  f"the largest tensor {sv['loading_bytes']:,}, held beside the placed weights")
    if r["warnings"]:
        out.append("")
        out.append("warnings:")
        out.extend(f"  - {w}" for w in r["warnings"])
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="deltaserve plan",
        description="Memory plan of a Gated DeltaNet hybrid: GDN state and KV bytes, the hybrid block size, "
                    "GDN pages per request and the pool per layout. Flags use vLLM's names; figures are per TP rank.")
    ap.add_argument("--model", default=None,
                    help="checkpoint directory, config.json or preset "
                         f"({', '.join(preset_names(include_aliases=True))}); default: the engine's preset")
    ap.add_argument("--block-size", type=ENGINE_FLAGS["block_size"].parse, default=None,
                    help=f"vLLM's --block-size (default {ENGINE_DEFAULTS.get('block_size', 16)}); "
                         "the alignment is max(kernel block size, --block-size)")
    ap.add_argument("--device", default="deltaserve", choices=sorted(S.KERNEL_ALIGNMENTS),
                    help="sets the kernel alignment: cuda 16 (flash-attention), gaudi 128, "
                         f"cpu / deltaserve {S.ENGINE_KERNEL_ALIGNMENT} (this engine, default)")
    ap.add_argument("--kernel-alignment", type=int, default=None, help="the attention kernel's smallest block "
                    "size, overriding --device")
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    ap.add_argument("--dtype", default="auto", help="model dtype (auto = the config's)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto | bfloat16 | float16 | float32 | fp8 (fp8_e4m3, fp8_e5m2)")
    ap.add_argument("--mamba-cache-dtype", default="auto", help="GDN conv state dtype (auto = model dtype)")
    ap.add_argument("--mamba-ssm-cache-dtype", default="auto",
                    help="GDN recurrent state dtype (auto = config mamba_ssm_dtype, else the conv dtype)")
    ap.add_argument("--mamba-cache-mode", default="align", choices=S.MAMBA_CACHE_MODES,
                    help="none (no prefix caching), align (prefix caching, default), all")
    ap.add_argument("--mamba-block-size", type=int, default=None,
                    help=f"chunk the block aligns to in 'all' mode (default {S.GDN_CHUNK_SIZE}, the GDN kernel chunk)")
    ap.add_argument("--num-speculative-tokens", type=int, default=0, help="MTP tokens: conv rows and state pages")
    ap.add_argument("--max-model-len", type=ENGINE_FLAGS["max_model_len"].parse, default=None,
                    help="context length (default the config's max_position_embeddings); 256Ki = 262,144")
    ap.add_argument("--max-num-seqs", type=ENGINE_FLAGS["max_num_seqs"].parse, default=None,
                    help=f"running sequences = live GDN slots (default {ENGINE_DEFAULTS.get('max_num_seqs', 16)})")
    ap.add_argument("--layout", "--cache-layout", default=ENGINE_DEFAULTS["cache_layout"], choices=sorted(REPORT_LAYOUTS),
                    help=f"the layout warnings refer to (default: the engine's, {ENGINE_DEFAULTS['cache_layout']})")
    ap.add_argument("--budget", "--kv-cache-memory", dest="budget", type=ENGINE_FLAGS["kv_cache_memory"].parse,
                    default=None,
                    help="bytes per rank for the cache (pages + GDN slots), e.g. 20GB or 18GiB")
    ap.add_argument("--device-memory", type=parse_bytes, default=None,
                    help="device memory per rank; budget = memory x --gpu-memory-utilization - weights - --reserve")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--weight-bytes", type=parse_bytes, default=None,
                    help="total weight bytes (default: the checkpoint's safetensors headers, else parameters x dtype)")
    ap.add_argument("--num-params", type=parse_count, default=None, help="parameter count, e.g. 27B")
    ap.add_argument("--weight-dtype", default=None, help="dtype for --num-params (default the model dtype)")
    ap.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                    help="count the weights as a block-FP8 checkpoint (fp8: Qwen's -FP8 format, quantized linears at "
                         "1 B + scales), a GPTQ-Int4 one (gptq-int4: Qwen's -GPTQ-Int4 format, the MLP and experts "
                         "int4), or as --quantize int4 runs them (int4: every projection int4); int4 weights are "
                         "counted as linear_int4 holds them (69 B per row and 128 k); default: the config.json's "
                         "quantization_config")
    ap.add_argument("--reserve", type=parse_bytes, default=0,
                    help="bytes for activations, graphs and other runtime reserves (not modeled; default 0)")
    ap.add_argument("--host-memory", type=parse_bytes, default=None,
                    help="the machine's memory, for deltaserve serve on a CPU: the pool is what is left after "
                         f"{HOST_HEADROOM:.0%}% headroom, the weights as run and the runtime; resident is checked "
                         "against it")
    ap.add_argument("--limit-mm-per-prompt", type=parse_mm_limits, default=DEFAULT_MM_LIMITS, metavar="JSON",
                    help="as the engine's flag: '{\"image\": 0}' leaves the vision encoder out of the weights as run")
    ap.add_argument("--quantize-head", choices=QUANTIZE_HEAD_CHOICES, default="none",
                    help="as the engine's flag: the head as run (fp8: block-FP8)")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        r = plan(args.model, PlanInputs.from_args(args))
    except (ConfigError, OSError, ValueError) as e:
        print(f"deltaserve plan: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(r, indent=2) if args.json else format_table(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
