"""The resume-point policy: where a request keeps the checkpoints a later request can resume from.

Table-driven: for each source (declared, structural, learned, grid), given requests, the points kept and their
order under a budget (scheduler/policy.py choose_resume_points, scheduler/learned.py); the client-declared source
from a Claude Code request's cache_control breakpoints and from the `resume_points` extension field on all three
APIs (server/resume_points.py); a point changes no output (hit == cold, bit for bit, with each source on and off);
and synthetic clients, each placing what differs between its sessions somewhere else, read their shared prefix
from the cache with the grid off.
"""
import json
import os
import random
import sys

import httpx
import pytest

from deltaserve.config import EngineConfig
from deltaserve.errors import ConfigError
from deltaserve.memory.save_kind import RESUME_SOURCES, SaveKind
from deltaserve.scheduler.learned import MAX_AGE, LearnedJunctions
from deltaserve.scheduler.policy import choose_resume_points

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from util import greedy, make_llm, random_tokens, signature  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "agents")
D, S, L = SaveKind.DECLARED, SaveKind.STRUCTURAL, SaveKind.LEARNED

# (wanted by source, prompt length, budget, grid) -> (points kept in position order, grid spacing left)
CHOICES = [
    # each source alone: positions floored to the 64-token block, out-of-prompt and repeated ones dropped
    ({D: [130, 700, 5000, 0]}, 1000, 8, 0, (((128, D), (640, D)), 0)),
    ({S: [700, 650, 64]}, 1000, 8, 0, (((64, S), (640, S)), 0)),
    ({L: [512]}, 1000, 8, 0, (((512, L),), 0)),
    ({}, 1000, 8, 128, ((), 128)),  # the grid alone: the configured spacing while the budget holds it
    # a block two sources name is kept once, for the higher-priority one
    ({D: [640], S: [650, 128], L: [128, 900]}, 1000, 8, 0, (((128, S), (640, D), (896, L)), 0)),
    # under a budget: by source priority, then in each source's own order (most likely read first)
    ({L: [64], S: [900, 128, 256], D: [512]}, 1000, 3, 0, (((128, S), (512, D), (896, S)), 0)),
    ({L: [64], S: [900], D: [512]}, 1000, 2, 0, (((512, D), (896, S)), 0)),
    ({D: [512, 128]}, 1000, 1, 128, (((512, D),), 0)),  # nothing left for the grid
    # the grid takes what is left, spread over the whole prompt: a long prompt gets a sparse grid
    ({D: [512]}, 22_900, 4, 128, (((512, D),), 5760)),
    ({}, 22_900, 24, 128, ((), 1024)),
    ({}, 22_900, 0, 128, ((), 0)),
]


@pytest.mark.parametrize("wanted, n, budget, grid, want", CHOICES)
def test_choose_resume_points(wanted, n, budget, grid, want):
    points, spacing = choose_resume_points(wanted, 64, n, budget, grid)
    assert (points, spacing) == want
    assert len(points) + (len(range(spacing, n, spacing)) if spacing else 0) <= budget  # the budget holds
    assert [p for p, _ in points] == sorted(p for p, _ in points)


def test_the_budget_in_count_and_bytes():
    """--resume-points is the count; --resume-point-bytes lowers it to the checkpoints it holds, by default (0) an
    eighth of the pool: the 0.8B shape's 19.5 MB checkpoints in its default pool (2,333 pages) make 11, not 48."""
    from deltaserve.scheduler.build import resume_point_budget

    ckpt = 786_432  # the embedded default's checkpoint
    assert resume_point_budget(EngineConfig(), ckpt) == 48
    assert resume_point_budget(EngineConfig(), ckpt, 2 << 30) == 48  # 341 fit in an eighth: the count binds
    assert resume_point_budget(EngineConfig(), ckpt, 32 << 20) == 5  # 4 MiB
    assert resume_point_budget(EngineConfig(resume_point_bytes=10 << 20), ckpt) == 13
    assert resume_point_budget(EngineConfig(resume_point_bytes=10 << 20), ckpt, 2 << 30) == 13  # given: it rules
    assert resume_point_budget(EngineConfig(resume_points=4, resume_point_bytes=10 << 20), ckpt) == 4
    assert resume_point_budget(EngineConfig(), 19_537_920, 2_333 * 786_432) == 11
    with pytest.raises(ConfigError, match="--resume-points must be >= 0"):
        EngineConfig(resume_points=-1)


