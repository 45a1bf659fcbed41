"""Traces: what the simulator (and the real-engine replay) serves. JSONL, one request per line. No torch.

deltaserve's own format (written by the generator, read by `deltaserve simulate --trace`):

    {"request_id": "s0-t1", "arrival_time": 1.25, "session_id": "s0",
     "prompt_token_ids": [17, 942, ...], "output_length": 32}
    {"request_id": "r7", "arrival_time": 2.0, "session_id": "u3",
     "hash_ids": [0, 1, 2, 9], "input_length": 1800, "hash_block_size": 512, "output_length": 16}

arrival_time is in seconds from the start of the trace; session_id is optional; the prompt is either
explicit token ids or a list of block-hash ids plus a length (every hash id stands for hash_block_size
tokens; equal ids mean equal blocks, so prefixes are shared exactly where the ids are). output_length is
the number of tokens the request generates (the simulator and the replay finish it there: ignore_eos).
An optional "cache_salt" enters the prefix-cache hash as in the engine. An optional "images" lists the
prompt's images, each {"offset": o, "tokens": n, "id": k}: its placeholder tokens are prompt positions
o .. o + n - 1 (n = the merged grid's rows x cols, 196 for 448x448 on Qwen3.5), and k names its content (equal
ids are the same picture: its blocks hit; the engine keys them by a content hash the same way). The step that
first reaches a request's images runs the vision encoder over all of them, which the simulator prices from
the bundle's vision_encoder.csv.

Mooncake-style traces (FAST'25 "Mooncake" / kvcache-ai traces) are read too: a line with "timestamp"
(milliseconds) and no "arrival_time" is one of those:

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

Hash ids become token ids deterministically (materialize()): block id h is hash_block_size tokens drawn
from a generator seeded by h, in [TOKEN_LO, vocab); a prompt longer than its blocks is padded with
tokens unique to the request. Both the simulator and the real-engine replay see the same token ids.
"""
from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from typing import Iterable, Iterator

TOKEN_LO = 10  # below: special tokens
DEFAULT_VOCAB = 4000  # fits the tiny preset's 4,096-token vocabulary (and every real one)
MOONCAKE_BLOCK = 512


@dataclass
class TraceRequest:
    request_id: str
    arrival_time: float  # seconds from the trace start
    output_length: int
    prompt_token_ids: list[int] | None = None
    hash_ids: list[int] | None = None
    input_length: int | None = None
    hash_block_size: int = MOONCAKE_BLOCK
    session_id: str | None = None
    cache_salt: str | None = None
    extra: dict = field(default_factory=dict)
    images: list[tuple[int, int, str]] = field(default_factory=list)  # (offset, tokens, id) per image, in order

    @property
    def media(self) -> tuple[tuple[int, int, bytes], ...]:
        """The scheduler's Request.media: (offset, tokens, a content hash standing for the image id)."""
        return tuple((o, n, hashlib.sha256(b"trace-image\0" + k.encode()).digest()) for o, n, k in self.images)

    def to_json(self) -> dict:
        d: dict = {"request_id": self.request_id, "arrival_time": round(self.arrival_time, 6)}
        if self.session_id is not None:
            d["session_id"] = self.session_id
        if self.prompt_token_ids is not None:
            d["prompt_token_ids"] = list(self.prompt_token_ids)
        else:
            d["hash_ids"] = list(self.hash_ids or [])
            d["input_length"] = self.input_length
            d["hash_block_size"] = self.hash_block_size
        d["output_length"] = self.output_length
        if self.cache_salt is not None:
            d["cache_salt"] = self.cache_salt
        if self.images:
            d["images"] = [{"offset": o, "tokens": n, "id": k} for o, n, k in self.images]
        d.update(self.extra)
        return d


class TraceError(ValueError):
    pass


