"""Recorded Claude Code traffic through the real engine: what the prefix cache serves each request.

Session A (tests/fixtures/agents/claude-code-3, then -4: a tool_use and its tool_result appended) and session
B (claude-code-5, then -6: resumed with `-c`), another first prompt and another billing line, on the embedded
model through /v1/messages as Claude Code sent them (max_tokens lowered to one token: only the prompt is
measured). The counts are exact: B's first request reads every token it shares with A (the tools, the whole
system text and the first user message up to the typed prompt) rounded down to the checkpoint grid, and a
continued turn reads its previous prompt rounded down to the 64-token grid of the runs layout.
"""
import json
import os
import sys

import httpx
import pytest

from deltaserve.config import EngineConfig
from deltaserve.server import build_app
from deltaserve.server.anthropic.input import messages_spec
from deltaserve.server.anthropic.protocol import MessagesRequest
from deltaserve.server.chat_spec import render_prompt
from deltaserve.text.tokenizer import load_tokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server_support import InProcessServer, wait_healthy

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "agents")
PAGE = 64  # the runs layout's page (the default layout): a hit lands on its grid
CHECKPOINT_GRID = 128  # --checkpoint-grid's default: where a first prompt leaves checkpoints for other sessions


def body(n: int) -> dict:
    with open(os.path.join(FIXTURES, f"claude-code-{n}.json")) as f:
        return {**json.load(f)["body"], "stream": False, "max_tokens": 1}


@pytest.fixture(scope="module")
def served():
    srv = InProcessServer(build_app(EngineConfig(), accept_any_model_name=True))
    wait_healthy(srv.base, timeout=240)
    yield srv
    srv.stop()


def usage(srv, n: int) -> dict:
    r = httpx.post(f"{srv.base}/v1/messages", json=body(n), timeout=600)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_claude_code_sessions_read_what_they_share_from_the_cache(served):
    tok = load_tokenizer(None)  # the embedded model's, which the server renders with
    a1, b1, a2, b2 = (tok.encode(render_prompt(tok, messages_spec(MessagesRequest.model_validate(body(n)))))
                      for n in (3, 5, 4, 6))
    user = tok.encode("<|im_start|>user")
    system = next(i for i in range(len(a1)) if a1[i:i + len(user)] == user)  # the tools and the system text
    common = next(i for i, (x, y) in enumerate(zip(a1, b1)) if x != y)
    assert common > system > 15000  # then the first user message up to the typed prompt
    assert a1 == a2[:len(a1)] and b1 == b2[:len(b1)]  # each turn renders as the prefix of the next

    u = usage(served, 3)
    assert u["cache_read_input_tokens"] == 0 and u["input_tokens"] == len(a1)
    u = usage(served, 5)  # session B's first request: all it shares with A, to a resume point A left
    # (before the resume-point policy: the 128-token grid's last point before `common`; now a structural point,
    # where the first user message's part that B changed begins, lies closer)
    assert common >= u["cache_read_input_tokens"] >= common // CHECKPOINT_GRID * CHECKPOINT_GRID >= system
    assert u["cache_read_input_tokens"] + u["input_tokens"] == len(b1)
    for prev, n, now in ((a1, 4, a2), (b1, 6, b2)):  # continued turns: the whole previous prompt, on the page grid
        u = usage(served, n)
        assert u["cache_read_input_tokens"] == len(prev) // PAGE * PAGE >= 0.95 * len(prev)
        assert u["cache_read_input_tokens"] + u["input_tokens"] == len(now)


