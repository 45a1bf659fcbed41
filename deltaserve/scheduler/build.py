"""Build the memory manager and the scheduler from a model's geometry and the engine's flags.

One function for the engine and the simulator, so the block size, the pool, the GDN slots and the
chunking rules of a simulated replica are the ones the engine would have. Pure Python, no torch.

    shape = resolve_shape(model_config, dtype="bfloat16", block_size=16, kv_cache_memory=64 << 20,
                          max_num_seqs=8)
    memory, scheduler = build_scheduler(shape, max_num_seqs=8, max_num_batched_tokens=512,
                                        enable_prefix_caching=True)

This mirrors LLMEngine.__init__ (engine.py): the block size is vLLM's rule at this engine's alignment
(--block-size rounded up to a multiple of the 64-token GDN chunk; the runs layout takes that alignment
itself as its block, and a GDN state spans several pages), the pool is sizing.plan_pool over the
cache budget with one GDN slot per --max-num-seqs, the conv state and KV take the model dtype and the
recurrent state float32.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import ConfigError, ModelConfig
from ..memory.manager import MemoryManager
from ..sizing import Geometry, PoolPlan, engine_block_size, geometry, plan_pool
from .scheduler import Scheduler

MODEL_DTYPES = ("bfloat16", "float16", "float32")


def resolve_dtype(requested: str, mc: ModelConfig) -> str:
    """--dtype auto = the checkpoint's dtype; anything the engine cannot run falls back to bfloat16."""
    d = mc.dtype if requested == "auto" else requested
    return d if d in MODEL_DTYPES else "bfloat16"


@dataclass(frozen=True)
class EngineShape:
    """What the engine derives from the model and its flags before it allocates anything."""

    dtype: str
    geometry: Geometry
    block_size: int
    pool: PoolPlan
    max_model_len: int


def resolve_shape(mc: ModelConfig, *, dtype: str = "auto", block_size: int = 16, kv_cache_memory: int,
                  max_num_seqs: int, cache_layout: str = "runs", max_model_len: int | None = None,
                  enable_prefix_caching: bool = True) -> EngineShape:
    """The engine's block size, pool and max model length for a cache budget of kv_cache_memory bytes.

    The max model length defaults to what one request can hold in the pool (the memory manager holds
    checkpoint pages back in align mode). Raises ConfigError where the engine would refuse to start."""
    dt = resolve_dtype(dtype, mc)
    geom = geometry(mc, kv_dtype=dt, conv_dtype=dt, ssm_dtype="float32")
    bs = engine_block_size(geom, block_size, layout=cache_layout)
    pool = plan_pool(geom, kv_cache_memory, bs, max_num_seqs, cache_layout)
    if pool.num_pages < 2:
        raise ConfigError(f"a {kv_cache_memory:,}-byte cache budget holds {pool.num_pages} pages of {bs} tokens "
                          f"after {pool.num_slots} GDN slots of {pool.slot_bytes:,} bytes; raise --kv-cache-memory "
                          f"or lower --max-num-seqs")
    cap = MemoryManager.from_plan(pool, caching=enable_prefix_caching).max_request_tokens()
    max_len = max_model_len or min(mc.max_position_embeddings, cap)
    if max_len > cap:
        raise ConfigError(f"--max-model-len {max_len} exceeds what one request can hold in the KV pool "
                          f"({cap:,} of {pool.pool_tokens:,} tokens); raise --kv-cache-memory or lower "
                          f"--max-model-len")
    return EngineShape(dt, geom, bs, pool, max_len)


def build_memory(shape: EngineShape, *, enable_prefix_caching: bool = True) -> MemoryManager:
    return MemoryManager.from_plan(shape.pool, caching=enable_prefix_caching)


def build_scheduler(shape: EngineShape, *, max_num_seqs: int, max_num_batched_tokens: int,
                    enable_prefix_caching: bool = True, prefill_merge_tokens: int = 0) -> tuple[MemoryManager, Scheduler]:
    """A fresh MemoryManager and the Scheduler over it, as the engine builds them."""
    memory = build_memory(shape, enable_prefix_caching=enable_prefix_caching)
    return memory, Scheduler(memory, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             prefill_merge_tokens=prefill_merge_tokens)
