"""Where prefill chunks end and where checkpoints are taken: a small policy object.

The scheduler asks the policy two things:
  chunk_end(start, limit, total): where a prefill chunk that starts at `start` ends, given it may run
      to `limit` (start + token budget left) and the sequence has `total` tokens to compute. Returning
      `start` means "not this step".
  saves(start, end, prompt_end, fork, points, grid): the checkpoints a step computing [start, end) takes, as
      (position, kind) in position order, each position a block boundary in (start, end]. A save before
      `end` is taken inside the chunk, by the GDN layers as their chunked kernel passes that boundary
      (docs/design.md), so a chunk never has to stop early for one. Kinds (memory/save_kind.py):
        STEP    the end of the step's work, when it is a block boundary (a middle prefill chunk, or a decode
                that completes a block): the resume point after a preemption;
        PROMPT  the prompt's last block boundary: what the next turn of a conversation hits;
        FORK    where this request's prompt leaves a chain of cached blocks that has no checkpoint at its end
                (another sequence computed that shared prefix inside a chunk): the next sequence that shares
                it hits all of it;
        DECLARED, STRUCTURAL, LEARNED
                the request's resume points (`points`: block boundaries, chosen under its budget by
                choose_resume_points), each with its source's kind (memory/save_kind.py);
        GRID    every `grid` tokens (the request's own spacing under its budget), so that a prefix someone else
                will share later has a checkpoint near its end.
A policy never returns GENERATED: the scheduler relabels the save at a background job's end with it (jobs.py).
The scheduler treats STEP and GENERATED as mandatory: their pages count in what the step needs (it preempts for
them as for attention pages) and they are reserved first. The others are optional, taken only while the pool has
room for them: PROMPT, FORK and the resume points from any allocatable page, GRID from free pages only (it evicts
nothing; such checkpoints are the first evicted). The memory manager refuses any save that is not at the end of a
full, unpublished block of the chunk.
"""
from __future__ import annotations

from typing import Protocol

from ..memory.save_kind import RESUME_SOURCES, SaveKind

Points = tuple[tuple[int, SaveKind], ...]  # (block boundary, source kind), in position order


class CheckpointPolicy(Protocol):
    def chunk_end(self, start: int, limit: int, total: int) -> int: ...
    def saves(self, start: int, end: int, prompt_end: int, fork: int,
              points: Points = (), grid: int | None = None) -> list[tuple[int, SaveKind]]: ...


def choose_resume_points(wanted: dict[SaveKind, list[int]], block_size: int, prompt_len: int, budget: int,
                         grid: int) -> tuple[Points, int]:
    """The resume points one request keeps, under its budget of `budget` checkpoints, and the grid spacing left for
    the rest: (points, grid).

    wanted: each source's positions (tokens), most likely to be read first (the order the source gives). A position
    becomes the block boundary at or before it; one in (0, prompt_len) counts once, for its highest-priority source
    (RESUME_SOURCES order: declared, structural, learned). Sources are served in priority order and, within one, in
    the order given, until the budget is spent. The grid (checkpoint_grid, 0 = off) takes what is left: its spacing
    is widened to a multiple of `grid` so that at most that many grid points fit in the prompt (a long prompt gets a
    sparse grid rather than its first few points). Pure: the same request always keeps the same points, so a hint
    changes no output, only where a checkpoint is kept."""
    assert budget >= 0 and block_size > 0 and grid % block_size == 0
    seen: set[int] = set()
    chosen: list[tuple[int, SaveKind]] = []
    for kind in RESUME_SOURCES:
        for h in wanted.get(kind, ()):
            b = h // block_size * block_size
            if 0 < b < prompt_len and b not in seen and len(chosen) < budget:
                seen.add(b)
                chosen.append((b, kind))
    left = budget - len(chosen)
    if grid and left <= 0:
        grid = 0
    elif grid:
        per = -(-prompt_len // (left + 1))  # at most `left` multiples of the spacing lie inside the prompt
        grid = max(grid, -(-per // grid) * grid)
    return tuple(sorted(chosen)), grid


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
              points: Points = (), grid: int | None = None) -> list[tuple[int, SaveKind]]:
        """grid: the request's spacing (choose_resume_points), default the policy's."""
        bs = self.block_size
        grid = self.grid if grid is None else grid
        out: dict[int, SaveKind] = {}
        if end % bs == 0:
            out[end] = SaveKind.STEP
        last = prompt_end // bs * bs
        if start < last < end:
            out.setdefault(last, SaveKind.PROMPT)
        for p, kind in points:  # before the fork: a learned point is the fork the request's key saw coming
            assert p % bs == 0, "a resume point is a block boundary (choose_resume_points)"
            if start < p < end:
                out.setdefault(p, kind)
        if start < fork < end:
            out.setdefault(fork, SaveKind.FORK)
        if grid:
            for p in range((start // grid + 1) * grid, end, grid):
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
              points: Points = (), grid: int | None = None) -> list[tuple[int, SaveKind]]:
        return []


def NoCheckpoints() -> GridChunks:
    """Caching off without flooring."""
    return GridChunks(1)
