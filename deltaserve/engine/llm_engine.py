"""LLMEngine: requests in, token outputs out, one step at a time.

    plan = scheduler.schedule()          # which tokens run, copy/zero plans   (pure Python)
    logits = runner.execute(plan)        # zero, restore, forward, save        (torch)
    sampled = self._sample(logits)       # next tokens, logprobs
    return self._emit(plan, sampled)     # scheduler.update, stops, detokenize
"""
from __future__ import annotations

import os
import logging
import time
from dataclasses import dataclass, field

from ..config import ConfigError, EngineConfig, ModelConfig, VisionConfig, resolve_dtype
from .inputs import EngineInputError, check_request
from .outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput
from .speculative import Acceptance, SpecStats, fit_drafts, verify, verify_greedy_lazily

log = logging.getLogger("deltaserve")


@dataclass
class EngineStats:
    """A snapshot for /metrics. Each counter keeps the one name it has from its owner (the memory manager's
    MemoryStats, the scheduler's SchedulerStats) to its metric (server/metrics.py)."""

    num_running: int
    num_waiting: int
    pages_total: int
    pages_used: int  # pages held by live requests (cached, unreferenced pages are free to evict)
    slots_total: int
    slots_used: int
    kv_cache_usage: float  # fraction of pages in use
    prefix_cache_queries: int  # tokens looked up (vLLM's vllm:prefix_cache_queries)
    prefix_cache_hits: int  # tokens served from the cache
    checkpoints_saved: int
    checkpoints_restored: int
    evictions: int
    preemptions: int
    prompt_tokens: int  # total prompt tokens computed
    generation_tokens: int  # total tokens generated
    checkpoints_saved_by_kind: dict[str, int] = field(default_factory=dict)  # by SaveKind value
    checkpoints_evicted_by_kind: dict[str, int] = field(default_factory=dict)
    checkpoints_hit_by_kind: dict[str, int] = field(default_factory=dict)
    checkpoints_evicted_unread_by_kind: dict[str, int] = field(default_factory=dict)
    checkpoints_kept: int = 0  # checkpoints in the cache or held by requests now
    checkpoint_bytes: int = 0  # the memory they take (pool pages, or the per-block layout's side tensor rows)
    checkpoints_renewed: int = 0  # junctions renewed in the eviction order (memory/manager.py)
    reprefill_tokens: int = 0  # generated tokens recomputed through the prefill path (background jobs)
    reprefill_jobs: int = 0  # jobs finished
    reprefill_dropped: int = 0  # jobs dropped: a request needed their seat, slot or pages, or all was cached
    # the disk tier (--cache-disk; memory/disk_tier.py DiskStats): gauges, then counters
    disk_bytes: int = 0
    disk_records: int = 0
    disk_writes: int = 0
    disk_write_bytes: int = 0
    disk_write_errors: int = 0  # writes that failed or did not fit: misses later
    disk_reads: int = 0
    disk_read_bytes: int = 0
    disk_read_errors: int = 0  # corrupt, torn or missing records: misses
    disk_read_seconds: float = 0.0  # summed read latency (over disk_reads: the mean)
    disk_evictions: int = 0
    disk_hit_tokens: int = 0  # hit tokens whose K/V came back from disk (of prefix_cache_hits)
    cpu_kernels: str = ""  # the compiled CPU kernels' instruction set (avx512bf16 / avx512 / avx2), or "torch"
    # speculative decoding (engine/speculative.py SpecStats; vLLM's vllm:spec_decode_* counters)
    spec_decode_num_drafts: int = 0  # verify steps
    spec_decode_num_draft_tokens: int = 0  # drafts verified
    spec_decode_num_accepted_tokens: int = 0  # drafts accepted
    spec_decode_accepted_per_pos: list[int] = field(default_factory=list)  # accepted at draft position 0, 1, ...
    # the processed-image cache (--mm-processor-cache-gb), in images: vLLM's vllm:mm_cache_queries / _hits
    mm_cache_queries: int = 0
    mm_cache_hits: int = 0


@dataclass
class _Live:
    """The engine's side of one request: sampling, detokenization, stops, what it returned so far."""

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: object  # SamplingParams
    sampling: object  # SamplingState
    detok: object  # IncrementalDetokenizer
    metrics: RequestMetrics
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: dict[int, PositionLogprobs] = field(default_factory=dict)
    sent_text: int = 0  # chars of text already returned
    sent_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0


