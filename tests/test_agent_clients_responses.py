"""/v1/responses against what Codex CLI really sends: the recorded requests in tests/fixtures/agents/codex-*.json
replayed as they are (body and headers), whole and streamed, through an app over a fake engine that writes a
scripted answer -- so the answer's shape (a namespaced call, a custom tool's call) can be checked, which random
weights could never write on demand. The requests go through the `openai` SDK (the fields this SDK version does
not know, such as client_metadata, in extra_body), which parses the answers into its Responses types.

What is checked: each request is answered 200; the built-in web_search tool is left out of the prompt and the
x-deltaserve-warning header says so; namespaced tools reach the prompt as <namespace>__<name> and a call to one
comes back as {"type": "function_call", "name", "namespace"}; a custom tool is a function with one string
parameter `input` and its call comes back as a custom_tool_call item; both round-trip as input."""
import glob
import inspect
import json
import os
import sys
from typing import ClassVar

import httpx
import openai
import pytest
from openai.types.responses import Response

from deltaserve.config import EngineConfig
from deltaserve.server import build_app

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server_support import FakeEngine, InProcessServer, wait_healthy

FIXTURES = sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "agents",
                                         "codex-*.json")))
SKIP_HEADERS = {"host", "content-length", "authorization", "accept-encoding", "connection"}
WAIT = ("<tool_call>\n<function=multi_agent_v1__wait_agent>\n<parameter=timeout_ms>\n30000\n</parameter>\n"
        "</function>\n</tool_call>")
EXEC_INPUT = "// @exec: quiet\nconsole.log('hi')"
EXEC = (f"<tool_call>\n<function=functions__exec>\n<parameter=input>\n{EXEC_INPUT}\n</parameter>\n</function>\n"
        "</tool_call>")


def record(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


class ScriptedEngine(FakeEngine):
    """The fake engine (served with a context that fits Codex-sized prompts) that writes
    ScriptedEngine.script, then <|im_end|> (Codex sends no max_output_tokens: the fake's own rule would write
    until the context is full), and keeps the prompts it was given."""

    script = "hi"
    prompts: ClassVar[list[str]] = []

    def add_request(self, request_id, prompt, params, cache_salt=None, arrival_time=None):
        super().add_request(request_id, prompt, params, cache_salt, arrival_time)
        r = self._live[request_id]
        r["script"] = self.tokenizer.encode(type(self).script) + [self.tokenizer.token_to_id("<|im_end|>")]
        type(self).prompts.append(self.tokenizer.decode(r["ids"]))


@pytest.fixture(scope="module")
def server():
    # Codex's default model (codex-4, no model configured) asks for its own name: served as any name is
    srv = InProcessServer(build_app(EngineConfig(max_model_len=1 << 17), engine_factory=ScriptedEngine,
                                    accept_any_model_name=True))
    wait_healthy(srv.base, timeout=60)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(autouse=True)
def _script():
    ScriptedEngine.script = "hi"
    ScriptedEngine.prompts.clear()
    yield


def headers(rec: dict) -> dict:
    return {k: v for k, v in rec["headers"].items() if k.lower() not in SKIP_HEADERS}


def post(server, rec: dict, body: dict) -> httpx.Response:
    """The body as it is, over plain HTTP (for the refusals: their status and error object)."""
    return httpx.post(server.base + rec["path"], json=body, headers=headers(rec), timeout=120)


def send(client, rec: dict, body: dict | None = None, stream: bool = False):
    """The request through the SDK: the raw response (its headers) and the parsed answer, the final Response and
    the stream's events."""
    body = {**(rec["body"] if body is None else body), "stream": stream}
    known = set(inspect.signature(client.responses.create).parameters)
    extra = {k: v for k, v in body.items() if k not in known}
    raw = client.responses.with_raw_response.create(**{k: v for k, v in body.items() if k in known},
                                                     extra_body=extra or None, extra_headers=headers(rec))
    assert raw.status_code == 200
    if not stream:
        final = raw.parse()
        assert isinstance(final, Response)
        return raw, final, []
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = list(raw.parse())
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    return raw, events[-1].response, events


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "whole"])
@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: os.path.basename(p)[:-5])
def test_codex_request_is_answered(client, path, streamed):
    rec = record(path)
    raw, final, events = send(client, rec, stream=streamed)
    assert final.status == "completed" and final.output_text == "hi"
    assert [o.type for o in final.output] == ["message"]
    assert final.usage.input_tokens > 1000 and final.store is False
    if streamed:
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "hi"
    prompt, warning = ScriptedEngine.prompts[-1], raw.headers["x-deltaserve-warning"]
    if rec["body"].get("tools"):  # codex-1..3: web_search offered, left out, and said so
        i = [t["type"] for t in rec["body"]["tools"]].index("web_search")
        assert f"tools[{i}] (web_search) left out of the prompt" in warning
        assert "<name>web_search</name>" not in prompt and "<name>exec_command</name>" in prompt
        assert [t.type for t in final.tools] == [t["type"] for t in rec["body"]["tools"]]  # echoed as sent
    else:  # codex-4: its tools come in an additional_tools item; the custom exec tool's grammar is not enforced
        assert "input[0].tools[0].tools[0].format (lark grammar of custom tool functions__exec)" in warning
        assert "<name>functions__exec</name>" in prompt and "<name>clock__sleep</name>" in prompt


