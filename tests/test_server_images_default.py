"""Images on the embedded default model (`make serve`: the tiny preset, whose small vision tower and image
tokens let it take images): one real server with no --model, answering an image request on each API, token
counting that counts an image as its real placeholder tokens, and a re-sent image hitting the prefix cache
with the same tokens and logprobs as its cold run."""
from __future__ import annotations

import base64
import os
import sys

import httpx
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server_support import RealServer
from util import png

# Qwen3.5's processor (the tiny preset has no preprocessor_config.json): 448x448 is 28 x 28 patches of 16,
# 14 x 14 = 196 tokens after the 2 x 2 merge; 97x203 is scaled up past the 65,536-pixel floor to 192x384,
# 6 x 12 = 72 tokens
TOKENS_448, TOKENS_97x203 = 196, 72


@pytest.fixture(scope="module")
def server():
    srv = RealServer("--seed", "0", "--max-num-seqs", "4", "--accept-any-model-name")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.base, timeout=300) as c:
        yield c


def url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def anthropic_image(raw: bytes) -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                        "data": base64.b64encode(raw).decode()}}


def chat_body(content, **kw) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0,
            **kw}


def test_chat_completions_image(client):
    r = client.post("/v1/chat/completions", json=chat_body(
        [{"type": "text", "text": "What is in"}, {"type": "image_url", "image_url": {"url": url(png(448, 448, 1))}}]))
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    assert u["completion_tokens"] == 4 and u["prompt_tokens"] > TOKENS_448


def test_responses_input_image(client):
    r = client.post("/v1/responses", json={"model": "m", "max_output_tokens": 3, "temperature": 0, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Describe"},
                                     {"type": "input_image", "image_url": url(png(97, 203, 2))}]}]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens"] > TOKENS_97x203


def test_anthropic_image_block_and_count_tokens(client):
    """count_tokens counts the image as its 196 placeholder tokens (plus <|vision_start|> and <|vision_end|>),
    and equals what the request itself then reports as its prompt (nothing of it cached yet)."""
    img = png(448, 448, 3)
    text = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hm?"}]}]}
    body = {**text, "messages": [{"role": "user", "content": [anthropic_image(img), {"type": "text", "text": "Hm?"}]}]}
    n_text = client.post("/v1/messages/count_tokens", json=text).json()["input_tokens"]
    r = client.post("/v1/messages/count_tokens", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["input_tokens"] == n_text + 2 + TOKENS_448
    m = client.post("/v1/messages", json={**body, "max_tokens": 3})
    assert m.status_code == 200, m.text
    u = m.json()["usage"]
    assert u["input_tokens"] + u["cache_read_input_tokens"] == r.json()["input_tokens"]
    tool = {"model": "m", "max_tokens": 3, "messages": [
        {"role": "user", "content": "Look"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [anthropic_image(img)]}]}]}
    assert client.post("/v1/messages", json=tool).status_code == 200
    broken = {**text, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "aGVsbG8="}}]}]}
    r = client.post("/v1/messages/count_tokens", json=broken)
    assert r.status_code == 400 and "not a readable image" in r.text


def test_tokenize_counts_images_as_the_chat_request_runs_them(client):
    content = [{"type": "image_url", "image_url": {"url": url(png(97, 203, 4))}}, {"type": "text", "text": "and"},
               {"type": "image_url", "image_url": {"url": url(png(448, 448, 4))}}]
    t = client.post("/tokenize", json={"model": "m", "messages": [{"role": "user", "content": content}]})
    assert t.status_code == 200, t.text
    tokens = t.json()["tokens"]
    assert tokens.count(188) == TOKENS_97x203 + TOKENS_448 and t.json()["count"] == len(tokens)
    r = client.post("/v1/chat/completions", json=chat_body(content))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(tokens)


def mm_cache(client) -> tuple[float, float]:
    """(vllm:mm_cache_queries_total, vllm:mm_cache_hits_total): the processed-image cache, in images."""
    got = {}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(("vllm:mm_cache_queries_total", "vllm:mm_cache_hits_total")):
            got[line.split("{")[0]] = float(line.split()[-1])
    return got["vllm:mm_cache_queries_total"], got["vllm:mm_cache_hits_total"]


def test_resent_image_hits_with_the_cold_bits(client):
    """The same images sent again: the prefix cache serves past them, and the tokens and logprobs are those
    of the cold run; the processed-image cache served both images of the second request (/metrics)."""
    content = [{"type": "text", "text": "Compare " * 40}, {"type": "image_url", "image_url": {"url": url(png(448, 448, 5))}},
               {"type": "text", "text": "with"}, {"type": "image_url", "image_url": {"url": url(png(250, 300, 6))}}]
    body = chat_body(content, max_tokens=8, logprobs=True, top_logprobs=3)
    q0, h0 = mm_cache(client)
    cold = client.post("/v1/chat/completions", json=body).json()
    q1, h1 = mm_cache(client)
    hit = client.post("/v1/chat/completions", json=body).json()
    assert (q1 - q0, h1 - h0) == (2, 0) and mm_cache(client) == (q1 + 2, h1 + 2)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256  # past both images (blocks of 128)
    assert hit["choices"][0]["logprobs"] == cold["choices"][0]["logprobs"]
    assert hit["choices"][0]["message"] == cold["choices"][0]["message"]
