"""Why a GDN checkpoint was taken: the kind the scheduler gives each save, which the memory manager counts per kind
and keeps with the checkpoint (the eviction policy and the by-kind metrics read it). No torch.

A str enum: a kind compares equal to, hashes like, prints and serializes as its value ("step", ...), so the by-kind
counters (keyed by those values) and the metric labels read the same as plain strings do.
"""
from __future__ import annotations

from enum import StrEnum


class SaveKind(StrEnum):
    """The kinds, in the order the by-kind counters list them. STEP and GENERATED are mandatory (MANDATORY_KINDS):
    the scheduler counts their pages in what a step needs, preempts for them like for attention pages, and reserves
    them first. The others are optional, taken only while the pool has room: PROMPT, FORK and HINT from any
    allocatable page, GRID from free pages only (it evicts nothing). With a disk tier a request waits at admission
    for room for its PROMPT and HINT checkpoints (DISK_KEPT_KINDS) while running requests hold pages: what leaves
    the pool then goes to disk instead of away, so a checkpoint a later request resumes from is worth the wait."""

    STEP = "step"  # the end of a step's work on a block boundary: the resume point after a preemption
    PROMPT = "prompt"  # the prompt's last block boundary: what the next turn of a conversation hits
    FORK = "fork"  # where a prompt leaves a cached chain that has no checkpoint at its end (scheduler: fork point)
    GRID = "grid"  # every --checkpoint-grid tokens inside a prefill chunk, so later sharers hit near a prefix's end
    HINT = "hint"  # where the request says its prefix will be reused: the end of the system prefix (tools + system text)
    GENERATED = "generated"  # the end of a finished request's outputs, recomputed by prefill (scheduler/jobs.py)


MANDATORY_KINDS = frozenset({SaveKind.STEP, SaveKind.GENERATED})
DISK_KEPT_KINDS = frozenset({SaveKind.PROMPT, SaveKind.HINT})
# a sequence's checkpoint replaced by a newer one goes to the front of the eviction order unless it was hit or is one
# of these, taken where a later request is expected to resume (memory/manager.py _hold_ckpt)
KEPT_WHEN_REPLACED = frozenset({SaveKind.PROMPT, SaveKind.FORK, SaveKind.HINT})


def zero_by_kind() -> dict[str, int]:
    """A by-kind counter, every kind at 0, keyed by the kinds' values (plain strings)."""
    return {k.value: 0 for k in SaveKind}
