"""Where a client's next request stops being the previous one re-sent, in tokens of the server's own rendering,
and why.

A request is rendered as the server renders it (the API's request model, its chat spec, the model's template
and tokenizer), so the positions are the tokens the prefix cache sees. For a turn that reads less from the cache
than the previous request's prompt plus its output, the first token where the two renderings differ is placed:

- inside the previous prompt: in the tool block, the system text or message k of the conversation, with a
  cause read off the text around it (a date or time that changed, the tool list changed, the system text
  changed, a message re-rendered);
- after it (the previous prompt is whole): in the previous answer as the client re-sends it: the template drops
  the reasoning of earlier turns (Qwen3.5's does), or the answer comes back re-rendered;
- nowhere (the previous prompt and answer are re-sent whole): the cache did not hold them (evicted, or no
  checkpoint there).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ...server.anthropic.input import messages_spec
from ...server.anthropic.protocol import MessagesRequest
from ...server.chat_spec import render_prompt
from ...server.resume_points import first_difference  # noqa: F401 - first_difference: report.py
from ...server.openai.protocol import ChatCompletionRequest
from ...server.openai.routes import chat_spec
from ...server.responses.input import input_messages, with_instructions
from ...server.responses.protocol import ResponsesRequest
from ...server.responses.routes import responses_spec

DIGITS = re.compile(r"\d")


def render(path: str, body: dict, tok) -> str:
    """The prompt text the server renders for this request body (path: /v1/messages, /v1/chat/completions or
    /v1/responses; a Responses request continued by previous_response_id is rendered without the stored part)."""
    if path.endswith("/messages"):
        spec = messages_spec(MessagesRequest.model_validate(body))
    elif path.endswith("/chat/completions"):
        spec = chat_spec(ChatCompletionRequest.model_validate(body))
    elif path.endswith("/responses"):
        req = ResponsesRequest.model_validate(body)
        spec = responses_spec(req, with_instructions(req.instructions, input_messages(req.input, set())))
    else:
        raise ValueError(f"no rendering for {path}")
    return render_prompt(tok, spec)


@dataclass(frozen=True)
class Divergence:
    position: int  # the first token of the next prompt that the previous prompt + answer do not give
    where: str  # tools, system, message k (role), previous answer, none
    cause: str
    before: str  # the text of the previous rendering from the divergence on (a few dozen characters)
    after: str  # the text of the next rendering from there


def _segment(tok, ids: list[int], pos: int) -> tuple[str, int]:
    """The chat segment that holds token pos: its role and its index (0 = the first <|im_start|> segment)."""
    text = tok.decode(ids[:pos], skip_special_tokens=False)
    k = text.count("<|im_start|>") - 1
    role = text[text.rfind("<|im_start|>") + len("<|im_start|>"):].split("\n", 1)[0] if k >= 0 else "(start)"
    in_tools = role == "system" and "<tools>" in text[text.rfind("<|im_start|>"):] and \
        "</tools>" not in text[text.rfind("<|im_start|>"):]
    return ("tools" if in_tools else role), k


def _word_at(tok, ids: list[int], pos: int) -> str:
    """The whitespace-delimited word of the rendering that holds token pos."""
    left = tok.decode(ids[max(0, pos - 24):pos], skip_special_tokens=False)
    right = tok.decode(ids[pos:pos + 24], skip_special_tokens=False)
    return (left.split()[-1] if left.strip() and not left[-1].isspace() else "") + \
        (right.split()[0] if right.strip() and not right[0].isspace() else "")


def explain(tok, prev: list[int], prev_output: int, prev_reasoned: bool, nxt: list[int]) -> Divergence:
    """Why nxt does not continue prev (+ its prev_output generated tokens) further than it does."""
    d = first_difference(prev, nxt)
    window = 48
    before = tok.decode(prev[d:d + 24], skip_special_tokens=False)[:window]
    after = tok.decode(nxt[d:d + 24], skip_special_tokens=False)[:window]
    if d < len(prev):
        where, k = _segment(tok, prev, d)
        if DIGITS.search(before[:16]) and DIGITS.search(after[:16]):
            cause = ("a path in the text changed" if "/" in _word_at(tok, prev, d)
                     else "a date or number in the text changed")
        elif where == "tools":
            cause = "the tool list changed"
        elif where == "system":
            cause = "the system text changed"
        else:
            cause = f"message {k} ({where}) is re-sent differently"
        return Divergence(d, "tools" if where == "tools" else f"message {k} ({where})", cause, before, after)
    if len(nxt) > len(prev) and prev_output:
        cause = ("the template drops the previous turn's reasoning" if prev_reasoned
                 else "the previous answer is re-sent re-rendered")
        return Divergence(d, "previous answer", cause, "", after)
    return Divergence(d, "none", "rendered as the previous prompt + answer: the cache did not hold them", "", "")