def check_memory(path: str, mc: ModelConfig, config: EngineConfig, dtype: str, device) -> None:
    """ConfigError, before anything is loaded, where the weights as run (memory/resident.py, from the checkpoint's
    headers), the largest tensor loading holds beside them, the runtime and an explicit --kv-cache-memory add up
    to more than the machine has available: a machine too small is told the figures rather than handed to the OOM
    killer. Logs the figures otherwise."""
    from ..memory.resident import RUNTIME_BYTES, largest_tensor, weights_as_run
    from ..runner.platform import available_bytes

    if not os.path.isdir(path):
        return
    images, mtp = config.mm_limit("image") > 0, config.speculative_config is not None
    weights = weights_as_run(path, mc, dtype, images=images, mtp=mtp, quantize_head=config.quantize_head,
                             quantize=config.quantize)
    if weights is None:
        return
    pool, free = config.kv_cache_memory or 0, available_bytes(device)
    loading = largest_tensor(path, mc, images=images, mtp=mtp,  # held beside the placed weights while loading
                             quantize_head=config.quantize_head)
    need = weights + loading + RUNTIME_BYTES + pool
    figures = (f"weights as run {weights / 1e9:.2f} GB + loading's largest tensor {loading / 1e9:.2f} GB + runtime "
               f"{RUNTIME_BYTES / 1e9:.2f} GB" + (f" + --kv-cache-memory {pool / 1e9:.2f} GB" if pool else "")
               + f" = {need / 1e9:.2f} GB")
    if need > free:
        raise ConfigError(f"{path} does not fit: {figures}, and this machine has {free / 1e9:.2f} GB available. "
                          + ("Give a smaller --kv-cache-memory, " if pool else "")
                          + "serve a block-FP8 checkpoint, or turn images off (--limit-mm-per-prompt "
                            "'{\"image\": 0}') where the model has a vision encoder")
    log.info("memory: %s of %.2f GB available", figures, free / 1e9)


def pool_for_context(mc: ModelConfig, config: EngineConfig, dtype: str, default: int, device) -> int:
    """The cache budget for an explicit --max-model-len without --kv-cache-memory: the default budget where that
    holds one request of the length, else the pool the length needs (scheduler/build.py context_budget), if it
    fits in 90% of the memory available now (the weights loaded); ConfigError with the figures otherwise."""
    from ..runner.platform import available_bytes
    from ..scheduler.build import context_budget

    need = context_budget(mc, config, config.max_model_len, dtype)
    if need <= default:
        log.info("KV pool sized from the memory free after loading: %.2f GB, which holds --max-model-len %s (%.2f "
                 "GB would)", default / 1e9, f"{config.max_model_len:,}", need / 1e9)
        return default
    free = available_bytes(device)
    if need > 0.9 * free:
        raise ConfigError(f"--max-model-len {config.max_model_len:,} needs a KV pool of {need / 1e9:.2f} GB and this "
                          f"machine has {free / 1e9:.2f} GB available after loading the weights (the pool may take "
                          f"90% of it): lower --max-model-len or --max-num-seqs, or serve a smaller checkpoint "
                          f"(block-FP8, --quantize int4)")
    log.info("KV pool sized for --max-model-len %s: %.2f GB (the default, %.2f GB, holds less; %.2f GB available)",
             f"{config.max_model_len:,}", need / 1e9, default / 1e9, free / 1e9)
    return need


