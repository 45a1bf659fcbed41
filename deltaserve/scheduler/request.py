"""A request as the scheduler sees it: token ids, progress, and where its memory is. No torch, no sampling.

The engine owns sampling, stop strings and eos; it calls Scheduler.finish(request_id, reason). The
scheduler itself stops a request at max_tokens (reason "length").
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import ClassVar

from ..memory.hashing import BlockHash, block_hash, root_hash


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue; recomputes (from the cache) when rescheduled
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


FINISH_STATUS = {"stop": RequestStatus.FINISHED_STOPPED, "length": RequestStatus.FINISHED_LENGTH,
                 "abort": RequestStatus.FINISHED_ABORTED}


@dataclass(eq=False)
class Request:
    background: ClassVar[bool] = False  # a background job of the scheduler's (jobs.OutputsJob): no sampling, yields

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int  # the scheduler finishes the request with reason "length" after this many outputs
    cache_salt: str | None = None
    arrival_time: float = 0.0
    prompt_logprobs: bool = False  # wants logits at prompt positions: its first prefill skips the cache
    skip_cache_lookup: bool = False  # never look this request up in the cache (it still publishes)
    extra_keys: tuple = ()  # anything else that changes the KV (enters the block hashes)
    # the prompt's images: (placeholder offset, placeholder count, content hash), sorted and apart; each block
    # holding placeholders of an image carries its hash (memory/hashing.py)
    media: tuple[tuple[int, int, bytes], ...] = ()
    media_encoded: bool = False  # the runner holds its images' encoder output (a step that reached them ran)
    # blocks that hold a generated token are hashed on the decode path (memory/hashing.py): only this request's
    # resume finds them (the scheduler sets it whenever caching is on)
    tag_outputs: bool = False
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V and GDN state are in this request's memory
    num_cached_tokens: int = 0  # prompt tokens served by the cache when first scheduled (a block multiple)
    num_preemptions: int = 0
    disk_wait: bool = False  # its prefix hit is being read back from the disk tier (Scheduler.admit)
    # prompt positions where a later request is expected to share this one's prefix up to, by source (the engine's
    # "cache_hints": declared by the client, structural from the render): the candidates for its resume points
    cache_hints: dict = field(default_factory=dict)  # SaveKind -> positions, most likely read first
    cache_key: str | None = None  # groups requests for the learned source (prompt_cache_key, else cache_salt)
    # the resume points it keeps (block boundaries, by source) and its grid spacing, chosen under the per-request
    # budget when it is added (policy.choose_resume_points); grid_step None = the policy's own grid
    resume_points: tuple[tuple[int, str], ...] = ()
    grid_step: int | None = None
    fork_point: int = 0  # where a cached chain without a checkpoint ends: a checkpoint is taken there (Scheduler._saves)
    finish_reason: str | None = None
    # speculative decoding: the drafts for the positions after the last token, set by the engine after each step; the
    # scheduler verifies them with the last token (as many as the step allows) and clears them
    draft_token_ids: list[int] = field(default_factory=list)
    page_ids: tuple[int, ...] = ()  # attention page table (a snapshot, refreshed every step it runs)
    slot: int | None = None  # live GDN slot while running
    _prompt_done: bool = field(default=False, repr=False)  # the whole prompt was computed once
    _root: BlockHash | None = field(default=None, repr=False)
    _block_hashes: list[BlockHash] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)

    # ---- tokens ----
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) of prompt + output."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    # ---- the hash chain (computed lazily, extended as tokens become known) ----
    @property
    def root_hash(self) -> BlockHash:
        if self._root is None:
            self._root = root_hash(self.cache_salt, self.extra_keys)
        return self._root

    def block_hashes(self, num_blocks: int, block_size: int) -> list[BlockHash]:
        """Chain hashes of the first num_blocks full blocks (all must be known tokens)."""
        if num_blocks * block_size > self.num_tokens:
            raise ValueError(f"block {num_blocks - 1} is not full yet")
        hs = self._block_hashes
        while len(hs) < num_blocks:
            j = len(hs)
            decode = self.tag_outputs and (j + 1) * block_size > self.num_prompt_tokens
            hs.append(block_hash(hs[-1] if hs else self.root_hash, self.tokens(j * block_size, (j + 1) * block_size),
                                 decode, self.block_media(j, block_size)))
        return hs

    def block_media(self, j: int, block_size: int) -> tuple[bytes, ...]:
        """Content hashes of the images with placeholder tokens in block j."""
        a, b = j * block_size, (j + 1) * block_size
        return tuple(h for off, n, h in self.media if off < b and a < off + n)

    def block_key(self, j: int, block_size: int) -> tuple[BlockHash, BlockHash, list[int]]:
        """(hash, parent hash, tokens) of full block j."""
        hs = self.block_hashes(j + 1, block_size)
        return hs[j], (hs[j - 1] if j else self.root_hash), self.tokens(j * block_size, (j + 1) * block_size)
