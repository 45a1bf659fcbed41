"""The screen `deltaserve serve` prints once the engine is ready: what was chosen for the user and where to
point each client.

    print(startup_screen(engine, host, port, served_name, api_key))

One block of plain text, no log prefixes: the model and where it came from, dtype and quantization, the
instruction set of the compiled kernels and why it was chosen, the cache layout and pool, what the process
holds (weights as run, pool, GDN slots, everything else; resident and peak), the context and the largest
request that fits, the endpoints, and one line per agent client (Claude Code, Codex CLI, Qwen
Code, opencode) and SDK. The lines for the clients are the settings the agent benchmark runs them with
(bench/clis/clients.py), as one shell line each. An API key is shown as $KEY, never printed.
"""
from __future__ import annotations

import json
import os
from typing import Any

WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def client_base(host: str, port: int) -> str:
    """The URL a client on this machine uses (a wildcard bind answers on loopback too)."""
    h = "127.0.0.1" if host in WILDCARD_HOSTS else host
    return f"http://{'[' + h + ']' if ':' in h else h}:{port}"


def client_lines(base: str, model: str, api_key: str | None = None) -> list[tuple[str, str]]:
    """(client, the one shell line that points it at base and asks for model), for each agent client and SDK."""
    key = "$KEY" if api_key else "x"  # the clients insist on some key; the server checks it only with --api-key
    provider = json.dumps({"provider": {"deltaserve": {"npm": "@ai-sdk/openai-compatible", "name": "deltaserve",
                                                       "options": {"baseURL": f"{base}/v1", "apiKey": key},
                                                       "models": {model: {"name": model}}}},
                           "model": f"deltaserve/{model}"}, separators=(",", ":"))
    codex_provider = (f'model_providers.deltaserve={{name="deltaserve",base_url="{base}/v1",wire_api="responses"'
                      + (',env_key="KEY"' if api_key else "") + "}")
    return [
        ("Claude Code", f"ANTHROPIC_BASE_URL={base} ANTHROPIC_API_KEY={key} ANTHROPIC_MODEL={model} claude"),
        ("Codex CLI", f"codex -m {model} -c model_provider=deltaserve -c '{codex_provider}'"),
        ("Qwen Code", f"OPENAI_BASE_URL={base}/v1 OPENAI_API_KEY={key} OPENAI_MODEL={model} qwen"),
        ("opencode", f"OPENCODE_CONFIG_CONTENT='{provider}' opencode"),
        ("OpenAI SDK", f'OpenAI(base_url="{base}/v1", api_key="{key}")  # or OPENAI_BASE_URL={base}/v1'),
        ("Anthropic SDK", f'Anthropic(base_url="{base}", api_key="{key}")  # or ANTHROPIC_BASE_URL={base}'),
    ]


def _isa_line(eng: Any) -> str:
    if eng.device.type != "cpu":
        return f"{eng.device.type} (torch ops)"
    if eng.cpu_kernels == "torch":
        return "torch ops (no compiled kernels: see the warning above, or DELTASERVE_DECODE_KERNELS=torch)"
    from ..model.ops.cpu_kernels import ISA_WHAT, executable_isas

    asked = eng.config.cpu_isa
    why = (f"the fastest of {', '.join(executable_isas())} this CPU executes" if asked == "auto"
           else f"--cpu-isa {asked}")
    return f"{eng.cpu_kernels}, {why}: {ISA_WHAT.get(eng.cpu_kernels, '')}"


def _quantization(eng: Any) -> str:
    from ..model.quant import read_quantization

    try:
        with open(os.path.join(eng.model_path, "config.json")) as f:
            spec = read_quantization(json.load(f))
    except (OSError, ValueError):
        spec = None
    from ..model.gptq import GptqSpec

    kind = "GPTQ-Int4 MLP / expert linears" if isinstance(spec, GptqSpec) else "block-FP8 linears"
    parts = [f"{kind} (the checkpoint's)"] if spec is not None else []
    if eng.config.quantize != "none":
        parts.append(f"projections {eng.config.quantize} at load (--quantize)")
    if eng.config.quantize_head != "none":
        parts.append(f"LM head {eng.config.quantize_head} (--quantize-head)")
    return ", ".join(parts) or "none"


def _model_source(eng: Any) -> str:
    name = eng.config.model
    if name is None:
        return f"the embedded {eng.config.preset} preset (seeded random weights; give MODEL to serve another)"
    if os.path.realpath(name) == os.path.realpath(eng.model_path):
        return eng.model_path
    return f"Hugging Face Hub, revision {eng.config.revision or 'main'} ({eng.model_path})"


