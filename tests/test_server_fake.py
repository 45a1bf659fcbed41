"""Server mechanics the real engine cannot be made to show on demand, on a fake engine in-process:
503 while loading, Bearer auth, a failing engine step that the server survives."""
import json
import os
import sys
import threading
import time

import httpx
import openai
import pytest

from deltaserve.config import EngineConfig
from deltaserve.server import build_app
from deltaserve.text.tokenizer import load_tokenizer
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the helpers beside this file
from server_support import FakeEngine, InProcessServer


@pytest.fixture(scope="module")
def slow_server():
    gate = threading.Event()

    def factory(cfg):
        gate.wait(30)
        return FakeEngine(cfg)

    srv = InProcessServer(build_app(EngineConfig(), api_key="sekret", engine_factory=factory))
    srv.gate = gate
    yield srv
    gate.set()
    srv.stop()


def test_503_until_ready_then_auth(slow_server):
    base = slow_server.base
    h = {"Authorization": "Bearer sekret"}
    r = httpx.get(base + "/health")
    assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
    r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=h)
    assert r.status_code == 503 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    slow_server.gate.set()
    deadline = time.time() + 30
    while httpx.get(base + "/health").status_code != 200:
        assert time.time() < deadline
        time.sleep(0.05)
    # auth
    assert httpx.post(base + "/v1/completions", json={"prompt": "hi"}).status_code == 401
    assert httpx.post(base + "/v1/completions", json={"prompt": "hi"},
                      headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(base + "/v1/models").status_code == 401
    client = openai.OpenAI(base_url=base + "/v1", api_key="sekret", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="nope", max_retries=0).models.list()
    assert client.models.list().data[0].id == "deltaserve/tiny"
    out = client.completions.create(model="deltaserve/tiny", prompt="hello", max_tokens=3)
    assert len(out.choices[0].text) > 0 and out.usage.completion_tokens == 3
    assert httpx.get(base + "/health").status_code == 200  # no auth on /health and /metrics
    assert httpx.get(base + "/metrics").status_code == 200


@pytest.fixture(scope="module")
def fake():
    srv = InProcessServer(build_app(EngineConfig(), engine_factory=FakeEngine, served_model_name=["a", "b"]))
    from server_support import wait_healthy
    wait_healthy(srv.base, 30)
    yield srv
    srv.stop()


def test_step_failure_is_contained(fake):
    client = openai.OpenAI(base_url=fake.base + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model="a", prompt="FAIL_STEP now", max_tokens=3)
    # the server goes on serving
    out = client.completions.create(model="b", prompt="hello", max_tokens=4)
    assert out.usage.completion_tokens == 4 and out.model == "a"
    assert httpx.get(fake.base + "/health").status_code == 200


def test_step_failure_midstream(fake):
    r = httpx.post(fake.base + "/v1/completions", json={"prompt": "FAIL_STEP", "max_tokens": 3, "stream": True})
    assert r.status_code == 200
    events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])


