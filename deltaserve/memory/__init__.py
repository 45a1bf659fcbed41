"""Pure-Python memory management: the page pool, GDN slots, and the hybrid prefix cache (no torch)."""
from .eviction import EvictionPolicy, LRUEviction
from .hashing import block_hash, root_hash
from .manager import (ATTN, CacheEntry, CheckpointError, MemoryManager, MemoryStats, MemoryUsage,
                      OutOfPagesError, PrefixHit)
from .save_kind import SaveKind

__all__ = ["ATTN", "CacheEntry", "CheckpointError", "EvictionPolicy", "LRUEviction", "MemoryManager",
           "MemoryStats", "MemoryUsage", "OutOfPagesError", "PrefixHit", "SaveKind", "block_hash", "root_hash"]
