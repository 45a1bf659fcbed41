"""`deltaserve serve`: the OpenAI-compatible server on uvicorn. Flags use vLLM's names.

    deltaserve serve [--model DIR] [--host 127.0.0.1] [--port 8000] [--dtype ...] [--max-model-len N]
                     [--max-num-seqs N] [--max-num-batched-tokens N] [--kv-cache-memory BYTES]
                     [--block-size N] [--[no-]enable-prefix-caching] [--cache-layout runs|in-page|per-block]
                     [--seed N] [--api-key KEY] [--served-model-name NAME ...]

With no --model it serves the embedded default model (the `tiny` preset).
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import sys

from ..config import CACHE_LAYOUTS

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_bytes(s: str) -> int:
    """'4294967296', '4G', '4GiB', '512M' -> bytes (K/M/G/T are powers of 1024)."""
    m = _SIZE.match(str(s))
    if not m:
        raise argparse.ArgumentTypeError(f"not a byte count: {s!r} (e.g. 4294967296, 4G, 512MiB)")
    mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * mult)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deltaserve serve", description="OpenAI-compatible server (vLLM's flag names)")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    p.add_argument("--preset", default=None, help="embedded model preset when --model is not given (default tiny)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default=None, choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--prefill-merge-tokens", type=int, default=None,
                   help="waiting prompts join a step while its prefill tokens are below this (default 256; 0 = no limit)")
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=None, metavar="BYTES",
                   help="bytes for the whole pool (pages + GDN slots), e.g. 2G")
    p.add_argument("--memory-utilization", "--gpu-memory-utilization", dest="memory_utilization", type=float,
                   default=None, help="fraction of device memory when --kv-cache-memory is not given")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--cache-layout", default=None, choices=CACHE_LAYOUTS)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--device", default=None, choices=["auto", "cpu", "cuda"])
    p.add_argument("--api-key", default=os.environ.get("DELTASERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $DELTASERVE_API_KEY)")
    p.add_argument("--served-model-name", nargs="+", default=None, help="name(s) the API answers to")
    p.add_argument("--reasoning-parser", default="qwen3", choices=["qwen3"],
                   help="reasoning parser (qwen3: <think>...</think> into reasoning_content)")
    p.add_argument("--tool-call-parser", default="qwen3_coder", choices=["qwen3_coder"])
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM compatibility; tool_choice auto is always available")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p


_ENGINE_FLAGS = ("model", "preset", "dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                 "prefill_merge_tokens", "kv_cache_memory", "memory_utilization", "block_size",
                 "enable_prefix_caching", "cache_layout",
                 "seed", "num_threads", "device")


def engine_config_from_args(args: argparse.Namespace):
    from ..config import EngineConfig

    kw = {k: getattr(args, k) for k in _ENGINE_FLAGS if getattr(args, k) is not None}
    return EngineConfig.from_kwargs(**kw)


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

    app = build_app(cfg, api_key=args.api_key, served_model_name=args.served_model_name, freeze_heap=True)
    logging.getLogger("deltaserve").info("serving %s on http://%s:%d", app.state.serving.model_name,
                                         args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_keep_alive=30,
                access_log=args.log_level == "debug")
    return 0
