"""The metering proxy's reading of answers (bench/stream_meter.py) on answers recorded from deltaserve and
llama-server (tests/fixtures/streams), and its budget cap (bench/capture.cap_budget).

Each recorded answer is fed in pieces of random sizes (a line, an event or a UTF-8 character cut anywhere, as a
socket delivers them); the usage it yields is the one the answer states, read by hand off the files."""
import json
import os
import random

import pytest

from deltaserve.bench.capture import cap_budget
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


def meter_of(raw: bytes, streamed: bool, rng: random.Random) -> StreamMeter:
    m = StreamMeter(streamed=streamed)
    i = 0
    while i < len(raw):
        n = rng.randint(1, 97)
        m.feed(raw[i:i + n])
        i += n
    m.finish()
    return m


@pytest.mark.parametrize("name", sorted(USAGE))
def test_usage_and_first_content_of_recorded_answers(name):
    with open(os.path.join(STREAMS, name + ".txt"), "rb") as f:
        raw = f.read()
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