def test_forced_tool_call_plumbing(fake):
    client = openai.OpenAI(base_url=fake.base + "/v1", api_key="x", max_retries=0)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["city", "days"]}}}]
    r = client.chat.completions.create(model="a", messages=[{"role": "user", "content": "weather?"}], tools=tools,
                                       tool_choice="required", max_tokens=200, temperature=0)
    call = r.choices[0].message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and args["city"] in ("Paris", "Oslo") and 1 <= args["days"] <= 9
    assert r.choices[0].finish_reason == "tool_calls"


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
SCRIPTED = ("<think>plan: call the tool</think>\n\nChecking. <tool_call>\n<function=get_weather>\n"
            "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


def _stream(client, **kw):
    content, reasoning, calls, finish = "", "", {}, None
    for ch in client.chat.completions.create(stream=True, **kw):
        for c in ch.choices:
            finish = c.finish_reason or finish
            content += c.delta.content or ""
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            for d in c.delta.tool_calls or []:
                e = calls.setdefault(d.index, {"name": "", "arguments": ""})
                if d.function is not None:
                    e["name"] += d.function.name or ""
                    e["arguments"] += d.function.arguments or ""
    return content, reasoning, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("text, reasoning, content, calls", [
    (SCRIPTED, "plan: call the tool", "Checking.", [("get_weather", {"city": "Paris", "days": 3})]),
    ("<think>hmm</think>\n\nplain answer", "hmm", "plain answer", []),
    ("no tags at all", None, "no tags at all", []),
    ("Sure <tool_call>\n<function=get_weather>\n<parameter=city>\nRome", None,
     "Sure <tool_call>\n<function=get_weather>\n<parameter=city>\nRome", []),  # malformed: content
])
def test_reasoning_and_auto_tool_parsing_end_to_end(fake, text, reasoning, content, calls):
    client = openai.OpenAI(base_url=fake.base + "/v1", api_key="x", max_retries=0)
    kw = dict(model="a", messages=[{"role": "user", "content": f"SCRIPT<<{text}|||"}], tools=[WEATHER],
              max_tokens=200)
    r = client.chat.completions.create(**kw)
    m = r.choices[0].message
    assert (m.model_extra or {}).get("reasoning_content") == reasoning
    assert (m.content or "") == content
    got = [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []]
    assert got == calls
    assert r.choices[0].finish_reason == ("tool_calls" if calls else "stop")
    s_content, s_reasoning, s_calls, s_finish = _stream(client, **kw)
    assert s_content == content and s_reasoning == (reasoning or "")
    assert [(c["name"], json.loads(c["arguments"])) for c in s_calls] == calls
    assert s_finish == r.choices[0].finish_reason


def _chat_lp_text(client, stream: bool, **kw) -> tuple[str, str, int]:
    """(content, the logprob entries' tokens joined, how many entries) of one chat choice."""
    if not stream:
        ch = client.chat.completions.create(logprobs=True, top_logprobs=2, **kw).choices[0]
        entries = ch.logprobs.content
        return ch.message.content or "", "".join(e.token for e in entries), len(entries)
    content, tokens, n = "", "", 0
    for chunk in client.chat.completions.create(logprobs=True, top_logprobs=2, stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for e in (ch.logprobs.content if ch.logprobs is not None else None) or []:
                tokens, n = tokens + e.token, n + 1
    return content, tokens, n


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_tokens_join_to_the_content(fake, stream):
    """A special token the content skips (<|im_start|> forced by logit_bias, the closing <|im_end|>) is "" in the
    logprobs too, one entry per generated token still; with skip_special_tokens false both show it."""
    client = openai.OpenAI(base_url=fake.base + "/v1", api_key="x", max_retries=0)
    tok = load_tokenizer(None)
    im_start, im_end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    assert {im_start, im_end} <= tok.special_token_ids
    msgs = [{"role": "user", "content": "SCRIPT<<Hello there, world|||"}]
    content, joined, n = _chat_lp_text(client, stream, model="a", messages=msgs, max_tokens=50)
    assert content == "Hello there, world" and joined == content
    assert n == len(tok.encode(content)) + 1  # the closing <|im_end|> keeps its entry
    forced = dict(model="a", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                  logit_bias={str(im_start): 100})
    assert _chat_lp_text(client, stream, **forced) == ("", "", 3)
    shown = _chat_lp_text(client, stream, extra_body={"skip_special_tokens": False}, **forced)
    assert shown == ("<|im_start|>" * 3, "<|im_start|>" * 3, 3)
    r = client.chat.completions.create(logprobs=True, top_logprobs=2, **forced)
    for e in r.choices[0].logprobs.content:  # the chosen token among the alternatives reads as it does above
        assert e.bytes == [] and {"token": "", "bytes": []} in [{"token": t.token, "bytes": t.bytes}
                                                                 for t in e.top_logprobs]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_tokens_join_to_the_text(fake, stream):
    client = openai.OpenAI(base_url=fake.base + "/v1", api_key="x", max_retries=0)
    im_start = load_tokenizer(None).token_to_id("<|im_start|>")
    kw = dict(model="a", prompt="Say SCRIPT<<Hi there|||", max_tokens=50, logprobs=1)
    forced = dict(model="a", prompt="hi", max_tokens=3, logprobs=1, logit_bias={str(im_start): 100})
    for args, text in ((kw, "Hi there"), (forced, "")):
        if stream:
            got, tokens = "", []
            for chunk in client.completions.create(stream=True, **args):
                for ch in chunk.choices:
                    got += ch.text
                    tokens += ch.logprobs.tokens if ch.logprobs is not None else []
        else:
            ch = client.completions.create(**args).choices[0]
            got, tokens = ch.text, ch.logprobs.tokens
            assert ch.logprobs.text_offset == [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
        assert got == text and "".join(tokens) == text


def test_no_tools_means_no_tool_parsing(fake):
    client = openai.OpenAI(base_url=fake.base + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model="a", messages=[{"role": "user", "content": f"SCRIPT<<{SCRIPTED}|||"}],
                                       max_tokens=200)
    assert not r.choices[0].message.tool_calls and "<tool_call>" in r.choices[0].message.content
    r = client.chat.completions.create(model="a", messages=[{"role": "user", "content": f"SCRIPT<<{SCRIPTED}|||"}],
                                       max_tokens=200, tools=[WEATHER], tool_choice="none")
    assert not r.choices[0].message.tool_calls


def test_served_engine_freezes_its_startup_heap():
    """`deltaserve serve` asks for a frozen heap once the engine is loaded (collector passes then skip the
    start-up objects); apps built without it, as in the other tests, leave the collector alone."""
    import gc

    from deltaserve.server.async_engine import AsyncEngine

    assert gc.get_freeze_count() == 0
    plain = AsyncEngine(EngineConfig(), FakeEngine)
    plain.start()
    assert plain.wait_ready(30) and gc.get_freeze_count() == 0
    plain.shutdown()
    frozen = AsyncEngine(EngineConfig(), FakeEngine, freeze_heap=True)
    try:
        frozen.start()
        assert frozen.wait_ready(30) and gc.get_freeze_count() > 0
    finally:
        frozen.shutdown()
        gc.unfreeze()


def test_a_fatal_step_failure_stops_the_server_with_its_reason():
    """An engine that cannot go on (a tensor-parallel rank died: the error says fatal) is not retried: /health
    turns 503 with the reason, every request gets it, and the engine's shutdown (its workers) runs."""
    class RankGone(RuntimeError):
        fatal = True

    class FatalEngine(FakeEngine):
        closed = False

        def step(self):
            if any(r["fail"] for r in self._live.values()):
                raise RankGone("tensor-parallel worker 1 (pid 4242) exited with code -9")
            return super().step()

        def shutdown(self):
            FatalEngine.closed = True

    srv = InProcessServer(build_app(EngineConfig(), engine_factory=FatalEngine))
    try:
        from server_support import wait_healthy
        wait_healthy(srv.base, 30)
        r = httpx.post(srv.base + "/v1/completions", json={"prompt": "FAIL_STEP", "max_tokens": 3})
        assert r.status_code == 500 and "worker 1" in r.json()["error"]["message"]
        deadline = time.time() + 10
        while not FatalEngine.closed:
            assert time.time() < deadline, "the engine's shutdown never ran"
            time.sleep(0.02)
        h = httpx.get(srv.base + "/health")
        assert h.status_code == 503 and "worker 1" in h.json()["error"]["message"]
        r = httpx.post(srv.base + "/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        assert r.status_code == 503 and "worker 1" in r.json()["error"]["message"]
    finally:
        srv.stop()


def test_any_model_name_only_when_asked(fake):
    """--accept-any-model-name: a client that asks for its own model names (Claude Code's claude-*) is served by
    the served model; without the flag that name is a 404 naming the model."""
    ask = {"model": "claude-opus-5-5", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(fake.base + "/v1/messages", json=ask)
    assert r.status_code == 404 and "claude-opus-5-5" in r.json()["error"]["message"]
    srv = InProcessServer(build_app(EngineConfig(), engine_factory=FakeEngine, served_model_name=["a"],
                                    accept_any_model_name=True))
    try:
        from server_support import wait_healthy
        wait_healthy(srv.base, 30)
        r = httpx.post(srv.base + "/v1/messages", json=ask)
        assert r.status_code == 200 and r.json()["model"] == "a", r.text
        r = httpx.post(srv.base + "/v1/chat/completions", json={**ask, "model": "gpt-5"})
        assert r.status_code == 200 and r.json()["model"] == "a", r.text
        assert [m["id"] for m in httpx.get(srv.base + "/v1/models").json()["data"]] == ["a"]
    finally:
        srv.stop()
