"""What gets evicted: a policy object over the pool's evictable pages.

An evictable page is unreferenced but holds cached content (a published attention block or a GDN
checkpoint). The memory manager tells the policy when a page becomes evictable (`push`), when it is
referenced again (`remove`), and asks it for a victim (`pop`). The manager owns all consequences of an
eviction (invalidating the cache entry, freeing sibling checkpoint pages).

Two policies: LRUEviction (the default) and ValueEviction (by the recompute a page spares per page held,
weighed with hits and recency); `--eviction lru|value` picks one.
"""
from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from typing import Iterator, Protocol


class EvictionPolicy(Protocol):
    # value: the prefill tokens the page's content spares per page held (the manager computes it only for a
    # policy whose `wants_value` is true); low_value: a checkpoint replaced by a newer one and never hit
    def push(self, page: int, low_value: bool = False, value: float = 0.0) -> None: ...
    def remove(self, page: int) -> None: ...
    def pop(self) -> int: ...
    def __len__(self) -> int: ...
    def __contains__(self, page: object) -> bool: ...
    def __iter__(self) -> Iterator[int]: ...  # in eviction order


class LRUEviction:
    """Least recently released first, with one refinement: low-value pages go before everything else.

    Low value = a checkpoint that its sequence replaced by a newer one and that no request ever hit, other than
    its prompt's (replaced by a decode's, it is where the conversation's next turn resumes).
    Why: under plain LRU a running sequence keeps releasing its stale checkpoints (one per block), and
    they are younger than the pages of a sequence preempted a moment ago, so the running sequence's
    progress evicts the preempted one's resume point first. A checkpoint proven by a hit (a shared
    system prompt's) stays in the ordinary LRU order.

    The manager releases a sequence's attention pages from its last block to its first, so under
    pressure a cached sequence loses its tail before its head (as vLLM does); its held checkpoint is
    released last and is dropped together with the tail block's attention page (without that page the
    checkpoint is unusable anyway).
    """

    wants_value = False

    def __init__(self) -> None:
        self._low: OrderedDict[int, None] = OrderedDict()
        self._q: OrderedDict[int, None] = OrderedDict()

    def push(self, page: int, low_value: bool = False, value: float = 0.0) -> None:
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


class ValueEviction:
    """Evict what spares the least recompute per page, weighed with hits and recency (Greedy-Dual-Size-Frequency).

    A page's priority when it becomes evictable is L + (1 + hits) * value, value being the prefill tokens its
    content spares per page (the manager's estimate: an attention page spares its block; a checkpoint the tokens
    back to the previous checkpoint of its chain, over its pages), and L the priority of the last page evicted
    (so what has waited long enough goes, whatever its value: recency). The lowest priority goes first; ties by
    release order, so a sequence's tail goes before its head as under LRU. A low-value page (a checkpoint its
    sequence replaced and nobody hit) has value 0: it goes first, as under LRU."""

    wants_value = True

    def __init__(self) -> None:
        self._heap: list[list] = []  # [priority, release order, page, alive]
        self._entry: dict[int, list] = {}
        self._clock = itertools.count()
        self._inflation = 0.0  # L

    def push(self, page: int, low_value: bool = False, value: float = 0.0) -> None:
        assert page not in self._entry, f"page {page} is already evictable"
        e = [self._inflation + (0.0 if low_value else value), next(self._clock), page, True]
        self._entry[page] = e
        heapq.heappush(self._heap, e)

    def remove(self, page: int) -> None:
        self._entry.pop(page)[3] = False  # left in the heap, skipped when it surfaces

    def pop(self) -> int:
        while True:
            pri, _, page, alive = heapq.heappop(self._heap)
            if alive:
                del self._entry[page]
                self._inflation = pri
                return page

    def __len__(self) -> int:
        return len(self._entry)

    def __contains__(self, page: object) -> bool:
        return page in self._entry

    def __iter__(self) -> Iterator[int]:
        yield from (e[2] for e in sorted(self._entry.values(), key=lambda e: (e[0], e[1])))


EVICTION_POLICIES = {"lru": LRUEviction, "value": ValueEviction}
