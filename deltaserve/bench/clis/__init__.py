"""`deltaserve bench agents`: the real coding-agent CLIs (Claude Code, Codex CLI, Qwen Code, opencode), headless,
N sessions x K turns each, against deltaserve and llama-server on the same checkpoint, side by side.

Each server runs behind a metering proxy (bench/capture.py + bench/stream_meter.py), which sees every request as
the CLI sent it and times the first generated content the same way for both servers. Each session is a fresh
working directory (the sessions of a client share its home, as one user's do: bench/clis/clients.py); its first
turn is `<cli> <first prompt>` (every session its own), its later turns continue the session (`claude -c -p`,
`codex exec resume --last`, `qwen -c`, `opencode run -c`). Turns are sent in rounds (every session's turn 1, then
every session's turn 2, ...), one CLI at a time, so a server holds N live sessions.

Reported per client and server: turns that exited 0; per turn its first main request (one with tools; side
requests such as title generation are counted, not measured): prompt tokens, cached tokens, time to first
content; the first turns of sessions 2..N against the prefix they share with session 1 (the tools and the
system text), later turns against the previous request's prompt; and for every main request that reads less
from the cache than the previous request's prompt plus its output, where the renderings diverge and why
(bench/clis/divergence.py). Every answer is capped at --max-output-tokens on both servers by the proxy, which
lowers each request's budget (llama-server's -n is only a default that a request's max_tokens overrides): random
weights never stop on their own, and the proxy presents each budget-cut answer as one the model ended
(bench/natural_stop.py): the CLIs fail a turn whose answer hit its budget.

Servers:
  deltaserve   `python -m deltaserve serve` on the checkpoint, --accept-any-model-name, --max-output-tokens
  llama.cpp    llama-server (scripts/setup_llama_cpp.sh) on the checkpoint's GGUF, --jinja (the checkpoint's
               template; where it refuses a system message that is not first, a copy that renders it as a user
               turn, as deltaserve does: bench/clis/peer_template.py), one slot per
               session (-np), -n; its prompt cache as it ships
  llama.cpp-tuned  the same with its recurrent-state checkpoints raised (--llama-cpp-tuned-args)

Each server is measured in its own tokens: deltaserve's prompts are its own rendering of each body; llama-server's
are the prompts it ran, read off its /slots after each main request (bench/clis/own_tokens.py). The report says
what each server changes in a request before it renders it (NORMALISATIONS in bench/clis/report.py).
"""
from __future__ import annotations

import argparse
import signal
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

import httpx

from ...embedded.model import ensure_model
from ...text.tokenizer import load_tokenizer
from ..capture import Recorder, make_handler
from ..peers import PeerUnavailable
from ..peers.llama_cpp import LlamaServer, ensure_gguf
from ..serve import DeltaserveServer
from . import saved
from .own_tokens import ENV as SLOTS_ENV, SlotWatch
from .peer_template import write_peer_template
from ..progress import progress_for
from .clients import CLIENTS, MODEL
from .report import analyse, format_report

_say = progress_for("agents")
REPO = Path(__file__).resolve().parents[3]
FIRST = ["What files are in this directory? Answer in one line.", "Write a one-line haiku about caches.",
         "Name three prime numbers, one line.", "Say hello in French, one line.", "What is 2 + 2? One line.",
         "Name a colour, one word.", "Name a planet, one word.", "Name a fruit, one word."]
LATER = ["thanks, now say bye", "one more line, please", "and a last one"]
LLAMA_SERVERS = ("llama.cpp", "llama.cpp-tuned")
# a user who wants llama-server's prefix cache to serve agents raises its recurrent-state checkpoints: more of
# them a slot and closer together, so a hit can end nearer to where two prompts part
TUNED = "--ctx-checkpoints 64 --checkpoint-min-step 256"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="deltaserve bench agents", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--clients", default="claude,codex,qwen,opencode", help="comma-separated: " + ",".join(CLIENTS))
    ap.add_argument("--servers", default="deltaserve,llama.cpp,llama.cpp-tuned",
                    help="comma-separated: deltaserve, llama.cpp (as it ships), llama.cpp-tuned "
                         "(--llama-cpp-tuned-args)")
    ap.add_argument("--sessions", type=int, default=3)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--model", default="tiny", help="a model directory or a preset (default: the embedded tiny)")
    ap.add_argument("--max-output-tokens", type=int, default=16,
                    help="each answer's cap on both servers (short answers: a random model rarely completes a tool call)")
    ap.add_argument("--kv-cache-memory", default="2G", help="deltaserve's pool")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads of both servers (default: all)")
    ap.add_argument("--llama-cpp-type", default="bf16", help="the GGUF's weight type")
    ap.add_argument("--llama-cpp-ctx-per-slot", type=int, default=49152)
    ap.add_argument("--llama-cpp-tuned-args", default=TUNED,
                    help="llama-server's flags in the llama.cpp-tuned arm: its state checkpoints raised (as shipped: "
                         "at most 32 a slot, at least 8,192 tokens apart)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one CLI turn may take")
    ap.add_argument("--no-install", action="store_true", help="do not run scripts/setup_agents.sh for missing CLIs")
    ap.add_argument("--out", default=None, help="folder for the records and the report (default runs/agents-TIME)")
    return ap


class Metered:
    """A server behind the metering proxy: base is the proxy's URL, recorder.records what passed."""

    def __init__(self, upstream: str, out: Path, cap_output: int, after=None):
        self.recorder = Recorder(out)
        self._client = httpx.Client(timeout=httpx.Timeout(30.0, read=None), follow_redirects=False)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(upstream, self.recorder, self._client, True,
                                                                               cap_output, natural_stop=True,
                                                                               after=after))
        self._server.daemon_threads = True
        self.base = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._client.close()


