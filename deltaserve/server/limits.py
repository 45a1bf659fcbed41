"""How much one request may carry: the body-size limit, and the prompt-length checks that run before the
whole prompt is tokenized.

Two bounds, both measured on the served tokenizer when the engine loads (TokenBounds):

- `max_chars_per_token`: the most characters one token can cover (the longest vocabulary entry, counted in
  characters it starts, and the added tokens). A text of L characters then has at least
  ceil(L / max_chars_per_token) tokens, so a rendered prompt whose length alone proves it cannot fit the
  context is refused before tokenizing (`check_fits`). The tokenizer's normalizer may shorten a text first
  (NFC composes up to 4 characters into 1): the bound divides by that factor unless the text is ASCII or
  already normalized.
- `json_bytes_per_token`: the most request bytes a token took on probe texts chosen to be dense in JSON (rare
  unicode written as \\uXXXX escapes, control characters, CJK, indented code). The default body limit is a
  context of max_model_len tokens at that density, times MARGIN, plus room for one image of the size the image
  decoder accepts (MAX_IMAGE_BYTES, in base64) when the model takes images.

Under the limit, `encode_capped` tokenizes a long prompt piece by piece and stops as soon as the pieces hold more
tokens than the context, so a prompt far past the context costs the time and memory of one context's worth of
text, not of all of it.
"""
from __future__ import annotations

import functools
import json
import logging
import math
import random
import unicodedata
from dataclasses import dataclass

from ..engine.inputs import EngineInputError
from ..media.images import MAX_IMAGE_BYTES

log = logging.getLogger("deltaserve.server")

