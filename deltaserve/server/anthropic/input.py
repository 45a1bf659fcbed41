"""Anthropic Messages -> the chat template's messages, and the request -> the one internal chat request.

`system` becomes the system message, its text blocks joined, less any block that starts with
`x-anthropic-billing-header:` (Claude Code's telemetry line, `cc_version=...; cc_entrypoint=...;`, whose suffix
changes from session to session: as the first text of the prompt it would make every session's prompt differ
from its first token, and no prefix cache would ever hit). A user message's `tool_result` blocks become tool
messages (in their order, around its text); an assistant message's `thinking`, `text` and `tool_use` blocks
become its reasoning_content, content and tool_calls. A final assistant message is a prefill: the answer
continues from its text (rendered after the generation prompt, not returned).

A system message inside `messages` (Claude Code sends its environment text so, after the first user message)
becomes a user message holding its text (its text blocks joined, the billing line dropped as above; one with
no text is left out), in its place: the Qwen3.5 chat template allows a system message only as the first
message (it raises "System message must be at the beginning" otherwise), and a user message is what every
template renders anywhere. Only when `system` is absent (or holds only the billing line) and `messages[0]` is a
system message does that one become the system message. The rule depends on nothing but the message's own
place and text, so the rendering of turn k stays a prefix of turn k+1's (a string or the same text as blocks
render alike).

`tools` (input_schema) become chat tools; tool_choice auto / any / tool / none become auto / required / the
named function / none. Thinking: `enabled` turns the template's thinking on with its budget enforced
(structured.ThinkingBudgetGuide); `disabled` or absent: off (Anthropic's default; an effort alone does not turn
it on, as Claude Code sends one with thinking turned off too); `adaptive`: the effort decides -- low: off,
medium: on with at most 8,192 thinking tokens (protocol.EFFORT_BUDGET; none when max_tokens is smaller), high,
xhigh, max or no effort: on, bounded by max_tokens only. The effort is output_config.effort, or that of the
last system message in `messages` carrying one (per-turn effort holds from its message on). `thinking.display`
is a display preference: the thinking is returned as written whatever it says ("omitted" included), because
its text is what makes the next turn's prompt continue this one (the signature is only a digest of it, from
which the text cannot be recovered as Anthropic's encrypted signature can). output_config.format (a JSON
schema) is enforced by the grammar, as response_format is in chat.
"""
from __future__ import annotations

from typing import Any

from ..chat_spec import ChatSpec, image_content
from ..resume_points import mark_end, parted
from ..errors import bad_request
from .protocol import (CountTokensRequest, ImageBlock, MessagesRequest, TextBlock, ThinkingBlock, ToolResultBlock,
                       ToolUseBlock)

NAMES = {"prompt": "messages", "stop": "stop_sequences", "multi_modal_data": "messages"}
_CHOICES = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}
BILLING_HEADER = "x-anthropic-billing-header:"  # a system text block starting so is client telemetry: dropped


def _system(system) -> str | None:
    """A system prompt's text: a string as is; text blocks joined, less the client's billing line, each block that
    carries cache_control marking a declared resume point at its end (resume_points.parted)."""
    if system is None:
        return None
    if isinstance(system, str):
        return system
    kept = [b for b in system if not b.text.startswith(BILLING_HEADER)]
    return parted([b.text for b in kept], "", tuple(k for k, b in enumerate(kept) if b.cache_control is not None))


