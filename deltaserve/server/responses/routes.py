"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{id}: the edge of one translation.

A Responses request becomes the one internal chat request (chat_spec.ChatSpec): input items and the stored
conversation a `previous_response_id` continues become template messages (responses_input.py), function,
custom and namespaced tools become chat tools (tools.py; built-in tools are left out, and the response's
x-deltaserve-warning header says so), `max_output_tokens` the token budget, `reasoning.effort` none / minimal the
template's enable_thinking false. Its delta stream folds into output items (responses_output.py): streamed
as typed server-sent events (`response.created`, `response.output_item.added`, `response.output_text.delta`,
`response.function_call_arguments.delta`, ..., `response.completed` or `response.incomplete`), or returned
whole. With store (the default) the conversation is kept (response_store.py) for the next turn.
"""
from __future__ import annotations

import json
import time
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse

from ..async_engine import EngineStepError
from ..chat_spec import ChatRun, ChatSpec, start_chat
from ..core import AbortingStream, ServingCore, engine_failed
from ..errors import ApiError
from ..state import ServedNames, ServerState
from .input import call_ids, input_messages, output_message, with_instructions
from .output import OutputFolder
from .protocol import CustomChoice, FunctionChoice, ResponsesRequest
from .store import ResponseStore, StoredResponse
from .tools import ToolSet, collect_tools

NAMES = {"prompt": "input", "max_tokens": "max_output_tokens", "response_format": "text.format",
         "multi_modal_data": "input"}


def responses_spec(req: ResponsesRequest, messages: list[dict], tools: ToolSet | None = None) -> ChatSpec:
    if tools is None:
        tools = collect_tools(req.tools, req.input, req.tool_choice)
    tc = req.tool_choice
    named = isinstance(tc, (FunctionChoice, CustomChoice))
    fmt = req.text.format if req.text is not None else None
    # text.format shapes the message text; a forced call writes none, so with one the call's grammar is the one
    # that applies (the Agents SDK sends both for an agent with an output type and a forced tool)
    response_format = None
    if named or tc == "required":
        pass
    elif fmt is not None and fmt.type == "json_object":
        response_format = ("json_object", None)
    elif fmt is not None and fmt.type == "json_schema":
        response_format = ("json_schema", fmt.json_schema)
    kwargs: dict[str, Any] = {}
    effort = req.reasoning.effort if req.reasoning is not None else None
    if effort is not None:
        kwargs["enable_thinking"] = effort not in ("none", "minimal")
    return ChatSpec(messages=messages, tools=tools.chat_tools or None,
                    tool_choice="function" if named else tc, tool_name=tools.forced if named else None,
                    parallel_tool_calls=req.parallel_tool_calls is not False, max_tokens=req.max_output_tokens,
                    sampling={"temperature": req.temperature, "top_p": req.top_p}, response_format=response_format,
                    template_kwargs=kwargs, names=NAMES, id_prefix="resp_", cache_key=req.prompt_cache_key)


class ResponsesServing(ServingCore):
    def __init__(self, engine, metrics, model_names: ServedNames, store: ResponseStore):
        super().__init__(engine, metrics, model_names)
        self.store = store

    async def create(self, req: ResponsesRequest, request: Request):
        self.check_model(req.model)
        prior: list[dict] = []
        if req.previous_response_id is not None:
            prior = self.store.get(req.previous_response_id).conversation
        tools = collect_tools(req.tools, req.input, req.tool_choice)
        conversation = prior + input_messages(req.input, call_ids(prior), req.resume_points)
        run = await start_chat(self, responses_spec(req, with_instructions(req.instructions, conversation), tools))
        created = time.time()
        folder = OutputFolder(summary=req.reasoning is not None and req.reasoning.summary is not None,
                              opaque="reasoning.encrypted_content" in (req.include or []), tools=tools.refs)
        if req.stream:
            return AbortingStream(self._stream(req, run, folder, conversation, created, request),
                                  media_type="text/event-stream", headers=tools.header())
        try:
            async for d in self.deltas(run.jobs, run.sink, request):
                self._fold(d, folder)
        except EngineStepError as e:
            raise engine_failed(e) from None
        return JSONResponse(self._done(req, run, folder, conversation, created), headers=tools.header())

    async def retrieve(self, response_id: str) -> dict:
        s = self.store.lookup(response_id)
        if s is None:
            raise ApiError(404, f"No stored response with id '{response_id}'.", "invalid_request_error",
                           "response_id", "response_not_found")
        return s.response

    async def delete(self, response_id: str) -> dict:
        if not self.store.delete(response_id):
            raise ApiError(404, f"No stored response with id '{response_id}'.", "invalid_request_error",
                           "response_id", "response_not_found")
        return {"id": response_id, "object": "response", "deleted": True}

    # ---------------------------------------------------------------- folding
    @staticmethod
    def _fold(d, folder: OutputFolder) -> list[dict]:
        events: list[dict] = []
        for kind, payload in d.pieces():
            events += folder.feed(kind, payload)
        if d.finished:
            events += folder.finish("incomplete" if d.job.finish_reason == "length" else "completed")
        return events

    def _done(self, req: ResponsesRequest, run: ChatRun, folder: OutputFolder, conversation: list[dict],
              created: float) -> dict:
        """The final response object; stored (with the conversation it ends) when store is on."""
        job = run.jobs[0]
        status = "incomplete" if job.finish_reason == "length" else "completed"
        body = self._response(req, run, created, status, folder.items)
        prompt, out = len(run.prompt_ids), job.completion_tokens
        body["usage"] = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": job.num_cached},
                         "output_tokens": out, "output_tokens_details": {"reasoning_tokens": job.reasoning_tokens},
                         "total_tokens": prompt + out}
        if req.store and job.finish_reason != "abort":  # a client that left gets nothing stored
            reply = output_message(folder.items)
            self.store.put(run.rid, StoredResponse(body, conversation + ([reply] if reply else [])))
        return body

    def _response(self, req: ResponsesRequest, run: ChatRun, created: float, status: str,
                  output: list[dict]) -> dict:
        tc = req.tool_choice
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        return {
            "id": run.rid, "object": "response", "created_at": int(created), "status": status,
            "completed_at": int(time.time()) if status != "in_progress" else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": self.model_name,
            "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning.model_dump() if req.reasoning is not None else {"effort": None, "summary": None},
            "store": req.store, "temperature": req.temperature, "top_p": req.top_p,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"},
                     **({"verbosity": req.text.verbosity} if req.text is not None and req.text.verbosity else {})},
            "tool_choice": tc.model_dump() if isinstance(tc, (FunctionChoice, CustomChoice)) else (tc or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "truncation": "disabled", "usage": None, "user": req.user, "metadata": req.metadata or {},
            "prompt_cache_key": req.prompt_cache_key,
        }

    async def _stream(self, req: ResponsesRequest, run: ChatRun, folder: OutputFolder, conversation: list[dict],
                      created: float, request: Request):
        seq = 0

        def event(ev: dict) -> str:
            nonlocal seq
            ev["sequence_number"] = seq
            seq += 1
            return f"event: {ev['type']}\ndata: {json.dumps(ev, ensure_ascii=False)}\n\n"

        snapshot = self._response(req, run, created, "in_progress", [])
        yield event({"type": "response.created", "response": snapshot})
        yield event({"type": "response.in_progress", "response": snapshot})
        try:
            async for d in self.deltas(run.jobs, run.sink, request):
                for ev in self._fold(d, folder):
                    yield event(ev)
        except EngineStepError as e:
            failed = self._response(req, run, created, "failed", folder.items)
            failed["error"] = {"code": "server_error", "message": f"The engine failed while generating: {e}"}
            yield event({"type": "response.failed", "response": failed})
            return
        final = self._done(req, run, folder, conversation, created)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        yield event({"type": kind, "response": final})


def register(app: FastAPI, state: ServerState) -> None:
    """POST /v1/responses, GET and DELETE /v1/responses/{response_id}, over one ResponsesServing and its store
    (app.state.responses). retrieve and delete are async so that, like create, they run on the event loop: the
    store has no lock."""
    responses = app.state.responses = ResponsesServing(state.engine, state.metrics, state.model_names,
                                                       ResponseStore(state.max_stored_responses))
    one = "/v1/responses/{response_id}"
    for path, method, endpoint, name in (("/v1/responses", "POST", responses.create, "create_response"),
                                         (one, "GET", responses.retrieve, "get_response"),
                                         (one, "DELETE", responses.delete, "delete_response")):
        app.add_api_route(path, endpoint, methods=[method], name=name, response_model=None)