MARGIN = 4  # the default body limit is this many times the densest probe's bytes per token
IMAGE_ALLOWANCE = 4 * ((MAX_IMAGE_BYTES + 2) // 3) + (1 << 16)  # one image at the decoder's cap, in base64
FALLBACK_BYTES = 64 << 20  # the limit until the engine has loaded (every generation route answers 503 then)
CHUNK_CHARS = 1 << 18  # encode_capped tokenizes at most this many characters at a time
NFC_SHRINK = 4  # the most characters NFC or NFKC composes into one (U+1FAF is 4 characters in NFD)


@dataclass(frozen=True)
class TokenBounds:
    """max_chars_per_token >= 1: no token covers more characters (of the normalized text). json_bytes_per_token:
    the densest probe's request bytes per token. normalizer: the tokenizer's normalizer's name (None: none)."""

    max_chars_per_token: int
    json_bytes_per_token: float
    normalizer: str | None = None


def _byte_table() -> dict[str, int]:
    from ..text.tokenizer import byte_decoder

    return byte_decoder()


def _chars_started(piece: str, table: dict[str, int]) -> int:
    """How many characters a vocabulary piece starts: its UTF-8 bytes that are not continuation bytes for a
    byte-level piece, else its length (an overestimate for sentencepiece's byte pieces, which is safe)."""
    if piece and all(c in table for c in piece):
        return sum(1 for c in piece if (table[c] & 0xC0) != 0x80)
    return len(piece)


def _probes() -> list[str]:
    """Texts dense in request bytes per token (deterministic)."""
    rnd = random.Random(0)
    rare = "".join(chr(rnd.choice([rnd.randint(0x4E00, 0x9FFF), rnd.randint(0x1F300, 0x1FAFF),
                                   rnd.randint(0xA000, 0xA48F), rnd.randint(0x10000, 0x1007F)])) for _ in range(4000))
    controls = "".join(chr(rnd.randint(1, 31)) for _ in range(4000))
    cjk = "".join(chr(rnd.randint(0x4E00, 0x4FFF)) for _ in range(4000))
    code = "".join(" " * (4 * rnd.randint(0, 6)) + rnd.choice(["x = f(y)", "return {}", "}", "pass", "i += 1"]) + "\n"
                   for _ in range(1500))
    prose = " ".join(rnd.choice(["the", "server", "refuses", "a", "request", "whose", "body", "is", "larger",
                                 "than", "its", "limit,", "and", "says", "so."]) for _ in range(3000))
    return [rare, controls, cjk, code, prose]


def measure_bounds(tok) -> TokenBounds:
    """The tokenizer's TokenBounds (a fraction of a second for a 250k vocabulary)."""
    backend = getattr(tok, "_backend", None)
    vocab = backend.get_vocab() if backend is not None else tok.hf.get_vocab()
    table = _byte_table()
    longest = max((_chars_started(p, table) for p in vocab), default=1)
    added = getattr(tok, "_added", {}) or {}
    longest = max([longest, *(len(t) for t in added.values())])
    dense = 1.0
    for text in _probes():
        n = len(tok.encode(text))
        if n:
            dense = max(dense, (len(json.dumps(text)) - 2) / n)
    norm = getattr(backend, "normalizer", None) if backend is not None else None
    return TokenBounds(max(1, longest), dense, type(norm).__name__ if norm is not None else None)


@functools.lru_cache(maxsize=8)
def token_bounds(tok) -> TokenBounds | None:
    """measure_bounds, once per tokenizer (tokenizers are shared and read-only); None for a tokenizer it cannot
    read (then prompts are only capped, not bounded by length, and the body limit is FALLBACK_BYTES)."""
    try:
        return measure_bounds(tok)
    except Exception:  # noqa: BLE001 - a tokenizer without a readable vocabulary: no length bound
        log.warning("cannot measure the tokenizer's token lengths; prompts are not bounded by length", exc_info=True)
        return None


def default_max_request_bytes(max_model_len: int, bounds: TokenBounds, images: bool) -> int:
    """The default body limit: a context of max_model_len tokens at the densest probe's bytes per token, times
    MARGIN, plus IMAGE_ALLOWANCE when the model takes images; rounded up to a whole MiB."""
    text = max_model_len * bounds.json_bytes_per_token * MARGIN
    total = text + (IMAGE_ALLOWANCE if images else 0)
    return int(math.ceil(total / (1 << 20))) * (1 << 20)


def _shrink(text: str, normalizer: str | None) -> int | None:
    """How many characters of `text` the normalizer may fold into one (None: unknown, no bound)."""
    if normalizer is None or text.isascii():
        return 1
    if normalizer in ("NFD", "NFKD"):
        return 1
    if normalizer in ("NFC", "NFKC"):
        return 1 if unicodedata.is_normalized(normalizer, text) else NFC_SHRINK
    return None


def min_tokens(text: str, bounds: TokenBounds) -> int:
    """A lower bound on text's token count from its length alone (0 where the normalizer is unknown)."""
    shrink = _shrink(text, bounds.normalizer)
    if shrink is None:
        return 0
    return -(-len(text) // (bounds.max_chars_per_token * shrink))


def too_long(max_model_len: int, n: int, why: str) -> EngineInputError:
    """The engine's context_length_exceeded refusal, for a prompt known to hold at least n tokens."""
    return EngineInputError(
        f"This model's maximum context length is {max_model_len} tokens. However, your request has at least {n} "
        f"input tokens ({why}), which leaves no room for the completion. Please reduce the length of the input.",
        "prompt", "context_length_exceeded")


def check_fits(text: str, bounds: TokenBounds, max_model_len: int) -> None:
    """Refuse (EngineInputError, context_length_exceeded) a text whose length alone proves it cannot fit."""
    n = min_tokens(text, bounds)
    if n >= max_model_len:
        raise too_long(max_model_len, n, f"a token of this tokenizer covers at most {bounds.max_chars_per_token} "
                                         f"characters, and the prompt has {len(text)}")


def _cut(text: str, at: int, lo: int) -> tuple[int, bool]:
    """Where to end the piece that would end at `at`: just after a newline followed by a printable ASCII character
    (a split point of every regex pre-tokenizer, so the pieces' tokens are the text's), searched back to lo;
    (at, False) when there is none."""
    k = text.rfind("\n", lo, at)
    while k >= lo:
        nxt = text[k + 1] if k + 1 < len(text) else ""
        if "!" <= nxt <= "~":
            return k + 1, True
        k = text.rfind("\n", lo, k)
    return at, False


def count_pieces(tok, text: str, stop_at: int | None = None) -> tuple[int, int]:
    """text's token count, tokenized CHUNK_CHARS characters at a time (so the tokenizer's memory is one piece's):
    (count, characters counted). With stop_at, counting stops once the count reaches it."""
    count, at = 0, 0
    while at < len(text):
        if at + CHUNK_CHARS < len(text):
            end, clean = _cut(text, at + CHUNK_CHARS, at + CHUNK_CHARS // 2)
        else:
            end, clean = len(text), True
        # a piece cut inside a pre-token may count one token more than the text holds there
        count += max(0, len(tok.encode(text[at:end])) - (0 if clean else 1))
        at = end
        if stop_at is not None and count >= stop_at:
            break
    return count, at


def check_prompt(tok, text: str, max_model_len: int, bounds: TokenBounds | None) -> None:
    """Refuse (EngineInputError, context_length_exceeded) a text of max_model_len tokens or more without
    tokenizing all of it: first from its length alone (check_fits, with bounds), then, for a text longer than
    CHUNK_CHARS, by counting its tokens piece by piece no further than the context."""
    if bounds is not None:
        check_fits(text, bounds, max_model_len)
    if len(text) > CHUNK_CHARS:
        count, at = count_pieces(tok, text, stop_at=max_model_len)
        if count >= max_model_len:
            raise too_long(max_model_len, count, f"counted in the first {at} of its {len(text)} characters")


def encode_capped(tok, text: str, max_model_len: int, bounds: TokenBounds | None = None
                  ) -> tuple[list[int], list[int] | None]:
    """tok.encode_with_ends(text) for a text that check_prompt lets through (it raises for the rest)."""
    check_prompt(tok, text, max_model_len, bounds)
    return tok.encode_with_ends(text)


class RequestLimits:
    """The body limit in force: `flag` (--max-request-bytes) when given, else the default for the loaded engine
    (default_max_request_bytes), FALLBACK_BYTES before it has loaded. engine_loaded runs on the engine thread
    before the engine serves, so the default is in place by the time any route can answer."""

    def __init__(self, flag: int | None = None):
        if flag is not None and flag < 1:
            raise ValueError("--max-request-bytes must be a positive number of bytes")
        self.flag = flag
        self.default: int | None = None
        self.max_model_len: int | None = None

    def engine_loaded(self, eng) -> None:
        self.max_model_len = int(eng.max_model_len)
        bounds = token_bounds(eng.tokenizer)
        if bounds is None:
            return
        config = getattr(eng, "config", None)
        images = getattr(eng, "vision", None) is not None and (config is None or config.mm_limit("image") > 0)
        self.default = default_max_request_bytes(self.max_model_len, bounds, images)
        log.info("request bodies up to %d bytes (%s); a token covers at most %d characters", self.max_body,
                 "--max-request-bytes" if self.flag is not None else "the default", bounds.max_chars_per_token)

    @property
    def max_body(self) -> int:
        if self.flag is not None:
            return self.flag
        return self.default if self.default is not None else FALLBACK_BYTES

    def message(self, size: int | None) -> str:
        """The 413's message: the body's size (when the client declared it), the limit and how to raise it."""
        how = "set by --max-request-bytes" if self.flag is not None else (
            f"the default for a context of {self.max_model_len} tokens" if self.max_model_len else "the default")
        what = f"{size} bytes, more than" if size is not None else "larger than"
        return (f"The request body is {what} this server's limit of {self.max_body} bytes ({how}). Send less, or "
                f"start the server with a larger --max-request-bytes.")
