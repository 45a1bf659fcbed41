"""The scheduler: continuous batching, chunked prefill, align mode, preemption. Pure Python, no torch.

One step (schedule() -> StepPlan, the runner executes it, then update(plan, sampled)):
  1. decodes: every running request past its prompt (its last sampled token; or, when resuming after a
     preemption, a generated token being replayed) gets 1 token, in admission order;
  2. running prefills (prompt chunks, or recomputation after a preemption), in admission order;
  3. waiting requests, first come first served, while there is budget, a free slot, room under
     max_num_seqs and pages, and the step's prefill tokens are under prefill_merge_tokens (if set). A
     request that does not fit stops admission (strict FCFS), except one whose prefix hit is being read
     back from the disk tier (memory/disk_tier.py): it waits, and those behind it go on. Nothing new is
     admitted in a step that preempted, or in which a running prefill could not get budget (so a long
     prompt is not starved by a stream of short ones);
  4. background jobs (jobs.py), only in a step that nothing above has work for.

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
Waiting requests never preempt running ones. A failed step's requests are preempted the same way, then planned
alone until past it (jobs.FailedSteps).

update() is where a step's results become visible: num_computed_tokens advances, the blocks the step
completed are published (never at scheduling time), checkpoints the step saved are attached, sampled
tokens are appended, and requests that reached max_tokens finish ("length").

Generated tokens, prefill-exact: with reprefill_outputs, a finished request's outputs are recomputed through the
prefill path by background jobs (jobs.ReprefillJobs: step 4 above, in steps nothing else has work for), so that
the next turn of a conversation hits them bit for bit as a cold run computes them.

Counters: the scheduler's (prefix-cache queries and hits, preemptions, the jobs') are in self.stats
(stats.SchedulerStats), the memory manager's in memory.stats.
"""
from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Mapping

from ..config import ConfigError
from ..memory.manager import DISK_GO, DISK_READING, CheckpointError, MemoryManager, MemoryUsage, PrefixHit
from ..memory.save_kind import DISK_KEPT_KINDS, MANDATORY_KINDS, SaveKind
from ..memory.sizing import ENGINE_KERNEL_ALIGNMENT as KERNEL_GRID  # the GDN chunked kernel's 64-token grid
from .jobs import FailedSteps, ReprefillJobs
from .plan import SeqWork, StateCopy, StepPlan
from .learned import LearnedJunctions
from .policy import AlignEveryBlock, CheckpointPolicy, GridChunks, choose_resume_points
from .request import FINISH_STATUS, Request, RequestStatus
from .stats import SchedulerStats


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
    drafts: tuple[int, ...] = ()  # a verify step: the drafts after the last token (end - start - 1 of them)


