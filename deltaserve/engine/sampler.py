"""The sampler: logits processors, greedy / random sampling and logprobs, one request's row at a time.

    states = [SamplingState.create(params, prompt_ids, eos_token_ids=tok.eos_token_ids, seed=engine_seed)]
    outs = Sampler(id_to_piece=tok.id_to_piece).sample(logits, states)   # logits [N, V] float32
    outs[0].token_id, outs[0].logprobs

Order (vLLM's): logit_bias -> min_tokens (eos and stop ids masked while fewer than min_tokens are out)
-> penalties (repetition over prompt + output, presence / frequency over output) -> guide mask ->
temperature (0 = greedy argmax of the processed logits) -> min_p -> top_k -> top_p -> a draw from the
request's own torch.Generator (one uniform per token, inverse CDF over the surviving tokens).

Logprobs are of the raw model distribution (log_softmax of the unprocessed logits, vLLM's default),
for the sampled token plus the top-N, with ranks (1 = most likely; a token's rank counts the tokens
whose logprob is >= its own, as vLLM does).

Batch invariance: every reduction (softmax, log_softmax, argmax, topk, sort) runs on one request's
row, copied into its own buffer, so a request's tokens and logprobs are bit-identical whatever else is
in the batch (docs/cpu.md: a vocab-wide reduction over a row inside a batch differs from the row alone).
The one exception is plain greedy without logprobs: one argmax over all such rows at once, which picks
the same ids as row by row (a max is exact and ties go to the first index either way).

sample() commits: it appends the chosen token to state.output_token_ids and calls guide.accept().
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence, runtime_checkable

import torch

from .outputs import Logprob, PositionLogprobs
from .sampling_params import SamplingParams

_NEG_INF = float("-inf")


@runtime_checkable
class Guide(Protocol):
    """Constrained decoding state for one sequence (the server implements it with a grammar library)."""

    def allowed_tokens(self, vocab_size: int) -> torch.Tensor | None:
        """A bool tensor [vocab_size] (True = allowed) for the next token, or None for no constraint."""
        ...

    def accept(self, token_id: int) -> None:
        """Advance past the sampled token."""
        ...

    def is_finished(self) -> bool:
        """True once the grammar is complete (the engine then stops the sequence)."""
        ...


@dataclass
class SamplingState:
    """One sequence's sampling state. The prompt list is only read; the output list is appended to by
    Sampler.sample()."""

    params: SamplingParams
    generator: torch.Generator
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: list[int] = field(default_factory=list)
    eos_token_ids: frozenset[int] = frozenset()
    guide: Guide | None = None
    seed: int | None = None  # the seed the generator started from
    # caches, built on first use
    _prompt_ids_t: torch.Tensor | None = field(default=None, init=False, repr=False)
    _bias: tuple[int, torch.Tensor, torch.Tensor] | None = field(default=None, init=False, repr=False)

    @classmethod
    def create(cls, params: SamplingParams, prompt_token_ids: Sequence[int] = (), *,
               eos_token_ids: frozenset[int] | Sequence[int] = (), seed: int | None = None, index: int = 0,
               guide: Guide | None = None, output_token_ids: list[int] | None = None,
               device: torch.device | str = "cpu") -> "SamplingState":
        """Seeded from params.seed (+ index, the sample's number when n > 1, as vLLM does), else from the
        engine's seed, else from the OS. The guide defaults to params.structured: a Guide is used as is, an
        object with new_guide() is asked for a fresh one."""
        if params.seed is not None:
            s = params.seed + index
        elif seed is not None:
            s = seed
        else:
            s = random.SystemRandom().getrandbits(63)
        gen = torch.Generator(device=device)
        gen.manual_seed(s % (1 << 64))
        if guide is None and params.structured is not None:
            st = params.structured
            if hasattr(st, "new_guide"):
                guide = st.new_guide()
            elif isinstance(st, Guide):
                guide = st
            else:
                raise TypeError("SamplingParams.structured must be a Guide or have new_guide(), "
                                f"got {type(st).__name__}")
        return cls(params=params, generator=gen, prompt_token_ids=prompt_token_ids,
                   output_token_ids=list(output_token_ids or []), eos_token_ids=frozenset(eos_token_ids),
                   guide=guide, seed=s)

    def accept(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        if self.guide is not None:
            self.guide.accept(token_id)

    # ---- cached tensors ----
    def _prompt_tensor(self) -> torch.Tensor:
        if self._prompt_ids_t is None:
            self._prompt_ids_t = torch.tensor(list(self.prompt_token_ids), dtype=torch.long)
        return self._prompt_ids_t

    def _bias_tensors(self, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._bias is None or self._bias[0] != vocab_size:
            items = [(k, v) for k, v in (self.params.logit_bias or {}).items() if 0 <= k < vocab_size]
            self._bias = (vocab_size, torch.tensor([k for k, _ in items], dtype=torch.long),
                          torch.tensor([v for _, v in items], dtype=torch.float32))
        return self._bias[1], self._bias[2]


@dataclass
class SampleOut:
    token_id: int
    logprobs: PositionLogprobs | None = None  # the sampled token and the top-N, of the raw distribution
    guide_finished: bool = False  # the guide says the structure is complete after this token
    error: str | None = None  # this row failed (e.g. its guide raised); token_id is -1 and nothing was committed


def _position_logprobs(lp: torch.Tensor, token_id: int, n: int,
                       id_to_piece: Callable[[int], str] | None) -> PositionLogprobs:
    """lp: one row's log_softmax [V]. The given token first, then the top-n by rank."""
    tok_lp = lp[token_id]
    rank = int((lp >= tok_lp).sum().item())
    out: PositionLogprobs = {token_id: Logprob(float(tok_lp.item()), max(rank, 1),
                                               id_to_piece(token_id) if id_to_piece else None)}
    if n > 0:
        vals, ids = torch.topk(lp, min(n, lp.numel()))
        for r, (v, i) in enumerate(zip(vals.tolist(), ids.tolist()), start=1):
            if i not in out:
                out[i] = Logprob(float(v), r, id_to_piece(i) if id_to_piece else None)
    return out


class Sampler:
    def __init__(self, id_to_piece: Callable[[int], str] | None = None,
                 argmax: Callable[[torch.Tensor], torch.Tensor] | None = None):
        """id_to_piece (e.g. Tokenizer.id_to_piece) fills Logprob.decoded_token when given. argmax: rows [N, V] ->
        [N] int64, torch.argmax(rows, dim=-1)'s answer (the model's compiled one, DecodeKernels.argmax; default
        torch's)."""
        self.id_to_piece = id_to_piece
        self.argmax = argmax or (lambda rows: torch.argmax(rows, dim=-1))

    # ------------------------------------------------------------------ public
    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> list[SampleOut]:
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits must be [N, V] with N = len(states) = {len(states)}, got {tuple(logits.shape)}")
        # plain greedy rows without logprobs: one argmax over all of them (exact: the ids of row-by-row argmax)
        greedy = [i for i, st in enumerate(states) if self.argmax_only(st)]
        fast: dict[int, int] = {}
        if greedy:  # one row too: argmax of the row in place, without sample_row's private copy
            rows = logits if len(greedy) == len(states) else logits[greedy]  # [G, V]
            fast = dict(zip(greedy, self.argmax(rows).tolist()))
        outs = []
        for i, st in enumerate(states):
            try:  # one request's failure (a guide that raises) must not take its batch neighbours down
                out = SampleOut(token_id=fast[i]) if i in fast else self.sample_row(logits[i], st)
                st.accept(out.token_id)
                if st.guide is not None:
                    out.guide_finished = bool(st.guide.is_finished())
            except Exception as e:  # noqa: BLE001 - reported on the row, the engine aborts that request
                out = SampleOut(token_id=-1, error=f"{type(e).__name__}: {e}")
            outs.append(out)
        return outs

    @torch.inference_mode()
    def sample_row(self, row: torch.Tensor, st: SamplingState) -> SampleOut:
        """One request's next token from its logits row [V]; does not commit (sample() does)."""
        raw = row.detach().to(torch.float32).contiguous().clone()  # own buffer: batch-independent reductions
        p = st.params
        logprobs = None
        if p.logprobs is not None:
            lp = torch.log_softmax(raw, dim=-1)
        token = self._choose(raw, st)
        if p.logprobs is not None:
            logprobs = _position_logprobs(lp, token, p.logprobs, self.id_to_piece)
        return SampleOut(token_id=token, logprobs=logprobs)

    @torch.inference_mode()
    def prompt_logprobs(self, logits: torch.Tensor, target_ids: Sequence[int], n: int) -> list[PositionLogprobs]:
        """Logprobs of target_ids[i] under logits[i] (the model's prediction for that position), plus the
        top-n, row by row. The caller aligns: logits of position j score prompt token j + 1."""
        if logits.dim() != 2 or logits.shape[0] != len(target_ids):
            raise ValueError(f"logits must be [M, V] with M = len(target_ids) = {len(target_ids)}, "
                             f"got {tuple(logits.shape)}")
        out = []
        for i, t in enumerate(target_ids):
            row = logits[i].detach().to(torch.float32).contiguous().clone()
            lp = torch.log_softmax(row, dim=-1)
            out.append(_position_logprobs(lp, int(t), n, self.id_to_piece))
        return out

    # ------------------------------------------------------------------ processing
    @staticmethod
    def _plain_greedy(st: SamplingState) -> bool:
        """Greedy with nothing that edits the logits first: the token is the argmax of the raw row."""
        p = st.params
        return (p.greedy and not p.logit_bias and not p.needs_penalties and st.guide is None
                and not (p.min_tokens and len(st.output_token_ids) < p.min_tokens))

    @classmethod
    def argmax_only(cls, st: SamplingState) -> bool:
        """Plain greedy without logprobs: the row's argmax is all that is read from its logits (one argmax over many
        rows gives each its token; speculative verification may skip rows it does not reach)."""
        return cls._plain_greedy(st) and st.params.logprobs is None

    def _choose(self, raw: torch.Tensor, st: SamplingState) -> int:
        p = st.params
        if self._plain_greedy(st):
            return int(self.argmax(raw.view(1, -1))[0])
        x = self._process(raw, st)
        if p.greedy:
            return int(self.argmax(x.view(1, -1))[0])
        ids, vals = self._truncate(x, p)
        # one uniform per token from the request's generator, inverse CDF (cheap at any vocab size)
        probs = torch.softmax(vals if ids is not None else x, dim=-1)
        cdf = torch.cumsum(probs, dim=0, dtype=torch.float64)
        u = torch.rand(1, generator=st.generator, dtype=torch.float64, device=cdf.device) * cdf[-1]
        j = min(int(torch.searchsorted(cdf, u, right=True).item()), cdf.numel() - 1)
        return int(ids[j].item()) if ids is not None else j

    def processed_logits(self, row: torch.Tensor, st: SamplingState) -> torch.Tensor:
        """Steps 1-8 on a copy of one row [V]: the logits the draw uses (greedy: up to the guide mask;
        otherwise temperature-scaled, -inf where min_p / top_k / top_p cut). For tests and debugging."""
        x = self._process(row.detach().to(torch.float32).contiguous().clone(), st)
        if st.params.greedy:
            return x
        ids, vals = self._truncate(x, st.params)
        if ids is None:
            return x
        out = torch.full_like(x, _NEG_INF)
        out[ids] = vals
        return out

    def _process(self, raw: torch.Tensor, st: SamplingState) -> torch.Tensor:
        """Steps 1-6 (logit_bias .. min_p) on a copy of the row."""
        p = st.params
        x = raw.clone()
        V = x.numel()
        # 1. logit_bias
        if p.logit_bias:
            idx, vals = st._bias_tensors(V)
            if idx.numel():
                x.index_add_(0, idx, vals)
        # 2. min_tokens
        if p.min_tokens and len(st.output_token_ids) < p.min_tokens:
            stop = [t for t in set(p.stop_token_ids) | set(st.eos_token_ids) if 0 <= t < V]
            if stop:
                x[torch.tensor(stop, dtype=torch.long)] = _NEG_INF
        # 3. penalties
        if p.needs_penalties:
            self._apply_penalties(x, st)
        # 4. guide
        if st.guide is not None:
            mask = st.guide.allowed_tokens(V)
            if mask is not None:
                self._apply_mask(x, mask, st)
        # 5. temperature (greedy: the argmax of what we have)
        if p.greedy:
            return x
        x.div_(p.temperature)
        # 6. min_p
        if p.min_p > 0.0:
            probs = torch.softmax(x, dim=-1)
            x.masked_fill_(probs < probs.amax() * p.min_p, _NEG_INF)
        return x

    # top_p without top_k first looks for its cut among the 4K, then 32K most likely tokens (a full sort of
    # a 248K vocab costs ~20 ms on this CPU, topk of 4K ~1 ms, of 32K ~4 ms) and sorts everything only when
    # the cut lies beyond (a flat distribution, e.g. a random-weight model's)
    TOP_P_PREFIXES = (4096, 32768)

    def _truncate(self, x: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Steps 7-8 (top_k, then top_p): the surviving token ids and their logits, or (None, None) for all.
        Same rule as vLLM: top_k keeps ties with the k-th logit; top_p keeps the most likely tokens while the
        mass strictly above them is < top_p (at least one)."""
        V = x.numel()
        ids = vals = None
        if 0 < p.top_k < V:
            kth = torch.topk(x, p.top_k).values[-1]
            ids = torch.nonzero(x >= kth).flatten()
            vals = x[ids]
        if p.top_p >= 1.0:
            return ids, vals
        if ids is not None:
            order = torch.sort(vals, descending=True, stable=True).indices
            ids, vals = ids[order], vals[order]
            pv = torch.softmax(vals, dim=-1)
            keep = (torch.cumsum(pv, 0) - pv) < p.top_p
            keep[0] = True
            return ids[keep], vals[keep]
        probs = torch.softmax(x, dim=-1)
        for k in self.TOP_P_PREFIXES:
            if k >= V:
                break
            pv, pi = torch.topk(probs, k)
            keep = (torch.cumsum(pv, 0) - pv) < p.top_p
            if not bool(keep[-1]):  # the cut lies inside the prefix
                keep[0] = True
                return pi[keep], x[pi[keep]]
        pv, pi = torch.sort(probs, descending=True, stable=True)
        keep = (torch.cumsum(pv, 0) - pv) < p.top_p
        keep[0] = True
        return pi[keep], x[pi[keep]]

    @staticmethod
    def _apply_penalties(x: torch.Tensor, st: SamplingState) -> None:
        p = st.params
        V = x.numel()
        out_t = torch.tensor(st.output_token_ids, dtype=torch.long) if st.output_token_ids else None
        if out_t is not None:
            out_t = out_t[(out_t >= 0) & (out_t < V)]
        if p.repetition_penalty != 1.0:
            parts = [st._prompt_tensor()]
            if out_t is not None:
                parts.append(out_t)
            seen = torch.cat(parts)
            seen = torch.unique(seen[(seen >= 0) & (seen < V)])
            if seen.numel():
                v = x[seen]
                x[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if out_t is not None and out_t.numel() and (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0):
            ids, counts = torch.unique(out_t, return_counts=True)
            v = x[ids]
            if p.frequency_penalty != 0.0:
                v = v - p.frequency_penalty * counts.to(torch.float32)
            if p.presence_penalty != 0.0:
                v = v - p.presence_penalty
            x[ids] = v

    @staticmethod
    def _apply_mask(x: torch.Tensor, mask: torch.Tensor, st: SamplingState) -> None:
        V = x.numel()
        mask = torch.as_tensor(mask, dtype=torch.bool).reshape(-1).to(x.device)
        if mask.numel() < V:  # a guide built on a tokenizer smaller than the model's rows: the rest is banned
            mask = torch.cat([mask, torch.zeros(V - mask.numel(), dtype=torch.bool, device=x.device)])
        elif mask.numel() > V:
            mask = mask[:V]
        if not bool(mask.any()):
            # nothing allowed: a dead end in the grammar; let the sequence end rather than sample garbage
            eos = [t for t in st.eos_token_ids if 0 <= t < V]
            if not eos:
                return
            mask = torch.zeros(V, dtype=torch.bool, device=x.device)
            mask[torch.tensor(eos, dtype=torch.long)] = True
        x.masked_fill_(~mask, _NEG_INF)
