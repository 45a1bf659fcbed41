"""A minimal driver around HybridModel for the tests (the real runner is deltaserve.runner).

make_caches() allocates Caches; Sequence tracks one sequence's slot, pages and position; step() runs one
forward over any mix of prefill chunks and decode tokens; prefill() / greedy() drive a single sequence.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deltaserve.model.batch import Caches, ForwardBatch
from deltaserve.model.qwen3_5 import HybridModel


def make_caches(model: HybridModel, num_slots: int = 1, num_pages: int = 64, block_size: int = 64) -> Caches:
    """Zeroed caches sized for the model: num_pages pages of block_size tokens, num_slots GDN slots."""
    shapes = model.cache_shapes(num_slots, num_pages, block_size)
    cfg, dev = model.config, model.device
    zeros = lambda k: torch.zeros(shapes[k][0], dtype=shapes[k][1], device=dev)
    return Caches(kv=[zeros("kv") for _ in cfg.attn_layers], conv=[zeros("conv") for _ in cfg.gdn_layers],
                  ssm=[zeros("ssm") for _ in cfg.gdn_layers], block_size=block_size)


@dataclass
class Sequence:
    """One sequence's place in the caches. pages: its page table (enough pages for its whole length)."""

    slot: int
    pages: list[int]
    pos: int = 0  # tokens already in the caches
    tokens: list[int] = field(default_factory=list)


def step(model: HybridModel, caches: Caches, work: list[tuple[Sequence, list[int], bool]]) -> list[torch.Tensor]:
    """One forward. work: (sequence, token ids, is_decode) in any order; prefill spans are put first, as the
    runner does. Returns, per work item in the given order, the logits of its tokens [n, vocab] float32."""
    order = sorted(range(len(work)), key=lambda i: work[i][2])
    batch = ForwardBatch.build([(work[i][1], work[i][0].pos, work[i][0].slot, work[i][0].pages, work[i][2], ())
                                for i in order], model.device)
    spans = batch.spans
    with torch.inference_mode():
        logits = model.compute_logits(model.forward(batch, caches))  # one head GEMM for the whole step
        out: list[torch.Tensor | None] = [None] * len(work)
        for i, s in zip(order, spans):
            out[i] = logits[s.start:s.start + s.length]
    for seq, toks, _ in work:
        seq.pos += len(toks)
        seq.tokens.extend(toks)
    return out  # type: ignore[return-value]


def prefill(model: HybridModel, caches: Caches, seq: Sequence, ids: list[int],
            chunks: list[int] | None = None) -> torch.Tensor:
    """Prefill ids into seq, cut into chunks of the given lengths (default: one chunk). Returns [len(ids), V]."""
    chunks = chunks or [len(ids)]
    assert sum(chunks) == len(ids), "chunk lengths must add up to the prompt"
    out, s = [], 0
    for n in chunks:
        out.append(step(model, caches, [(seq, ids[s:s + n], False)])[0])
        s += n
    return torch.cat(out)


def greedy(model: HybridModel, ids: list[int], max_new_tokens: int, block_size: int = 64,
           chunks: list[int] | None = None) -> list[int]:
    """Greedy generation for one sequence: prefill then decode steps. Returns the new tokens."""
    total = len(ids) + max_new_tokens
    n_pages = -(-total // block_size)
    caches = make_caches(model, num_slots=1, num_pages=n_pages, block_size=block_size)
    seq = Sequence(slot=0, pages=list(range(n_pages)))
    logits = prefill(model, caches, seq, ids, chunks)
    new = [int(logits[-1].argmax())]
    while len(new) < max_new_tokens:
        new.append(int(step(model, caches, [(seq, [new[-1]], True)])[0][-1].argmax()))
    return new
