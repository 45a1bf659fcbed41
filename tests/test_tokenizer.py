"""The embedded tokenizer, its chat template, checkpoint loading and incremental detokenization."""
from __future__ import annotations

import filecmp
import json
import os
import random
import subprocess
import sys

import pytest

from deltaserve.text.tokenizer import (EMBEDDED_TOKENIZER_DIR, IncrementalDetokenizer, TokenizerError, load_tokenizer,
                                  write_tokenizer)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPECIALS = ["<|endoftext|>", "<|im_end|>", "<|im_start|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
            "<tool_response>", "</tool_response>"]
TEXTS = ["Hello, world! The cache holds 1234 pages.", "def f(x):\n    return x * 2\n", '{"city": "Paris", "days": 3}',
         "Hi 🙂 中文テキスト café — 𝔘𝔫𝔦", "  leading and trailing  \n\n", "", "a\tb\r\nc"]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


def test_embedded_layout(tok):
    assert tok.vocab_size == len(tok) <= 4096
    assert [tok.token_to_id(s) for s in SPECIALS] == list(range(9))
    assert tok.eos_token_ids == frozenset({0, 1}) and tok.eos_token_id == 1 and tok.pad_token_id == 0
    assert tok.special_token_ids == frozenset({0, 1, 2, 186, 187, 188, 189})
    assert tok.is_byte_level and tok.token_to_id("<not-a-token>") is None
    total = sum(os.path.getsize(EMBEDDED_TOKENIZER_DIR / f) for f in os.listdir(EMBEDDED_TOKENIZER_DIR))
    assert total < 2_000_000
    assert load_tokenizer(None) is tok  # cached


def test_image_tokens_take_bytes_no_text_has(tok):
    """Qwen3.5's image tokens sit on the ids of the byte symbols of 0xF5..0xF8, which UTF-8 never contains:
    the tokenization of any text is what it was before they came, as the byte symbols' ids were unreachable."""
    from deltaserve.text.tokenizer import byte_decoder

    ids = [tok.token_to_id(t) for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")]
    assert ids == [186, 187, 188, 189]
    sym = {b: c for c, b in byte_decoder().items()}
    assert all(tok.token_to_id(sym[b]) is None for b in (0xF5, 0xF6, 0xF7, 0xF8))
    assert tok.token_to_id(sym[0xF4]) == 185 and tok.token_to_id(sym[0xF9]) == 190  # their neighbours stay
    rng = random.Random(5)
    planes = [(32, 127), (128, 0x800), (0x800, 0xD800), (0xE000, 0x10000), (0x10000, 0x110000)]
    for _ in range(300):
        text = "".join(chr(rng.randrange(*rng.choice(planes))) for _ in range(rng.randrange(1, 30)))
        assert not set(tok.encode(text)) & set(ids), text
    assert tok.encode("a<|vision_start|><|image_pad|><|vision_end|>b")[1:4] == [186, 188, 187]


def test_chat_template_renders_images_as_qwen35(tok):
    """An image part (the servers' {"type": "image"}, or Qwen's own image / image_url keys) renders as Qwen3.5's
    template renders it, with add_vision_id's "Picture N: " when asked; text-only chats are unchanged."""
    msgs = [{"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "image", "image": "x"},
                                         {"type": "image_url", "image_url": {"url": "u"}}, {"type": "text", "text": "B"}]},
            {"role": "assistant", "content": "ok"},
            {"role": "tool", "content": [{"type": "image", "image": "y"}]}]
    pic = "<|vision_start|><|image_pad|><|vision_end|>"
    s = tok.apply_chat_template(msgs, add_generation_prompt=False)
    assert s.startswith(f"<|im_start|>user\nA{pic}{pic}B<|im_end|>\n")
    assert s.endswith(f"<|im_start|>user\n<tool_response>\n{pic}\n</tool_response><|im_end|>\n")
    s = tok.apply_chat_template(msgs, add_generation_prompt=False, add_vision_id=True)
    assert f"A Picture 1: {pic}Picture 2: {pic}B".replace("A ", "A") in s and f"Picture 3: {pic}" in s


