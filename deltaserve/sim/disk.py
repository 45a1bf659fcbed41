"""The prefix cache's disk tier in the simulator: the engine's own decisions (memory/disk_tier.py, attached to the
replica's real MemoryManager) on a bandwidth model in place of runner/disk_store.py. No torch, no files.

    writes   free: the engine's I/O worker writes while steps run, and no step waits for one;
    reads    one at a time (one device), each `latency + bytes / bandwidth` of simulated time from when it is
             asked for or the previous read ends; the request waits in the scheduler meanwhile, as in the engine;
    loads    free (a copy into the pool, small beside a step).
A replica with nothing to run but reads sleeps until the next read lands.
"""
from __future__ import annotations

import heapq

from ..memory.disk_tier import DiskTier


class SimDisk:
    def __init__(self, tier: DiskTier, gbps: float, latency_s: float = 1e-4):
        if gbps <= 0:
            raise ValueError(f"disk bandwidth must be > 0 GB/s, not {gbps}")
        self.tier = tier
        self.bandwidth = gbps * 1e9  # bytes a second
        self.latency_s = latency_s
        self._free_at = 0.0  # when the device finishes the reads asked for so far
        self._reads: list[tuple[float, tuple, int, float]] = []  # (lands at, key, bytes, asked at)

    def deliver(self, now: float) -> None:
        """Reads that landed by `now` reach the tier (its next poll stages them)."""
        while self._reads and self._reads[0][0] <= now:
            t, key, n, asked = heapq.heappop(self._reads)
            self.tier.done.append(("read", key, True, t - asked, n))

    def carry_out(self, now: float) -> None:
        """What the manager decided in this schedule(): writes done at once, reads queued on the device."""
        ops, _ = self.tier.take()
        for op, arg in ops:
            if op == "write":
                self.tier.done.append(("write", arg.record.key, True, 0.0, arg.record.nbytes))
            elif op == "read":
                start = max(now, self._free_at)
                self._free_at = start + self.latency_s + arg.nbytes / self.bandwidth
                heapq.heappush(self._reads, (self._free_at, arg.key, arg.nbytes, now))

    def next_landing(self) -> float | None:
        return self._reads[0][0] if self._reads else None
