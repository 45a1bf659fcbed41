"""The metering proxy's reading of answers (bench/stream_meter.py) on answers recorded from deltaserve and
llama-server (tests/fixtures/streams), its budget cap (bench/capture.cap_budget) and its natural-stop rewrite
(bench/natural_stop.py).

Each recorded answer is fed in pieces of random sizes (a line, an event or a UTF-8 character cut anywhere, as a
socket delivers them); the usage it yields is the one the answer states, read by hand off the files."""
import json
import os
import random

import pytest

from deltaserve.bench.capture import cap_budget
from deltaserve.bench.natural_stop import LineRewriter, rewrite_whole
from deltaserve.bench.stream_meter import StreamMeter

STREAMS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "streams")

# (prompt, cached, output): every prompt token, those read from the cache, the generated tokens
USAGE = {
    "deltaserve-messages-stream": (23, 0, 8),
    "deltaserve-messages-whole": (23, 0, 8),
    "deltaserve-chat-stream": (None, None, None),  # no stream_options.include_usage: a Chat stream has none
    "deltaserve-chat-whole": (316, 256, 8),
    "deltaserve-chat-usage-stream": (13, 0, 8),
    "deltaserve-responses-stream": (23, 0, 8),
    "deltaserve-responses-whole": (23, 0, 8),
    "llama.cpp-messages-stream": (23, 0, 8),
    "llama.cpp-messages-whole": (23, 19, 8),  # input_tokens 4 + cache_read_input_tokens 19
    "llama.cpp-chat-stream": (316, 0, 8),  # from llama-server's own timings (prompt_n + cache_n, cache_n)
    "llama.cpp-chat-whole": (316, 312, 8),
    "llama.cpp-chat-usage-stream": (13, 0, 8),
    "llama.cpp-responses-stream": (23, 19, 8),
    "llama.cpp-responses-whole": (23, 19, 8),
}


def pieces(raw: bytes, rng: random.Random):
    i = 0
    while i < len(raw):
        n = rng.randint(1, 97)
        yield raw[i:i + n]
        i += n


def meter_of(raw: bytes, streamed: bool, rng: random.Random) -> StreamMeter:
    m = StreamMeter(streamed=streamed)
    for piece in pieces(raw, rng):
        m.feed(piece)
    m.finish()
    return m


def read(name: str) -> bytes:
    with open(os.path.join(STREAMS, name + ".txt"), "rb") as f:
        return f.read()


@pytest.mark.parametrize("name", sorted(USAGE))
def test_usage_and_first_content_of_recorded_answers(name):
    raw = read(name)
    for seed in range(5):
        m = meter_of(raw, name.endswith("-stream"), random.Random(seed))
        assert (m.usage.prompt, m.usage.cached, m.usage.output) == USAGE[name], seed
        assert m.first_content_s is not None and m.first_content_s >= 0
        assert not m.reasoned  # none of these answers reasoned (random weights, 8 tokens)