def test_sources_are_ordered_and_in_the_one_table():
    assert RESUME_SOURCES == (SaveKind.DECLARED, SaveKind.STRUCTURAL, SaveKind.LEARNED, SaveKind.GRID)
    assert SaveKind("hint") is SaveKind.STRUCTURAL  # a disk-tier record from before the sources were named


def chain(*blocks: str) -> list[str]:
    """Block hashes of a prompt made of the given blocks: each a hash of everything before it (a hash chain)."""
    return ["/".join(blocks[:i + 1]) for i in range(len(blocks))]


# requests of one key, in order, as (prompt blocks, learned points wanted)
LEARNING = [
    # sessions of an agent that part at block 3 (the working directory): the second learns it, the third reads it
    [("t s s a x y", []), ("t s s b x y", [192]), ("t s s c x y", [192])],
    # a conversation's turns continue each other: no junction (the prompt checkpoint serves the next turn)
    [("t s a", []), ("t s a b", []), ("t s a b c", [])],
    # two junctions: the newest pass first
    [("t a x", []), ("t b x", [64]), ("t b y", [128, 64]), ("t a z", [128, 64])],
]


@pytest.mark.parametrize("requests", LEARNING)
def test_learned_junctions(requests):
    lj = LearnedJunctions()
    got = [lj.points("agent", chain(*p.split()), 64) for p, _ in requests]
    assert got == [want for _, want in requests]
    assert LearnedJunctions().points("other", chain(*requests[-1][0].split()), 64) == []  # keys do not mix


def test_learned_junctions_age_out():
    lj = LearnedJunctions()
    lj.points("k", chain("t", "s", "a"), 64)
    assert lj.points("k", chain("t", "s", "b"), 64) == [128]
    for i in range(MAX_AGE + 1):  # traffic that never passes the junction again
        lj.points("k", chain("u", str(i)), 64)
    # forgotten: no request passed it for MAX_AGE requests, and the prompts it came from are no longer compared
    assert lj.points("k", chain("t", "s", "c"), 64) == []


# ---------------------------------------------------------------- the client-declared source


def _tok():
    from deltaserve.text.tokenizer import load_tokenizer

    return load_tokenizer(None)


def _points(tok, spec):
    from deltaserve.server.chat_spec import render_prompt
    from deltaserve.server.resume_points import resume_points

    text = render_prompt(tok, spec)
    ids, ends = tok.encode_with_ends(text)
    return text, ids, ends, resume_points(tok, spec, text, ids, ends)


def _at_block_end(text, ends, p, block_end):
    """Position p is the point of a block that ends at character block_end: the last token that ends by then is
    token p (the point keeps a token of margin: that token may merge with what follows in another request)."""
    return ends[p] <= block_end < ends[p + 1]


def test_claude_code_cache_control_breakpoints_are_declared_points():
    """Claude Code marks its cache breakpoints with cache_control: the last two system blocks (its identity line
    and its instructions; the billing line before them is dropped) and the newest message's block. Each becomes a
    declared point, at the end of that block in the render."""
    from deltaserve.server.anthropic.input import messages_spec
    from deltaserve.server.anthropic.protocol import MessagesRequest

    tok = _tok()
    for n in (3, 4, 6):
        with open(os.path.join(FIXTURES, f"claude-code-{n}.json")) as f:
            body = json.load(f)["body"]
        spec = messages_spec(MessagesRequest.model_validate(body))
        text, ids, ends, points = _points(tok, spec)
        marked_system = [b["text"] for b in body["system"] if b.get("cache_control")]
        assert len(marked_system) == 2
        # the system blocks are joined into one text: each marked one ends where its text ends in the render
        sys_at = text.index(marked_system[0])
        block_ends = [sys_at + len(marked_system[0]), text.index(marked_system[1]) + len(marked_system[1])]
        last = body["messages"][-1]["content"][0]
        last_text = last.get("text") or (last["content"] if isinstance(last.get("content"), str)
                                         else "".join(b["text"] for b in last.get("content") or []))
        block_ends.append(text.rindex(last_text) + len(last_text))
        declared = points["declared"]
        assert len(declared) == 3, (n, declared)
        for p, e in zip(declared, block_ends):
            assert _at_block_end(text, ends, p, e), (n, p, e)
        assert declared[0] < declared[1] < declared[2] < len(ids)


LONG = " ".join(f"word{i % 97}" for i in range(40))


