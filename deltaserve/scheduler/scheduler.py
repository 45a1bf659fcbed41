"""The scheduler: continuous batching, chunked prefill, align mode, preemption. Pure Python, no torch.

One step (schedule() -> StepPlan, the runner executes it, then update(plan, sampled)):
  1. decodes: every running request past its prompt (its last sampled token; or, when resuming after a
     preemption, a generated token being replayed) gets 1 token, in admission order;
  2. running prefills (prompt chunks, or recomputation after a preemption), in admission order;
  3. waiting requests, first come first served, while there is budget, a free slot, room under
     max_num_seqs and pages, and the step's prefill tokens are under prefill_merge_tokens (if set). A
     request that does not fit stops admission (strict FCFS). Nothing new is admitted in a step that
     preempted, or in which a running prefill could not get budget (so a long prompt is not starved
     by a stream of short ones).

Align mode (caching on): a prefill chunk that does not reach the end of the prompt ends on a block
boundary (the checkpoint policy floors it); with less than one block of budget left such a chunk waits
for the next step. A budget below one block could never move a long prompt, so the constructor refuses
it (ConfigError), as it refuses a budget below max_num_seqs. Every step that ends on a block boundary
saves the slot (decodes included). Caching off: chunks are floored to the 64-token kernel grid instead
(policy.GridChunks; chunk_grid=1 turns that off), which keeps a request's logits independent of its
batch. Budgets of at least block_size + max_num_seqs never make a prefill wait behind decodes.

Memory: when a running request needs pages that the pool cannot give (free + evictable), the most
recently admitted running request is preempted (even if it was already scheduled in this step: its
work is withdrawn): its pages and slot are freed (published blocks stay cached, evictable), and it goes
back to the front of the waiting queue with num_computed_tokens = 0. When readmitted it looks up the
cache like any request (it usually hits its own blocks) and recomputes the rest: prompt tokens through
the prefill path, generated tokens through the decode path one per step (replay_decode, the default:
bit-exact with the uninterrupted run; replay_decode=False recomputes them by prefill as vLLM does).
The step that computes its last token samples the next one.
Waiting requests never preempt running ones.

update() is where a step's results become visible: num_computed_tokens advances, the blocks the step
completed are published (never at scheduling time), checkpoints the step saved are attached, sampled
tokens are appended, and requests that reached max_tokens finish ("length").

Generated tokens, prefill-exact: a block that holds a generated token was written by decode steps and is
published on the decode path's hash (only the request's own resume finds it), because the decode path's last
bits differ from the prefill path's. With reprefill_outputs (and GDN layers), when a request finishes, a
background job (a Request with background=True, id "<id>/outputs") recomputes its prompt +
outputs, to the last full block, through the prefill path from the prompt's checkpoint, and publishes those
blocks and a checkpoint at their end ("generated"): the next turn of a conversation, which sends them as
its prompt, then hits them bit for bit as a cold run computes them. Jobs only take what nobody else needs:
they run only in steps that nothing else has work for (at most job_tokens tokens a step: a step with a job
in it never delays a live request's prefill or decode); they take pages as a request does (evicting the least recently used cached content, which the outputs they
store are likelier to be asked for than), and are dropped (never requeued) when a waiting request needs their
seat or slot, or a running one their pages. The engine steps them while it is otherwise idle.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Mapping

from ..config import ConfigError
from ..memory.manager import CacheStats, CheckpointError, MemoryManager, MemoryUsage, PrefixHit
from ..memory.sizing import ENGINE_KERNEL_ALIGNMENT as KERNEL_GRID  # the GDN chunked kernel's 64-token grid
from .plan import SeqWork, StateCopy, StepPlan
from .policy import AlignEveryBlock, CheckpointPolicy, GridChunks
from .request import FINISH_STATUS, Request, RequestStatus


@dataclass
class _Scheduled:
    req: Request
    start: int
    end: int
    is_decode: bool
    new_pages: list[int] = field(default_factory=list)
    zero_slot: bool = False
    restore: tuple[int, ...] | None = None
    saves: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)  # (position, location)


class Scheduler:
    def __init__(self, memory: MemoryManager, max_num_seqs: int, max_num_batched_tokens: int,
                 checkpoint_policy: CheckpointPolicy | None = None, chunk_grid: int | None = None,
                 replay_decode: bool = True, prefill_merge_tokens: int = 0, checkpoint_grid: int = 0,
                 reprefill_outputs: bool = False, job_tokens: int = 256):
        """checkpoint_policy: default AlignEveryBlock(block_size, checkpoint_grid) with caching on,
        GridChunks(chunk_grid) with it off. checkpoint_grid: also save a checkpoint every this many tokens
        inside prefill chunks, from free pages only (0 = none; a multiple of the block size).
        chunk_grid (caching off): non-final prefill chunks end on multiples of it; default 64 (the GDN
        kernel grid) when the budget allows a whole grid, else 1. With caching on, chunks end on block
        boundaries, and the engine's blocks are multiples of 64.
        replay_decode: after a preemption, recompute the prompt through the prefill path and the
        generated tokens through the decode path, one per step (default), so the resumed request
        computes every token on the path the uninterrupted run used: prefill and decode differ in the
        last bits (docs/cpu.md), and on near-tied logits that flips greedy tokens. False: recompute
        everything through prefill (vLLM's way; fewer steps, not bit-exact).
        prefill_merge_tokens: a waiting request joins a step only while the step's prefill tokens are
        below this (the first prefill of a step always joins); 0 = no limit. Prompts that arrive
        together then finish one after another instead of all at the end of one long step: a prefill
        costing t finishes at t, the next at 2t, a mean of 1.5t instead of 2t, and closed-loop sessions
        stop landing their turns in the same step. Short prompts (together under the limit, where the
        step's fixed cost dominates) still share a step.
        reprefill_outputs: recompute finished requests' outputs through the prefill path in background jobs of
        at most job_tokens tokens a step (see the module docstring)."""
        if max_num_seqs < 1 or max_num_batched_tokens < max_num_seqs:
            raise ConfigError(f"--max-num-batched-tokens ({max_num_batched_tokens}) must be at least "
                              f"--max-num-seqs ({max_num_seqs}) >= 1, so every running request can decode")
        if memory.caching and max_num_batched_tokens < memory.block_size:
            raise ConfigError(
                f"with prefix caching on, prefill chunks end on block boundaries, so "
                f"--max-num-batched-tokens ({max_num_batched_tokens}) must be at least the block size "
                f"({memory.block_size}); raise it or turn caching off")
        self.memory = memory
        self.block_size = memory.block_size
        self.caching = memory.caching
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.replay_decode = replay_decode
        if prefill_merge_tokens < 0:
            raise ConfigError(f"--prefill-merge-tokens must be >= 0 (0 = no limit), not {prefill_merge_tokens}")
        self.prefill_merge_tokens = prefill_merge_tokens
        if checkpoint_policy is None:
            if memory.caching:
                checkpoint_policy = AlignEveryBlock(memory.block_size, checkpoint_grid)
            else:
                if chunk_grid is None:
                    chunk_grid = KERNEL_GRID if max_num_batched_tokens >= KERNEL_GRID else 1
                if chunk_grid > max_num_batched_tokens:
                    raise ConfigError(f"chunk grid {chunk_grid} exceeds --max-num-batched-tokens "
                                      f"{max_num_batched_tokens}")
                checkpoint_policy = GridChunks(chunk_grid)
        self.policy = checkpoint_policy
        self.reprefill = reprefill_outputs and memory.caching and memory.num_gdn_groups > 0
        self.job_tokens = max(job_tokens, memory.block_size)
        self.jobs: deque[Request] = deque()  # background jobs not yet admitted (oldest first)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self.requests: dict[str, Request] = {}  # every unfinished request
        # per-step scratch
        self._budget = 0
        self._recs: dict[str, _Scheduled] = {}
        self._preempted: list[str] = []
        self._recently_finished: dict[str, Request] = {}
        self._alone: dict[str, int] = {}  # isolate(): request id -> tokens it must compute alone (in order)

    # ------------------------------------------------------------------ requests in and out
    def add(self, request: Request) -> None:
        """Queue a request. Raises ValueError for one that can never be served."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if not request.prompt_token_ids:
            raise ValueError("the prompt is empty")
        if request.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, not {request.max_tokens}")
        cap = self.max_request_tokens()
        if request.num_tokens + request.max_tokens - len(request.output_token_ids) > cap:
            raise ValueError(f"prompt ({request.num_prompt_tokens} tokens) + max_tokens ({request.max_tokens}) "
                             f"exceeds the {cap} tokens one request can hold in this pool")
        request.status = RequestStatus.WAITING
        request.tag_outputs = self.caching  # a hit never serves decode-path bits as prefill ones
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def max_request_tokens(self) -> int:
        """The most tokens (prompt + max_tokens) one request can ever hold; the engine refuses more."""
        return self.memory.max_request_tokens()

    def finish(self, request_id: str, reason: str) -> bool:
        """Finish a request ("stop", "length" or "abort") and free everything it holds.

        Safe at any moment (between schedule() and update() too: update() then skips its work).
        Returns False if the request is unknown or already finished.
        """
        if reason not in FINISH_STATUS:
            raise ValueError(f"finish reason must be one of {sorted(FINISH_STATUS)}, not {reason!r}")
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self.memory.free(request_id)
        else:
            (self.jobs if req.background else self.waiting).remove(req)
        req.status = FINISH_STATUS[reason]
        req.finish_reason = reason
        req.slot, req.page_ids = None, ()
        if not req.background:
            self._recently_finished[request_id] = req
            if self.reprefill and reason != "abort":
                self._queue_job(req)
        return True

    # ------------------------------------------------------------------ background jobs
    def _queue_job(self, req: Request) -> None:
        """A job that recomputes req's prompt + outputs to their last full block through the prefill path,
        when that reaches past the prompt's last block boundary (where the prompt's checkpoint is)."""
        bs, toks = self.block_size, req.all_token_ids
        n = len(toks) // bs * bs
        jid = f"{req.request_id}/outputs"
        if n <= req.num_prompt_tokens // bs * bs or n >= self.max_request_tokens() or jid in self.requests:
            return
        job = Request(jid, toks[:n], max_tokens=1, cache_salt=req.cache_salt, extra_keys=req.extra_keys,
                      arrival_time=req.arrival_time, background=True)
        job.resume_at = req.num_prompt_tokens // bs * bs  # where its hit must reach (the prompt's checkpoint)
        job.status = RequestStatus.WAITING
        self.requests[jid] = job
        self.jobs.append(job)
        while len(self.jobs) > 4 * self.max_num_seqs:  # the oldest are the least likely to be sent again
            self._drop_job(self.jobs[0])

    def _drop_job(self, job: Request) -> None:
        rec = self._recs.pop(job.request_id, None)  # already in this step's plan: withdrawn
        if rec is not None:
            self._budget += rec.end - rec.start
        self.finish(job.request_id, "abort")
        self.memory.stats.reprefill_dropped += 1

    def has_background(self) -> bool:
        """Background jobs queued or running (the engine steps them when it is otherwise idle)."""
        return bool(self.jobs) or any(r.background for r in self.running)

    def _yield_seats(self) -> None:
        """A waiting request never waits for a job: drop the newest running jobs while it lacks a seat or slot."""
        while self.waiting and (len(self.running) >= self.max_num_seqs or not self.memory.num_free_slots):
            job = next((r for r in reversed(self.running) if r.background), None)
            if job is None:
                return
            self._drop_job(job)

    def _schedule_jobs(self) -> None:
        """A step with no other work: running jobs, then new ones (job_tokens at most each)."""
        mem = self.memory
        for job in [r for r in self.running if r.background]:
            if self._budget < 1:
                return
            start = job.num_computed_tokens
            end = self._chunk_end(job, start, min(self._budget, self.job_tokens))
            if end <= start:
                continue
            self._schedule_running(job, start, end, False)  # a job that does not fit drops itself
        while (self.jobs and not self.waiting and self._budget > 0 and len(self.running) < self.max_num_seqs
               and mem.num_free_slots):
            head = self.jobs[0]
            if not self._admit(head, self.jobs, min(self._budget, self.job_tokens)):
                if not self.jobs or self.jobs[0] is not head:
                    continue  # it dropped itself (its prompt's checkpoint is gone): try the next
                if not self.running:  # idle, and still it does not fit: it never will
                    self._drop_job(head)
                    continue
                return

    def abort(self, request_id: str) -> bool:
        return self.finish(request_id, "abort")

    def get(self, request_id: str) -> Request | None:
        """An unfinished request, or one finished since the last schedule() (so the engine can still
        read num_cached_tokens etc. of a request that update() finished at max_tokens)."""
        req = self.requests.get(request_id)
        return req if req is not None else self._recently_finished.get(request_id)

    get_request = get

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def stats(self) -> dict[str, int]:
        """Monotonic counters for metrics (the memory manager's CacheStats, under the metric names)."""
        st: CacheStats = self.memory.stats
        return {"prefix_queries": st.prefix_query_tokens, "prefix_hits": st.prefix_hit_tokens,
                "checkpoints_saved": st.checkpoints_saved, "checkpoints_restored": st.checkpoints_restored,
                "evictions": st.evicted_pages, "preemptions": st.preemptions,
                "checkpoints_saved_by_kind": dict(st.saved_by_kind),
                "checkpoints_evicted_by_kind": dict(st.evicted_by_kind)}

    def usage(self) -> MemoryUsage:
        return self.memory.usage()

    # ------------------------------------------------------------------ one step
    def schedule(self) -> StepPlan:
        self._budget = self.max_num_batched_tokens
        self._recs = {}
        self._preempted = []
        self._recently_finished = {}
        while self._alone:  # after a failed step: its requests one at a time (isolate)
            rid = next(iter(self._alone))
            req = self.requests.get(rid)
            if req is not None and self._schedule_alone(req):
                return self._build_plan()
            del self._alone[rid]  # finished meanwhile, or cannot run now: back to normal scheduling
        self._yield_seats()
        stalled = False
        for req in list(self.running):  # 1. decodes
            if self._budget < 1:
                break
            if req.status is RequestStatus.RUNNING and self._in_decode(req):
                start = req.num_computed_tokens
                self._schedule_running(req, start, start + 1, True)
        for req in list(self.running):  # 2. running prefills
            if (req.status is not RequestStatus.RUNNING or req.request_id in self._recs or self._in_decode(req)
                    or req.background):
                continue
            start = req.num_computed_tokens
            assert start < req.num_tokens, f"running request {req.request_id} has nothing to compute"
            end = self._chunk_end(req, start)
            if end <= start:
                stalled = True
                continue
            self._schedule_running(req, start, end, False)
        if not self._preempted and not stalled:  # 3. waiting, FCFS
            while (self.waiting and self._budget > 0 and len(self.running) < self.max_num_seqs
                   and self.memory.num_free_slots and not self._prefills_full()):
                if not self._admit(self.waiting[0]):
                    break
        if not self._recs and not self.waiting:  # 4. background jobs, only in a step nobody else has work for
            self._schedule_jobs()
        return self._build_plan()

    # ------------------------------------------------------------------ failed steps
    def recover(self, plan: StepPlan) -> list[str]:
        """The runner failed on `plan`: none of it counts. Its requests' GDN slots may be half-advanced, so each
        is preempted (pages and slot freed, published blocks kept) and will recompute; returns their ids."""
        ids = []
        for w in reversed(plan.work):  # _preempt puts each at the front: keep their order
            req = self.requests.get(w.request_id)
            if req is not None and req.status is RequestStatus.RUNNING:
                self._preempt(req)
                ids.append(w.request_id)
        return ids[::-1]

    def isolate(self, until: Mapping[str, int]) -> None:
        """Schedule these requests alone, one at a time and in this order, each until it has computed until[id]
        tokens (the end of its work in a failed step), so that a step that fails again has one request in it.
        Other requests wait meanwhile."""
        for rid, n in until.items():
            self._alone.setdefault(rid, n)

    def _schedule_alone(self, req: Request) -> bool:
        if req.status is RequestStatus.RUNNING:
            start, decode = req.num_computed_tokens, self._in_decode(req)
            end = start + 1 if decode else self._chunk_end(req, start)
            return end > start and self._schedule_running(req, start, end, decode)
        if not self.memory.num_free_slots:
            return False
        self.waiting.remove(req)
        self.waiting.appendleft(req)
        return self._admit(req)

    def _prefills_full(self) -> bool:
        """The step's prefill tokens reached prefill_merge_tokens: no further waiting request joins it."""
        if not self.prefill_merge_tokens:
            return False
        tokens = sum(r.end - r.start for r in self._recs.values() if not r.is_decode)
        return tokens >= self.prefill_merge_tokens

    def update(self, plan: StepPlan, sampled: Mapping[str, int]) -> list[Request]:
        """The runner has executed `plan`: advance, publish, append sampled tokens.

        sampled maps request id -> token for every SeqWork with sample=True. A request missing from it
        (its sampling failed) gets no token and must be finished by the caller before the next
        schedule(). Returns the requests that received a token, in plan order; those that reached
        max_tokens are already finished ("length"; get() still finds them until the next schedule()).
        """
        bs = self.block_size
        advanced: list[Request] = []
        for w in plan.work:
            req = self.requests.get(w.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # finished or aborted after scheduling
            if req.num_computed_tokens != w.start_pos:
                raise RuntimeError(f"plan out of date for {w.request_id}: starts at {w.start_pos}, "
                                   f"request has {req.num_computed_tokens} computed tokens")
            end = w.start_pos + len(w.token_ids)
            req.num_computed_tokens = end
            if end >= req.num_prompt_tokens:
                req._prompt_done = True
            if self.caching:
                have = self.memory.num_published(w.request_id)
                if end // bs > have:
                    self.memory.publish(w.request_id, [req.block_key(j, bs) for j in range(have, end // bs)])
                self.memory.commit_checkpoints(w.request_id)
            if self._alone.get(w.request_id, end + 1) <= end:
                del self._alone[w.request_id]  # passed the failed step alone
            if req.background:
                self.memory.stats.reprefill_tokens += end - w.start_pos
                if end == req.num_tokens:
                    self.finish(req.request_id, "stop")  # its blocks and checkpoint stay cached
                    self.memory.stats.reprefill_jobs += 1
                continue
            if w.sample and w.request_id in sampled:
                req.output_token_ids.append(int(sampled[w.request_id]))
                advanced.append(req)
                if len(req.output_token_ids) >= req.max_tokens:
                    self.finish(req.request_id, "length")
        return advanced

    # ------------------------------------------------------------------ internals
    def _in_decode(self, req: Request, c: int | None = None) -> bool:
        """Whether the token at position c (default: the next to compute) takes the decode path, one token
        per step: always the last (sampled) token after the prompt; with replay_decode also generated
        tokens recomputed after a preemption."""
        c = req.num_computed_tokens if c is None else c
        if c < req.num_prompt_tokens:
            return False
        return c < req.num_tokens if self.replay_decode else req.num_tokens - c == 1

    def _prefill_target(self, req: Request) -> int:
        """Where the prefill path stops: the prompt's end with replay_decode, else the last token."""
        return req.num_prompt_tokens if self.replay_decode else req.num_tokens

    def _chunk_end(self, req: Request, start: int, budget: int | None = None) -> int:
        return self.policy.chunk_end(start, start + (self._budget if budget is None else budget),
                                     self._prefill_target(req))

    def _saves(self, req: Request, start: int, end: int) -> list[tuple[int, str]]:
        """The policy's checkpoints for computing [start, end) (position, kind); none without caching or GDN.

        The fork point is where the cached chain of blocks this request shares with earlier sequences ends
        without a checkpoint (find_prefix's num_matched_blocks): typically a shared system prompt followed by
        different text, computed by the earlier sequence inside one chunk. A checkpoint there lets every later
        sequence with that prefix hit all of it; it is taken inside the chunk, so the bits are unchanged
        (docs/design.md, the 64-token grid)."""
        if not (self.caching and self.memory.num_gdn_groups):
            return []
        saves = self.policy.saves(start, end, self._prefill_target(req), req.fork_point)
        if req.background:  # the job's end is the checkpoint it exists for
            saves = [(p, "generated" if p == req.num_tokens else kind) for p, kind in saves]
        return saves

    def _victim(self) -> Request:
        """Who gives up its pages: a background job first, else the most recently admitted request."""
        return next((r for r in reversed(self.running) if r.background), self.running[-1])

    @staticmethod
    def _mandatory(saves: list[tuple[int, str]]) -> int:
        return sum(1 for _, kind in saves if kind in ("step", "generated"))

    def _reserve(self, rec: _Scheduled, saves: list[tuple[int, str]]) -> None:
        """Reserve the step's save (its pages were counted), then the optional ones while they fit: prompt and
        fork checkpoints from any allocatable page, grid ones from free pages only (they evict nothing)."""
        mem, rid, per = self.memory, rec.req.request_id, self.memory.checkpoint_pages
        for pos, kind in sorted(saves, key=lambda s: s[1] not in ("step", "generated")):
            room = mem.num_free_pages() if kind == "grid" else mem.num_allocatable()
            if kind in ("step", "generated") or room >= per:
                rec.saves.append((pos, mem.reserve_checkpoint(rid, pos, kind)))
        rec.saves.sort()

    def _schedule_running(self, req: Request, start: int, end: int, is_decode: bool) -> bool:
        rid = req.request_id
        saves = self._saves(req, start, end)
        need = self.memory.pages_needed(rid, end) + self.memory.checkpoint_pages * self._mandatory(saves)
        while need > self.memory.num_allocatable():
            victim = self._victim()
            self._preempt(victim)
            if victim is req:
                return False
        rec = _Scheduled(req, start, end, is_decode, self.memory.append_pages(rid, end))
        self._reserve(rec, saves)
        self._recs[rid] = rec
        self._budget -= end - start
        return True

    def _preempt(self, victim: Request) -> None:
        """victim gives up its pages and slot and waits at the front of the queue; a background job is dropped."""
        if victim.background:
            self._drop_job(victim)
            return
        rid = victim.request_id
        self.running.remove(victim)
        rec = self._recs.pop(rid, None)
        if rec is not None:
            self._budget += rec.end - rec.start
        self.memory.free(rid)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        victim.slot, victim.page_ids = None, ()
        self.waiting.appendleft(victim)
        self._preempted.append(rid)
        self.memory.stats.preemptions += 1

    def _admit(self, req: Request, queue: deque | None = None, budget: int | None = None) -> bool:
        """Admit req, the head of `queue` (default the waiting queue), with `budget` tokens (default what is
        left in the step)."""
        queue = self.waiting if queue is None else queue
        bs, mem = self.block_size, self.memory
        total = req.num_tokens
        hit: PrefixHit | None = None
        if self.caching and not req.skip_cache_lookup and not (req.prompt_logprobs and not req._prompt_done):
            nb = total // bs if req.background else (total - 1) // bs  # a hit leaves a token to sample from
            hashes = req.block_hashes(nb, bs)
            hit = mem.find_prefix(req.root_hash, hashes, lambda j: req.tokens(j * bs, (j + 1) * bs), nb)
        start = hit.num_tokens if hit is not None else 0
        if req.background and (start < req.resume_at or hit.num_matched_blocks * bs == total):
            # the prompt's checkpoint is gone (not worth a recompute), or every block is cached already (a next
            # turn that re-sent these outputs computed them first, and went on past them)
            self._drop_job(req)
            return False
        is_decode = self._in_decode(req, start)
        if hit is not None and hit.num_matched_blocks > hit.num_blocks and mem.num_gdn_groups:
            req.fork_point = hit.num_matched_blocks * bs
        end = start + 1 if is_decode else self._chunk_end(req, start, budget)
        if end <= start:
            return False
        saves = self._saves(req, start, end)
        need = (mem.pages_for(end) - (hit.num_blocks if hit else 0)
                + mem.checkpoint_pages * self._mandatory(saves) + mem.pin_cost(hit))
        if need > mem.num_allocatable():
            return False
        rid = req.request_id
        slot, location = mem.admit(rid, hit)
        if location is not None and start % bs:
            raise CheckpointError(f"restore for {rid} at position {start}, not a block boundary")
        rec = _Scheduled(req, start, end, is_decode, mem.append_pages(rid, end), zero_slot=location is None,
                         restore=location)
        self._reserve(rec, saves)
        if hit is not None and not req.background:
            mem.stats.prefix_query_tokens += total
            mem.stats.prefix_hit_tokens += start
        if req.num_preemptions == 0:
            req.num_cached_tokens = start
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = start
        queue.popleft()
        self.running.append(req)
        self._recs[rid] = rec
        self._budget -= end - start
        return True

    def _build_plan(self) -> StepPlan:
        work, zero_pages, zero_slots, restores, saves = [], [], [], [], []
        for rid, rec in self._recs.items():
            req = rec.req
            req.page_ids = self.memory.page_table(rid)
            req.slot = slot = self.memory.slot_of(rid)
            work.append(SeqWork(
                request_id=rid, token_ids=tuple(req.tokens(rec.start, rec.end)), start_pos=rec.start,
                slot=slot, page_ids=req.page_ids, is_decode=rec.is_decode,
                sample=rec.end == req.num_tokens and not req.background,
                prompt_logprobs=req.prompt_logprobs and not rec.is_decode and rec.start < req.num_prompt_tokens
                and not req._prompt_done))
            zero_pages.extend(rec.new_pages)
            if rec.zero_slot:
                zero_slots.append(slot)
            if rec.restore is not None:
                restores.append(StateCopy(slot, rec.restore))
            saves.extend(StateCopy(slot, loc, pos) for pos, loc in rec.saves)
        plan = StepPlan(work=tuple(work), zero_pages=tuple(zero_pages), zero_slots=tuple(zero_slots),
                        restores=tuple(restores), saves=tuple(saves), preempted=tuple(self._preempted))
        self._recs = {}
        return plan
