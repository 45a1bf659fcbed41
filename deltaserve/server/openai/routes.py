"""The OpenAI routes: /v1/completions and /v1/chat/completions over the shared delta stream (core.py).

Completions fan out into one engine request per (prompt, sample); chat converts its request into a
ChatSpec (chat_spec.py) -- the same internal request /v1/responses and /v1/messages make -- so the
template, the grammar of a forced tool call and the parsers are applied once, in one place. A streamed
response formats each delta as it comes; a whole response is the fold of the same deltas.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse

from ..async_engine import EngineStepError, RequestSink
from ..chat_spec import (ChatSpec, grammar_for, guide_for, image_content, prompt_ids, prompt_token_ids,
                         render_prompt, start_chat)
from ..core import AbortingStream, Delta, Job, ServingCore
from ...engine.inputs import EngineInputError
from ..errors import ApiError, bad_request, error_body  # noqa: F401 - re-exported for older imports
from ..limits import check_prompt, token_bounds
from ..resume_points import mark_end
from ..state import ServerState
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, NamedToolChoice,
                       TokenizeRequest)

log = logging.getLogger("deltaserve.server")

_LOGPROB_FLOOR = -9999.0  # JSON has no -inf (vLLM clamps the same way)
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "stop", "stop_token_ids", "logit_bias")


def _lp(v: float) -> float:
    v = float(v)
    return _LOGPROB_FLOOR if math.isnan(v) or v < _LOGPROB_FLOOR else v


def _sampling_values(req) -> dict[str, Any]:
    d = {name: getattr(req, name) for name in _SAMPLING_FIELDS}
    d["skip_special_tokens"] = req.skip_special_tokens
    d["include_stop_str_in_output"] = req.keeps_stop_str
    return d


def _json_format(rf) -> tuple[str, Any] | None:
    if rf is None or rf.type == "text":
        return None
    return ("json_object", None) if rf.type == "json_object" else ("json_schema", rf.json_schema.json_schema)


def chat_spec(req: ChatCompletionRequest) -> ChatSpec:
    """A Chat Completions request as the one internal chat request."""
    messages = []
    for i, m in enumerate(req.messages):
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
        parts = m.parts()
        d["content"] = image_content(parts, d["role"], f"messages[{i}].content") if parts is not None else ""
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
    for i in req.resume_points or ():
        mark_end(messages[i])
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    tc = req.tool_choice
    named = isinstance(tc, NamedToolChoice)
    return ChatSpec(messages=messages, tools=tools, tool_choice="function" if named else tc,
                    tool_name=tc.function.name if named else None,
                    parallel_tool_calls=req.parallel_tool_calls is not False, max_tokens=req.max_new_tokens,
                    sampling=_sampling_values(req), seed=req.seed, n=req.n,
                    logprobs=(req.top_logprobs or 0) if req.logprobs else None, prompt_logprobs=req.prompt_logprobs,
                    min_tokens=req.min_tokens, ignore_eos=req.ignore_eos,
                    response_format=_json_format(req.response_format),
                    template_kwargs=_template_kwargs(req), cache_salt=req.cache_salt,
                    cache_key=req.prompt_cache_key,
                    names={"prompt": "messages", "multi_modal_data": "messages"}, id_prefix="chatcmpl-")


def _template_kwargs(req: ChatCompletionRequest) -> dict[str, Any]:
    """chat_template_kwargs, with reasoning_effort as the thinking switch unless they set enable_thinking."""
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:
        kwargs.setdefault("enable_thinking", req.reasoning_effort not in ("none", "minimal"))
    return kwargs


class OpenAIServing(ServingCore):
    # ---------------------------------------------------------------- helpers
    @staticmethod
    def _json_grammar(req, tok) -> str | None:
        fmt = _json_format(req.response_format)
        return grammar_for(tok, ChatSpec(messages=[], response_format=fmt)) if fmt is not None else None

    # ---------------------------------------------------------------- logprobs
    def _piece(self, tid: int, lp: Any = None, skip_special: bool = False) -> str:
        """The token's text in a logprobs entry: what it adds to the output text, so the entries' tokens joined are
        the text. A special token the text skips (skip_special_tokens, on by default: <|im_start|>, <|im_end|>)
        is "" here too, in the chosen token's entry and among the alternatives alike."""
        tok = self.engine.tokenizer
        if skip_special and int(tid) in tok.special_token_ids:
            return ""
        d = getattr(lp, "decoded_token", None)
        return d if isinstance(d, str) else tok.id_to_piece(int(tid))

    def _bytes(self, tid: int, piece: str) -> list[int]:
        if piece == "":  # a skipped special token (or an empty piece) adds no bytes
            return []
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

    def _chat_logprobs(self, c, start: int, end: int, n: int, skip_special: bool = True) -> list[dict]:
        out = []
        lps = c.logprobs or []
        for k in range(start, min(end, len(lps), len(c.token_ids))):
            pos = lps[k] or {}
            tid = c.token_ids[k]
            lp = pos.get(tid)
            piece = self._piece(tid, lp, skip_special)
            top = []
            for t, alt in self._top(pos, tid, n):
                p = self._piece(t, alt, skip_special)
                top.append({"token": p, "logprob": _lp(alt.logprob), "bytes": self._bytes(t, p)})
            out.append({"token": piece, "logprob": _lp(lp.logprob) if lp is not None else _LOGPROB_FLOOR,
                        "bytes": self._bytes(tid, piece), "top_logprobs": top})
        return out

    def _completion_logprobs(self, ids: list[int], positions: list, n: int, offset0: int,
                             skip_special: bool = False, generated_from: int = 0) -> dict:
        """tokens, token_logprobs, top_logprobs, text_offset of ids; the generated ones (from index generated_from
        on: an echoed prompt comes first, written as it was sent) skip special tokens as the text does."""
        tokens, token_lps, tops, offsets = [], [], [], []
        off = offset0
        for k, (tid, pos) in enumerate(zip(ids, positions)):
            skip = skip_special and k >= generated_from
            if pos is None:  # the first prompt token has no logprob
                piece = self._piece(tid)
                tokens.append(piece)
                token_lps.append(None)
                tops.append(None)
            else:
                lp = pos.get(tid)
                piece = self._piece(tid, lp, skip)
                tokens.append(piece)
                token_lps.append(_lp(lp.logprob) if lp is not None else _LOGPROB_FLOOR)
                top: dict[str, float] = {}
                for t, alt in self._top(pos, tid, n):
                    top.setdefault(self._piece(t, alt, skip), _lp(alt.logprob))
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

    # ================================================================ render, tokenize, detokenize
    # The routes a KV-aware router asks for a request's token ids (vLLM's shapes): they go through the same
    # template and tokenizer as the request itself, so the ids are the ones the engine will cache.
    def _generate_request(self, rid: str, ids: list[int], req, max_tokens: int | None) -> dict:
        """vLLM's render answer: the request as the tokens-in GenerateRequest it would run."""
        sp = {k: v for k, v in _sampling_values(req).items() if v is not None}
        sp.update(max_tokens=max_tokens, n=req.n, seed=req.seed, min_tokens=req.min_tokens, ignore_eos=req.ignore_eos)
        return {"request_id": rid, "token_ids": ids, "features": None, "sampling_params": sp,
                "model": self.model_name, "stream": req.stream, "cache_salt": req.cache_salt, "priority": 0,
                "kv_transfer_params": None}

    @staticmethod
    def _completion_prompts(req: CompletionRequest) -> list[Any]:
        p = req.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]
        return list(p)

    @staticmethod
    def _encode(eng, tok, text: str, param: str = "prompt", add_special_tokens: bool = False) -> list[int]:
        """A text prompt's ids; a 400 (context_length_exceeded) for one that cannot fit the context, found without
        tokenizing all of it (limits.check_prompt). Call it off the event loop."""
        try:
            check_prompt(tok, text, int(eng.max_model_len), token_bounds(tok))
        except EngineInputError as e:
            raise bad_request(str(e), param, e.code) from None
        return tok.encode(text, add_special_tokens=add_special_tokens)

    def _encode_all(self, eng, tok, prompts: list[Any]) -> list[tuple[list[int], str | None]]:
        return [(self._encode(eng, tok, p), p) if isinstance(p, str) else (list(p), None) for p in prompts]

    async def render_completions(self, req: CompletionRequest):
        self.check_model(req.model)
        eng, tok = self.ready()
        rid = f"cmpl-{uuid.uuid4().hex}"
        encoded = await asyncio.to_thread(self._encode_all, eng, tok, self._completion_prompts(req))
        return JSONResponse([self._generate_request(f"{rid}-{i}", ids, req, req.max_tokens)
                             for i, (ids, _) in enumerate(encoded)])

    async def render_chat(self, req: ChatCompletionRequest):
        self.check_model(req.model)
        eng, tok = self.ready()
        spec = chat_spec(req)
        _, ids, _ = await asyncio.to_thread(prompt_ids, eng, tok, spec)
        return JSONResponse(self._generate_request(f"chatcmpl-{uuid.uuid4().hex}", ids, req, req.max_new_tokens))

    async def tokenize(self, req: TokenizeRequest):
        self.check_model(req.model)
        eng, tok = self.ready()

        def run() -> list[int]:
            if req.messages is not None:
                spec = chat_spec(ChatCompletionRequest(messages=req.messages, tools=req.tools,
                                                       chat_template_kwargs=req.chat_template_kwargs))
                text = render_prompt(tok, spec)
                ids = self._encode(eng, tok, text, "messages", bool(req.add_special_tokens))
                # each image's placeholder widened, as the engine runs it
                return prompt_token_ids(eng, ids, spec.images)
            return self._encode(eng, tok, req.prompt, "prompt", bool(req.add_special_tokens))

        ids = await asyncio.to_thread(run)
        body: dict[str, Any] = {"count": len(ids), "max_model_len": int(eng.max_model_len), "tokens": ids,
                                "token_strs": [tok.id_to_piece(t) for t in ids] if req.return_token_strs else None}
        return JSONResponse(body)

    async def detokenize(self, req: DetokenizeRequest):
        self.check_model(req.model)
        eng, tok = self.ready()
        vocab = getattr(getattr(eng, "model_config", None), "vocab_size", None) or tok.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary (0..{vocab - 1})", "tokens")
        try:
            text = tok.decode(req.tokens)
        except Exception as e:  # noqa: BLE001 - an id the tokenizer has no piece for
            raise bad_request(f"cannot decode these tokens: {e}", "tokens") from None
        return JSONResponse({"prompt": text})

    # ================================================================ /v1/completions
    async def completions(self, req: CompletionRequest, request: Request):
        self.check_model(req.model)
        eng, tok = self.ready()
        encoded = await asyncio.to_thread(self._encode_all, eng, tok, self._completion_prompts(req))
        max_tokens = req.max_tokens
        echo_only = False
        if max_tokens == 0 and req.echo:
            echo_only, max_tokens = True, 1
        elif max_tokens is not None and max_tokens < 1:
            raise bad_request(f"max_tokens must be an integer >= 1, got {max_tokens}", "max_tokens")
        prompt_lp = req.prompt_logprobs
        if req.echo and req.logprobs is not None:  # echoed prompt tokens carry logprobs too
            prompt_lp = max(req.logprobs, prompt_lp or 0)
        grammar = self._json_grammar(req, tok)
        rid = f"cmpl-{uuid.uuid4().hex}"
        jobs: list[Job] = []
        prompt_lens = {pi: len(ids) for pi, (ids, _) in enumerate(encoded)}
        for pi, (ids, text) in enumerate(encoded):
            for s in range(req.n):
                seed = None if req.seed is None else req.seed + s
                guide = guide_for(tok, grammar, False, None)
                sp = self.sampling_params(_sampling_values(req), max_tokens=max_tokens, seed=seed, guide=guide,
                                          logprobs=req.logprobs, prompt_logprobs=prompt_lp,
                                          min_tokens=req.min_tokens, ignore_eos=req.ignore_eos)
                jobs.append(Job(pi * req.n + s, f"{rid}-{pi}-{s}", ids, sp, text))
        sink = RequestSink(asyncio.get_running_loop())
        await self.submit(jobs, sink, req.cache_salt)
        created = int(time.time())
        if req.stream:
            gen = self._stream_completions(req, jobs, sink, rid, created, prompt_lens, echo_only, request)
            return AbortingStream(gen, media_type="text/event-stream")
        choices = []
        for ch in await self.fold(jobs, sink, request):
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
                                                         req.logprobs, 0, req.skip_special_tokens,
                                                         len(j.prompt_ids))
                else:
                    logprobs = self._completion_logprobs(ids, lps or [], req.logprobs, 0, req.skip_special_tokens)
            choice = {"index": j.index, "text": prefix + text, "logprobs": logprobs,
                      "finish_reason": "length" if echo_only else j.finish_reason,
                      "stop_reason": None if echo_only else j.stop_reason}
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self._prompt_logprobs_json(j.prompt_logprobs, req.prompt_logprobs,
                                                                      j.prompt_ids)
            choices.append(choice)
        usage = self.usage(jobs, prompt_lens)
        if echo_only:
            usage["completion_tokens"] = 0
            usage["total_tokens"] = usage["prompt_tokens"]
        return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                             "choices": choices, "usage": usage})

    @staticmethod
    def _echo(job: Job, tok) -> str:
        return job.prompt_text if job.prompt_text is not None else tok.decode(job.prompt_ids)

    async def _stream_completions(self, req, jobs, sink, rid, created, prompt_lens, echo_only, request):
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = include_usage and bool(req.stream_options.continuous_usage_stats)
        tok = self.engine.tokenizer

        def chunk(choices, usage=None):
            d = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                 "choices": choices}
            if usage is None and continuous and choices:
                usage = self.usage(jobs, prompt_lens)
            if usage is not None:
                d["usage"] = usage
            return f"data: {json.dumps(d)}\n\n"

        try:
            if req.echo:
                for j in sorted(jobs, key=lambda j: j.index):
                    yield chunk([{"index": j.index, "text": self._echo(j, tok), "logprobs": None,
                                  "finish_reason": None}])
            offsets: dict[int, int] = {}
            async for d in self.deltas(jobs, sink, request):
                job, c = d.job, d.job.last.outputs[0]
                text = "" if echo_only else d.text
                logprobs = None
                if req.logprobs is not None and not echo_only and d.end > d.start:
                    off = offsets.get(job.index, 0)
                    logprobs = self._completion_logprobs(list(c.token_ids[d.start:d.end]),
                                                         list((c.logprobs or [])[d.start:d.end]), req.logprobs, off,
                                                         req.skip_special_tokens)
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
                usage = self.usage(jobs, prompt_lens)
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
        spec = chat_spec(req)
        run = await start_chat(self, spec)
        jobs, sink, rid = run.jobs, run.sink, run.rid
        n_top = spec.logprobs
        created = int(time.time())
        prompt_lens = {0: len(run.prompt_ids)}
        if req.stream:
            gen = self._stream_chat(req, jobs, sink, rid, created, prompt_lens, n_top, request)
            return AbortingStream(gen, media_type="text/event-stream")
        choices = []
        for ch in await self.fold(jobs, sink, request):
            j = ch.job
            content = ch.content if j.tools is None else (ch.content or None)
            msg: dict[str, Any] = {"role": "assistant", "content": content if (content or not ch.tool_calls) else None,
                                   "reasoning_content": ch.reasoning if j.reasoning.saw_reasoning else None,
                                   "tool_calls": [{"id": k.id, "type": "function",
                                                   "function": {"name": k.name, "arguments": k.arguments}}
                                                  for k in ch.tool_calls]}
            logprobs = None
            if n_top is not None and j.last is not None and j.last.outputs:
                logprobs = {"content": self._chat_logprobs(j.last.outputs[0], 0, ch.end, n_top,
                                                           req.skip_special_tokens)}
            choices.append({"index": j.index, "message": msg, "logprobs": logprobs,
                            "finish_reason": self._chat_finish(j, bool(ch.tool_calls)), "stop_reason": j.stop_reason})
        body = {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
                "choices": choices, "usage": self.usage(jobs, prompt_lens)}
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = self._prompt_logprobs_json(jobs[0].prompt_logprobs)
        return JSONResponse(body)

    @staticmethod
    def _chat_finish(job: Job, called: bool) -> str | None:
        """A choice that stopped after writing tool calls finished with "tool_calls" (OpenAI's reason); one cut by
        max_tokens keeps "length" even when its (forced) call is returned."""
        return "tool_calls" if called and job.finish_reason == "stop" else job.finish_reason

    async def _stream_chat(self, req, jobs, sink, rid, created, prompt_lens, n_top, request):
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = include_usage and bool(req.stream_options.continuous_usage_stats)

        def chunk(choices, usage=None, extra=None):
            d = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                 "choices": choices}
            if usage is None and continuous and choices:
                usage = self.usage(jobs, prompt_lens)
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
            async for d in self.deltas(jobs, sink, request):
                job = d.job
                logprobs = None
                if n_top is not None and d.end > d.start:
                    logprobs = {"content": self._chat_logprobs(job.last.outputs[0], d.start, d.end, n_top,
                                                               req.skip_special_tokens)}
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
                yield chunk([], self.usage(jobs, prompt_lens))
            yield "data: [DONE]\n\n"
        except EngineStepError as e:
            yield f"data: {json.dumps(error_body(f'The engine failed while generating: {e}', 'internal_error'))}\n\n"
            yield "data: [DONE]\n\n"


def register(app: FastAPI, state: ServerState) -> None:
    """Chat Completions, Completions, their render routes, /tokenize and /detokenize, over one OpenAIServing
    (app.state.serving). Each route is the serving method itself (FastAPI reads the body model off its
    signature); the names are the routes' operation ids."""
    serving = app.state.serving = OpenAIServing(state.engine, state.metrics, state.model_names)
    for path, endpoint, name in (("/v1/completions", serving.completions, "completions"),
                                 ("/v1/chat/completions", serving.chat, "chat_completions"),
                                 ("/v1/completions/render", serving.render_completions, "render_completions"),
                                 ("/v1/chat/completions/render", serving.render_chat, "render_chat"),
                                 ("/tokenize", serving.tokenize, "tokenize"),
                                 ("/detokenize", serving.detokenize, "detokenize")):
        app.add_api_route(path, endpoint, methods=["POST"], name=name, response_model=None)
