"""POST /v1/responses against a real server (the tiny embedded model), driven by the real clients: the `openai`
SDK and the OpenAI Agents SDK (`openai-agents`).

Random weights write nonsense, so free text runs to max_output_tokens (status "incomplete"); the forced
tool paths -- whose grammar ends the output -- are what prove the plumbing end to end.
"""
import asyncio
import json
import os
import sys
from typing import Literal

import httpx
import jsonschema
import openai
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server_support import RealServer

MODEL = "deltaserve/tiny"
STORED = 3  # the server keeps this many stored responses, so eviction is testable
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather forecast for a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
               "required": ["city", "days"], "additionalProperties": False}}
NOTE = {"type": "function", "name": "write_note", "parameters": {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 6}, "body": {"type": "string"}}, "required": ["title", "body"]}}
# long enough that a second turn starts with whole 64-token pages the first one wrote
INSTRUCTIONS = ("You are a careful weather assistant. Always call the get_weather tool for any question about the "
                "weather, then answer in one short sentence that names the city, the sky and the temperature. ") * 3


@pytest.fixture(scope="module")
def server():
    srv = RealServer("--max-num-seqs", "16", "--seed", "0", "--max-stored-responses", str(STORED),
                     "--strict-max-tokens")  # the max_output_tokens refusal is tested below
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_plain_whole_and_streamed_agree(client):
    kw = dict(model=MODEL, input="Say something", max_output_tokens=10, temperature=0)
    whole = client.responses.create(**kw)
    assert whole.object == "response" and whole.id.startswith("resp_") and whole.model == MODEL
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in whole.output] == ["message"] and whole.output[0].role == "assistant"
    assert whole.output_text and whole.usage.output_tokens == 10 and whole.usage.input_tokens > 0
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.incomplete"
    assert "response.output_item.added" in types and "response.content_part.added" in types
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == text and events[-1].response.output_text == text
    assert events[-1].response.usage.output_tokens == 10


def test_forced_function_tool(client):
    r = client.responses.create(model=MODEL, input="What is the weather in Tokyo for 3 days?", tools=[WEATHER],
                                tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=80,
                                temperature=0)
    assert r.status == "completed"
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    assert calls[0].status == "completed"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    # the same through the SDK's streaming helper, which assembles the events into the final response
    with client.responses.stream(model=MODEL, input="Weather in Lima?", tools=[WEATHER], tool_choice="required",
                                 max_output_tokens=80, temperature=0) as s:
        deltas = "".join(e.delta for e in s if e.type == "response.function_call_arguments.delta")
        final = s.get_final_response()
    call = [o for o in final.output if o.type == "function_call"][0]
    assert final.status == "completed" and call.arguments == deltas
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


def test_forced_call_cut_by_max_output_tokens_is_still_a_call(client):
    """A forced call whose free-text parameter runs into max_output_tokens comes back as a call with the
    arguments written so far (status incomplete), never as markup in a message."""
    r = client.responses.create(model=MODEL, input="Write a note", tools=[NOTE],
                                tool_choice={"type": "function", "name": "write_note"}, max_output_tokens=40,
                                temperature=0)
    assert r.status == "incomplete" and [o.type for o in r.output] == ["function_call"]
    call = r.output[0]
    assert call.name == "write_note" and call.status == "incomplete"
    args = json.loads(call.arguments)
    assert set(args) == {"title", "body"} and len(args["title"]) <= 6  # maxLength ended the title; the body was cut
    assert "</parameter" not in args["body"] and not r.output_text


def test_previous_response_id_continues_with_cached_tokens(client):
    first = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input="Weather in Paris for 2 days?",
                                    tools=[WEATHER], tool_choice="required", max_output_tokens=80, temperature=0)
    call = [o for o in first.output if o.type == "function_call"][0]
    second = client.responses.create(
        model=MODEL, instructions=INSTRUCTIONS, previous_response_id=first.id, tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear", "c": 21}'}],
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=80, temperature=0)
    assert second.previous_response_id == first.id and second.status == "completed"
    assert second.usage.input_tokens > first.usage.input_tokens
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= 64 and cached <= first.usage.input_tokens + first.usage.output_tokens
    # the same conversation sent whole renders the same prompt
    whole = client.responses.create(
        model=MODEL, instructions=INSTRUCTIONS, tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        input=[{"role": "user", "content": "Weather in Paris for 2 days?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear", "c": 21}'}],
        max_output_tokens=80, temperature=0)
    assert whole.usage.input_tokens == second.usage.input_tokens
    assert [o.arguments for o in whole.output] == [o.arguments for o in second.output]  # greedy: same call


def test_store_retrieve_delete_and_eviction(server, client):
    ids = [client.responses.create(model=MODEL, input=f"turn {i}", max_output_tokens=2, temperature=0).id
           for i in range(STORED + 1)]
    got = client.responses.retrieve(ids[-1])
    assert got.id == ids[-1] and got.output_text
    with pytest.raises(openai.BadRequestError) as e:  # the oldest was evicted: a clear error naming the field
        client.responses.create(model=MODEL, input="again", previous_response_id=ids[0], max_output_tokens=2)
    err = e.value.body
    assert err["param"] == "previous_response_id" and err["code"] == "previous_response_not_found"
    assert "evicted" in err["message"] and str(STORED) in err["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="again", previous_response_id="resp_nope", max_output_tokens=2)
    assert "not found" in e.value.body["message"]
    nostore = client.responses.create(model=MODEL, input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(nostore.id)
    assert httpx.delete(f"{server.base}/v1/responses/{ids[-1]}").json()["deleted"] is True
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[-1])


def test_reasoning_effort_and_encrypted_content_round_trip(client):
    r = client.responses.create(model=MODEL, input="hi", reasoning={"effort": "none"}, max_output_tokens=3,
                                include=["reasoning.encrypted_content"], temperature=0)
    assert r.reasoning.effort == "none" and r.status == "incomplete"
    # a reasoning item handed back (as Codex CLI does) is read: content, or this server's encrypted_content
    from deltaserve.server.responses.input import encode_reasoning
    item = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": encode_reasoning("thought")}
    r2 = client.responses.create(model=MODEL, max_output_tokens=2, input=[
        {"role": "user", "content": "q"}, item, {"role": "assistant", "content": "a"},
        {"role": "user", "content": "q2"}])
    assert r2.usage.input_tokens > 0
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, max_output_tokens=2, input=[
            {"role": "user", "content": "q"}, {**item, "encrypted_content": "gAAAA-from-elsewhere"}])
    assert e.value.body["param"] == "input[1].encrypted_content"


def test_json_schema_text_format(client):
    schema = {"type": "object", "properties": {"sky": {"enum": ["sunny", "rainy"]}, "n": {"type": "integer",
              "minimum": 0, "maximum": 9}}, "required": ["sky", "n"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="JSON", max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "w", "schema": schema}})
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), schema)


