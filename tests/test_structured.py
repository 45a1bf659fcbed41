"""Constrained decoding (deltaserve.text.structured) on the embedded tokenizer, driven by a random 'model'.

A random walk over the allowed tokens stands in for the model: whatever it picks, the text must
parse and validate. Walks are biased to finish so they end in a bounded number of steps.
"""
import json
import random

import jsonschema
import pytest

from deltaserve.text.parsers import extract_tool_calls
from deltaserve.text.structured import GrammarError, GuideFactory


def _tokenizer():
    try:
        from deltaserve.text.tokenizer import load_tokenizer
    except ImportError:  # the project tokenizer has not landed: a small byte-level BPE of the same kind
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tr = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                 initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(['{"name": "x", "age": 3} hello world <parameter=city>'] * 10, tr)
        tok.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t in ["<think>", "</think>", "<tool_call>", "</tool_call>"]])
        hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
        hf.eos_token_ids = [hf.eos_token_id]
        return hf
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def tok():
    return _tokenizer()


@pytest.fixture(scope="module")
def factory(tok):
    return GuideFactory.for_tokenizer(tok)


def _decode(tok, ids):
    if hasattr(tok, "decode"):
        return tok.decode(ids)
    raise AssertionError


def walk(tok, guide, vocab, rnd, max_steps=400, prefer_short=0.85):
    """Sample uniformly among allowed tokens, preferring the shortest ones (which close structures sooner)."""
    out = []
    eos = set(GuideFactory.for_tokenizer(tok).ll_tokenizer.eos_tokens)
    for _ in range(max_steps):
        if guide.is_finished():
            break
        mask = guide.allowed_tokens(vocab)
        allowed = mask.nonzero().flatten().tolist() if mask is not None else list(range(vocab))
        assert allowed, "a guide must always allow something"
        if eos & set(allowed) and rnd.random() < 0.9:
            break
        if rnd.random() < prefer_short:
            lens = {t: len(_decode(tok, [t])) for t in allowed}
            best = min(lens.values())
            allowed = [t for t in allowed if lens[t] == best]
        t = rnd.choice(allowed)
        guide.accept(t)
        out.append(t)
    return _decode(tok, out)


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green"]},
    },
    "required": ["name", "age", "ok", "color"],
    "additionalProperties": False,
}


def test_json_schema_random_walks_validate(tok, factory):
    rnd = random.Random(0)
    g = factory.json_schema_grammar(SCHEMA)
    for _ in range(5):
        text = walk(tok, factory.guide(g), factory.vocab_size + 7, rnd)
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object(tok, factory):
    rnd = random.Random(1)
    g = factory.json_object_grammar()
    for _ in range(3):
        text = walk(tok, factory.guide(g), factory.vocab_size, rnd)
        assert isinstance(json.loads(text), dict)


def test_bad_schema_is_grammar_error(factory):
    with pytest.raises(GrammarError):
        factory.json_schema_grammar({"type": "no-such-type"})
    with pytest.raises(GrammarError):
        factory.json_schema_grammar([1, 2])


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7},
                       "note": {"type": "string", "maxLength": 5},
                       "opts": {"type": "object", "properties": {"x": {"type": "boolean"}},
                                "required": ["x"], "additionalProperties": False}},
        "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}},
]


@pytest.mark.parametrize("named", [None, "get_weather", "ping"])
def test_tool_call_grammar_random_walks_parse(tok, factory, named):
    rnd = random.Random(2)
    g = factory.tool_call_grammar(TOOLS, named)
    params = TOOLS[0]["function"]["parameters"]
    for _ in range(4):
        text = walk(tok, factory.guide(g), factory.vocab_size, rnd)
        content, calls = extract_tool_calls(text, TOOLS)
        assert calls, text
        assert content is None, (content, text)
        for c in calls:
            if named:
                assert c.name == named
            args = json.loads(c.arguments)
            if c.name == "get_weather":
                jsonschema.validate(args, params)
            else:
                assert args == {}


def test_tool_grammar_errors(factory):
    with pytest.raises(GrammarError):
        factory.tool_call_grammar(TOOLS, "nope")
    with pytest.raises(GrammarError):
        factory.tool_call_grammar([])


def test_wait_for_think_end(tok, factory):
    g = factory.guide(factory.json_object_grammar(), wait_for_think_end=True)
    assert g.allowed_tokens(factory.vocab_size) is None
    ids = tok.encode("some thoughts</think>", add_special_tokens=False) if not hasattr(tok, "eos_token_ids") or \
        "add_special_tokens" in str(getattr(tok.encode, "__doc__", "")) else tok.encode("some thoughts</think>")
    for t in ids:
        g.accept(t)
    mask = g.allowed_tokens(factory.vocab_size)
    assert mask is not None and 0 < int(mask.sum()) < factory.vocab_size


BOUNDED = {"type": "object", "properties": {
    "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
    "tag": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 4},
    "note": {"type": "string", "minLength": 2, "maxLength": 5},
    "mode": {"const": "fast"},
    "level": {"enum": [1, 2, 3]},
    "days": {"type": "integer", "minimum": 2, "maximum": 5},
    "odd": {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 13},
    "ratio": {"type": "number", "minimum": 0.5, "maximum": 2},
    "maybe": {"type": ["string", "null"], "maxLength": 3}},
    "required": ["code", "tag", "note", "mode", "level", "days", "odd", "ratio", "maybe"]}


def test_tool_grammar_honours_parameter_bounds(tok, factory):
    """maxLength, pattern (with a length too), const, enum and numeric bounds hold inside the call grammar, so
    every bounded parameter ends: a random walk always completes the call, and its arguments validate."""
    tools = [{"type": "function", "function": {"name": "bounded", "parameters": BOUNDED}}]
    g = factory.tool_call_grammar(tools, "bounded")
    rnd = random.Random(4)
    for _ in range(4):
        guide = factory.guide(g)
        text = walk(tok, guide, factory.vocab_size, rnd, max_steps=600, prefer_short=0.5)
        content, calls = extract_tool_calls(text, tools)
        assert content is None and len(calls) == 1, text
        jsonschema.validate(json.loads(calls[0].arguments), BOUNDED)


def test_tool_grammar_bound_errors(factory):
    bad = {"type": "object", "properties": {"s": {"type": "string", "minLength": 5, "maxLength": 2}}}
    with pytest.raises(GrammarError, match="maxLength"):
        factory.tool_call_grammar([{"type": "function", "function": {"name": "f", "parameters": bad}}], "f")


def test_thinking_budget_forces_think_end(tok, factory):
    from deltaserve.text.structured import ThinkingBudgetGuide

    end = tok.token_to_id("</think>")
    inner = factory.guide(factory.json_object_grammar(), wait_for_think_end=True)
    g = ThinkingBudgetGuide(inner, end, budget=3)
    word = tok.encode(" thought")[0]
    for _ in range(3):
        assert g.allowed_tokens(factory.vocab_size) is None  # thinking freely within the budget
        g.accept(word)
    mask = g.allowed_tokens(factory.vocab_size)
    assert mask.nonzero().flatten().tolist() == [end]  # the budget is spent: only </think>
    g.accept(end)
    after = g.allowed_tokens(factory.vocab_size)  # now the answer's grammar applies
    assert after is not None and 0 < int(after.sum()) < factory.vocab_size and not g.is_finished()
    free = ThinkingBudgetGuide(None, end, budget=1)
    free.accept(word)
    free.accept(end)
    assert free.allowed_tokens(factory.vocab_size) is None and not free.is_finished()
