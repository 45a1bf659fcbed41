"""Why a GDN checkpoint was taken: the one table of checkpoint kinds. The scheduler gives each save a kind, the
memory manager counts per kind (saved, hit, evicted unread) and keeps it with the checkpoint (the eviction policy
and the by-kind metrics read it). No torch.

A str enum: a kind compares equal to, hashes like, prints and serializes as its value ("step", ...), so the by-kind
counters (keyed by those values) and the metric labels read the same as plain strings do.

Resume points. Four kinds are the sources of the resume-point policy (docs/design.md, "Resume points"), the places
a request keeps a checkpoint for a later request to resume from, in priority order (RESUME_SOURCES): what the client
declared, what the rendered conversation's structure marks, what earlier requests of the same key taught, and the
grid. A request keeps at most a budget of them (scheduler/policy.py choose_resume_points); the server computes the
first two (server/resume_points.py), the scheduler the others.
"""
from __future__ import annotations

from enum import StrEnum


class SaveKind(StrEnum):
    """The kinds, in the order the by-kind counters list them. STEP and GENERATED are mandatory (MANDATORY_KINDS):
    the scheduler counts their pages in what a step needs, preempts for them like for attention pages, and reserves
    them first. The others are optional, taken only while the pool has room: PROMPT, FORK and the declared,
    structural and learned resume points from any allocatable page, GRID from free pages only (it evicts nothing).
    With a disk tier a request waits at admission for room for its PROMPT checkpoint and its declared and
    structural resume points (DISK_KEPT_KINDS, all within its budget) while running requests hold pages: what
    leaves the pool then goes to disk instead of away, so a checkpoint a later request resumes from is worth the
    wait."""

    STEP = "step"  # the end of a step's work on a block boundary: the resume point after a preemption
    PROMPT = "prompt"  # the prompt's last block boundary: what the next turn of a conversation hits
    FORK = "fork"  # where a prompt leaves a cached chain that has no checkpoint at its end (scheduler: fork point)
    GRID = "grid"  # resume source 4: evenly spaced inside prefill chunks, from free pages only
    DECLARED = "declared"  # resume source 1: where the client said a prefix is reused (cache_control, resume_points)
    STRUCTURAL = "structural"  # resume source 2: message and part boundaries of the render, the system prefix's end
    LEARNED = "learned"  # resume source 3: where earlier requests of the same cache key parted from each other
    GENERATED = "generated"  # the end of a finished request's outputs, recomputed by prefill (scheduler/jobs.py)

    @classmethod
    def _missing_(cls, value):
        # a disk-tier record written before the hint kind was split into its sources: the routes' hints were the
        # structural ones
        return cls.STRUCTURAL if value == "hint" else None


# the resume-point sources, highest priority first: under a request's budget a source is served before the next
RESUME_SOURCES = (SaveKind.DECLARED, SaveKind.STRUCTURAL, SaveKind.LEARNED, SaveKind.GRID)
# the sources a request passes positions of with its prompt (the engine's "cache_hints"); grid and learned points
# are the scheduler's own
HINTED_SOURCES = (SaveKind.DECLARED, SaveKind.STRUCTURAL)

MANDATORY_KINDS = frozenset({SaveKind.STEP, SaveKind.GENERATED})
DISK_KEPT_KINDS = frozenset({SaveKind.PROMPT, SaveKind.DECLARED, SaveKind.STRUCTURAL, SaveKind.LEARNED})
# a sequence's checkpoint replaced by a newer one goes to the front of the eviction order unless it was hit or is one
# of these, taken where a later request is expected to resume (memory/manager.py _hold_ckpt)
KEPT_WHEN_REPLACED = frozenset({SaveKind.PROMPT, SaveKind.FORK, SaveKind.DECLARED, SaveKind.STRUCTURAL,
                                SaveKind.LEARNED})


def zero_by_kind() -> dict[str, int]:
    """A by-kind counter, every kind at 0, keyed by the kinds' values (plain strings)."""
    return {k.value: 0 for k in SaveKind}