def _err(r, param=None):
    assert r.status_code == 400, (r.status_code, r.text)
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["type"] == "invalid_request_error"
    if param is not None:
        assert e["param"] == param, e
    return e


def test_bad_input_is_400_naming_the_field(server):
    url = server.base + "/v1/responses"

    def post(*args, **kw):  # the first image request waits for the engine's start-up work on a loaded machine
        return httpx.post(*args, timeout=60, **kw)

    e = _err(post(url, json={"input": "x", "background": True}), "background")
    assert "refused" in e["message"]
    _err(post(url, json={"input": "x", "service_tier": "flex"}), "service_tier")
    _err(post(url, json={"input": "x", "tools": [{"type": "bogus_tool"}]}), "tools")
    # a built-in tool merely offered is left out of the prompt (a warning header says so); forced, it is refused
    _err(post(url, json={"input": "x", "tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}}),
         "tool_choice")
    _err(post(url, json={"input": "x", "include": ["message.output_text.logprobs"]}), "include")
    _err(post(url, json={"input": "x", "truncation": "auto"}), "truncation")
    _err(post(url, json={"input": []}), "input")
    _err(post(url, json={"input": [{"type": "item_reference", "id": "x"}]}), "input")
    _err(post(url, json={"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}),
         "input")
    _err(post(url, json={"input": "x", "temperature": -1}), "temperature")
    _err(post(url, json={"input": "x", "max_output_tokens": 0}), "max_output_tokens")
    e = _err(post(url, json={"input": "x", "max_output_tokens": 10 ** 7}), "max_output_tokens")
    assert "maximum context length" in e["message"]
    _err(post(url, json={"input": "x", "tool_choice": "required"}), "tool_choice")
    _err(post(url, json={"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "no"}}),
         "tool_choice")
    _err(post(url, json={"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]}),
         "input[0].call_id")
    _err(post(url, json={"input": [{"role": "user", "content": "q"}, {"type": "function_call", "call_id": "c",
                                                                            "name": "f", "arguments": "[1]"}]}),
         "input[1].arguments")
    _err(post(url, json={"input": "x", "text": {"format": {"type": "json_schema", "name": "b",
                                                                 "schema": {"type": "nonsense"}}}}), "text.format")
    assert post(url, json={"input": "x", "model": "gpt-5"}).status_code == 404
    # the engine and other requests carry on
    assert httpx.get(server.base + "/health").status_code == 200
    assert post(url, json={"input": "still fine", "max_output_tokens": 2}).json()["usage"]["output_tokens"] == 2


def test_agents_sdk_runner_calls_the_tool_and_finishes(server):
    """An Agent with one function tool, run by Runner through the SDK's OpenAI provider (Responses API): the tool
    is called (forced), its result fed back, and the run ends with the agent's typed output (a JSON schema the
    grammar completes, since random weights would otherwise write until max_tokens)."""
    from agents import Agent, ModelSettings, OpenAIProvider, RunConfig, Runner, function_tool, set_tracing_disabled
    from pydantic import BaseModel

    set_tracing_disabled(True)
    seen = []

    @function_tool
    def get_weather(city: Literal["Paris", "Lima"]) -> str:
        """Weather for a city."""
        seen.append(city)
        return f"sunny in {city}"

    class Answer(BaseModel):
        sky: Literal["sunny", "rainy"]

    client = openai.AsyncOpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)
    agent = Agent(name="weather", instructions=INSTRUCTIONS, tools=[get_weather], output_type=Answer, model=MODEL,
                  model_settings=ModelSettings(tool_choice="get_weather", max_tokens=48, temperature=0))
    run = RunConfig(model_provider=OpenAIProvider(openai_client=client, use_responses=True))
    result = asyncio.run(Runner.run(agent, "Weather in Paris?", max_turns=4, run_config=run))
    assert len(seen) == 1 and seen[0] in ("Paris", "Lima")
    kinds = [type(i).__name__ for i in result.new_items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"], kinds
    assert isinstance(result.final_output, Answer)
    first, second = result.raw_responses
    assert second.usage.input_tokens_details.cached_tokens >= 64  # the tool turn reused the first turn's pages
