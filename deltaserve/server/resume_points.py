"""Where a chat request's prompt may be resumed by a later request: the server's half of the resume-point policy.

The routes convert their request into a ChatSpec (chat_spec.py); `resume_points` takes that spec and its render
and returns the candidate positions of the sources a server can see, by source (memory/save_kind.py, the one table
of kinds), each source's positions most likely read first:

  declared    what the client marked: the end of each Anthropic block carrying `cache_control`, the end of each
              message named by the `resume_points` extension field (Chat Completions, Responses, Messages), and
              the end of the system prefix when a tool carries `cache_control` (the template renders the tools
              there). Marks travel with the message text (Marked.marks, in characters).
  structural  what the render's structure shows, knowing no client: the end of the tools and leading system
              messages (system_prefix_end), where each message of the newest turn (those after the last
              assistant message) begins, where the newest user message's last parts begin, where the system
              text's last part begins, and points before the system prefix's end at doubling distances (256 to
              2,048 tokens: backoff_points).

Every position is found from the render itself: the messages' texts are located in order in the rendered prompt
(a cursor that only moves forward, so a short text cannot match inside an earlier message), and a character
offset becomes the count of tokens that end before it, less one (a token that ends there may merge with what
follows in another request). Text the template does not write verbatim gets no position. The engine's scheduler
chooses the points a request keeps under its budget (scheduler/policy.py choose_resume_points); the learned and
grid sources are its own. A position changes no output, only where a checkpoint is kept.
"""
from __future__ import annotations

import bisect
import functools
import json

from ..memory.save_kind import SaveKind
from ..text.tokenizer import TokenizerError


class Marked(str):
    """A message's text made of the parts the client sent, joined: a plain string to the template, which also knows
    where each part after the first begins (`starts`) and where the client declared a resume point (`marks`: the
    end of a block it marked), both in characters."""

    starts: tuple[int, ...] = ()
    marks: tuple[int, ...] = ()


def parted(texts: list[str], sep: str, marked: tuple[int, ...] = ()) -> str:
    """texts joined by sep; a Marked text when there are several or when some are marked (`marked`: the indexes of
    the texts whose end the client declared a resume point)."""
    if len(texts) < 2 and not marked:
        return sep.join(texts)
    out, starts, ends, at = Marked(sep.join(texts)), [], [], 0
    for k, t in enumerate(texts):
        if k:
            at += len(sep)
            starts.append(at)
        at += len(t)
        ends.append(at)
    out.starts = tuple(starts)
    out.marks = tuple(ends[k] for k in marked if 0 <= k < len(texts))
    return out


def mark_end(message: dict) -> None:
    """Declare a resume point at the end of message's text (the `resume_points` extension field); a message whose
    content is a part list (images) or empty gets none."""
    content = message.get("content")
    if isinstance(content, str) and content:
        out = Marked(content)
        out.starts = getattr(content, "starts", ())
        out.marks = tuple(sorted(set(getattr(content, "marks", ())) | {len(content)}))
        message["content"] = out


def resume_points(tok, spec, prompt_text: str, ids: list[int], ends: list[int] | None) -> dict[str, list[int]]:
    """The candidate resume points of a rendered chat request, by source value ({"declared": [...], "structural":
    [...]}, the engine's "cache_hints" dict); a source with none is left out."""
    located = _locate(spec.messages, prompt_text)
    prefix_end = system_prefix_end(tok, spec, ids)
    declared: list[int] = []
    if spec.declared_tools and prefix_end is not None:
        declared.append(prefix_end)
    for i, m in enumerate(spec.messages):
        marks = getattr(m.get("content"), "marks", ())
        if marks and i in located:
            declared += _positions(tok, prompt_text, located[i], marks, ids, ends)
    structural: list[int] = [prefix_end] if prefix_end is not None else []
    last_assistant = max((i for i, m in enumerate(spec.messages) if m.get("role") == "assistant"), default=-1)
    turn = [i for i in range(last_assistant + 1, len(spec.messages)) if i in located]
    structural += _positions(tok, prompt_text, 0, [located[i] for i in turn], ids, ends)
    structural += part_hints(tok, spec, prompt_text, ids, ends, located)
    structural += system_hints(tok, spec, prompt_text, ids, ends, located)
    structural += backoff_points(prefix_end)
    out = {SaveKind.DECLARED.value: declared, SaveKind.STRUCTURAL.value: structural}
    return {k: list(dict.fromkeys(v)) for k, v in out.items() if v}


def _locate(messages: list[dict], prompt_text: str) -> dict[int, int]:
    """Where each message's text (a string content) begins in the rendered prompt, by message index: found in order,
    each search starting where the previous message's text ended; a message whose text the template does not write
    verbatim (or that has none) is left out and the cursor stays."""
    out, cursor = {}, 0
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, str) or not content:
            continue
        at = prompt_text.find(content, cursor)
        if at >= 0:
            out[i], cursor = at, at + len(content)
    return out


# the first user message's content in the probe of system_prefix_end: no real message starts with it
_PROBE = "\x00\x01"


