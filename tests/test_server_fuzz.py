"""Fuzzing the server with malformed and hostile requests (hypothesis): never a 5xx, healthy after.

Default run: 1,000 mutated requests (most fail validation and never reach the model; the ones that
pass generate at most a few tokens), 150 valid requests with random sampling values that do reach the
model, and a set of hand-written hostile bodies. DELTASERVE_SLOW=1 multiplies the counts by 10.
"""
import json
import os
import sys

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the helpers beside this file
from server_support import RealServer

SLOW = os.environ.get("DELTASERVE_SLOW") == "1"
N_MUTATED = 10_000 if SLOW else 1_000
N_VALID = 1_500 if SLOW else 150
MODEL = "deltaserve/tiny"


@pytest.fixture(scope="module")
def server():
    srv = RealServer("--max-num-seqs", "16")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base, timeout=120) as c:
        yield c


def check(r: httpx.Response, stream: bool = False) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
    elif r.status_code == 200 and r.request.url.path.startswith("/v1/") and r.request.method == "POST":
        if stream:
            lines = [ln for ln in r.text.split("\n") if ln.startswith("data: ")]
            assert lines and lines[-1] == "data: [DONE]", r.text[-300:]
            for ln in lines[:-1]:
                assert "error" not in json.loads(ln[6:]), ln
        else:
            assert "choices" in r.json()


json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.integers(-3, 40),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30),
    st.sampled_from(["", "null", "auto", "required", "none", "text", "json_object", "json_schema", "function",
                     "user", "assistant", "tool", "system", "<tool_call>", "</think>", "\x00", "\ud7ff"]))
json_values = st.recursive(json_scalars, lambda kids: st.one_of(
    st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=12), kids, max_size=4)), max_leaves=12)

FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "min_p", "seed", "n", "stop", "stop_token_ids", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "logit_bias", "logprobs", "top_logprobs", "echo", "prompt_logprobs", "ignore_eos",
          "min_tokens", "cache_salt", "chat_template_kwargs", "response_format", "tools", "tool_choice",
          "parallel_tool_calls", "stream", "stream_options", "user"]
# Values that keep a request cheap if it validates: a generation is at most a few tokens.
BOUNDED = {
    "max_tokens": st.one_of(st.integers(-2, 3), st.integers(10**6, 10**12), st.sampled_from(["3", 2.5, True])),
    "max_completion_tokens": st.one_of(st.integers(-2, 3), st.sampled_from([10**9, "1", 1.5])),
    "n": st.one_of(st.integers(-1, 2), st.sampled_from([65, 10**6, "2", 1.0])),
    "min_tokens": st.one_of(st.integers(-2, 3), st.sampled_from([10**6, "1"])),
}


def message():
    return st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "developer", "bot"]),
                                  "content": st.one_of(st.text(max_size=40), json_values)},
                                 optional={"tool_call_id": st.text(max_size=8), "name": st.text(max_size=8),
                                           "tool_calls": json_values, "reasoning_content": st.text(max_size=10),
                                           "extra": json_values})


@st.composite
def mutated(draw):
    chat = draw(st.booleans())
    body: dict = ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2} if chat
                  else {"prompt": "hi", "max_tokens": 2})
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["set", "set", "set", "unknown", "delete", "messages"]))
        if op == "set":
            f = draw(st.sampled_from(FIELDS))
            body[f] = draw(BOUNDED[f]) if f in BOUNDED else draw(json_values)
        elif op == "unknown":
            body[draw(st.text(min_size=1, max_size=15))] = draw(json_values)
        elif op == "delete" and body:
            body.pop(draw(st.sampled_from(sorted(body, key=str))), None)
        elif op == "messages":
            body["messages"] = draw(st.lists(message(), max_size=3))
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 2  # a request that validates must stay short
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


