"""The two generation routes: request -> engine requests -> OpenAI responses (whole or streamed).

One HTTP request becomes one engine request per (prompt, sample): n > 1 and batched completion
prompts fan out, each with its own id, its own guide, and its seed offset by the sample's number.
Outputs of all of them arrive in one RequestSink. Whatever way the HTTP exchange ends (finished,
error, client gone mid-stream), every engine request still unfinished is aborted, which frees its
pages and GDN slot.
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
    tool_calls_sent: int = 0
    prompt_logprobs: Any = None
    out_text: list[str] = field(default_factory=list)


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

    def _check_ids(self, ids: list[int], param: str) -> None:
        if not ids:
            raise bad_request("The prompt is empty.", param, "empty_prompt")
        v = self.vocab_size
        for t in ids:
            if not 0 <= t < v:
                raise bad_request(f"Token id {t} in {param} is out of vocabulary [0, {v}).", param, "invalid_token_id")

    def _check_length(self, n_prompt: int, max_tokens: int | None, param: str) -> int:
        max_len = int(self.engine.engine.max_model_len)
        if n_prompt >= max_len:
            raise bad_request(
                f"This model's maximum context length is {max_len} tokens. However, your request has "
                f"{n_prompt} input tokens. Please reduce the length of the input.", param, "context_length_exceeded")
        if max_tokens is None:
            return max_len - n_prompt
        if n_prompt + max_tokens > max_len:
            raise bad_request(
                f"This model's maximum context length is {max_len} tokens. However, you requested "
                f"{n_prompt + max_tokens} tokens ({n_prompt} in the {'messages' if param == 'messages' else 'prompt'}, "
                f"{max_tokens} in the completion). Please reduce the length of the "
                f"{'messages' if param == 'messages' else 'prompt'} or completion.", param, "context_length_exceeded")
        return max_tokens

    def _sampling_params(self, req, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None,
                         seed: int | None, guide: Any):
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
            sp = SamplingParams(n=1, seed=seed, max_tokens=max_tokens, min_tokens=req.min_tokens,
                                ignore_eos=req.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                structured=guide, **kw)
            sp.validate_for(self.vocab_size)
        except (ValueError, TypeError) as e:
            msg = str(e)
            first = msg.split(" ", 1)[0]
            raise bad_request(msg, first if first.isidentifier() else None) from None
        return sp

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

    async def _submit(self, jobs: list[_Job], sink: RequestSink, cache_salt: str | None) -> None:
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
            msg = str(e)
            first = msg.split(" ", 1)[0]
            raise bad_request(msg or type(e).__name__, first if first.isidentifier() and first in
                              type(jobs[0].params).__dataclass_fields__ else None) from None
        except BaseException:
            self._abort(submitted)
            raise

    def _abort(self, jobs: list[_Job]) -> None:
        for j in jobs:
            if not j.finished:
                self.engine.abort(j.request_id)
                j.finished = True
                j.finish_reason = j.finish_reason or "abort"

    async def _wait_all(self, jobs, sink, request) -> None:
        """Run every job of a non-streamed request to completion (an engine failure becomes a 500)."""
        try:
            async for _ in self._outputs(jobs, sink, request):
                pass
        except EngineStepError as e:
            raise ApiError(500, f"The engine failed while generating: {e}", "internal_error", None,
                           "engine_error") from None

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
        # prompts
        p = req.prompt
        if isinstance(p, str):
            prompts: list[Any] = [p]
        elif p and isinstance(p[0], int):
            prompts = [p]
        else:
            prompts = list(p)
        encoded: list[tuple[list[int], str | None]] = []
        for i, pr in enumerate(prompts):
            param = "prompt"
            if isinstance(pr, str):
                ids = tok.encode(pr)
                if not ids:
                    raise bad_request("The prompt is empty.", param, "empty_prompt")
                encoded.append((ids, pr))
            else:
                ids = list(pr)
                self._check_ids(ids, param)
                encoded.append((ids, None))
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
        prompt_lens: dict[int, int] = {}
        for pi, (ids, text) in enumerate(encoded):
            mt = self._check_length(len(ids), max_tokens, "prompt")
            prompt_lens[pi] = len(ids)
            for s in range(req.n):
                seed = None if req.seed is None else req.seed + s
                sp = self._sampling_params(req, mt, req.logprobs, prompt_lp, seed,
                                           self._guide(tok, grammar, False))
                jobs.append(_Job(pi * req.n + s, f"{rid}-{pi}-{s}", ids, sp, text))
        sink = RequestSink(asyncio.get_running_loop())
        await self._submit(jobs, sink, req.cache_salt)
        created = int(time.time())
        if req.stream:
            gen = self._stream_completions(req, jobs, sink, rid, created, prompt_lens, echo_only, request)
            return AbortingStream(gen, media_type="text/event-stream")
        await self._wait_all(jobs, sink, request)
        choices = []
        for j in sorted(jobs, key=lambda j: j.index):
            c = j.last.outputs[0] if j.last is not None and j.last.outputs else None
            text = c.text if c is not None else ""
            ids = list(c.token_ids) if c is not None else []
            lps = list(c.logprobs) if c is not None and c.logprobs is not None else None
            if echo_only:
                text, ids, lps = "", [], ([] if lps is not None else None)
            prefix = ""
            if req.echo:
                prefix = j.prompt_text if j.prompt_text is not None else tok.decode(j.prompt_ids)
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
                    prefix = j.prompt_text if j.prompt_text is not None else tok.decode(j.prompt_ids)
                    yield chunk([{"index": j.index, "text": prefix, "logprobs": None, "finish_reason": None}])
            offsets: dict[int, int] = {}
            async for job, out in self._outputs(jobs, sink, request):
                c = out.outputs[0] if out.outputs else None
                if c is None:
                    continue
                text = "" if echo_only else self._new_text(job, c)
                start, end = job.ids_seen, len(c.token_ids)
                job.ids_seen = end
                logprobs = None
                if req.logprobs is not None and not echo_only and end > start:
                    off = offsets.get(job.index, 0)
                    logprobs = self._completion_logprobs(list(c.token_ids[start:end]),
                                                         list((c.logprobs or [])[start:end]), req.logprobs, off)
                    offsets[job.index] = off + sum(len(t) for t in logprobs["tokens"])
                fin = ("length" if echo_only else job.finish_reason) if job.finished else None
                # a chunk for every step that produced tokens, even when their text is still incomplete
                # (vLLM does the same): a client's time to first token is the time of the first chunk
                if text or logprobs is not None or fin is not None or (end > start and not echo_only):
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
    async def chat(self, req: ChatCompletionRequest, request: Request):
        self.check_model(req.model)
        _, tok = self._ready()
        from ..tokenizer import TokenizerError

        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
        forced = req.tool_choice if (choice == "required" or isinstance(choice, NamedToolChoice)) else None
        use_tools = tools if choice != "none" else None
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
            prompt_text = tok.apply_chat_template(messages, tools=use_tools, add_generation_prompt=True, **kwargs)
        except TokenizerError as e:
            raise bad_request(str(e), "messages", "invalid_messages") from None
        except TypeError as e:
            raise bad_request(f"chat_template_kwargs: {e}", "chat_template_kwargs") from None
        ids = tok.encode(prompt_text)
        if not ids:
            raise bad_request("The rendered prompt is empty.", "messages", "empty_prompt")
        thinking = prompt_opens_thinking(prompt_text)
        max_tokens = self._check_length(len(ids), req.max_new_tokens, "messages")
        n_top = (req.top_logprobs or 0) if req.logprobs else None
        grammar = self._grammar(req, tok, tools, forced)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        jobs: list[_Job] = []
        for s in range(req.n):
            seed = None if req.seed is None else req.seed + s
            sp = self._sampling_params(req, max_tokens, n_top, req.prompt_logprobs, seed,
                                       self._guide(tok, grammar, thinking))
            j = _Job(s, f"{rid}-{s}", ids, sp, prompt_text)
            j.reasoning = Qwen3ReasoningParser(thinking)
            j.tools = Qwen3CoderToolParser(tools) if use_tools else None
            jobs.append(j)
        sink = RequestSink(asyncio.get_running_loop())
        await self._submit(jobs, sink, req.cache_salt)
        created = int(time.time())
        prompt_lens = {0: len(ids)}
        if req.stream:
            gen = self._stream_chat(req, jobs, sink, rid, created, prompt_lens, n_top, request)
            return AbortingStream(gen, media_type="text/event-stream")
        await self._wait_all(jobs, sink, request)
        choices = []
        for j in jobs:
            c = j.last.outputs[0] if j.last is not None and j.last.outputs else None
            text = c.text if c is not None else ""
            r1, c1 = j.reasoning.feed(text)
            r2, c2 = j.reasoning.finish()
            reasoning = (r1 + r2) if j.reasoning.saw_reasoning else None
            content: str | None = c1 + c2
            calls = []
            if j.tools is not None:
                t1, k1 = j.tools.feed(content)
                t2, k2 = j.tools.finish()
                content, calls = (t1 + t2) or None, k1 + k2
                if req.parallel_tool_calls is False:
                    calls = calls[:1]
            msg: dict[str, Any] = {"role": "assistant", "content": content if (content or not calls) else None,
                                   "reasoning_content": reasoning}
            if calls:
                msg["tool_calls"] = [{"id": k.id, "type": "function",
                                      "function": {"name": k.name, "arguments": k.arguments}} for k in calls]
            else:
                msg["tool_calls"] = []
            fr = j.finish_reason
            if calls and fr == "stop":
                fr = "tool_calls"
            logprobs = None
            if n_top is not None and c is not None:
                logprobs = {"content": self._chat_logprobs(c, 0, len(c.token_ids), n_top)}
            choices.append({"index": j.index, "message": msg, "logprobs": logprobs, "finish_reason": fr,
                            "stop_reason": j.stop_reason})
        body = {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
                "choices": choices, "usage": self._usage(jobs, prompt_lens)}
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = self._prompt_logprobs_json(jobs[0].prompt_logprobs)
        return JSONResponse(body)

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

        def deltas(job: _Job, text: str, final: bool) -> list[dict]:
            out: list[dict] = []
            r, c = job.reasoning.feed(text)
            if final:
                r2, c2 = job.reasoning.finish()
                r, c = r + r2, c + c2
            if r:
                out.append({"reasoning_content": r})
            if job.tools is None:
                if c:
                    out.append({"content": c})
                return out
            content, calls = job.tools.feed(c)
            if final:
                c3, k3 = job.tools.finish()
                content, calls = content + c3, calls + k3
            if content:
                out.append({"content": content})
            if req.parallel_tool_calls is False:
                calls = [k for k in calls if k.index == 0]
            for k in calls:
                out.append({"tool_calls": [{"index": k.index, "id": k.id, "type": "function",
                                            "function": {"name": k.name, "arguments": ""}}]})
                out.append({"tool_calls": [{"index": k.index, "function": {"arguments": k.arguments}}]})
                job.tool_calls_sent += 1
            return out

        try:
            for j in jobs:
                yield chunk([{"index": j.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])
            async for job, out in self._outputs(jobs, sink, request):
                c = out.outputs[0] if out.outputs else None
                if c is None:
                    continue
                text = self._new_text(job, c)
                start, end = job.ids_seen, len(c.token_ids)
                job.ids_seen = end
                logprobs = None
                if n_top is not None and end > start:
                    logprobs = {"content": self._chat_logprobs(c, start, end, n_top)}
                ds = deltas(job, text, job.finished)
                if logprobs is not None and not ds:
                    ds = [{}]
                for k, d in enumerate(ds):
                    yield chunk([{"index": job.index, "delta": d, "logprobs": logprobs if k == 0 else None,
                                  "finish_reason": None}])
                if job.finished:
                    fr = job.finish_reason
                    if job.tool_calls_sent and fr == "stop":
                        fr = "tool_calls"
                    yield chunk([{"index": job.index, "delta": {}, "logprobs": None, "finish_reason": fr,
                                  "stop_reason": job.stop_reason}])
            if req.prompt_logprobs is not None:
                yield chunk([], extra={"prompt_logprobs": self._prompt_logprobs_json(jobs[0].prompt_logprobs)})
            if include_usage:
                yield chunk([], self._usage(jobs, prompt_lens))
            yield "data: [DONE]\n\n"
        except EngineStepError as e:
            yield f"data: {json.dumps(error_body(f'The engine failed while generating: {e}', 'internal_error'))}\n\n"
            yield "data: [DONE]\n\n"
