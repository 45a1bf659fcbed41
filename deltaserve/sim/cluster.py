"""The discrete-event simulation: replicas that run the engine's own Scheduler and MemoryManager, with the
latency model in place of the model runner, behind a router. No torch.

A replica does what LLMEngine.step does, with time taken from the latency model:

    plan = scheduler.schedule()                      # the real scheduler, the real memory manager
    t_end = now + latency.step_us(plan) * 1e-6       # instead of runner.execute(plan) and sampling
    scheduler.update(plan, {rid: TOKEN ...})         # at t_end: tokens of this step are stamped t_end

Sampled tokens are a fixed id (the trace gives output lengths; a request finishes at its output length,
as with ignore_eos). Requests arriving while a step runs are seen by the next schedule(), as in the
engine's loop; an idle replica starts a step the moment a request arrives, once every request arriving at that
same instant is in (the engine admits everything that has arrived before it plans).

Cluster config (JSON):

    {"profile": "path/to/bundle",              # relative to the config file
     "router": "round-robin" | "least-loaded" | {"policy": "prefix-affinity", "max_imbalance": 4},
     "replicas": [{"count": 2, "max_num_seqs": 8, "max_num_batched_tokens": 512,
                   "kv_cache_memory": 67108864, "enable_prefix_caching": true}]}

Replica keys are the engine's scheduling and memory flags by their EngineConfig names (config.REPLICA_FLAGS:
dtype, max_model_len, max_num_seqs, max_num_batched_tokens, prefill_merge_tokens, kv_cache_memory, block_size,
enable_prefix_caching, cache_layout, checkpoint_grid, eviction, reprefill_outputs, reprefill_job_tokens,
num_threads, cache_disk, cache_disk_bytes), checked as the engine checks them; plus count, name, tp, profile (a
bundle for this replica group) and disk_gbps (the disk tier's read bandwidth, sim/disk.py; cache_disk, any value,
turns the tier on: no files are written). `deltaserve simulate` takes the same flags on its command line.
"""
from __future__ import annotations

import heapq
import json
import logging
import os
from dataclasses import dataclass, replace

from ..config import REPLICA_FLAGS, EngineConfig, ModelConfig
from ..memory.disk_tier import DiskTier
from ..memory.eviction import EVICTION_POLICIES
from ..scheduler import Request
from ..scheduler.build import build
from .bundle import Bundle, load_bundle
from .disk import SimDisk
from .latency import LatencyModel, StepShape
from .report import RequestRecord
from .router import Router, make_router
from .trace import TraceRequest

log = logging.getLogger("deltaserve.sim")

SAMPLED_TOKEN = 11  # what every simulated step "samples"


REPLICA_OWN_KEYS = ("count", "name", "tp", "profile", "disk_gbps")  # replica keys that are not engine flags


@dataclass(frozen=True)
class ReplicaConfig:
    """One simulated replica: the engine's scheduling and memory flags (config.REPLICA_FLAGS, parsed and
    checked as the engine checks them) and where it runs (tp, its bundle)."""

    engine: EngineConfig = EngineConfig()
    tp: int = 1
    name: str | None = None
    profile: str | None = None
    disk_gbps: float = 2.0  # the disk tier's read bandwidth (with cache_disk set)

    @classmethod
    def from_dict(cls, d: dict) -> "ReplicaConfig":
        """From a cluster config's replica entry: engine flags by their EngineConfig names, plus name, tp,
        profile (count is the caller's)."""
        own = {k: d[k] for k in REPLICA_OWN_KEYS[1:] if k in d}
        flags = {k: v for k, v in d.items() if k not in own}
        unknown = sorted(set(flags) - set(REPLICA_FLAGS))
        if unknown:
            raise ValueError(f"unknown replica option(s): {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(REPLICA_FLAGS + REPLICA_OWN_KEYS))}")
        return cls(EngineConfig.from_kwargs(**flags), **own)

    def with_flags(self, **flags) -> "ReplicaConfig":
        """This replica with some engine flags replaced (command-line overrides)."""
        return replace(self, engine=replace(self.engine, **flags))


