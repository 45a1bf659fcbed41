"""Where checkpoints are taken, and so where prefill chunks may end: a small policy object.

The scheduler asks the policy two things:
  chunk_end(start, limit, total): where a prefill chunk that starts at `start` ends, given it may run
      to `limit` (start + token budget left) and the sequence has `total` tokens to compute. Returning
      `start` means "not this step".
  save_at(end): whether the step whose chunk ends at `end` saves the slot into a checkpoint.

Later policies (checkpoints on a sparse grid, at fork points, at the end of every request) implement the
same two methods; the memory manager still refuses any save that is not at the end of a full block.
"""
from __future__ import annotations

from typing import Protocol


class CheckpointPolicy(Protocol):
    def chunk_end(self, start: int, limit: int, total: int) -> int: ...
    def save_at(self, end: int) -> bool: ...


class AlignEveryBlock:
    """vLLM's align mode: prefill chunks end on block boundaries, and every step that ends on
    a block boundary (a decode that completes a block included) saves a checkpoint, so every checkpoint
    is exact and a hit can resume at any block that has one.

    As vLLM does ("force to cache the last chunk"), a chunk that would run past the last block boundary
    of the prompt to its ragged end stops at that boundary, and the tail (< one block) runs next step.
    That checkpoint after the prompt's last full block is the one later requests hit (the next turn of
    a conversation, an extension, a diverging suffix); without it, a prompt computed in one chunk would
    leave no checkpoint at all. Cost: one more step for the tail.
    """

    def __init__(self, block_size: int):
        self.block_size = block_size

    def chunk_end(self, start: int, limit: int, total: int) -> int:
        bs = self.block_size
        if limit < total:  # a middle chunk ends on a block boundary, or waits for more budget
            end = limit // bs * bs
            return end if end > start else start
        last = total // bs * bs  # the last block boundary of the prefill
        return last if start < last < total else total  # stop there so its checkpoint is taken

    def save_at(self, end: int) -> bool:
        return end % self.block_size == 0


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

    def save_at(self, end: int) -> bool:
        return False


def NoCheckpoints() -> GridChunks:
    """Caching off without flooring."""
    return GridChunks(1)
