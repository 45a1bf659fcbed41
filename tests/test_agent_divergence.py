"""Where a client's next request stops continuing the previous one, and why (bench/clis/divergence.py), on
recorded Claude Code requests (tests/fixtures/agents) rendered as the server renders them (embedded model)."""
import copy
import json
import os

import pytest

from deltaserve.bench.clis.divergence import explain, first_difference, render
from deltaserve.text.tokenizer import load_tokenizer

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "agents")


def fixture(name: str) -> tuple[str, dict]:
    with open(os.path.join(FIXTURES, name + ".json")) as f:
        d = json.load(f)
    return d["path"], d["body"]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def first(tok):
    path, body = fixture("claude-code-3")
    return path, body, tok.encode(render(path, body, tok))


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 4]) == 2
    assert first_difference([1, 2], [1, 2, 3]) == 2 and first_difference([1, 2, 3], [1, 2]) == 2
    assert first_difference([], [1]) == 0


def test_a_continued_turn_re_sends_its_prompt_whole(tok, first):
    path, _, prev = first
    nxt = tok.encode(render(*fixture("claude-code-4"), tok))
    d = explain(tok, prev, prev_output=12, prev_reasoned=False, nxt=nxt)
    assert d.position == len(prev) and d.where == "previous answer"
    assert d.cause == "the previous answer is re-sent re-rendered"
    d = explain(tok, prev, prev_output=12, prev_reasoned=True, nxt=nxt)
    assert d.cause == "the template drops the previous turn's reasoning"


def test_another_session_shares_the_tools_and_system_text_up_to_its_prompt(tok, first):
    _, _, prev = first
    nxt = tok.encode(render(*fixture("claude-code-5"), tok))
    d = explain(tok, prev, prev_output=0, prev_reasoned=False, nxt=nxt)
    # the billing line differs between the sessions but is not rendered: the first difference is the typed prompt
    assert d.where == "message 1 (user)" and d.after.startswith("What files are in this directory?")
    text = tok.decode(prev[:d.position], skip_special_tokens=False)
    assert "</tools>" in text and "x-anthropic-billing-header" not in text


def test_a_changed_tool_list_is_named(tok, first):
    path, body, prev = first
    fewer = copy.deepcopy(body)
    fewer["tools"] = fewer["tools"][:-1]
    d = explain(tok, prev, 0, False, tok.encode(render(path, fewer, tok)))
    assert d.where == "tools" and d.cause == "the tool list changed" and d.position < len(prev)


def test_a_changed_date_is_named(tok):
    path, body = fixture("claude-code-3")
    dated = [copy.deepcopy(body) for _ in range(2)]
    for b, day in zip(dated, ("2026-12-02", "2026-12-03")):
        b["system"][-1]["text"] += f"\nToday's date is {day}."
    prev, nxt = (tok.encode(render(path, b, tok)) for b in dated)
    d = explain(tok, prev, 0, False, nxt)
    assert d.where == "message 0 (system)" and d.cause == "a date or number in the text changed"


def test_a_prompt_re_sent_as_it_was_blames_the_cache(tok, first):
    _, _, prev = first
    d = explain(tok, prev, prev_output=0, prev_reasoned=False, nxt=list(prev))
    assert (d.where, d.position) == ("none", len(prev)) and "cache did not hold" in d.cause
