"""`deltaserve serve`: the OpenAI-compatible server on uvicorn. Flags use vLLM's names.

    deltaserve serve [MODEL] [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--served-model-name NAME ...]
                     [--max-request-bytes N]
                     [engine flags: --model DIR|ID, --revision REV, --tokenizer DIR|ID, --max-model-len N,
                      --kv-cache-memory 2G, ... (config.EngineConfig)]

MODEL (as `vllm serve MODEL`) or --model: a directory or a Hugging Face Hub id, resolved (and downloaded, with
a progress bar) before anything loads, so a model that cannot be had is one line and exit status 2. With
neither it serves the embedded default model (the `tiny` preset). The served name defaults to the MODEL given.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from ..config import add_engine_args, engine_args, env_engine_args


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deltaserve serve", description="OpenAI-compatible server (vLLM's flag names)",
                                epilog="Every engine flag is also read from DELTASERVE_<FLAG> (--max-model-len: "
                                       "DELTASERVE_MAX_MODEL_LEN=32k; --enable-prefix-caching: "
                                       "DELTASERVE_ENABLE_PREFIX_CACHING=0); a flag given on the command line wins.")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="a model directory or Hugging Face Hub id, as --model (default: the embedded model)")
    p.add_argument("--host", default=os.environ.get("DELTASERVE_HOST", "127.0.0.1"),
                   help="the address to bind (default: $DELTASERVE_HOST, else 127.0.0.1; 0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=os.environ.get("DELTASERVE_PORT") or 8000,
                   help="(default: $DELTASERVE_PORT, else 8000; 0 takes a free port, which the start-up screen shows)")
    p.add_argument("--api-key", default=os.environ.get("DELTASERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $DELTASERVE_API_KEY)")
    p.add_argument("--served-model-name", nargs="+", default=None, help="name(s) the API answers to")
    p.add_argument("--accept-any-model-name", action="store_true",
                   help="serve a request that names another model with this one (as llama-server does): for clients "
                        "that ask for their own model names, e.g. Claude Code without ANTHROPIC_MODEL")
    p.add_argument("--reasoning-parser", default="qwen3", choices=["qwen3"],
                   help="reasoning parser (qwen3: <think>...</think> into reasoning_content)")
    p.add_argument("--tool-call-parser", default="qwen3_coder", choices=["qwen3_coder"])
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM compatibility; tool_choice auto is always available")
    p.add_argument("--max-stored-responses", type=int, default=None, metavar="N",
                   help="how many /v1/responses (store: true) are kept in memory for previous_response_id "
                        "(default 1024; the oldest is evicted first; 0 keeps none)")
    p.add_argument("--max-request-bytes", type=int, default=None, metavar="N",
                   help="the largest request body accepted, in bytes; a larger one is answered 413 before it is read "
                        "whole (default: room for a context of --max-model-len tokens of the densest text, times 4, "
                        "plus one image at the image decoder's 20 MiB cap when the model takes images)")
    p.add_argument("--kv-events-endpoint", default=None, metavar="tcp://HOST:PORT",
                   help="publish prefix-cache events for a KV-aware router (vllm-router --policy kv_aware) on a "
                        "ZMQ PUB socket, in vLLM's format, at the checkpoint grid (docs/cluster.md); "
                        "tcp://127.0.0.1:PORT binds loopback, tcp://*:PORT every interface")
    p.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help="vLLM's KV events config instead: {\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", "
                        "\"endpoint\": ..., \"replay_endpoint\": ..., \"topic\": ..., \"buffer_steps\": ..., "
                        "\"hwm\": ...}")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_engine_args(p)
    return p


def kv_events_from_args(args: argparse.Namespace, cfg):
    """The KV events config the flags ask for (None: no events), checked against the engine config."""
    from .kv_events import KVEventsConfig

    if args.kv_events_endpoint is not None and args.kv_events_config is not None:
        raise ValueError("give --kv-events-endpoint or --kv-events-config, not both")
    if args.kv_events_endpoint is not None:
        ev = KVEventsConfig.for_endpoint(args.kv_events_endpoint)
    elif args.kv_events_config is not None:
        ev = KVEventsConfig.from_json(args.kv_events_config)
    else:
        return None
    if not ev.enabled:
        return None
    if not cfg.enable_prefix_caching:
        raise ValueError("KV events describe the prefix cache: they need --enable-prefix-caching")
    if cfg.checkpoint_grid <= 0:
        raise ValueError("KV events are announced at the checkpoint grid: give --checkpoint-grid N > 0")
    return ev


def engine_config_from_args(args: argparse.Namespace):
    """The EngineConfig of the flags; the positional MODEL is --model (ValueError when both differ)."""
    from ..config import EngineConfig

    given = engine_args(args)
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if given.get("model", tag) != tag:
            raise ValueError(f"MODEL {tag} and --model {given['model']} disagree: give one")
        given["model"] = tag
    return EngineConfig.from_kwargs(**{**env_engine_args(), **given})  # DELTASERVE_<FLAG>, the command line over it


def resolve_models(cfg) -> None:
    """Fetch (or find in the Hub cache) the model and tokenizer the config names, before anything loads: the
    engine's own resolution then finds them at once. ConfigError names what is missing and how to get it."""
    from ..hub import resolve_model

    resolve_model(cfg.model, cfg.revision)
    resolve_model(cfg.tokenizer, what="tokenizer")


