"""`deltaserve serve`: the OpenAI-compatible server on uvicorn. Flags use vLLM's names.

    deltaserve serve [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--served-model-name NAME ...]
                     [engine flags: --model DIR, --max-model-len N, --kv-cache-memory 2G, ... (config.EngineConfig)]

With no --model it serves the embedded default model (the `tiny` preset).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from ..config import add_engine_args, engine_args


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deltaserve serve", description="OpenAI-compatible server (vLLM's flag names)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("DELTASERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $DELTASERVE_API_KEY)")
    p.add_argument("--served-model-name", nargs="+", default=None, help="name(s) the API answers to")
    p.add_argument("--reasoning-parser", default="qwen3", choices=["qwen3"],
                   help="reasoning parser (qwen3: <think>...</think> into reasoning_content)")
    p.add_argument("--tool-call-parser", default="qwen3_coder", choices=["qwen3_coder"])
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM compatibility; tool_choice auto is always available")
    p.add_argument("--max-stored-responses", type=int, default=None, metavar="N",
                   help="how many /v1/responses (store: true) are kept in memory for previous_response_id "
                        "(default 1024; the oldest is evicted first; 0 keeps none)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_engine_args(p)
    return p


def engine_config_from_args(args: argparse.Namespace):
    from ..config import EngineConfig

    return EngineConfig.from_kwargs(**engine_args(args))


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from ..config import ConfigError

    try:
        cfg = engine_config_from_args(args)
    except (ConfigError, ValueError, TypeError) as e:
        print(f"deltaserve serve: {e}", file=sys.stderr)
        return 2
    import uvicorn

    from .app import build_app

    from .response_store import DEFAULT_MAX_STORED

    stored = DEFAULT_MAX_STORED if args.max_stored_responses is None else args.max_stored_responses
    if stored < 0:
        print("deltaserve serve: --max-stored-responses must be >= 0", file=sys.stderr)
        return 2
    app = build_app(cfg, api_key=args.api_key, served_model_name=args.served_model_name, freeze_heap=True,
                    max_stored_responses=stored)
    logging.getLogger("deltaserve").info("serving %s on http://%s:%d", app.state.serving.model_name,
                                         args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_keep_alive=30,
                access_log=args.log_level == "debug")
    return 0
