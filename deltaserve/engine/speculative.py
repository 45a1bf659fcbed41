"""Speculative decoding (docs/speculative.md): drafters, the verify rule, how many drafts a request gets, counters.

A step verifies a request's last sampled token t and its drafts d1..dk in one decode span (scheduler/scheduler.py
_drafts, runner/runner.py); row j of its logits is what a plain decode step computes after t, d1..dj. verify() samples
row 0, then row j only while the token sampled at row j - 1 equals d_j: every emitted token is drawn from the very
logits, with the very generator draw, plain decoding would use, so drafted == plain bit for bit, greedy or sampled.

Sampled (temperature > 0): the drafts are the MTP layer's greedy tokens, a one-hot draft distribution q = [d]. The
standard rejection rule accepts d with probability min(1, p(d) / q(d)) = p(d) and on rejection draws from
norm(max(p - q, 0)) = p without d. Drawing y ~ p and accepting iff y == d has the same law: P(accept) = p(d), and a
rejected y is p conditioned on y != d. verify() is that rule, coupled to plain sampling's own draw.

Drafters: MTPDrafter (the model's MTP layer, model/mtp.py) and, for tests and benchmarks, ScriptedDrafter (a known
continuation, right with probability p: the forced-acceptance and forced-rejection controls at p = 1 and 0).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

from .sampler import SampleOut


class Drafter(Protocol):
    def observe(self, request_id: str, start: int, hidden: torch.Tensor, tokens: Sequence[int]) -> None:
        """The model's outputs [n, H] at positions start .. start + n - 1, all of them kept (accepted), and the
        request's tokens now (prompt + outputs)."""

    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k drafts for the positions after tokens[-1] (fewer or none: the scheduler verifies what it gets)."""

    def forget(self, request_id: str) -> None:
        """The request is finished: drop what is held for it."""


class MTPDrafter:
    """Drafts with the model's MTP layer(s) (model.mtp). Each request keeps the layer's K/V (MTPCache), the model's
    outputs the layer has not run on yet, and the layer's output at the newest position it ran on; a draft chains on
    the layer's own output (docs/speculative.md).

    The layer runs lazily: observe() only queues the model's outputs, and propose() runs the layer over everything
    queued in one call before drafting. A request whose drafts are off (speculative.Acceptance) costs no MTP call
    until its next probe. Queued rows are flushed early past FLUSH rows (a long prompt), or when a request jumps
    ahead of its queue (a prefix hit after a preemption)."""

    FLUSH = 512

    def __init__(self, model):
        assert model.mtp is not None, "MTPDrafter needs a model loaded with its MTP layers"
        self.model = model
        self.caches: dict[str, object] = {}
        self.queued: dict[str, tuple[int, list[torch.Tensor]]] = {}  # request -> (first position, rows)
        self.last: dict[str, tuple[int, torch.Tensor]] = {}  # request -> (position, the layer's output there)

    def observe(self, request_id: str, start: int, hidden: torch.Tensor, tokens: Sequence[int]) -> None:
        if hidden.shape[0] == 0:
            return
        q = self.queued.get(request_id)
        if q is not None:
            first, rows = q
            end = first + sum(r.shape[0] for r in rows)
            if start > end:  # positions skipped: the queue is run first
                self._run(request_id, tokens)
                q = None
            elif start < end:  # recomputed positions (after a preemption): the older rows from start on go
                keep = torch.cat(rows)[: max(0, start - first)]
                q = (first, [keep]) if keep.shape[0] else None
        first, rows = q if q is not None else (start, [])
        self.queued[request_id] = (first, rows + [hidden.clone()])  # its own copy: the step's buffer may be reused
        if sum(r.shape[0] for r in rows) + hidden.shape[0] >= self.FLUSH:
            self._run(request_id, tokens)

    @torch.inference_mode()
    def _run(self, request_id: str, tokens: Sequence[int]) -> None:
        """The layer over the queued rows whose next token is known; the rest stay queued."""
        q = self.queued.pop(request_id, None)
        if q is None:
            return
        start, rows = q
        hidden = torch.cat(rows) if len(rows) > 1 else rows[0]
        n = min(hidden.shape[0], len(tokens) - 1 - start)
        if n < hidden.shape[0]:
            self.queued[request_id] = (start + max(n, 0), [hidden[max(n, 0):]])
        if n <= 0:
            return
        cache = self.caches.get(request_id)
        if cache is None:
            cache = self.caches[request_id] = self.model.mtp.new_cache(self.model.config, self.model.device)
        ids = torch.tensor(list(tokens[start + 1: start + 1 + n]), dtype=torch.long, device=self.model.device)
        out = self.model.mtp(self.model, ids, hidden[:n], start, cache)
        self.last[request_id] = (start + n - 1, out[-1:])

    @torch.inference_mode()
    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
        if k <= 0:
            return []
        self._run(request_id, tokens)
        last = self.last.get(request_id)
        if last is None or last[0] != len(tokens) - 2:  # the layer has not seen the newest token
            return []
        pos, h = last
        cache = self.caches[request_id]
        drafts = [int(torch.argmax(self.model.compute_logits(h)[0]).item())]
        for step in range(1, k):
            ids = torch.tensor([drafts[-1]], dtype=torch.long, device=self.model.device)
            h = self.model.mtp(self.model, ids, h, pos + step, cache, step=step)
            drafts.append(int(torch.argmax(self.model.compute_logits(h)[0]).item()))
        return drafts

    def forget(self, request_id: str) -> None:
        self.caches.pop(request_id, None)
        self.queued.pop(request_id, None)
        self.last.pop(request_id, None)


class ScriptedDrafter:
    """Proposes a known continuation of each prompt (e.g. plain greedy decoding's output), each draft right with
    probability p (seeded) and otherwise a token that is certainly not the continuation's. p = 1: the forced-acceptance
    control (a greedy request accepts every draft); p = 0: the forced-rejection control (never one).

    priced_by: a real drafter (MTPDrafter) that is fed and asked exactly as if it drafted, its drafts thrown away:
    a benchmark of a known acceptance then pays what drafting costs (the MTP layer and a full-vocabulary head per
    draft), as a real drafter at that acceptance would. Without it, drafting is free, which flatters the arm."""

    def __init__(self, continuations: dict[tuple[int, ...], Sequence[int]], p: float = 1.0, vocab_size: int = 2,
                 seed: int = 0, priced_by: Drafter | None = None):
        self.continuations = {tuple(k): list(v) for k, v in continuations.items()}
        self.p, self.vocab_size, self.rng = p, vocab_size, random.Random(seed)
        self.prompt_len: dict[str, tuple[tuple[int, ...], int]] = {}
        self.priced_by = priced_by

    def observe(self, request_id: str, start: int, hidden: torch.Tensor, tokens: Sequence[int]) -> None:
        if self.priced_by is not None:
            self.priced_by.observe(request_id, start, hidden, tokens)
        if request_id not in self.prompt_len:  # the longest known prompt the request starts with
            known = [p for p in self.continuations if len(p) <= len(tokens) and tuple(tokens[:len(p)]) == p]
            if known:
                prompt = max(known, key=len)
                self.prompt_len[request_id] = (prompt, len(prompt))

    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
        if self.priced_by is not None and k > 0:
            self.priced_by.propose(request_id, tokens, k)  # its cost, not its drafts
        known = self.prompt_len.get(request_id)
        if known is None:
            return []
        prompt, n = known
        cont = self.continuations[prompt][len(tokens) - n:][:k]
        return [t if self.rng.random() < self.p else (t + 1) % self.vocab_size for t in cont]

    def forget(self, request_id: str) -> None:
        self.prompt_len.pop(request_id, None)
        if self.priced_by is not None:
            self.priced_by.forget(request_id)


def verify(sampler, logits: torch.Tensor, state, drafts: Sequence[int]) -> list:
    """A verify step's emitted tokens (SampleOuts, committed to state): row 0's token, then row j's while the token of
    row j - 1 equals drafts[j - 1]. logits [len(drafts) + 1, V]. Each row is sampled alone, exactly as sample() samples
    a plain decode row (the module docstring: the rule, and why it is the standard one)."""
    assert logits.shape[0] == len(drafts) + 1, "a row per token of the verify span"
    if sampler.argmax_only(state):
        # every row is then plain greedy too (accepting tokens adds no penalty, guide or min_tokens stop): one argmax
        # over all rows gives the ids sample() gives row by row, and commits them as it does
        outs = []
        for j, token in enumerate(sampler.argmax(logits).tolist()):
            state.accept(token)
            outs.append(SampleOut(token_id=token))
            if j == len(drafts) or token != drafts[j]:
                break
        return outs
    outs = []
    for j in range(len(drafts) + 1):
        out = sampler.sample(logits[j: j + 1], [state])[0]
        outs.append(out)
        if out.error is not None or out.guide_finished or j == len(drafts) or out.token_id != drafts[j]:
            break
    return outs


@torch.inference_mode()
def verify_greedy_lazily(argmax, head, spans: Sequence[tuple[torch.Tensor, object, Sequence[int]]]) -> list[list]:
    """verify() of the verify spans of plain greedy requests without logprobs, with the head run lazily: row 0 of
    every span first, in one head call, then the rows after it of the spans whose row-0 token equals their first
    draft, in a second call. spans: (hidden [len(drafts) + 1, H], the request's sampling state, drafts) each: the
    model's outputs of the span; head: hidden rows -> logits rows (the model's compute_logits); argmax: the
    sampler's. Returns each span's emitted tokens (SampleOuts, committed to its state), as verify() returns them.

    With drafts that are always wrong a step then runs the head over one row a request, as a plain decode step does,
    and converts and scans one row of logits (248k on the 0.8B shape) a request instead of k + 1; the second call
    streams the head's weights again, which is why only requests whose drafts are seldom accepted come here
    (Acceptance.LAZY_BELOW). Two calls at most, whatever the batch: a call per request would stream the head's
    weights once per request.

    The tokens are verify()'s over the full head's logits bit for bit where the head is row-wise batch-invariant
    (the compiled linears and oneDNN's, tests/test_linear.py): a row's logits are the same whatever rows share its
    call, and each row's token is the same argmax with its tie rule. The runner takes this path only there
    (ModelRunner.execute lazy_head)."""
    for hidden, _, drafts in spans:
        assert hidden.shape[0] == len(drafts) + 1, "a row per token of the verify span"
    if not spans:
        return []
    first = argmax(head(torch.cat([hidden[:1] for hidden, _, _ in spans]))).tolist()
    outs: list[list] = []
    more = []  # the spans whose first draft was right
    for i, ((hidden, state, drafts), token) in enumerate(zip(spans, first)):
        state.accept(token)
        outs.append([SampleOut(token_id=token)])
        if drafts and token == drafts[0]:
            more.append(i)
    if more:
        tokens = argmax(head(torch.cat([spans[i][0][1:] for i in more]))).tolist()
        at = 0
        for i in more:
            hidden, state, drafts = spans[i]
            for j, token in enumerate(tokens[at: at + len(drafts)], start=1):
                state.accept(token)
                outs[i].append(SampleOut(token_id=token))
                if j == len(drafts) or token != drafts[j]:
                    break
            at += len(drafts)
    return outs


@dataclass
class Acceptance:
    """One request's acceptance: an exponential average of the fraction of its drafts accepted. next_k drafts j tokens
    while rate ** j (the chance the j-th is accepted) is at least WORTH; none below that for one draft, except a probe of
    one draft every PROBE steps, which lets a request whose text turns predictable win its drafts back."""

    rate: float = 1.0  # optimistic at first: the first steps measure it
    idle: int = 0  # steps without drafts since the last probe

    ALPHA = 0.3
    WORTH = 0.3
    PROBE = 8
    # verify_greedy_lazily below this rate: it saves the head's extra rows when draft 1 is wrong and costs a second
    # pass over the head's weights when it is right. On the 0.8B shape (a 248k x 1024 head, streamed from memory)
    # one pass costs about the same for 1 row as for 4 (23-31 ms on one thread): the lazy path pays only where
    # draft 1 almost never survives, as with drafts that are always wrong
    LAZY_BELOW = 0.1

    def next_k(self, k_max: int) -> int:
        k = 0
        while k < k_max and self.rate ** (k + 1) >= self.WORTH:
            k += 1
        if k == 0:
            self.idle += 1
            if self.idle >= self.PROBE:
                self.idle = 0
                return 1
        return k

    def record(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.rate = (1 - self.ALPHA) * self.rate + self.ALPHA * accepted / drafted

    def lazy_head(self) -> bool:
        """Whether this request's next verify step runs its head lazily (LAZY_BELOW)."""
        return self.rate < self.LAZY_BELOW


def fit_drafts(wanted: dict[str, tuple[int, float]], rows: int, max_rows: int) -> dict[str, int]:
    """Each request's drafts for the next step, cut to a step of at most max_rows rows: wanted maps a request to
    (the drafts its acceptance asks for, its acceptance rate r); rows is the step's rows before drafts (one per
    decoding request). The j-th draft of a request survives with chance about r ** j, so the drafts kept are the
    most likely ones across the batch, each request's first ones (ties: the earlier position, so requests of one
    rate share the room, then the earlier request in wanted). max_rows 0:
    nothing is cut. Where verifying costs more than a plain step (past max_rows rows each row adds its arithmetic
    and a draft yields less than a row's token) drafting does not pay, so a large batch drafts little or nothing."""
    if max_rows <= 0:
        return {rid: k for rid, (k, _) in wanted.items()}
    room = max(0, max_rows - rows)
    chances = sorted((-(r ** j), j, i, rid) for i, (rid, (k, r)) in enumerate(wanted.items()) for j in range(1, k + 1))
    out = dict.fromkeys(wanted, 0)
    for *_, rid in chances[:room]:
        out[rid] += 1
    return out


@dataclass
class SpecStats:
    """vLLM's speculative-decoding counters: verify steps (num_drafts), drafts verified, drafts accepted, and accepted
    per draft position (position 0 = the first draft)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, drafted: int, accepted: int) -> None:
        assert 0 <= accepted <= drafted
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        while len(self.accepted_per_pos) < drafted:
            self.accepted_per_pos.append(0)
        for j in range(accepted):
            self.accepted_per_pos[j] += 1
