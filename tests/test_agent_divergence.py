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
    _, _, prev = first
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


def test_a_changed_path_is_named(tok):
    """Two sessions whose system text names their own working directory (the bench's session0, session1)."""
    path, body = fixture("claude-code-3")
    homed = [copy.deepcopy(body) for _ in range(2)]
    for b, n in zip(homed, (0, 1)):
        b["system"][-1]["text"] += f"\nPrimary working directory: /tmp/runs/session{n}/work"
    prev, nxt = (tok.encode(render(path, b, tok)) for b in homed)
    assert explain(tok, prev, 0, False, nxt).cause == "a path in the text changed"


def test_a_prompt_re_sent_as_it_was_blames_the_cache(tok, first):
    _, _, prev = first
    d = explain(tok, prev, prev_output=0, prev_reasoned=False, nxt=list(prev))
    assert (d.where, d.position) == ("none", len(prev)) and "cache did not hold" in d.cause


def _req(name: str, cached: int, prompt: int, output: int = 16, ttft: float = 0.5) -> dict:
    path, body = fixture(name)
    return {"file": name, "method": "POST", "path": path, "body": body, "first_content_s": ttft, "status": 200,
            "usage": {"prompt": prompt, "cached": cached, "output": output}, "reasoned": False}


def test_report_sets_each_request_against_what_it_shares_most_with(tok):
    """Session 1 turn 1 (claude-code-3), session 2 turn 1 (claude-code-5), then session 1's continued turn
    (claude-code-4); a side request without tools is counted, not measured. Session 2's first turn is read
    against session 1's shared prefix, the continued turn against its own previous prompt."""
    from deltaserve.bench.clis.report import analyse, format_report
    a, b, c = (len(tok.encode(render(*fixture(n), tok))) for n in ("claude-code-3", "claude-code-5", "claude-code-4"))
    side = {"file": "side", "method": "POST", "path": "/v1/messages", "body": {"messages": []}, "usage": {}}
    rows = {"deltaserve": [
        {"client": "claude", "session": 0, "turn": 0, "rc": 0, "wall_s": 1.0, "requests": [_req("claude-code-3", 0, a)]},
        {"client": "claude", "session": 1, "turn": 0, "rc": 0, "wall_s": 1.0,
         "requests": [side, _req("claude-code-5", 18048, b)]},
        {"client": "claude", "session": 0, "turn": 1, "rc": 0, "wall_s": 1.0,
         "requests": [_req("claude-code-4", 1000, c, ttft=2.0)]},  # a poor hit: reported with its cause
    ]}
    r = analyse(rows, tok)["servers"]["deltaserve"]["claude"]
    t0, t1, t2 = r["turns"]
    assert (t0["share"], t1["base"], t1["share"]) == (None, 18155, round(18048 / 18155, 4))
    assert t2["base"] == a and t2["share"] == round(1000 / a, 4)
    assert (r["turns_ok"], r["requests"], r["main_requests"]) == (3, 4, 3)
    assert r["first_turn_share_min"] == t1["share"] and r["later_turn_ttft_s"] == 2.0
    (d,) = r["divergences"]  # session 2 read all it could; the continued turn did not
    assert (d["session"], d["turn"], d["could"], d["where"]) == (0, 1, a + 16, "previous answer")
    text = format_report(analyse(rows, tok), {"sessions": 2, "turns": 2, "model": "tiny",
                                                          "model_dir": "-", "max_output_tokens": 16})
    assert "| deltaserve | claude | 3/3 | 4 (3) |" in text and "session 1 turn 2: cached 1000" in text


def test_report_blames_the_server_when_it_read_less_than_the_renderings_share(tok):
    from deltaserve.bench.clis.report import analyse
    a = len(tok.encode(render(*fixture("claude-code-3"), tok)))
    rows = {"llama.cpp": [
        {"client": "claude", "session": 0, "turn": 0, "rc": 0, "wall_s": 1.0, "requests": [_req("claude-code-3", 0, a)]},
        {"client": "claude", "session": 1, "turn": 0, "rc": 0, "wall_s": 1.0, "requests": [_req("claude-code-5", 0, 0)]},
    ]}
    (d,) = analyse(rows, tok)["servers"]["llama.cpp"]["claude"]["divergences"]
    assert d["cause"].startswith("the server did not serve the 18155 tokens both renderings share")


def test_a_failed_request_has_no_first_token_time(tok):
    from deltaserve.bench.clis.report import analyse, format_report
    bad = {**_req("claude-code-3", 0, 0, ttft=0.01), "status": 500, "usage": {},
           "response_body": {"error": {"message": "System message must be at the beginning."}}}
    rows = {"llama.cpp": [{"client": "claude", "session": 0, "turn": 0, "rc": 1, "wall_s": 1.0, "requests": [bad]}]}
    result = analyse(rows, tok)
    t = result["servers"]["llama.cpp"]["claude"]["turns"][0]
    assert t["ttft_s"] is None and t["error"].startswith("500: ") and "System message" in t["error"]
    text = format_report(result, {"sessions": 1, "turns": 1, "model": "m", "model_dir": "-", "max_output_tokens": 16})
    assert "## Turns whose first main request failed" in text and "| 0/1 |" in text