@settings(max_examples=N_MUTATED, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(req=mutated())
def test_fuzz_mutated_requests(http, req):
    path, body = req
    stream = body.get("stream") is True
    r = http.post(path, content=json.dumps(body, allow_nan=True), headers={"content-type": "application/json"})
    check(r, stream)


@st.composite
def valid_sampling(draw):
    body = {"model": MODEL, "max_tokens": draw(st.integers(1, 3)), "n": draw(st.integers(1, 2))}
    opt = {
        "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 50),
        "min_p": st.floats(0, 1), "seed": st.integers(0, 2**31), "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0.5, 2),
        "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
        "stop_token_ids": st.lists(st.integers(0, 4095), max_size=3),
        "logit_bias": st.dictionaries(st.integers(0, 4095).map(str), st.floats(-100, 100), max_size=3),
        "ignore_eos": st.booleans(), "min_tokens": st.integers(0, 1), "cache_salt": st.text(min_size=1, max_size=5),
        "prompt_logprobs": st.integers(0, 3), "stream": st.booleans(),
    }
    for k, s in opt.items():
        if draw(st.booleans()):
            body[k] = draw(s)
    chat = draw(st.booleans())
    text = draw(st.text(min_size=1, max_size=60))
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
        if draw(st.booleans()):
            body["logprobs"] = True
            body["top_logprobs"] = draw(st.integers(0, 20))
    else:
        body["prompt"] = draw(st.one_of(st.just(text), st.lists(st.integers(0, 4095), min_size=1, max_size=30)))
        if draw(st.booleans()):
            body["logprobs"] = draw(st.integers(0, 5))
        body["echo"] = draw(st.booleans())
    if body.get("stream") and draw(st.booleans()):
        body["stream_options"] = {"include_usage": True}
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


@settings(max_examples=N_VALID, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(req=valid_sampling())
def test_fuzz_valid_sampling_reaches_model(http, req):
    path, body = req
    r = http.post(path, json=body)
    if r.status_code == 400:  # only the text prompt may legitimately be refused (it can tokenize to nothing)
        assert body.get("prompt") is not None and r.json()["error"]["code"] == "empty_prompt", r.text
        return
    assert r.status_code == 200, r.text[:500]
    check(r, bool(body.get("stream")))


HOSTILE = [
    (b"", "application/json"), (b"null", "application/json"), (b"[]", "application/json"),
    (b'"prompt"', "application/json"), (b"{" * 100_000, "application/json"), (b"[" * 50_000 + b"]" * 50_000, None),
    (b'{"prompt": "x"', "application/json"), (b"\xff\xfe\x00garbage", "application/json"),
    (b'{"prompt": "hi", "max_tokens": 2}', "text/plain"), (b'{"prompt": "hi", "max_tokens": 2}', None),
    (b'prompt=hi', "application/x-www-form-urlencoded"),
    (json.dumps({"prompt": "a" * 300_000, "max_tokens": 2}).encode(), "application/json"),
    (json.dumps({"prompt": [1] * 200_000, "max_tokens": 2}).encode(), "application/json"),
    (json.dumps({"prompt": ["hi"] * 70, "max_tokens": 1}).encode(), "application/json"),
    (b'{"prompt": "hi", "max_tokens": 1e999}', "application/json"),
    (b'{"prompt": "hi", "temperature": NaN}', "application/json"),
    (b'{"prompt": "hi", "prompt": "dup", "max_tokens": 1}', "application/json"),
    (json.dumps({"messages": [{"role": "user", "content": "{{ 7*7 }}{% for x in range(10**9) %}"}],
                 "max_tokens": 1}).encode(), "application/json"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                 "chat_template_kwargs": {"enable_thinking": {"a": [1] * 1000}}}).encode(), "application/json"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}}).encode(), None),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "response_format": {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(((("}}}}).encode(),
     None),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "tool_choice": "required",
                 "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                     "type": "object", "properties": {"p": {"type": "string", "pattern": "[[["}}}}}]}).encode(),
     None),
]


def test_hostile_bodies(http, server):
    for body, ctype in HOSTILE:
        for path in ("/v1/completions", "/v1/chat/completions"):
            headers = {"content-type": ctype} if ctype else {}
            r = http.post(path, content=body, headers=headers)
            check(r)
    for method, path in [("GET", "/v1/completions"), ("PUT", "/v1/chat/completions"), ("DELETE", "/v1/models"),
                         ("POST", "/health"), ("GET", "/v1/../../etc/passwd"), ("GET", "/%00")]:
        check(http.request(method, path))
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "after the storm", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_healthy_and_idle_after(http):
    assert http.get("/health").status_code == 200
    text = http.get("/metrics").text
    vals = {ln.split("{")[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
            if ln and not ln.startswith("#")}
    assert vals["deltaserve_pages_in_use"] == 0 and vals["deltaserve_gdn_slots_in_use"] == 0
