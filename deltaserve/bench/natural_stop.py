"""An answer cut by its token budget, presented as one the model ended itself: the agents bench's stand-in for a
model that stops.

Random weights never end an answer, so every answer of a bench on random weights ends at its budget, and the
agent CLIs treat that as a failed turn: Claude Code re-asks ("Output token limit hit. Resume directly") three
times and exits 1, Codex exits 1 on `response.incomplete`. A trained model ends its answers; the bench measures
the server's prompt caching and first-token time, not the model's answers, so its metering proxy rewrites the
end of a budget-cut answer into a natural end, the same way for every server:

- Anthropic Messages: `stop_reason` "max_tokens" -> "end_turn";
- Responses: `response.incomplete` -> `response.completed`, status "incomplete" -> "completed" (the response and
  its output items), `incomplete_details` -> null;
- Chat Completions: `finish_reason` "length" -> "stop".

Nothing else changes: the answer's text and usage pass as the server sent them.
"""
from __future__ import annotations

import json

INCOMPLETE = b"response.incomplete"


def _response(r: dict) -> None:
    if r.get("status") == "incomplete":
        r["status"] = "completed"
        r["incomplete_details"] = None
    for item in r.get("output") or []:
        if isinstance(item, dict) and item.get("status") == "incomplete":
            item["status"] = "completed"


def rewrite_event(e: dict) -> bool:
    """Rewrite one parsed answer or stream event in place; whether anything changed."""
    before = json.dumps(e, sort_keys=True)
    if e.get("type") == "message_delta" and (e.get("delta") or {}).get("stop_reason") == "max_tokens":
        e["delta"]["stop_reason"] = "end_turn"
    if e.get("type") == "message" and e.get("stop_reason") == "max_tokens":
        e["stop_reason"] = "end_turn"
    if e.get("type") == "response.incomplete":
        e["type"] = "response.completed"
    if isinstance(e.get("response"), dict):
        _response(e["response"])
    if e.get("object") == "response":
        _response(e)
    if isinstance(e.get("item"), dict) and e["item"].get("status") == "incomplete":
        e["item"]["status"] = "completed"
    for c in e.get("choices") or []:
        if isinstance(c, dict) and c.get("finish_reason") == "length":
            c["finish_reason"] = "stop"
    return json.dumps(e, sort_keys=True) != before


def rewrite_line(line: bytes) -> bytes:
    """One line of an event stream (its newline kept): `event: response.incomplete` and `data:` JSON rewritten."""
    body = line.rstrip(b"\r\n")
    end = line[len(body):]
    if body.startswith(b"event:") and body[6:].strip() == INCOMPLETE:
        return b"event: response.completed" + end
    if not body.startswith(b"data:"):
        return line
    try:
        e = json.loads(body[5:])
    except ValueError:
        return line
    if not isinstance(e, dict) or not rewrite_event(e):
        return line
    return b"data: " + json.dumps(e, ensure_ascii=False).encode() + end


def rewrite_whole(raw: bytes) -> bytes:
    """A whole (unstreamed) JSON answer, rewritten; anything else unchanged."""
    try:
        e = json.loads(raw)
    except ValueError:
        return raw
    if not isinstance(e, dict) or not rewrite_event(e):
        return raw
    return json.dumps(e, ensure_ascii=False).encode()


class LineRewriter:
    """Fed a stream's bytes in pieces of any size, gives back the rewritten bytes of every whole line so far."""

    def __init__(self):
        self._pending = b""
        self.changed = False  # whether any line was rewritten

    def _line(self, line: bytes) -> bytes:
        out = rewrite_line(line)
        self.changed |= out != line
        return out

    def feed(self, chunk: bytes) -> bytes:
        lines = (self._pending + chunk).split(b"\n")
        self._pending = lines.pop()
        return b"".join(self._line(line + b"\n") for line in lines)

    def finish(self) -> bytes:
        rest, self._pending = self._pending, b""
        return self._line(rest) if rest else b""
