"""The memory arithmetic: GDN state bytes, KV bytes per token, the hybrid block size, pool sizes.

One module used by the engine (to size its pool), the planner (`deltaserve plan`) and the
simulator, so they can never disagree. Pure Python, no torch. Everything is per TP rank.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import DTYPE_BYTES, ConfigError, ModelConfig
from .layouts import PER_BLOCK_STATES, CacheLayout, layout_for

ENGINE_KERNEL_ALIGNMENT = 64  # deltaserve's GDN chunk: blocks are multiples of it (docs/design.md, the 64-token grid)
# The layouts (where checkpoints live, how many pages they take) are the classes of layouts.py.
MAMBA_CACHE_MODES = ("none", "align", "all")  # vLLM's cache_config.mamba_cache_mode
# The attention kernel's smallest block size: vLLM flash-attention on CUDA, vllm-gaudi, and this engine
# (whose blocks are multiples of its GDN chunk on every device).
KERNEL_ALIGNMENTS = {"cuda": 16, "gaudi": 128, "cpu": ENGINE_KERNEL_ALIGNMENT, "deltaserve": ENGINE_KERNEL_ALIGNMENT}
# GDN chunk size used for mamba_cache_mode "all" when the config names none (mamba_chunk_size / chunk_size).
GDN_CHUNK_SIZE = 64

_DTYPE_ALIASES = {
    "bf16": "bfloat16", "half": "float16", "fp16": "float16", "float": "float32", "fp32": "float32",
    "fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8", "fp8_inc": "fp8",
}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def normalize_dtype(name: str) -> str:
    """'torch.bfloat16' / 'bf16' / 'fp8_e4m3' -> the DTYPE_BYTES name ('bfloat16', 'fp8', ...)."""
    key = str(name).replace("torch.", "").strip().lower()
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        raise ConfigError(f"unknown dtype {name!r}; known: {', '.join(sorted(set(DTYPE_BYTES) | set(_DTYPE_ALIASES)))}")
    return key


def dtype_bytes(name: str) -> int:
    try:
        return DTYPE_BYTES[name]
    except KeyError:
        return DTYPE_BYTES[normalize_dtype(name)]


@dataclass(frozen=True)
class Geometry:
    """Per-TP-rank byte sizes of one model's caches."""

    n_attn_layers: int
    n_gdn_layers: int
    kv_bytes_per_token_per_layer: int  # K + V of one attention layer for one token
    gdn_conv_bytes: int  # conv window of one GDN layer for one sequence
    gdn_ssm_bytes: int  # recurrent state of one GDN layer for one sequence

    @property
    def gdn_state_bytes(self) -> int:
        """One GDN layer's whole state for one sequence (conv + recurrent)."""
        return self.gdn_conv_bytes + self.gdn_ssm_bytes

    @property
    def gdn_state_bytes_per_seq(self) -> int:
        return self.n_gdn_layers * self.gdn_state_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return self.n_attn_layers * self.kv_bytes_per_token_per_layer


