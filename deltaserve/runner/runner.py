"""The model runner: carries out a StepPlan on the caches (zero, restore, forward, save) and returns the logits
the engine samples from."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..model.batch import ForwardBatch
from ..scheduler.plan import SeqWork, StateCopy, StepPlan
from .cache import CacheStore


class StateCopyError(RuntimeError):
    """Fail closed: a checkpoint copy that would serve a wrong GDN state."""


@dataclass
class StepLogits:
    """The logits that sample the step's next tokens, one row per sampling request, and (if asked) those of a
    request's prompt chunk."""

    owners: list[str]  # the request ids of sample's rows, in order (a verify step's request: a row per token)
    sample: torch.Tensor | None  # [len(owners), V] float32
    prompt: dict[str, torch.Tensor]  # request id -> [len(chunk), V] float32
    # with keep_hidden (speculative decoding): request id -> (first position, the model's output at each of its
    # tokens this step [n, hidden]), what the MTP layer drafts from
    hidden: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)
    # execute(lazy_head=...): request id -> its verify span's output rows [k + 1, hidden], the head not yet run on
    # them (speculative.verify_greedy_lazily runs it row 0 first); their rows are not in sample
    lazy: dict[str, torch.Tensor] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model, store: CacheStore, device: torch.device | str = "cpu"):
        self.model = model
        self.store = store
        self.device = torch.device(device)
        self.keep_hidden = False  # return every request's hidden rows (StepLogits.hidden): the drafter reads them
        self.media = None  # MediaStore (media.py) on a multimodal model: the live requests' images

    def rollback(self, slot: int, accepted: int) -> None:
        """After every verify step: the slot's GDN state <- the one after its token `accepted` (0 = the last sampled
        token, j = its j-th draft), from the step's state log (conv states copied; the recurrent state, left after
        token 0 by the step, replayed through the accepted drafts: CacheStore.rollback). The K/V rows of rejected
        drafts stay in their page, never read (attention reads positions up to its own) and rewritten by the next
        step's tokens."""
        self.store.rollback(slot, accepted, self.model.replay_gdn)

    def _check_copies(self, plan: StepPlan) -> None:
        bs = self.store.block_size
        by_slot = {w.slot: w for w in plan.work}
        for c in plan.restores:
            w = by_slot.get(c.slot)
            if w is None or w.start_pos % bs:
                raise StateCopyError(f"restore into slot {c.slot} off a block boundary "
                                     f"(start {None if w is None else w.start_pos}, block {bs})")
        for c in plan.saves:
            w = by_slot.get(c.slot)
            end = None if w is None else w.start_pos + len(w.token_ids)
            pos = end if c.pos is None else c.pos
            if w is None or pos % bs or not w.start_pos < pos <= end:
                raise StateCopyError(f"save of slot {c.slot} at {pos}: not a block boundary of its work "
                                     f"({None if w is None else w.start_pos}..{end}, block {bs})")

    def build_batch(self, work: list[SeqWork], saves: tuple[StateCopy, ...] = ()) -> ForwardBatch:
        """The flat batch of `work`; saves inside a span (before its end) ride on it for the GDN layers."""
        inside: dict[int, list] = {}
        for c in saves:
            inside.setdefault(c.slot, []).append((c.pos, c.location))
        return ForwardBatch.build([(w.token_ids, w.start_pos, w.slot, w.page_ids, w.is_decode,
                                    tuple(sorted(inside.get(w.slot, ()))), self._span_media(w)) for w in work],
                                  self.device)

    def _span_media(self, w: SeqWork):
        """What a request's images change in its span (positions, embedding rows), or None (text only)."""
        m = self.media.get(w.request_id) if self.media is not None else None
        return m.span_media(self.model.visual, w.start_pos, len(w.token_ids)) if m is not None else None

    def lazy_head_exact(self) -> bool:
        """Whether the head gives a row the same bits alone as beside other rows: the packed linears (compiled
        linear_bf16 / linear_fp8, oneDNN's) are row-wise batch-invariant (tests/test_linear.py); F.linear in float32
        (MKL's sgemm, blocked by the number of rows) is not, and keeps the head over every row at once."""
        return self.model.linear_kind is not None

    @torch.inference_mode()
    def execute(self, plan: StepPlan, lazy_head: frozenset[str] | set[str] = frozenset()) -> StepLogits:
        """zero -> restore -> forward -> save; returns the logits the engine samples from. lazy_head: requests whose
        verify span's rows come back as hidden rows (StepLogits.lazy) for the engine to run the head on row by need;
        honoured only where lazy_head_exact()."""
        self._check_copies(plan)
        ends = {w.slot: w.start_pos + len(w.token_ids) for w in plan.work}
        self.store.zero_pages(plan.zero_pages)
        self.store.zero_slots(plan.zero_slots)
        for c in plan.restores:
            self.store.restore(c)
        out = StepLogits([], None, {})
        if plan.work:
            # prefill spans first, then decodes (the model batches the decodes together)
            work = [w for w in plan.work if not w.is_decode] + [w for w in plan.work if w.is_decode]
            batch = self.build_batch(work, tuple(c for c in plan.saves if c.pos is not None and c.pos < ends[c.slot]))
            hidden = self.model.forward(batch, self.store.caches())  # [T, hidden]
            rows, owners = [], []
            lazy = lazy_head if lazy_head and self.lazy_head_exact() else ()
            for w, s in zip(work, batch.spans):
                if w.prompt_logprobs:
                    out.prompt[w.request_id] = self.model.compute_logits(hidden[s.start: s.start + s.length])
                if w.sample and w.num_drafts:  # a verify step samples after each of its tokens
                    assert w.is_decode and s.length == w.num_drafts + 1, "a verify step is one decode span"
                    if w.request_id in lazy:
                        out.lazy[w.request_id] = hidden[s.start: s.start + s.length]
                    else:
                        rows.extend(range(s.start, s.start + s.length))
                        owners.extend([w.request_id] * s.length)
                elif w.sample:
                    rows.append(s.start + s.length - 1)
                    owners.append(w.request_id)
                if self.keep_hidden:
                    out.hidden[w.request_id] = (w.start_pos, hidden[s.start: s.start + s.length])
            if rows:  # a decode-only step samples every row: the head runs on hidden as it is
                picked = hidden if len(rows) == hidden.shape[0] else hidden[torch.tensor(rows, device=hidden.device)]
                out.owners, out.sample = owners, self.model.compute_logits(picked)
        for c in plan.saves:
            if c.pos is None or c.pos == ends.get(c.slot):
                self.store.save(c)
        return out
