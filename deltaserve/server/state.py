"""ServerState: what one app's routes share. build_app makes it; each API subpackage's register(app, state) and
the common routes read it."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from .async_engine import AsyncEngine
from .metrics import ServerMetrics


class ServedNames(list):
    """The names the API answers to (--served-model-name; the first is the one responses report). any_name
    (--accept-any-model-name): a request naming another model is served by this one, as llama-server does, so a
    client that asks for its own model names (Claude Code asks for claude-* unless ANTHROPIC_MODEL is set)
    works unconfigured."""

    def __init__(self, names, any_name: bool = False):
        super().__init__(names)
        assert self, "a server answers to at least one name"
        self.any_name = any_name

    def answers(self, name: str | None) -> bool:
        return name is None or self.any_name or name in self


@dataclass(frozen=True)
class ServerState:
    """One engine and what every API serves it with.

    The engine loads in its own thread once the app starts: until engine.is_ready, routes that need it
    answer 503 (ServingCore.ready), and the tokenizer is engine.tokenizer once it is. model_names holds at
    least one name; responses report the first. api_key None: no auth."""

    engine_config: Any  # what the engine is built from (/v1/models reports its model as the root)
    engine: AsyncEngine
    metrics: ServerMetrics
    model_names: ServedNames
    api_key: str | None
    max_stored_responses: int  # /v1/responses kept for previous_response_id
    started: float = field(default_factory=time.time)  # /v1/models' created
