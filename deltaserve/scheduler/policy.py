"""Where prefill chunks end and where checkpoints are taken: a small policy object.

The scheduler asks the policy two things:
  chunk_end(start, limit, total): where a prefill chunk that starts at `start` ends, given it may run
      to `limit` (start + token budget left) and the sequence has `total` tokens to compute. Returning
      `start` means "not this step".
  saves(start, end, prompt_end, fork, hints): the checkpoints a step computing [start, end) takes, as
      (position, kind) in position order, each position a block boundary in (start, end]. A save before
      `end` is taken inside the chunk, by the GDN layers as their chunked kernel passes that boundary
      (docs/design.md), so a chunk never has to stop early for one. Kinds (memory/save_kind.py):
        STEP    the end of the step's work, when it is a block boundary (a middle prefill chunk, or a decode
                that completes a block): the resume point after a preemption;
        PROMPT  the prompt's last block boundary: what the next turn of a conversation hits;
        FORK    where this request's prompt leaves a chain of cached blocks that has no checkpoint at its end
                (another sequence computed that shared prefix inside a chunk): the next sequence that shares
                it hits all of it;
        GRID    every `grid` tokens, so that a prefix someone else will share later (a system prompt, a tool
                list) has a checkpoint near its end;
        HINT    the last block boundary at or before each of the request's hint positions: where the request
                itself says a prefix will be reused (the chat routes pass the end of the system prefix, the
                tools and system text that every session of an agent re-sends).
A policy never returns GENERATED: the scheduler relabels the save at a background job's end with it (jobs.py).
The scheduler treats STEP and GENERATED as mandatory: their pages count in what the step needs (it preempts for
them as for attention pages) and they are reserved first. PROMPT, FORK, HINT and GRID are optional, taken only
while the pool has room for them: PROMPT, FORK and HINT from any allocatable page, GRID from free pages only (it evicts
nothing; such checkpoints are the first evicted). The memory manager refuses any save that is not at the end of a
full, unpublished block of the chunk.
"""
from __future__ import annotations

from typing import Protocol

from ..memory.save_kind import SaveKind


class CheckpointPolicy(Protocol):
    def chunk_end(self, start: int, limit: int, total: int) -> int: ...
    def saves(self, start: int, end: int, prompt_end: int, fork: int,
              hints: tuple[int, ...] = ()) -> list[tuple[int, SaveKind]]: ...


class AlignEveryBlock:
    """vLLM's align mode, with checkpoints inside chunks: a prefill chunk that does not reach the end of the
    sequence ends on a block boundary, so the slot's state there is exact; every step that ends on a block
    boundary saves it (STEP), and inside the chunk the prompt's last block boundary (PROMPT), the fork
    point (FORK) and every `grid` tokens (GRID, 0 = none) are saved as the kernel passes them. A prompt
    computed in one chunk thus leaves its checkpoints without stopping at its last block boundary (vLLM's
    "force to cache the last chunk" costs a step for the tail; this does not)."""

    def __init__(self, block_size: int, grid: int = 0):
        if grid % block_size:
            raise ValueError(f"the checkpoint grid ({grid}) must be a multiple of the block size ({block_size})")
        self.block_size = block_size
        self.grid = grid

    def chunk_end(self, start: int, limit: int, total: int) -> int:
        if limit >= total:
            return total
        end = limit // self.block_size * self.block_size  # a middle chunk ends on a block boundary
        return end if end > start else start  # or waits for more budget

    def saves(self, start: int, end: int, prompt_end: int, fork: int,
              hints: tuple[int, ...] = ()) -> list[tuple[int, SaveKind]]:
        bs = self.block_size
        out: dict[int, SaveKind] = {}
        if end % bs == 0:
            out[end] = SaveKind.STEP
        last = prompt_end // bs * bs
        if start < last < end:
            out.setdefault(last, SaveKind.PROMPT)
        if start < fork < end:
            out.setdefault(fork, SaveKind.FORK)
        for h in hints:
            if start < h // bs * bs < end:
                out.setdefault(h // bs * bs, SaveKind.HINT)
        if self.grid:
            for p in range((start // self.grid + 1) * self.grid, end, self.grid):
                out.setdefault(p, SaveKind.GRID)
        return sorted(out.items())


class GridChunks:
    """Caching off: nothing is saved; a prefill chunk that does not reach the end of the sequence ends on
    a multiple of `grid` (the engine passes its 64-token GDN kernel chunk; 1 = no flooring).

    Why floor at all without caching: decodes take budget first, so without flooring a prompt's chunk
    boundaries would depend on how many other requests happen to be decoding, and the GDN chunked kernel
    is only bit-exact across chunk boundaries on its 64-token grid (docs/design.md, the 64-token grid). Flooring makes a
    request's logits independent of the batch it shares (concurrent == solo, chunked == unchunked,
    bit-identical) for at most grid - 1 tokens of budget per step.
    """

    def __init__(self, grid: int = 1):
        self.grid = max(1, grid)

    def chunk_end(self, start: int, limit: int, total: int) -> int:
        if limit >= total:
            return total
        end = limit // self.grid * self.grid
        return end if end > start else start

    def saves(self, start: int, end: int, prompt_end: int, fork: int,
              hints: tuple[int, ...] = ()) -> list[tuple[int, SaveKind]]:
        return []


def NoCheckpoints() -> GridChunks:
    """Caching off without flooring."""
    return GridChunks(1)
