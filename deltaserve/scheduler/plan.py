"""What one engine step does: the scheduler's output, carried out by the model runner.

Pure data, no torch. The runner executes a StepPlan in this order:
  1. zero `zero_pages` (every layer position of each page) and `zero_slots` (conv + recurrent state);
  2. `restores`: copy each checkpoint location into its slot (bit-exact byte copies);
  3. run the model over `work` and sample where `SeqWork.sample` is set;
  4. `saves`: copy each slot into its checkpoint location (saves inside a prefill chunk are taken during 3).
Then the scheduler's update() publishes the hashes of blocks this step completed.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SeqWork:
    """One sequence's share of a step.

    Tokens token_ids sit at absolute positions start_pos .. start_pos + len(token_ids) - 1.
    page_ids is the request's attention page table: page_ids[j] holds positions
    j*block_size .. (j+1)*block_size - 1, and it covers every position up to the last one computed.
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    slot: int  # the request's live GDN state slot
    page_ids: tuple[int, ...]
    is_decode: bool  # True: generated token through the decode path; False: prefill path (prompt or recompute)
    sample: bool  # the last token's logits yield the next token (prompt complete, or decode)
    prompt_logprobs: bool = False  # the request wants logits at every prompt position of this chunk
    # a speculative verify step (docs/speculative.md): the last num_drafts of token_ids are drafts; every token takes
    # the decode path and samples, the runner logs the GDN state after each, and the engine keeps the accepted prefix
    num_drafts: int = 0


@dataclass(frozen=True)
class StateCopy:
    """A GDN state moving between a live slot and a checkpoint.

    location: checkpoints in pool pages: pages_per_state page ids per GDN group (layouts.py); beside the
    pool (per-block): (page id,), the row of the side tensor (the attention page of that block).
    pos (saves): the state is the one after exactly token pos - 1: the end of the slot's work in this step
    (copied from the slot after the forward), or a block boundary inside its prefill chunk (taken by the
    GDN layers as the chunk passes it). None on restores (they go in before the work starts).
    """

    slot: int
    location: tuple[int, ...]
    pos: int | None = None


@dataclass(frozen=True)
class StepPlan:
    work: tuple[SeqWork, ...] = ()
    zero_pages: tuple[int, ...] = ()
    zero_slots: tuple[int, ...] = ()
    restores: tuple[StateCopy, ...] = ()  # before the forward: location -> slot
    saves: tuple[StateCopy, ...] = ()  # after the forward: slot -> location
    preempted: tuple[str, ...] = ()  # request ids preempted while planning this step
    encoder_images: tuple[int, ...] = ()  # the image tokens of each image the step's encoder runs make (the simulator prices them)

    @property
    def num_tokens(self) -> int:
        return sum(len(w.token_ids) for w in self.work)

    def is_empty(self) -> bool:
        return not self.work
