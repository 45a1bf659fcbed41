"""SamplingParams: vLLM's names, defaults and valid ranges. No torch here.

Every out-of-range value raises ValueError naming the field and its valid range, so the server can
answer 400 with the message as is.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

MAX_LOGPROBS = 20  # top-N cap for logprobs and prompt_logprobs (OpenAI's top_logprobs cap)
MAX_LOGIT_BIAS = 100.0  # |bias| cap, as OpenAI's API
SAMPLING_EPS = 1e-5  # temperature below this is greedy (vLLM's _SAMPLING_EPS)
MIN_TEMPERATURE = 1e-2  # positive temperatures below this are raised to it (vLLM's _MAX_TEMP), no inf/nan


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N per generated token (0: the sampled token only)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured: object | None = None  # a Guide (deltaserve.sampler.Guide) or a factory with new_guide()

    def __post_init__(self) -> None:
        self._normalize()
        self._verify()

    # ---------------------------------------------------------------- normalization
    def _normalize(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a mapping of token id to bias, got {type(self.logit_bias).__name__}")
            bias: dict[int, float] = {}
            for k, v in self.logit_bias.items():
                try:  # JSON gives string keys
                    kid = int(k)
                    if isinstance(k, float) or isinstance(k, bool) or (isinstance(k, str) and str(kid) != k.strip()):
                        raise ValueError
                except (TypeError, ValueError):
                    raise ValueError(f"logit_bias keys must be token ids (integers), got {k!r}") from None
                if not _is_num(v) or not math.isfinite(v):
                    raise ValueError(f"logit_bias[{k!r}] must be a finite number, got {v!r}")
                bias[kid] = float(v)
            self.logit_bias = bias or None
        if _is_num(self.top_k) and self.top_k == -1:
            self.top_k = 0
        if _is_num(self.temperature) and 0 < self.temperature < SAMPLING_EPS:
            self.temperature = 0.0
        elif _is_num(self.temperature) and SAMPLING_EPS <= self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE

    # ---------------------------------------------------------------- validation
    def _verify(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        need(_is_int(self.n) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            v = getattr(self, name)
            need(_is_num(v) and math.isfinite(v), f"{name} must be a finite number, got {v!r}")
        need(self.temperature >= 0.0, f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        need(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        need(_is_int(self.top_k) and self.top_k >= 0,
             f"top_k must be an integer >= 1, or 0 or -1 to disable it, got {self.top_k!r}")
        need(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        need(-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        need(-2.0 <= self.frequency_penalty <= 2.0,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        need(self.repetition_penalty > 0.0, f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        need(self.seed is None or _is_int(self.seed), f"seed must be an integer or null, got {self.seed!r}")
        need(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
             f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        need(_is_int(self.min_tokens) and self.min_tokens >= 0,
             f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None:
            need(self.min_tokens <= self.max_tokens,
                 f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            need(v is None or (_is_int(v) and 0 <= v <= MAX_LOGPROBS),
                 f"{name} must be an integer in [0, {MAX_LOGPROBS}] or null, got {v!r}")
        for s in self.stop:
            need(isinstance(s, str) and s != "", f"stop must be a string or a list of non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            need(_is_int(t) and t >= 0, f"stop_token_ids must be non-negative integers, got {t!r}")
        for k, v in (self.logit_bias or {}).items():
            need(-MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS,
                 f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {v} for token {k}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            need(isinstance(getattr(self, name), bool), f"{name} must be a boolean, got {getattr(self, name)!r}")

    def validate_for(self, vocab_size: int) -> None:
        """Token-id fields against the model's vocabulary: logit_bias keys and stop_token_ids in [0, vocab)."""
        for k in self.logit_bias or {}:
            if not 0 <= k < vocab_size:
                raise ValueError(f"logit_bias has token id {k}, outside the vocabulary [0, {vocab_size})")
        for t in self.stop_token_ids:
            if not 0 <= t < vocab_size:
                raise ValueError(f"stop_token_ids has token id {t}, outside the vocabulary [0, {vocab_size})")

    # ---------------------------------------------------------------- helpers
    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def clone(self) -> "SamplingParams":
        """A copy for one request; the guide object (structured) is shared, not copied."""
        c = copy.copy(self)
        c.stop = list(self.stop)
        c.stop_token_ids = list(self.stop_token_ids)
        c.logit_bias = dict(self.logit_bias) if self.logit_bias else None
        return c
