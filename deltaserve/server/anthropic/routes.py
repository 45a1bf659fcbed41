"""POST /v1/messages (Anthropic's Messages API) and /v1/messages/count_tokens: the edge of one translation.

A Messages request becomes the one internal chat request (input.py); its delta stream folds into
content blocks (output.py), streamed as Anthropic's server-sent events (message_start,
content_block_start / _delta / _stop, message_delta, message_stop) or returned whole. Usage follows
Anthropic's accounting: `input_tokens` are the prompt tokens the prefix cache did not serve,
`cache_read_input_tokens` those it did; `cache_creation_input_tokens` is 0 (caching is automatic here and
costs no write). Errors on these routes are in Anthropic's shape (errors.py).
"""
from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse

from ..async_engine import EngineStepError
from ..chat_spec import ChatRun, prompt_token_ids, render_prompt, start_chat
from ..core import AbortingStream, Job, ServingCore, engine_failed
from ..errors import anthropic_error_body
from ..limits import count_pieces
from ..state import ServerState
from .input import messages_spec
from .output import BlockFolder
from .protocol import CountTokensRequest, MessagesRequest


def stop_reason(job: Job, called: bool) -> str:
    if job.finish_reason == "length":
        return "max_tokens"
    if isinstance(job.stop_reason, str):
        return "stop_sequence"
    return "tool_use" if called else "end_turn"


class MessagesServing(ServingCore):
    async def create(self, req: MessagesRequest, request: Request):
        self.check_model(req.model)
        run = await start_chat(self, messages_spec(req))
        folder = BlockFolder()
        if req.stream:
            return AbortingStream(self._stream(run, folder, request), media_type="text/event-stream")
        try:
            async for d in self.deltas(run.jobs, run.sink, request):
                self._fold(d, folder)
        except EngineStepError as e:
            raise engine_failed(e) from None
        job = run.jobs[0]
        body = self._message(run, folder.blocks)
        body["stop_reason"] = stop_reason(job, any(b["type"] == "tool_use" for b in folder.blocks))
        body["stop_sequence"] = job.stop_reason if isinstance(job.stop_reason, str) else None
        body["usage"] = self._usage(run, final=True)
        return JSONResponse(body)

    async def count_tokens(self, req: CountTokensRequest) -> dict:
        self.check_model(req.model)
        eng, tok = self.ready()
        spec = messages_spec(req)

        def count() -> int:  # off the event loop; a long text counted piece by piece, whatever its length
            text = render_prompt(tok, spec)
            if spec.images:
                return len(prompt_token_ids(eng, tok.encode(text), spec.images))
            return count_pieces(tok, text)[0]

        return {"input_tokens": await asyncio.to_thread(count)}

    # ---------------------------------------------------------------- shapes
    def _message(self, run: ChatRun, blocks: list[dict]) -> dict:
        return {"id": run.rid, "type": "message", "role": "assistant", "model": self.model_name, "content": blocks,
                "stop_reason": None, "stop_sequence": None}

    @staticmethod
    def _usage(run: ChatRun, final: bool) -> dict:
        job = run.jobs[0]
        cached = job.num_cached
        return {"input_tokens": len(run.prompt_ids) - cached, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached, "output_tokens": job.completion_tokens if final else 0}

    @staticmethod
    def _fold(d, folder: BlockFolder) -> list[dict]:
        events: list[dict] = []
        for kind, payload in d.pieces():
            events += folder.feed(kind, payload)
        if d.finished:
            events += folder.finish()
        return events

    async def _stream(self, run: ChatRun, folder: BlockFolder, request: Request):
        def event(ev: dict) -> str:
            return f"event: {ev['type']}\ndata: {json.dumps(ev, ensure_ascii=False)}\n\n"

        started = False
        try:
            async for d in self.deltas(run.jobs, run.sink, request):
                if not started:  # after the first output, which says how much of the prompt the cache served
                    started = True
                    yield event({"type": "message_start",
                                 "message": {**self._message(run, []), "usage": self._usage(run, final=False)}})
                for ev in self._fold(d, folder):
                    yield event(ev)
        except EngineStepError as e:
            yield event(anthropic_error_body(f"The engine failed while generating: {e}", "internal_error"))
            return
        job = run.jobs[0]
        if not started or not job.finish_reason or job.finish_reason == "abort":
            return
        called = any(b["type"] == "tool_use" for b in folder.blocks)
        yield event({"type": "message_delta",
                     "delta": {"stop_reason": stop_reason(job, called),
                               "stop_sequence": job.stop_reason if isinstance(job.stop_reason, str) else None},
                     "usage": self._usage(run, final=True)})
        yield event({"type": "message_stop"})


def register(app: FastAPI, state: ServerState) -> None:
    """POST /v1/messages and /v1/messages/count_tokens over one MessagesServing (app.state.messages)."""
    messages = app.state.messages = MessagesServing(state.engine, state.metrics, state.model_names)
    for path, endpoint, name in (("/v1/messages", messages.create, "create_message"),
                                 ("/v1/messages/count_tokens", messages.count_tokens, "count_tokens")):
        app.add_api_route(path, endpoint, methods=["POST"], name=name, response_model=None)
