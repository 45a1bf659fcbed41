"""What the engine returns per request (vLLM's RequestOutput shape, so users feel at home)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


# One position's logprobs: the chosen token plus the top-N, keyed by token id.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str  # cumulative
    token_ids: list[int]  # cumulative
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (a multiple of the block size)
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # None at position 0
    metrics: RequestMetrics | None = None
    new_token_ids: list[int] = field(default_factory=list)  # tokens added since the last output
    new_text: str = ""  # text added since the last output
