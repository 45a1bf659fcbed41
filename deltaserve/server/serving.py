"""The two generation routes: request -> engine requests -> one delta stream -> OpenAI responses.

One HTTP request becomes one engine request per (prompt, sample): n > 1 and batched completion
prompts fan out, each with its own id, its own guide, and its seed offset by the sample's number.
Outputs of all of them arrive in one RequestSink and become one stream of Deltas (what a choice added:
text, token ids, logprobs, and for chat its reasoning, content and tool calls, parsed once, as they
arrive). A streamed response formats each delta as it comes; a whole response is the fold of the same
deltas (fold_deltas), so the two cannot diverge. Validation of the prompt and the sampling values is the
engine's (engine.check_request); its EngineInputError becomes a 400 naming the field. Whatever way the
HTTP exchange ends (finished, error, client gone mid-stream), every engine request still unfinished is
aborted, which frees its pages and GDN slot.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from ..parsers import Qwen3CoderToolParser, Qwen3ReasoningParser, prompt_opens_thinking
from .async_engine import AsyncEngine, EngineNotReady, EngineStepError, RequestSink
from .metrics import RequestTimer, ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, NamedToolChoice

log = logging.getLogger("deltaserve.server")

_DISCONNECT_POLL_S = 0.5  # how often a request checks that its client is still there
_LOGPROB_FLOOR = -9999.0  # JSON has no -inf (vLLM clamps the same way)
_RESERVED_TEMPLATE_KWARGS = {"messages", "tools", "tokenize", "add_generation_prompt", "chat_template",
                             "conversation", "return_dict", "return_tensors", "padding", "truncation",
                             "max_length", "continue_final_message", "documents", "tokenizer_kwargs"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


def _lp(v: float) -> float:
    v = float(v)
    return _LOGPROB_FLOOR if math.isnan(v) or v < _LOGPROB_FLOOR else v


@dataclass
class _Job:
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
    prompt_logprobs: Any = None


@dataclass
class Delta:
    """What one choice produced since its previous delta."""

    job: _Job
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


@dataclass
class Choice:
    """A whole choice: the fold of its deltas."""

    job: _Job
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


def _engine_error_param(e, jobs: list[_Job], prompt_param: str) -> str | None:
    """The request field an EngineInputError names, in this route's words (the prompt is 'messages' in chat)."""
    param = getattr(e, "param", None)
    if param == "prompt":
        return prompt_param
    if param is not None and jobs and param in type(jobs[0].params).__dataclass_fields__:
        return param
    return None


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


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, model_names: list[str]):
        self.engine = engine
        self.metrics = metrics
        self.model_names = model_names

    # ---------------------------------------------------------------- helpers
    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model", "model_not_found")

    def _ready(self):
        if not self.engine.is_ready:
            raise ApiError(503, self.engine.load_error or "The engine is loading; retry shortly.",
                           "service_unavailable", None, "not_ready")
        return self.engine.engine, self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        eng = self.engine.engine
        mc = getattr(eng, "model_config", None)
        v = getattr(mc, "vocab_size", None)
        return int(v) if v else int(self.engine.tokenizer.vocab_size)

    def _sampling_params(self, req, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None,
                         seed: int | None, guide: Any):
        """The request's sampling values (their ranges are checked here, the vocabulary and the context length by
        the engine)."""
        from ..sampling_params import SamplingParams

        kw: dict[str, Any] = {}
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "stop", "stop_token_ids"):
            v = getattr(req, name)
            if v is not None:
                kw[name] = v
        if req.logit_bias is not None:
            kw["logit_bias"] = dict(req.logit_bias)
        try:
            return SamplingParams(n=1, seed=seed, max_tokens=max_tokens, min_tokens=req.min_tokens,
                                  ignore_eos=req.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                  structured=guide, **kw)
        except (ValueError, TypeError) as e:
            msg = str(e)
            first = msg.split(" ", 1)[0]
            raise bad_request(msg, first if first.isidentifier() else None) from None

    def _grammar(self, req, tok, tools: list[dict] | None, forced: Any) -> str | None:
        rf = req.response_format
        want_json = rf is not None and rf.type != "text"
        if not want_json and forced is None:
            return None
        try:
            import llguidance  # noqa: F401
        except ImportError:
            raise bad_request("Constrained decoding (response_format json_object / json_schema, tool_choice "
                              "'required' or a named function) needs the llguidance package, which is not "
                              "installed on this server.", "response_format" if want_json else "tool_choice",
                              "unsupported") from None
        from ..structured import GrammarError, GuideFactory

        try:
            f = GuideFactory.for_tokenizer(tok)
            if forced is not None:
                name = forced.function.name if isinstance(forced, NamedToolChoice) else None
                parallel = req.parallel_tool_calls is not False
                return f.tool_call_grammar(tools or [], name, parallel)
            if rf.type == "json_object":
                return f.json_object_grammar()
            schema = rf.json_schema.json_schema
            if schema is None or schema is True:
                return f.json_schema_grammar({})
            if schema is False:
                raise GrammarError("a false schema matches nothing")
            return f.json_schema_grammar(schema)
        except GrammarError as e:
            param = "tools" if forced is not None else "response_format"
            raise bad_request(f"Cannot enforce {param}: {e}", param, "invalid_schema") from None

    def _guide(self, tok, grammar: str | None, wait_for_think_end: bool):
        if grammar is None:
            return None
        from ..structured import GuideFactory
        return GuideFactory.for_tokenizer(tok).guide(grammar, wait_for_think_end)

    async def _submit(self, jobs: list[_Job], sink: RequestSink, cache_salt: str | None,
                      prompt_param: str = "prompt") -> None:
        """Hand every job to the engine; the engine's refusal of one (EngineInputError) aborts them all and
        becomes a 400 that names the field (the prompt under this route's name for it)."""
        from ..engine import EngineInputError

        submitted: list[_Job] = []
        try:
            for j in jobs:
                submitted.append(j)  # aborted on any failure below (an abort of an unknown id is a no-op)
                await self.engine.add_request(j.request_id, j.prompt_ids, j.params, sink, cache_salt=cache_salt)
                j.timer = RequestTimer(self.metrics, time.monotonic())
        except EngineNotReady as e:
            self._abort(submitted)
            raise ApiError(503, str(e), "service_unavailable", None, "not_ready") from None
        except EngineInputError as e:
            self._abort(submitted)
            raise bad_request(str(e) or type(e).__name__, _engine_error_param(e, jobs, prompt_param),
                              getattr(e, "code", "invalid_value")) from None
        except BaseException:
            self._abort(submitted)
            raise

    def _abort(self, jobs: list[_Job]) -> None:
        for j in jobs:
            if not j.finished:
                self.engine.abort(j.request_id)
                j.finished = True
                j.finish_reason = j.finish_reason or "abort"

    async def _deltas(self, jobs: list[_Job], sink: RequestSink, request: Request | None) -> AsyncIterator[Delta]:
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
                c3, k3 = job.tools.finish()
                d.content, d.tool_calls = d.content + c3, d.tool_calls + k3
            if job.only_first_call:
                d.tool_calls = [k for k in d.tool_calls if k.index == 0]

    async def fold_deltas(self, jobs: list[_Job], sink: RequestSink, request: Request | None) -> list[Choice]:
        """Run every job to completion: the whole choices, in index order (an engine failure becomes a 500)."""
        choices = {j.index: Choice(j) for j in jobs}
        try:
            async for d in self._deltas(jobs, sink, request):
                choices[d.index].add(d)
        except EngineStepError as e:
            raise ApiError(500, f"The engine failed while generating: {e}", "internal_error", None,
                           "engine_error") from None
        return [choices[i] for i in sorted(choices)]

    async def _outputs(self, jobs: list[_Job], sink: RequestSink,
                       request: Request | None) -> AsyncIterator[tuple[_Job, Any]]:
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
            self._abort([j for j in jobs if not j.finished])

    # ---------------------------------------------------------------- logprobs
    def _piece(self, tid: int, lp: Any = None) -> str:
        d = getattr(lp, "decoded_token", None)
        return d if isinstance(d, str) else self.engine.tokenizer.id_to_piece(int(tid))

    def _bytes(self, tid: int, piece: str) -> list[int]:
        tok = self.engine.tokenizer
        b = tok.id_to_bytes(int(tid)) if hasattr(tok, "id_to_bytes") else None
        return list(b if b is not None else piece.encode("utf-8"))

    @staticmethod
    def _top(pos: dict, token_id: int, n: int) -> list[tuple[int, Any]]:
        items = sorted(pos.items(), key=lambda kv: (kv[1].rank, -kv[1].logprob, kv[0]))
        if len(items) > n:
            tok_lp = pos.get(token_id)
            if tok_lp is not None and tok_lp.rank > n:
                items = [kv for kv in items if kv[0] != token_id]
        return items[:n]

    def _chat_logprobs(self, c, start: int, end: int, n: int) -> list[dict]:
        out = []
        lps = c.logprobs or []
        for k in range(start, min(end, len(lps), len(c.token_ids))):
            pos = lps[k] or {}
            tid = c.token_ids[k]
            lp = pos.get(tid)
            piece = self._piece(tid, lp)
            top = []
            for t, alt in self._top(pos, tid, n):
                p = self._piece(t, alt)
                top.append({"token": p, "logprob": _lp(alt.logprob), "bytes": self._bytes(t, p)})
            out.append({"token": piece, "logprob": _lp(lp.logprob) if lp is not None else _LOGPROB_FLOOR,
                        "bytes": self._bytes(tid, piece), "top_logprobs": top})
        return out

    def _completion_logprobs(self, ids: list[int], positions: list, n: int, offset0: int) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        off = offset0
        for tid, pos in zip(ids, positions):
            if pos is None:  # the first prompt token has no logprob
                piece = self._piece(tid)
                tokens.append(piece)
                token_lps.append(None)
                tops.append(None)
            else:
                lp = pos.get(tid)
                piece = self._piece(tid, lp)
                tokens.append(piece)
                token_lps.append(_lp(lp.logprob) if lp is not None else _LOGPROB_FLOOR)
                top: dict[str, float] = {}
                for t, alt in self._top(pos, tid, n):
                    top.setdefault(self._piece(t, alt), _lp(alt.logprob))
                tops.append(top)
            offsets.append(off)
            off += len(piece)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    @staticmethod
    def _prompt_logprobs_json(plps, n: int | None = None, ids: list[int] | None = None) -> list | None:
        """vLLM's shape: [None, {token_id: {logprob, rank, decoded_token}}, ...]; the prompt's own token
        at each position plus the top n (entries beyond n, computed for echo, are left out)."""
        if plps is None:
            return None
        out = []
        for k, pos in enumerate(plps):
            if pos is None:
                out.append(None)
                continue
            own = ids[k] if ids is not None and k < len(ids) else None
            out.append({str(t): {"logprob": _lp(v.logprob), "rank": v.rank, "decoded_token": v.decoded_token}
                        for t, v in pos.items() if n is None or v.rank <= n or t == own})
        return out

    @staticmethod
    def _new_text(job: _Job, c) -> str:
        text = c.text
        if job.text_len <= len(text):
            d = text[job.text_len:]
            job.text_len = len(text)
            return d
        return ""  # the engine shortened its text (a stop string): what was sent stays sent

    def _usage(self, jobs: list[_Job], prompt_lens: dict[int, int]) -> dict:
        prompt = sum(prompt_lens.values())
        completion = sum(len(j.last.outputs[0].token_ids) if j.last is not None and j.last.outputs else 0
                         for j in jobs)
        cached: dict[int, int] = {}
        for j in jobs:
            key = id(j.prompt_ids)
            cached[key] = max(cached.get(key, 0), j.num_cached)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}

    # ================================================================ /v1/completions
    async def completions(self, req: CompletionRequest, request: Request):
        self.check_model(req.model)
        _, tok = self._ready()
        p = req.prompt
        if isinstance(p, str):
            prompts: list[Any] = [p]
        elif p and isinstance(p[0], int):
            prompts = [p]
        else:
            prompts = list(p)
        encoded = [(tok.encode(pr), pr) if isinstance(pr, str) else (list(pr), None) for pr in prompts]
        max_tokens = req.max_tokens
        echo_only = False
        if max_tokens == 0 and req.echo:
            echo_only, max_tokens = True, 1
        elif max_tokens is not None and max_tokens < 1:
            raise bad_request(f"max_tokens must be an integer >= 1, got {max_tokens}", "max_tokens")
        prompt_lp = req.prompt_logprobs
        if req.echo and req.logprobs is not None:  # echoed prompt tokens carry logprobs too
            prompt_lp = max(req.logprobs, prompt_lp or 0)
        grammar = self._grammar(req, tok, None, None)
        rid = f"cmpl-{uuid.uuid4().hex}"
        jobs: list[_Job] = []
        prompt_lens = {pi: len(ids) for pi, (ids, _) in enumerate(encoded)}
        for pi, (ids, text) in enumerate(encoded):
            for s in range(req.n):
                seed = None if req.seed is None else req.seed + s
                sp = self._sampling_params(req, max_tokens, req.logprobs, prompt_lp, seed,
                                           self._guide(tok, grammar, False))
                jobs.append(_Job(pi * req.n + s, f"{rid}-{pi}-{s}", ids, sp, text))
        sink = RequestSink(asyncio.get_running_loop())
        await self._submit(jobs, sink, req.cache_salt)
        created = int(time.time())
        if req.stream:
            gen = self._stream_completions(req, jobs, sink, rid, created, prompt_lens, echo_only, request)
            return AbortingStream(gen, media_type="text/event-stream")
        choices = []
        for ch in await self.fold_deltas(jobs, sink, request):
            j, c = ch.job, (ch.job.last.outputs[0] if ch.job.last is not None and ch.job.last.outputs else None)
            text, ids = ch.text, list(c.token_ids[:ch.end]) if c is not None else []
            lps = list(c.logprobs[:ch.end]) if c is not None and c.logprobs is not None else None
            if echo_only:
                text, ids, lps = "", [], ([] if lps is not None else None)
            prefix = self._echo(j, tok) if req.echo else ""
            logprobs = None
            if req.logprobs is not None:
                if req.echo:
                    plps = j.prompt_logprobs or [None] * len(j.prompt_ids)
                    logprobs = self._completion_logprobs(j.prompt_ids + ids, list(plps) + (lps or []),
                                                         req.logprobs, 0)
                else:
                    logprobs = self._completion_logprobs(ids, lps or [], req.logprobs, 0)
            choice = {"index": j.index, "text": prefix + text, "logprobs": logprobs,
                      "finish_reason": "length" if echo_only else j.finish_reason,
                      "stop_reason": None if echo_only else j.stop_reason}
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self._prompt_logprobs_json(j.prompt_logprobs, req.prompt_logprobs,
                                                                      j.prompt_ids)
            choices.append(choice)
        usage = self._usage(jobs, prompt_lens)
        if echo_only:
            usage["completion_tokens"] = 0
            usage["total_tokens"] = usage["prompt_tokens"]
        return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                             "choices": choices, "usage": usage})

    @staticmethod
    def _echo(job: _Job, tok) -> str:
        return job.prompt_text if job.prompt_text is not None else tok.decode(job.prompt_ids)

    async def _stream_completions(self, req, jobs, sink, rid, created, prompt_lens, echo_only, request):
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        tok = self.engine.tokenizer

        def chunk(choices, usage=None):
            d = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                 "choices": choices}
            if usage is not None:
                d["usage"] = usage
            return f"data: {json.dumps(d)}\n\n"

        try:
            if req.echo:
                for j in sorted(jobs, key=lambda j: j.index):
                    yield chunk([{"index": j.index, "text": self._echo(j, tok), "logprobs": None,
                                  "finish_reason": None}])
            offsets: dict[int, int] = {}
            async for d in self._deltas(jobs, sink, request):
                job, c = d.job, d.job.last.outputs[0]
                text = "" if echo_only else d.text
                logprobs = None
                if req.logprobs is not None and not echo_only and d.end > d.start:
                    off = offsets.get(job.index, 0)
                    logprobs = self._completion_logprobs(list(c.token_ids[d.start:d.end]),
                                                         list((c.logprobs or [])[d.start:d.end]), req.logprobs, off)
                    offsets[job.index] = off + sum(len(t) for t in logprobs["tokens"])
                fin = ("length" if echo_only else job.finish_reason) if d.finished else None
                # a chunk for every step that produced tokens, even when their text is still incomplete
                # (vLLM does the same): a client's time to first token is the time of the first chunk
                if text or logprobs is not None or fin is not None or (d.end > d.start and not echo_only):
                    ch = {"index": job.index, "text": text, "logprobs": logprobs, "finish_reason": fin}
                    if fin is not None:
                        ch["stop_reason"] = None if echo_only else job.stop_reason
                        if req.prompt_logprobs is not None:
                            ch["prompt_logprobs"] = self._prompt_logprobs_json(job.prompt_logprobs, req.prompt_logprobs,
                                                                           job.prompt_ids)
                    yield chunk([ch])
            if include_usage:
                usage = self._usage(jobs, prompt_lens)
                if echo_only:
                    usage["completion_tokens"], usage["total_tokens"] = 0, usage["prompt_tokens"]
                yield chunk([], usage)
            yield "data: [DONE]\n\n"
        except EngineStepError as e:
            yield f"data: {json.dumps(error_body(f'The engine failed while generating: {e}', 'internal_error'))}\n\n"
            yield "data: [DONE]\n\n"

    # ================================================================ /v1/chat/completions
    def _render_chat(self, req: ChatCompletionRequest, tok, use_tools: list[dict] | None) -> str:
        """The conversation through the checkpoint's chat template (400 on what the template refuses)."""
        from ..tokenizer import TokenizerError

        kwargs = dict(req.chat_template_kwargs or {})
        bad = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS)
        if bad:
            raise bad_request(f"chat_template_kwargs may not set {', '.join(bad)}", "chat_template_kwargs")
        messages = []
        for m in req.messages:
            d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
            text = m.text()
            d["content"] = text if text is not None else ""
            if m.name is not None:
                d["name"] = m.name
            if m.tool_calls:
                d["tool_calls"] = [{"id": tc.id, "type": "function",
                                    "function": {"name": tc.function.name, "arguments": tc.function.arguments}}
                                   for tc in m.tool_calls]
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            if m.reasoning_content is not None:
                d["reasoning_content"] = m.reasoning_content
            messages.append(d)
        try:
            return tok.apply_chat_template(messages, tools=use_tools, add_generation_prompt=True, **kwargs)
        except TokenizerError as e:
            raise bad_request(str(e), "messages", "invalid_messages") from None
        except TypeError as e:
            raise bad_request(f"chat_template_kwargs: {e}", "chat_template_kwargs") from None

    async def chat(self, req: ChatCompletionRequest, request: Request):
        self.check_model(req.model)
        _, tok = self._ready()
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
        forced = req.tool_choice if (choice == "required" or isinstance(choice, NamedToolChoice)) else None
        use_tools = tools if choice != "none" else None
        prompt_text = self._render_chat(req, tok, use_tools)
        ids = tok.encode(prompt_text)
        thinking = prompt_opens_thinking(prompt_text)
        n_top = (req.top_logprobs or 0) if req.logprobs else None
        grammar = self._grammar(req, tok, tools, forced)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        jobs: list[_Job] = []
        for s in range(req.n):
            seed = None if req.seed is None else req.seed + s
            sp = self._sampling_params(req, req.max_new_tokens, n_top, req.prompt_logprobs, seed,
                                       self._guide(tok, grammar, thinking))
            j = _Job(s, f"{rid}-{s}", ids, sp, prompt_text, only_first_call=req.parallel_tool_calls is False)
            j.reasoning = Qwen3ReasoningParser(thinking)
            j.tools = Qwen3CoderToolParser(tools) if use_tools else None
            jobs.append(j)
        sink = RequestSink(asyncio.get_running_loop())
        await self._submit(jobs, sink, req.cache_salt, prompt_param="messages")
        created = int(time.time())
        prompt_lens = {0: len(ids)}
        if req.stream:
            gen = self._stream_chat(req, jobs, sink, rid, created, prompt_lens, n_top, request)
            return AbortingStream(gen, media_type="text/event-stream")
        choices = []
        for ch in await self.fold_deltas(jobs, sink, request):
            j = ch.job
            content = ch.content if j.tools is None else (ch.content or None)
            msg: dict[str, Any] = {"role": "assistant", "content": content if (content or not ch.tool_calls) else None,
                                   "reasoning_content": ch.reasoning if j.reasoning.saw_reasoning else None,
                                   "tool_calls": [{"id": k.id, "type": "function",
                                                   "function": {"name": k.name, "arguments": k.arguments}}
                                                  for k in ch.tool_calls]}
            logprobs = None
            if n_top is not None and j.last is not None and j.last.outputs:
                logprobs = {"content": self._chat_logprobs(j.last.outputs[0], 0, ch.end, n_top)}
            choices.append({"index": j.index, "message": msg, "logprobs": logprobs,
                            "finish_reason": self._chat_finish(j, bool(ch.tool_calls)), "stop_reason": j.stop_reason})
        body = {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
                "choices": choices, "usage": self._usage(jobs, prompt_lens)}
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = self._prompt_logprobs_json(jobs[0].prompt_logprobs)
        return JSONResponse(body)

    @staticmethod
    def _chat_finish(job: _Job, called: bool) -> str | None:
        """A choice that stopped after writing tool calls finished with "tool_calls" (OpenAI's reason)."""
        return "tool_calls" if called and job.finish_reason == "stop" else job.finish_reason

    async def _stream_chat(self, req, jobs, sink, rid, created, prompt_lens, n_top, request):
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choices, usage=None, extra=None):
            d = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                 "choices": choices}
            if usage is not None:
                d["usage"] = usage
            if extra:
                d.update(extra)
            return f"data: {json.dumps(d)}\n\n"

        def parts(d: Delta) -> list[dict]:
            """The delta as chat deltas: reasoning, content, then each tool call (its header, then arguments)."""
            out: list[dict] = []
            if d.reasoning:
                out.append({"reasoning_content": d.reasoning})
            if d.content:
                out.append({"content": d.content})
            for k in d.tool_calls:
                out.append({"tool_calls": [{"index": k.index, "id": k.id, "type": "function",
                                            "function": {"name": k.name, "arguments": ""}}]})
                out.append({"tool_calls": [{"index": k.index, "function": {"arguments": k.arguments}}]})
            return out

        called: set[int] = set()
        try:
            for j in jobs:
                yield chunk([{"index": j.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])
            async for d in self._deltas(jobs, sink, request):
                job = d.job
                logprobs = None
                if n_top is not None and d.end > d.start:
                    logprobs = {"content": self._chat_logprobs(job.last.outputs[0], d.start, d.end, n_top)}
                ds = parts(d)
                if d.tool_calls:
                    called.add(job.index)
                if logprobs is not None and not ds:
                    ds = [{}]
                for k, part in enumerate(ds):
                    yield chunk([{"index": job.index, "delta": part, "logprobs": logprobs if k == 0 else None,
                                  "finish_reason": None}])
                if d.finished:
                    yield chunk([{"index": job.index, "delta": {}, "logprobs": None,
                                  "finish_reason": self._chat_finish(job, job.index in called),
                                  "stop_reason": job.stop_reason}])
            if req.prompt_logprobs is not None:
                yield chunk([], extra={"prompt_logprobs": self._prompt_logprobs_json(jobs[0].prompt_logprobs)})
            if include_usage:
                yield chunk([], self._usage(jobs, prompt_lens))
            yield "data: [DONE]\n\n"
        except EngineStepError as e:
            yield f"data: {json.dumps(error_body(f'The engine failed while generating: {e}', 'internal_error'))}\n\n"
            yield "data: [DONE]\n\n"
