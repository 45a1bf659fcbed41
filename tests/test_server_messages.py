"""POST /v1/messages (Anthropic's Messages API) against a real server (the tiny embedded model), driven by the
`anthropic` SDK.

Random weights write nonsense, so free text runs to max_tokens (stop_reason "max_tokens"); a forced tool --
whose grammar ends the output -- is what proves the plumbing end to end.
"""
import json
import os
import sys

import anthropic
import httpx
import jsonschema
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server_support import RealServer

MODEL = "deltaserve/tiny"
WEATHER = {"name": "get_weather", "description": "Weather forecast for a city",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
               "required": ["city", "days"], "additionalProperties": False},
           "cache_control": {"type": "ephemeral"}}
NOTE = {"name": "write_note", "input_schema": {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 6}, "body": {"type": "string"}}, "required": ["title", "body"]}}
SYSTEM = [{"type": "text", "cache_control": {"type": "ephemeral"},
           "text": ("You are a careful weather assistant. Always call get_weather for any question about the weather, "
                    "then answer in one short sentence that names the city, the sky and the temperature. ") * 3}]


@pytest.fixture(scope="module")
def server():
    srv = RealServer("--max-num-seqs", "16", "--seed", "0", "--strict-max-tokens")  # refusals tested below
    yield srv
    srv.stop()


class Greedy(anthropic.Anthropic):
    """The SDK no longer takes temperature as an argument; the API (and this server) still does."""

    def __init__(self, **kw):
        super().__init__(**kw)
        create, stream = self.messages.create, self.messages.stream
        self.messages.create = lambda **k: create(**{"extra_body": {"temperature": 0}, **k})
        self.messages.stream = lambda **k: stream(**{"extra_body": {"temperature": 0}, **k})


@pytest.fixture(scope="module")
def client(server):
    return Greedy(base_url=server.base, api_key="unused", max_retries=0, timeout=120)