class Replica:
    def __init__(self, index: int, cfg: ReplicaConfig, bundle: Bundle, latency: LatencyModel | None = None):
        self.index = index
        self.name = cfg.name or f"replica-{index}"
        self.cfg = cfg
        self.bundle = bundle
        mc = ModelConfig.from_hf(bundle.config)
        eng = cfg.engine  # the engine flags (EngineConfig)
        kv = eng.kv_cache_memory or (bundle.meta.get("engine") or {}).get("kv_cache_memory")
        if not kv:
            raise ValueError(f"{self.name}: kv_cache_memory is required (the bundle records none)")
        dtype = eng.dtype if eng.dtype != "auto" else (bundle.meta.get("dtypes") or {}).get("model", "auto")
        self.shape, self.memory, self.scheduler = build(mc, eng, int(kv), dtype, tp=cfg.tp)
        self.disk = None
        if eng.cache_disk and eng.enable_prefix_caching:  # the engine's tier on a bandwidth model (sim/disk.py)
            pool = self.shape.pool
            tier = DiskTier(eng.cache_disk_bytes, pool.page_bytes * pool.group_size,
                            self.shape.geometry.gdn_state_bytes_per_seq, EVICTION_POLICIES[eng.eviction]())
            self.memory.attach_disk(tier)
            self.disk = SimDisk(tier, cfg.disk_gbps)
        recorded = bundle.block_size(cfg.tp)
        if recorded is not None and recorded != self.shape.block_size and eng.block_size == 16:
            log.warning("%s: block size %d differs from the bundle's engine-resolved %d (tp %d)", self.name,
                        self.shape.block_size, recorded, cfg.tp)
        threads = (bundle.meta.get("hardware") or {}).get("torch_threads")
        if eng.num_threads is not None and threads is not None and eng.num_threads != threads:
            log.warning("%s: num_threads %d, but the bundle was profiled with %d", self.name, eng.num_threads, threads)
        self.latency = latency or LatencyModel(bundle, tp=cfg.tp)
        self.max_model_len = self.shape.max_model_len
        self.records: dict[str, RequestRecord] = {}
        self._reqs: dict[str, Request] = {}
        self.plan = None
        self.busy_until: float | None = None
        self.num_steps = 0
        self.busy_time = 0.0
        self._after_prefill = False  # the last step computed prompt tokens (the latency model's cold decode)
        # called with (plan, now) for every step this replica starts: what the validation compares with the real
        # engine's steps (sim/replayed.py)
        self.on_plan = None

    # ---------------------------------------------------------------- load, for routers
    def outstanding(self) -> int:
        return self.scheduler.num_running + self.scheduler.num_waiting

    def queued_tokens(self) -> int:
        return sum(r.num_tokens for r in self.scheduler.waiting)

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---------------------------------------------------------------- requests
    def submit(self, tr: TraceRequest, req: Request, now: float) -> RequestRecord:
        rec = RequestRecord(tr.request_id, tr.session_id, self.index, tr.arrival_time, req.num_prompt_tokens,
                            tr.output_length)
        self.records[tr.request_id] = rec
        n, m = req.num_prompt_tokens, req.max_tokens
        if n >= self.max_model_len or n + m > self.max_model_len:
            rec.status = f"rejected: {n} + {m} tokens exceed max_model_len {self.max_model_len}"
            return rec
        try:
            self.scheduler.add(req)
        except ValueError as e:
            rec.status = f"rejected: {e}"
            return rec
        self._reqs[tr.request_id] = req
        return rec

    # ---------------------------------------------------------------- steps
    def start(self, now: float) -> float | None:
        """Plan a step at `now`; returns its end time, or None when there is nothing to run."""
        if self.disk is not None:
            self.disk.deliver(now)
        plan = self.scheduler.schedule()
        if self.disk is not None:
            self.disk.carry_out(now)
        if plan.is_empty():
            landing = self.disk.next_landing() if self.disk is not None else None
            if landing is not None:  # only reads to wait for: an idle "step" until the next one lands
                self.plan, self.busy_until = plan, landing
                return landing
            self.plan, self.busy_until = None, None
            return None
        if self.on_plan is not None:
            self.on_plan(plan, now)
        shape = StepShape.of(plan, after_prefill=self._after_prefill)
        self._after_prefill = bool(shape.prefill)
        dt = self.latency.shape_us(shape, now) * 1e-6
        self.plan, self.busy_until = plan, now + dt
        self.num_steps += 1
        self.busy_time += dt
        return self.busy_until

    def complete(self, now: float) -> list[RequestRecord]:
        """The step in flight ends at `now`: its tokens are out. Returns the records that finished."""
        plan, self.plan, self.busy_until = self.plan, None, None
        sampled = {w.request_id: SAMPLED_TOKEN for w in plan.work if w.sample}
        advanced = self.scheduler.update(plan, sampled)
        done = []
        for req in advanced:
            rec = self.records[req.request_id]
            rec.output_tokens += 1
            rec.cached_tokens = req.num_cached_tokens
            rec.preemptions = req.num_preemptions
            if rec.first_token is None:
                rec.first_token = now
            if req.is_finished:
                rec.finish = now
                del self._reqs[req.request_id]
                done.append(rec)
        return done


