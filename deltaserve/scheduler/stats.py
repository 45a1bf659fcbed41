"""The scheduler's monotonic counters. Pure data, no torch.

Each counter has one name from here to /metrics: the name of its EngineStats field (engine/llm_engine.py), which
server/metrics.py exports. The memory manager keeps its own counters (memory/manager.py MemoryStats); the engine
reads both.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerStats:
    prefix_cache_queries: int = 0  # tokens of requests looked up in the prefix cache (each admission; jobs excluded)
    prefix_cache_hits: int = 0  # of those, tokens served by the cache
    preemptions: int = 0  # running requests that gave up their memory (a failed step's requests included)
    reprefill_tokens: int = 0  # generated tokens recomputed through the prefill path (jobs.py)
    reprefill_jobs: int = 0  # such jobs finished
    reprefill_dropped: int = 0  # such jobs dropped (a request needed their seat, slot or pages, or all was cached)