def test_plain_and_streamed_agree(client):
    kw = dict(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "Say something"}])
    m = client.messages.create(**kw)
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL and m.id.startswith("msg_")
    assert m.stop_reason == "max_tokens" and [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.usage.output_tokens == 10 and m.usage.input_tokens > 0 and m.usage.cache_read_input_tokens == 0
    with client.messages.stream(**kw) as s:
        events = [e.type for e in s]
        text = s.get_final_text()
        final = s.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "content_block_delta" in events and "message_delta" in events
    assert text == m.content[0].text and final.stop_reason == "max_tokens" and final.usage.output_tokens == 10
    raw = [e.type for e in client.messages.create(stream=True, **kw)]
    assert raw[0] == "message_start" and raw[-2:] == ["message_delta", "message_stop"]


def test_stop_sequences(client):
    free = client.messages.create(model=MODEL, max_tokens=12, messages=[{"role": "user", "content": "Go"}])
    word = free.content[0].text.split()[1]  # a word the greedy answer writes
    m = client.messages.create(model=MODEL, max_tokens=12, stop_sequences=[word],
                               messages=[{"role": "user", "content": "Go"}])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == word and word not in m.content[0].text


def test_forced_tool_then_tool_result_turn_reads_the_cache(client):
    q = [{"role": "user", "content": "What is the weather in Lima for 2 days?"}]
    first = client.messages.create(model=MODEL, max_tokens=80, system=SYSTEM, tools=[WEATHER],
                                   tool_choice={"type": "tool", "name": "get_weather"}, messages=q)
    assert first.stop_reason == "tool_use"
    uses = [b for b in first.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, WEATHER["input_schema"])
    turn2 = q + [{"role": "assistant", "content": first.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                               "content": [{"type": "text", "text": '{"sky": "clear", "c": 19}'}]}]}]
    second = client.messages.create(model=MODEL, max_tokens=80, system=SYSTEM, tools=[WEATHER],
                                    tool_choice={"type": "any"}, messages=turn2)
    assert second.stop_reason == "tool_use"
    u = second.usage
    assert u.cache_read_input_tokens >= 64 and u.cache_creation_input_tokens == 0
    assert u.input_tokens + u.cache_read_input_tokens > first.usage.input_tokens
    # streamed: the tool_use block arrives as input_json_delta and parses
    with client.messages.stream(model=MODEL, max_tokens=80, system=SYSTEM, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"}, messages=turn2) as s:
        deltas = [e.delta.partial_json for e in s if e.type == "content_block_delta"
                  and e.delta.type == "input_json_delta"]
        final = s.get_final_message()
    block = [b for b in final.content if b.type == "tool_use"][0]
    assert final.stop_reason == "tool_use" and json.loads("".join(deltas)) == block.input
    assert final.usage.cache_read_input_tokens >= 64
    assert client.messages.count_tokens(model=MODEL, system=SYSTEM, tools=[WEATHER], messages=turn2).input_tokens \
        == second.usage.input_tokens + second.usage.cache_read_input_tokens


def test_forced_tool_cut_by_max_tokens_is_still_a_tool_use(client):
    m = client.messages.create(model=MODEL, max_tokens=40, tools=[NOTE],
                               tool_choice={"type": "tool", "name": "write_note"},
                               messages=[{"role": "user", "content": "Write a note"}])
    assert m.stop_reason == "max_tokens" and [b.type for b in m.content] == ["tool_use"]
    args = m.content[0].input
    assert set(args) == {"title", "body"} and len(args["title"]) <= 6


def test_prefill_continues_the_assistant_text(client):
    kw = dict(model=MODEL, max_tokens=6)
    m = client.messages.create(messages=[{"role": "user", "content": "Name a colour"},
                                         {"role": "assistant", "content": "The colour is"}], **kw)
    assert m.stop_reason == "max_tokens" and not m.content[0].text.startswith("The colour is")
    assert m.usage.input_tokens > client.messages.create(
        messages=[{"role": "user", "content": "Name a colour"}], **kw).usage.input_tokens


def test_sampling_range_edges_are_served(client):
    """The ends of Anthropic's ranges are served: temperature 1, top_p 1, top_k 0 (off), and top_p 0, a nucleus
    of the likeliest token alone: greedy whatever the temperature."""
    kw = dict(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Count on"}])
    greedy = client.messages.create(**kw).content[0].text
    edge = client.messages.create(extra_body={"temperature": 1, "top_p": 1, "top_k": 0}, **kw)
    assert edge.usage.output_tokens == 8
    assert client.messages.create(extra_body={"temperature": 1, "top_p": 0}, **kw).content[0].text == greedy


def _err(r, what=None):
    assert r.status_code == 400, (r.status_code, r.text)
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == "invalid_request_error"
    if what is not None:
        assert what in body["error"]["message"], body
    return body["error"]["message"]


def test_bad_input_is_400_in_anthropic_shape(server, client):
    url = server.base + "/v1/messages"
    ok = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    _err(httpx.post(url, json={**ok, "service_tier": "auto"}), "service_tier")
    _err(httpx.post(url, json={**ok, "max_tokens": 0}), "max_tokens")
    _err(httpx.post(url, json={"model": MODEL, "messages": ok["messages"]}), "max_tokens")
    _err(httpx.post(url, json={**ok, "messages": []}), "messages")
    _err(httpx.post(url, json={**ok, "temperature": -1}), "temperature")
    # Anthropic's ranges, narrower than OpenAI's: temperature and top_p in [0, 1], top_k >= 0
    assert "[0, 1]" in _err(httpx.post(url, json={**ok, "temperature": 1.5}), "temperature")
    _err(httpx.post(url, json={**ok, "top_p": 1.01}), "top_p")
    _err(httpx.post(url, json={**ok, "top_p": -0.5}), "top_p")
    _err(httpx.post(url, json={**ok, "top_k": -1}), "top_k")
    _err(httpx.post(url, json={**ok, "max_tokens": 10 ** 7}), "maximum context length")
    _err(httpx.post(url, json={**ok, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}), "server tool")
    _err(httpx.post(url, json={**ok, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}), "image")
    _err(httpx.post(url, json={**ok, "tool_choice": {"type": "any"}}), "tool_choice")
    _err(httpx.post(url, json={**ok, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}),
         "tool_choice")
    _err(httpx.post(url, json={**ok, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_x", "content": "r"}]}]}), "messages.0.content.0.tool_use_id")
    _err(httpx.post(url, json={**ok, "thinking": {"type": "enabled", "budget_tokens": 2048}}), "budget_tokens")
    _err(httpx.post(url, json={**ok, "thinking": {"type": "enabled", "budget_tokens": 10}, "max_tokens": 4000}),
         "budget_tokens")
    _err(httpx.post(url, content=b"{nope", headers={"content-type": "application/json"}), "JSON")
    r = httpx.post(url, json={**ok, "model": "claude-opus-4"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):  # the SDK turns the shape into its own exception
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "x"}],
                               extra_body={"top_k": -5})
    # the engine and other requests carry on
    assert httpx.get(server.base + "/health").status_code == 200
    assert client.messages.create(model=MODEL, max_tokens=2, messages=ok["messages"]).usage.output_tokens == 2
