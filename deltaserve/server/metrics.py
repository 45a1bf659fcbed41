"""Prometheus metrics, one CollectorRegistry per app (no global state): vLLM's names where vLLM has one.

Engine-wide numbers (running / waiting, KV usage, prefix-cache queries and hits, token counters,
pages, GDN slots, checkpoints) come from the engine thread's latest EngineStats snapshot at scrape
time. Per-request latencies (time to first token, inter-token latency, end to end) are observed by
the server as outputs arrive.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0, 7680.0)

# (metric name, EngineStats field, help). Gauges:
_GAUGES = (
    ("vllm:num_requests_running", "num_running", "Number of requests in model execution batches."),
    ("vllm:num_requests_waiting", "num_waiting", "Number of requests waiting to be processed."),
    ("vllm:kv_cache_usage_perc", "kv_cache_usage", "KV-cache usage. 1 means 100 percent usage."),
    # its older name, which some routers and gateways still read
    ("vllm:gpu_cache_usage_perc", "kv_cache_usage", "KV-cache usage. 1 means 100 percent usage."),
    ("deltaserve_pages_in_use", "pages_used", "Pages referenced by live requests."),
    ("deltaserve_pages_total", "pages_total", "Pages in the pool."),
    ("deltaserve_gdn_slots_in_use", "slots_used", "GDN state slots held by live requests."),
    ("deltaserve_gdn_slots_total", "slots_total", "GDN state slots in the pool."),
)
# Counters (exposed with the _total suffix, as vLLM's are):
_COUNTERS = (
    ("vllm:prefix_cache_queries", "prefix_cache_queries", "Prefix-cache queries, in tokens."),
    ("vllm:prefix_cache_hits", "prefix_cache_hits", "Prefix-cache hits, in tokens."),
    ("vllm:prompt_tokens", "prompt_tokens", "Number of prefill tokens processed."),
    ("vllm:generation_tokens", "generation_tokens", "Number of generation tokens processed."),
    ("vllm:num_preemptions", "preemptions", "Cumulative number of preemptions."),
    ("deltaserve_checkpoints_saved", "checkpoints_saved", "GDN state checkpoints saved into pages."),
    ("deltaserve_checkpoints_restored", "checkpoints_restored", "GDN state checkpoints restored on a hit."),
    ("deltaserve_checkpoints_renewed", "checkpoints_renewed", "Checkpoints two or more requests resumed from, renewed "
     "in the eviction order by a prefix hit passing them."),
    ("deltaserve_evictions", "evictions", "Cached pages evicted."),
    ("deltaserve_reprefill_tokens", "reprefill_tokens", "Generated tokens recomputed through the prefill path."),
    ("deltaserve_reprefill_jobs", "reprefill_jobs", "Finished requests whose outputs were recomputed and cached."),
    ("deltaserve_reprefill_dropped", "reprefill_dropped", "Output recompute jobs dropped: a request needed their seat, "
     "slot or pages, or the outputs were cached already."),
    ("vllm:mm_cache_queries", "mm_cache_queries", "Multi-modal cache queries, in terms of number of items."),
    ("vllm:mm_cache_hits", "mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items."),
)


# Speculative decoding (--speculative-config): vLLM's counters, and the accepted drafts per draft position below
_SPEC_COUNTERS = (
    ("vllm:spec_decode_num_drafts", "spec_decode_num_drafts", "Number of spec decoding drafts (verify steps)."),
    ("vllm:spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens", "Number of draft tokens."),
    ("vllm:spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens", "Number of accepted tokens."),
)


# The prefix cache's disk tier (--cache-disk): gauges, then counters
_DISK_GAUGES = (
    ("deltaserve_disk_bytes", "disk_bytes", "Bytes the disk tier's records take."),
    ("deltaserve_disk_records", "disk_records", "Records (blocks' K/V and GDN checkpoints) in the disk tier."),
)
_DISK_COUNTERS = (
    ("deltaserve_disk_writes", "disk_writes", "Records written to the disk tier."),
    ("deltaserve_disk_write_bytes", "disk_write_bytes", "Bytes written to the disk tier."),
    ("deltaserve_disk_write_errors", "disk_write_errors", "Disk-tier writes that failed or did not fit."),
    ("deltaserve_disk_reads", "disk_reads", "Records read back from the disk tier and verified."),
    ("deltaserve_disk_read_bytes", "disk_read_bytes", "Bytes read back from the disk tier."),
    ("deltaserve_disk_read_errors", "disk_read_errors", "Disk-tier records found corrupt, torn or missing (misses)."),
    ("deltaserve_disk_read_seconds", "disk_read_seconds", "Summed disk-tier read latency, request to verified bytes."),
    ("deltaserve_disk_evictions", "disk_evictions", "Records deleted to keep the disk tier in its budget."),
    ("deltaserve_disk_hit_tokens", "disk_hit_tokens", "Prefix-hit tokens whose K/V came back from the disk tier."),
)

# Labelled by checkpoint kind (the SaveKind values): (metric name, EngineStats field, help)
_BY_KIND = (
    ("deltaserve_checkpoints_saved_by_kind", "checkpoints_saved_by_kind", "GDN checkpoints saved, by why they were taken."),
    ("deltaserve_checkpoints_evicted_by_kind", "checkpoints_evicted_by_kind", "GDN checkpoints evicted, by kind."),
    ("deltaserve_checkpoints_hit_by_kind", "checkpoints_hit_by_kind",
     "Prefix-cache hits that resumed from a GDN checkpoint, by the checkpoint's kind (a resume point's source)."),
    ("deltaserve_checkpoints_evicted_unread_by_kind", "checkpoints_evicted_unread_by_kind",
     "GDN checkpoints evicted before any request resumed from them, by kind."),
)
_CHECKPOINT_GAUGES = (
    ("deltaserve_checkpoints_kept", "checkpoints_kept", "GDN checkpoints in the cache or held by requests."),
    ("deltaserve_checkpoint_bytes", "checkpoint_bytes", "Bytes the kept GDN checkpoints take."),
)

_INFO = (
    ("deltaserve_block_size", "block_size", "Tokens per page (the hybrid block size)."),
    ("deltaserve_max_model_len", "max_model_len", "The longest prompt plus completion, in tokens."),
)


class _EngineStatsCollector:
    def __init__(self, get_stats, model_name: str, get_info=None):
        self._get = get_stats
        self._info = get_info
        self._model = model_name
        self.kv_event_block_size: int | None = None  # set once KV events are published

    def collect(self):
        info = self._info() if self._info is not None else None
        for name, field, doc in _INFO:
            v = getattr(info, field, None)
            if isinstance(v, (int, float)):
                g = GaugeMetricFamily(name, doc, labels=["model_name"])
                g.add_metric([self._model], float(v))
                yield g
        if self.kv_event_block_size is not None:
            g = GaugeMetricFamily("deltaserve_kv_event_block_size", "Tokens per KV event block (the checkpoint grid; "
                                  "a router's --kv-event-block-size).", labels=["model_name"])
            g.add_metric([self._model], float(self.kv_event_block_size))
            yield g
        pool = getattr(info, "pool", None)
        if pool is not None and isinstance(getattr(info, "block_size", None), int):
            # vLLM's info gauge: the cache geometry as labels, value 1 (a page is vLLM's GPU block)
            g = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                  labels=["block_size", "num_gpu_blocks", "enable_prefix_caching", "model_name"])
            caching = getattr(getattr(info, "config", None), "enable_prefix_caching", None)
            g.add_metric([str(info.block_size), str(pool.num_pages), str(caching), self._model], 1.0)
            yield g
        stats = self._get()
        if stats is None:
            return
        for name, field, doc in _GAUGES + _CHECKPOINT_GAUGES + _DISK_GAUGES:
            v = getattr(stats, field, None)
            if v is None:
                continue
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self._model], float(v))
            yield g
        for name, field, doc in _COUNTERS + _DISK_COUNTERS:
            v = getattr(stats, field, None)
            if v is None:
                continue
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self._model], float(v))
            yield c
        if getattr(stats, "spec_decode_num_drafts", None):  # only where the engine speculates (as vLLM)
            for name, field, doc in _SPEC_COUNTERS:
                c = CounterMetricFamily(name, doc, labels=["model_name"])
                c.add_metric([self._model], float(getattr(stats, field)))
                yield c
            c = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                    "Accepted tokens per draft position.", labels=["model_name", "position"])
            for pos, v in enumerate(stats.spec_decode_accepted_per_pos):
                c.add_metric([self._model, str(pos)], float(v))
            yield c
        for name, field, doc in _BY_KIND:
            counts = getattr(stats, field, None)
            if not counts:
                continue
            c = CounterMetricFamily(name, doc, labels=["model_name", "kind"])
            for kind, v in counts.items():
                c.add_metric([self._model, kind], float(v))
            yield c


class ServerMetrics:
    def __init__(self, get_stats, model_name: str, get_info=None):
        self.registry = CollectorRegistry(auto_describe=False)
        self.model_name = model_name
        self.engine_collector = _EngineStatsCollector(get_stats, model_name, get_info)
        self.registry.register(self.engine_collector)
        labels = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, buckets=_TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             labels, buckets=_ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
                             labels, buckets=_E2E_BUCKETS, registry=self.registry).labels(model_name)
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                labels + ["finished_reason"], registry=self.registry)

    def finished(self, reason: str | None) -> None:
        self._success.labels(self.model_name, reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Latency bookkeeping of one engine request (event loop thread)."""

    __slots__ = ("metrics", "start", "last", "tokens", "done")

    def __init__(self, metrics: ServerMetrics, start: float):
        self.metrics = metrics
        self.start = start
        self.last: float | None = None
        self.tokens = 0
        self.done = False

    def tokens_arrived(self, n: int, now: float) -> None:
        if n <= 0:
            return
        self.tokens += n
        if self.last is None:
            self.metrics.ttft.observe(now - self.start)
        else:
            gap = (now - self.last) / n
            for _ in range(n):
                self.metrics.itl.observe(gap)
        self.last = now

    def finish(self, reason: str | None, now: float) -> None:
        if not self.done:
            self.done = True
            self.metrics.e2e.observe(now - self.start)
            self.metrics.finished(reason)
