"""Pure-Python memory management: the page pool, GDN slots, and the hybrid prefix cache (no torch)."""
from .eviction import EvictionPolicy, LRUEviction
from .hashing import block_hash, root_hash
from .manager import (ATTN, CacheEntry, CacheStats, CheckpointError, MemoryManager, MemoryUsage,
                      OutOfPagesError, PrefixHit)

__all__ = ["ATTN", "CacheEntry", "CacheStats", "CheckpointError", "EvictionPolicy", "LRUEviction",
           "MemoryManager", "MemoryUsage", "OutOfPagesError", "PrefixHit", "block_hash", "root_hash"]
