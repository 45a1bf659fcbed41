"""Work the Scheduler plans besides its requests: re-prefill background jobs, and the isolation of a failed step's
requests. Pure Python, no torch. Both are parts of one Scheduler (scheduler.py), which holds them and calls them
while it plans a step; they plan through its step operations (admit, schedule_running, preempt, withdraw).

Re-prefill jobs (ReprefillJobs). A block that holds a generated token was written by decode steps and is published
on the decode path's hash (only the request's own resume finds it), because the decode path's last bits differ from
the prefill path's. With reprefill_outputs (and GDN layers), when a request finishes, a background job (an
OutputsJob, id "<id>/outputs") recomputes its prompt + outputs, to the last full block, through the prefill path
from the prompt's checkpoint, and publishes those blocks and a checkpoint at their end (SaveKind.GENERATED): the
next turn of a conversation, which sends them as its prompt, then hits them bit for bit as a cold run computes them.
Invariants:
  * jobs take only what nobody else needs: they run only in steps that nothing else has work for, at most
    job_tokens tokens a step, so a step with a job in it never delays a live request's prefill or decode;
  * they take pages as a request does (evicting the least recently used cached content, which the outputs they
    store are likelier to be asked for than), and are dropped (never requeued) when a waiting request needs their
    seat or slot, or a running one their pages (the scheduler's victim is a job first);
  * a job runs only when its prefix hit reaches the prompt's checkpoint (resume_at), and is dropped when that is
    gone or when every block it would compute is cached already;
  * at most 4 * max_num_seqs jobs wait; the oldest are dropped first (the least likely to be sent again).
The engine steps them while it is otherwise idle.

Failed steps (FailedSteps). When the runner fails on a plan, none of it counts: recover() preempts the plan's
requests (their GDN slots may be half-advanced), and isolate() then has the scheduler plan them alone, one at a
time and in order, each until it is past the end of its work in the failed step, so that a step that fails again
holds one request. Other requests wait meanwhile.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Mapping

from ..memory.manager import PrefixHit
from .plan import StepPlan
from .request import Request, RequestStatus
from .stats import SchedulerStats

if TYPE_CHECKING:
    from .scheduler import Scheduler


@dataclass(eq=False)
class OutputsJob(Request):
    """A finished request's prompt + outputs, to their last full block, recomputed through the prefill path: no
    sampling (max_tokens 1 is never reached), and it yields its seat, slot and pages to any request."""

    background: ClassVar[bool] = True
    resume_at: int = 0  # runs only when its prefix hit reaches this far (the prompt's checkpoint)


class ReprefillJobs:
    """The Scheduler's re-prefill background jobs (module docstring). enabled: reprefill_outputs, with caching on
    and GDN layers. job_tokens: at least a block (the Scheduler rounds it up)."""

    def __init__(self, scheduler: "Scheduler", stats: SchedulerStats, enabled: bool, job_tokens: int):
        self._s = scheduler
        self.stats = stats
        self.enabled = enabled
        self.job_tokens = job_tokens
        self.queue: deque[OutputsJob] = deque()  # jobs not yet admitted (oldest first)

    def has_work(self) -> bool:
        """Jobs queued or running (the engine steps them when it is otherwise idle)."""
        return bool(self.queue) or any(r.background for r in self._s.running)

    def queue_for(self, req: Request) -> None:
        """req finished: a job that recomputes its prompt + outputs to their last full block through the prefill path,
        when that reaches past the prompt's last block boundary (where the prompt's checkpoint is)."""
        if not self.enabled or req.media:  # a job has no pixels: its prefix could not be recomputed with them
            return
        s = self._s
        bs, toks = s.block_size, req.all_token_ids
        n = len(toks) // bs * bs
        jid = f"{req.request_id}/outputs"
        if n <= req.num_prompt_tokens // bs * bs or n >= s.max_request_tokens() or jid in s.requests:
            return
        job = OutputsJob(jid, toks[:n], max_tokens=1, cache_salt=req.cache_salt, extra_keys=req.extra_keys,
                         arrival_time=req.arrival_time, resume_at=req.num_prompt_tokens // bs * bs)
        job.status = RequestStatus.WAITING
        s.requests[jid] = job
        self.queue.append(job)
        while len(self.queue) > 4 * s.max_num_seqs:  # the oldest are the least likely to be sent again
            self.drop(self.queue[0])

    def drop(self, job: OutputsJob) -> None:
        """Drop a job, queued or running; its work in the step being planned is withdrawn."""
        self._s.withdraw(job.request_id)
        self._s.finish(job.request_id, "abort")
        self.stats.reprefill_dropped += 1

    def worth_running(self, job: OutputsJob, start: int, hit: PrefixHit) -> bool:
        """Whether job, whose prefix hit reaches start, is worth admitting: not when the prompt's checkpoint is gone
        (not worth a recompute), nor when every block is cached already (a next turn that re-sent these outputs
        computed them first, and went on past them)."""
        return start >= job.resume_at and hit.num_matched_blocks * self._s.block_size != job.num_tokens

    def advanced(self, job: OutputsJob, start: int, end: int) -> None:
        """A step computed [start, end) of job; at its end it finishes (its blocks and checkpoint stay cached)."""
        self.stats.reprefill_tokens += end - start
        if end == job.num_tokens:
            self._s.finish(job.request_id, "stop")
            self.stats.reprefill_jobs += 1

    def yield_seats(self) -> None:
        """A waiting request never waits for a job: drop the newest running jobs while it lacks a seat or slot."""
        s = self._s
        while s.waiting and (len(s.running) >= s.max_num_seqs or not s.memory.num_free_slots):
            job = next((r for r in reversed(s.running) if r.background), None)
            if job is None:
                return
            self.drop(job)

    def schedule(self) -> None:
        """A step with no other work: running jobs, then new ones (job_tokens at most each)."""
        s = self._s
        for job in [r for r in s.running if r.background]:
            if s.budget < 1:
                return
            start = job.num_computed_tokens
            end = s.chunk_end(job, start, min(s.budget, self.job_tokens))
            if end <= start:
                continue
            s.schedule_running(job, start, end, False)  # a job that does not fit drops itself
        while (self.queue and not s.waiting and s.budget > 0 and len(s.running) < s.max_num_seqs
               and s.memory.num_free_slots):
            head = self.queue[0]
            if not s.admit(head, self.queue, min(s.budget, self.job_tokens)):
                if not self.queue or self.queue[0] is not head:
                    continue  # it dropped itself (its prompt's checkpoint is gone): try the next
                if not s.running:  # idle, and still it does not fit: it never will
                    self.drop(head)
                    continue
                return


class FailedSteps:
    """The isolation of a failed step's requests (module docstring)."""

    def __init__(self, scheduler: "Scheduler"):
        self._s = scheduler
        self._alone: dict[str, int] = {}  # request id -> tokens it must compute alone (in order)

    def recover(self, plan: StepPlan) -> list[str]:
        """The runner failed on `plan`: none of it counts. Its requests' GDN slots may be half-advanced, so each
        is preempted (pages and slot freed, published blocks kept) and will recompute; returns their ids."""
        s = self._s
        ids = []
        for w in reversed(plan.work):  # preempt puts each at the front: keep their order
            req = s.requests.get(w.request_id)
            if req is not None and req.status is RequestStatus.RUNNING:
                s.preempt(req)
                ids.append(w.request_id)
        return ids[::-1]

    def isolate(self, until: Mapping[str, int]) -> None:
        """Schedule these requests alone, one at a time and in this order, each until it has computed until[id]
        tokens (the end of its work in a failed step), so that a step that fails again has one request in it.
        Other requests wait meanwhile."""
        for rid, n in until.items():
            self._alone.setdefault(rid, n)

    def schedule(self) -> bool:
        """Plan the next isolated request alone; False when none is left to run (normal scheduling then)."""
        s = self._s
        while self._alone:
            rid = next(iter(self._alone))
            req = s.requests.get(rid)
            if req is not None and self._schedule_alone(req):
                return True
            del self._alone[rid]  # finished meanwhile, or cannot run now: back to normal scheduling
        return False

    def advanced(self, request_id: str, end: int) -> None:
        """A step computed request_id up to end: past its failed step, it leaves isolation."""
        if self._alone.get(request_id, end + 1) <= end:
            del self._alone[request_id]

    def _schedule_alone(self, req: Request) -> bool:
        s = self._s
        if req.status is RequestStatus.RUNNING:
            start, decode = req.num_computed_tokens, s.in_decode(req)
            end = start + 1 if decode else s.chunk_end(req, start)
            return end > start and s.schedule_running(req, start, end, decode)
        if not s.memory.num_free_slots:
            return False
        s.waiting.remove(req)
        s.waiting.appendleft(req)
        return s.admit(req)
