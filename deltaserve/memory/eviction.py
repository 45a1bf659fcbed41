"""What gets evicted: a policy object over the pool's evictable pages.

An evictable page is unreferenced but holds cached content (a published attention block or a GDN
checkpoint). The memory manager tells the policy when a page becomes evictable (`push`), when it is
referenced again (`remove`), and asks it for a victim (`pop`). The manager owns all consequences of an
eviction (invalidating the cache entry, freeing sibling checkpoint pages).

DESIGN.md leaves room for later policies (seed 004: evict by recompute saved per byte); they implement
the same four methods.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterator, Protocol


class EvictionPolicy(Protocol):
    def push(self, page: int) -> None: ...
    def remove(self, page: int) -> None: ...
    def pop(self) -> int: ...
    def __len__(self) -> int: ...
    def __contains__(self, page: object) -> bool: ...
    def __iter__(self) -> Iterator[int]: ...


class LRUEviction:
    """Least recently released first. Pages are pushed in the order they became unreferenced.

    The manager releases a request's attention pages from its last block to its first, so under
    pressure a cached sequence loses its tail before its head (as vLLM does), and its checkpoint last
    (it is dropped together with the tail block's attention page, which makes it unusable anyway).
    """

    def __init__(self) -> None:
        self._q: OrderedDict[int, None] = OrderedDict()

    def push(self, page: int) -> None:
        assert page not in self._q, f"page {page} is already evictable"
        self._q[page] = None

    def remove(self, page: int) -> None:
        del self._q[page]

    def pop(self) -> int:
        page, _ = self._q.popitem(last=False)
        return page

    def __len__(self) -> int:
        return len(self._q)

    def __contains__(self, page: object) -> bool:
        return page in self._q

    def __iter__(self) -> Iterator[int]:
        return iter(self._q)