@dataclass
class ClusterConfig:
    replicas: list[ReplicaConfig]
    router: object
    profile: str | None

    @classmethod
    def load(cls, path: str) -> "ClusterConfig":
        with open(path) as f:
            d = json.load(f)
        return cls.from_dict(d, os.path.dirname(os.path.abspath(path)))

    @classmethod
    def from_dict(cls, d: dict, base: str = ".") -> "ClusterConfig":
        unknown = sorted(set(d) - {"replicas", "router", "profile", "_comment"})
        if unknown:
            raise ValueError(f"unknown cluster option(s): {', '.join(unknown)}")
        reps = []
        for g in d.get("replicas") or [{}]:
            g = dict(g)
            count = int(g.pop("count", 1))
            if g.get("profile"):
                g["profile"] = os.path.join(base, g["profile"])
            for i in range(count):
                c = ReplicaConfig.from_dict(g)
                reps.append(c)
        prof = d.get("profile")
        return cls(reps, d.get("router", "round-robin"), os.path.join(base, prof) if prof else None)


class Simulation:
    def __init__(self, cluster: ClusterConfig, bundle: Bundle | None = None, router: Router | None = None):
        bundles: dict[str, Bundle] = {}
        models: dict[str, LatencyModel] = {}
        self.replicas: list[Replica] = []
        for i, rc in enumerate(cluster.replicas):
            path = rc.profile or cluster.profile
            if bundle is not None and rc.profile is None:
                b = bundle
            else:
                if path is None:
                    raise ValueError("no profile bundle: give one in the cluster config ('profile') or --profile")
                b = bundles.get(path) or bundles.setdefault(path, load_bundle(path))
            key = f"{id(b)}/{rc.tp}"
            lm = models.get(key) or models.setdefault(key, LatencyModel(b, tp=rc.tp))
            self.replicas.append(Replica(i, rc, b, lm))
        self.router = router or make_router(cluster.router)

    def run(self, trace: list[TraceRequest]) -> list[RequestRecord]:
        """Serve the trace (arrival times in seconds from 0); one record per request, in trace order."""
        reps = self.replicas
        records: list[RequestRecord] = []
        heap: list[tuple[float, int]] = []
        arrivals = sorted(trace, key=lambda r: r.arrival_time)
        idle: set[int] = set()  # idle replicas given a request at this instant, started once all of it is in
        i = 0
        now = 0.0
        while i < len(arrivals) or heap:
            t_arr = arrivals[i].arrival_time if i < len(arrivals) else float("inf")
            if heap and heap[0][0] < t_arr:
                now, k = heapq.heappop(heap)
                r = reps[k]
                r.complete(now)
                end = r.start(now) if r.has_work() else None
                if end is not None:
                    heapq.heappush(heap, (end, k))
                continue
            tr = arrivals[i]
            i += 1
            now = t_arr
            if tr.prompt_token_ids is None:
                raise ValueError(f"request {tr.request_id} has no token ids: materialize() the trace first")
            req = Request(tr.request_id, tr.prompt_token_ids, max_tokens=tr.output_length,
                          cache_salt=tr.cache_salt, arrival_time=tr.arrival_time, media=tr.media)
            k = self.router.route(req, tr.session_id, reps)
            self.router.observe(k, req, tr.session_id)
            records.append(reps[k].submit(tr, req, now))
            if reps[k].busy_until is None:
                idle.add(k)
            if i < len(arrivals) and arrivals[i].arrival_time == now:
                continue  # an engine admits everything that has arrived before it plans: the rest of this instant first
            for k in sorted(idle):
                r = reps[k]
                end = r.start(now) if r.has_work() else None
                if end is not None:
                    heapq.heappush(heap, (end, k))
            idle.clear()
        for r in reps:  # anything left can never be scheduled (no step could make progress)
            for rid in list(r._reqs):
                r.records[rid].status = "unfinished"
        return records

    def stats(self) -> list[dict]:
        out = []
        for r in self.replicas:
            st = r.scheduler.counters()
            out.append({"replica": r.index, "name": r.name, "block_size": r.shape.block_size,
                        "num_pages": r.shape.pool.num_pages, "steps": r.num_steps, "busy_s": r.busy_time, **st})
        return out