class LLMEngine:
    """Synchronous engine. Not thread-safe: one thread calls add_request/abort_request/step.

    add_request(request_id, prompt, params, cache_salt=None, arrival_time=None)
        prompt: str | list[int] | {"prompt": str} | {"prompt_token_ids": list[int]}.
        Raises EngineInputError for bad input; nothing is queued then.
    abort_request(request_id)   frees everything the request holds; unknown ids are ignored.
    step() -> list[RequestOutput]  one output per request that advanced (or finished/aborted) this step.
    """

    def __init__(self, config: EngineConfig):
        import torch

        from ..embedded.model import ensure_model
        from ..model.loader import load_model
        from ..runner.cache import CacheStore
        from ..runner.platform import default_kv_budget, select_device, tune_allocator
        from ..runner.runner import ModelRunner
        from .sampler import Sampler
        from ..scheduler.build import build
        from ..text.tokenizer import load_tokenizer

        self.config = config
        tune_allocator()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = select_device(config.device)
        if self.device.type == "cpu":
            from ..model.ops.cpu_kernels import use_isa
            try:
                use_isa(config.cpu_isa)  # the process's choice, before any model is built (logged with the model)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        from ..hub import resolve_model
        # a Hub id resolves to its snapshot in the Hub cache (downloaded once); a directory is itself
        path = resolve_model(config.model, config.revision) or ensure_model(config.preset, seed=config.seed)
        self.model_path = path
        self.model_name = config.model or f"deltaserve/{config.preset}"
        mc = ModelConfig.from_path(path)
        self.model_config = mc
        weights = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
                      if f.endswith(".safetensors")) if os.path.isdir(path) else 0
        log.info("loading %s from %s (%.2f GB of safetensors)", self.model_name, path, weights / 1e9)
        self.dtype = resolve_dtype(config.dtype, mc)
        if self.dtype == "float16" and self.device.type == "cpu":
            log.warning("float16 has no fast matmul path on most CPUs (~150x slower than bfloat16 here); "
                        "prefer --dtype bfloat16")
        self.parallel = None  # tensor parallelism: rank 0's handle on the other ranks (deltaserve/parallel/)
        if self.device.type == "cpu" and config.tensor_parallel_size == 1 and not config.node_rank:
            check_memory(path, mc, config, self.dtype, self.device)  # before a byte is read: refuse with figures
        if config.tensor_parallel_size > 1 or config.node_rank:
            from ..parallel.launch import TensorParallel
            self.parallel = TensorParallel.start(config, path, self.dtype, self.device)  # loads shard 0
            self.model = self.parallel.model
        else:
            # --limit-mm-per-prompt image=0: the vision encoder's weights are never read (no memory for them)
            self.model = load_model(path, dtype=self.dtype, device=self.device, quantize_head=config.quantize_head,
                                    mtp=config.speculative_config is not None, vision=config.mm_limit("image") > 0,
                                    quantize=config.quantize)
        self.tokenizer = load_tokenizer(resolve_model(config.tokenizer, what="tokenizer") or path)
        kern = self.model.decode_kernels
        self.cpu_kernels = kern.isa if kern is not None and kern.compiled else "torch"  # stats, bench footers

        # config -> sizing -> memory + scheduler (the builder a simulated replica uses too) -> runner
        budget = config.kv_cache_memory or default_kv_budget(self.device, config.memory_utilization, self.model)
        if not config.kv_cache_memory and config.max_model_len and self.parallel is None:
            budget = pool_for_context(mc, config, self.dtype, budget, self.device)
        elif not config.kv_cache_memory:
            log.info("KV pool sized from the memory free after loading: %.2f GB (--memory-utilization %s of what is "
                     "available%s); --kv-cache-memory or --max-model-len chooses it", budget / 1e9,
                     config.memory_utilization, ", at most 2 GiB on a CPU" if self.device.type == "cpu" else "")
        if self.parallel:
            budget = self.parallel.agree_budget(budget)  # per rank: the smallest rank's
        shape, self.memory, self.scheduler = build(mc, config, budget, self.dtype)
        self.block_size, self.pool, self.max_model_len = shape.block_size, shape.pool, shape.max_model_len
        pool, caching = shape.pool, config.enable_prefix_caching
        self.store = CacheStore(self.model.config, pool, kv_dtype=getattr(torch, self.dtype),  # the rank's heads
                                conv_dtype=getattr(torch, self.dtype), device=self.device)
        self.runner = ModelRunner(self.model, self.store, self.device)
        self.disk = None  # the prefix cache's disk tier (--cache-disk): its files and I/O worker
        if config.cache_disk:
            from ..memory.eviction import EVICTION_POLICIES
            from ..runner.disk_store import DiskStore, fingerprint
            self.disk = DiskStore(config.cache_disk, config.cache_disk_bytes, self.memory, self.store,
                                  fingerprint(path, self.dtype, pool, config.cache_layout, self.cpu_kernels,
                                              config.quantize_head, self.device.type, config.quantize),
                                  EVICTION_POLICIES[config.eviction]())
        if self.parallel:
            self.runner = self.parallel.attach(self.runner, pool)  # every step runs on every rank
        # speculative decoding (--speculative-config; engine/speculative.py, docs/speculative.md)
        self.spec = config.speculative_config
        self.drafter = None  # proposes drafts after each step (MTPDrafter; tests put a ScriptedDrafter here)
        self.spec_stats = SpecStats()
        self._acceptance: dict[str, Acceptance] = {}
        if self.spec is not None:
            from .speculative import MTPDrafter
            self.store.enable_state_log(self.spec.num_speculative_tokens)
            self.runner.keep_hidden = True
            self.drafter = MTPDrafter(self.model)
        self.last_plan = None  # the plan of the latest step (the profiler and the validation read it)
        self.sampler = Sampler(id_to_piece=self.tokenizer.id_to_piece, argmax=kern.argmax if kern is not None else None)
        self._live: dict[str, _Live] = {}
        # images: the vision encoder (a multimodal checkpoint on one rank), the processor, the live requests' media
        self.vision = getattr(self.model, "visual", None) if self.parallel is None else None
        self.vision_config = VisionConfig.from_path(path) if self.vision is not None else None
        self._image_processor = None  # made on the first image (transformers' image processor)
        self.image_cache = None  # encoded image -> processed image, for that processor (--mm-processor-cache-gb)
        if self.vision is not None:
            from ..media.images import ProcessedImageCache
            from ..runner.media import MediaStore
            budget = int(config.mm_processor_cache_gb * (1 << 30))
            self.image_cache = ProcessedImageCache(budget) if budget else None  # 0: off, no digest taken
            self.runner.media = MediaStore()
            self.memory.media_token_ids = frozenset({self.vision_config.image_token_id})
        self._seed_counter = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.step_failures = 0  # steps that raised (see _recover)
        log.info("model %s (%s), dtype %s, device %s", self.model_name, mc.model_type, self.dtype, self.device)
        log.info("KV pool %s tokens (%s pages of %d tokens, layout %s, prefix caching %s); KV %s bytes/token; "
                 "GDN slot %s bytes x %d; max model len %d; up to %d resume points a request",
                 f"{pool.pool_tokens:,}", f"{pool.num_pages:,}", self.block_size, config.cache_layout,
                 "on" if caching else "off", f"{shape.geometry.kv_bytes_per_token:,}", f"{pool.slot_bytes:,}",
                 pool.num_slots, self.max_model_len, self.scheduler.resume_points)

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLMEngine":
        return cls(config)

    def shutdown(self) -> None:
        """Write the cached blocks to the disk tier and stop its worker, stop the tensor-parallel workers, if any
        (idempotent; the workers are also stopped at exit)."""
        if self.disk is not None:
            disk, self.disk = self.disk, None
            self.memory.spill_all()
            disk.close()
            self.memory.disk.close()
            self.memory.disk.poll()  # count what the worker finished
        if self.parallel is not None:
            self.parallel.close()

    # ------------------------------------------------------------------ requests
    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt", "multi_modal_data", "cache_hints",
                                     "cache_key"}
            if unknown:
                raise EngineInputError(f"unknown prompt field(s): {', '.join(sorted(unknown))}", "prompt")
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise EngineInputError("a prompt dict needs 'prompt' or 'prompt_token_ids'", "prompt")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise EngineInputError("a prompt is a string, a list of token ids, or a dict with 'prompt' or "
                               "'prompt_token_ids'", "prompt")

    def add_request(self, request_id: str, prompt, params=None, cache_salt: str | None = None,
                    arrival_time: float | None = None) -> list[int]:
        """Queue a request; returns its prompt's token ids as the engine runs them (each image placeholder
        widened to its image's token count). EngineInputError for what it refuses."""
        from .sampler import SamplingState
        from .sampling_params import SamplingParams
        from ..scheduler import Request
        from ..text.tokenizer import IncrementalDetokenizer

        if request_id in self._live:
            raise EngineInputError(f"request id {request_id!r} is already in use")
        if self.drafter is not None:  # a reused id must not find the drafts of its namesake
            self.drafter.forget(request_id)
            self._acceptance.pop(request_id, None)
        if isinstance(prompt, dict) and cache_salt is None:
            cache_salt = prompt.get("cache_salt")
        text, ids = self._prompt_ids(prompt)
        hints = _cache_hints(prompt.get("cache_hints") if isinstance(prompt, dict) else None, len(ids))
        images = None
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            images = self._prompt_images(ids, prompt["multi_modal_data"])
            if images is not None:
                ids = images.token_ids
                hints = {kind: images.widen(ps) for kind, ps in hints.items()}
        params = check_request(ids, params if params is not None else SamplingParams(),
                               self.model_config.vocab_size, self.max_model_len, self.config.strict_max_tokens,
                               self.config.max_output_tokens)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise EngineInputError("cache_salt must be a string", "cache_salt")
        now = time.time() if arrival_time is None else arrival_time
        seed = None
        if params.seed is None:
            seed = self.config.seed * 1_000_003 + self._seed_counter
            self._seed_counter += 1
        state = SamplingState.create(params, ids, eos_token_ids=self.tokenizer.eos_token_ids, seed=seed)
        req = Request(request_id=request_id, prompt_token_ids=ids, max_tokens=params.max_tokens,
                      cache_salt=cache_salt, arrival_time=now,
                      prompt_logprobs=params.prompt_logprobs is not None,
                      media=images.media_keys if images is not None else (), cache_hints=hints,
                      cache_key=_cache_key(prompt, cache_salt))
        try:
            self.scheduler.add(req)
        except ValueError as e:
            raise EngineInputError(str(e)) from None
        if images is not None:
            self.runner.media.add(request_id, self._request_media(images))
        self._live[request_id] = _Live(
            request_id, text, ids, params, state,
            IncrementalDetokenizer(self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens),
            RequestMetrics(arrival_time=now), logprobs=[] if params.logprobs is not None else None)
        return ids

    def _prompt_images(self, ids: list[int], data):
        """The request's images, preprocessed, its placeholders expanded (engine/images.py); None for none."""
        from .images import image_items, prepare_images

        items = image_items(data)
        if not items:
            return None
        return prepare_images(ids, items, self._images_processor(), self.vision_config.image_token_id,
                              self.config.mm_limit("image"), self.image_cache)

    def prompt_token_ids(self, ids: list[int], images: list | None) -> list[int]:
        """The prompt as add_request would run it, each image placeholder widened to its image's token count,
        from the images' sizes alone (token counting: nothing is preprocessed or queued). Safe beside the
        engine's steps: it reads the processor's settings only. EngineInputError as add_request refuses."""
        from .images import widened_ids

        if not images:
            return list(ids)
        return widened_ids(ids, list(images), self._images_processor(), self.vision_config.image_token_id,
                           self.config.mm_limit("image"))

    def _images_processor(self):
        """The image processor (made on first use); EngineInputError where the model takes no images."""
        from ..media.images import ImagePreprocessor

        if self.vision is None:
            raise EngineInputError(f"model {self.model_name} has no vision encoder"
                                   + (" on this engine (tensor parallelism serves text only)" if self.parallel else "")
                                   + ": it takes text, not images", "multi_modal_data")
        if self._image_processor is None:
            self._image_processor = ImagePreprocessor(self.model_path)
        return self._image_processor

    def _request_media(self, images):
        """The runner's side of a request's images (runner/media.py): pixels, grids and placeholder spans."""
        import torch

        from ..model.mrope import ImageSpan
        from ..runner.media import RequestMedia

        return RequestMedia([ImageSpan(o, r, c) for o, (r, c) in zip(images.offsets, images.grids)],
                            [torch.from_numpy(im.pixels) for im in images.images], [im.grid for im in images.images],
                            key=tuple(im.hash for im in images.images))

    def _release(self, request_id: str) -> None:
        """A request ended (finished or aborted): its images' encoder output goes with it."""
        media = getattr(self.runner, "media", None)
        if media is not None:
            media.drop(request_id)

    def abort_request(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        if live is not None:
            self.scheduler.abort(request_id)
            self._release(request_id)
        if self.drafter is not None:
            self.drafter.forget(request_id)
            self._acceptance.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._live)

    def has_background_work(self) -> bool:
        """The scheduler's own jobs (finished requests' outputs recomputed by prefill: scheduler/jobs.py);
        step() runs them in budget nobody else needs. A server steps them while idle."""
        return self.scheduler.jobs.has_work()

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        plan = self.last_plan = self.scheduler.schedule()
        if self.disk is not None:  # outside the try: a load that cannot land must not leave a published hash
            self.disk.sync()  # spilled pages out, loaded ones in, before the step writes or reads a page
            if plan.is_empty() and self.memory.disk.busy():
                self.disk.wait(0.01)  # only reads from disk to wait for: do not spin
        try:
            lazy = self._lazy_head(plan)  # only with a drafter, never under tensor parallelism (refused there)
            logits = self.runner.execute(plan, lazy) if lazy else self.runner.execute(plan)
            sampled = self._sample(plan, logits)
        except Exception as e:  # noqa: BLE001 - one failing request must not take the others down
            if getattr(e, "fatal", False):  # the engine cannot go on (a tensor-parallel rank is gone)
                raise
            return self._recover(plan, e)
        outputs = self._emit(plan, sampled)
        if self.drafter is not None:
            self._draft(plan, sampled, logits.hidden)
        return outputs

    def _recover(self, plan, error: Exception) -> list[RequestOutput]:
        """A step failed (the model, a kernel, the sampler). Alone in its step, a request is the cause: it is
        aborted with the error as its stop_reason. With others, nothing of the step counts: every request in it
        is preempted (their GDN slots may be half-advanced) and recomputes, alone and one at a time until past
        the failed step (scheduler/jobs.py FailedSteps), so a second failure names its request; the rest lose
        nothing."""
        self.step_failures += 1
        log.error("engine step failed with %d request(s) in it: %s: %s", len(plan.work), type(error).__name__,
                  error, exc_info=error)
        if len(plan.work) != 1:
            self.scheduler.failed_steps.recover(plan)
            self.scheduler.failed_steps.isolate({w.request_id: w.start_pos + len(w.token_ids) for w in plan.work})
            return []
        rid = plan.work[0].request_id
        self.scheduler.finish(rid, "abort")
        self._release(rid)
        live = self._live.pop(rid, None)
        if live is None:
            return []
        live.finish_reason = "abort"
        live.stop_reason = f"the engine failed on this request: {type(error).__name__}: {error}"
        live.metrics.finished_time = time.time()
        return [self._output(live)]

    def _lazy_head(self, plan) -> set[str]:
        """The verify steps whose head runs lazily (speculative.verify_greedy_lazily): plain greedy without logprobs
        (the tokens then need only each row's argmax) and drafts accepted seldom enough that row 0 alone usually
        decides the step (Acceptance.lazy_head); a sampled row or logprobs need every row's logits."""
        if self.drafter is None:
            return set()
        lazy = set()
        for w in plan.work:
            live = self._live.get(w.request_id)
            if w.num_drafts and w.sample and live is not None and self.sampler.argmax_only(live.sampling) \
                    and self._acceptance.setdefault(w.request_id, Acceptance()).lazy_head():
                lazy.add(w.request_id)
        return lazy

    def _sample(self, plan, logits) -> dict[str, object]:
        now = time.time()
        for w in plan.work:
            live = self._live.get(w.request_id)
            if live is None:  # a background job of the scheduler's: nothing to sample
                continue
            if live.metrics.first_scheduled_time is None:
                live.metrics.first_scheduled_time = now
            if w.request_id in logits.prompt and live.params.prompt_logprobs is not None:
                self._prompt_logprobs(live, w, logits.prompt[w.request_id])
        owners = logits.owners
        if not owners and not logits.lazy:
            return {}
        verifying = {w.request_id: w for w in plan.work if w.num_drafts and w.sample}
        if not verifying:
            outs = self.sampler.sample(logits.sample, [self._live[r].sampling for r in owners])
            return dict(zip(owners, outs))
        plain = [i for i, r in enumerate(owners) if r not in verifying]
        sampled: dict[str, object] = {}
        if plain:
            rows = logits.sample if len(plain) == len(owners) else logits.sample[plain]
            sampled.update(zip([owners[i] for i in plain],
                               self.sampler.sample(rows, [self._live[owners[i]].sampling for i in plain])))
        lazy = [rid for rid in verifying if rid in logits.lazy]  # their heads in two calls at most, all together
        lazy_outs = dict(zip(lazy, verify_greedy_lazily(
            self.sampler.argmax, self.model.compute_logits,
            [(logits.lazy[rid], self._live[rid].sampling, verifying[rid].token_ids[1:]) for rid in lazy]))) \
            if lazy else {}
        for rid, w in verifying.items():
            if rid in lazy_outs:
                outs = lazy_outs[rid]
            else:
                i = owners.index(rid)
                outs = verify(self.sampler, logits.sample[i: i + w.num_drafts + 1], self._live[rid].sampling,
                              w.token_ids[1:])
            accepted = len(outs) - 1
            # the slot's GDN state <- the one after the last kept token (the step leaves the recurrent state after
            # its first token, so a step that kept its drafts replays them: CacheStore.rollback)
            self.runner.rollback(w.slot, accepted)
            self.spec_stats.record(w.num_drafts, accepted)
            self._acceptance.setdefault(rid, Acceptance()).record(w.num_drafts, accepted)
            sampled[rid] = outs
        return sampled

    def _prompt_logprobs(self, live: _Live, w, chunk_logits) -> None:
        """Logits at position p score token p + 1; only positions whose next token is in the prompt."""
        n_prompt = len(live.prompt_ids)
        positions = [w.start_pos + i for i in range(len(w.token_ids)) if w.start_pos + i + 1 < n_prompt]
        if not positions:
            return
        k = positions[0] - w.start_pos
        targets = [live.prompt_ids[p + 1] for p in positions]
        lps = self.sampler.prompt_logprobs(chunk_logits[k: k + len(positions)], targets, live.params.prompt_logprobs)
        for p, lp in zip(positions, lps):
            live.prompt_logprobs[p + 1] = lp

    def _emit(self, plan, sampled: dict[str, object]) -> list[RequestOutput]:
        tokens: dict[str, object] = {}
        for rid, s in sampled.items():
            if isinstance(s, list):  # a verify step: the tokens it emits, up to a failed row
                ok = [o.token_id for o in s[: next((j for j, o in enumerate(s) if o.error), len(s))]]
                if ok:
                    tokens[rid] = ok
            elif s.error is None:
                tokens[rid] = s.token_id
        self.scheduler.update(plan, tokens)
        for w in plan.work:
            if not w.is_decode and w.request_id in self._live:
                self.prompt_tokens_total += len(w.token_ids)
        now = time.time()
        outputs = []
        for rid, s in sampled.items():
            live = self._live.get(rid)
            if live is None:
                continue
            for one in (s if isinstance(s, list) else (s,)):
                if one.error is not None:
                    self.scheduler.finish(rid, "abort")
                    live.finish_reason = "abort"
                    live.stop_reason = one.error
                else:
                    self._append(live, one, now)
                if live.finish_reason is not None:  # a stop inside a verify step drops the tokens after it
                    break
            outputs.append(self._output(live))
            if live.finish_reason is not None:
                live.metrics.finished_time = now
                del self._live[rid]
                self._release(rid)
        return outputs

    def _draft(self, plan, sampled: dict[str, object], hidden: dict) -> None:
        """Show the drafter this step's kept outputs of the model, and ask it for the next step's drafts of every
        request about to decode its last token, as many as its acceptance says pay (speculative.Acceptance).
        hidden: the step's StepLogits.hidden (request id -> first position, the model's output rows). With the
        adaptive rule the batch's drafts are cut to the step's max_verify_rows (speculative.fit_drafts)."""
        wanted: dict[str, tuple[int, float]] = {}  # every request about to decode: (drafts it asks for, its rate)
        for w in plan.work:
            req = self.scheduler.get(w.request_id)
            req = None if req is None or req.is_finished else req
            if w.request_id not in self._live or req is None or w.request_id not in hidden:
                if req is None:
                    self.drafter.forget(w.request_id)
                    self._acceptance.pop(w.request_id, None)
                continue
            start, rows = hidden[w.request_id]
            kept = req.num_computed_tokens - start  # a verify step keeps its accepted rows only
            self.drafter.observe(w.request_id, start, rows[:kept], req.all_token_ids)
            if w.request_id in sampled and req.num_computed_tokens == req.num_tokens - 1:
                k = self.spec.num_speculative_tokens
                if self.spec.adaptive:
                    acc = self._acceptance.setdefault(w.request_id, Acceptance())
                    wanted[w.request_id] = (acc.next_k(k), acc.rate)
                else:
                    wanted[w.request_id] = (k, 1.0)
        cap = self.spec.max_verify_rows if self.spec.adaptive else 0  # fixed drafts: K every step, no cap
        for rid, k in fit_drafts(wanted, len(wanted), cap).items():
            self.scheduler.set_drafts(rid, self.drafter.propose(rid, self.scheduler.get(rid).all_token_ids, k)
                                      if k else [])

    def _append(self, live: _Live, s, now: float) -> None:
        req = self.scheduler.get(live.request_id)
        live.num_cached_tokens = req.num_cached_tokens
        live.metrics.num_preemptions = req.num_preemptions
        if live.metrics.first_token_time is None:
            live.metrics.first_token_time = now
        live.metrics.last_token_time = now
        tok = s.token_id
        self.generation_tokens_total += 1
        live.token_ids.append(tok)
        if live.logprobs is not None:
            live.logprobs.append(s.logprobs)
        p = live.params
        delta = live.detok.add(tok)
        live.text += delta
        n_out = len(live.token_ids)
        reason, stop = None, None
        if n_out >= p.min_tokens:
            if tok in self.tokenizer.eos_token_ids and not p.ignore_eos:
                reason = "stop"
            elif p.stop_token_ids and tok in p.stop_token_ids:
                reason, stop = "stop", tok
            elif p.stop and (hit := self._find_stop(live, len(delta))) is not None:
                reason, stop = "stop", hit
            elif s.guide_finished:
                reason = "stop"
        if reason is None and n_out >= req.max_tokens:  # the scheduler's limit (check_request: within the context),
            reason = "length"  # at which update() has finished the request already
        if reason is not None:
            if stop is None or isinstance(stop, int):
                live.text += live.detok.flush()  # a stream ending mid-character
            live.finish_reason, live.stop_reason = reason, stop
            self.scheduler.finish(live.request_id, reason, outputs=n_out)  # a verify step's tokens past a stop go

    def _find_stop(self, live: _Live, new_chars: int) -> str | None:
        """Look for a stop string in the new text (and the tail it may complete); truncate the text there."""
        p = live.params
        longest = max(len(x) for x in p.stop)
        start = max(0, len(live.text) - new_chars - longest + 1)
        for s in p.stop:
            i = live.text.find(s, start)
            if i != -1:
                live.text = live.text[: i + (len(s) if p.include_stop_str_in_output else 0)]
                return s
        return None

    def _output(self, live: _Live) -> RequestOutput:
        hold = 0
        if live.finish_reason is None and live.params.stop and not live.params.include_stop_str_in_output:
            hold = max(len(s) for s in live.params.stop) - 1  # text that may still become a stop string
        visible = max(live.sent_text, len(live.text) - hold)
        new_text = live.text[live.sent_text: visible]
        live.sent_text = visible
        new_ids = live.token_ids[live.sent_tokens:]
        live.sent_tokens = len(live.token_ids)
        plp = None
        if live.params.prompt_logprobs is not None:
            plp = [None] + [live.prompt_logprobs.get(i) for i in range(1, len(live.prompt_ids))]
        comp = CompletionOutput(index=0, text=live.text[:visible],
                                token_ids=list(live.token_ids),
                                logprobs=list(live.logprobs) if live.logprobs is not None else None,
                                finish_reason=live.finish_reason, stop_reason=live.stop_reason)
        return RequestOutput(request_id=live.request_id, prompt=live.prompt, prompt_token_ids=live.prompt_ids,
                             outputs=[comp], finished=live.finish_reason is not None,
                             num_cached_tokens=live.num_cached_tokens, prompt_logprobs=plp, metrics=live.metrics,
                             new_token_ids=new_ids, new_text=new_text)

    # ------------------------------------------------------------------ stats
    def stats(self) -> EngineStats:
        m, ic = self.memory, self.image_cache
        kept, ckpt_pages = m.num_checkpoints()
        return EngineStats(
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            pages_total=m.num_pages, pages_used=m.num_pages_in_use, slots_total=m.num_slots,
            slots_used=m.num_slots_in_use, kv_cache_usage=m.num_pages_in_use / max(1, m.num_pages),
            prompt_tokens=self.prompt_tokens_total, generation_tokens=self.generation_tokens_total,
            checkpoints_kept=kept, checkpoint_bytes=ckpt_pages * self.pool.bytes_per_page
            + (0 if self.pool.layout.in_pool else kept * self.pool.per_page_state_bytes),
            cpu_kernels=self.cpu_kernels, spec_decode_num_drafts=self.spec_stats.num_drafts,
            spec_decode_num_draft_tokens=self.spec_stats.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.spec_stats.num_accepted_tokens,
            spec_decode_accepted_per_pos=list(self.spec_stats.accepted_per_pos),
            mm_cache_queries=ic.hits + ic.misses if ic is not None else 0, mm_cache_hits=ic.hits if ic is not None else 0,
            **self.scheduler.counters())