def _start(server: str, model_dir: str, a, out: Path):
    log = str(out / f"{server}.log")
    if server == "deltaserve":
        engine = {"model": model_dir, "kv_cache_memory": a.kv_cache_memory, "num_threads": a.threads}
        return DeltaserveServer(engine, log, extra=("--served-model-name", MODEL, "--accept-any-model-name",
                                                    "--max-output-tokens", str(a.max_output_tokens)))
    gguf = ensure_gguf(model_dir, a.llama_cpp_type, log_path=log)
    threads = a.threads or os.cpu_count() or 1
    template = write_peer_template(model_dir, out)
    if template is not None:
        _say(f"llama-server: the model's chat template with a later system message rendered as a user turn "
             f"(as deltaserve does; as shipped it raises): {template}")
    tuned = tuple(a.llama_cpp_tuned_args.split()) if server == "llama.cpp-tuned" else ()
    return LlamaServer(gguf, ctx=a.sessions * a.llama_cpp_ctx_per_slot, slots=a.sessions, threads=threads,
                       log_path=log, env=SLOTS_ENV, extra=("--jinja", "-n", str(a.max_output_tokens),
                                            *(("--chat-template-file", str(template)) if template else ()), *tuned))


def _install(names: list[str], no_install: bool) -> list[str]:
    missing = [n for n in names if not CLIENTS[n].installed()]
    if missing and not no_install:
        script = REPO / "scripts" / "setup_agents.sh"
        if script.exists() and shutil.which("npm"):
            _say(f"installing the agent CLIs ({script})")
            subprocess.run(["bash", str(script)], check=False, stdout=subprocess.DEVNULL)
    for n in [n for n in names if not CLIENTS[n].installed()]:
        _say(f"{n}: not installed (scripts/setup_agents.sh); left out")
    return [n for n in names if CLIENTS[n].installed()]


def run_client(client, metered: Metered, a, folder: Path, metrics_base: str | None = None) -> list[dict]:
    """N sessions x K turns of one CLI through the metered server: one row per turn with its requests; with
    metrics_base (deltaserve's URL), the checkpoints each turn saved (bench/clis/saved.py)."""
    rows = []
    home_dir = str(folder / "home") if client.shares_home else None
    envs = {s: client.prepare(metered.base, str(folder / f"session{s}"), home_dir) for s in range(a.sessions)}
    for t in range(a.turns):
        for s in range(a.sessions):
            prompt = FIRST[s % len(FIRST)] if t == 0 else LATER[(t - 1) % len(LATER)]
            mark = len(metered.recorder.records)
            before = saved.read(metrics_base) if metrics_base else None
            t0 = time.monotonic()
            try:
                r = subprocess.run(client.argv(prompt, continued=t > 0), cwd=folder / f"session{s}" / "work",
                                   env=envs[s], capture_output=True, text=True, timeout=a.timeout)
                rc, err = r.returncode, r.stderr[-600:]
            except subprocess.TimeoutExpired:
                rc, err = "timeout", ""
            wall = time.monotonic() - t0
            requests = metered.recorder.records[mark:]
            rows.append({"client": client.name, "session": s, "turn": t, "rc": rc, "wall_s": round(wall, 2),
                         "stderr": err if rc != 0 else "", "requests": requests,
                         "checkpoints": saved.spent(before, saved.read(metrics_base)) if before else None})
            _say(f"{client.name} session {s} turn {t}: exit {rc}, {len(requests)} requests, {wall:.1f} s")
    return rows


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    # the servers run in their own sessions (a CLI's Ctrl-C must not reach them): a SIGTERM to this process must
    # still stop them, so it unwinds through the finally blocks that close them
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    names = [n.strip() for n in a.clients.split(",") if n.strip()]
    servers = [s.strip() for s in a.servers.split(",") if s.strip()]
    bad = [n for n in names if n not in CLIENTS] + [s for s in servers if s not in ("deltaserve", *LLAMA_SERVERS)]
    if bad or a.sessions < 1 or a.turns < 1:
        print(f"unknown clients/servers {bad} or fewer than one session/turn", file=sys.stderr)
        return 2
    names = _install(names, a.no_install)
    if not names:
        print("no agent CLI is installed: run scripts/setup_agents.sh", file=sys.stderr)
        return 2
    model_dir = a.model if os.path.isdir(a.model) else ensure_model(a.model)
    tok = load_tokenizer(model_dir)
    out = Path(a.out or f"runs/agents-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[dict]] = {}
    for server in servers:
        try:
            proc = _start(server, model_dir, a, out)
        except (PeerUnavailable, RuntimeError) as e:
            _say(f"{server}: left out: {e}")
            continue
        _say(f"{server}: up at {proc.base}")
        watch = SlotWatch(proc.base) if server in LLAMA_SERVERS else None
        metered = Metered(proc.base, out / server / "requests", a.max_output_tokens, watch and watch.after)
        try:
            for n in names:
                rows.setdefault(server, []).extend(run_client(CLIENTS[n], metered, a, out / server / n,
                                                              proc.base if server == "deltaserve" else None))
        finally:
            metered.close()
            proc.close()
            if watch:
                watch.close()
    result = analyse(rows, tok)
    text = format_report(result, vars(a) | {"model_dir": model_dir})
    (out / "report.md").write_text(text)
    slim = {s: [{k: v for k, v in r.items() if k != "requests"} | {"requests": len(r["requests"])} for r in rs]
            for s, rs in rows.items()}
    (out / "result.json").write_text(json.dumps({"args": vars(a), "turns": slim, "analysis": result}, indent=1))
    print(text)
    _say(f"report: {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
