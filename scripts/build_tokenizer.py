#!/usr/bin/env python
"""Build deltaserve's embedded tokenizer: a Qwen-style byte-level BPE trained on a generated corpus.

    python scripts/build_tokenizer.py [OUT_DIR]     (default: deltaserve/assets/tokenizer)

Deterministic: the corpus comes from a seeded random.Random, the trainer runs single-threaded and
the JSON files are written with sorted keys, so two runs write the same bytes (for a given version
of the `tokenizers` library; `--check` rebuilds into a temporary directory and compares).

Layout (total vocab <= 4096, the `tiny` preset's vocab_size):
    0  <|endoftext|>   special, pad, also an eos
    1  <|im_end|>      special, the chat eos (the tiny preset's eos_token_id)
    2  <|im_start|>    special
    3..8  <think> </think> <tool_call> </tool_call> <tool_response> </tool_response>
          added tokens that are NOT special (like Qwen3): decode(skip_special_tokens=True) keeps them,
          so reasoning and tool-call parsers see them in the text
    9..264   the 256 byte-level symbols, but for 186..189: <|vision_start|> <|vision_end|> <|image_pad|>
             <|video_pad|>, special, on the ids of bytes 0xF5..0xF8, which UTF-8 never contains
    265..    merges
The qwen3_coder tool-call pieces (<function=NAME>, <parameter=NAME>, </parameter>, </function>) are
plain text; the corpus contains them often enough that they become short runs of merged tokens.
"""
from __future__ import annotations

import argparse
import filecmp
import hashlib
import json
import os
import random
import sys
import tempfile

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # before tokenizers is imported: single-threaded, deterministic

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers  # noqa: E402

VOCAB_SIZE = 4096
SEED = 20240601
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_end|>", "<|im_start|>"]
REASONING_TOOL_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
ALL_ADDED = SPECIAL_TOKENS + REASONING_TOOL_TOKENS
EOS_TOKENS = ["<|im_end|>", "<|endoftext|>"]
# Qwen3.5's image tokens (special, as in Qwen's tokenizer), on the ids of bytes that never occur in UTF-8
# (0xF5..0xF8), so no text's tokenization changes (_add_image_tokens)
IMAGE_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
UNUSED_BYTES = [0xF5, 0xF6, 0xF7, 0xF8]

