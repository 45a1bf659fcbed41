"""A choice's delta stream as Anthropic content blocks, and the stream events that build them.

`BlockFolder` folds the (kind, payload) pieces of the delta stream (core.Delta.pieces) into content
blocks -- consecutive pieces of one kind are one block -- and returns, for each piece, its events:

    reasoning  -> {"type": "thinking", "thinking", "signature"}   content_block_start, thinking_delta ...,
                                                                  signature_delta, content_block_stop
    content    -> {"type": "text", "text"}                        content_block_start, text_delta ..., stop
    tool call  -> {"type": "tool_use", "id", "name", "input"}     content_block_start, input_json_delta, stop

A streamed message sends the events (between message_start and message_delta / message_stop); a whole one
keeps the blocks. One fold, so the stream always assembles to the whole message.

The thinking `signature` is a digest of the thinking text, not a cryptographic signature: clients hand
thinking blocks back with their signature, and this server reads the text and never needs to verify it.
"""
from __future__ import annotations

import base64
import hashlib
import json
from typing import Any


def signature(thinking: str) -> str:
    return base64.b64encode(hashlib.sha256(thinking.encode("utf-8")).digest()).decode("ascii")


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


class BlockFolder:
    def __init__(self):
        self.blocks: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None

    def feed(self, kind: str, payload: Any) -> list[dict]:
        events: list[dict] = []
        want = {"reasoning": "thinking", "content": "text"}.get(kind)
        if self._open is not None and self._open["type"] != want:
            events += self._close()
        if kind == "tool_call":
            return events + self._tool_use(payload)
        if self._open is None:
            block = {"type": want, want: ""}
            if want == "thinking":
                block["signature"] = ""
            self.blocks.append(block)
            self._open = block
            events.append({"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)})
        self._open[want] += payload
        delta = {"type": "thinking_delta", "thinking": payload} if want == "thinking" else \
            {"type": "text_delta", "text": payload}
        events.append({"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta})
        return events

    def finish(self) -> list[dict]:
        return self._close() if self._open is not None else []

    def _close(self) -> list[dict]:
        block, k = self._open, len(self.blocks) - 1
        self._open = None
        events = []
        if block["type"] == "thinking":
            block["signature"] = signature(block["thinking"])
            events.append({"type": "content_block_delta", "index": k,
                           "delta": {"type": "signature_delta", "signature": block["signature"]}})
        events.append({"type": "content_block_stop", "index": k})
        return events

    def _tool_use(self, call) -> list[dict]:
        block = {"type": "tool_use", "id": tool_use_id(call.id), "name": call.name, "input": {}}
        self.blocks.append(block)
        k = len(self.blocks) - 1
        events = [{"type": "content_block_start", "index": k, "content_block": dict(block)},
                  {"type": "content_block_delta", "index": k,
                   "delta": {"type": "input_json_delta", "partial_json": call.arguments}},
                  {"type": "content_block_stop", "index": k}]
        block["input"] = json.loads(call.arguments)
        return events