def test_namespace_tool_in_the_prompt_and_its_call_back(client):
    rec = record(FIXTURES[0])  # codex-1: multi_agent_v1 is a namespace of five functions
    ScriptedEngine.script = WAIT
    _, whole, _ = send(client, rec)
    prompt = ScriptedEngine.prompts[-1]
    for name in ("close_agent", "resume_agent", "send_input", "spawn_agent", "wait_agent"):
        assert f"<name>multi_agent_v1__{name}</name>" in prompt
    # the namespace's description starts each of its tools' descriptions
    assert "<name>multi_agent_v1__wait_agent</name>\n<description>Tools for spawning and managing sub-agents." \
        in prompt
    _, streamed, events = send(client, rec, stream=True)
    for final in (whole, streamed):
        assert final.status == "completed" and [o.type for o in final.output] == ["function_call"]
        call = final.output[0]
        assert (call.name, call.namespace, json.loads(call.arguments)) == ("wait_agent", "multi_agent_v1",
                                                                            {"timeout_ms": 30000})
    done = next(e for e in events if e.type == "response.output_item.done")
    assert done.item.namespace == "multi_agent_v1" and done.item.name == "wait_agent"
    args = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(args.arguments) == {"timeout_ms": 30000}
    # the call handed back (as Codex does, name + namespace) renders under its qualified name again
    ScriptedEngine.script = "done"
    body = dict(rec["body"])
    item = whole.output[0].model_dump(exclude_none=True)
    body["input"] = rec["body"]["input"] + [item, {"type": "function_call_output", "call_id": item["call_id"],
                                                   "output": "agent finished"}]
    _, again, _ = send(client, rec, body)
    assert again.output_text == "done"
    assert "<function=multi_agent_v1__wait_agent>\n<parameter=timeout_ms>\n30000" in ScriptedEngine.prompts[-1]


def test_custom_tool_in_the_prompt_and_its_call_back(client):
    rec = record(FIXTURES[3])  # codex-4: functions.exec is a custom tool with a lark grammar
    assert rec["body"]["input"][0]["type"] == "additional_tools"
    ScriptedEngine.script = EXEC
    _, whole, _ = send(client, rec)
    prompt = ScriptedEngine.prompts[-1]
    start = prompt.index("<name>functions__exec</name>")
    exec_tool = prompt[start:prompt.index("</function>", start)]
    assert "<parameter>\n<name>input</name>\n<type>string</type>" in exec_tool
    assert "write the whole text as the string parameter `input`" in exec_tool
    assert "lark grammar:\nstart: pragma_source | plain_source" in exec_tool
    _, streamed, events = send(client, rec, stream=True)
    for final in (whole, streamed):
        assert final.status == "completed" and [o.type for o in final.output] == ["custom_tool_call"]
        call = final.output[0]
        assert (call.name, call.namespace, call.input) == ("exec", "functions", EXEC_INPUT)
        assert call.call_id.startswith("call_")
    kinds = [e.type for e in events]
    assert "response.custom_tool_call_input.delta" in kinds and "response.function_call_arguments.delta" not in kinds
    assert [e.input for e in events if e.type == "response.custom_tool_call_input.done"] == [EXEC_INPUT]
    # handed back as Codex does: the custom_tool_call and its custom_tool_call_output
    ScriptedEngine.script = "done"
    body = dict(rec["body"])
    item = whole.output[0].model_dump(exclude_none=True)
    body["input"] = rec["body"]["input"] + [item, {"type": "custom_tool_call_output", "call_id": item["call_id"],
                                                   "output": "hi"}]
    _, again, _ = send(client, rec, body, stream=True)
    assert again.output_text == "done"
    assert f"<function=functions__exec>\n<parameter=input>\n{EXEC_INPUT}\n</parameter>" in ScriptedEngine.prompts[-1]
    assert "<tool_response>\nhi\n</tool_response>" in ScriptedEngine.prompts[-1]


