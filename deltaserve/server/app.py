"""The FastAPI app: the state its routes share, error objects, API-key auth, and the engine's lifecycle.

    app = build_app(EngineConfig(...), api_key=None, served_model_name=None)

Three APIs over one engine: OpenAI's (/v1/completions, /v1/chat/completions, /v1/responses) and
Anthropic's (/v1/messages), each added by its subpackage's register(app, state) over the one ServerState
(state.py); /health, /v1/models and /metrics are the app's own. The engine starts loading in a background
thread when the app starts (its lifespan); until it is ready, /health and the generation routes answer 503.
Errors are OpenAI error objects {"error": {"message", "type", "param", "code"}}, and Anthropic's
{"type": "error", "error": {"type", "message"}} on /v1/messages (errors.py): 400 for malformed JSON, unknown
or unimplemented fields and bad values, 401 without the API key (Authorization: Bearer KEY, or Anthropic's
x-api-key on /v1/messages), 404 for an unknown model or route, 503 while not ready. A handler's failure
never reaches the engine thread or another request.
"""
from __future__ import annotations

import logging
import secrets
from contextlib import asynccontextmanager
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from ..memory.events import RouterView
from . import anthropic, openai, responses
from .async_engine import AsyncEngine
from .errors import ANTHROPIC_PREFIX, ApiError, shaped_error_body
from .kv_events import event_block_size
from .limits import RequestLimits
from .metrics import CONTENT_TYPE, ServerMetrics
from .openai.protocol import FieldError
from .responses.store import DEFAULT_MAX_STORED
from .state import ServedNames, ServerState

log = logging.getLogger("deltaserve.server")


def default_model_name(engine_config: Any) -> str:
    model = getattr(engine_config, "model", None)
    if model:
        return str(model)
    return f"deltaserve/{getattr(engine_config, 'preset', 'tiny')}"


class _Guard:
    """Pure ASGI middleware: Bearer auth on /v1/*, and the body-size limit (limits.RequestLimits), both before any
    parsing. The body is read here, counted as it arrives: a declared Content-Length over the limit is answered
    413 before a byte of the body is read, a body that grows past it (chunked) as soon as it does, so an
    oversized request never costs more memory than the limit. A body within the limit is handed on whole."""

    def __init__(self, app, api_key: str | None, limits: RequestLimits):
        self.app = app
        self.api_key = api_key
        self.limits = limits

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        path = scope.get("path", "")
        if self.api_key is not None and path.startswith("/v1") and scope.get("method") != "OPTIONS":
            if not self._authorized(headers, path):
                how = "x-api-key: KEY or " if path.startswith(ANTHROPIC_PREFIX) else ""
                resp = JSONResponse(shaped_error_body(path, f"Invalid or missing API key (send {how}Authorization: "
                                                      "Bearer KEY).", "authentication_error", None, "invalid_api_key"),
                                    status_code=401, headers={"WWW-Authenticate": "Bearer"})
                return await resp(scope, receive, send)
        limit = self.limits.max_body
        try:
            declared = int(headers[b"content-length"]) if b"content-length" in headers else None
        except ValueError:
            declared = None
        if declared is not None and declared > limit:
            return await self._too_large(scope, receive, send, path, declared)
        chunks: list[bytes] = []
        total, left = 0, None
        while True:  # the body, counted as it arrives
            message = await receive()
            if message["type"] != "http.request":
                left = message  # the client went away: the app hears it after the body it got
                break
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > limit:
                return await self._too_large(scope, receive, send, path, None)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]
        chunks.clear()  # the joined body is the only copy the app gets
        if left is not None:
            pending.append(left)

        async def replayed():
            if pending:
                return pending.pop(0)
            return await receive()

        return await self.app(scope, replayed, send)

    async def _too_large(self, scope, receive, send, path: str, size: int | None):
        body = shaped_error_body(path, self.limits.message(size), "invalid_request_error", None, "request_too_large")
        await JSONResponse(body, status_code=413, headers={"Connection": "close"})(scope, receive, send)

    def _authorized(self, headers: dict, path: str) -> bool:
        """Authorization: Bearer KEY on every /v1 route; Anthropic's SDKs send x-api-key: KEY instead."""
        def same(got: str, want: str) -> bool:
            return secrets.compare_digest(got.encode("latin-1", "replace"), want.encode("latin-1", "replace"))

        if same(headers.get(b"authorization", b"").decode("latin-1"), f"Bearer {self.api_key}"):
            return True
        return path.startswith(ANTHROPIC_PREFIX) and same(headers.get(b"x-api-key", b"").decode("latin-1"),
                                                          self.api_key)