def conversation(req: CountTokensRequest) -> tuple[list[dict], str]:
    """(template messages, prefill text)."""
    out: list[dict[str, Any]] = []
    sys = _system(req.system)
    msgs = list(req.messages)
    opening = not sys and msgs[0].role == "system"  # the conversation opens with the system prompt: it is that one
    if opening:
        sys = _system(msgs[0].content)
    if sys:
        out.append({"role": "system", "content": sys})
    calls: set[str] = set()
    prefill = ""
    if msgs[-1].role == "assistant":
        last = msgs.pop()
        blocks = [last.content] if isinstance(last.content, str) else last.content
        if not all(isinstance(b, (str, TextBlock)) for b in blocks):
            raise bad_request("A final assistant message (a prefill) may only hold text.",
                              f"messages.{len(msgs)}.content")
        if req.thinking_on:
            raise bad_request("A final assistant message (a prefill) cannot be combined with thinking.",
                              f"messages.{len(msgs)}")
        prefill = "".join(b if isinstance(b, str) else b.text for b in blocks)
    ends: dict[int, int] = {}  # request message index -> the index of its last template message
    for i, m in enumerate(msgs):
        if out:
            ends[i - 1] = len(out) - 1
        if m.role == "system":  # not first in the template's messages: a user message holding its text
            text = _system(m.content)
            if text and not (i == 0 and opening):
                out.append({"role": "user", "content": text})
            continue
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        if m.role == "assistant":
            a: dict[str, Any] = {"role": "assistant", "content": ""}
            for b in m.content:
                if isinstance(b, ThinkingBlock):
                    a["reasoning_content"] = a.get("reasoning_content", "") + b.thinking
                elif isinstance(b, TextBlock):
                    a["content"] += b.text
                elif isinstance(b, ToolUseBlock):
                    a.setdefault("tool_calls", []).append(
                        {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}})
                    calls.add(b.id)
            out.append(a)
            if any(b.cache_control is not None for b in m.content):
                mark_end(a)  # where the template puts a marked block of an assistant turn: its text's end
            continue
        text: list[tuple[str, str]] = []  # ("text", text) / ("image", data URL): chat_spec.image_content
        marked: list[int] = []  # the parts of text whose block carries cache_control
        for k, b in enumerate(m.content):
            if isinstance(b, ToolResultBlock):
                if b.tool_use_id not in calls:
                    raise bad_request(f"tool_result block names tool_use_id {b.tool_use_id!r}, which no earlier "
                                      "tool_use block has.", f"messages.{i}.content.{k}.tool_use_id")
                if text:
                    out.append({"role": "user", "content": image_content(text, "user", f"messages.{i}.content", "",
                                                                         tuple(marked))})
                    text, marked = [], []
                parts = b.parts()
                out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                            "content": image_content(parts, "tool", f"messages.{i}.content.{k}.content", "")})
                if b.cache_control is not None:
                    mark_end(out[-1])
            elif isinstance(b, ImageBlock):
                text.append(("image", b.source.data_url()))
            else:
                if b.cache_control is not None:
                    marked.append(len(text))
                text.append(("text", b.text))
        if text:
            out.append({"role": "user", "content": image_content(text, "user", f"messages.{i}.content", "",
                                                                 tuple(marked))})
    if out:
        ends[len(msgs) - 1] = len(out) - 1
    for i in set(req.resume_points or ()) | ({len(msgs) - 1} if req.cache_control is not None else set()):
        if i in ends:  # a final assistant message (a prefill) renders after the generation prompt: no point
            mark_end(out[ends[i]])
    return out, prefill


def messages_spec(req: MessagesRequest | CountTokensRequest) -> ChatSpec:
    messages, prefill = conversation(req)
    tc = req.tool_choice
    tools = [t.as_chat_tool() for t in req.tools] if req.tools else None
    spec = ChatSpec(messages=messages, tools=tools, tool_choice=_CHOICES[tc.type] if tc is not None else None,
                    tool_name=tc.name if tc is not None and tc.type == "tool" else None,
                    parallel_tool_calls=not (tc is not None and tc.disable_parallel_tool_use),
                    template_kwargs={"enable_thinking": req.thinking_on}, prefill=prefill,
                    thinking_budget=req.thinking_budget, names=NAMES, id_prefix="msg_",
                    declared_tools=any(t.cache_control is not None for t in req.tools or ()))
    if isinstance(req, MessagesRequest):
        spec.max_tokens = req.max_tokens
        if spec.thinking_budget is not None and spec.thinking_budget >= req.max_tokens:
            spec.thinking_budget = None  # an effort's budget max_tokens reaches first (enabled's is checked < it)
        spec.sampling = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
                         "stop": req.stop_sequences}
        if req.top_p == 0:  # Anthropic's range takes 0: a nucleus of no mass keeps the likeliest token, greedy
            spec.sampling.update(temperature=0.0, top_p=None)
        fmt = req.output_config.format if req.output_config is not None else None
        if fmt is not None:
            spec.response_format = ("json_schema", fmt.json_schema)
            spec.names = {**NAMES, "response_format": "output_config.format"}
    return spec
