"""What Claude Code sends to /v1/messages (the requests recorded in tests/fixtures/agents/claude-code-*.json),
replayed through the app: a mid-conversation system message carrying the turn's effort, deferred tools,
adaptive thinking with display "omitted", output_config.effort, context_management, metadata.user_id, the
billing line opening `system`, its beta headers and `?beta=true`.

A fake engine in-process (tests/server_support.py) answers, over the embedded tokenizer and template and over
the real Qwen3.5 ones (skipped, saying why, when the package index cannot be reached to build them); its
context is large enough for the recorded prompts (about 22,500 tokens through the embedded 4,096-token
tokenizer). Answers are parsed with the `anthropic` SDK's beta types, as Claude Code
reads them.
"""
import copy
import json
import os
import sys

import anthropic
import httpx
import pytest

from deltaserve.config import EngineConfig
from deltaserve.server import build_app
from deltaserve.server.anthropic.input import messages_spec
from deltaserve.server.anthropic.protocol import MessagesRequest
from deltaserve.server.chat_spec import render_prompt
from deltaserve.text.parsers import prompt_opens_thinking

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server_support import FakeEngine, InProcessServer, wait_healthy
from util import qwen35_dir

KEY = "sekret"
FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "agents")
SESSIONS = [1, 2, 3, 4, 5, 6]
# what the proxy recorded that is the transport's, not the client's (and the credential, redacted there)
TRANSPORT = {"host", "content-length", "connection", "accept-encoding", "x-api-key"}
BILLING = "x-anthropic-billing-header:"
THINKING = "The user greets me."
BASH = ("<tool_call>\n<function=Bash>\n<parameter=command>\nls\n</parameter>\n<parameter=description>\nList files\n"
        "</parameter>\n</function>\n</tool_call>")


def recorded(n: int) -> dict:
    with open(os.path.join(FIXTURES, f"claude-code-{n}.json")) as f:
        return json.load(f)


def client_headers(rec: dict) -> dict:
    return {k: v for k, v in rec["headers"].items() if k.lower() not in TRANSPORT}


def tokenizer(name: str):
    from deltaserve.text.tokenizer import load_tokenizer
    return load_tokenizer(None if name == "embedded" else qwen35_dir())


def render(tok, body: dict) -> str:
    return render_prompt(tok, messages_spec(MessagesRequest.model_validate(body)))


@pytest.fixture(scope="module", params=["embedded", "qwen3.5"])
def served(request):
    """(server, tokenizer) for one template: the fake engine with the model's tokenizer and a large context."""
    tok = tokenizer(request.param)

    class Engine(FakeEngine):
        def __init__(self, config=None):
            super().__init__(config)
            self.tokenizer = tok
            self.model_config.vocab_size = tok.vocab_size

    srv = InProcessServer(build_app(EngineConfig(max_model_len=65536), api_key=KEY, engine_factory=Engine,
                                    served_model_name=["deltaserve/tiny", "deltaserve"], accept_any_model_name=True))
    wait_healthy(srv.base, timeout=60)
    yield srv, tok
    srv.stop()


@pytest.fixture(scope="module")
def client(served):
    return anthropic.Anthropic(base_url=served[0].base, api_key=KEY, max_retries=0, timeout=120)


def sdk_kwargs(rec: dict, **over) -> dict:
    """The recorded body as the SDK's beta messages.create arguments (it posts to /v1/messages?beta=true, as
    Claude Code does), with the recorded client headers."""
    body = {k: v for k, v in rec["body"].items() if k != "stream"}
    return {**body, **over, "extra_headers": client_headers(rec)}


@pytest.mark.parametrize("n", SESSIONS)
def test_recorded_requests_are_answered(client, n):
    """Every recorded body, max_tokens lowered: a 200 the SDK parses, whole and streamed, the prompt whole."""
    rec = recorded(n)
    kw = sdk_kwargs(rec, max_tokens=16)
    m = client.beta.messages.create(**kw)
    assert m.type == "message" and m.role == "assistant" and m.model == "deltaserve/tiny"
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 16 and m.content
    assert m.usage.input_tokens > 10000  # tools, system and conversation all in the prompt
    with client.beta.messages.stream(**kw) as s:
        types = [e.type for e in s]
        final = s.get_final_message()
    assert types[0] == "message_start" and types[-1] == "message_stop" and "content_block_delta" in types
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 16
    assert final.usage.input_tokens == m.usage.input_tokens


def scripted(rec: dict, tok, answer: str) -> dict:
    """The recorded body with its first prompt making the fake model write `answer` (after the <think> the
    model writes itself when the prompt does not open one)."""
    body = copy.deepcopy(rec["body"])
    first = body["messages"][0]["content"]
    opens = prompt_opens_thinking(render(tok, body))
    first[-1]["text"] = f"SCRIPT<<{'' if opens else '<think>'}{answer}|||"
    return body


