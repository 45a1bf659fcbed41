"""The three APIs over the real Qwen3.5 tokenizer and chat template, on a fake engine in-process (a 0.8B model of
random weights would take minutes to build and write nonsense all the same).

The fake "model" samples pseudo-random ids over the 248k vocabulary within whatever the guides allow, so what is
checked is the plumbing on the real format: the template opens a think block, an Anthropic thinking budget
closes it at the budget, the call grammar then writes the forced call, and the parsers read it out of real ids.
"""
import json
import os
import sys

import anthropic
import jsonschema
import openai
import pytest

from deltaserve.config import EngineConfig
from deltaserve.server import build_app

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server_support import InProcessServer, qwen35_fake_engine, wait_healthy

MODEL = "deltaserve/tiny"  # the fake engine's name for itself
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lima"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
          "required": ["city", "days"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server():
    QwenFake, tok = qwen35_fake_engine()
    srv = InProcessServer(build_app(EngineConfig(), engine_factory=QwenFake))
    wait_healthy(srv.base, timeout=120)
    srv.tok = tok
    yield srv
    srv.stop()


def test_anthropic_thinking_budget_then_forced_tool(server):
    a = anthropic.Anthropic(base_url=server.base, api_key="x", max_retries=0, timeout=120)
    m = a.messages.create(model=MODEL, max_tokens=1400, thinking={"type": "enabled", "budget_tokens": 1024},
                          tools=[{"name": "get_weather", "input_schema": SCHEMA}],
                          tool_choice={"type": "tool", "name": "get_weather"},
                          messages=[{"role": "user", "content": "Weather in Paris?"}])
    assert [b.type for b in m.content] == ["thinking", "tool_use"], m.content
    assert m.stop_reason == "tool_use" and m.content[1].name == "get_weather"
    jsonschema.validate(m.content[1].input, SCHEMA)
    # 1024 thinking tokens, the </think> the budget forced, then the call (a few dozen tokens): not max_tokens
    assert m.content[0].thinking and 1024 + 1 < m.usage.output_tokens < 1024 + 1 + 80


def test_responses_and_chat_forced_call_with_thinking_off(server):
    c = openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0, timeout=120)
    tool = {"type": "function", "name": "get_weather", "parameters": SCHEMA}
    r = c.responses.create(model=MODEL, input="Weather?", tools=[tool], tool_choice="required",
                           parallel_tool_calls=False,
                           reasoning={"effort": "none"}, max_output_tokens=120)
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"]
    jsonschema.validate(json.loads(r.output[0].arguments), SCHEMA)
    ch = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather?"}], max_tokens=120,
                                   tools=[{"type": "function",
                                           "function": {"name": "get_weather", "parameters": SCHEMA}}],
                                   tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert ch.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(ch.choices[0].message.tool_calls[0].function.arguments), SCHEMA)
    # thinking on (the template's default) and no budget: the whole output is reasoning, and says so
    t = c.responses.create(model=MODEL, input="Think", max_output_tokens=12)
    assert t.status == "incomplete" and [o.type for o in t.output] == ["reasoning"]
    assert t.usage.output_tokens_details.reasoning_tokens == 12