# Qwen2's pre-tokenizer split: contractions, letter runs with one leading non-letter, single digits,
# punctuation runs, newlines, whitespace.
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# A Qwen3.5-style chat template (qwen3_coder XML tools), written for deltaserve.
CHAT_TEMPLATE = r"""{%- set image_count = namespace(value=0) -%}
{%- macro render_content(content) -%}
    {%- if content is none -%}
    {%- elif content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part is string -%}
                {{- part -}}
            {%- elif part is mapping and (part.type == 'image' or 'image' in part or 'image_url' in part) -%}
                {%- set image_count.value = image_count.value + 1 -%}
                {%- if add_vision_id is defined and add_vision_id -%}
                    {{- 'Picture ' ~ image_count.value ~ ': ' -}}
                {%- endif -%}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
            {%- elif part is mapping and part.text is defined -%}
                {{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{- content | string -}}
    {%- endif -%}
{%- endmacro -%}
{%- macro render_extra_keys(obj, handled) -%}
    {%- if obj is mapping -%}
        {%- for key, value in obj.items() if key not in handled -%}
            {%- if value is string -%}
                {{- '\n<' ~ key ~ '>' ~ value ~ '</' ~ key ~ '>' -}}
            {%- else -%}
                {{- '\n<' ~ key ~ '>' ~ (value | tojson) ~ '</' ~ key ~ '>' -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set has_tools = tools is defined and tools and tools is iterable and tools is not mapping -%}
{%- if has_tools -%}
    {{- '<|im_start|>system\n# Tools\n\nYou can call the following functions:\n\n<tools>' -}}
    {%- for tool in tools -%}
        {%- set fn = tool.function if tool.function is defined else tool -%}
        {{- '\n<function>\n<name>' ~ fn.name ~ '</name>' -}}
        {%- if fn.description is defined and fn.description -%}
            {{- '\n<description>' ~ (fn.description | trim) ~ '</description>' -}}
        {%- endif -%}
        {{- '\n<parameters>' -}}
        {%- if fn.parameters is defined and fn.parameters is mapping -%}
            {%- if fn.parameters.properties is defined and fn.parameters.properties is mapping -%}
                {%- for pname, pfields in fn.parameters.properties.items() -%}
                    {{- '\n<parameter>\n<name>' ~ pname ~ '</name>' -}}
                    {%- if pfields is mapping -%}
                        {%- if pfields.type is defined -%}
                            {%- if pfields.type is string -%}
                                {{- '\n<type>' ~ pfields.type ~ '</type>' -}}
                            {%- else -%}
                                {{- '\n<type>' ~ (pfields.type | tojson) ~ '</type>' -}}
                            {%- endif -%}
                        {%- endif -%}
                        {%- if pfields.description is defined and pfields.description -%}
                            {{- '\n<description>' ~ (pfields.description | string | trim) ~ '</description>' -}}
                        {%- endif -%}
                        {{- render_extra_keys(pfields, ['name', 'type', 'description']) -}}
                    {%- endif -%}
                    {{- '\n</parameter>' -}}
                {%- endfor -%}
            {%- endif -%}
            {{- render_extra_keys(fn.parameters, ['type', 'properties']) -}}
        {%- endif -%}
        {{- '\n</parameters>' -}}
        {{- render_extra_keys(fn, ['type', 'name', 'description', 'parameters']) -}}
        {{- '\n</function>' -}}
    {%- endfor -%}
    {{- '\n</tools>\n\nTo call a function, reply in exactly this format, with nothing after it:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n<parameter=example_parameter_2>\nA value may span\nseveral lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Every call is a <function=...></function> block nested inside <tool_call></tool_call> tags\n- Give every required parameter\n- Reasoning in natural language goes BEFORE a call, never after it\n- If no function fits, answer normally and do not mention the functions\n</IMPORTANT>' -}}
    {%- if messages and messages[0].role == 'system' -%}
        {%- set sys = render_content(messages[0].content) | trim -%}
        {%- if sys -%}
            {{- '\n\n' ~ sys -}}
        {%- endif -%}
    {%- endif -%}
    {{- '<|im_end|>\n' -}}
{%- elif messages and messages[0].role == 'system' -%}
    {{- '<|im_start|>system\n' ~ (render_content(messages[0].content) | trim) ~ '<|im_end|>\n' -}}
{%- endif -%}
{%- set ns = namespace(last_query=-1) -%}
{%- for message in messages -%}
    {%- if message.role == 'user' -%}
        {%- set ns.last_query = loop.index0 -%}
    {%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
    {%- set content = render_content(message.content) -%}
    {%- if message.role == 'system' -%}
        {%- if not loop.first -%}
            {{- '<|im_start|>system\n' ~ (content | trim) ~ '<|im_end|>\n' -}}
        {%- endif -%}
    {%- elif message.role == 'user' -%}
        {{- '<|im_start|>user\n' ~ content ~ '<|im_end|>\n' -}}
    {%- elif message.role == 'assistant' -%}
        {%- set reasoning = '' -%}
        {%- if message.reasoning_content is defined and message.reasoning_content is string -%}
            {%- set reasoning = message.reasoning_content -%}
        {%- elif message.reasoning is defined and message.reasoning is string -%}
            {%- set reasoning = message.reasoning -%}
        {%- elif '</think>' in content -%}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}
            {%- set content = content.split('</think>')[-1] -%}
        {%- endif -%}
        {%- set reasoning = reasoning | trim -%}
        {%- set content = content | trim -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if loop.index0 > ns.last_query -%}
            {{- '<think>\n' ~ reasoning ~ '\n</think>\n\n' -}}
        {%- endif -%}
        {{- content -}}
        {%- if message.tool_calls is defined and message.tool_calls -%}
            {%- for call in message.tool_calls -%}
                {%- set f = call.function if call.function is defined else call -%}
                {%- if not loop.first -%}
                    {{- '\n' -}}
                {%- elif content -%}
                    {{- '\n\n' -}}
                {%- endif -%}
                {{- '<tool_call>\n<function=' ~ f.name ~ '>\n' -}}
                {%- if f.arguments is defined and f.arguments is mapping -%}
                    {%- for aname, avalue in f.arguments.items() -%}
                        {{- '<parameter=' ~ aname ~ '>\n' -}}
                        {%- if avalue is string -%}
                            {{- avalue -}}
                        {%- else -%}
                            {{- avalue | tojson -}}
                        {%- endif -%}
                        {{- '\n</parameter>\n' -}}
                    {%- endfor -%}
                {%- elif f.arguments is defined and f.arguments -%}
                    {{- f.arguments | string -}}
                    {{- '\n' -}}
                {%- endif -%}
                {{- '</function>\n</tool_call>' -}}
            {%- endfor -%}
        {%- endif -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or loop.previtem.role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' ~ content ~ '\n</tool_response>' -}}
        {%- if loop.last or loop.nextitem.role != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- else -%}
        {{- raise_exception('unknown message role ' ~ message.role) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- endif -%}
{%- endif -%}
"""

