"""What a proxy can read off an answer as it passes: when the first generated content arrived, the usage the
server reported and whether the model reasoned, for the three APIs the agent CLIs speak, streamed or whole.

The same clock for every server: time from the request's arrival at the proxy to the first event that carries
generated content (Anthropic `content_block_delta`; a Responses `*.delta` event; a Chat chunk whose delta has
content, reasoning or tool calls). A `message_start` or a role-only first chunk is not a token: servers send
them at different moments. A whole (unstreamed) answer's clock is its last byte.

Usage is normalised to prompt (every prompt token, cached or not), cached and output tokens:
- Anthropic: input_tokens + cache_read_input_tokens + cache_creation_input_tokens, cache_read_input_tokens;
  message_start carries the input side, message_delta the output side;
- Responses: usage.input_tokens (cached included), input_tokens_details.cached_tokens, in response.completed;
- Chat: usage.prompt_tokens, prompt_tokens_details.cached_tokens, in the last chunk (stream_options.include_usage)
  or, where a client does not ask for it, llama-server's `timings` (prompt_n + cache_n, cache_n).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field


@dataclass
class Usage:
    prompt: int | None = None
    cached: int | None = None
    output: int | None = None


@dataclass
class StreamMeter:
    """Fed the answer's bytes as they pass (feed), closed at the end (finish); started at the request's arrival."""

    started: float = field(default_factory=time.monotonic)
    streamed: bool = True
    first_content_s: float | None = None
    usage: Usage = field(default_factory=Usage)
    reasoned: bool = False
    _pending: bytes = b""
    _whole: bytearray = field(default_factory=bytearray)

    def feed(self, chunk: bytes) -> None:
        if not self.streamed:
            self._whole += chunk
            return
        lines = (self._pending + chunk).split(b"\n")
        self._pending = lines.pop()
        for line in lines:
            self._line(line.strip())

    def finish(self) -> None:
        if self.streamed:
            self._line(self._pending.strip())
            self._pending = b""
        else:
            if self.first_content_s is None:
                self.first_content_s = time.monotonic() - self.started
            try:
                self._event(json.loads(bytes(self._whole)), whole=True)
            except ValueError:
                pass

    def _line(self, line: bytes) -> None:
        if not line.startswith(b"data:"):
            return
        data = line[5:].strip()
        if not data or data == b"[DONE]":
            return
        try:
            event = json.loads(data)
        except ValueError:
            return
        if isinstance(event, dict):
            self._event(event, whole=False)

    def _content(self) -> None:
        if self.first_content_s is None:
            self.first_content_s = time.monotonic() - self.started

    def _event(self, e: dict, whole: bool) -> None:
        kind = e.get("type")
        if kind == "message_start" or (whole and kind == "message"):  # Anthropic
            self._anthropic((e.get("message") or e).get("usage") or {})
            if whole:
                self.reasoned |= any(b.get("type") == "thinking" for b in e.get("content") or [])
        elif kind == "message_delta":
            self._anthropic(e.get("usage") or {})
        elif kind == "content_block_delta":
            self._content()
            self.reasoned |= (e.get("delta") or {}).get("type") == "thinking_delta"
        elif kind == "content_block_start" and (e.get("content_block") or {}).get("type") == "thinking":
            self.reasoned = True
        elif isinstance(kind, str) and kind.startswith("response."):  # Responses
            if kind.endswith(".delta"):
                self._content()
                self.reasoned |= "reasoning" in kind
            if kind in ("response.completed", "response.incomplete"):
                self._responses(e.get("response") or {})
        elif whole and e.get("object") == "response":
            self._responses(e)
        elif "choices" in e:  # Chat
            for c in e.get("choices") or []:
                d = c.get("delta") if not whole else c.get("message")
                d = d or {}
                if d.get("content") or d.get("reasoning_content") or d.get("reasoning") or d.get("tool_calls"):
                    self._content()
                self.reasoned |= bool(d.get("reasoning_content") or d.get("reasoning"))
            u = e.get("usage")
            if u:
                self.usage.prompt = u.get("prompt_tokens", self.usage.prompt)
                self.usage.cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", self.usage.cached)
                self.usage.output = u.get("completion_tokens", self.usage.output)
            t = e.get("timings")  # llama-server's own, on its last chunk
            if t and self.usage.cached is None and "cache_n" in t:
                self.usage.cached = int(t["cache_n"])
                self.usage.prompt = self.usage.prompt or int(t.get("prompt_n", 0)) + int(t["cache_n"])
                self.usage.output = self.usage.output or t.get("predicted_n")

    def _anthropic(self, u: dict) -> None:
        if "input_tokens" in u:
            self.usage.cached = int(u.get("cache_read_input_tokens") or 0)
            self.usage.prompt = (int(u["input_tokens"]) + self.usage.cached
                                 + int(u.get("cache_creation_input_tokens") or 0))
        if "output_tokens" in u:
            self.usage.output = int(u["output_tokens"])

    def _responses(self, r: dict) -> None:
        u = r.get("usage") or {}
        if "input_tokens" in u:
            self.usage.prompt = int(u["input_tokens"])
            self.usage.cached = int((u.get("input_tokens_details") or {}).get("cached_tokens") or 0)
            self.usage.output = u.get("output_tokens")
        self.reasoned |= any(it.get("type") == "reasoning" for it in r.get("output") or [])