@pytest.mark.parametrize("n", SESSIONS)
def test_recorded_requests_as_sent_complete_a_turn(served, client, n):
    """The recorded request as sent (its max_tokens of 32,000 or 128,000 clamped to what is left of the context,
    streamed as Claude Code streams), with a prompt that makes the fake model think, then answer or call Bash:
    the turn ends with the thinking returned as written (display "omitted" is a display preference), the text
    or the tool_use, and the stop reason Claude Code acts on."""
    srv, tok = served
    rec = recorded(n)
    call = n == 3  # session A's first turn: the stub answered it with a Bash call, which claude-code-4 continues
    body = scripted(rec, tok, f"\n{THINKING}\n</think>\n\n" + (BASH if call else "hi"))
    assert body["stream"] is True and body["max_tokens"] >= 32000

    r = httpx.post(f"{srv.base}{rec['path']}?{rec['query']}", json=body, timeout=120,
                   headers={**client_headers(rec), "x-api-key": KEY})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text

    kw = sdk_kwargs({**rec, "body": body})
    events = list(client.beta.messages.create(**kw, stream=True))
    whole = client.beta.messages.create(**kw, stream=False)
    with client.beta.messages.stream(**kw) as s:
        list(s)
        streamed = s.get_final_message()
    assert events[0].type == "message_start" and events[-1].type == "message_stop"
    for m in (whole, streamed):
        assert [b.type for b in m.content] == ["thinking", "tool_use" if call else "text"]
        assert m.content[0].thinking.strip() == THINKING and m.content[0].signature
        if call:
            assert m.stop_reason == "tool_use" and m.content[1].name == "Bash"
            assert m.content[1].input == {"command": "ls", "description": "List files"}
            assert m.content[1].id.startswith("toolu_")
        else:
            assert m.stop_reason == "end_turn" and m.content[1].text == "hi"
    assert whole.usage.input_tokens == streamed.usage.input_tokens


@pytest.mark.parametrize("name", ["embedded", "qwen3.5"])
def test_two_sessions_share_the_prompt_up_to_the_first_prompt(name):
    """Sessions A and B (another first prompt, another billing line): their prompts share every token of the tools,
    the system text and the first user message up to the prompt typed, so the prefix cache serves B what A ran.
    The billing line is not in the prompt; the environment text (a mid-conversation system message) is."""
    tok = tokenizer(name)
    a, b = render(tok, recorded(3)["body"]), render(tok, recorded(5)["body"])
    ia, ib = tok.encode(a), tok.encode(b)
    common = next(i for i, (x, y) in enumerate(zip(ia, ib)) if x != y)
    head = a[:a.index("</system-reminder>") + len("</system-reminder>")]  # the first user message up to its prompt
    assert head.count("<|im_start|>user") == 1 and b.startswith(head)
    assert len(tok.decode(ia[:common], skip_special_tokens=False)) >= len(head)
    assert common >= len(tok.encode(head)) - 1 > 5000
    assert BILLING not in a and "cc_version" not in a
    assert "You are a Claude agent" in a and "# Environment" in a


@pytest.mark.parametrize("name", ["embedded", "qwen3.5"])
def test_a_turn_renders_as_the_prefix_of_the_next(name):
    """Session A: the first turn (its environment message as text blocks) is a prefix of the second (the same
    message as a string, then the tool_use and its tool_result), so the second turn reads the first from the
    cache."""
    tok = tokenizer(name)
    first, second = render(tok, recorded(3)["body"]), render(tok, recorded(4)["body"])
    assert second.startswith(first) and len(second) > len(first)


def _spec(**body):
    base = {"model": "deltaserve", "max_tokens": 32000, "messages": [{"role": "user", "content": "hi"}]}
    return messages_spec(MessagesRequest.model_validate({**base, **body}))


