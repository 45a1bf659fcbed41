"""What every route shares: engine requests in, one stream of deltas per choice out.

One HTTP request becomes one engine request per (prompt, sample) -- a `Job`. Outputs of all of them
arrive in one RequestSink and become one stream of Deltas (what a choice added: text, token ids, and for
chat its reasoning, content and tool calls, parsed once, as they arrive). Each API formats the deltas: a
streamed response formats each as it comes, a whole response is their fold, so the two cannot diverge.
Validation of the prompt and the sampling values is the engine's (engine.check_request); its
EngineInputError becomes a 400 naming the field in the route's own words. Whatever way the HTTP exchange
ends (finished, error, client gone mid-stream), every engine request still unfinished is aborted, which
frees its pages and GDN slot.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import StreamingResponse

from ..engine.inputs import EngineInputError
from ..engine.sampling_params import SamplingParams
from ..text.parsers import Qwen3CoderToolParser, Qwen3ReasoningParser
from .async_engine import AsyncEngine, EngineNotReady, EngineStepError, RequestSink
from .errors import ApiError, bad_request
from .metrics import RequestTimer, ServerMetrics
from .state import ServedNames

log = logging.getLogger("deltaserve.server")

_DISCONNECT_POLL_S = 0.5  # how often a request checks that its client is still there


@dataclass
class Job:
    index: int  # choice index
    request_id: str  # engine request id
    prompt_ids: list[int]
    params: Any
    prompt_text: str | None = None
    # running state
    text_len: int = 0
    ids_seen: int = 0
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: Any = None
    num_cached: int = 0
    last: Any = None  # the latest RequestOutput
    timer: RequestTimer | None = None
    reasoning: Qwen3ReasoningParser | None = None
    tools: Qwen3CoderToolParser | None = None
    only_first_call: bool = False  # parallel_tool_calls false: tool calls after the first are dropped
    forced_tool: bool = False  # a forced call cut by max_tokens is returned with the arguments so far
    reasoning_tokens: int = 0  # tokens whose text went to reasoning
    prompt_logprobs: Any = None
    images: list | None = None  # the request's images in order (data URLs, base64 or bytes): multi_modal_data
    # candidate resume points by source ({"declared": [...], "structural": [...]}: server/resume_points.py)
    cache_hints: dict = field(default_factory=dict)

    @property
    def completion_tokens(self) -> int:
        return len(self.last.outputs[0].token_ids) if self.last is not None and self.last.outputs else 0


@dataclass
class Delta:
    """What one choice produced since its previous delta."""

    job: Job
    text: str  # new visible text (all of it; chat splits it into reasoning and content)
    start: int  # its new tokens are job.last's token_ids[start:end] (logprobs alike)
    end: int
    reasoning: str = ""  # chat: new reasoning text
    content: str = ""  # chat: new content text
    tool_calls: list = field(default_factory=list)  # chat: tool calls completed in this delta
    finished: bool = False

    @property
    def index(self) -> int:
        return self.job.index

    def pieces(self) -> list[tuple[str, Any]]:
        """The chat delta as ordered (kind, payload) pieces: ("reasoning", str), ("content", str),
        ("tool_call", ToolCall). The Responses and Messages routes fold these into items / content blocks."""
        out: list[tuple[str, Any]] = []
        if self.reasoning:
            out.append(("reasoning", self.reasoning))
        if self.content:
            out.append(("content", self.content))
        out.extend(("tool_call", k) for k in self.tool_calls)
        return out


@dataclass
class Choice:
    """A whole choice: the fold of its deltas."""

    job: Job
    text: str = ""
    reasoning: str = ""
    content: str = ""
    tool_calls: list = field(default_factory=list)
    end: int = 0  # tokens out

    def add(self, d: Delta) -> None:
        self.text += d.text
        self.reasoning += d.reasoning
        self.content += d.content
        self.tool_calls += d.tool_calls
        self.end = d.end


class AbortingStream(StreamingResponse):
    """A StreamingResponse that always closes its generator, so a client leaving aborts the requests."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:  # noqa: BLE001
                    pass


def engine_failed(e: BaseException) -> ApiError:
    return ApiError(500, f"The engine failed while generating: {e}", "internal_error", None, "engine_error")


