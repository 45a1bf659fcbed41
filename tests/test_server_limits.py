"""Oversized requests: the body limit (413 before the body is read whole, in each API's error shape), prompts
refused from their length or a capped count, and small requests answered beside a long one (tokenizing and
template rendering run off the event loop). Over the fake engine (its context: --max-model-len, 2048 here)."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from deltaserve.config import EngineConfig
from deltaserve.server import build_app
from deltaserve.server.limits import (CHUNK_CHARS, TokenBounds, check_prompt, count_pieces, default_max_request_bytes,
                                      min_tokens, token_bounds)
from deltaserve.text.tokenizer import load_tokenizer
from server_support import FakeEngine, InProcessServer

LIMIT = 256 << 10
CONTEXT = 2048
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
MESSAGES = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
RESPONSES = {"model": "m", "input": "hi", "max_output_tokens": 2}
APIS = [("/v1/chat/completions", CHAT), ("/v1/messages", MESSAGES), ("/v1/responses", RESPONSES)]


def _with_text(body: dict, text: str) -> dict:
    if "input" in body:
        return {**body, "input": text}
    return {**body, "messages": [{"role": "user", "content": text}]}


@pytest.fixture(scope="module")
def server():
    app = build_app(EngineConfig(max_model_len=CONTEXT), engine_factory=FakeEngine, served_model_name="m",
                    max_request_bytes=LIMIT)
    s = InProcessServer(app)
    deadline = time.time() + 60
    while httpx.get(s.base + "/health").status_code != 200:
        assert time.time() < deadline
        time.sleep(0.05)
    yield s
    s.stop()


def _assert_413(r: httpx.Response, path: str) -> None:
    assert r.status_code == 413, r.text
    body = r.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["type"] == "request_too_large"
        msg = body["error"]["message"]
    else:
        assert body["error"]["code"] == "request_too_large" and body["error"]["type"] == "invalid_request_error"
        msg = body["error"]["message"]
    assert str(LIMIT) in msg and "--max-request-bytes" in msg


@pytest.mark.parametrize("path,body", APIS)
@pytest.mark.parametrize("stream", [False, True])
def test_declared_body_over_the_limit_is_413_before_it_is_read(server, path, body, stream):
    sent = []

    def chunks():  # a body far over the limit, with its length declared up front
        head = json.dumps({**_with_text(body, ""), "stream": stream})[:-1].encode()
        yield head
        for _ in range(64):
            sent.append(1)
            yield b" " * (64 << 10)
    size = len(json.dumps({**_with_text(body, ""), "stream": stream})[:-1]) + 64 * (64 << 10)
    t = time.monotonic()
    r = httpx.post(server.base + path, content=chunks(), headers={"content-length": str(size),
                                                                    "content-type": "application/json"}, timeout=30)
    assert time.monotonic() - t < 5
    _assert_413(r, path)
    assert str(size) in r.text  # the declared size is named
    assert len(sent) < 64  # answered before the client had sent it all


@pytest.mark.parametrize("path,body", APIS)
def test_chunked_body_over_the_limit_is_413_as_it_grows(server, path, body):
    sent = []

    def chunks():  # no Content-Length: counted as it arrives
        yield json.dumps(_with_text(body, ""))[:-1].encode()
        for _ in range(256):
            sent.append(1)
            yield b" " * (16 << 10)
    r = httpx.post(server.base + path, content=chunks(), headers={"content-type": "application/json"}, timeout=30)
    _assert_413(r, path)
    assert len(sent) < 256


@pytest.mark.parametrize("path,body", APIS)
@pytest.mark.parametrize("stream", [False, True])
def test_text_that_cannot_fit_is_refused_at_once(server, path, body, stream):
    text = "word " * (LIMIT // 6)  # under the body limit, far past the 2048-token context
    t = time.monotonic()
    r = httpx.post(server.base + path, json={**_with_text(body, text), "stream": stream}, timeout=30)
    assert time.monotonic() - t < 1.0
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "maximum context length is 2048 tokens" in err["message"]
    if not path.startswith("/v1/messages"):
        assert err["code"] == "context_length_exceeded"


def test_small_requests_are_answered_beside_a_long_one(server):
    """A prompt that fits the body limit but takes the tokenizer a while (counted piece by piece) does not hold up
    small requests on the three APIs: each answers within a fixed multiple of its time alone."""
    alone = {}
    for path, body in APIS:
        t = time.monotonic()
        assert httpx.post(server.base + path, json=body, timeout=30).status_code == 200
        alone[path] = time.monotonic() - t
    big_done = threading.Event()
    big_status = []

    def big():
        # dense unicode: many tokens per character, so the length bound alone cannot refuse it
        text = "\u4e00\u9fff\U0001f600" * (LIMIT // 40)
        for path, body in APIS:
            r = httpx.post(server.base + path, json=_with_text(body, text), timeout=60)
            big_status.append(r.status_code)
        big_done.set()
    th = threading.Thread(target=big)
    th.start()
    beside = {}
    try:
        while not big_done.is_set():
            for path, body in APIS:
                t = time.monotonic()
                assert httpx.post(server.base + path, json=body, timeout=30).status_code == 200
                beside[path] = max(beside.get(path, 0.0), time.monotonic() - t)
    finally:
        th.join(60)
    assert big_status == [400, 400, 400]
    for path in alone:
        assert beside.get(path, 0.0) < max(20 * alone[path], 1.0), (path, alone[path], beside.get(path))


def test_length_bound_is_a_lower_bound_on_the_token_count():
    tok = load_tokenizer(None)
    b = token_bounds(tok)
    assert b is not None and b.max_chars_per_token >= 1
    for text in ["hello world " * 50, "=" * 5000, " " * 5000, "\u00e9t\u00e9 " * 300, "e\u0301" * 500,
                 "<|im_start|>" * 100, "\u4e00" * 1000]:
        assert min_tokens(text, b) <= len(tok.encode(text)), text[:20]


def test_piecewise_count_stops_at_the_context_and_matches_short_texts():
    tok = load_tokenizer(None)
    text = "line of text\n" * (CHUNK_CHARS // 4)
    n, at = count_pieces(tok, text, stop_at=1000)
    assert n >= 1000 and at < len(text)
    whole = "some code:\n  x = 1\n" * 100
    assert count_pieces(tok, whole)[0] == len(tok.encode(whole))
    with pytest.raises(ValueError, match="context_length|maximum context length"):
        check_prompt(tok, text, 1000, None)


def test_default_limit_grows_with_the_context_and_leaves_room_for_an_image():
    b = TokenBounds(16, 5.5, "NFC")
    small, big = default_max_request_bytes(4096, b, False), default_max_request_bytes(262144, b, False)
    assert small < big and big >= 262144 * 5.5
    assert default_max_request_bytes(262144, b, True) - big >= 4 * (20 << 20) // 3
