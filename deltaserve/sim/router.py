"""Routers: which replica a new request goes to. No torch.

  round-robin      requests in arrival order, replica after replica
  least-loaded     the replica with the fewest unfinished requests (then the fewest queued prompt tokens,
                   then the lowest index)
  prefix-affinity  the replica whose prefix cache holds the longest usable prefix of the prompt, looked up
                   in the replica's real MemoryManager (a hit must end at a GDN checkpoint, as in the
                   engine); with no hit anywhere, the replica that last served the request's session;
                   else least-loaded. A replica more than max_imbalance unfinished requests above the least
                   loaded one is passed over, so affinity cannot pile everything onto one replica.
  kv-aware         vllm-router's kv_aware policy in front of deltaserve replicas (docs/cluster.md): each
                   replica's cache as the router sees it through its KV events (memory/events.py RouterView,
                   the same hybrid rule the server publishes: whole checkpoint-grid blocks from token 0, each
                   ended by a checkpoint); the replica credited with the longest prefix of the prompt, ties and
                   no credit anywhere to the least loaded (then the lowest index). Events reach the router
                   instantly here; the real router sees them a publish interval later, and adds speculative
                   credit for what it just routed (not modelled).
"""
from __future__ import annotations

from ..memory.events import RouterView
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
                            extra_keys=req.extra_keys, media=req.media)
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


class KVAware(Router):
    name = "kv-aware"

    def __init__(self):
        self._views: dict[int, tuple[RouterView, object]] = {}

    def _view(self, replica) -> RouterView:
        v = self._views.get(replica.index)
        if v is None:
            mem = replica.memory
            grid = replica.cfg.engine.checkpoint_grid
            if not mem.caching or grid <= 0:
                raise ValueError(f"{replica.name}: the kv-aware router needs prefix caching and a checkpoint grid "
                                 "(its KV events are announced at the grid)")
            bs = mem.block_size
            v = (RouterView(bs, -(-grid // bs) * bs, checkpoints=mem.num_gdn_groups > 0), mem.enable_events())
            self._views[replica.index] = v
        view, records = v
        if records:
            batch = []
            while records:
                batch.append(records.popleft())
            view.feed(batch)
        return view

    def credited_tokens(self, req: Request, replica) -> int:
        """Tokens of the prompt the router credits this replica with: whole event blocks from token 0, each
        announced (the router hashes tokens only: no salt)."""
        view = self._view(replica)
        bs, per = view.block_size, view.per_event
        probe = Request(req.request_id, req.prompt_token_ids, max_tokens=1)
        hashes = probe.block_hashes(probe.num_tokens // bs, bs)
        depth = 0
        while (depth + 1) * per <= len(hashes) and view.is_announced(hashes[(depth + 1) * per - 1]):
            depth += 1
        return depth * view.event_block_size

    def route(self, req, session_id, replicas) -> int:
        credit = {r.index: self.credited_tokens(req, r) for r in replicas}
        return min(replicas, key=lambda r: (-credit[r.index],) + _load_key(r)).index


ROUTERS = {"round-robin": RoundRobin, "least-loaded": LeastLoaded, "prefix-affinity": PrefixAffinity,
           "kv-aware": KVAware}


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