def _validation_message(errors: list[dict]) -> tuple[str, str | None, str]:
    """The first pydantic error as (message, param, code)."""
    if not errors:
        return "Invalid request.", None, "invalid_value"
    # a union (a string or a list of items) reports one error per member: the deepest says what is wrong
    e = max(errors, key=lambda x: len(x.get("loc", ())))
    loc = [x for x in e.get("loc", ()) if x != "body"]
    kind = e.get("type", "")
    if kind == "json_invalid":
        detail = (e.get("ctx") or {}).get("error", "")
        return f"Malformed JSON in the request body{': ' + str(detail) if detail else ''}.", None, "invalid_json"
    # union members add their type as a path element ("str", "list[int]", "function-after[...]"): drop them
    path = [str(x) for x in loc if isinstance(x, int) or (isinstance(x, str) and x.isidentifier())]
    blamed = (e.get("ctx") or {}).get("error")
    if isinstance(blamed, FieldError):  # a check across fields that names the one to blame
        path += blamed.field.split(".")
    param = path[0] if path and not path[0].isdigit() else None
    dotted = ".".join(path)
    if kind == "extra_forbidden":
        return (f"Unknown or unsupported field '{dotted}': deltaserve does not implement it, "
                "so it is refused rather than ignored."), param, "unknown_field"
    if kind == "missing":
        return f"Missing required field '{dotted}'.", param, "missing_field"
    if kind == "union_tag_not_found":
        return f"Invalid value for '{dotted}': it needs a 'type' field.", param, "invalid_value"
    msg = e.get("msg", "invalid value")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    where = f"'{dotted}': " if dotted else ""
    return f"Invalid value for {where}{msg}".replace("for : ", ""), param, "invalid_value"


def build_app(engine_config: Any, api_key: str | None = None, served_model_name: str | list[str] | None = None,
              *, engine_factory: Callable[[Any], Any] | None = None, freeze_heap: bool = False,
              max_stored_responses: int = DEFAULT_MAX_STORED, kv_events: Any = None,
              accept_any_model_name: bool = False, max_request_bytes: int | None = None,
              on_loaded: Callable[[Any], None] | None = None) -> FastAPI:
    """The app over one engine. engine_factory (tests) replaces LLMEngine.from_config. freeze_heap: see
    AsyncEngine (the `deltaserve serve` process sets it; tests that build many apps do not).
    max_stored_responses: how many /v1/responses (store: true) are kept for previous_response_id.
    kv_events: a kv_events.KVEventPublisher (its sockets open): the engine's cache changes are published on it
    (closed when the app stops). accept_any_model_name: a request naming another model is served by this one
    (state.ServedNames). max_request_bytes: the body-size limit (--max-request-bytes; None: the default for the
    loaded model, limits.default_max_request_bytes). on_loaded(engine): called on the engine thread once it is
    built (`deltaserve serve` prints its start-up screen there)."""
    limits = RequestLimits(max_request_bytes)
    state = _server_state(engine_config, api_key, _served_names(engine_config, served_model_name, accept_any_model_name),
                          engine_factory, freeze_heap, max_stored_responses, kv_events, limits, on_loaded)
    app = FastAPI(title="deltaserve", version="0.1.0", lifespan=_lifespan(state.engine, kv_events),
                  description="OpenAI-compatible server for Gated DeltaNet hybrid models")
    app.state.engine = state.engine
    app.state.metrics = state.metrics
    app.state.limits = limits
    app.add_middleware(_Guard, api_key=state.api_key, limits=limits)
    _add_error_handlers(app)
    for api in (openai, responses, anthropic):
        api.register(app, state)
    _add_common_routes(app, state)
    return app


