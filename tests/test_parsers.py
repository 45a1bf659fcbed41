"""The qwen3_coder tool-call parser and the qwen3 reasoning parser (no model, no server)."""
import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltaserve.text.parsers import (
    Qwen3CoderToolParser,
    Qwen3ReasoningParser,
    convert_param_value,
    extract_reasoning,
    extract_tool_calls,
    prompt_opens_thinking,
)

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "metric": {"type": "boolean"},
            "ratio": {"type": "number"},
            "opts": {"type": "object"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "maybe": {"type": ["integer", "null"]},
        },
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}},
]

CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


def stream(parser_text: str, cuts: list[int], tools=TOOLS):
    p = Qwen3CoderToolParser(tools)
    content, calls, last = [], [], 0
    for c in sorted(set(cuts)) + [len(parser_text)]:
        d, cs = p.feed(parser_text[last:c])
        content.append(d)
        calls += cs
        last = c
    d, cs = p.finish()
    content.append(d)
    calls += cs
    return "".join(content), calls


def test_single_call_with_types():
    content, calls = extract_tool_calls(CALL, TOOLS)
    assert content is None
    assert len(calls) == 1
    assert calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Paris", "days": 3}
    assert calls[0].id.startswith("call_")


def test_content_before_and_parallel_calls():
    text = "Let me check.\n\n" + CALL + "\n" + CALL.replace("Paris", "Tokyo") + "\n"
    content, calls = extract_tool_calls(text, TOOLS)
    assert content == "Let me check."
    assert [json.loads(c.arguments)["city"] for c in calls] == ["Paris", "Tokyo"]
    assert [c.index for c in calls] == [0, 1]
    assert len({c.id for c in calls}) == 2


def test_conversions():
    p = TOOLS[0]["function"]["parameters"]["properties"]
    assert convert_param_value("true", p["metric"]) is True
    assert convert_param_value("2.5", p["ratio"]) == 2.5
    assert convert_param_value("7", p["ratio"]) == 7
    assert convert_param_value('{"a": 1}', p["opts"]) == {"a": 1}
    assert convert_param_value("{'a': 1}", p["opts"]) == {"a": 1}
    assert convert_param_value('["x", "y"]', p["tags"]) == ["x", "y"]
    assert convert_param_value("null", p["maybe"]) is None
    assert convert_param_value("5", p["maybe"]) == 5
    assert convert_param_value("null", p["city"]) == "null"  # a string parameter keeps its text
    assert convert_param_value("abc", p["days"]) == "abc"  # does not fit: the text itself
    assert convert_param_value("x", None) == "x"


def test_unknown_function_and_param_are_strings():
    text = "<tool_call>\n<function=other>\n<parameter=n>\n5\n</parameter>\n</function>\n</tool_call>"
    content, calls = extract_tool_calls(text, TOOLS)
    assert calls[0].name == "other" and json.loads(calls[0].arguments) == {"n": "5"}


def test_missing_parameter_close_and_tool_call_close():
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n2\n</function>"
    content, calls = extract_tool_calls(text, TOOLS)
    assert content is None and json.loads(calls[0].arguments) == {"city": "Paris", "days": 2}


def test_no_parameters():
    content, calls = extract_tool_calls("<tool_call>\n<function=noop>\n</function>\n</tool_call>", TOOLS)
    assert calls[0].name == "noop" and calls[0].arguments == "{}"


MALFORMED = [
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis",  # truncated
    "<tool_call>\nnot a function\n</tool_call>",
    "<tool_call>\n<function=>\n</function>\n</tool_call>",
    "<tool_call>\n<function=get weather>\n</function>",
    "<tool_call>\n<function=get_weather\n<parameter=city>x</parameter></function>",
    "<tool_call>\n<function=get_weather>\n<parameter=ci ty>\nx\n</parameter>\n</function>",
    "<tool_call>",
    "<function=",
    "<tool_call><tool_call><function=a></function>",
    "</tool_call></function><function=x",
]


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_is_content(text):
    content, calls = extract_tool_calls("Before. " + text, TOOLS)
    assert calls == []
    assert content == "Before. " + text