def parse_line(d: dict, index: int) -> TraceRequest:
    if not isinstance(d, dict):
        raise TraceError(f"line {index + 1}: not a JSON object")
    if "arrival_time" in d:
        t = float(d["arrival_time"])
    elif "timestamp" in d:  # Mooncake: milliseconds
        t = float(d["timestamp"]) / 1000.0
    else:
        raise TraceError(f"line {index + 1}: needs arrival_time (s) or timestamp (ms)")
    out = d.get("output_length", d.get("output_tokens", d.get("max_tokens")))
    if out is None or int(out) < 1:
        raise TraceError(f"line {index + 1}: output_length must be >= 1")
    rid = str(d.get("request_id", d.get("id", f"req-{index}")))
    sid = d.get("session_id", d.get("chat_id"))
    known = {"arrival_time", "timestamp", "output_length", "output_tokens", "max_tokens", "request_id", "id",
             "session_id", "chat_id", "prompt_token_ids", "hash_ids", "input_length", "hash_block_size",
             "cache_salt", "images"}
    extra = {k: v for k, v in d.items() if k not in known}
    if "prompt_token_ids" in d:
        ids = [int(x) for x in d["prompt_token_ids"]]
        if not ids:
            raise TraceError(f"line {index + 1}: empty prompt")
        return TraceRequest(rid, t, int(out), prompt_token_ids=ids, session_id=None if sid is None else str(sid),
                            cache_salt=d.get("cache_salt"), extra=extra, images=_images(d, len(ids), index))
    if "hash_ids" in d:
        hb = int(d.get("hash_block_size", MOONCAKE_BLOCK))
        hashes = [int(x) for x in d["hash_ids"]]
        n = int(d.get("input_length", len(hashes) * hb))
        if n < 1:
            raise TraceError(f"line {index + 1}: input_length must be >= 1")
        return TraceRequest(rid, t, int(out), hash_ids=hashes, input_length=n, hash_block_size=hb,
                            session_id=None if sid is None else str(sid), cache_salt=d.get("cache_salt"), extra=extra,
                            images=_images(d, n, index))
    raise TraceError(f"line {index + 1}: needs prompt_token_ids or hash_ids (+ input_length)")


def _images(d: dict, prompt_len: int, index: int) -> list[tuple[int, int, str]]:
    """A line's "images": (offset, tokens, id) each, inside the prompt, in order and apart (as the engine lays
    out placeholder runs)."""
    items = d.get("images") or []
    if not isinstance(items, list):
        raise TraceError(f"line {index + 1}: images must be a list of {{offset, tokens, id}}")
    out, end = [], 0
    for k, im in enumerate(items):
        try:
            o, n, key = int(im["offset"]), int(im["tokens"]), str(im["id"])
        except (TypeError, KeyError, ValueError):
            raise TraceError(f"line {index + 1}: image {k} needs offset, tokens and id") from None
        if n < 1 or o < end or o + n > prompt_len:
            raise TraceError(f"line {index + 1}: image {k} ({n} tokens at {o}) must lie inside the prompt of "
                             f"{prompt_len} tokens, after the previous image, and hold at least one token")
        out.append((o, n, key))
        end = o + n
    return out


def read_trace(path: str, num_reqs: int | None = None) -> list[TraceRequest]:
    """Read a JSONL trace (deltaserve or Mooncake format), sorted by arrival time, the first num_reqs of it.

    Arrival times are shifted so that the first request arrives at 0."""
    reqs: list[TraceRequest] = []
    with open(path) as f:
        for i, line in enumerate(f):
            line = line.strip()
            if not line:
                continue
            reqs.append(parse_line(json.loads(line), i))
    reqs.sort(key=lambda r: r.arrival_time)
    if num_reqs is not None:
        reqs = reqs[:num_reqs]
    if reqs:
        t0 = reqs[0].arrival_time
        for r in reqs:
            r.arrival_time -= t0
    seen: set[str] = set()
    for r in reqs:
        if r.request_id in seen:
            raise TraceError(f"request id {r.request_id!r} appears twice")
        seen.add(r.request_id)
    return reqs


def write_trace(path: str, reqs: Iterable[TraceRequest]) -> None:
    with open(path, "w") as f:
        for r in reqs:
            f.write(json.dumps(r.to_json(), separators=(",", ":")) + "\n")


class _BlockTokens:
    def __init__(self, vocab: int, seed: int):
        self.vocab, self.seed = vocab, seed
        self.cache: dict[tuple[int, int], list[int]] = {}

    def block(self, h: int, size: int) -> list[int]:
        key = (h, size)
        b = self.cache.get(key)
        if b is None:
            rng = random.Random(self.seed * 1_000_003 + h)
            b = [rng.randrange(TOKEN_LO, self.vocab) for _ in range(size)]
            self.cache[key] = b
        return b