def test_a_mid_conversation_system_message_is_a_user_message_in_its_place():
    env = [{"type": "text", "text": "# Environment", "cache_control": {"type": "ephemeral"}}]
    spec = _spec(system=[{"type": "text", "text": f"{BILLING} cc_version=2.1.328.593; cc_entrypoint=sdk-cli;"},
                         {"type": "text", "text": "You are an agent."}],
                 messages=[{"role": "user", "content": "hi"},
                           {"role": "system", "content": env, "output_config": {"effort": "high"}},
                           {"role": "assistant", "content": "hello"},
                           {"role": "user", "content": "bye"}])
    assert spec.messages == [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "hi"},
                             {"role": "user", "content": "# Environment"},
                             {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}]
    # opening the conversation with no `system` (or only the billing line): it is the system prompt
    spec = _spec(system=[{"type": "text", "text": f"{BILLING} cc_version=1"}],
                 messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert spec.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    spec = _spec(system="S", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert spec.messages == [{"role": "system", "content": "S"}, {"role": "user", "content": "Be brief."},
                             {"role": "user", "content": "hi"}]


def test_effort_sets_adaptive_thinking():
    """adaptive: low off, medium on with 8,192 thinking tokens at most, high / xhigh / max on with max_tokens
    only; the last mid-conversation effort wins over the top-level one; an explicit enabled / disabled thinking
    wins over any effort; no thinking object: off whatever the effort."""
    adaptive = {"type": "adaptive", "display": "omitted"}

    def switch(**body):
        spec = _spec(**body)
        return spec.template_kwargs["enable_thinking"], spec.thinking_budget

    assert switch(thinking=adaptive) == (True, None)
    assert switch(thinking=adaptive, output_config={"effort": "low"}) == (False, None)
    assert switch(thinking=adaptive, output_config={"effort": "medium"}) == (True, 8192)
    assert switch(thinking=adaptive, output_config={"effort": "medium"}, max_tokens=4000) == (True, None)
    for effort in ("high", "xhigh", "max"):
        assert switch(thinking=adaptive, output_config={"effort": effort}) == (True, None)
    turn = [{"role": "user", "content": "hi"}, {"role": "system", "content": "env", "output_config": {"effort": "low"}}]
    assert switch(thinking=adaptive, output_config={"effort": "high"}, messages=turn) == (False, None)
    assert switch(thinking={"type": "enabled", "budget_tokens": 2048}, output_config={"effort": "low"}) == (True, 2048)
    assert switch(thinking={"type": "disabled"}, output_config={"effort": "max"}) == (False, None)
    assert switch(output_config={"effort": "high"}) == (False, None)


def _err(r, *what):
    assert r.status_code == 400, (r.status_code, r.text)
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    for w in what:
        assert w in body["error"]["message"], body
    return body["error"]["message"]


def test_what_cannot_be_honoured_or_is_misspelt_is_still_refused(served):
    srv = served[0]
    url, headers = srv.base + "/v1/messages?beta=true", {"x-api-key": KEY}
    ok = {"model": "deltaserve", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    assert httpx.post(url, headers=headers, json={
        **ok, "thinking": {"type": "adaptive", "display": "omitted"}, "output_config": {"effort": "max"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns",
                                                                                      "value": 2}}]},
        "metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "s"})},
        "tools": [{"name": "t", "input_schema": {"type": "object"}, "defer_loading": True}]}).status_code == 200
    _err(httpx.post(url, headers=headers, json={**ok, "output_config": {"effort": "extreme"}}), "output_config.effort")
    _err(httpx.post(url, headers=headers, json={**ok, "output_config": {"efort": "low"}}), "output_config.efort")
    _err(httpx.post(url, headers=headers, json={**ok, "thinking": {"type": "adaptive", "display": "hidden"}}),
         "thinking")
    _err(httpx.post(url, headers=headers, json={**ok, "tools": [{"name": "t", "input_schema": {"type": "object"},
                                                                 "defer_load": True}]}), "tools.0.defer_load")
    _err(httpx.post(url, headers=headers, json={**ok, "context_management": {"edits": [
        {"type": "clear_tool_uses_20250919"}]}}), "context_management.edits.0", "clear_tool_uses_20250919")
    _err(httpx.post(url, headers=headers, json={**ok, "context_management": {"edits": [
        {"type": "clear_thinking_20251015", "keep": "some"}]}}), "context_management.edits.0.keep")
    _err(httpx.post(url, headers=headers, json={**ok, "messages": [
        {"role": "user", "content": "x", "output_config": {"effort": "low"}}]}), "messages.0.output_config")
    _err(httpx.post(url, headers=headers, json={**ok, "messages": [
        {"role": "user", "content": "x"}, {"role": "system", "content": "y", "output_config": {"effort": "low",
                                                                                             "format": None}}]}),
         "messages.1.output_config.format")
    _err(httpx.post(url, headers=headers, json={**ok, "messages": [{"role": "user", "content": "x"}, {
        "role": "system", "content": [{"type": "tool_result", "tool_use_id": "a", "content": "b"}]}]}),
         "messages.1", "system message")
    _err(httpx.post(url, headers=headers, json={**ok, "messages": [{"role": "tool", "content": "x"}]}),
         "messages.0.role")


def test_count_tokens_takes_the_conversation_as_claude_code_sends_it(served, client):
    rec = recorded(4)
    body = {k: rec["body"][k] for k in ("model", "messages", "system", "tools", "thinking", "output_config",
                                        "context_management")}
    n = client.beta.messages.count_tokens(**body, extra_headers=client_headers(rec)).input_tokens
    assert n == client.beta.messages.create(**sdk_kwargs(rec, max_tokens=1)).usage.input_tokens


def test_claude_codes_first_call_is_not_an_error_that_stops_it(served):
    """Claude Code's HEAD /api/hello is a fire-and-forget preconnect (its failure is caught): a 404, no 5xx."""
    r = httpx.head(served[0].base + "/api/hello")
    assert r.status_code == 404