def system_prefix_end(tok, spec, ids: list[int]) -> int | None:
    """Where the prompt's system prefix ends, in tokens: the tools and the leading system messages, rendered, up
    to the first token that depends on what follows them. That prefix is what every session of an agent re-sends
    (its tools and its instructions), so it is a structural resume point: the next session hits all of it. Found by
    rendering the same tools and system messages before a probe user message and taking the tokens the probe and
    the prompt share; None when they share nothing or the template refuses the probe."""
    k = leading_system(spec)
    if k == 0 and not spec.template_tools:
        return None
    key = json.dumps([spec.messages[:k], spec.template_tools, spec.template_kwargs], default=str)  # key order kept
    probe = _probe_ids(tok, key)
    if probe is None:
        return None
    shared = first_difference(probe, ids)
    return shared if 0 < shared < len(ids) else None


def leading_system(spec) -> int:
    """How many messages open the conversation as system (or developer) messages."""
    k = 0
    while k < len(spec.messages) and spec.messages[k].get("role") in ("system", "developer"):
        k += 1
    return k


BACKOFF = (256, 512, 1024, 2048)  # distances before the system prefix's end that are structural points


def backoff_points(prefix_end: int | None) -> list[int]:
    """Points before the system prefix's end at doubling distances (BACKOFF), nearest first. Instructions open with
    what every session of a client shares and end with what is the session's own (its working directory, the date,
    a memory folder named after the project), so a second session in another place parts inside the system text a
    little before its end, where no message or part boundary is. With a point at each doubling distance, a session
    that parts x tokens before the end (x up to 2,048) resumes less than max(x, 256) tokens before where it parts
    (a block's rounding aside): 95% of a 10,000-token shared prefix for x up to 500, whatever the client writes
    there. Four checkpoints, taken where the pool has room like every structural point."""
    if prefix_end is None:
        return []
    return [prefix_end - d for d in BACKOFF if prefix_end - d > 0]


PART_HINTS = 2  # the last part boundaries of the newest user message that are structural points


def part_hints(tok, spec, prompt_text: str, ids: list[int], ends: list[int] | None,
               located: dict[int, int] | None = None) -> tuple[int, ...]:
    """Where the newest user message's last parts begin, in tokens (at most PART_HINTS). Agents send a user turn as
    several parts, reminders the client generates (a date, a file list, the skills it offers) before what the user
    typed, and the next request may re-send that message without one of them (Qwen Code moves its date reminder to
    the newest message): a checkpoint at a part boundary is where the next request can resume."""
    located = _locate(spec.messages, prompt_text) if located is None else located
    i = next((k for k in range(len(spec.messages) - 1, -1, -1) if spec.messages[k].get("role") == "user"), None)
    content = spec.messages[i].get("content") if i is not None else None
    starts = getattr(content, "starts", ())[-PART_HINTS:]
    return _positions(tok, prompt_text, located.get(i, -1) if starts else -1, starts, ids, ends)


def system_hints(tok, spec, prompt_text: str, ids: list[int], ends: list[int] | None,
                 located: dict[int, int] | None = None) -> tuple[int, ...]:
    """Where the system text's last part begins when the client sent it as parts (a Messages system of blocks), in
    tokens: clients put what differs between sessions after what they share."""
    k = leading_system(spec)
    content = spec.messages[k - 1].get("content") if k else None
    if not isinstance(content, str) or not content:
        return ()
    starts = getattr(content, "starts", ())[-1:]
    located = _locate(spec.messages, prompt_text) if located is None else located
    return _positions(tok, prompt_text, located.get(k - 1, -1) if starts else -1, starts, ids, ends)


def _positions(tok, prompt_text: str, base: int, offsets, ids: list[int], ends: list[int] | None) -> tuple[int, ...]:
    """The token positions of the character offsets `offsets` of a text rendered at `base` in prompt_text (none when
    base < 0: the text is not there verbatim). A boundary's position is the count of tokens that end before it,
    less one (a token that ends there may merge with what follows in another request); without the tokenizer's
    offsets, the tokens the prompt shares with its own text cut there."""
    if base < 0 or (ends is not None and len(ends) != len(ids)):
        return ()
    out = []
    for off in offsets:
        cut = base + off
        n = (bisect.bisect_right(ends, cut) - 1 if ends is not None
             else first_difference(tok.encode(prompt_text[:cut]), ids))
        if 0 < n < len(ids):
            out.append(n)
    return tuple(out)


@functools.lru_cache(maxsize=64)
def _probe_ids(tok, key: str) -> tuple[int, ...] | None:
    """The probe's tokens for the system messages, tools and template arguments in key (JSON), rendered before a
    probe user message; cached, since an agent sends the same tools and system text on every turn and the render
    is most of the cost. None when the template refuses the probe."""
    messages, tools, kwargs = json.loads(key)
    try:
        text = tok.apply_chat_template([*messages, {"role": "user", "content": _PROBE}], tools=tools,
                                       add_generation_prompt=False, **kwargs)
    except (TokenizerError, TypeError):
        return None
    return tuple(tok.encode(text))


def first_difference(a, b) -> int:
    """The first position where token sequences a and b differ (the shorter length when one is a prefix of the
    other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