@pytest.mark.parametrize("text", TEXTS)
def test_roundtrip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_special_tokens_in_text(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|><think>x</think><tool_call>")
    assert ids[0] == 2 and 1 in ids and 3 in ids and 4 in ids and ids[-1] == 5
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi<think>x</think><tool_call>"
    assert tok.decode(ids, skip_special_tokens=False).startswith("<|im_start|>user")
    assert tok.id_to_piece(1) == "<|im_end|>" and tok.id_to_bytes(3) == b"<think>"
    # the qwen3_coder pieces are plain text, but short
    assert len(tok.encode("<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>")) <= 24


def test_id_to_piece_and_bytes(tok):
    for i in range(9, tok.vocab_size, 97):
        assert tok.id_to_bytes(i).decode("utf-8", errors="replace") == tok.id_to_piece(i)
    assert tok.id_to_piece(tok.vocab_size + 5) == "" and tok.id_to_bytes(-1) == b""


# ------------------------------------------------------------------ chat template

def test_chat_basic(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(msgs) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("Hi<|im_end|>\n")
    assert tok.apply_chat_template(msgs, enable_thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tok.apply_chat_template(msgs, enable_thinking=True).endswith("<|im_start|>assistant\n")
    ids = tok.encode_chat(msgs)
    assert ids == tok.encode(tok.apply_chat_template(msgs)) == tok.apply_chat_template(msgs, tokenize=True)
    assert ids[0] == 2 and ids.count(1) == 2
    # content given as a list of text parts
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert "<|im_start|>user\nab<|im_end|>" in tok.apply_chat_template(parts)


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name"},
        "days": {"type": "integer", "enum": [1, 2, 3]}}, "required": ["city"]}}}]


def test_chat_tools_and_history(tok):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "old answer", "reasoning_content": "old thoughts"},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "need the tool",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}},
                        {"id": "c2", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Nice"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
        {"role": "tool", "tool_call_id": "c2", "content": "sunny"},
    ]
    s = tok.apply_chat_template(msgs, tools=TOOLS)
    assert s.startswith("<|im_start|>system\n# Tools\n")
    assert ("<tools>\n<function>\n<name>get_weather</name>\n<description>Get the weather.</description>\n"
            "<parameters>\n<parameter>\n<name>city</name>\n<type>string</type>\n<description>City name</description>\n"
            "</parameter>\n<parameter>\n<name>days</name>\n<type>integer</type>\n<enum>[1, 2, 3]</enum>\n</parameter>\n"
            '<required>["city"]</required>\n</parameters>\n</function>\n</tools>') in s
    assert "</IMPORTANT>\n\nBe brief.<|im_end|>\n" in s and s.count("<|im_start|>system") == 1
    # reasoning before the last user turn is dropped, after it kept
    assert "old thoughts" not in s and "<|im_start|>assistant\nold answer<|im_end|>" in s
    assert ("<|im_start|>assistant\n<think>\nneed the tool\n</think>\n\nChecking.\n\n<tool_call>\n<function=get_weather>\n"
            "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n"
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nNice\n</parameter>\n</function>\n</tool_call>"
            "<|im_end|>\n") in s
    assert s.endswith("<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response>\n<tool_response>\nsunny\n"
                      "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # an assistant turn with content None and only tool calls
    s3 = tok.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}], add_generation_prompt=False)
    assert s3.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n<function=f>\n</function>\n"
                       "</tool_call><|im_end|>\n")
    # think tags inside content are split out the same way
    s2 = tok.apply_chat_template([{"role": "user", "content": "q"},
                                  {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nA"}], add_generation_prompt=False)
    assert s2.endswith("<|im_start|>assistant\n<think>\nhmm\n</think>\n\nA<|im_end|>\n")


def test_chat_errors(tok):
    with pytest.raises(TokenizerError, match="role"):
        tok.apply_chat_template([{"role": "wizard", "content": "x"}])
    with pytest.raises(TokenizerError):
        tok.apply_chat_template("not a list")


# ------------------------------------------------------------------ files

def test_build_script_reproduces_shipped_files(tmp_path):
    """scripts/build_tokenizer.py is deterministic and produced exactly the shipped files."""
    out = tmp_path / "tk"
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "build_tokenizer.py"), str(out)], check=True,
                   capture_output=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    names = sorted(os.listdir(out))
    assert names == sorted(os.listdir(EMBEDDED_TOKENIZER_DIR))
    for n in names:
        assert filecmp.cmp(out / n, EMBEDDED_TOKENIZER_DIR / n, shallow=False), n


def test_write_and_load_checkpoint_tokenizer(tmp_path, tok):
    write_tokenizer(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 1}))
    t2 = load_tokenizer(str(tmp_path))
    assert t2 is not tok and t2.vocab_size == tok.vocab_size and t2.eos_token_ids == tok.eos_token_ids
    assert t2.encode(TEXTS[3]) == tok.encode(TEXTS[3])
    assert t2.apply_chat_template([{"role": "user", "content": "x"}]) == tok.apply_chat_template(
        [{"role": "user", "content": "x"}])