def _sse(*events: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def test_first_content_waits_for_generated_content():
    """A message_start, a role-only chunk or a response.created is sent before any token: not the clock."""
    m = StreamMeter()
    m.feed(_sse({"type": "message_start", "message": {"usage": {"input_tokens": 5}}},
                {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}))
    m.feed(b'data: {"choices": [{"delta": {"role": "assistant"}}]}\n\n'
           b'data: {"type": "response.created", "response": {}}\n\n')
    assert m.first_content_s is None
    m.feed(_sse({"type": "content_block_delta", "delta": {"type": "text_delta", "text": "a"}}))
    assert m.first_content_s is not None


@pytest.mark.parametrize("events", [
    ({"type": "content_block_start", "content_block": {"type": "thinking", "thinking": ""}},),
    ({"type": "content_block_delta", "delta": {"type": "thinking_delta", "thinking": "hm"}},),
    ({"type": "response.reasoning_text.delta", "delta": "hm"},),
    ({"choices": [{"delta": {"reasoning_content": "hm"}}]},),
    ({"choices": [{"delta": {"reasoning": "hm"}}]},),
])
def test_reasoning_is_seen_in_every_api(events):
    m = StreamMeter()
    m.feed(_sse(*events))
    m.finish()
    assert m.reasoned


def test_a_whole_answer_that_is_not_json_gives_no_usage():
    m = StreamMeter(streamed=False)
    m.feed(b"<html>bad gateway</html>")
    m.finish()
    assert (m.usage.prompt, m.usage.cached, m.usage.output) == (None, None, None)


def test_cap_budget_lowers_each_api_budget_and_says_what_was_asked():
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        raw, asked = cap_budget(json.dumps({key: 32000, "messages": [{"content": "é"}]}).encode(), 16)
        assert asked == 32000 and json.loads(raw) == {key: 16, "messages": [{"content": "é"}]}
    body = json.dumps({"max_tokens": 8}).encode()
    assert cap_budget(body, 16) == (body, None)  # under the cap: the bytes pass as sent
    assert cap_budget(body, 0) == (body, None)  # no cap
    assert cap_budget(b"not json", 16) == (b"not json", None)
    assert cap_budget(b"[1, 2]", 16) == (b"[1, 2]", None)
    # Anthropic's max_tokens must stay above an enabled thinking budget: the cap stops there
    raw, asked = cap_budget(json.dumps({"max_tokens": 4096, "thinking": {"type": "enabled",
                                                                       "budget_tokens": 1024}}).encode(), 16)
    assert json.loads(raw)["max_tokens"] == 1025 and asked == 4096


def ends(raw: bytes) -> set[str]:
    """How an answer says it ended: each stop_reason, finish_reason, status and response event type in it."""
    found = set()

    def walk(x):
        if isinstance(x, dict):
            for k, v in x.items():
                if k in ("stop_reason", "finish_reason", "status") and isinstance(v, str):
                    found.add(f"{k}={v}")
                if k == "type" and isinstance(v, str) and v in ("response.completed", "response.incomplete"):
                    found.add(v)
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    for line in raw.split(b"\n"):
        line = line[5:] if line.startswith(b"data:") else line
        try:
            walk(json.loads(line))
        except ValueError:
            pass
    return found


CUT = {"stop_reason=max_tokens", "finish_reason=length", "status=incomplete", "response.incomplete"}


@pytest.mark.parametrize("name", sorted(USAGE))
def test_natural_stop_turns_a_budget_cut_into_a_natural_end_and_nothing_else(name):
    raw = read(name)
    if name.endswith("-stream"):
        lines = LineRewriter()
        out = b"".join(lines.feed(p) for p in pieces(raw, random.Random(1))) + lines.finish()
        changed = lines.changed
    else:
        out = rewrite_whole(raw)
        changed = out != raw
    assert not ends(out) & CUT
    assert changed == bool(ends(raw) & CUT)  # all were cut at 8 tokens; llama-server's Responses say completed
    assert b"response.incomplete" not in out
    if name.endswith("-stream"):
        assert out.count(b"\n") == raw.count(b"\n")  # line for line
    a, b = meter_of(raw, name.endswith("-stream"), random.Random(0)), meter_of(out, name.endswith("-stream"),
                                                                              random.Random(0))
    assert vars(a.usage) == vars(b.usage)  # the text and the usage pass as sent


def test_natural_stop_leaves_other_bytes_alone():
    for raw in (b"not json", b'{"choices": [{"finish_reason": "stop"}]}', b"[1]"):
        assert rewrite_whole(raw) == raw
    lines = LineRewriter()
    sse = b"event: ping\ndata: {bad json\n\ndata: [DONE]\n\n"
    assert lines.feed(sse) + lines.finish() == sse and not lines.changed
    lines = LineRewriter()
    assert lines.feed(b"event: response.incomplete\r\n") == b"event: response.completed\r\n" and lines.changed
