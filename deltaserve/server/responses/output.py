"""A choice's delta stream as Responses API output items, and the typed events that build them.

`OutputFolder` folds the (kind, payload) pieces of the delta stream (core.Delta.pieces: reasoning text,
content text, tool calls) into output items -- consecutive pieces of one kind are one item; a change of kind
closes the item and opens the next -- and returns, for each piece, the stream events that say so. A
streamed response sends those events; a whole response keeps only the items. Both come from one fold,
so a streamed response always assembles to the whole one.

    reasoning  -> {"type": "reasoning", "content": [{"type": "reasoning_text"}], "summary": [...]}
                  events: output_item.added, reasoning_text.delta (+ reasoning_summary_* with a summary), ...done
    content    -> {"type": "message", "role": "assistant", "content": [{"type": "output_text"}]}
                  events: output_item.added, content_part.added, output_text.delta, output_text.done, ...
    tool call  -> {"type": "function_call", "call_id", "name", "arguments"} (+ "namespace": the call of a
                  namespaced tool carries its bare name and its namespace, as OpenAI's API writes it)
                  events: output_item.added, function_call_arguments.delta, function_call_arguments.done, ...
                  a custom tool's call: {"type": "custom_tool_call", "call_id", "name", "input"} (+ "namespace")
                  events: output_item.added, custom_tool_call_input.delta, custom_tool_call_input.done, ...
"""
from __future__ import annotations

import uuid
from typing import Any

from .input import encode_reasoning
from .tools import ToolRef, custom_input


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputFolder:
    """summary: the reasoning item carries its text as a summary too; opaque: it carries encrypted_content.
    tools: what each function name the model may call stands for (tools.ToolSet.refs; a name not in it is a
    plain function call)."""

    def __init__(self, summary: bool = False, opaque: bool = False, tools: dict[str, ToolRef] | None = None):
        self.items: list[dict[str, Any]] = []
        self.summary = summary
        self.opaque = opaque
        self.tools = tools or {}
        self._open: dict[str, Any] | None = None  # the item still being written (reasoning or message)

    @property
    def _index(self) -> int:
        return len(self.items) - 1

    def feed(self, kind: str, payload: Any) -> list[dict]:
        """One piece -> the events it causes (the items are updated in place)."""
        events: list[dict] = []
        want = {"reasoning": "reasoning", "content": "message"}.get(kind)
        if self._open is not None and self._open["type"] != want:
            events += self._close("completed")
        if kind == "tool_call":
            return events + self._call(payload)
        if self._open is None:
            events += self._start(want)
        item, k = self._open, self._index
        if want == "reasoning":
            item["content"][0]["text"] += payload
            events.append({"type": "response.reasoning_text.delta", "item_id": item["id"], "output_index": k,
                           "content_index": 0, "delta": payload})
            if self.summary:
                item["summary"][0]["text"] += payload
                events.append({"type": "response.reasoning_summary_text.delta", "item_id": item["id"],
                               "output_index": k, "summary_index": 0, "delta": payload})
        else:
            item["content"][0]["text"] += payload
            events.append({"type": "response.output_text.delta", "item_id": item["id"], "output_index": k,
                           "content_index": 0, "delta": payload, "logprobs": []})
        return events

    def finish(self, status: str) -> list[dict]:
        """The end of the choice: close what is open (status "incomplete" when the token budget ran out)."""
        return self._close(status) if self._open is not None else []

    # ---------------------------------------------------------------- items
    def _start(self, kind: str) -> list[dict]:
        if kind == "reasoning":
            item = {"id": _id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
            added = _copy(item)
            item["content"].append({"type": "reasoning_text", "text": ""})
            if self.summary:
                item["summary"].append({"type": "summary_text", "text": ""})
        else:
            item = {"id": _id("msg"), "type": "message", "role": "assistant", "status": "in_progress", "content": []}
            added = _copy(item)
            item["content"].append({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        self.items.append(item)
        self._open = item
        k = self._index
        events = [{"type": "response.output_item.added", "output_index": k, "item": added}]
        if kind == "reasoning":
            events.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": k,
                           "content_index": 0, "part": {"type": "reasoning_text", "text": ""}})
            if self.summary:
                events.append({"type": "response.reasoning_summary_part.added", "item_id": item["id"],
                               "output_index": k, "summary_index": 0, "part": {"type": "summary_text", "text": ""}})
        else:
            events.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": k,
                           "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": [],
                                                        "logprobs": []}})
        return events

    def _close(self, status: str) -> list[dict]:
        item, k = self._open, self._index
        self._open = None
        item["status"] = status
        part = item["content"][0]
        events: list[dict] = []
        if item["type"] == "reasoning":
            events.append({"type": "response.reasoning_text.done", "item_id": item["id"], "output_index": k,
                           "content_index": 0, "text": part["text"]})
            events.append({"type": "response.content_part.done", "item_id": item["id"], "output_index": k,
                           "content_index": 0, "part": _copy(part)})
            if self.summary:
                s = item["summary"][0]
                events.append({"type": "response.reasoning_summary_text.done", "item_id": item["id"],
                               "output_index": k, "summary_index": 0, "text": s["text"]})
                events.append({"type": "response.reasoning_summary_part.done", "item_id": item["id"],
                               "output_index": k, "summary_index": 0, "part": _copy(s)})
            if self.opaque:
                item["encrypted_content"] = encode_reasoning(part["text"])
        else:
            events.append({"type": "response.output_text.done", "item_id": item["id"], "output_index": k,
                           "content_index": 0, "text": part["text"], "logprobs": []})
            events.append({"type": "response.content_part.done", "item_id": item["id"], "output_index": k,
                           "content_index": 0, "part": _copy(part)})
        events.append({"type": "response.output_item.done", "output_index": k, "item": _copy(item)})
        return events

    def _call(self, call) -> list[dict]:
        ref = self.tools.get(call.name, ToolRef("function", call.name))
        if ref.kind == "custom":
            item = {"id": _id("ctc"), "type": "custom_tool_call", "status": "in_progress", "call_id": call.id,
                    "name": ref.name, "input": ""}
        else:
            item = {"id": _id("fc"), "type": "function_call", "status": "in_progress", "call_id": call.id,
                    "name": ref.name, "arguments": ""}
        if ref.namespace is not None:
            item["namespace"] = ref.namespace
        self.items.append(item)
        k = self._index
        events = [{"type": "response.output_item.added", "output_index": k, "item": _copy(item)}]
        if ref.kind == "custom":
            text = custom_input(call.arguments)
            events += [{"type": "response.custom_tool_call_input.delta", "item_id": item["id"], "output_index": k,
                        "delta": text},
                       {"type": "response.custom_tool_call_input.done", "item_id": item["id"], "output_index": k,
                        "input": text}]
            item["input"] = text
        else:
            events += [{"type": "response.function_call_arguments.delta", "item_id": item["id"], "output_index": k,
                        "delta": call.arguments},
                       {"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": k,
                        "name": ref.name, "arguments": call.arguments}]
            item["arguments"] = call.arguments
        # a forced call cut by max_output_tokens comes back with the arguments written so far, as incomplete
        item["status"] = "completed" if getattr(call, "complete", True) else "incomplete"
        events.append({"type": "response.output_item.done", "output_index": k, "item": _copy(item)})
        return events


def _copy(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _copy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_copy(v) for v in d]
    return d