def geometry(m: ModelConfig, kv_dtype: str, conv_dtype: str, ssm_dtype: str, tp: int = 1,
             num_speculative_tokens: int = 0) -> Geometry:
    """Bytes per rank. Heads divide by tp; KV heads are replicated when tp exceeds them (as vLLM does)."""
    if m.linear_num_key_heads % tp or m.linear_num_value_heads % tp:
        raise ConfigError(f"GDN heads ({m.linear_num_key_heads} key, {m.linear_num_value_heads} value) "
                          f"do not divide by tensor-parallel size {tp}")
    kv_heads = max(1, m.num_key_value_heads // tp)
    kv = 2 * kv_heads * m.head_dim * dtype_bytes(kv_dtype)
    conv_rows = m.linear_conv_kernel_dim - 1 + num_speculative_tokens
    conv = m.conv_dim // tp * conv_rows * dtype_bytes(conv_dtype)
    ssm = (m.linear_num_value_heads // tp) * m.linear_value_head_dim * m.linear_key_head_dim * dtype_bytes(ssm_dtype)
    return Geometry(len(m.attn_layers), len(m.gdn_layers), kv, conv, ssm)


def hybrid_block_size(g: Geometry, alignment: int) -> int:
    """vLLM's rule: the smallest multiple of `alignment` whose attention page holds one GDN layer state.

    alignment = max(the attention kernel's smallest block size, --block-size).
    """
    if g.n_gdn_layers == 0 or g.n_attn_layers == 0:
        return alignment
    return alignment * cdiv(g.gdn_state_bytes, alignment * g.kv_bytes_per_token_per_layer)


def alignment_for(kernel_block_size: int, user_block_size: int) -> int:
    return max(kernel_block_size, user_block_size)


def kernel_alignment_for(device: str) -> int:
    """The smallest attention kernel block size: cuda 16, gaudi 128, cpu / deltaserve 64 (this engine)."""
    try:
        return KERNEL_ALIGNMENTS[device]
    except KeyError:
        raise ConfigError(f"unknown device {device!r}; known: {', '.join(KERNEL_ALIGNMENTS)}") from None


def resolve_block_size(g: Geometry, kernel_block_size: int, user_block_size: int = 16,
                       mamba_cache_mode: str = "align", mamba_chunk_size: int | None = None) -> int:
    """The block size vLLM ends up with (platform _align_hybrid_block_size), for any cache mode.

    none / align: hybrid_block_size(g, max(kernel, --block-size)); all: the block is also a multiple of
    the mamba chunk size: lcm(chunk, alignment) * cdiv(cdiv(state, kv per token per layer), lcm).
    The user's --block-size wins only when it is larger.
    """
    if mamba_cache_mode not in MAMBA_CACHE_MODES:
        raise ConfigError(f"mamba_cache_mode must be one of {MAMBA_CACHE_MODES}, not {mamba_cache_mode!r}")
    alignment = alignment_for(kernel_block_size, user_block_size)
    if g.n_gdn_layers == 0 or g.n_attn_layers == 0:
        return user_block_size
    if mamba_cache_mode == "all":
        chunk = math.lcm(mamba_chunk_size or GDN_CHUNK_SIZE, alignment)
        block = chunk * cdiv(cdiv(g.gdn_state_bytes, g.kv_bytes_per_token_per_layer), chunk)
    else:
        block = hybrid_block_size(g, alignment)
    return max(user_block_size, block)


def engine_block_size(g: Geometry, user_block_size: int, layout: str | CacheLayout,
                      mamba_cache_mode: str = "align", kernel_alignment: int = ENGINE_KERNEL_ALIGNMENT) -> int:
    """The page this engine uses: --block-size rounded up to a multiple of ENGINE_KERNEL_ALIGNMENT (its GDN
    chunk grid), then the layout's choice between that alignment and vLLM's hybrid block at it.

    kernel_alignment: another engine's smallest kernel block (KERNEL_ALIGNMENTS, e.g. cuda 16), when the
    simulator replays that engine (sim/external_replay.py); this engine always uses its own."""
    user = kernel_alignment * cdiv(user_block_size, kernel_alignment)
    return layout_for(layout).page_tokens(user, resolve_block_size(g, kernel_alignment, user, mamba_cache_mode))


def gdn_pages_per_layer(mamba_cache_mode: str, num_speculative_tokens: int = 0, max_model_len: int = 0,
                        block_size: int = 1) -> int:
    """GDN pages one request holds per GDN layer (vLLM MambaSpec.max_memory_usage_bytes / page size):
    1 + N without caching, 2 + N in align mode (running state + last checkpoint), one per block in all mode."""
    n = num_speculative_tokens
    if mamba_cache_mode == "none":
        return 1 + n
    if mamba_cache_mode == "align":
        return 2 + n
    if mamba_cache_mode == "all":
        return cdiv(max_model_len, block_size) + n
    raise ConfigError(f"mamba_cache_mode must be one of {MAMBA_CACHE_MODES}, not {mamba_cache_mode!r}")


def kv_groups(m: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """vLLM's KV cache groups: one attention group, the GDN layers cut into groups of the same layer count.

    A block belongs to one group at a time; every group has group_size layer positions (the last GDN
    group may be short, vLLM pads it).
    """
    attn, gdn = m.attn_layers, m.gdn_layers
    size = len(attn) or len(gdn) or 1
    groups: list[tuple[str, tuple[int, ...]]] = [("attention", attn)] if attn else []
    groups += [("gdn", gdn[i:i + size]) for i in range(0, len(gdn), size)]
    return groups


@dataclass(frozen=True)
class CacheDtypes:
    """Resolved dtypes of the caches, as vLLM resolves 'auto'."""

    model: str  # weights / activations
    kv: str  # attention K/V (--kv-cache-dtype)
    conv: str  # GDN conv window (--mamba-cache-dtype)
    ssm: str  # GDN recurrent state (--mamba-ssm-cache-dtype)
    ssm_source: str  # where the SSM dtype came from


def resolve_cache_dtypes(m: ModelConfig, dtype: str = "auto", kv_cache_dtype: str = "auto",
                         mamba_cache_dtype: str = "auto", mamba_ssm_cache_dtype: str = "auto") -> CacheDtypes:
    """vLLM's rules: KV and conv dtypes 'auto' = the model dtype; SSM dtype 'auto' = the config's
    mamba_ssm_dtype (vLLM's Qwen3.5 config hook), else the conv dtype (MambaStateDtypeCalculator), which is
    the model dtype on Qwen3-Next."""
    model = normalize_dtype(m.dtype if dtype == "auto" else dtype)
    kv = model if kv_cache_dtype == "auto" else normalize_dtype(kv_cache_dtype)
    conv = model if mamba_cache_dtype == "auto" else normalize_dtype(mamba_cache_dtype)
    if mamba_ssm_cache_dtype != "auto":
        ssm, src = normalize_dtype(mamba_ssm_cache_dtype), "--mamba-ssm-cache-dtype"
    elif m.mamba_ssm_dtype:
        ssm, src = normalize_dtype(m.mamba_ssm_dtype), "config mamba_ssm_dtype"
    else:
        ssm, src = conv, "auto: the conv-state dtype (config has no mamba_ssm_dtype)"
    return CacheDtypes(model, kv, conv, ssm, src)


def param_count(m: ModelConfig) -> int:
    """Parameters of the text model as config.json describes it (no MTP head, no vision tower).

    Gated attention (q_proj doubled for the output gate, q/k norms), GDN (qkv, z, b, a projections, conv,
    dt_bias, A_log, gated norm, out_proj), dense or MoE MLP (router, experts, shared expert and its gate).
    """
    h, v = m.hidden_size, m.vocab_size
    total = v * h * (1 if m.tie_word_embeddings else 2) + h  # embeddings, lm_head, final norm
    hd = m.head_dim
    attn = (h * m.num_attention_heads * hd * 2 + 2 * h * m.num_key_value_heads * hd
            + m.num_attention_heads * hd * h + 2 * hd)
    hv, dv = m.linear_num_value_heads, m.linear_value_head_dim
    gdn = (h * m.conv_dim + h * hv * dv + 2 * h * hv + m.conv_dim * m.linear_conv_kernel_dim
           + 2 * hv + dv + hv * dv * h)
    for i, kind in enumerate(m.layer_types):
        total += 2 * h + (attn if kind == "full_attention" else gdn)
        if m.is_moe_layer(i):
            total += h * m.num_experts + m.num_experts * 3 * h * m.moe_intermediate_size
            if m.shared_expert_intermediate_size:
                total += 3 * h * m.shared_expert_intermediate_size + h
        else:
            total += 3 * h * m.intermediate_size
    return total


def fp8_linear_shapes(m: ModelConfig) -> list[tuple[int, int]]:
    """[out, in] of every linear a block-FP8 checkpoint quantizes, by Qwen's -FP8 rule (model/make.py
    FP8_LINEARS): attention q/k/v/o, GDN in_proj_qkv / in_proj_z (qwen3_next: in_proj_qkvz) and out_proj, the
    dense MLP, every expert and the shared expert. Embeddings, the head, norms, conv, in_proj_a / b, the router
    and the shared-expert gate stay in the model dtype."""
    h, hd = m.hidden_size, m.head_dim
    hq, hkv = m.num_attention_heads, m.num_key_value_heads
    vd = m.linear_num_value_heads * m.linear_value_head_dim
    out: list[tuple[int, int]] = []
    for i, kind in enumerate(m.layer_types):
        if kind == "full_attention":
            out += [(2 * hq * hd, h), (hkv * hd, h), (hkv * hd, h), (h, hq * hd)]
        elif m.model_type == "qwen3_next":
            out += [(m.conv_dim + vd, h), (h, vd)]
        else:
            out += [(m.conv_dim, h), (vd, h), (h, vd)]
        if m.is_moe_layer(i):
            mi = m.moe_intermediate_size
            out += [(mi, h), (mi, h), (h, mi)] * m.num_experts
            if m.shared_expert_intermediate_size:
                si = m.shared_expert_intermediate_size
                out += [(si, h), (si, h), (h, si)]
        else:
            out += [(m.intermediate_size, h), (m.intermediate_size, h), (h, m.intermediate_size)]
    return out


def fp8_weight_bytes(m: ModelConfig, dtype: str) -> tuple[int, int]:
    """(weight bytes, quantized parameters) of the model as a block-FP8 checkpoint: the fp8_linear_shapes at one
    byte per parameter plus one fp32 scale per 128 x 128 block (partial blocks rounded up), every other
    parameter at `dtype`."""
    shapes = fp8_linear_shapes(m)
    q = sum(n * k for n, k in shapes)
    scales = sum(cdiv(n, 128) * cdiv(k, 128) for n, k in shapes)
    return (param_count(m) - q) * dtype_bytes(dtype) + q + 4 * scales, q


# ---- int4 weights as the compiled linear_int4 holds them (model/ops/int4.py, csrc/linear_int4.cpp)

INT4_COLS = 16  # output rows per packed column block: a weight's rows round up to it
INT4_GROUP = 128  # Qwen's GPTQ-Int4 group and --quantize int4's


def int4_run_bytes(n: int, k: int, group: int = INT4_GROUP) -> int:
    """An int4 [n, k] weight packed for linear_int4: per output row (rounded up to 16) and group of k (k rounded
    up to whole groups), group / 2 bytes of codes, a 1-byte zero and a fp32 scale: 69 B per 128 weights."""
    return cdiv(n, INT4_COLS) * INT4_COLS * cdiv(k, group) * (group // 2 + 1 + 4)


def mlp_run_shapes(m: ModelConfig, shared: bool = True) -> list[tuple[int, int]]:
    """[out, in] of the MLP projections as the layers fuse them: the dense gate_up and down, each routed
    expert's, and (shared) the shared expert's."""
    h = m.hidden_size
    out: list[tuple[int, int]] = []
    for i in range(m.num_hidden_layers):
        if m.is_moe_layer(i):
            mi = m.moe_intermediate_size
            out += [(2 * mi, h), (h, mi)] * m.num_experts
            if shared and m.shared_expert_intermediate_size:
                si = m.shared_expert_intermediate_size
                out += [(2 * si, h), (h, si)]
        else:
            out += [(2 * m.intermediate_size, h), (h, m.intermediate_size)]
    return out


def mixer_run_shapes(m: ModelConfig) -> list[tuple[int, int]]:
    """[out, in] of the attention and GDN projections as the layers fuse them (qkv_proj + o_proj; GDN in_proj =
    qkv | z | b | a, out_proj)."""
    h, hd = m.hidden_size, m.head_dim
    hq, hkv = m.num_attention_heads, m.num_key_value_heads
    vd = m.linear_num_value_heads * m.linear_value_head_dim
    out: list[tuple[int, int]] = []
    for kind in m.layer_types:
        if kind == "full_attention":
            out += [((2 * hq + 2 * hkv) * hd, h), (h, hq * hd)]
        else:
            out += [(m.conv_dim + vd + 2 * m.linear_num_value_heads, h), (h, vd)]
    return out


def int4_weight_bytes(m: ModelConfig, dtype: str, quantization: str, group: int = INT4_GROUP) -> tuple[int, int]:
    """(weight bytes as run, int4 parameters) of the text model with int4 linears packed for linear_int4 (groups
    of 128), every other parameter at `dtype`. quantization "gptq-int4": Qwen's -GPTQ-Int4 checkpoints (the dense
    MLP and the routed experts int4; attention, GDN, the shared expert, the router, embeddings and head bf16);
    "int4": --quantize int4 at load (every projection of the text model: attention, GDN, MLP, experts, shared
    expert; the router, the shared-expert gate, embeddings and head stay in dtype); group: 32 for int4-g32."""
    shapes = mlp_run_shapes(m, shared=quantization == "int4")
    if quantization == "int4":
        shapes += mixer_run_shapes(m)
    q = sum(n * k for n, k in shapes)
    return (param_count(m) - q) * dtype_bytes(dtype) + sum(int4_run_bytes(n, k, group) for n, k in shapes), q


@dataclass(frozen=True)
class Pool:
    """How a byte budget splits into pages and GDN slots for one layout.

    The pool has `group_size` layer positions; page p at position i is page_bytes long. An attention
    layer uses one position; the GDN layers are cut into `num_gdn_groups` groups of group_size layers,
    and a checkpoint of group g keeps one state of each of its layers at their layer positions, in
    pages_per_state pages (layouts.py: in the pool, or in a tensor beside it).
    """

    layout: CacheLayout
    block_size: int
    page_bytes: int  # one layer position of one page: block_size * kv_bytes_per_token_per_layer
    page_padding_bytes: int  # bytes of a checkpoint's pages that its GDN layer state leaves unused
    group_size: int  # layer positions per page (= attention layer count)
    num_gdn_groups: int
    num_slots: int  # live GDN state slots (one per running sequence)
    slot_bytes: int  # all GDN layers' state for one sequence
    num_pages: int
    per_page_state_bytes: int  # the layout's state tensor beside the pool, bytes per page (0: none)
    pages_per_state: int = 1  # pages one GDN layer state spans

    @property
    def checkpoint_pages(self) -> int:
        """Pool pages one checkpoint takes (0 where checkpoints live beside the pool)."""
        return self.layout.checkpoint_pages(self.num_gdn_groups, self.pages_per_state)

    @property
    def pool_tokens(self) -> int:
        return self.num_pages * self.block_size

    @property
    def bytes_per_page(self) -> int:
        """What one page costs from the budget, every layer position and any per-page state."""
        return self.group_size * self.page_bytes + self.per_page_state_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_pages * self.bytes_per_page + self.num_slots * self.slot_bytes


def size_pool(g: Geometry, budget_bytes: int, block_size: int, num_slots: int, layout: str | CacheLayout,
              per_block_state: str | None = None) -> Pool:
    """Split `budget_bytes` into `num_slots` live GDN slots and as many pages as fit, for `layout`
    (layouts.py; a name or the object). per_block_state ("model" or "group") picks the per-block variant:
    one whole-model state per page, or one GDN group's state per page as vllm-gaudi's tensors hold."""
    if per_block_state is not None:
        if per_block_state not in PER_BLOCK_STATES:
            raise ConfigError(f"per_block_state must be one of {', '.join(PER_BLOCK_STATES)}, not {per_block_state!r}")
        if layout_for(layout).in_pool:
            raise ConfigError(f"per_block_state applies to the per-block layout, not {layout_for(layout).name}")
        layout = PER_BLOCK_STATES[per_block_state]
    lay = layout_for(layout)
    group_size = max(1, g.n_attn_layers)
    num_gdn_groups = cdiv(g.n_gdn_layers, group_size) if g.n_gdn_layers else 0
    page_bytes = block_size * g.kv_bytes_per_token_per_layer
    per_state = lay.pages_per_state(g.gdn_state_bytes if g.n_gdn_layers else 0, page_bytes)
    per_page_state = lay.side_bytes(g, group_size)
    slot_bytes = g.gdn_state_bytes_per_seq
    left = budget_bytes - num_slots * slot_bytes
    num_pages = max(0, left // (group_size * page_bytes + per_page_state))
    return Pool(lay, block_size, page_bytes,
                    per_state * page_bytes - g.gdn_state_bytes if g.n_gdn_layers else 0,
                    group_size, num_gdn_groups, num_slots, slot_bytes, num_pages, per_page_state, per_state)


def pages_per_seq(p: Pool, seq_len: int, mamba_cache_mode: str = "align") -> int:
    """Pool pages one sequence of seq_len tokens holds: its attention pages, plus, in-page with caching on,
    the pages of its GDN checkpoints (checkpoint_pages per checkpoint: the latest in align mode, one per
    block in all mode). The per-block layout keeps checkpoints in its side tensor, not in pages."""
    pages = cdiv(seq_len, p.block_size)
    if mamba_cache_mode != "none":
        pages += p.checkpoint_pages * (1 if mamba_cache_mode == "align" else cdiv(seq_len, p.block_size))
    return pages


def max_concurrent_seqs(p: Pool, seq_len: int, mamba_cache_mode: str = "align") -> int:
    """How many sequences of seq_len tokens fit at once: bounded by the live slots and by the pages."""
    return min(p.num_slots, p.num_pages // max(1, pages_per_seq(p, seq_len, mamba_cache_mode)))