def test_valid_call_then_malformed_tail():
    text = CALL + "\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome"
    content, calls = extract_tool_calls(text, TOOLS)
    assert len(calls) == 1
    assert content == "\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome"


def test_plain_text_unchanged():
    for t in ["", "hello", "a < b and c > d", "x <tool", "trailing space   ", "<tool_cal"]:
        content, calls = extract_tool_calls(t, TOOLS)
        assert calls == [] and (content or "") == t


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_streaming_equals_nonstreaming(data):
    pieces = ["Hi ", "there.\n\n", CALL, "\n", CALL.replace("3", "4"), "tail", " ", "<tool", "_call>",
              "\n<function=noop>", "\n</function>", "\n</tool_call>", "<parameter=x>", "</parameter>", "<", "\n"]
    text = "".join(data.draw(st.lists(st.sampled_from(pieces), max_size=10)))
    cuts = data.draw(st.lists(st.integers(0, max(len(text), 0)), max_size=12))
    c_full, calls_full = extract_tool_calls(text, TOOLS)
    c_str, calls_str = stream(text, cuts)
    assert (c_full or "") == c_str
    assert [(c.name, c.arguments) for c in calls_full] == [(c.name, c.arguments) for c in calls_str]
    # nothing is lost: every character is content or inside a call (or whitespace around calls)
    if not calls_full:
        assert c_str == text


def test_streaming_token_by_token():
    text = "Sure." + "\n\n" + CALL
    p = Qwen3CoderToolParser(TOOLS)
    out, calls = [], []
    for ch in text:
        d, cs = p.feed(ch)
        out.append(d)
        calls += cs
        assert "<" not in d  # no partial tags leak as content
    d, cs = p.finish()
    out.append(d)
    calls += cs
    assert "".join(out) == "Sure." and len(calls) == 1


# ---------------------------------------------------------------- reasoning


def test_prompt_opens_thinking():
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n")


@pytest.mark.parametrize("earlier", [
    "<|im_start|>user\nWhat does <think> do?<|im_end|>\n",  # a user question about the tag
    "<|im_start|>user\n<tool_response>\nline 3: <think>\n</tool_response><|im_end|>\n",  # a tool result
    "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\nI write <think> first<|im_end|>\n"  # an answer re-sent
    "<|im_start|>user\nand?<|im_end|>\n",
])
def test_only_the_generation_prompt_opens_thinking(earlier):
    """A <think> in a finished turn is text: whether the new answer starts in reasoning is the generation
    prompt's own opening, in both template styles (the model opens the block itself / the template opens it)."""
    assert not prompt_opens_thinking(earlier + "<|im_start|>assistant\n")  # the model writes its own <think>
    assert prompt_opens_thinking(earlier + "<|im_start|>assistant\n<think>\n")  # Qwen3.5's template, thinking on
    assert not prompt_opens_thinking(earlier + "<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking off
    # an Anthropic prefill is part of the turn: one that opens a think block does count
    assert prompt_opens_thinking(earlier + "<|im_start|>assistant\n<think>\nLet me")
    assert not prompt_opens_thinking(earlier)  # no assistant turn is open (the last one is closed)


def test_reasoning_nonstreaming():
    assert extract_reasoning("plan</think>\n\nanswer", True) == ("plan", "answer")
    assert extract_reasoning("<think>plan</think>answer") == ("plan", "answer")
    assert extract_reasoning("just an answer") == (None, "just an answer")
    assert extract_reasoning("still thinking", True) == ("still thinking", "")
    assert extract_reasoning("x </think> y") == (None, "x </think> y")
    assert extract_reasoning("", True) == ("", "")


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="ab<>/thinkn\n ", max_size=40), st.booleans(), st.randoms())
def test_reasoning_streaming_equals_nonstreaming(text, start, rnd):
    text = rnd.choice(["", "<think>", "x"]) + text + rnd.choice(["", "</think>", "</th"]) + text
    r_full, c_full = extract_reasoning(text, start)
    p = Qwen3ReasoningParser(start)
    rs, cs, i = [], [], 0
    while i < len(text):
        j = i + rnd.randint(1, 5)
        r, c = p.feed(text[i:j])
        rs.append(r)
        cs.append(c)
        i = j
    r, c = p.finish()
    rs.append(r)
    cs.append(c)
    assert "".join(cs) == c_full
    assert "".join(rs) == (r_full or "")