def _print_screen(eng, args: argparse.Namespace, served_name: str) -> None:
    """The start-up screen (banner.py) on stdout; a failure to draw it is logged, never a load error."""
    from .banner import startup_screen

    try:
        print("\n" + startup_screen(eng, args.host, args.port, served_name, args.api_key) + "\n", flush=True)
    except Exception:  # noqa: BLE001 - the server serves without its screen
        logging.getLogger("deltaserve").exception("could not draw the start-up screen")


def listen_socket(host: str, port: int):
    """The server's listening socket, bound before the model loads: a port in use ends the process at once with
    a line that says so (uvicorn would find out only after the load, and the start-up screen would already claim
    the server ready). Port 0 takes a free port; the screen shows the one taken."""
    import errno
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=2048)  # SO_REUSEADDR, as uvicorn binds
    except OSError as e:
        hint = "another process listens there: stop it or give another --port" if e.errno == errno.EADDRINUSE else \
            "give a --host this machine has"
        why = os.strerror(e.errno) if e.errno else str(e)
        raise OSError(f"cannot listen on {host}:{port}: {why} ({hint})") from None


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        force=True)  # `deltaserve serve` arrives with the top-level command's INFO set
    from ..config import ConfigError

    try:
        cfg = engine_config_from_args(args)
        resolve_models(cfg)
        if cfg.cache_disk:  # before the engine loads: a directory it cannot read ends the process here
            from ..runner.disk_store import check_directory

            check_directory(cfg.cache_disk)
        events = kv_events_from_args(args, cfg)
        publisher = None
        if events is not None:
            from .kv_events import KVEventPublisher

            publisher = KVEventPublisher(events)  # opens its sockets now: a bad endpoint fails here
        sock = listen_socket(args.host, args.port)
        args.port = sock.getsockname()[1]
    except (ConfigError, ValueError, TypeError, OSError) as e:
        print(f"deltaserve serve: {e}", file=sys.stderr)
        return 2
    import uvicorn

    from .app import build_app
    from .responses.store import DEFAULT_MAX_STORED

    stored = DEFAULT_MAX_STORED if args.max_stored_responses is None else args.max_stored_responses
    if stored < 0:
        print("deltaserve serve: --max-stored-responses must be >= 0", file=sys.stderr)
        return 2
    if args.max_request_bytes is not None and args.max_request_bytes < 1:
        print("deltaserve serve: --max-request-bytes must be >= 1", file=sys.stderr)
        return 2
    names = []  # the served names, once the app has them
    app = build_app(cfg, api_key=args.api_key, served_model_name=args.served_model_name, freeze_heap=True,
                    max_stored_responses=stored, kv_events=publisher,
                    accept_any_model_name=args.accept_any_model_name, max_request_bytes=args.max_request_bytes,
                    on_loaded=lambda eng: _print_screen(eng, args, names[0]))
    names.append(app.state.serving.model_name)
    logging.getLogger("deltaserve").info("loading %s for http://%s:%d (/health answers 503 until it is ready)",
                                         names[0], args.host, args.port)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_keep_alive=30, access_log=args.log_level == "debug"))
    server.run(sockets=[sock])
    return 0 if server.started else 3  # uvicorn's own status for a server that never started
