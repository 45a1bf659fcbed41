"""Tokenizers: the embedded default one and a model's own, behind one small interface.

    tok = load_tokenizer(None)          # the tokenizer shipped in deltaserve/assets/tokenizer
    tok = load_tokenizer("/model")      # the model directory's tokenizer (transformers, offline)
    ids = tok.encode("hello")
    text = tok.apply_chat_template(messages, tools=tools, enable_thinking=False)
    det = IncrementalDetokenizer(tok, prompt_ids)
    delta = det.add(token_id)           # text added by this token ("" while a character is incomplete)

The embedded tokenizer is a Qwen-style byte-level BPE (4,096 ids) built by scripts/build_tokenizer.py;
its ids: <|endoftext|> 0, <|im_end|> 1, <|im_start|> 2, <think> 3, </think> 4, <tool_call> 5,
</tool_call> 6, <tool_response> 7, </tool_response> 8; the image tokens <|vision_start|> 186, <|vision_end|>
187, <|image_pad|> 188, <|video_pad|> 189 (on byte symbols UTF-8 never produces: docs/images.md).
eos = {<|im_end|>, <|endoftext|>}.
The qwen3.5-0.8b-shape preset gets the real Qwen3.5 tokenizer and chat template instead (built by
deltaserve/embedded/qwen35_tokenizer.py from the published sources); both load through load_tokenizer(dir).
"""
from __future__ import annotations

import codecs
import copy
import functools
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterable

from tokenizers import decoders

EMBEDDED_TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "assets" / "tokenizer"
EMBEDDED_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
EMBEDDED_EOS_TOKENS = ("<|im_end|>", "<|endoftext|>")

# Tokens the reasoning and tool parsers look for (present in the embedded tokenizer and in Qwen's).
THINK_START, THINK_END = "<think>", "</think>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded, or a chat that cannot be rendered; the message says why."""


@functools.lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character standing for each byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _is_byte_level(backend) -> bool:
    """True when the backend decodes with the byte-level decoder (GPT-2 / Qwen / Llama-3 style)."""
    try:
        dec = backend.decoder
        if isinstance(dec, decoders.ByteLevel):
            return True
        if dec is None:
            return False
        spec = json.loads(dec.__getstate__()) if hasattr(dec, "__getstate__") else {}
    except Exception:  # noqa: BLE001 - any oddity means "not byte-level": the generic path still works
        return False
    if spec.get("type") == "ByteLevel":
        return True
    if spec.get("type") == "Sequence":
        return any(d.get("type") == "ByteLevel" for d in spec.get("decoders", []))
    return False


def _json_file(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError):
        return {}


def _eos_from_config(d: dict) -> list[int]:
    out: list[int] = []
    for src in (d, d.get("text_config") or {}):
        e = src.get("eos_token_id") if isinstance(src, dict) else None
        if isinstance(e, int):
            out.append(e)
        elif isinstance(e, (list, tuple)):
            out.extend(int(x) for x in e if isinstance(x, int))
    return out


