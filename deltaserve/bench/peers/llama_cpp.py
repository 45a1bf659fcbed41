"""Harness side of the llama.cpp peer: converts the benchmark's checkpoint to GGUF with llama.cpp's own
converter, starts `llama-server` on it and talks HTTP to it. llama.cpp is never a dependency of deltaserve:
it is built by scripts/setup_llama_cpp.sh into its own directory under $DELTASERVE_HOME, and nothing here
imports it (the converter runs in a subprocess, peers/gguf_convert.py).

Timing is the client's, as for the deltaserve arm: prefill@L is the wall time of a one-token request, decode@B
the decode phase of bench/decode_phase.py over the streamed events' arrival times (each event's `timings`, asked
for with `timings_per_token`, says how many tokens the stream holds). The server's own `predicted_ms` is not
used: with several streams the longest one's first-to-last time can include the other streams' prefill.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ...home import home
from ..decode_phase import decode_phase
from . import PeerUnavailable, free_port, post_json, stop_group, wait_healthy
from .gguf_bytes import decode_bytes_per_token

BUILD = "b11434"
OUTTYPES = ("bf16", "f32", "q8_0")  # GGUF weight formats the converter writes for our checkpoints
# formats llama-quantize makes from the converted bf16 GGUF: the 4-bit files CPU users run (Q4_K_M is what llama.cpp,
# Ollama and LM Studio hand them by default), with llama-quantize's own per-tensor mixture (output Q6_K, ...)
QUANT_TYPES = ("q4_k_m", "q4_0", "q4_k_s", "q5_k_m", "q6_k")
CONVERTER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gguf_convert.py")


def default_dir() -> str:
    """Where scripts/setup_llama_cpp.sh puts the tree (src/) and its build (build/)."""

    return os.path.join(home(), "llama.cpp", BUILD)


def server_binary(root: str | None = None) -> str:
    return os.path.join(root or default_dir(), "build", "bin", "llama-server")


def quantize_binary(root: str | None = None) -> str:
    return os.path.join(root or default_dir(), "build", "bin", "llama-quantize")


def quantize_command(binary: str, src: str, dst: str, gtype: str, threads: int | None = None) -> list[str]:
    """llama-quantize's command line: the bf16 GGUF src into dst in gtype (a QUANT_TYPES name; the tool spells it
    in capitals), with its default mixture of tensor types and no importance matrix (llama.cpp's default too)."""
    if gtype not in QUANT_TYPES:
        raise ValueError(f"GGUF type {gtype!r} not made here; choose from {', '.join(OUTTYPES + QUANT_TYPES)}")
    return [binary, src, dst, gtype.upper()] + ([str(threads)] if threads else [])


def require_server(root: str | None = None) -> str:
    """The llama-server path, or PeerUnavailable saying how to build it."""
    path = server_binary(root)
    if not os.access(path, os.X_OK):
        raise PeerUnavailable(f"no llama-server at {path} (run scripts/setup_llama_cpp.sh)")
    return path


# --------------------------------------------------------------------------- GGUF conversion
def has_mtp_layers(model_dir: str) -> bool:
    """Whether the checkpoint holds MTP tensors. The config is not enough: the embedded 0.8B shape declares
    mtp_num_hidden_layers=1 (Qwen3.5-0.8B's config) but stores no MTP weights, and a GGUF converted with
    them announced has an MTP block llama-server then fails to find (`blk.24.attn_norm.weight`)."""
    for name in sorted(os.listdir(model_dir)):
        if not name.endswith(".safetensors"):
            continue
        with open(os.path.join(model_dir, name), "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        if any("mtp" in key.split(".") for key in header if key != "__metadata__"):
            return True
    return False


def convert_command(model_dir: str, outtype: str, outfile: str, *, tree: str, python: str | None = None,
                    mtp: bool | None = None) -> list[str]:
    """The converter's command line: our wrapper (pre-tokenizer fallback) around the tree's
    convert_hf_to_gguf.py. A checkpoint without MTP layers needs --no-mtp (the converter expects them for
    Qwen3.5 otherwise)."""
    if outtype not in OUTTYPES:
        raise ValueError(f"GGUF type {outtype!r} not supported here; choose from {', '.join(OUTTYPES)}")
    if mtp is None:
        mtp = has_mtp_layers(model_dir)
    return ([python or sys.executable, CONVERTER, tree, model_dir, "--outtype", outtype, "--outfile", outfile]
            + ([] if mtp else ["--no-mtp"]))


def gguf_path(model_dir: str, outtype: str) -> str:
    """Cache path of a checkpoint's GGUF: the embedded checkpoints' directory names carry their content hash."""

    name = os.path.basename(os.path.normpath(model_dir))
    return os.path.join(home(), "gguf", f"{name}-{outtype}-{BUILD}.gguf")


def ensure_gguf(model_dir: str, outtype: str, *, root: str | None = None, log_path: str | None = None,
                timeout: float = 3600.0) -> str:
    """Convert once (atomically: a temporary file renamed into place) and reuse afterwards. A QUANT_TYPES type is
    llama-quantize's file made from the bf16 conversion (itself made and kept first)."""
    root = root or default_dir()
    out = gguf_path(model_dir, outtype)
    if os.path.exists(out):
        return out
    if outtype in QUANT_TYPES:
        src = ensure_gguf(model_dir, "bf16", root=root, log_path=log_path, timeout=timeout)
        binary = quantize_binary(root)
        if not os.access(binary, os.X_OK):
            raise PeerUnavailable(f"no llama-quantize at {binary} (run scripts/setup_llama_cpp.sh)")
        _, tmp = _converter(root, out)
        return _convert(quantize_command(binary, src, tmp, outtype, os.cpu_count()), tmp, out, log_path, timeout,
                        f"llama-quantize ({outtype})")
    tree, tmp = _converter(root, out)
    return _convert(convert_command(model_dir, outtype, tmp, tree=tree), tmp, out, log_path, timeout,
                    f"GGUF conversion ({outtype})")


def _converter(root: str, out: str) -> tuple[str, str]:
    """(the llama.cpp tree whose converter runs, the temporary file it writes for out); PeerUnavailable without it."""
    tree = os.path.join(root, "src")
    if not os.path.exists(os.path.join(tree, "convert_hf_to_gguf.py")):
        raise PeerUnavailable(f"no llama.cpp tree at {tree} (run scripts/setup_llama_cpp.sh)")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    return tree, f"{out}.tmp{os.getpid()}"


def _convert(cmd: list[str], tmp: str, out: str, log_path: str | None, timeout: float, what: str) -> str:
    """Run a converter writing tmp (logged), then rename tmp to out: a failed or killed run leaves no file at out."""
    with open(log_path or os.devnull, "a") as log:
        log.write(f"\n===== {time.strftime('%F %T')} {' '.join(cmd)}\n")
        log.flush()
        r = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, check=False)
    if r.returncode != 0 or not os.path.exists(tmp):
        if os.path.exists(tmp):
            os.remove(tmp)
        raise PeerUnavailable(f"{what} failed with exit {r.returncode} (log: {log_path})")
    os.replace(tmp, out)
    return out


def mmproj_path(model_dir: str) -> str:
    """Cache path of a checkpoint's vision tower as llama.cpp's multimodal projector (mmproj) GGUF, bf16."""
    name = os.path.basename(os.path.normpath(model_dir))
    return os.path.join(home(), "gguf", f"{name}-mmproj-bf16-{BUILD}.gguf")


def ensure_mmproj(model_dir: str, *, root: str | None = None, log_path: str | None = None,
                  timeout: float = 3600.0) -> str:
    """The checkpoint's vision tower converted once by the converter's --mmproj (Qwen3_5ForConditionalGeneration
    is one of its vision models). The converter reads the image processor's settings from preprocessor_config.json,
    which a checkpoint without one (the embedded ones: Qwen3.5's published settings) lacks: it then converts a
    directory of links to the checkpoint's files plus that file, with the settings the engine uses."""
    from ...media.images import QWEN35_PROCESSOR

    root = root or default_dir()
    out = mmproj_path(model_dir)
    if os.path.exists(out):
        return out
    tree, tmp = _converter(root, out)
    with tempfile.TemporaryDirectory() as d:
        src = model_dir
        if not os.path.exists(os.path.join(model_dir, "preprocessor_config.json")):
            src = os.path.join(d, os.path.basename(os.path.normpath(model_dir)))
            os.makedirs(src)
            for name in os.listdir(model_dir):
                os.symlink(os.path.join(os.path.abspath(model_dir), name), os.path.join(src, name))
            with open(os.path.join(src, "preprocessor_config.json"), "w") as f:
                json.dump({**QWEN35_PROCESSOR, "image_processor_type": "Qwen2VLImageProcessorFast"}, f)
        cmd = [sys.executable, CONVERTER, tree, src, "--mmproj", "--outtype", "bf16", "--outfile", tmp]
        return _convert(cmd, tmp, out, log_path, timeout, "mmproj conversion")


# --------------------------------------------------------------------------- the server
def server_command(binary: str, gguf: str, *, port: int, ctx: int, slots: int, threads: int,
                   host: str = "127.0.0.1", extra: tuple[str, ...] | list[str] = ()) -> list[str]:
    """llama-server's command line. -c is the whole context, split evenly over the -np slots (no unified
    KV when -np is given), so the caller passes slots x the per-slot length it needs."""
    if slots < 1 or threads < 1 or ctx < slots:
        raise ValueError(f"llama-server needs slots >= 1, threads >= 1 and ctx >= slots (got {slots}, {threads}, {ctx})")
    return [binary, "-m", gguf, "--host", host, "--port", str(port), "-c", str(ctx), "-np", str(slots),
            "-t", str(threads), "--no-webui", *extra]


@dataclass(frozen=True)
class Timings:
    """One response's `timings`: cache_n prompt tokens reused, prompt_n prefilled in prompt_ms,
    predicted_n generated (the first from the prompt's logits) with the last predicted_n - 1 in predicted_ms."""
    prompt_n: int
    cache_n: int
    prompt_ms: float
    predicted_n: int
    predicted_ms: float
    draft_n: int = 0  # with speculative decoding (--spec-type): drafts proposed, and accepted
    draft_n_accepted: int = 0


def parse_timings(resp: dict) -> Timings:
    t = resp.get("timings")
    if not isinstance(t, dict):
        raise ValueError(f"llama-server response has no timings object (keys: {sorted(resp)})")
    try:
        return Timings(int(t["prompt_n"]), int(t.get("cache_n", 0)), float(t["prompt_ms"]), int(t["predicted_n"]),
                       float(t["predicted_ms"]), int(t.get("draft_n", 0)), int(t.get("draft_n_accepted", 0)))
    except KeyError as e:
        raise ValueError(f"llama-server timings lack {e.args[0]!r}: {t}") from None


NO_REPACK = "--no-repack"
RETRY_SIGNALS = (-4, -11)  # SIGILL, SIGSEGV at start-up: retried with NO_REPACK (LlamaServer)


class LlamaServer:
    """A llama-server process on 127.0.0.1: started, waited for (/health), stopped by close().

    A start-up that dies of SIGILL or SIGSEGV is retried once with --no-repack: on VMs whose CPU advertises AMX,
    ggml's AMX kernels (an "extra buffer type", which --no-repack turns off) hit an illegal instruction
    (`tilezero`) during the warm-up decode on one, and crashed with SIGSEGV right after the thread pool started
    on another (the 4-bit GGUFs), while bf16 never takes that path. `self.no_repack` says whether the retry
    happened."""

    def __init__(self, gguf: str, *, ctx: int, slots: int, threads: int, log_path: str, root: str | None = None,
                 extra: tuple[str, ...] = (), startup_timeout: float = 300.0, env: dict[str, str] | None = None):
        self._env = {**os.environ, **(env or {})}
        try:
            self._start(gguf, ctx=ctx, slots=slots, threads=threads, log_path=log_path, root=root, extra=extra,
                        startup_timeout=startup_timeout)
            self.no_repack = NO_REPACK in extra
        except PeerUnavailable:
            if getattr(self, "proc", None) is None or self.proc.returncode not in RETRY_SIGNALS or NO_REPACK in extra:
                raise
            self._start(gguf, ctx=ctx, slots=slots, threads=threads, log_path=log_path, root=root,
                        extra=(*extra, NO_REPACK), startup_timeout=startup_timeout)
            self.no_repack = True

    def _start(self, gguf: str, *, ctx: int, slots: int, threads: int, log_path: str, root: str | None,
               extra: tuple[str, ...], startup_timeout: float) -> None:
        binary = require_server(root)
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.cmd = server_command(binary, gguf, port=self.port, ctx=ctx, slots=slots, threads=threads, extra=extra)
        self.slots, self.threads, self.ctx, self.log_path = slots, threads, ctx, log_path
        self._log = open(log_path, "a", buffering=1)  # noqa: SIM115 - lives as long as the server
        self._log.write(f"\n===== {time.strftime('%F %T')} {' '.join(self.cmd)}\n")
        t0 = time.time()
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=self._env)
        why = wait_healthy(self.proc, self.base + "/health", startup_timeout)
        if why is not None:
            self.close()
            tail = f": {self._tail()}" if self.proc.returncode is not None else ""
            raise PeerUnavailable(f"llama-server {why} at start-up{tail} (log: {log_path})")
        self.startup_s = round(time.time() - t0, 1)
        try:
            with urllib.request.urlopen(self.base + "/props", timeout=10) as r:
                self.props = json.loads(r.read())
        except (urllib.error.URLError, OSError, ValueError):
            self.props = {}

    def _tail(self) -> str:
        try:
            with open(self.log_path) as f:
                return " | ".join(ln.strip() for ln in f.read().splitlines()[-4:])[-400:]
        except OSError:
            return ""

    def post(self, path: str, body: dict, timeout: float = 3600.0) -> dict:
        return post_json(self.base, path, body, "llama-server", timeout)

    def _body(self, prompt: list[int], n_predict: int, cache_prompt: bool, stream: bool) -> dict:
        return {"prompt": list(prompt), "n_predict": n_predict, "ignore_eos": True, "temperature": 0.0, "top_k": 1,
                "cache_prompt": cache_prompt, "stream": stream, "timings_per_token": stream}

    def complete(self, prompt: list[int], n_predict: int, *, cache_prompt: bool = False) -> Timings:
        """One greedy completion of a token-id prompt, exactly n_predict tokens (ignore_eos)."""
        t = parse_timings(self.post("/completion", self._body(prompt, n_predict, cache_prompt, False)))
        if t.predicted_n != n_predict:
            raise RuntimeError(f"llama-server generated {t.predicted_n} tokens, asked for {n_predict}")
        return t

    def stream(self, prompt: list[int], n_predict: int, on_tokens, *, cache_prompt: bool = False,
               timeout: float = 3600.0) -> Timings:
        """The same completion streamed: on_tokens(n) as each event arrives, n the tokens generated so far (its
        `timings.predicted_n`). Returns the final event's timings."""
        req = urllib.request.Request(self.base + "/completion",
                                     data=json.dumps(self._body(prompt, n_predict, cache_prompt, True)).encode(),
                                     headers={"Content-Type": "application/json"})
        last = None
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                for line in r:
                    if not line.startswith(b"data: "):
                        continue
                    event = json.loads(line[len(b"data: "):])
                    if "error" in event:
                        raise RuntimeError(f"llama-server /completion: {event['error']}")
                    last = parse_timings(event)
                    on_tokens(last.predicted_n)
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"llama-server /completion: HTTP {e.code}: {e.read()[:300]!r}") from None
        if last is None or last.predicted_n != n_predict:
            raise RuntimeError(f"llama-server streamed {last and last.predicted_n} tokens, asked for {n_predict}")
        return last

    def close(self) -> None:
        p = getattr(self, "proc", None)
        if p is not None:
            stop_group(p)
        if not self._log.closed:
            self._log.close()