def _process_memory() -> dict[str, int]:
    """This process's resident (VmRSS) and peak resident (VmHWM) bytes; {} where /proc does not say."""
    try:
        with open("/proc/self/status") as f:
            lines = dict(line.split(":", 1) for line in f if ":" in line)
        return {k: int(lines[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}
    except (OSError, KeyError, ValueError):
        return {}


def memory_line(eng: Any) -> str:
    """What the process holds: the weights as run, the pool (KV pages, GDN slots) and everything else (the
    interpreter, torch, kernels, tokenizer, server: resident less the two), with the resident and peak figures
    `deltaserve plan` predicts (tools/planner.py RUNTIME_BYTES is the everything else it assumes)."""
    pool = eng.pool
    held = getattr(getattr(eng, "model", None), "held_weight_bytes", None)  # a tensor-parallel model: not counted
    weights = held() if held is not None else None
    slots = pool.num_slots * getattr(pool, "slot_bytes", 0)
    pages = pool.total_bytes - slots
    gb = lambda n: f"{n / 1e9:,.2f} GB" if n >= 10**9 else f"{n / 1e6:,.1f} MB"  # noqa: E731
    parts = []
    if weights is not None:
        extra = [f"{k} {gb(weights[k])}" for k in ("head", "vision", "mtp") if weights[k]]
        parts.append(f"weights {gb(weights['total'])} as run" + (f" ({', '.join(extra)})" if extra else ""))
    parts.append(f"pool {gb(pool.total_bytes)} (KV pages {gb(pages)}, GDN slots {gb(slots)})")
    mem = _process_memory()
    if mem:
        rest = mem["VmRSS"] - pool.total_bytes - (weights["total"] if weights is not None else 0)
        parts.append(f"everything else {gb(max(rest, 0))}; resident {gb(mem['VmRSS'])}, peak {gb(mem['VmHWM'])}")
    return ", ".join(parts)


def startup_screen(eng: Any, host: str, port: int, served_name: str, api_key: str | None = None) -> str:
    """The ready screen of a loaded LLMEngine served on host:port under served_name."""
    pool, mc = eng.pool, eng.model_config
    base = client_base(host, port)
    largest = eng.memory.max_request_tokens()
    limit = ("the model's own" if eng.max_model_len == mc.max_position_embeddings and not eng.config.max_model_len
             else "--max-model-len" if eng.config.max_model_len else
             f"the model's {mc.max_position_embeddings:,}, cut to what the pool holds")
    spec = eng.config.speculative_config
    rows = [
        ("model", f"{eng.model_name} ({mc.model_type}, {mc.num_hidden_layers} layers) from {_model_source(eng)}"),
        ("served as", served_name + ("  (requests must send Authorization: Bearer $KEY)" if api_key else "")),
        ("dtype", f"{eng.dtype} on {eng.device.type}; quantization: {_quantization(eng)}"),
        ("kernels", _isa_line(eng)),
        ("cache", f"layout {eng.config.cache_layout}, {pool.num_pages:,} pages of {eng.block_size} tokens "
                  f"= {pool.pool_tokens:,} tokens + {pool.num_slots} GDN slots ({pool.total_bytes / 2**20:,.0f} MiB); "
                  f"prefix caching {'on' if eng.config.enable_prefix_caching else 'off'}"),
        ("memory", memory_line(eng)),
        ("context", f"{eng.max_model_len:,} tokens per request ({limit}); the largest request the pool fits "
                    f"alone: {largest:,} tokens; up to {eng.config.max_num_seqs} at once"),
    ]
    if spec is not None:
        rows.append(("speculative", f"{spec.method}, {spec.num_speculative_tokens} draft tokens a step"))
    rows += [
        ("OpenAI API", f"{base}/v1  (chat/completions, completions, responses, models)"),
        ("Anthropic API", f"{base}/v1/messages"),
        ("also", f"{base}/health, {base}/metrics"),
    ]
    width = max(len(k) for k, _ in rows) + 2
    out = [f"deltaserve is ready: {served_name} on {base}", ""]
    out += [f"  {k + ':':<{width}}{v}" for k, v in rows]
    out += ["", "Point a client at it (one line each):"]
    lines = client_lines(base, served_name, api_key)
    w = max(len(k) for k, _ in lines) + 2
    out += [f"  {k + ':':<{w}}{v}" for k, v in lines]
    if api_key:
        out.append("  ($KEY: the --api-key the server was started with)")
    return "\n".join(out)