# ---------------------------------------------------------------- corpus
WORDS = """the of and to in a is that for it as was with be by on not he I this are or his from at which
but have an they you were her she there one all we their can has been if more when will would who so no
what up out about into than them then some could time these two may first do any like my now over such our
man me even most made after also did many before must through back years where much your way well down
should because each just those people how too little state good very make world still own see men work
long get here between both life being under never day same another know while last might us great old
year off come since against go came right used take three states himself few house use during without
again place American around however home small found thought went say part once general high upon school
every does got united left number course war until always away something fact though water less public
put think almost hand enough far took head yet government system better set told nothing night end why
called didn't eyes find going look asked later knew point next program city business give group toward
young days let room president side social given present several order national possible rather second
face per among form important often things looked early white case John become large big need four within
felt along children saw best church ever least power development light seemed family interest want members
mind country area others done turned although open God service certain kind problem began different door
thus help sense means whole matter perhaps itself York it's times law human line above name example
action company hands local show whether five history gave today either act feet across taken past quite
anything seen having body several experience really week field word money information model token engine
request server batch cache prefix memory state layer attention sequence prompt output input value
function parameter result error message user assistant system tool call weather city temperature query
search file path read write update delete create list string number boolean object array true false null
compute kernel tensor matrix vector shape dtype float integer chunk block page slot schedule sample""".split()

SYLLABLES = ["ka", "lo", "mi", "ne", "ra", "to", "su", "vi", "de", "ba", "po", "ri", "an", "el", "or", "un",
             "ist", "ent", "ion", "ly", "er", "ed", "ing", "al", "com", "pre", "con", "ter", "ver", "str",
             "ph", "th", "sh", "ch", "qu", "ex", "im", "ab", "ou", "ea", "ai", "ow", "ar", "at", "es", "ic"]

ACCENTED = ["café", "naïve", "über", "façade", "señor", "déjà", "Zürich", "résumé", "Ångström", "smörgåsbord",
            "привет", "мир", "данные", "λόγος", "ψυχή", "São", "crème", "brûlée"]

PY_NAMES = ["x", "y", "i", "n", "idx", "data", "items", "result", "value", "key", "config", "tokens", "logits",
            "state", "batch", "seq_len", "hidden", "weight", "bias", "output", "request", "page_table", "cache"]


def _lexicon(rng: random.Random, n: int) -> list[str]:
    seen: set[str] = set(WORDS)
    out: list[str] = []
    while len(out) < n:
        w = "".join(rng.choice(SYLLABLES) for _ in range(rng.choice((2, 2, 3, 3, 3, 4))))
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


def _zipf_pick(rng: random.Random, seq: list[str]) -> str:
    # a heavy-tailed pick: index ~ n * u^3
    return seq[int(len(seq) * rng.random() ** 3)]


def _sentence(rng: random.Random, lex: list[str]) -> str:
    n = rng.randint(4, 18)
    words = []
    for _ in range(n):
        r = rng.random()
        if r < 0.6:
            words.append(_zipf_pick(rng, WORDS))
        elif r < 0.97:
            words.append(_zipf_pick(rng, lex))
        else:
            words.append(rng.choice(ACCENTED))
    if rng.random() < 0.2:
        words.insert(rng.randrange(len(words)), str(rng.randint(0, 10 ** rng.randint(1, 6))))
    words[0] = words[0][:1].upper() + words[0][1:]
    s = " ".join(words)
    if rng.random() < 0.25:
        k = rng.randrange(1, len(words))
        s = " ".join(words[:k]) + ", " + " ".join(words[k:])
    return s + rng.choice([".", ".", ".", "?", "!", ":", ";"])