def _served_names(engine_config: Any, served_model_name: str | list[str] | None,
                  any_name: bool = False) -> ServedNames:
    """--served-model-name as a list (one name or several), else the engine's model; never empty."""
    if isinstance(served_model_name, str):
        return ServedNames([served_model_name], any_name)
    if served_model_name:
        return ServedNames(served_model_name, any_name)
    return ServedNames([default_model_name(engine_config)], any_name)


def _server_state(engine_config: Any, api_key: str | None, names: ServedNames,
                  engine_factory: Callable[[Any], Any] | None, freeze_heap: bool, max_stored_responses: int,
                  kv_events: Any, limits: RequestLimits, then: Callable[[Any], None] | None = None) -> ServerState:
    """The engine (it loads when the app starts), its metrics and what the routes share. Once it has loaded (on its
    thread, before it serves) the request limits are measured on its tokenizer, then(engine) is called after the
    KV events publisher attaches."""
    def on_loaded(eng):  # metrics is bound below, before the engine can load
        limits.engine_loaded(eng)
        if kv_events is not None:
            _publish_kv_events(kv_events, eng, metrics)
        if then is not None:
            then(eng)

    engine = AsyncEngine(engine_config, engine_factory, freeze_heap=freeze_heap, on_loaded=on_loaded)
    metrics = ServerMetrics(lambda: engine.stats, names[0], lambda: engine.engine if engine.is_ready else None)
    return ServerState(engine_config, engine, metrics, names, api_key, max_stored_responses)


def _publish_kv_events(kv_events: Any, eng: Any, metrics: ServerMetrics) -> None:
    """The loaded engine's cache changes go out on kv_events, in the blocks a router hashes."""
    view = RouterView(eng.block_size, event_block_size(eng), checkpoints=eng.memory.num_gdn_groups > 0)
    kv_events.attach(eng.memory.enable_events(), view)
    metrics.engine_collector.kv_event_block_size = view.event_block_size


def _lifespan(engine: AsyncEngine, kv_events: Any):
    """The engine loads (in its thread) while the app runs, and stops with it; so does the KV event publisher."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()
            if kv_events is not None:
                kv_events.close()

    return lifespan


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as the route's API shapes it (errors.shaped_error_body): ours, pydantic's 400s, starlette's
    (404 unknown route, 405), and anything unhandled as a 500 that names only the exception's type."""
    def shaped(request: Request, message: str, type_: str, param: str | None, code: str | None) -> dict:
        return shaped_error_body(request.url.path, message, type_, param, code)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return JSONResponse(shaped(request, exc.message, exc.type, exc.param, exc.code), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        msg, param, code = _validation_message(list(exc.errors()))
        return JSONResponse(shaped(request, msg, "invalid_request_error", param, code), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = {401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error"}.get(
            exc.status_code, "invalid_request_error" if exc.status_code < 500 else "internal_error")
        return JSONResponse(shaped(request, str(exc.detail), kind, None, None), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(shaped(request, f"Internal error: {type(exc).__name__}", "internal_error", None,
                                   "internal_error"), status_code=500)


def _add_common_routes(app: FastAPI, state: ServerState) -> None:
    """The routes of no one API: /v1/models, /health (200 ready, 503 while loading or failed) and /metrics."""
    engine = state.engine

    @app.get("/v1/models")
    async def models():
        eng = engine.engine if engine.is_ready else None
        data = []
        for name in state.model_names:
            d: dict[str, Any] = {"id": name, "object": "model", "created": int(state.started), "owned_by": "deltaserve",
                                 "root": getattr(state.engine_config, "model", None) or name, "parent": None}
            if eng is not None:
                d["max_model_len"] = int(eng.max_model_len)
            data.append(d)
        return {"object": "list", "data": data}

    @app.get("/health")
    async def health():
        if engine.is_ready:
            return Response(status_code=200)
        return JSONResponse(shaped_error_body("/health", engine.load_error or "The engine is loading.",
                                              "service_unavailable", None, "not_ready"), status_code=503)

    @app.get("/metrics")
    async def prometheus():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)