def _cache_hints(hints, n: int) -> dict:
    """A prompt dict's "cache_hints": token positions in (0, n) where the caller expects later requests to share the
    prompt's prefix up to, the candidates for its resume points (scheduler/policy.py choose_resume_points). A list
    is the caller's own (the declared source); a dict maps a source ("declared", "structural": what the chat routes
    compute, server/resume_points.py) to its positions, most likely read first. A hint changes no output, only what
    is kept, so positions outside the prompt are dropped rather than refused."""
    from ..memory.save_kind import HINTED_SOURCES, SaveKind

    if hints is None:
        return {}
    by_source = hints if isinstance(hints, dict) else {SaveKind.DECLARED.value: hints}
    out: dict = {}
    for source, ps in by_source.items():
        if source not in {k.value for k in HINTED_SOURCES}:
            raise EngineInputError(f"cache_hints: unknown source {source!r} (declared, structural)", "cache_hints")
        if not isinstance(ps, (list, tuple)) or not all(isinstance(h, int) and not isinstance(h, bool) for h in ps):
            raise EngineInputError("cache_hints is a list of token positions", "cache_hints")
        out[SaveKind(source)] = list(dict.fromkeys(h for h in ps if 0 < h < n))
    return out


def _cache_key(prompt, cache_salt: str | None) -> str | None:
    """What groups requests for the learned resume points: the prompt dict's "cache_key" (the client's
    prompt_cache_key), else its cache salt (requests that may share pages at all)."""
    key = prompt.get("cache_key") if isinstance(prompt, dict) else None
    if key is not None and not isinstance(key, str):
        raise EngineInputError("cache_key must be a string", "cache_key")
    return key if key is not None else cache_salt
