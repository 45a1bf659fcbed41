"""Responses API input items -> the chat template's messages (and a response's output back into them).

Items map onto the conversation the template renders: user / system / developer messages as they are; an
assistant turn is the run of `reasoning`, assistant `message`, `function_call` and `custom_tool_call` items that
follow one another (reasoning_content, content, tool_calls); a `function_call_output` or
`custom_tool_call_output` is a tool message. A call to a namespaced tool is written with its qualified name and a
custom tool's call as its one `input` parameter, as the model was shown them (tools.py); `additional_tools`
items render nothing here (their tools join the request's). The same
mapping turns a stored response's output into the assistant message a `previous_response_id` continues
from, so a continued conversation renders to the same prefix the first turn did -- which is what lets the
prefix cache serve it.

Reasoning's `encrypted_content` (include: ["reasoning.encrypted_content"], what stateless clients such as
Codex CLI send back) is NOT encrypted here: it is the reasoning text, base64-encoded behind a prefix, which
the server reads back. deltaserve returns the reasoning in the clear anyway; the field exists so that a
client that keeps no server state can still hand the reasoning back.
"""
from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from ..chat_spec import image_content
from ..resume_points import mark_end
from ..errors import bad_request
from .protocol import CallFields, CustomToolCallItem, FunctionCallOutputItem, MessageItem, ReasoningItem
from .tools import CUSTOM_INPUT, qualified

_OPAQUE_PREFIX = "deltaserve-reasoning-v1:"


def encode_reasoning(text: str) -> str:
    return _OPAQUE_PREFIX + base64.b64encode(text.encode("utf-8")).decode("ascii")


def decode_reasoning(blob: str, where: str) -> str:
    if not blob.startswith(_OPAQUE_PREFIX):
        raise bad_request("This encrypted_content was not written by this server, which cannot read it; send the "
                          "reasoning as content parts of type reasoning_text instead.", where,
                          "invalid_encrypted_content")
    try:
        return base64.b64decode(blob[len(_OPAQUE_PREFIX):], validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        raise bad_request("encrypted_content is damaged.", where, "invalid_encrypted_content") from None


def _reasoning_text(it: ReasoningItem, where: str) -> str:
    if it.content:
        return "".join(p.text for p in it.content)
    if it.encrypted_content:
        return decode_reasoning(it.encrypted_content, where + ".encrypted_content")
    return "\n\n".join(p.text for p in it.summary)


def _arguments(text: str, where: str) -> dict:
    try:
        v = json.loads(text)
    except ValueError:
        v = None
    if not isinstance(v, dict):
        raise bad_request(f"{where} must be a JSON object (the function's arguments).", where, "invalid_value")
    return v


def input_messages(items: str | list, known_calls: set[str] | None = None,
                   resume_points: list[int] | None = None) -> list[dict]:
    """The request's input as template messages. known_calls: call ids from the conversation it continues
    (a function_call_output must answer a call made before it). resume_points: the input items whose end the client
    declares a resume point (the extension field): the end of the message each one went into is marked (a leading
    system message is then joined with the instructions, and the system prefix's end is a structural point anyway)."""
    if isinstance(items, str):
        out = [{"role": "user", "content": items}]
        if resume_points:
            mark_end(out[0])
        return out
    marked = set(resume_points or ())
    calls = set(known_calls or ())
    out: list[dict[str, Any]] = []
    cur: dict[str, Any] | None = None  # the assistant turn being assembled

    def assistant() -> dict[str, Any]:
        m: dict[str, Any] = {"role": "assistant", "content": ""}
        out.append(m)
        return m

    for i, it in enumerate(items):
        where = f"input[{i}]"
        if isinstance(it, MessageItem):
            if it.role == "assistant":
                if cur is None or cur["content"] or cur.get("tool_calls"):
                    cur = assistant()
                cur["content"] += it.text()
            else:
                cur = None
                role = "system" if it.role in ("system", "developer") else "user"
                out.append({"role": role, "content": image_content(it.parts(), role, where + ".content", sep="")})
        elif isinstance(it, ReasoningItem):
            if cur is None or cur["content"] or cur.get("tool_calls") or "reasoning_content" in cur:
                cur = assistant()
            cur["reasoning_content"] = _reasoning_text(it, where)
        elif isinstance(it, CallFields):
            if cur is None:
                cur = assistant()
            if isinstance(it, CustomToolCallItem):
                args = {CUSTOM_INPUT: it.input}
            else:
                args = _arguments(it.arguments, where + ".arguments")
            cur.setdefault("tool_calls", []).append(
                {"id": it.call_id, "type": "function",
                 "function": {"name": qualified(it.namespace, it.name), "arguments": args}})
            calls.add(it.call_id)
        elif isinstance(it, FunctionCallOutputItem):  # custom_tool_call_output too
            if it.call_id not in calls:
                call = "custom_tool_call" if it.type == "custom_tool_call_output" else "function_call"
                raise bad_request(f"No {call} with call_id {it.call_id!r} comes before this "
                                  f"{it.type}.", where + ".call_id", "invalid_value")
            cur = None
            out.append({"role": "tool", "tool_call_id": it.call_id,
                        "content": image_content(it.parts(), "tool", where + ".output", sep="")})
        if i in marked and out:
            mark_end(out[-1])
    return out


def output_message(output: list[dict]) -> dict | None:
    """A response's output items as the one assistant message the next turn renders (None if it wrote nothing)."""
    m: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in output:
        if item["type"] == "reasoning":
            m["reasoning_content"] = "".join(p["text"] for p in item.get("content") or [])
        elif item["type"] == "message":
            m["content"] += "".join(p["text"] for p in item["content"])
        elif item["type"] in ("function_call", "custom_tool_call"):
            if item["type"] == "custom_tool_call":
                args = {CUSTOM_INPUT: item["input"]}
            else:
                args = json.loads(item["arguments"] or "{}")
            m.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": qualified(item.get("namespace"), item["name"]), "arguments": args}})
    return m if (m["content"] or m.get("tool_calls") or m.get("reasoning_content")) else None


def call_ids(messages: list[dict]) -> set[str]:
    return {c["id"] for m in messages for c in m.get("tool_calls") or [] if c.get("id")}


def with_instructions(instructions: str | None, messages: list[dict]) -> list[dict]:
    """instructions and the conversation's leading system / developer messages become one system message at the
    start (Qwen's templates take the system prompt there only)."""
    k = 0
    while k < len(messages) and messages[k]["role"] == "system":
        k += 1
    texts = ([instructions] if instructions else []) + [m["content"] for m in messages[:k]]
    head = [{"role": "system", "content": "\n\n".join(texts)}] if texts else []
    return head + messages[k:]
