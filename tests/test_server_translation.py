"""One translation layer: Chat Completions, Responses and Messages are three shapes of one request and one delta
stream. A fake engine in-process writes a scripted answer (reasoning, text, a tool call) so each API can be
checked to carry the same parse -- whole and streamed alike -- which random weights could never write on
demand. Also: Anthropic's x-api-key auth and error shape, and a failing engine step on the new routes."""
import json
import os
import sys

import anthropic
import httpx
import openai
import pytest

from deltaserve.config import EngineConfig
from deltaserve.server import build_app

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server_support import FakeEngine, InProcessServer, wait_healthy

MODEL = "deltaserve/tiny"
KEY = "sekret"
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
        "</parameter>\n</function>\n</tool_call>")
ANSWER = "<think>\nThe user wants weather.\n</think>\n\nLet me check." + "\n\n" + CALL
SCRIPT = f"SCRIPT<<{ANSWER}|||"
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}
RESP_TOOL = {"type": "function", **CHAT_TOOL["function"]}
ANTH_TOOL = {"name": "get_weather", "input_schema": CHAT_TOOL["function"]["parameters"]}
REASONING, CONTENT, ARGS = "\nThe user wants weather.\n", "Let me check.", {"city": "Paris", "days": 3}


@pytest.fixture(scope="module")
def server():
    srv = InProcessServer(build_app(EngineConfig(), api_key=KEY, engine_factory=FakeEngine))
    wait_healthy(srv.base, timeout=60)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def anth(server):
    return anthropic.Anthropic(base_url=server.base, api_key=KEY, max_retries=0)  # sends x-api-key


def test_chat_parses_reasoning_content_and_call(oai):
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": SCRIPT}], tools=[CHAT_TOOL],
                                    max_tokens=200)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert m.model_extra["reasoning_content"] == REASONING and m.content == CONTENT
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == [("get_weather", ARGS)]


def test_responses_items_whole_and_streamed(oai):
    kw = dict(model=MODEL, input=SCRIPT, tools=[RESP_TOOL], max_output_tokens=200)
    r = oai.responses.create(**kw)
    assert r.status == "completed" and [o.type for o in r.output] == ["reasoning", "message", "function_call"]
    assert r.output[0].content[0].text == REASONING and r.output_text == CONTENT
    assert r.output[2].name == "get_weather" and json.loads(r.output[2].arguments) == ARGS
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    with oai.responses.stream(**kw) as s:
        events = list(s)
        final = s.get_final_response()
    types = [e.type for e in events]
    assert "response.reasoning_text.delta" in types and "response.output_text.delta" in types
    assert "response.function_call_arguments.delta" in types and types[-1] == "response.completed"
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == CONTENT and json.loads(final.output[2].arguments) == ARGS
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == REASONING
    # summary asked for: the reasoning is its own summary, streamed as such too
    s = oai.responses.create(reasoning={"summary": "auto"}, **kw)
    assert s.output[0].summary[0].text == REASONING


def test_messages_blocks_whole_and_streamed(anth):
    kw = dict(model=MODEL, max_tokens=200, tools=[ANTH_TOOL], messages=[{"role": "user", "content": SCRIPT}])
    m = anth.messages.create(**kw)
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["thinking", "text", "tool_use"]
    assert m.content[0].thinking == REASONING and m.content[0].signature and m.content[1].text == CONTENT
    assert m.content[2].name == "get_weather" and m.content[2].input == ARGS
    with anth.messages.stream(**kw) as s:
        kinds = [e.delta.type for e in s if e.type == "content_block_delta"]
        final = s.get_final_message()
    assert {"thinking_delta", "signature_delta", "text_delta", "input_json_delta"} <= set(kinds)
    assert (final.stop_reason, final.usage.output_tokens) == (m.stop_reason, m.usage.output_tokens)
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"] and final.content[2].input == ARGS
    assert final.content[0].thinking == REASONING and final.content[1].text == CONTENT
    # the thinking block handed back renders as the assistant's reasoning: the request is accepted as is
    again = anth.messages.create(model=MODEL, max_tokens=3, tools=[ANTH_TOOL], messages=[
        {"role": "user", "content": "q"}, {"role": "assistant", "content": m.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": m.content[2].id, "content": "sunny",
                                      "is_error": False}]}])
    assert again.usage.input_tokens > 0


def test_x_api_key_and_error_shape(server):
    url = server.base + "/v1/messages"
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
    r = httpx.post(url, json=body)
    assert r.status_code == 401 and r.json()["type"] == "error" and r.json()["error"]["type"] == "authentication_error"
    assert httpx.post(url, json=body, headers={"x-api-key": "wrong"}).status_code == 401
    assert httpx.post(url, json=body, headers={"x-api-key": KEY}).status_code == 200
    assert httpx.post(url, json=body, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    # x-api-key is Anthropic's header only
    r = httpx.post(server.base + "/v1/responses", json={"input": "x"}, headers={"x-api-key": KEY})
    assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.base, api_key="nope", max_retries=0).messages.create(**body)


def test_failing_step_on_new_routes(server, oai, anth):
    with pytest.raises(openai.InternalServerError):
        oai.responses.create(model=MODEL, input=FakeEngine.FAIL_STEP, max_output_tokens=4)
    events = list(oai.responses.create(model=MODEL, input=FakeEngine.FAIL_STEP, max_output_tokens=4, stream=True))
    assert events[-1].type == "response.failed" and "engine failed" in events[-1].response.error.message
    with pytest.raises(anthropic.InternalServerError):
        anth.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": FakeEngine.FAIL_STEP}])
    r = httpx.post(server.base + "/v1/messages", headers={"x-api-key": KEY},
                   json={"model": MODEL, "max_tokens": 4, "stream": True,
                         "messages": [{"role": "user", "content": FakeEngine.FAIL_STEP}]})
    assert "event: error" in r.text and '"type": "api_error"' in r.text
    assert oai.responses.create(model=MODEL, input="fine", max_output_tokens=2).usage.output_tokens == 2


def test_chat_reasoning_effort_is_the_thinking_switch_and_hints_pass():
    from deltaserve.server.openai.protocol import ChatCompletionRequest
    from deltaserve.server.openai.routes import chat_spec

    base = {"messages": [{"role": "user", "content": "hi"}], "metadata": {"k": "v"}, "store": False,
            "prompt_cache_key": "session-1", "safety_identifier": "u1"}
    kw = lambda **extra: chat_spec(ChatCompletionRequest.model_validate({**base, **extra})).template_kwargs
    assert kw() == {}
    assert kw(reasoning_effort="minimal") == {"enable_thinking": False}
    assert kw(reasoning_effort="high") == {"enable_thinking": True}
    assert kw(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}) == {"enable_thinking": True}