def test_the_system_prefix_is_checkpointed_without_the_grid():
    """With the checkpoint grid off (as under a full pool, where grid checkpoints are not taken), session B's first
    request still reads the tools, the whole system text and the first user message up to the part it changed:
    session A kept its resume points there (declared: Claude Code's cache_control breakpoints; structural: the
    system prefix's end, where the messages and the first user message's parts begin), within the budget. Session
    B saves only the structural point where it parts from A (and its prompt and step checkpoints)."""
    from deltaserve.server.resume_points import resume_points, system_prefix_end

    tok = load_tokenizer(None)
    spec_a, spec_b = (messages_spec(MessagesRequest.model_validate(body(n))) for n in (3, 5))
    text_a = render_prompt(tok, spec_a)
    a1, ends = tok.encode_with_ends(text_a)
    b1 = tok.encode(render_prompt(tok, spec_b))
    common = next(i for i, (x, y) in enumerate(zip(a1, b1)) if x != y)
    points = resume_points(tok, spec_a, text_a, a1, ends)
    user = tok.encode("<|im_start|>user")
    system = next(i for i in range(len(a1)) if a1[i:i + len(user)] == user)
    end = system_prefix_end(tok, spec_a, a1)
    assert system < end <= system + 4  # the user turn's opening tokens are shared too
    # the last of A's points (each on its page boundary) at or before where B parts
    best = max(p // PAGE * PAGE for ps in points.values() for p in ps if p // PAGE * PAGE <= common)
    srv = InProcessServer(build_app(EngineConfig(checkpoint_grid=0), accept_any_model_name=True))
    try:
        wait_healthy(srv.base, timeout=240)

        def saves() -> dict[str, float]:
            metrics = httpx.get(f"{srv.base}/metrics", timeout=30).text
            return {ln.split('kind="')[1].split('"')[0]: float(ln.rsplit(" ", 1)[1]) for ln in metrics.splitlines()
                    if ln.startswith("deltaserve_checkpoints_saved_by_kind_total{")}

        assert usage(srv, 3)["cache_read_input_tokens"] == 0
        after_a = saves()
        assert after_a["declared"] >= 2 and after_a["structural"] >= 1 and after_a["grid"] == 0
        u = usage(srv, 5)
        assert u["cache_read_input_tokens"] == best >= end // PAGE * PAGE
        assert u["cache_read_input_tokens"] >= 0.95 * common
        hits = httpx.get(f"{srv.base}/metrics", timeout=30).text
        assert any(ln.startswith("deltaserve_checkpoints_hit_by_kind_total{") and 'kind="structural"' in ln
                   and not ln.endswith(" 0.0") for ln in hits.splitlines())
    finally:
        srv.stop()


def qwen_body(n: int) -> dict:
    with open(os.path.join(FIXTURES, f"qwen-code-{n}.json")) as f:
        sent = json.load(f)["body"]
    sent.pop("stream_options", None)
    return {**sent, "stream": False, "max_tokens": 1}


def test_the_newest_user_turns_part_boundaries_are_checkpointed():
    """Qwen Code sends its first user message as parts (reminders of skills, tools and the date, then what was
    typed) and, a request later, re-sends that message without the date reminder. The first request hinted where
    the message's last two parts begin (part_hints), so with the grid off the second reads up to the reminder, not
    only the system prefix."""
    from deltaserve.server.resume_points import first_difference, part_hints, system_prefix_end
    from deltaserve.server.openai.protocol import ChatCompletionRequest
    from deltaserve.server.openai.routes import chat_spec

    tok = load_tokenizer(None)
    specs = [chat_spec(ChatCompletionRequest.model_validate(qwen_body(n))) for n in (2, 3)]
    texts = [render_prompt(tok, s) for s in specs]
    (a, ends), b = tok.encode_with_ends(texts[0]), tok.encode(texts[1])
    hints = part_hints(tok, specs[0], texts[0], a, ends)
    cut = part_hints(tok, specs[0], texts[0], a, None)  # without offsets: the prompt against its text cut there
    date = texts[0].index("<system-reminder>\nThe current date")
    assert len(hints) == 2 and cut[0] == first_difference(tok.encode(texts[0][:date]), a)
    assert all(c - 2 <= h <= c for h, c in zip(hints, cut))
    parted = first_difference(a, b)  # where the second request leaves the first: at the date reminder
    assert parted - PAGE < hints[0] <= parted
    assert system_prefix_end(tok, specs[0], a) < parted - 2 * PAGE  # the date reminder is well past the system


@pytest.mark.slow
def test_the_next_request_reads_up_to_the_part_boundary():
    """The engine's side of the above, on the embedded model with the grid off: the second request reads up to the
    date reminder's page, from the part-boundary checkpoint the first request left."""
    from deltaserve.server.resume_points import part_hints
    from deltaserve.server.openai.protocol import ChatCompletionRequest
    from deltaserve.server.openai.routes import chat_spec

    tok = load_tokenizer(None)
    spec = chat_spec(ChatCompletionRequest.model_validate(qwen_body(2)))
    text = render_prompt(tok, spec)
    hints = part_hints(tok, spec, text, *tok.encode_with_ends(text))
    srv = InProcessServer(build_app(EngineConfig(checkpoint_grid=0), accept_any_model_name=True))
    try:
        wait_healthy(srv.base, timeout=240)
        got = []
        for n in (2, 3):
            r = httpx.post(f"{srv.base}/v1/chat/completions", json=qwen_body(n), timeout=600)
            assert r.status_code == 200, r.text
            got.append(r.json()["usage"])
        cached = (got[1].get("prompt_tokens_details") or {}).get("cached_tokens")
        assert cached == hints[0] // PAGE * PAGE, (cached, hints)
    finally:
        srv.stop()


def opencode_body(workdir: str | None = None) -> dict:
    """opencode's main request (fixture opencode-2), its working directory replaced by workdir: another session."""
    with open(os.path.join(FIXTURES, "opencode-2.json")) as f:
        sent = json.load(f)["body"]
    sent.pop("stream_options", None)
    system = sent["messages"][0]
    old = system["content"].split("Working directory: ")[1].split("\n")[0]
    if workdir is not None:
        system["content"] = system["content"].replace(old, workdir)
    return {**sent, "stream": False, "max_tokens": 1}


def test_sessions_in_other_directories_part_near_the_system_prefix_end():
    """opencode ends its one-string system text with an <env> block holding the session's working directory, Qwen
    Code names the project's memory folder after it, and Codex its home (instructions hold what every session shares
    first and the session's own last), so two sessions in other directories part inside the system text, a little
    before the end of the system prefix (whose point no other session reads). The back-off points before that end
    (backoff_points) leave one less than max(x, 256) tokens before where they part, x tokens before the end."""
    import copy

    from deltaserve.server.openai.protocol import ChatCompletionRequest
    from deltaserve.server.openai.routes import chat_spec
    from deltaserve.server.resume_points import backoff_points, first_difference, resume_points, system_prefix_end
    from deltaserve.server.responses.input import input_messages, with_instructions
    from deltaserve.server.responses.protocol import ResponsesRequest
    from deltaserve.server.responses.routes import responses_spec
    from deltaserve.server.responses.tools import collect_tools

    def codex(n):  # as the Responses route builds its chat request
        with open(os.path.join(FIXTURES, f"codex-{n}.json")) as f:
            req = ResponsesRequest.model_validate(json.load(f)["body"])
        return responses_spec(req, with_instructions(req.instructions, input_messages(req.input, set())),
                              collect_tools(req.tools, req.input, req.tool_choice))

    qwen = qwen_body(2)
    other = copy.deepcopy(qwen)
    other["messages"][0]["content"] = qwen["messages"][0]["content"].replace("-tmp-cap-proj-qwen", "-home-b-proj")
    tok = load_tokenizer(None)
    pairs = [[chat_spec(ChatCompletionRequest.model_validate(b)) for b in bodies]
             for bodies in ((opencode_body(None), opencode_body("/home/b/project")), (qwen, other))]
    pairs.append([codex(1), codex(2)])  # Codex's home folder, named in its instructions' skills paths
    for specs in pairs:
        texts = [render_prompt(tok, s) for s in specs]
        (a, ends), b = tok.encode_with_ends(texts[0]), tok.encode(texts[1])
        parted = first_difference(a, b)
        end = system_prefix_end(tok, specs[0], a)
        assert end > parted > 0.9 * end  # inside the system text, near its end
        points = resume_points(tok, specs[0], texts[0], a, ends)["structural"]
        assert set(backoff_points(end)) < set(points)
        resume = max(p for p in backoff_points(end) if p <= parted)
        assert parted - resume < max(end - parted, 256) and resume // PAGE * PAGE >= 0.95 * parted, (resume, parted)


def test_opencode_sessions_read_up_to_the_env_block():
    """The engine's side, with the grid off (as under a full pool): sessions in other directories part inside
    opencode's one-string system text, at its <env> block, where no message or part boundary lies, a little before
    the system prefix's end. The first session keeps the structural points before that end (backoff_points), so
    the second reads up to the nearest one, >= 95% of what it shares; the second session's request learns the
    junction (the learned source: requests without a key form one group) and keeps a checkpoint there, so the third
    reads the tools and the system text up to the working directory's line."""
    from deltaserve.server.resume_points import backoff_points, first_difference, system_prefix_end
    from deltaserve.server.openai.protocol import ChatCompletionRequest
    from deltaserve.server.openai.routes import chat_spec

    tok = load_tokenizer(None)
    dirs = (None, "/home/b/project", "/srv/c/work")
    specs = [chat_spec(ChatCompletionRequest.model_validate(opencode_body(w))) for w in dirs]
    texts = [render_prompt(tok, s) for s in specs]
    a, b = tok.encode(texts[0]), tok.encode(texts[1])
    shared = first_difference(a, b)
    at = max(p for p in backoff_points(system_prefix_end(tok, specs[0], a)) if p <= shared)
    srv = InProcessServer(build_app(EngineConfig(checkpoint_grid=0), accept_any_model_name=True))
    try:
        wait_healthy(srv.base, timeout=240)
        got = []
        for w in dirs:
            r = httpx.post(f"{srv.base}/v1/chat/completions", json=opencode_body(w), timeout=600)
            assert r.status_code == 200, r.text
            got.append(r.json()["usage"])
        cached = [(u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0 for u in got]
        assert cached[0] == 0 and got[1]["prompt_tokens"] == len(b)
        assert cached[1] == at // PAGE * PAGE >= 0.95 * shared, (cached, at, shared)  # a back-off point
        assert cached[2] == shared // PAGE * PAGE > cached[1], (cached, shared)  # learned from traffic
    finally:
        srv.stop()
