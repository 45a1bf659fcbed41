"""Images over the three APIs against a real server: a small multimodal model (the tiny preset's text model
with the Qwen3.5 vocabulary and tokenizer, whose chat template renders an image as
<|vision_start|><|image_pad|><|vision_end|>, and a small vision tower).

Chat Completions image_url (data URLs; a remote URL is a 400), Responses input_image, Anthropic image blocks
(base64), images inside tool results; --limit-mm-per-prompt (17 images over a limit of 16 is a 400 naming
it); malformed base64 a 400; nothing held after the refusals; a conversation re-sent with a new turn hits the
prefix cache past its images."""
from __future__ import annotations

import base64
import json
import os
import sys

import httpx
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server_support import RealServer
from util import png, qwen35_dir

VISION = {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "out_hidden_size": 256,
          "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2, "num_position_embeddings": 64,
          "in_channels": 3, "hidden_act": "gelu_pytorch_tanh"}
PROCESSOR = {"patch_size": 4, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3,
             "image_std": [0.5] * 3, "size": {"shortest_edge": 64, "longest_edge": 64 * 64}}
LIMIT = '{"image": 16, "video": 0}'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from deltaserve.embedded.model import write_preset_tokenizer
    from deltaserve.model.make import make_random_model
    from deltaserve.presets import text_preset

    qwen35_dir()  # skips where the Qwen3.5 tokenizer's sources cannot be fetched
    path = tmp_path_factory.mktemp("qwen35-vl-small")
    write_preset_tokenizer(True, str(path))
    text = text_preset("tiny")
    text.update(vocab_size=248320, eos_token_id=248046)
    make_random_model({"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
                       "text_config": text, "vision_config": VISION, "image_token_id": 248056,
                       "video_token_id": 248057, "vision_start_token_id": 248053, "vision_end_token_id": 248054,
                       "tie_word_embeddings": True, "dtype": "bfloat16"}, str(path))
    with open(path / "preprocessor_config.json", "w") as f:
        json.dump(PROCESSOR, f)
    srv = RealServer("--model", str(path), "--seed", "0", "--limit-mm-per-prompt", LIMIT, "--max-num-seqs", "4",
                     "--accept-any-model-name")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.base, timeout=300) as c:
        yield c


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def url(raw: bytes) -> str:
    return "data:image/png;base64," + b64(raw)


def chat(client, content, **kw):
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0, **kw}
    return client.post("/v1/chat/completions", json=body)


def held(client) -> float:
    text = client.get("/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")))


def test_chat_image_url(client):
    r = chat(client, [{"type": "text", "text": "What is in"}, {"type": "image_url", "image_url": {"url": url(png(448, 448, 1))}},
                      {"type": "text", "text": "this picture?"}])
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    assert u["completion_tokens"] == 4 and u["prompt_tokens"] > 64  # the placeholder widened to 8 x 8 tokens


def test_chat_next_turn_hits_past_the_images(client):
    imgs = [url(png(448, 448, 2)), url(png(97, 203, 3))]
    first = [{"type": "text", "text": "Compare " * 60}, {"type": "image_url", "image_url": {"url": imgs[0]}},
             {"type": "text", "text": "with"}, {"type": "image_url", "image_url": {"url": imgs[1]}}]
    r1 = client.post("/v1/chat/completions", json={"model": "m", "max_tokens": 4, "temperature": 0,
                                                   "messages": [{"role": "user", "content": first}]})
    assert r1.status_code == 200, r1.text
    answer = r1.json()["choices"][0]["message"]["content"] or "ok"
    msgs = [{"role": "user", "content": first}, {"role": "assistant", "content": answer},
            {"role": "user", "content": "And now?"}]
    r2 = client.post("/v1/chat/completions", json={"model": "m", "max_tokens": 4, "temperature": 0, "messages": msgs})
    assert r2.status_code == 200, r2.text
    assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 128  # past both images (block 128)


def test_chat_refusals(client):
    remote = chat(client, [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}])
    assert remote.status_code == 400 and "remote image URLs" in remote.text
    bad = chat(client, [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}])
    assert bad.status_code == 400 and "base64" in bad.text
    many = chat(client, [{"type": "image_url", "image_url": {"url": url(png(16, 16, k))}} for k in range(17)])
    assert many.status_code == 400 and "at most 16 images" in many.text and "limit-mm-per-prompt" in many.text
    system = client.post("/v1/chat/completions", json={"model": "m", "max_tokens": 2, "messages": [
        {"role": "system", "content": [{"type": "image_url", "image_url": {"url": url(png(16, 16, 0))}}]},
        {"role": "user", "content": "hi"}]})
    assert system.status_code == 400
    assert held(client) == 0
    assert chat(client, "still fine").status_code == 200


def test_chat_image_in_tool_result(client):
    msgs = [{"role": "user", "content": "Take a screenshot"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "screenshot", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": [
                {"type": "text", "text": "here:"}, {"type": "image_url", "image_url": {"url": url(png(64, 64, 5))}}]}]
    r = client.post("/v1/chat/completions", json={"model": "m", "max_tokens": 3, "temperature": 0, "messages": msgs})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 64


def test_responses_input_image(client):
    body = {"model": "m", "max_output_tokens": 3, "temperature": 0, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Describe"},
                                     {"type": "input_image", "image_url": url(png(97, 203, 6))}]}]}
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens"] > 55
    bad = client.post("/v1/responses", json={**body, "input": [{"role": "user", "content": [
        {"type": "input_image", "file_id": "file-1"}]}]})
    assert bad.status_code == 400 and "file_id" in bad.text


def test_anthropic_image_blocks(client):
    img = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(png(250, 40, 7))}}
    body = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": [img, {"type": "text", "text": "What?"}]}]}
    r = client.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens"] > 60
    tool = {"model": "m", "max_tokens": 3, "messages": [
        {"role": "user", "content": "Look"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [img]}]}]}
    assert client.post("/v1/messages", json=tool).status_code == 200
    remote = {**body, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://example.com/x.png"}}]}]}
    r = client.post("/v1/messages", json=remote)
    assert r.status_code == 400 and "network" in r.text
    broken = {**body, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "!!notbase64!!"}}]}]}
    r = client.post("/v1/messages", json=broken)
    assert r.status_code == 400 and "base64" in r.text
    assert held(client) == 0