def _err(r: httpx.Response, param: str) -> str:
    assert r.status_code == 400, (r.status_code, r.text)
    e = r.json()["error"]
    assert e["param"] == param, e
    return e["message"]


def test_what_stays_refused(server):
    rec = record(FIXTURES[0])
    body = rec["body"]
    # forcing a built-in tool: it cannot be run
    msg = _err(post(server, rec, {**body, "tool_choice": {"type": "web_search"}}), "tool_choice")
    assert "web_search" in msg
    # only built-in tools, and a call required
    _err(post(server, rec, {**body, "tools": [{"type": "web_search"}], "tool_choice": "required"}), "tool_choice")
    # a typo is not a hint
    assert "client_metdata" in _err(post(server, rec, {**body, "client_metdata": {}}), "client_metdata")
    _err(post(server, rec, {**body, "text": {"verbosty": "low"}}), "text")
    _err(post(server, rec, {**body, "reasoning": {"context": "everything"}}), "reasoning")
    # a tool type nobody knows, a field a namespaced tool does not have
    assert "'bogus'" in _err(post(server, rec, {**body, "tools": [{"type": "bogus"}]}), "tools")
    ns = next(t for t in body["tools"] if t["type"] == "namespace")
    bad = {**ns, "tools": [{**ns["tools"][0], "defer_loading": True}]}
    _err(post(server, rec, {**body, "tools": [bad]}), "tools")
    # a flat tool named like a namespaced one
    clash = {"type": "function", "name": "multi_agent_v1__wait_agent", "parameters": {"type": "object"}}
    assert "unique" in _err(post(server, rec, {**body, "tools": body["tools"] + [clash]}), "tools")
    # tool_choice naming a tool that is not there; a custom tool's output with no call before it
    _err(post(server, rec, {**body, "tool_choice": {"type": "custom", "name": "exec_command"}}), "tool_choice")
    orphan = {"type": "custom_tool_call_output", "call_id": "nope", "output": "x"}
    _err(post(server, rec, {**body, "input": body["input"] + [orphan]}), f"input[{len(body['input'])}].call_id")


def test_forced_namespaced_tool_by_its_bare_or_qualified_name(client):
    rec = record(FIXTURES[0])
    ScriptedEngine.script = WAIT
    for name in ("wait_agent", "multi_agent_v1__wait_agent"):
        body = {**rec["body"], "tool_choice": {"type": "function", "name": name}}
        _, final, _ = send(client, rec, body)
        assert final.tool_choice.name == name
        assert [(o.type, o.name, o.namespace) for o in final.output] == [("function_call", "wait_agent",
                                                                          "multi_agent_v1")]


def test_stored_namespaced_call_continues_under_its_qualified_name(client):
    """store: true keeps the conversation as the template renders it: previous_response_id continues a namespaced
    call with its qualified name, as the model wrote it."""
    rec = record(FIXTURES[0])
    ScriptedEngine.script = WAIT
    _, first, _ = send(client, rec, {**rec["body"], "store": True})
    call = first.output[0]
    assert (call.name, call.namespace) == ("wait_agent", "multi_agent_v1")
    ScriptedEngine.script = "done"
    body = {**rec["body"], "store": True, "previous_response_id": first.id,
            "input": [{"type": "function_call_output", "call_id": call.call_id, "output": "agent finished",
                       "name": call.name, "namespace": call.namespace}]}
    _, second, _ = send(client, rec, body, stream=True)
    assert second.output_text == "done" and second.previous_response_id == first.id
    assert "<function=multi_agent_v1__wait_agent>\n<parameter=timeout_ms>\n30000" in ScriptedEngine.prompts[-1]