def test_checkpoint_eos_from_generation_config(tmp_path):
    write_tokenizer(str(tmp_path))
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["eos_token"] = "<|endoftext|>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with open(tmp_path / "tokenizer.json", "a") as f:
        f.write("\n")  # no longer byte-identical to the embedded file, so no embedded eos set
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 0]}))
    assert load_tokenizer(str(tmp_path)).eos_token_ids == frozenset({0, 7})


def test_load_errors(tmp_path):
    with pytest.raises(TokenizerError, match="not a directory"):
        load_tokenizer(str(tmp_path / "missing"))
    with pytest.raises(TokenizerError, match="no tokenizer files"):
        load_tokenizer(str(tmp_path))


# ------------------------------------------------------------------ incremental detokenization

@pytest.mark.parametrize("byte_mode", [True, False])
def test_incremental_multibyte(tok, byte_mode):
    text = "Hi 🙂 中文テキスト café — 𝔘𝔫𝔦 end 👍🏽"
    ids = tok.encode(text)
    assert len(ids) > len(text) // 2  # emoji and CJK are split over byte tokens here
    det = IncrementalDetokenizer(tok, tok.encode("Prompt: "), byte_mode=byte_mode)
    deltas = [det.add(i) for i in ids]
    assert "".join(deltas) == text and det.text == text and det.flush() == ""
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # a character split over tokens was held back, then emitted whole
    assert "🙂" in deltas and "中" in deltas


def test_incremental_matches_decode_on_random_streams(tok):
    """Any id stream, invalid UTF-8 and special tokens included: deltas + flush == decode()."""
    # the byte symbols (ids 9..264 but the image tokens' 186..189, whose bytes UTF-8 never has)
    byte_ids = {tok.id_to_bytes(i)[0]: i for i in range(9, 265) if i not in range(186, 190)}
    assert len(byte_ids) == 252
    high, every = [i for b, i in byte_ids.items() if b >= 128], list(byte_ids.values())
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.choice([rng.randrange(tok.vocab_size), rng.choice(high), rng.choice(every), rng.randrange(9),
                           rng.randrange(186, 190)]) for _ in range(rng.randint(1, 24))]
        for skip in (True, False):
            det = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
            got = "".join(det.add(i) for i in ids) + det.flush()
            assert got == tok.decode(ids, skip_special_tokens=skip), ids


def test_incremental_holds_incomplete_then_flushes(tok):
    byte_ids = {tok.id_to_bytes(i)[0]: i for i in range(9, 265) if i not in range(186, 190)}
    det = IncrementalDetokenizer(tok, [])
    euro = "€".encode()  # 3 bytes
    assert det.add(byte_ids[euro[0]]) == "" and det.add(byte_ids[euro[1]]) == ""
    assert det.add(byte_ids[euro[2]]) == "€"
    assert det.add(byte_ids[euro[0]]) == "" and det.flush() == "\ufffd"  # the stream ended mid-character
    det2 = IncrementalDetokenizer(tok, [])
    assert det2.add(byte_ids[0x80]) == "\ufffd"  # a byte that can never start a character: at once
    assert det2.add(1) == "" and det2.output_ids == [byte_ids[0x80], 1]  # special token skipped
