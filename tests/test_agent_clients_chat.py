"""Qwen Code's and opencode's recorded Chat Completions requests (tests/fixtures/agents) replayed through the app.

Both ask for max_tokens 32,000 whatever the prompt and stream with usage; each recorded body is answered 200,
streamed and whole, and parses with the official SDK's types. A fake engine (no model) with a context larger
than the prompts answers, so the test is about the server's edge, not the model.
"""
from __future__ import annotations

import glob
import json
import os

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from server_support import FakeEngine, InProcessServer, wait_healthy

from deltaserve.config import EngineConfig
from deltaserve.server import build_app

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "agents")
CHAT_BODIES = sorted(glob.glob(os.path.join(FIXTURES, "qwen-code-*.json")) +
                     glob.glob(os.path.join(FIXTURES, "opencode-*.json")))
CONTEXT = 1 << 18  # real Qwen3.5's 262,144
SAYS = 6  # tokens the fake model writes before its budget is spent


class LongContextEngine(FakeEngine):
    """The fake engine with a real model's context; it stops after SAYS tokens (the budget the server clamped
    to what is left of the context is checked first)."""

    def __init__(self, config=None):
        super().__init__(config)
        self.budgets: list[int] = []

    def add_request(self, request_id, prompt, params, cache_salt=None, arrival_time=None):
        super().add_request(request_id, prompt, params, cache_salt, arrival_time)
        live = self._live[request_id]
        self.budgets.append(live["params"].max_tokens)
        assert len(live["ids"]) + live["params"].max_tokens <= CONTEXT
        live["params"].max_tokens = min(live["params"].max_tokens, SAYS)


@pytest.fixture(scope="module")
def server():
    engines = []

    def factory(cfg):
        engines.append(LongContextEngine(cfg))
        return engines[0]

    srv = InProcessServer(build_app(EngineConfig(max_model_len=CONTEXT), engine_factory=factory,
                                    served_model_name=["deltaserve"]))
    wait_healthy(srv.base, 30)
    srv.engines = engines
    yield srv
    srv.stop()


def _body(path: str) -> dict:
    with open(path) as f:
        return json.load(f)["body"]


def test_every_client_sent_what_we_replay():
    names = {os.path.basename(p).split("-")[0] for p in CHAT_BODIES}
    assert names == {"qwen", "opencode"} and len(CHAT_BODIES) >= 8


@pytest.mark.parametrize("path", CHAT_BODIES, ids=os.path.basename)
def test_recorded_request_is_served_streamed(server, path):
    body = _body(path)
    assert body["max_tokens"] >= 32000 and body["stream"] is True  # what the clients send, as recorded
    chunks = []
    with httpx.stream("POST", server.base + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(ChatCompletionChunk.model_validate(json.loads(line[6:])))
    assert chunks and chunks[-1].usage is not None  # stream_options.include_usage
    assert chunks[-1].usage.completion_tokens == SAYS
    assert server.engines[0].budgets[-1] == body["max_tokens"]  # it fits this context: it reaches the engine as sent


@pytest.mark.parametrize("path", CHAT_BODIES, ids=os.path.basename)
def test_recorded_request_is_served_whole(server, path):
    body = {k: v for k, v in _body(path).items() if k not in ("stream", "stream_options")}
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0)
    out = client.chat.completions.create(**body)
    assert isinstance(out, ChatCompletion) and out.model == "deltaserve"
    assert out.usage.completion_tokens == SAYS and out.choices[0].finish_reason == "length"
