"""The FastAPI app: routes, OpenAI error objects, Bearer auth, and the engine's lifecycle.

    app = build_app(EngineConfig(...), api_key=None, served_model_name=None)

The engine starts loading in a background thread when the app starts (its lifespan); until it is
ready, /health and the generation routes answer 503. Errors are OpenAI error objects
{"error": {"message", "type", "param", "code"}}: 400 for malformed JSON, unknown or unimplemented
fields and bad values, 401 without the API key, 404 for an unknown model or route, 503 while not
ready. A handler's failure never reaches the engine thread or another request.
"""
from __future__ import annotations

import logging
import secrets
import time
from contextlib import asynccontextmanager
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from .async_engine import AsyncEngine
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest
from .serving import ApiError, OpenAIServing, error_body

log = logging.getLogger("deltaserve.server")

MAX_BODY_BYTES = 64 << 20


def default_model_name(engine_config: Any) -> str:
    model = getattr(engine_config, "model", None)
    if model:
        return str(model)
    return f"deltaserve/{getattr(engine_config, 'preset', 'tiny')}"


class _Guard:
    """Pure ASGI middleware: Bearer auth on /v1/*, and a cap on the body size (both before any parsing)."""

    def __init__(self, app, api_key: str | None, max_body: int = MAX_BODY_BYTES):
        self.app = app
        self.api_key = api_key
        self.max_body = max_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.api_key is not None and scope.get("path", "").startswith("/v1") and scope.get("method") != "OPTIONS":
            auth = headers.get(b"authorization", b"").decode("latin-1")
            expected = f"Bearer {self.api_key}"
            if not secrets.compare_digest(auth.encode("latin-1", "replace"), expected.encode("latin-1", "replace")):
                resp = JSONResponse(error_body("Invalid or missing API key (send Authorization: Bearer KEY).",
                                               "authentication_error", None, "invalid_api_key"), status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})
                return await resp(scope, receive, send)
        cl = headers.get(b"content-length")
        if cl is not None:
            try:
                too_big = int(cl) > self.max_body
            except ValueError:
                too_big = False
            if too_big:
                resp = JSONResponse(error_body(f"The request body is larger than {self.max_body} bytes.",
                                               "invalid_request_error", None, "body_too_large"), status_code=413)
                return await resp(scope, receive, send)
        return await self.app(scope, receive, send)


def _validation_message(errors: list[dict]) -> tuple[str, str | None, str]:
    """The first pydantic error as (message, param, code)."""
    if not errors:
        return "Invalid request.", None, "invalid_value"
    e = errors[0]
    loc = [x for x in e.get("loc", ()) if x != "body"]
    kind = e.get("type", "")
    if kind == "json_invalid":
        detail = (e.get("ctx") or {}).get("error", "")
        return f"Malformed JSON in the request body{': ' + str(detail) if detail else ''}.", None, "invalid_json"
    # union members add their type as a path element ("str", "list[int]", "function-after[...]"): drop them
    path = [str(x) for x in loc if isinstance(x, int) or (isinstance(x, str) and x.isidentifier())]
    param = path[0] if path and not path[0].isdigit() else None
    dotted = ".".join(path)
    if kind == "extra_forbidden":
        return (f"Unknown or unsupported field '{dotted}': deltaserve does not implement it, "
                "so it is refused rather than ignored."), param, "unknown_field"
    if kind == "missing":
        return f"Missing required field '{dotted}'.", param, "missing_field"
    msg = e.get("msg", "invalid value")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    where = f"'{dotted}': " if dotted else ""
    return f"Invalid value for {where}{msg}".replace("for : ", ""), param, "invalid_value"


def build_app(engine_config: Any, api_key: str | None = None, served_model_name: str | list[str] | None = None,
              *, engine_factory: Callable[[Any], Any] | None = None, freeze_heap: bool = False) -> FastAPI:
    """The OpenAI-compatible app over one engine. engine_factory (tests) replaces LLMEngine.from_config.
    freeze_heap: see AsyncEngine (the `deltaserve serve` process sets it; tests that build many apps do not)."""
    if isinstance(served_model_name, str):
        names = [served_model_name]
    elif served_model_name:
        names = list(served_model_name)
    else:
        names = [default_model_name(engine_config)]
    engine = AsyncEngine(engine_config, engine_factory, freeze_heap=freeze_heap)
    metrics = ServerMetrics(lambda: engine.stats, names[0], lambda: engine.engine if engine.is_ready else None)
    serving = OpenAIServing(engine, metrics, names)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="deltaserve", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible server for Gated DeltaNet hybrid models")
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.serving = serving
    app.add_middleware(_Guard, api_key=api_key)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        msg, param, code = _validation_message(list(exc.errors()))
        return JSONResponse(error_body(msg, "invalid_request_error", param, code), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = {401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error"}.get(
            exc.status_code, "invalid_request_error" if exc.status_code < 500 else "internal_error")
        return JSONResponse(error_body(str(exc.detail), kind, None, None), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(f"Internal error: {type(exc).__name__}", "internal_error", None,
                                       "internal_error"), status_code=500)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await serving.chat(body, request)

    @app.get("/v1/models")
    async def models():
        eng = engine.engine if engine.is_ready else None
        data = []
        for name in names:
            d: dict[str, Any] = {"id": name, "object": "model", "created": int(app_started), "owned_by": "deltaserve",
                                 "root": getattr(engine_config, "model", None) or name, "parent": None}
            if eng is not None:
                d["max_model_len"] = int(eng.max_model_len)
            data.append(d)
        return {"object": "list", "data": data}

    @app.get("/health")
    async def health():
        if engine.is_ready:
            return Response(status_code=200)
        return JSONResponse(error_body(engine.load_error or "The engine is loading.", "service_unavailable", None,
                                       "not_ready"), status_code=503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    app_started = time.time()
    return app
