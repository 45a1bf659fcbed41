"""Routers: which replica a new request goes to. No torch.

  round-robin      requests in arrival order, replica after replica
  least-loaded     the replica with the fewest unfinished requests (then the fewest queued prompt tokens,
                   then the lowest index)
  prefix-affinity  the replica whose prefix cache holds the longest usable prefix of the prompt, looked up
                   in the replica's real MemoryManager (a hit must end at a GDN checkpoint, as in the
                   engine); with no hit anywhere, the replica that last served the request's session;
                   else least-loaded. A replica more than max_imbalance unfinished requests above the least
                   loaded one is passed over, so affinity cannot pile everything onto one replica.
"""
from __future__ import annotations

from ..scheduler import Request


class Router:
    name = "router"

    def route(self, req: Request, session_id: str | None, replicas: list) -> int:
        raise NotImplementedError

    def observe(self, index: int, req: Request, session_id: str | None) -> None:
        """The request went to replica `index`."""


class RoundRobin(Router):
    name = "round-robin"

    def __init__(self):
        self.next = 0

    def route(self, req, session_id, replicas) -> int:
        i = self.next % len(replicas)
        self.next += 1
        return i


def _load_key(r):
    return (r.outstanding(), r.queued_tokens(), r.index)


class LeastLoaded(Router):
    name = "least-loaded"

    def route(self, req, session_id, replicas) -> int:
        return min(replicas, key=_load_key).index


class PrefixAffinity(Router):
    name = "prefix-affinity"

    def __init__(self, max_imbalance: int = 4):
        self.max_imbalance = max_imbalance
        self.last_replica: dict[str, int] = {}

    @staticmethod
    def _hit_tokens(req: Request, replica, cache: dict[int, tuple]) -> int:
        mem = replica.memory
        if not mem.caching:
            return 0
        bs = mem.block_size
        if bs not in cache:
            probe = Request(req.request_id, req.prompt_token_ids, max_tokens=1, cache_salt=req.cache_salt,
                            extra_keys=req.extra_keys)
            nb = (probe.num_tokens - 1) // bs
            cache[bs] = (probe, nb, probe.block_hashes(nb, bs))
        probe, nb, hashes = cache[bs]
        hit = mem.find_prefix(probe.root_hash, hashes, lambda j: probe.tokens(j * bs, (j + 1) * bs), nb)
        return hit.num_tokens

    def route(self, req, session_id, replicas) -> int:
        least = min(replicas, key=_load_key)
        floor = least.outstanding() + self.max_imbalance
        eligible = [r for r in replicas if r.outstanding() <= floor]
        cache: dict[int, tuple] = {}
        best, best_hit = None, 0
        for r in eligible:
            h = self._hit_tokens(req, r, cache)
            if h > best_hit or (h == best_hit and best is not None and h > 0 and _load_key(r) < _load_key(best)):
                best, best_hit = r, h
        if best is not None:
            return best.index
        if session_id is not None and session_id in self.last_replica:
            i = self.last_replica[session_id]
            if any(r.index == i for r in eligible):
                return i
        return least.index

    def observe(self, index, req, session_id) -> None:
        if session_id is not None:
            self.last_replica[session_id] = index


ROUTERS = {"round-robin": RoundRobin, "least-loaded": LeastLoaded, "prefix-affinity": PrefixAffinity}


def make_router(spec) -> Router:
    """spec: a policy name, or {"policy": name, **options}."""
    if isinstance(spec, str):
        spec = {"policy": spec}
    spec = dict(spec or {"policy": "round-robin"})
    name = spec.pop("policy", "round-robin")
    if name not in ROUTERS:
        raise ValueError(f"unknown router policy {name!r}; known: {', '.join(ROUTERS)}")
    try:
        return ROUTERS[name](**spec)
    except TypeError as e:
        raise ValueError(f"router {name}: {e}") from None