def test_resume_points_field_on_all_three_apis():
    """The extension field names messages (input items) whose end is a declared point, on Chat Completions,
    Responses and Messages alike; an index outside the list is a 400-shaped validation error."""
    from pydantic import ValidationError

    from deltaserve.server.anthropic.input import messages_spec
    from deltaserve.server.anthropic.protocol import MessagesRequest
    from deltaserve.server.openai.protocol import ChatCompletionRequest
    from deltaserve.server.openai.routes import chat_spec
    from deltaserve.server.responses.input import input_messages
    from deltaserve.server.responses.protocol import ResponsesRequest
    from deltaserve.server.responses.routes import responses_spec

    tok = _tok()
    first, second = "first " + LONG, "second " + LONG
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": first},
        {"role": "assistant", "content": "ok"}, {"role": "user", "content": second}], "resume_points": [1]})
    resp = ResponsesRequest.model_validate({"model": "m", "instructions": "be brief", "input": [
        {"role": "user", "content": first}, {"role": "assistant", "content": "ok"},
        {"role": "user", "content": second}], "resume_points": [0], "prompt_cache_key": "k"})
    msgs = MessagesRequest.model_validate({"model": "m", "max_tokens": 4, "system": "be brief", "messages": [
        {"role": "user", "content": first}, {"role": "assistant", "content": "ok"},
        {"role": "user", "content": second}], "resume_points": [0]})
    specs = [chat_spec(chat), responses_spec(resp, input_messages(resp.input, None, resp.resume_points)),
             messages_spec(msgs)]
    assert specs[1].cache_key == "k"
    for spec in specs:
        text, ids, ends, points = _points(tok, spec)
        end = text.index(first) + len(first)
        assert len(points["declared"]) == 1 and _at_block_end(text, ends, points["declared"][0], end)
    for model, body in ((ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]}),
                        (ResponsesRequest, {"input": "x"}),
                        (MessagesRequest, {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}]})):
        with pytest.raises(ValidationError, match="resume_points"):
            model.model_validate({"model": "m", **body, "resume_points": [3]})


def test_structural_points_come_from_the_render():
    """Knowing no client: the system prefix's end and the points before it, where the newest turn's messages and the
    newest user message's last parts begin. A line of the system text is no point of its own, path or not."""
    from deltaserve.server.openai.protocol import ChatCompletionRequest
    from deltaserve.server.openai.routes import chat_spec

    tok = _tok()
    system = LONG + "\nWorking directory: /home/a/proj\n" + LONG
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": [{"type": "text", "text": "reminder " + LONG},
                                     {"type": "text", "text": "typed " + LONG}]}]})
    spec = chat_spec(req)
    text, ids, ends, points = _points(tok, spec)
    s = points["structural"]
    user_at = text.index("reminder ")
    typed_at = text.index("typed ")
    assert any(_at_block_end(text, ends, p, user_at) for p in s)  # the user message begins
    assert any(_at_block_end(text, ends, p, typed_at - 1) or _at_block_end(text, ends, p, typed_at) for p in s)
    assert "declared" not in points
    line = text.index("Working directory")
    assert not any(_at_block_end(text, ends, p, line) for p in s)
    from deltaserve.server.resume_points import backoff_points, system_prefix_end
    assert s[0] == system_prefix_end(tok, spec, ids) and set(backoff_points(s[0])) < set(s)


@pytest.mark.parametrize("prefix_end, parts_at, expected", [
    (None, None, []),  # no system prefix: no point
    (300, None, [44]),  # only the distances that stay inside the prompt
    (10_000, 9_900, [9_744, 9_488, 8_976, 7_952]),  # parts 100 before the end: resumes 156 before it
    (10_000, 9_500, [9_744, 9_488, 8_976, 7_952]),  # 500 before: resumes 12 before (at 9,488)
    (10_000, 8_200, [9_744, 9_488, 8_976, 7_952]),  # 1,800 before: resumes 248 before (at 7,952)
])
def test_backoff_points_bound_the_loss_of_a_parting_before_the_system_prefix_end(prefix_end, parts_at, expected):
    """Points at 256, 512, 1,024 and 2,048 tokens before the system prefix's end, nearest first: a session that parts
    x tokens before the end (x <= 2,048) resumes less than max(x, 256) tokens before where it parts."""
    from deltaserve.server.resume_points import backoff_points

    pts = backoff_points(prefix_end)
    assert pts == expected
    if parts_at is not None:
        x = prefix_end - parts_at
        resume = max(p for p in pts if p <= parts_at)
        assert parts_at - resume < max(x, 256)