class Scheduler:
    def __init__(self, memory: MemoryManager, max_num_seqs: int, max_num_batched_tokens: int,
                 checkpoint_policy: CheckpointPolicy | None = None, chunk_grid: int | None = None,
                 replay_decode: bool = True, prefill_merge_tokens: int = 0, checkpoint_grid: int = 0,
                 reprefill_outputs: bool = False, job_tokens: int = 256, encoder_budget: int | None = None,
                 resume_points: int = 1 << 30):
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
        at most job_tokens tokens a step (at least a block; jobs.py).
        resume_points: the most resume points (declared, structural, learned and grid checkpoints) one request
        keeps (policy.choose_resume_points; build.py derives it from --resume-points and --resume-point-bytes).
        encoder_budget: image tokens the vision encoder may produce in one step (default max_num_batched_tokens).
        The runner encodes all of a request's images in the step whose chunk first reaches one of them
        (runner/media.py); that request pays their tokens from this budget. Over it, the chunk ends at the block
        boundary before that image (or waits a step); the first request to encode in a step always may, so
        a request with more image tokens than the budget still runs."""
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
        if resume_points < 0:
            raise ConfigError(f"--resume-points must be >= 0, not {resume_points}")
        self.resume_points = resume_points
        self.learned = LearnedJunctions()  # the learned resume-point source, by request key
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
        self.encoder_budget = max_num_batched_tokens if encoder_budget is None else encoder_budget
        if self.encoder_budget < 1:
            raise ConfigError(f"--max-num-encoder-input-tokens must be >= 1, not {self.encoder_budget}")
        self.stats = SchedulerStats()
        reprefill = reprefill_outputs and memory.caching and memory.num_gdn_groups > 0
        self.jobs = ReprefillJobs(self, self.stats, reprefill, max(job_tokens, memory.block_size))
        self.failed_steps = FailedSteps(self)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self.requests: dict[str, Request] = {}  # every unfinished request
        # per-step scratch
        self._budget = 0
        self._recs: dict[str, _Scheduled] = {}
        self._encoding: dict[str, int] = {}  # requests whose images the step encodes -> their image tokens
        self._preempted: list[str] = []
        self._recently_finished: dict[str, Request] = {}

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
        if self.caching and self.memory.num_gdn_groups and not request.background:
            self._choose_resume_points(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def _choose_resume_points(self, req: Request) -> None:
        """req's resume points and grid spacing under the per-request budget (policy.choose_resume_points): its
        hinted sources, then what earlier requests of its key taught (learned.py; requests without a key form one
        group), then the grid."""
        bs = self.block_size
        hashes = req.block_hashes(req.num_prompt_tokens // bs, bs)
        wanted = {**req.cache_hints, SaveKind.LEARNED: self.learned.points(req.cache_key or "", hashes, bs)}
        req.resume_points, req.grid_step = choose_resume_points(wanted, bs, req.num_prompt_tokens,
                                                                self.resume_points, getattr(self.policy, "grid", 0))

    def max_request_tokens(self) -> int:
        """The most tokens (prompt + max_tokens) one request can ever hold; the engine refuses more."""
        return self.memory.max_request_tokens()

    def finish(self, request_id: str, reason: str, outputs: int | None = None) -> bool:
        """Finish a request ("stop", "length" or "abort") and free everything it holds.

        outputs: how many generated tokens the request keeps, where the caller stopped it inside a verify step's
        tokens (a stop string or token before its last): those after it are dropped, also from a request update()
        has just finished at max_tokens, before its outputs are recomputed for the cache (jobs.py).
        Safe at any moment (between schedule() and update() too: update() then skips its work).
        Returns False if the request is unknown or already finished.
        """
        if reason not in FINISH_STATUS:
            raise ValueError(f"finish reason must be one of {sorted(FINISH_STATUS)}, not {reason!r}")
        if outputs is not None and (done := self.get(request_id)) is not None and len(done.output_token_ids) > outputs:
            del done.output_token_ids[outputs:]
            done.num_computed_tokens = min(done.num_computed_tokens, done.num_tokens - 1)
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self.memory.free(request_id)
        else:
            (self.jobs.queue if req.background else self.waiting).remove(req)
        req.status = FINISH_STATUS[reason]
        req.finish_reason = reason
        req.slot, req.page_ids = None, ()
        if not req.background:
            self._recently_finished[request_id] = req
            if reason != "abort":
                self.jobs.queue_for(req)
        return True

    def abort(self, request_id: str) -> bool:
        return self.finish(request_id, "abort")

    def set_drafts(self, request_id: str, drafts: list[int]) -> None:
        """The drafter's proposals for the request's next step, which _drafts trims to what that step can verify."""
        self.requests[request_id].draft_token_ids = list(drafts)

    def get(self, request_id: str) -> Request | None:
        """An unfinished request, or one finished since the last schedule() (so the engine can still
        read num_cached_tokens etc. of a request that update() finished at max_tokens)."""
        req = self.requests.get(request_id)
        return req if req is not None else self._recently_finished.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def counters(self) -> dict[str, object]:
        """Every monotonic counter of the scheduler and of its memory manager, by its one name (EngineStats'), the
        by-kind dicts copied."""
        return {**asdict(self.memory.stats), **asdict(self.stats), **asdict(self.memory.disk_stats())}

    def usage(self) -> MemoryUsage:
        return self.memory.usage()

    # ------------------------------------------------------------------ one step
    def schedule(self) -> StepPlan:
        self._budget = self.max_num_batched_tokens
        self._recs = {}
        self._encoding = {}
        self._preempted = []
        self._recently_finished = {}
        if self.failed_steps.schedule():  # after a failed step: its requests one at a time
            return self._build_plan()
        self.jobs.yield_seats()
        stalled = False
        for req in list(self.running):  # 1. decodes
            if self._budget < 1:
                break
            if req.status is RequestStatus.RUNNING and self.in_decode(req):
                start = req.num_computed_tokens
                drafts = self._drafts(req, start)
                if self.schedule_running(req, start, start + 1 + len(drafts), True) and drafts:
                    self._recs[req.request_id].drafts = drafts
        for req in list(self.running):  # 2. running prefills
            if (req.status is not RequestStatus.RUNNING or req.request_id in self._recs or self.in_decode(req)
                    or req.background):
                continue
            start = req.num_computed_tokens
            assert start < req.num_tokens, f"running request {req.request_id} has nothing to compute"
            end = self.chunk_end(req, start)
            if end <= start:
                stalled = True
                continue
            self.schedule_running(req, start, end, False)
        if not self._preempted and not stalled:  # 3. waiting, FCFS
            for req in list(self.waiting):
                if not (self._budget > 0 and len(self.running) < self.max_num_seqs and self.memory.num_free_slots
                        and not self._prefills_full()):
                    break
                if not self.admit(req) and not req.disk_wait:
                    break  # a request whose blocks are being read from disk waits; those behind it go on
        if not self._recs and not self.waiting:  # 4. background jobs, only in a step nobody else has work for
            self.jobs.schedule()
        return self._build_plan()

    def _drafts(self, req: Request, start: int) -> tuple[int, ...]:
        """The drafts req's decode step verifies (docs/speculative.md), and clears them: only for the last token (not a
        replay after a preemption), as many as the budget leaves room for, none past max_tokens (a step emits at
        most drafts + 1 tokens), and with caching on none that reach the block's last position, so a verify step
        never completes a block: no checkpoint is taken and no block published from a state that may be rejected
        (the block's last two tokens decode plainly, and the step that completes it saves as any decode)."""
        drafts, req.draft_token_ids = tuple(req.draft_token_ids), []
        if not drafts or start != req.num_tokens - 1 or req.background:
            return ()
        k = min(len(drafts), self._budget - 1, req.max_tokens - len(req.output_token_ids) - 1)
        if self.caching:
            k = min(k, (start // self.block_size + 1) * self.block_size - start - 2)
        if k <= 0:
            return ()
        assert not self._saves(req, start, start + 1 + k), "a verify step takes no checkpoint"
        return drafts[:k]

    def _prefills_full(self) -> bool:
        """The step's prefill tokens reached prefill_merge_tokens: no further waiting request joins it."""
        if not self.prefill_merge_tokens:
            return False
        tokens = sum(r.end - r.start for r in self._recs.values() if not r.is_decode)
        return tokens >= self.prefill_merge_tokens

    def update(self, plan: StepPlan, sampled: Mapping[str, int]) -> list[Request]:
        """The runner has executed `plan`: advance, publish, append sampled tokens.

        sampled maps request id -> token for every SeqWork with sample=True; for a verify step (num_drafts > 0) the
        list of tokens it emits: the accepted drafts and the token after them, so it computed (kept) len(list) of its
        tokens. A request missing from it (its sampling failed) gets no token and must be finished by the caller
        before the next schedule(). Returns the requests that received a token, in plan order; those that reached
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
            got = sampled.get(w.request_id) if w.sample else None
            emitted = [] if got is None else [int(t) for t in got] if isinstance(got, (list, tuple)) else [int(got)]
            if w.num_drafts:  # the accepted prefix: the last token and the drafts that matched
                assert len(emitted) <= w.num_drafts + 1, "a verify step emits at most drafts + 1 tokens"
                end = w.start_pos + max(1, len(emitted))
                assert end // bs == w.start_pos // bs or not self.caching, "a verify step completes no block"
            req.num_computed_tokens = end
            if w.request_id in self._encoding:
                req.media_encoded = True  # the runner keeps the encoder's output for the request's life
            if end >= req.num_prompt_tokens:
                req._prompt_done = True
            if self.caching:
                have = self.memory.num_published(w.request_id)
                if end // bs > have:
                    self.memory.publish(w.request_id, [req.block_key(j, bs) for j in range(have, end // bs)])
                self.memory.commit_checkpoints(w.request_id)
            self.failed_steps.advanced(w.request_id, end)
            if req.background:
                self.jobs.advanced(req, w.start_pos, end)
                continue
            if emitted:
                req.output_token_ids.extend(emitted)
                advanced.append(req)
                if len(req.output_token_ids) >= req.max_tokens:
                    self.finish(req.request_id, "length")
        return advanced

    # ------------------------------------------------------------------ step operations
    # jobs.py plans through these too. admit, schedule_running and budget are valid only while schedule() plans a
    # step; preempt and withdraw also between steps (a failed step's recovery, a job dropped when a request finishes)
    @property
    def budget(self) -> int:
        """Tokens left in the step being planned."""
        return self._budget

    def in_decode(self, req: Request, c: int | None = None) -> bool:
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

    def chunk_end(self, req: Request, start: int, budget: int | None = None) -> int:
        """Where req's prefill chunk from start ends with `budget` tokens (default what is left in the step), and
        within the step's encoder budget (encoder_budget)."""
        end = self.policy.chunk_end(start, start + (self._budget if budget is None else budget),
                                    self._prefill_target(req))
        first = self._first_image(req, start, end)
        if first is None or not self._encoding or sum(self._encoding.values()) + self._image_tokens(req) \
                <= self.encoder_budget:
            return end
        cut = first // self.block_size * self.block_size  # chunks end on block boundaries (the policy's grid too)
        return cut if cut > start else start

    @staticmethod
    def _image_tokens(req: Request) -> int:
        return sum(n for _, n, _ in req.media)

    def _first_image(self, req: Request, start: int, end: int) -> int | None:
        """Where the first image [start, end) reaches starts, when computing that chunk runs the encoder (req's
        images not encoded yet, nor in this step); None otherwise."""
        if not req.media or req.media_encoded or req.request_id in self._encoding:
            return None
        return next((off for off, n, _ in req.media if off < end and start < off + n), None)

    def _charge_encoder(self, req: Request, start: int, end: int) -> None:
        """req's chunk [start, end) is planned: it pays its images' encoding if it runs the encoder."""
        if self._first_image(req, start, end) is not None:
            self._encoding[req.request_id] = self._image_tokens(req)

    def _saves(self, req: Request, start: int, end: int) -> list[tuple[int, SaveKind]]:
        """The policy's checkpoints for computing [start, end) (position, kind); none without caching or GDN.

        The fork point is where the cached chain of blocks this request shares with earlier sequences ends
        without a checkpoint (find_prefix's num_matched_blocks): typically a shared system prompt followed by
        different text, computed by the earlier sequence inside one chunk. A checkpoint there lets every later
        sequence with that prefix hit all of it; it is taken inside the chunk, so the bits are unchanged
        (docs/design.md, the 64-token grid)."""
        if not (self.caching and self.memory.num_gdn_groups):
            return []
        saves = self.policy.saves(start, end, self._prefill_target(req), req.fork_point, req.resume_points,
                                  req.grid_step)
        if req.background:  # the job's end is the checkpoint it exists for
            saves = [(p, SaveKind.GENERATED if p == req.num_tokens else kind) for p, kind in saves]
        return saves

    def _victim(self) -> Request:
        """Who gives up its pages: a background job first, else the most recently admitted request."""
        return next((r for r in reversed(self.running) if r.background), self.running[-1])

    @staticmethod
    def _mandatory(saves: list[tuple[int, SaveKind]]) -> int:
        return sum(1 for _, kind in saves if kind in MANDATORY_KINDS)

    def _worth_waiting_for(self, saves: list[tuple[int, SaveKind]]) -> int:
        """With a disk tier, the optional saves a request waits at admission to have room for (memory/save_kind.py:
        what leaves the pool then goes to disk, not away), while running requests hold pages that will make room;
        a running prefill takes them only where they fit, as without the tier (no preemption for them)."""
        if self.memory.disk is None or not self.running:
            return 0
        return sum(1 for _, kind in saves if kind in DISK_KEPT_KINDS)

    def _reserve(self, rec: _Scheduled, saves: list[tuple[int, SaveKind]]) -> None:
        """Reserve the mandatory saves (their pages were counted), then the optional ones while they fit: prompt, fork
        and resume points from any allocatable page, grid ones from free pages only (they evict nothing)."""
        mem, rid, per = self.memory, rec.req.request_id, self.memory.checkpoint_pages
        for pos, kind in sorted(saves, key=lambda s: s[1] not in MANDATORY_KINDS):
            room = mem.num_free_pages() if kind == SaveKind.GRID else mem.num_allocatable()
            if kind in MANDATORY_KINDS or room >= per:
                rec.saves.append((pos, mem.reserve_checkpoint(rid, pos, kind)))
        rec.saves.sort()

    def schedule_running(self, req: Request, start: int, end: int, is_decode: bool) -> bool:
        """Plan [start, end) of running req, preempting for its pages (a job first, else the newest request); False
        when req itself was preempted."""
        rid = req.request_id
        saves = self._saves(req, start, end)
        need = self.memory.pages_needed(rid, end) + self.memory.checkpoint_pages * self._mandatory(saves)
        while need > self.memory.num_allocatable():
            victim = self._victim()
            self.preempt(victim)
            if victim is req:
                return False
        rec = _Scheduled(req, start, end, is_decode, self.memory.append_pages(rid, end))
        self._reserve(rec, saves)
        self._recs[rid] = rec
        self._budget -= end - start
        self._charge_encoder(req, start, end)
        return True

    def withdraw(self, request_id: str) -> None:
        """Take request_id's work out of the step being planned (if it has any); its tokens return to the budget."""
        rec = self._recs.pop(request_id, None)
        if rec is not None:
            self._budget += rec.end - rec.start
        self._encoding.pop(request_id, None)

    def preempt(self, victim: Request) -> None:
        """victim gives up its pages and slot and waits at the front of the queue; a background job is dropped."""
        if victim.background:
            self.jobs.drop(victim)
            return
        rid = victim.request_id
        self.running.remove(victim)
        self.withdraw(rid)
        self.memory.free(rid)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        victim.slot, victim.page_ids = None, ()
        self.waiting.appendleft(victim)
        self._preempted.append(rid)
        self.stats.preemptions += 1

    def admit(self, req: Request, queue: deque | None = None, budget: int | None = None) -> bool:
        """Admit req, the head of `queue` (default the waiting queue), with `budget` tokens (default what is
        left in the step)."""
        queue = self.waiting if queue is None else queue
        bs, mem = self.block_size, self.memory
        total = req.num_tokens
        hit: PrefixHit | None = None
        if self.caching and not req.skip_cache_lookup and not (req.prompt_logprobs and not req._prompt_done):
            nb = total // bs if req.background else (total - 1) // bs  # a hit leaves a token to sample from
            hashes = req.block_hashes(nb, bs)

            def block_tokens(j: int):
                return req.tokens(j * bs, (j + 1) * bs)

            # the disk tier: a longer hit there is read back first (the request waits, the step goes on; those
            # behind it go on while its reads are in flight, not while it waits for the pages to put them in)
            disk = DISK_GO if req.background else mem.prepare_from_disk(req.root_hash, hashes, block_tokens, nb)
            req.disk_wait = disk == DISK_READING
            if disk != DISK_GO:
                return False
            hit = mem.find_prefix(req.root_hash, hashes, block_tokens, nb)
        start = hit.num_tokens if hit is not None else 0
        if req.background and not self.jobs.worth_running(req, start, hit):
            self.jobs.drop(req)
            return False
        is_decode = self.in_decode(req, start)
        if hit is not None and hit.num_matched_blocks > hit.num_blocks and mem.num_gdn_groups:
            req.fork_point = hit.num_matched_blocks * bs
        end = start + 1 if is_decode else self.chunk_end(req, start, budget)
        if end <= start:
            return False
        saves = self._saves(req, start, end)
        need = (mem.pages_for(end) - (hit.num_blocks if hit else 0)
                + mem.checkpoint_pages * (self._mandatory(saves) + self._worth_waiting_for(saves)) + mem.pin_cost(hit))
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
            self.stats.prefix_cache_queries += total
            self.stats.prefix_cache_hits += start
        if req.num_preemptions == 0:
            req.num_cached_tokens = start
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = start
        if queue[0] is req:
            queue.popleft()
        else:  # a request ahead of it waits for the disk tier
            queue.remove(req)
        self.running.append(req)
        self._recs[rid] = rec
        self._budget -= end - start
        self._charge_encoder(req, start, end)
        return True

    def _build_plan(self) -> StepPlan:
        work, zero_pages, zero_slots, restores, saves = [], [], [], [], []
        for rid, rec in self._recs.items():
            req = rec.req
            req.page_ids = self.memory.page_table(rid)
            req.slot = slot = self.memory.slot_of(rid)
            last = rec.end - len(rec.drafts)  # a verify step: its drafts follow the request's last token
            work.append(SeqWork(
                request_id=rid, token_ids=tuple(req.tokens(rec.start, last)) + rec.drafts, start_pos=rec.start,
                slot=slot, page_ids=req.page_ids, is_decode=rec.is_decode,
                sample=last == req.num_tokens and not req.background, num_drafts=len(rec.drafts),
                prompt_logprobs=req.prompt_logprobs and not rec.is_decode and rec.start < req.num_prompt_tokens
                and not req._prompt_done))
            zero_pages.extend(rec.new_pages)
            if rec.zero_slot:
                zero_slots.append(slot)
            if rec.restore is not None:
                restores.append(StateCopy(slot, rec.restore))
            saves.extend(StateCopy(slot, loc, pos) for pos, loc in rec.saves)
        encoder_images = tuple(n for rid, rec in self._recs.items() if rid in self._encoding for _, n, _ in rec.req.media)
        plan = StepPlan(work=tuple(work), zero_pages=tuple(zero_pages), zero_slots=tuple(zero_slots),
                        restores=tuple(restores), saves=tuple(saves), preempted=tuple(self._preempted),
                        encoder_images=encoder_images)
        self._recs = {}
        return plan