class Tokenizer:
    """A transformers fast tokenizer plus what the engine needs: eos ids, pieces, bytes, chat rendering."""

    def __init__(self, hf, name_or_path: str, extra_eos_token_ids: Iterable[int] = ()):
        self.hf = hf
        self.name_or_path = name_or_path
        self.vocab_size: int = len(hf)
        eos = set(int(i) for i in extra_eos_token_ids if 0 <= int(i) < self.vocab_size)
        if hf.eos_token_id is not None:
            eos.add(int(hf.eos_token_id))
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        added = getattr(hf, "added_tokens_decoder", {}) or {}
        self._added: dict[int, str] = {int(i): str(t) for i, t in added.items()}
        self.special_token_ids: frozenset[int] = frozenset(
            int(i) for i, t in added.items() if getattr(t, "special", False))
        backend = getattr(hf, "backend_tokenizer", None) or getattr(hf, "_tokenizer", None)
        self._backend = backend
        self.is_byte_level: bool = backend is not None and _is_byte_level(backend)

    # ---- basic ops ----
    def __len__(self) -> int:
        return self.vocab_size

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    @property
    def pad_token_id(self) -> int | None:
        return self.hf.pad_token_id

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf, "chat_template", None)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, not {type(text).__name__}")
        if self._backend is not None:
            return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def encode_with_ends(self, text: str) -> tuple[list[int], list[int] | None]:
        """encode(text) and where each of its tokens ends in text (characters; None without a fast backend)."""
        if self._backend is None:
            return self.encode(text), None
        enc = self._backend.encode(text, add_special_tokens=False)
        return list(enc.ids), [end for _, end in enc.offsets]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, piece: str) -> int | None:
        """The id of a vocabulary piece or added token (e.g. "<think>"), None if absent."""
        i = self.hf.convert_tokens_to_ids(piece)
        unk = self.hf.unk_token_id
        return None if i is None or (unk is not None and i == unk and piece != self.hf.unk_token) else int(i)

    @functools.lru_cache(maxsize=65536)
    def id_to_piece(self, token_id: int) -> str:
        """The token's text on its own, for logprobs display ("\\ufffd" for a partial UTF-8 byte)."""
        if not 0 <= token_id < self.vocab_size:
            return ""
        return self.decode([token_id], skip_special_tokens=False)

    @functools.lru_cache(maxsize=65536)
    def id_to_bytes(self, token_id: int) -> bytes | None:
        """The exact bytes a token contributes to the text, or None where the tokenizer is not byte-level
        (sentencepiece pieces depend on their neighbours). Out-of-range ids give b""."""
        if not 0 <= token_id < self.vocab_size:
            return b""
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        if not self.is_byte_level:
            return None
        piece = self.hf.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        table = byte_decoder()
        return b"".join(bytes([table[c]]) if c in table else c.encode("utf-8") for c in piece)

    # ---- chat ----
    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = True, tokenize: bool = False,
                            chat_template: str | None = None, **kwargs: Any) -> str | list[int]:
        """Render a conversation with the tokenizer's chat template (kwargs go to the template, e.g.
        enable_thinking=False). Tool-call arguments given as a JSON string (the OpenAI form) are parsed
        into a dict first, like vLLM does. tokenize=True returns token ids instead of text."""
        template = chat_template or self.chat_template
        if not template:
            raise TokenizerError(f"the tokenizer at {self.name_or_path} has no chat template; "
                                 "use a completion prompt or pass chat_template")
        msgs = _prepare_messages(messages)
        try:
            text = self.hf.apply_chat_template(msgs, tools=tools or None, add_generation_prompt=add_generation_prompt,
                                               tokenize=False, chat_template=chat_template, **kwargs)
        except TokenizerError:
            raise
        except Exception as e:  # jinja errors, raise_exception(...) in the template, bad message shapes
            raise TokenizerError(f"cannot render the chat: {type(e).__name__}: {e}") from e
        if isinstance(text, list):  # a batch-shaped answer from transformers; we render one chat
            text = text[0]
        return self.encode(text) if tokenize else text

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        """apply_chat_template, tokenized (no extra special tokens: the template writes them)."""
        return self.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                        tokenize=True, **kwargs)

    def __repr__(self) -> str:
        return f"Tokenizer({self.name_or_path!r}, vocab_size={self.vocab_size}, eos={sorted(self.eos_token_ids)})"


def _prepare_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if not isinstance(messages, list):
        raise TokenizerError("messages must be a list of {'role': ..., 'content': ...} objects")
    out = []
    for i, m in enumerate(messages):
        if hasattr(m, "model_dump"):
            m = m.model_dump(exclude_none=True)
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise TokenizerError(f"messages[{i}] must be an object with a string 'role'")
        m = dict(m)  # the texts are shared, not copied: a long one is in memory once, however many layers pass it
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            m["tool_calls"] = calls = copy.deepcopy(calls)  # their arguments are parsed in place below
            for c in calls:
                f = c.get("function") if isinstance(c, dict) else None
                if isinstance(f, dict) and isinstance(f.get("arguments"), str):
                    try:
                        parsed = json.loads(f["arguments"])
                    except ValueError:
                        continue
                    if isinstance(parsed, dict):
                        f["arguments"] = parsed
        out.append(m)
    return out


@functools.lru_cache(maxsize=8)
def _load_cached(path: str) -> Tokenizer:
    return _load(path)