# ---------------------------------------------------------------- a point changes no output

@pytest.mark.parametrize("source", ["declared", "structural", "learned", "grid", "no hint"])
def test_each_source_changes_no_output(source):
    """Three sessions share a 700-token prefix; the source under test places the point there (the learned one from
    traffic: the requests share a key). Every hit is bit-identical to a cold run of the same prompt, and the
    sessions a source serves read the prefix from the cache."""
    rng = random.Random(7)
    system = random_tokens(rng, 700)
    prompts = [system + random_tokens(rng, 150 + 29 * i) for i in range(3)]
    llm = make_llm(max_num_batched_tokens=2048, kv_cache_memory=128 << 20,
                   checkpoint_grid=128 if source == "grid" else 0)
    extra = {"declared": {"cache_hints": [700]}, "structural": {"cache_hints": {"structural": [700]}},
             "learned": {"cache_key": "agent"}}.get(source, {})
    hits = [llm.generate([{"prompt_token_ids": p, "cache_salt": "s", **extra}], greedy(), use_tqdm=False)[0]
            for p in prompts]
    colds = [llm.generate([{"prompt_token_ids": p, "cache_salt": f"cold-{i}"}], greedy(), use_tqdm=False)[0]
             for i, p in enumerate(prompts)]
    assert [signature(h) for h in hits] == [signature(c) for c in colds]
    cached = [h.num_cached_tokens for h in hits]
    kinds = llm.engine.memory.stats.checkpoints_saved_by_kind
    hit_kinds = llm.engine.memory.stats.checkpoints_hit_by_kind
    if source in ("declared", "structural"):
        assert cached == [0, 640, 640] and kinds[source] == 1 and hit_kinds[source] == 2
    elif source == "learned":  # the second session parts from the first and learns where: the third reads it
        assert cached == [0, 0, 640] and kinds["learned"] == 1 and hit_kinds["learned"] == 1
    elif source == "grid":
        assert cached == [0, 640, 640]
    else:
        assert cached == [0, 0, 640]  # the point the second learned where it parted (the salt is the key)


def test_cache_hints_refuse_an_unknown_source():
    llm = make_llm()
    with pytest.raises(Exception, match="cache_hints"):
        llm.generate([{"prompt_token_ids": [5, 6, 7], "cache_hints": {"grid": [2]}}], greedy(), use_tqdm=False)


# ---------------------------------------------------------------- synthetic clients, through the server

def _text(seed: str, words: int) -> str:
    rng = random.Random(seed)
    vocab = ["alpha", "build", "check", "delta", "edit", "file", "grep", "hold", "index", "join", "keep", "list",
             "merge", "note", "open", "patch", "query", "read", "stage", "test", "undo", "view", "write", "yield"]
    return " ".join(rng.choice(vocab) + str(rng.randrange(100)) for _ in range(words))