def speculative_flags(k: int, p: float | None) -> list[str]:
    """llama-server's own speculative decoding with the model's MTP layer (--spec-type draft-mtp), k drafts a step;
    p: the drafts' acceptance made synthetic (--spec-synth-rates, its benchmarking option: draft j accepted with
    probability p ** j, as a drafter right with probability p each), None: the MTP layer's own drafts."""
    flags = ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(k)]
    if p is not None:
        flags += ["--spec-synth-rates", ",".join(f"{p ** j:g}" for j in range(1, k + 1))]
    return flags


# --------------------------------------------------------------------------- the throughput arm
class LlamaCppPeer:
    """One throughput arm: llama-server on the checkpoint's GGUF of one type (`llama.cpp-bf16`, ...).
    Prompt caching is off per request, so every row prefills its whole prompt."""

    def __init__(self, model_dir: str, outtype: str, *, slots: int, threads: int, ctx_per_slot: int,
                 log_dir: str, root: str | None = None, progress=None, name: str | None = None,
                 extra: tuple[str, ...] = ()):
        self.name = name or f"llama.cpp-{outtype}"  # name, extra: an arm with more server flags (speculative_flags)
        require_server(root)
        log = os.path.join(log_dir, f"{self.name}-{os.path.basename(os.path.normpath(model_dir))}.log")
        if progress:
            progress(f"{self.name}: converting the checkpoint to GGUF (cached: {gguf_path(model_dir, outtype)})")
        self.gguf = ensure_gguf(model_dir, outtype, root=root, log_path=log)
        self.server = LlamaServer(self.gguf, ctx=slots * ctx_per_slot, slots=slots, threads=threads, log_path=log,
                                  root=root, extra=tuple(extra))
        # bytes_read: what its roofline is counted at, its own GGUF's bytes per token (not the bf16 checkpoint's)
        self.info = {"build": BUILD, "gguf": self.gguf, "gguf_bytes": os.path.getsize(self.gguf),
                     "bytes_read": decode_bytes_per_token(self.gguf), "slots": slots,
                     "threads": threads, "ctx": slots * ctx_per_slot, "startup_s": self.server.startup_s,
                     "no_repack": self.server.no_repack, "extra": " ".join(extra)}

    def prefill(self, prompts: list[list[int]]) -> tuple[float, int]:
        """The wall time of one-token requests, as the deltaserve arm times its own."""
        t = time.perf_counter()
        self._each(prompts, lambda i, p: self.server.complete(p, 1))
        return time.perf_counter() - t, sum(len(p) for p in prompts)

    def decode(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
        arrivals: list[tuple[float, int, int]] = []  # list.append is atomic: the streams' threads share it

        def run(i: int, p: list[int]) -> Timings:
            return self.server.stream(p, max_tokens, lambda n: arrivals.append((time.perf_counter(), i, n)))

        ts = self._each(prompts, run)
        drafted = sum(t.draft_n for t in ts)
        if drafted:  # a speculative arm: the acceptance of its latest decode, as the deltaserve arms record it
            self.info["acceptance"] = round(sum(t.draft_n_accepted for t in ts) / drafted, 3)
        return decode_phase(arrivals, len(prompts))

    def _each(self, prompts: list[list[int]], fn) -> list[Timings]:
        """fn(i, prompt) for every prompt, concurrently (one slot each)."""
        if len(prompts) > self.server.slots:
            raise RuntimeError(f"{len(prompts)} streams but llama-server has {self.server.slots} slots")
        if len(prompts) == 1:
            return [fn(0, prompts[0])]
        with ThreadPoolExecutor(len(prompts)) as ex:
            return list(ex.map(fn, range(len(prompts)), prompts))

    def close(self) -> None:
        self.server.close()