def _paragraph(rng: random.Random, lex: list[str]) -> str:
    return " ".join(_sentence(rng, lex) for _ in range(rng.randint(1, 6)))


def _python(rng: random.Random, lex: list[str]) -> str:
    fn = "_".join(rng.choice(WORDS + lex).lower() for _ in range(rng.randint(1, 3)))
    args = ", ".join(rng.sample(PY_NAMES, rng.randint(1, 3)))
    a, b = rng.sample(PY_NAMES, 2)
    lines = [f"def {fn}({args}):",
             f'    """{_sentence(rng, lex)}"""',
             f"    {a} = {b}[{rng.randint(0, 64)}:] + {rng.randint(0, 999)}",
             f"    for {rng.choice(['i', 'j', 'k'])} in range(len({b})):",
             f"        if {a} >= {rng.randint(1, 100)} and not {b}:",
             f"            {a} += {rng.choice(['1', '2', 'x', 'n * 2', 'len(items)'])}",
             "    return " + rng.choice([a, b, "None", "True", "{%r: %s}" % (a, b)]),
             ""]
    return "\n".join(lines)


def _json_value(rng: random.Random, lex: list[str], depth: int = 0):
    r = rng.random()
    if depth < 2 and r < 0.2:
        return {rng.choice(WORDS + lex): _json_value(rng, lex, depth + 1) for _ in range(rng.randint(1, 4))}
    if depth < 2 and r < 0.3:
        return [_json_value(rng, lex, depth + 1) for _ in range(rng.randint(0, 4))]
    if r < 0.55:
        return " ".join(_zipf_pick(rng, WORDS) for _ in range(rng.randint(1, 4)))
    if r < 0.75:
        return rng.randint(-1000, 100000)
    if r < 0.85:
        return round(rng.uniform(-100, 100), rng.randint(1, 4))
    return rng.choice([True, False, None])


def _json(rng: random.Random, lex: list[str]) -> str:
    obj = {rng.choice(WORDS + lex): _json_value(rng, lex) for _ in range(rng.randint(1, 5))}
    return json.dumps(obj, ensure_ascii=False, indent=rng.choice([None, 2]))


def _tool_call(rng: random.Random, lex: list[str]) -> str:
    name = "_".join(rng.choice(WORDS).lower() for _ in range(rng.randint(1, 3)))
    parts = ["<tool_call>", f"<function={name}>"]
    for _ in range(rng.randint(1, 3)):
        p = rng.choice(["city", "query", "path", "value", "unit", "limit", "name", "content", "location", "id"])
        v = _json_value(rng, lex)
        parts += [f"<parameter={p}>", v if isinstance(v, str) else json.dumps(v, ensure_ascii=False), "</parameter>"]
    parts += ["</function>", "</tool_call>"]
    return "\n".join(parts)


def _chat(rng: random.Random, lex: list[str]) -> str:
    out = []
    if rng.random() < 0.5:
        out.append("<|im_start|>system\n" + _paragraph(rng, lex) + "<|im_end|>\n")
    for _ in range(rng.randint(1, 3)):
        out.append("<|im_start|>user\n" + _paragraph(rng, lex) + "<|im_end|>\n")
        a = "<|im_start|>assistant\n"
        if rng.random() < 0.5:
            a += "<think>\n" + _paragraph(rng, lex) + "\n</think>\n\n"
        a += _paragraph(rng, lex)
        if rng.random() < 0.4:
            a += "\n\n" + _tool_call(rng, lex)
            out.append(a + "<|im_end|>\n")
            out.append("<|im_start|>user\n<tool_response>\n" + _json(rng, lex) + "\n</tool_response><|im_end|>\n")
        else:
            out.append(a + "<|im_end|>\n")
    return "".join(out)


def build_corpus(n_docs: int = 12000) -> list[str]:
    rng = random.Random(SEED)
    lex = _lexicon(rng, 6000)
    makers = [_paragraph] * 5 + [_python] * 2 + [_json] * 2 + [_chat] * 2 + [_tool_call]
    return [rng.choice(makers)(rng, lex) for _ in range(n_docs)]