def _load(path: str) -> Tokenizer:
    from transformers import AutoTokenizer  # seconds to import: `deltaserve plan` and the simulator never load one
    if not os.path.isdir(path):
        raise TokenizerError(f"no tokenizer: {path} is not a directory")
    if not any(os.path.exists(os.path.join(path, f))
               for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")):
        raise TokenizerError(f"no tokenizer files (tokenizer.json, tokenizer_config.json) in {path}")
    try:
        hf = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - the message names the directory and the cause
        raise TokenizerError(f"cannot load the tokenizer in {path}: {type(e).__name__}: {e}") from e
    extra: list[int] = []
    for name in ("generation_config.json", "config.json"):
        extra += _eos_from_config(_json_file(os.path.join(path, name)))
    if os.path.realpath(path) == os.path.realpath(EMBEDDED_TOKENIZER_DIR) or _same_as_embedded(path):
        extra += [hf.convert_tokens_to_ids(t) for t in EMBEDDED_EOS_TOKENS]
    return Tokenizer(hf, path, extra)


def _same_as_embedded(path: str) -> bool:
    """A model directory whose tokenizer.json is the embedded one (written by make-model) gets its eos set."""
    a, b = os.path.join(path, "tokenizer.json"), EMBEDDED_TOKENIZER_DIR / "tokenizer.json"
    try:
        if os.path.getsize(a) != os.path.getsize(b):
            return False
        with open(a, "rb") as fa, open(b, "rb") as fb:
            return fa.read() == fb.read()
    except OSError:
        return False


def load_tokenizer(path: str | None = None) -> Tokenizer:
    """The embedded tokenizer (path None) or a model directory's own (offline, no remote code).
    Loaded once per path and shared: Tokenizer objects are read-only."""
    return _load_cached(os.path.realpath(str(EMBEDDED_TOKENIZER_DIR if path is None else path)))


def write_tokenizer(out_dir: str) -> list[str]:
    """Copy the embedded tokenizer's files into a model directory; returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for name in EMBEDDED_TOKENIZER_FILES:
        dst = os.path.join(out_dir, name)
        shutil.copyfile(EMBEDDED_TOKENIZER_DIR / name, dst)
        written.append(dst)
    return written


class IncrementalDetokenizer:
    """Turns a stream of output token ids into text deltas, never emitting a half character.

    Byte-level tokenizers (the embedded one, Qwen's): each token's bytes go through an incremental
    UTF-8 decoder, so an incomplete multi-byte character is held until it completes, and bytes that can
    never form a character become U+FFFD at once. The concatenated deltas plus flush() equal
    tokenizer.decode(output_ids, skip_special_tokens).

    Other tokenizers (sentencepiece): vLLM's prefix/read-offset scheme over decode(), primed with the
    prompt's last tokens so a leading space is right; a trailing U+FFFD is held until the next token.
    """

    # vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET
    PROMPT_CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Iterable[int] = (), skip_special_tokens: bool = True,
                 byte_mode: bool | None = None):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.byte_mode = tokenizer.is_byte_level if byte_mode is None else byte_mode
        self.output_ids: list[int] = []
        self.text = ""  # everything emitted so far
        if self.byte_mode:
            self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        else:
            tail = list(prompt_ids)[-(self.PROMPT_CONTEXT + 1):]
            self._ids: list[int] = tail
            self._prefix = max(len(tail) - self.PROMPT_CONTEXT, 0)
            self._read = len(tail)

    def add(self, token_id: int) -> str:
        """Feed one generated token; returns the text it completes (possibly "")."""
        token_id = int(token_id)
        self.output_ids.append(token_id)
        skip = self.skip_special_tokens and token_id in self.tokenizer.special_token_ids
        if self.byte_mode:
            delta = "" if skip else self._dec.decode(self.tokenizer.id_to_bytes(token_id) or b"")
        else:
            if skip:
                return ""
            delta = self._add_generic(token_id)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of the stream: whatever is still held back (an unfinished character becomes U+FFFD)."""
        if self.byte_mode:
            delta = self._dec.decode(b"", final=True)
        else:
            dec = self.tokenizer.decode
            prefix_text = dec(self._ids[self._prefix:self._read], skip_special_tokens=self.skip_special_tokens)
            full = dec(self._ids[self._prefix:], skip_special_tokens=self.skip_special_tokens)
            delta = full[len(prefix_text):] if len(full) > len(prefix_text) else ""
            self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta

    def _add_generic(self, token_id: int) -> str:
        self._ids.append(token_id)
        dec = self.tokenizer.decode
        prefix_text = dec(self._ids[self._prefix:self._read], skip_special_tokens=self.skip_special_tokens)
        full = dec(self._ids[self._prefix:], skip_special_tokens=self.skip_special_tokens)
        if len(full) <= len(prefix_text) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        return delta
