"""What gets evicted: a policy object over the pool's evictable pages.

An evictable page is unreferenced but holds cached content (a published attention block or a GDN
checkpoint). The memory manager tells the policy when a page becomes evictable (`push`), when it is
referenced again (`remove`), and asks it for a victim (`pop`). The manager owns all consequences of an
eviction (invalidating the cache entry, freeing sibling checkpoint pages).

Later policies (evict by the recompute a page saves per byte, docs/design.md) implement
the same four methods.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterator, Protocol


class EvictionPolicy(Protocol):
    def push(self, page: int, low_value: bool = False) -> None: ...
    def remove(self, page: int) -> None: ...
    def pop(self) -> int: ...
    def __len__(self) -> int: ...
    def __contains__(self, page: object) -> bool: ...
    def __iter__(self) -> Iterator[int]: ...  # in eviction order


class LRUEviction:
    """Least recently released first, with one refinement: low-value pages go before everything else.

    Low value = a checkpoint that its sequence replaced by a newer one and that no request ever hit.
    Why: under plain LRU a running sequence keeps releasing its stale checkpoints (one per block), and
    they are younger than the pages of a sequence preempted a moment ago, so the running sequence's
    progress evicts the preempted one's resume point first. A checkpoint proven by a hit (a shared
    system prompt's) stays in the ordinary LRU order.

    The manager releases a sequence's attention pages from its last block to its first, so under
    pressure a cached sequence loses its tail before its head (as vLLM does); its held checkpoint is
    released last and is dropped together with the tail block's attention page (without that page the
    checkpoint is unusable anyway).
    """

    def __init__(self) -> None:
        self._low: OrderedDict[int, None] = OrderedDict()
        self._q: OrderedDict[int, None] = OrderedDict()

    def push(self, page: int, low_value: bool = False) -> None:
        assert page not in self._q and page not in self._low, f"page {page} is already evictable"
        (self._low if low_value else self._q)[page] = None

    def remove(self, page: int) -> None:
        if page in self._low:
            del self._low[page]
        else:
            del self._q[page]

    def pop(self) -> int:
        page, _ = (self._low if self._low else self._q).popitem(last=False)
        return page

    def __len__(self) -> int:
        return len(self._low) + len(self._q)

    def __contains__(self, page: object) -> bool:
        return page in self._q or page in self._low

    def __iter__(self) -> Iterator[int]:
        yield from self._low
        yield from self._q
