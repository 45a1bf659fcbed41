"""Build the memory manager and the scheduler from a model's geometry and the engine's flags.

One function for the engine and the simulator, so the block size, the pool, the GDN slots and the
chunking rules of a simulated replica are the ones the engine would have. Pure Python, no torch.

    shape, memory, scheduler = build(model_config, EngineConfig(...), kv_cache_memory=64 << 20)

The cache layout is chosen here, once, from --cache-layout (layouts.py); the page size is the layout's
choice at this engine's alignment (--block-size rounded up to a multiple of the 64-token GDN chunk: the
runs layout takes that alignment, in-page and per-block vLLM's hybrid block at it); the pool is
sizing.size_pool over the cache budget with one GDN slot per --max-num-seqs; the conv state and KV take the
model dtype and the recurrent state float32.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import ENGINE_DEFAULTS, ConfigError, EngineConfig, ModelConfig, resolve_dtype
from ..memory.layouts import layout_for
from ..memory.eviction import EVICTION_POLICIES
from ..memory.manager import MemoryManager
from ..memory.sizing import ENGINE_KERNEL_ALIGNMENT, Geometry, Pool, engine_block_size, geometry, size_pool
from .scheduler import Scheduler

@dataclass(frozen=True)
class EngineShape:
    """What the engine derives from the model and its flags before it allocates anything."""

    dtype: str
    geometry: Geometry
    block_size: int
    pool: Pool
    max_model_len: int


def resolve_shape(mc: ModelConfig, *, dtype: str = "auto", block_size: int = ENGINE_DEFAULTS["block_size"],
                  kv_cache_memory: int, max_num_seqs: int, cache_layout: str = ENGINE_DEFAULTS["cache_layout"],
                  max_model_len: int | None = None, enable_prefix_caching: bool = True,
                  kernel_alignment: int = ENGINE_KERNEL_ALIGNMENT, tensor_parallel_size: int = 1) -> EngineShape:
    """The engine's block size, pool and max model length for a cache budget of kv_cache_memory bytes.

    The max model length defaults to what one request can hold in the pool (the memory manager holds
    checkpoint pages back in align mode). Raises ConfigError where the engine would refuse to start.
    kernel_alignment: the smallest kernel block of the engine being simulated (sizing.KERNEL_ALIGNMENTS; a
    foreign engine replayed by sim/external_replay.py); this engine's own by default. tensor_parallel_size: the
    pool is one rank's (kv_cache_memory is per rank, every size is sizing.geometry's per-rank figure)."""
    dt = resolve_dtype(dtype, mc)
    geom = geometry(mc, kv_dtype=dt, conv_dtype=dt, ssm_dtype="float32", tp=tensor_parallel_size)
    layout = layout_for(cache_layout)
    bs = engine_block_size(geom, block_size, layout, kernel_alignment=kernel_alignment)
    pool = size_pool(geom, kv_cache_memory, bs, max_num_seqs, layout)
    if pool.num_pages < 2:
        raise ConfigError(f"a {kv_cache_memory:,}-byte cache budget holds {pool.num_pages} pages of {bs} tokens "
                          f"after {pool.num_slots} GDN slots of {pool.slot_bytes:,} bytes; raise --kv-cache-memory "
                          f"or lower --max-num-seqs")
    cap = MemoryManager.from_pool(pool, caching=enable_prefix_caching).max_request_tokens()
    max_len = max_model_len or min(mc.max_position_embeddings, cap)
    if max_len > cap:
        raise ConfigError(f"--max-model-len {max_len} exceeds what one request can hold in the KV pool "
                          f"({cap:,} of {pool.pool_tokens:,} tokens); raise --kv-cache-memory or lower "
                          f"--max-model-len")
    return EngineShape(dt, geom, bs, pool, max_len)


def build_scheduler(shape: EngineShape, *, max_num_seqs: int, max_num_batched_tokens: int,
                    enable_prefix_caching: bool = True, prefill_merge_tokens: int = 0,
                    checkpoint_grid: int = 0, chunk_grid: int | None = None,
                    replay_decode: bool = True, reprefill_outputs: bool = False,
                    reprefill_job_tokens: int = ENGINE_DEFAULTS["reprefill_job_tokens"],
                    eviction: str = "lru", encoder_budget: int | None = None,
                    resume_points: int = 1 << 30) -> tuple[MemoryManager, Scheduler]:
    """A fresh MemoryManager and the Scheduler over it, as the engine builds them. checkpoint_grid is rounded up
    to a multiple of the page (0 = off). chunk_grid and replay_decode are the Scheduler's (defaults: the
    engine's); a simulated foreign engine passes its own (vLLM: chunk_grid 1, replay_decode False).
    reprefill_job_tokens: the Scheduler's job_tokens. resume_points: the Scheduler's per-request budget (count)."""
    memory = MemoryManager.from_pool(shape.pool, caching=enable_prefix_caching, eviction=EVICTION_POLICIES[eviction]())
    bs = shape.block_size
    return memory, Scheduler(memory, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             prefill_merge_tokens=prefill_merge_tokens, checkpoint_grid=-(-checkpoint_grid // bs) * bs,
                             chunk_grid=chunk_grid, replay_decode=replay_decode,
                             reprefill_outputs=reprefill_outputs, job_tokens=reprefill_job_tokens,
                             encoder_budget=encoder_budget, resume_points=resume_points)


def state_log_bytes(shape: EngineShape, mc: ModelConfig, num_speculative_tokens: int) -> int:
    """The speculative state log's bytes (runner/cache.py CacheStore.enable_state_log): per slot, draft position and
    GDN layer, the conv state and one token's recurrence inputs (conv_dim + Hv values in the conv dtype, Hv fp32
    gates); the recurrent state itself is never logged."""
    g = shape.geometry
    conv_dtype_bytes = g.gdn_conv_bytes // ((mc.linear_conv_kernel_dim - 1) * mc.conv_dim)
    inputs = (mc.conv_dim + mc.linear_num_value_heads) * conv_dtype_bytes + mc.linear_num_value_heads * 4
    return shape.pool.num_slots * num_speculative_tokens * g.n_gdn_layers * (g.gdn_conv_bytes + inputs)


def build(mc: ModelConfig, cfg: EngineConfig, kv_cache_memory: int,
          dtype: str | None = None, tp: int | None = None) -> tuple[EngineShape, MemoryManager, Scheduler]:
    """Everything the engine (and a simulated replica) derives from its flags: the shape, then the memory
    manager and the scheduler over it. dtype overrides cfg.dtype (a simulated replica: the bundle's); tp
    overrides cfg.tensor_parallel_size (a simulated replica: its own tp). kv_cache_memory is one rank's.
    Speculative decoding: the per-position state log (runner/cache.py CacheStore.enable_state_log) comes out of the
    budget before the pool is sized."""
    def shape_for(budget: int) -> EngineShape:
        return resolve_shape(mc, dtype=dtype or cfg.dtype, block_size=cfg.block_size, kv_cache_memory=budget,
                             max_num_seqs=cfg.max_num_seqs, cache_layout=cfg.cache_layout,
                             max_model_len=cfg.max_model_len, enable_prefix_caching=cfg.enable_prefix_caching,
                             tensor_parallel_size=tp or cfg.tensor_parallel_size)

    shape = shape_for(kv_cache_memory)
    if cfg.speculative_config is not None:
        shape = shape_for(kv_cache_memory - state_log_bytes(shape, mc, cfg.speculative_config.num_speculative_tokens))
    pool_bytes = shape.pool.num_pages * shape.pool.bytes_per_page
    memory, scheduler = build_scheduler(shape, max_num_seqs=cfg.max_num_seqs,
                                        max_num_batched_tokens=cfg.max_num_batched_tokens,
                                        enable_prefix_caching=cfg.enable_prefix_caching,
                                        prefill_merge_tokens=cfg.prefill_merge_tokens,
                                        checkpoint_grid=cfg.checkpoint_grid,
                                        reprefill_outputs=cfg.reprefill_outputs,
                                        reprefill_job_tokens=cfg.reprefill_job_tokens, eviction=cfg.eviction,
                                        encoder_budget=cfg.max_num_encoder_input_tokens,
                                        resume_points=resume_point_budget(cfg, shape.pool.slot_bytes, pool_bytes))
    return shape, memory, scheduler


def context_budget(mc: ModelConfig, cfg: EngineConfig, tokens: int, dtype: str | None = None) -> int:
    """The smallest cache budget (bytes) in which build() makes a pool that holds one request of `tokens` tokens
    (what --max-model-len asks for): the GDN slots of --max-num-seqs, the request's pages, the two checkpoints a
    sequence may hold in the pool (MemoryManager.max_request_tokens), and the speculative state log where
    decoding drafts. build() at that budget is the check."""
    dt = resolve_dtype(dtype or cfg.dtype, mc)
    geom = geometry(mc, kv_dtype=dt, conv_dtype=dt, ssm_dtype="float32", tp=cfg.tensor_parallel_size)
    layout = layout_for(cfg.cache_layout)
    bs = engine_block_size(geom, cfg.block_size, layout)
    pool = size_pool(geom, 0, bs, cfg.max_num_seqs, layout)  # no pages: the per-page and per-slot figures
    per_page = pool.group_size * pool.page_bytes + pool.per_page_state_bytes
    checkpoints = pool.checkpoint_pages if cfg.enable_prefix_caching else 0
    budget = pool.num_slots * pool.slot_bytes + (-(-tokens // bs) + 2 * checkpoints) * per_page
    if cfg.speculative_config is not None:
        budget += state_log_bytes(EngineShape(dt, geom, bs, pool, 0), mc, cfg.speculative_config.num_speculative_tokens)
    build(mc, replace(cfg, max_model_len=tokens), budget, dtype)  # ConfigError if it did not hold them
    return budget


# A request's resume points take at most this share of the pool unless --resume-point-bytes says otherwise: a
# checkpoint of every GDN layer weighs as much as ~1,600 tokens of KV on the 0.8B shape, so a count alone would let
# one long prompt's grid fill half a 2 GiB pool, and the next prompt's later points (the ones nearest where
# sessions part) then find no free page
RESUME_POOL_SHARE = 8


def resume_point_budget(cfg: EngineConfig, checkpoint_bytes: int, pool_bytes: int = 0) -> int:
    """How many resume points one request keeps: --resume-points, fewer when their checkpoints (checkpoint_bytes
    each: every GDN layer's state, one sequence's slot) would take more than --resume-point-bytes, or by default
    (0) more than 1 / RESUME_POOL_SHARE of the pool's pool_bytes."""
    n = cfg.resume_points
    bound = cfg.resume_point_bytes or pool_bytes // RESUME_POOL_SHARE
    if bound and checkpoint_bytes:
        n = min(n, bound // checkpoint_bytes)
    return n