def build(out_dir: str) -> None:
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=ALL_ADDED,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(build_corpus(), trainer=trainer)
    data = json.loads(tok.to_str())
    # Qwen3 keeps <think>/<tool_call>/... as added tokens that are not special.
    for t in data["added_tokens"]:
        t["special"] = t["content"] in SPECIAL_TOKENS
    # the byte-level post-processor (offsets only) as in Qwen's tokenizer.json
    data["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                              "use_regex": False}
    _add_image_tokens(data)
    ids = {t["content"]: t["id"] for t in data["added_tokens"]}
    assert [ids[t] for t in ALL_ADDED] == list(range(len(ALL_ADDED))), ids
    assert len(data["model"]["vocab"]) <= VOCAB_SIZE

    added_decoder = {str(t["id"]): {"content": t["content"], "lstrip": False, "normalized": False,
                                    "rstrip": False, "single_word": False, "special": t["special"]}
                     for t in data["added_tokens"]}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 262144,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
        "add_prefix_space": False,
        "added_tokens_decoder": added_decoder,
        "chat_template": CHAT_TEMPLATE,
    }
    special_map = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    os.makedirs(out_dir, exist_ok=True)
    _write_json(os.path.join(out_dir, "tokenizer.json"), data, indent=None)
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), config, indent=2)
    _write_json(os.path.join(out_dir, "special_tokens_map.json"), special_map, indent=2)


def _add_image_tokens(data: dict) -> None:
    """Give the image tokens the ids of byte symbols no text can produce (UNUSED_BYTES), in place.

    The vocabulary is full (4,096, the tiny preset's vocab_size), and growing it would change the model's
    embedding and head and so every output's logprobs. The byte-level pre-tokenizer maps a string's UTF-8
    bytes to symbols, and UTF-8 never contains these bytes, so their symbols are never produced, no merge
    uses them (checked), and taking their ids changes the tokenization of no text. The model keeps its
    embedding rows; only decoding those ids changes (a stray U+FFFD before, a special token now)."""
    enc = {b: c for c, b in _byte_symbols().items()}
    vocab = data["model"]["vocab"]
    unused = {enc[b] for b in UNUSED_BYTES}
    assert not any(set(a) & unused or set(b) & unused for a, b in map(_merge_pair, data["model"]["merges"]))
    for token, byte in zip(IMAGE_TOKENS, UNUSED_BYTES):
        tid = vocab.pop(enc[byte])
        vocab[token] = tid
        data["added_tokens"].append({"id": tid, "content": token, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": True})
    data["model"]["vocab"] = dict(sorted(vocab.items(), key=lambda kv: kv[1]))


def _merge_pair(m) -> tuple[str, str]:
    return tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1))


def _byte_symbols() -> dict[str, int]:
    """GPT-2's byte-level alphabet: {symbol: byte} (deltaserve.text.tokenizer.byte_decoder, without importing
    the package)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _write_json(path: str, obj, indent) -> None:
    text = json.dumps(obj, ensure_ascii=False, indent=indent, sort_keys=indent is not None,
                      separators=(",", ":") if indent is None else None)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(text + "\n")


def _digest(d: str) -> str:
    h = hashlib.sha256()
    for name in sorted(os.listdir(d)):
        with open(os.path.join(d, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("out_dir", nargs="?", default=os.path.normpath(os.path.join(here, "..", "deltaserve", "assets", "tokenizer")))
    ap.add_argument("--check", action="store_true",
                    help="build twice into temporary directories and compare with OUT_DIR; write nothing")
    args = ap.parse_args(argv)
    if args.check:
        with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
            build(a)
            build(b)
            same_twice = _digest(a) == _digest(b)
            names = sorted(os.listdir(a))
            same_shipped = all(os.path.exists(os.path.join(args.out_dir, n))
                               and filecmp.cmp(os.path.join(a, n), os.path.join(args.out_dir, n), shallow=False)
                               for n in names)
            print(f"built twice identical: {same_twice}; matches {args.out_dir}: {same_shipped}; sha256 {_digest(a)}")
            return 0 if same_twice and same_shipped else 1
    build(args.out_dir)
    print(f"wrote {args.out_dir} (sha256 {_digest(args.out_dir)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