def test_reasoning_streaming_holds_partial_end_tag():
    p = Qwen3ReasoningParser(True)
    assert p.feed("abc</th") == ("abc", "")
    assert p.feed("ink>\n\nhi") == ("", "hi")


def test_random_garbage_never_crashes():
    rnd = random.Random(0)
    alphabet = ["<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>",
                ">", "<", "\n", "f", "x", " ", "{", "}", "[", "]", "'", '"', "1", "null", "true"]
    for _ in range(2000):
        text = "".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 30)))
        c, calls = extract_tool_calls(text, TOOLS)
        for call in calls:
            assert isinstance(json.loads(call.arguments), dict)
        if not calls:
            assert (c or "") == text


# ---------------------------------------------------------------- a forced call cut by max_tokens

NOTE_TOOLS = [{"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "n": {"type": "integer"}, "content": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "wait", "parameters": {"type": "object", "properties": {}}}}]
FULL = ("<tool_call>\n<function=write_file>\n<parameter=path>\na.txt\n</parameter>\n<parameter=n>\n3\n</parameter>\n"
        "<parameter=content>\nhello world, and more\n</parameter>\n</function>\n</tool_call>")


def salvage(text, forced_name="write_file", cuts=()):
    p = Qwen3CoderToolParser(NOTE_TOOLS, forced_name=forced_name, forced=True)
    content, calls, last = "", [], 0
    for c in list(cuts) + [len(text)]:
        d, k = p.feed(text[last:c])
        content, calls, last = content + d, calls + k, c
    d, k = p.finish(salvage=True)
    return content + d, calls + k


@pytest.mark.parametrize("named", ["write_file", None])
def test_salvage_returns_the_call_with_the_arguments_so_far(named):
    """Every cut of a forced call gives a call (never markup as content) whose arguments are a prefix of the
    final ones: finished parameters whole, the one being written up to the cut, a half-written name dropped."""
    final = {"path": "a.txt", "n": 3, "content": "hello world, and more"}
    # `required`: the name must be known, and "w" could still be write_file or wait
    first = 1 if named else len("<tool_call>\n<function=wr")
    for cut in range(len(FULL) + 1):
        content, calls = salvage(FULL[:cut], named, cuts=[cut // 2])
        assert content == "", (cut, content)  # never the markup as content
        if cut < first:
            assert calls == [], cut
            continue
        assert len(calls) == 1 and calls[0].name == "write_file", cut
        args = json.loads(calls[0].arguments)
        for k, v in args.items():
            assert (final[k] if k == "content" else str(final[k])).startswith(str(v)), (cut, k, v)
        assert calls[0].complete == (cut >= FULL.index("</function>") + len("</function>")), cut
    assert json.loads(calls[0].arguments) == final


def test_salvage_picks_the_only_tool_a_cut_name_can_be():
    _, calls = salvage("<tool_call>\n<function=wri", forced_name=None)
    assert [c.name for c in calls] == ["write_file"] and calls[0].arguments == "{}" and not calls[0].complete
    _, calls = salvage("<tool_call>\n<function=", forced_name=None)  # write_file or wait: unknown
    assert calls == []


def test_salvage_after_a_complete_call_and_without_salvage():
    two = FULL + "\n" + FULL[:70]
    _, calls = salvage(two, forced_name=None)
    assert [c.complete for c in calls] == [True, False] and json.loads(calls[1].arguments) == {"path": "a.txt"}
    p = Qwen3CoderToolParser(NOTE_TOOLS, forced_name="write_file")
    content, calls = p.feed(FULL[:70])
    c2, k2 = p.finish()  # not cut by max_tokens (or not forced): the unfinished call is content, as before
    assert calls + k2 == [] and content + c2 == FULL[:70]
