"""Recorded Claude Code traffic through the real engine: what the prefix cache serves each request.

Session A (tests/fixtures/agents/claude-code-3, then -4: a tool_use and its tool_result appended) and session
B (claude-code-5, then -6: resumed with `-c`), another first prompt and another billing line, on the embedded
model through /v1/messages as Claude Code sent them (max_tokens lowered to one token: only the prompt is
measured). The counts are exact: B's first request reads every token it shares with A (the tools, the whole
system text and the first user message up to the typed prompt) rounded down to the checkpoint grid, and a
continued turn reads its previous prompt rounded down to the 64-token grid of the runs layout.
"""
import json
import os
import sys

import httpx
import pytest

from deltaserve.config import EngineConfig
from deltaserve.server import build_app
from deltaserve.server.anthropic.input import messages_spec
from deltaserve.server.anthropic.protocol import MessagesRequest
from deltaserve.server.chat_spec import render_prompt
from deltaserve.text.tokenizer import load_tokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server_support import InProcessServer, wait_healthy

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "agents")
PAGE = 64  # the runs layout's page (the default layout): a hit lands on its grid
CHECKPOINT_GRID = 128  # --checkpoint-grid's default: where a first prompt leaves checkpoints for other sessions


def body(n: int) -> dict:
    with open(os.path.join(FIXTURES, f"claude-code-{n}.json")) as f:
        return {**json.load(f)["body"], "stream": False, "max_tokens": 1}


@pytest.fixture(scope="module")
def served():
    srv = InProcessServer(build_app(EngineConfig(), accept_any_model_name=True))
    wait_healthy(srv.base, timeout=240)
    yield srv
    srv.stop()


def usage(srv, n: int) -> dict:
    r = httpx.post(f"{srv.base}/v1/messages", json=body(n), timeout=600)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_claude_code_sessions_read_what_they_share_from_the_cache(served):
    tok = load_tokenizer(None)  # the embedded model's, which the server renders with
    a1, b1, a2, b2 = (tok.encode(render_prompt(tok, messages_spec(MessagesRequest.model_validate(body(n)))))
                      for n in (3, 5, 4, 6))
    user = tok.encode("<|im_start|>user")
    system = next(i for i in range(len(a1)) if a1[i:i + len(user)] == user)  # the tools and the system text
    common = next(i for i, (x, y) in enumerate(zip(a1, b1)) if x != y)
    assert common > system > 15000  # then the first user message up to the typed prompt
    assert a1 == a2[:len(a1)] and b1 == b2[:len(b1)]  # each turn renders as the prefix of the next

    u = usage(served, 3)
    assert u["cache_read_input_tokens"] == 0 and u["input_tokens"] == len(a1)
    u = usage(served, 5)  # session B's first request: all it shares with A, on the checkpoint grid
    assert u["cache_read_input_tokens"] == common // CHECKPOINT_GRID * CHECKPOINT_GRID >= system
    assert u["cache_read_input_tokens"] + u["input_tokens"] == len(b1)
    for prev, n, now in ((a1, 4, a2), (b1, 6, b2)):  # continued turns: the whole previous prompt, on the page grid
        u = usage(served, n)
        assert u["cache_read_input_tokens"] == len(prev) // PAGE * PAGE >= 0.95 * len(prev)
        assert u["cache_read_input_tokens"] + u["input_tokens"] == len(now)


def test_the_system_prefix_is_checkpointed_without_the_grid():
    """With the checkpoint grid off (as under a full pool, where grid checkpoints are not taken), session B's first
    request still reads the tools and the whole system text: the route hints the end of the system prefix
    (system_prefix_end) and the engine checkpoints it (SaveKind.HINT) on the page grid."""
    from deltaserve.server.chat_spec import system_prefix_end

    tok = load_tokenizer(None)
    spec_a = messages_spec(MessagesRequest.model_validate(body(3)))
    a1 = tok.encode(render_prompt(tok, spec_a))
    user = tok.encode("<|im_start|>user")
    system = next(i for i in range(len(a1)) if a1[i:i + len(user)] == user)
    end = system_prefix_end(tok, spec_a, a1)
    assert system < end <= system + 4  # the user turn's opening tokens are shared too
    srv = InProcessServer(build_app(EngineConfig(checkpoint_grid=0), accept_any_model_name=True))
    try:
        wait_healthy(srv.base, timeout=240)
        assert usage(srv, 3)["cache_read_input_tokens"] == 0
        u = usage(srv, 5)
        assert u["cache_read_input_tokens"] == end // PAGE * PAGE >= system - PAGE
        metrics = httpx.get(f"{srv.base}/metrics", timeout=30).text
        saved = [ln for ln in metrics.splitlines() if ln.startswith('deltaserve_checkpoints_saved_by_kind_total{kind="hint"')]
        assert len(saved) == 1 and saved[0].endswith(" 1.0"), saved
    finally:
        srv.stop()
