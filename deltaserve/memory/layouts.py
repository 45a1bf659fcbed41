"""Cache layouts: where the bytes of a GDN checkpoint live, one class per layout. Pure Python, no torch.

A checkpoint is the state of every GDN layer after exactly the last token of a block (docs/design.md).
Each layout answers the same few questions, and nothing outside this module asks for a layout by name:

  page_tokens(alignment, hybrid_block)  tokens per page: the hybrid block (a page holds one GDN layer state)
                                        or the alignment itself (a state spans several pages)
  pages_per_state(state, page_bytes)    pages of one layer position that one GDN layer state spans
  side_bytes(geometry, group_size)      bytes per page of a state tensor kept beside the pool (0: none)
  in_pool                               checkpoints take pages of the pool (the memory manager allocates,
                                        holds and evicts them); otherwise they sit in the side tensor at
                                        the row of their block's attention page and cost no page
  checkpoint_pages(groups, per_state)   pool pages one checkpoint takes

The memory manager (memory/manager.py) keeps pages and the prefix cache and reads only `in_pool`; the
runner's cache store (runner/cache.py) reads `in_pool` to find a checkpoint's bytes; sizing.size_pool sizes
the pool with the rest; the planner prints `note`. The layout is chosen once, from --cache-layout, in
scheduler/build.py (the engine and the simulator) and in the planner.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import LAYOUT_NAMES
from ..errors import ConfigError


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class LayoutError(ConfigError):
    """A layout that cannot hold this model's states at this page size; the message says what to change."""


@dataclass(frozen=True)
class CacheLayout:
    name: str
    note: str  # one line for the planner's table: what a page costs

    in_pool = True
    max_pages_per_state = 1  # None: a state may span any number of pages

    def page_tokens(self, alignment: int, hybrid_block: int) -> int:
        """Tokens per page given the alignment and vLLM's hybrid block at that alignment."""
        return hybrid_block

    def pages_per_state(self, state_bytes: int, page_bytes: int) -> int:
        """Pages (of one layer position) one GDN layer state spans; raises LayoutError if it cannot fit."""
        if state_bytes and page_bytes < state_bytes:
            raise LayoutError(f"{page_bytes}-byte pages are too small for a {state_bytes}-byte GDN state in the "
                              f"{self.name} layout; use the hybrid block size (sizing.hybrid_block_size) or "
                              f"the runs layout")
        return 1

    def side_bytes(self, geometry, group_size: int) -> int:
        """Bytes per page of a state tensor beside the pool (0: checkpoints live in pool pages)."""
        return 0

    def checkpoint_pages(self, num_gdn_groups: int, pages_per_state: int) -> int:
        """Pool pages one checkpoint takes: pages_per_state per GDN group, or none beside the pool."""
        return num_gdn_groups * pages_per_state if self.in_pool else 0


@dataclass(frozen=True)
class InPage(CacheLayout):
    """Pages as large as vLLM's hybrid block (a page holds one GDN layer state); a checkpoint is one page per
    GDN group, in the group's layer positions. The whole pool stays available for context."""


@dataclass(frozen=True)
class Runs(CacheLayout):
    """Pages of the alignment itself (64 tokens here), so hits land on that grid; one GDN layer state is cut
    across pages_per_state pages, and a checkpoint is that run of pages for every GDN group (any pages, not
    adjacent ones). The same pool as in-page."""

    max_pages_per_state = None

    def page_tokens(self, alignment: int, hybrid_block: int) -> int:
        return alignment

    def pages_per_state(self, state_bytes: int, page_bytes: int) -> int:
        return _cdiv(state_bytes, page_bytes) if state_bytes else 1


@dataclass(frozen=True)
class PerBlock(CacheLayout):
    """A second tensor beside the pool keeps one state per page, at the row of the block's attention page:
    upstream vLLM's way. `per` says what one row holds: "model" (every GDN layer: this engine's arm) or
    "group" (one GDN group's layers: what vllm-gaudi's per-block tensors amount to; planner only)."""

    per: str = "model"
    in_pool = False

    def side_bytes(self, geometry, group_size: int) -> int:
        if self.per == "model":
            return geometry.gdn_state_bytes_per_seq
        return min(group_size, geometry.n_gdn_layers) * geometry.gdn_state_bytes


IN_PAGE = InPage("in-page", "live slots + pages; checkpoints in pages owned by GDN groups")
RUNS = Runs("runs", "the same with pages of the alignment; a checkpoint spans several pages per GDN group")
PER_BLOCK = PerBlock("per-block", "+ one whole-model GDN state per page (this engine's per-block arm)")
PER_BLOCK_GROUP = PerBlock("per-block-group", "+ one GDN group's state per page (vllm-gaudi's per-block tensors)",
                           per="group")

ENGINE_LAYOUTS = {lay.name: lay for lay in (RUNS, IN_PAGE, PER_BLOCK)}  # what --cache-layout offers
assert tuple(ENGINE_LAYOUTS) == LAYOUT_NAMES, "config's --cache-layout choices and the layouts here must agree"
REPORT_LAYOUTS = {**{n: ENGINE_LAYOUTS[n] for n in ("in-page", "runs", "per-block")},
                  PER_BLOCK_GROUP.name: PER_BLOCK_GROUP}  # what the planner compares
PER_BLOCK_STATES = {"model": PER_BLOCK, "group": PER_BLOCK_GROUP}


def layout_for(layout: "str | CacheLayout") -> CacheLayout:
    """The layout object for a name (an engine layout or a planner one); objects pass through."""
    if isinstance(layout, CacheLayout):
        return layout
    found = ENGINE_LAYOUTS.get(layout) or REPORT_LAYOUTS.get(layout)
    if found is None:
        raise LayoutError(f"layout must be one of {', '.join(REPORT_LAYOUTS)}, not {layout!r}")
    return found