def materialize(reqs: list[TraceRequest], vocab: int = DEFAULT_VOCAB, seed: int = 0) -> list[TraceRequest]:
    """Turn hash-id prompts into token ids (in place) and return the list. Token-id prompts are checked
    against the model's vocabulary; hash blocks draw their tokens from [TOKEN_LO, min(vocab, DEFAULT_VOCAB))."""
    blocks = _BlockTokens(min(vocab, DEFAULT_VOCAB), seed)
    for r in reqs:
        if r.prompt_token_ids is None:
            toks: list[int] = []
            for h in r.hash_ids or []:
                toks.extend(blocks.block(h, r.hash_block_size))
            n = r.input_length or len(toks)
            if len(toks) < n:
                rng = random.Random(f"pad|{seed}|{r.request_id}")
                toks.extend(rng.randrange(TOKEN_LO, min(vocab, DEFAULT_VOCAB)) for _ in range(n - len(toks)))
            r.prompt_token_ids = toks[:n]
        else:
            bad = [t for t in r.prompt_token_ids if not 0 <= t < vocab]
            if bad:
                raise TraceError(f"request {r.request_id}: token id {bad[0]} outside the vocabulary [0, {vocab})")
    return reqs


# ---------------------------------------------------------------------------------------- the generator
@dataclass
class AgentTraceSpec:
    """Synthetic agent sessions: every session starts with the same system prompt and tool definitions,
    then each turn appends the previous output and new tokens (a tool result or a user message) and
    re-sends the whole conversation. Sessions start as a Poisson process; turns follow each other after
    a think time (the tool call or the user, exponential), measured from the previous turn's arrival since
    the trace is open-loop, and at least min_gap: a real agent's next turn never arrives before the answer
    to its last one, which an exponential gap alone allows (two turns 10 ms apart racing for one
    checkpoint)."""

    num_sessions: int = 20
    session_rate: float = 1.0  # sessions per second (Poisson)
    turns: tuple[int, int] = (2, 5)  # turns per session, inclusive range
    system_tokens: int = 512  # shared by every session (system prompt + tools)
    first_user_tokens: tuple[int, int] = (64, 256)
    new_tokens: tuple[int, int] = (32, 192)  # appended per later turn (tool result / user message)
    output_tokens: tuple[int, int] = (16, 64)
    think_time: float = 2.0  # mean seconds between a turn's arrival and the next (exponential)
    min_gap: float = 0.0  # at least this many seconds between turns of a session
    vocab: int = DEFAULT_VOCAB
    seed: int = 0


def agent_trace(spec: AgentTraceSpec) -> list[TraceRequest]:
    rng = random.Random(spec.seed)
    tok = lambda n: [rng.randrange(TOKEN_LO, spec.vocab) for _ in range(n)]  # noqa: E731
    system = tok(spec.system_tokens)
    reqs: list[TraceRequest] = []
    t = 0.0
    for s in range(spec.num_sessions):
        t += rng.expovariate(spec.session_rate) if s else 0.0
        sid = f"s{s}"
        history = system + tok(rng.randint(*spec.first_user_tokens))
        at = t
        for k in range(rng.randint(*spec.turns)):
            if k:
                history = history + tok(rng.randint(*spec.new_tokens))
            out = rng.randint(*spec.output_tokens)
            reqs.append(TraceRequest(f"{sid}-t{k}", at, out, prompt_token_ids=list(history), session_id=sid))
            history = history + tok(out)  # what the assistant said (the real engine says something else)
            at += max(spec.min_gap, rng.expovariate(1.0 / spec.think_time) if spec.think_time > 0 else 0.0)
    reqs.sort(key=lambda r: (r.arrival_time, r.request_id))
    return reqs


def mooncake_like(num_reqs: int = 100, rate: float = 1.0, seed: int = 0, block: int = MOONCAKE_BLOCK,
                  prefix_pool: int = 8, max_blocks: int = 8, output: tuple[int, int] = (16, 128)) -> Iterator[dict]:
    """Mooncake-format lines (timestamp ms, hash_ids, input_length, output_length) with shared prefixes:
    each request starts with one of prefix_pool shared chains, then its own blocks."""
    rng = random.Random(seed)
    prefixes = [[p * 1000 + j for j in range(rng.randint(1, max(1, max_blocks // 2)))] for p in range(prefix_pool)]
    t = 0.0
    next_id = 10 ** 6
    for i in range(num_reqs):
        t += rng.expovariate(rate)
        ids = list(rng.choice(prefixes))
        for _ in range(rng.randint(0, max(0, max_blocks - len(ids)))):
            ids.append(next_id)
            next_id += 1
        n = len(ids) * block - rng.randrange(0, block)
        yield {"timestamp": int(t * 1000), "input_length": max(1, n), "output_length": rng.randint(*output),
               "hash_ids": ids}
