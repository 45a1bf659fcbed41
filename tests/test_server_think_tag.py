"""A `<think>` in an earlier turn is text, not the opening of the new answer's reasoning: on every API (Chat
Completions, Messages, Responses), streamed and not, over the embedded chat template (the model opens its own
think block) and the real Qwen3.5 template (the generation prompt opens it), with thinking on and off.

The fake engine writes a scripted answer (SCRIPT<<...|||, tests/server_support.py; the script comes before the
tag in the prompt, so its own "</think>" cannot close the tag), so what comes back as reasoning and as content
is known exactly: reasoning "plan" and content "The answer." with thinking on, content
"The answer." alone with thinking off, wherever the conversation mentions the tag.
"""
import os
import sys

import anthropic
import openai
import pytest

from deltaserve.config import EngineConfig
from deltaserve.server import build_app

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server_support import FakeEngine, InProcessServer, qwen35_fake_engine, wait_healthy

MODEL = "deltaserve/tiny"
ANSWER = "The answer."
PLACES = ("user", "tool", "assistant")  # where the earlier conversation mentions <think>


@pytest.fixture(scope="module", params=["embedded", "qwen3.5"])
def server(request):
    engine = FakeEngine if request.param == "embedded" else qwen35_fake_engine()[0]
    srv = InProcessServer(build_app(EngineConfig(), engine_factory=engine))
    wait_healthy(srv.base, timeout=120)
    # the embedded template's generation prompt leaves the think block to the model; Qwen3.5's opens it
    srv.template_opens = request.param == "qwen3.5"
    yield srv
    srv.stop()


def _script(server, thinking: bool) -> str:
    if not thinking:
        return ANSWER
    return ("" if server.template_opens else "<think>") + "plan</think>\n\n" + ANSWER


# ---------------------------------------------------------------- the three conversations, in each API's shape

def _chat_messages(place: str, script: str) -> list[dict]:
    ask = f"SCRIPT<<{script}|||"
    if place == "user":
        return [{"role": "user", "content": f"{ask} What does the <think> tag do?"}]
    if place == "tool":
        return [{"role": "user", "content": f"Read the file. {ask}"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "read", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "line 1: <think>\nline 2: start"}]
    return [{"role": "user", "content": f"{ask} Which tag opens reasoning?"},
            {"role": "assistant", "content": "It is <think>, written first."},
            {"role": "user", "content": "Thanks."}]


def _anthropic_messages(place: str, script: str) -> list[dict]:
    ask = f"SCRIPT<<{script}|||"
    if place == "user":
        return [{"role": "user", "content": f"{ask} What does the <think> tag do?"}]
    if place == "tool":
        return [{"role": "user", "content": f"Read the file. {ask}"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "read", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                              "content": "line 1: <think>\nline 2: start"}]}]
    return [{"role": "user", "content": f"{ask} Which tag opens reasoning?"},
            {"role": "assistant", "content": "It is <think>, written first."},
            {"role": "user", "content": "Thanks."}]


def _responses_input(place: str, script: str) -> list[dict]:
    ask = f"SCRIPT<<{script}|||"
    if place == "user":
        return [{"role": "user", "content": f"{ask} What does the <think> tag do?"}]
    if place == "tool":
        return [{"role": "user", "content": f"Read the file. {ask}"},
                {"type": "function_call", "call_id": "call_1", "name": "read", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "line 1: <think>\nline 2: start"}]
    return [{"role": "user", "content": f"{ask} Which tag opens reasoning?"},
            {"role": "assistant", "content": "It is <think>, written first."},
            {"role": "user", "content": "Thanks."}]


READ_TOOL = {"name": "read", "description": "Read the file", "parameters": {"type": "object", "properties": {}}}


def _expect(reasoning, content, thinking: bool) -> None:
    assert content == ANSWER, (reasoning, content)
    assert (reasoning or None) == ("plan" if thinking else None), (reasoning, content)


# ---------------------------------------------------------------- the APIs

@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("place", PLACES)
def test_chat_completions(server, place, stream, thinking):
    c = openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0, timeout=60)
    kw = dict(model=MODEL, messages=_chat_messages(place, _script(server, thinking)), max_tokens=64,
              tools=[{"type": "function", "function": READ_TOOL}],
              extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
    if not stream:
        m = c.chat.completions.create(**kw).choices[0].message
        _expect(getattr(m, "reasoning_content", None), m.content, thinking)
        return
    reasoning, content = "", ""
    for ch in c.chat.completions.create(stream=True, **kw):
        for choice in ch.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    _expect(reasoning, content, thinking)


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("place", PLACES)
def test_anthropic_messages(server, place, stream, thinking):
    a = anthropic.Anthropic(base_url=server.base, api_key="x", max_retries=0, timeout=60)
    kw = dict(model=MODEL, max_tokens=64, messages=_anthropic_messages(place, _script(server, thinking)),
              tools=[{"name": "read", "description": "Read the file", "input_schema": READ_TOOL["parameters"]}])
    if thinking:
        kw["extra_body"] = {"thinking": {"type": "adaptive"}}
    if stream:
        with a.messages.stream(**kw) as s:
            m = s.get_final_message()
    else:
        m = a.messages.create(**kw)
    reasoning = "".join(b.thinking for b in m.content if b.type == "thinking")
    content = "".join(b.text for b in m.content if b.type == "text")
    assert m.stop_reason == "end_turn"
    _expect(reasoning, content, thinking)


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("place", PLACES)
def test_responses(server, place, stream, thinking):
    c = openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0, timeout=60)
    kw = dict(model=MODEL, input=_responses_input(place, _script(server, thinking)), max_output_tokens=64,
              tools=[{"type": "function", **READ_TOOL}], reasoning={"effort": "medium" if thinking else "none"})
    if stream:
        done = [e for e in c.responses.create(stream=True, **kw) if e.type == "response.completed"]
        assert len(done) == 1
        r = done[0].response
    else:
        r = c.responses.create(**kw)
    assert r.status == "completed"
    reasoning = "".join(p.text for o in r.output if o.type == "reasoning" for p in (o.content or []))
    _expect(reasoning, r.output_text, thinking)