def _tools(seed: str, tool_note: str = "") -> list[dict]:
    return [{"type": "function", "function": {"name": f"tool_{i}", "description": _text(f"{seed}-tool{i}", 300)
             + (f" {tool_note} " + _text(f"{seed}-tail{i}", 60) if tool_note and i == 1 else ""),
             "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}} for i in range(3)]


def _chat(seed: str, k: int, where: str) -> tuple[str, dict]:
    """Session k of a synthetic Chat Completions client that writes its session's details (a working directory,
    a date) at `where`."""
    cwd, date = f"/proj{k}", f"2026-12-0{k + 1}"
    system = _text(seed + "-sys", 450)
    user_text = _text(seed + "-user", 150)
    tools = _tools(seed, f"Files live under /home/u{k}/repo." if where == "tool description" else "")
    if where == "working directory of one segment":  # inside a one-string system text
        system = system + f"\nWorking directory: {cwd}\n" + _text(seed + "-sys2", 100)
    if where == "~/ path":
        user_text = _text(seed + "-pre", 100) + f" See ~/notes{k}/todo.md for context. " + user_text
    if where == "date and directory in the first user message":
        user_text = _text(seed + "-pre", 100) + f" Today is {date}; I work in {cwd}. " + user_text
    content = user_text
    if where == "own content part":
        content = [{"type": "text", "text": _text(seed + "-reminder", 100)},
                   {"type": "text", "text": f"Working directory: {cwd}. Date: {date}."},
                   {"type": "text", "text": user_text}]
    return "/v1/chat/completions", {"model": "m", "max_tokens": 1, "tools": tools, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": content}]}


def _messages(seed: str, k: int, where: str) -> tuple[str, dict]:
    """Session k of a synthetic Messages client: its details in a second system message, or after a system block
    it marks with cache_control."""
    cwd = f"/proj{k}"
    tools = [{"name": f"tool_{i}", "description": _text(f"{seed}-tool{i}", 60),
              "input_schema": {"type": "object"}} for i in range(3)]
    user = _text(seed + "-user", 150)
    if where == "second system message":
        return "/v1/messages", {"model": "m", "max_tokens": 1, "tools": tools,
                                "system": _text(seed + "-sys", 450), "messages": [
                                    {"role": "user", "content": user},
                                    {"role": "system", "content": f"Working directory: {cwd}"}]}
    marked = where == "cache_control"
    system = [{"type": "text", "text": _text(seed + "-sys", 450), **({"cache_control": {"type": "ephemeral"}}
                                                                     if marked else {})},
              {"type": "text", "text": f"\nWorking directory: {cwd}\n" + _text(seed + "-sys2", 100)}]
    return "/v1/messages", {"model": "m", "max_tokens": 1, "tools": tools, "system": system,
                            "messages": [{"role": "user", "content": user}]}


# (client, where its sessions differ, the first session that reads >= 95% of what it shares with the earlier ones)
CLIENTS = [
    (_messages, "cache_control", 2),  # declared
    (_messages, "second system message", 2),  # structural: where a message begins
    (_chat, "own content part", 2),  # structural: where a part begins
    # structural: inside one text, no boundary marks it, but near the system prefix's end (backoff_points)
    (_chat, "working directory of one segment", 2),
    (_chat, "~/ path", 3),
    (_chat, "date and directory in the first user message", 3),
    (_chat, "tool description", 3),
    (_messages, "not marked", 3),  # the same system blocks, no cache_control: its last part begins there (2)
]


# one client a source by default (declared, structural at a message and at a part, learned); the other learned
# places under the slow mark (the same sources at other places of the prompt)
SLOW_PLACES = ("~/ path", "date and directory in the first user message", "tool description", "not marked")


@pytest.mark.parametrize("places", ["one a source", pytest.param("all", marks=pytest.mark.slow)])
def test_synthetic_clients_read_their_shared_prefix_without_the_grid(places):
    """Each client sends three sessions that differ only in its details at one place; with the grid off (no
    checkpoints but resume points, as under a pool too full for the grid), a session reads >= 95% of the prefix
    it shares with the earlier ones from the first repeat where a source marks the place (client-declared,
    structural) and from the third session on where only traffic can (learned)."""
    from deltaserve.server import build_app
    from deltaserve.server.anthropic.input import messages_spec
    from deltaserve.server.anthropic.protocol import MessagesRequest
    from deltaserve.server.chat_spec import render_prompt
    from deltaserve.server.openai.protocol import ChatCompletionRequest
    from deltaserve.server.openai.routes import chat_spec
    from deltaserve.server.resume_points import first_difference
    from server_support import InProcessServer, wait_healthy

    tok = _tok()
    srv = InProcessServer(build_app(EngineConfig(checkpoint_grid=0), accept_any_model_name=True))
    report = []
    try:
        wait_healthy(srv.base, timeout=240)
        for client, where, first in CLIENTS:
            if places != "all" and where in SLOW_PLACES:
                continue
            seen: list[list[int]] = []
            for k in range(3):
                path, body = client(where.replace(" ", "-"), k, where)
                spec = (messages_spec(MessagesRequest.model_validate(body)) if path == "/v1/messages"
                        else chat_spec(ChatCompletionRequest.model_validate(body)))
                ids = tok.encode(render_prompt(tok, spec))
                shared = max((first_difference(ids, s) for s in seen), default=0)
                r = httpx.post(srv.base + path, json=body, timeout=600)
                assert r.status_code == 200, r.text
                u = r.json()["usage"]
                cached = u.get("cache_read_input_tokens")
                if cached is None:
                    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                report.append((where, k, shared, cached))
                if k:
                    assert shared > 2000 and cached <= shared, (where, k, shared, cached)
                if k + 1 >= first:
                    assert cached >= 0.95 * shared, (where, k, shared, cached)
                seen.append(ids)
    finally:
        srv.stop()
    print(report)