class ServingCore:
    """The engine side of every route: readiness, model names, sampling values, submission, the delta stream."""

    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, model_names: ServedNames):
        self.engine = engine
        self.metrics = metrics
        self.model_names = model_names

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, model: str | None) -> None:
        if not self.model_names.answers(model):
            raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model", "model_not_found")

    def ready(self):
        if not self.engine.is_ready:
            raise ApiError(503, self.engine.load_error or "The engine is loading; retry shortly.",
                           "service_unavailable", None, "not_ready")
        return self.engine.engine, self.engine.tokenizer

    @staticmethod
    def sampling_params(values: dict[str, Any], *, max_tokens: int | None, seed: int | None, guide: Any,
                        logprobs: int | None = None, prompt_logprobs: int | None = None, min_tokens: int = 0,
                        ignore_eos: bool = False, names: dict[str, str] | None = None):
        """SamplingParams from the request's values (None = default); ranges are checked by SamplingParams, the
        vocabulary and context length by the engine. names: this route's word for a field (max_tokens ->
        max_output_tokens), used in the 400."""

        kw = {k: v for k, v in values.items() if v is not None}
        if kw.get("logit_bias") is not None:
            kw["logit_bias"] = dict(kw["logit_bias"])
        try:
            return SamplingParams(n=1, seed=seed, max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos,
                                  logprobs=logprobs, prompt_logprobs=prompt_logprobs, structured=guide, **kw)
        except (ValueError, TypeError) as e:
            msg = str(e)
            first = msg.split(" ", 1)[0]
            param = first if first.isidentifier() else None
            if param and names and param in names:
                msg, param = names[param] + msg[len(param):], names[param]
            raise bad_request(msg, param) from None

    async def submit(self, jobs: list[Job], sink: RequestSink, cache_salt: str | None,
                     names: dict[str, str] | None = None, cache_key: str | None = None) -> None:
        """Hand every job to the engine; the engine's refusal of one (EngineInputError) aborts them all and
        becomes a 400 naming the field in this route's words (names: engine field -> request field; the prompt
        is 'messages' in chat, 'input' in responses). cache_key: what groups requests for the learned resume points
        (prompt_cache_key)."""

        submitted: list[Job] = []
        try:
            for j in jobs:
                submitted.append(j)  # aborted on any failure below (an abort of an unknown id is a no-op)
                prompt: Any = j.prompt_ids
                if j.images or j.cache_hints or cache_key is not None:
                    prompt = {"prompt_token_ids": j.prompt_ids, "cache_hints": dict(j.cache_hints)}
                    if cache_key is not None:
                        prompt["cache_key"] = cache_key
                    if j.images:
                        prompt["multi_modal_data"] = {"image": j.images}
                ids = await self.engine.add_request(j.request_id, prompt, j.params, sink, cache_salt=cache_salt)
                if j.images and ids is not None:
                    j.prompt_ids = ids  # placeholders widened: what usage counts
                j.timer = RequestTimer(self.metrics, time.monotonic())
        except EngineNotReady as e:
            self.abort(submitted)
            raise ApiError(503, str(e), "service_unavailable", None, "not_ready") from None
        except EngineInputError as e:
            self.abort(submitted)
            param = getattr(e, "param", None)
            names = names or {}
            if param in names:
                param = names[param]
            elif param != "prompt" and not (jobs and param in type(jobs[0].params).__dataclass_fields__):
                param = None
            raise bad_request(str(e) or type(e).__name__, param, getattr(e, "code", "invalid_value")) from None
        except BaseException:
            self.abort(submitted)
            raise

    def abort(self, jobs: list[Job]) -> None:
        for j in jobs:
            if not j.finished:
                self.engine.abort(j.request_id)
                j.finished = True
                j.finish_reason = j.finish_reason or "abort"

    async def deltas(self, jobs: list[Job], sink: RequestSink, request: Request | None) -> AsyncIterator[Delta]:
        """The delta stream: one Delta per engine output, until every job finished. Chat jobs (those with a
        reasoning parser) have their text split into reasoning, content and tool calls here, once."""
        async for job, out in self._outputs(jobs, sink, request):
            c = out.outputs[0] if out.outputs else None
            if c is None:
                continue
            text = self._new_text(job, c)
            start, end = job.ids_seen, len(c.token_ids)
            job.ids_seen = end
            d = Delta(job, text, start, end, finished=job.finished)
            if job.reasoning is not None:
                self._parse(d)
            yield d

    @staticmethod
    def _parse(d: Delta) -> None:
        """Chat: the delta's text through the reasoning parser, then its content through the tool parser."""
        job = d.job
        r, c = job.reasoning.feed(d.text)
        if d.finished:
            r2, c2 = job.reasoning.finish()
            r, c = r + r2, c + c2
        d.reasoning, d.content = r, c
        if job.tools is not None:
            d.content, d.tool_calls = job.tools.feed(c)
            if d.finished:
                # a forced call cut by max_tokens still comes back as a call, with the arguments written so far
                salvage = job.forced_tool and job.finish_reason == "length"
                c3, k3 = job.tools.finish(salvage=salvage)
                d.content, d.tool_calls = d.content + c3, d.tool_calls + k3
            if job.only_first_call:
                d.tool_calls = [k for k in d.tool_calls if k.index == 0]
        if d.reasoning and not d.content and not d.tool_calls:
            job.reasoning_tokens += d.end - d.start

    async def fold(self, jobs: list[Job], sink: RequestSink, request: Request | None) -> list[Choice]:
        """Run every job to completion: the whole choices, in index order (an engine failure becomes a 500)."""
        choices = {j.index: Choice(j) for j in jobs}
        try:
            async for d in self.deltas(jobs, sink, request):
                choices[d.index].add(d)
        except EngineStepError as e:
            raise engine_failed(e) from None
        return [choices[i] for i in sorted(choices)]

    async def _outputs(self, jobs: list[Job], sink: RequestSink,
                       request: Request | None) -> AsyncIterator[tuple[Job, Any]]:
        """Yield (job, RequestOutput) as they come, until every job finished. Aborts the rest on exit."""
        by_id = {j.request_id: j for j in jobs}
        left = len(jobs)
        next_check = time.monotonic() + _DISCONNECT_POLL_S
        try:
            while left:
                try:
                    item = await asyncio.wait_for(sink.queue.get(), timeout=_DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    item = None
                if request is not None and time.monotonic() >= next_check:
                    next_check = time.monotonic() + _DISCONNECT_POLL_S
                    if await request.is_disconnected():
                        log.info("client disconnected; aborting %d requests", left)
                        return
                if item is None:
                    continue
                if isinstance(item, BaseException):
                    raise item
                job = by_id.get(item.request_id)
                if job is None or job.finished:
                    continue
                now = time.monotonic()
                c = item.outputs[0] if item.outputs else None
                if c is not None and job.timer is not None:
                    job.timer.tokens_arrived(len(c.token_ids) - job.ids_seen, now)
                job.last = item
                job.num_cached = getattr(item, "num_cached_tokens", 0) or 0
                if item.prompt_logprobs is not None:
                    job.prompt_logprobs = item.prompt_logprobs
                if item.finished:
                    job.finished = True
                    left -= 1
                    if c is not None:
                        job.finish_reason, job.stop_reason = c.finish_reason, c.stop_reason
                    if job.timer is not None:
                        job.timer.finish(job.finish_reason, now)
                yield job, item
        finally:
            self.abort([j for j in jobs if not j.finished])

    @staticmethod
    def _new_text(job: Job, c) -> str:
        text = c.text
        if job.text_len <= len(text):
            d = text[job.text_len:]
            job.text_len = len(text)
            return d
        return ""  # the engine shortened its text (a stop string): what was sent stays sent

    @staticmethod
    def usage(jobs: list[Job], prompt_lens: dict[int, int]) -> dict:
        """OpenAI usage over the jobs (cached_tokens: what the prefix cache served, counted once per prompt)."""
        prompt = sum(prompt_lens.values())
        completion = sum(j.completion_tokens for j in jobs)
        cached: dict[int, int] = {}
        for j in jobs:
            key = id(j.prompt_ids)
            cached[key] = max(cached.get(key, 0), j.num_cached)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}
