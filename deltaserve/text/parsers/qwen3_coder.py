"""The qwen3_coder tool-call parser: Qwen3.5's XML tool calls into OpenAI `tool_calls`.

The format the model emits (one or more blocks, after optional text):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Parameter values are raw text; they are converted to JSON by the tool's parameter schema
(integer, number, boolean, object/array, null; anything else stays a string) and the call's
arguments are the JSON object of them.

Rules (the same streaming or not, because the non-streaming result *is* the streaming parser fed
the whole text):
- text before the first call is content (trailing whitespace before a call dropped);
- a call is emitted once it is complete (its `</function>` seen, and the `</tool_call>` that
  follows, if any); a tool call is never emitted half-way and then retracted;
- from the first malformed or unfinished call on, the rest of the text is content: malformed
  model output never crashes and never disappears;
- except for a forced call (tool_choice "required" or a named function) cut short by max_tokens:
  `finish(salvage=True)` returns it as a call with the parameters written so far (the value being
  written when the budget ran out ends there), because a client that forced a tool reads `tool_calls`,
  and under the call grammar the text is tool-call markup only (so a call that cannot be salvaged --
  cut before its name is known -- is dropped rather than returned as content).
"""
from __future__ import annotations

import ast
import json
import uuid
from dataclasses import dataclass
from typing import Any

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
FUNCTION_PREFIX = "<function="
FUNCTION_END = "</function>"
PARAMETER_PREFIX = "<parameter="
PARAMETER_END = "</parameter>"
_MARKERS = (TOOL_CALL_START, FUNCTION_PREFIX)
_MAX_LITERAL_EVAL = 100_000  # ast.literal_eval is not for huge inputs


@dataclass
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str  # JSON object text
    complete: bool = True  # False: a forced call max_tokens cut short, with the arguments written so far


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ---------------------------------------------------------------- value conversion


def _schema_types(schema: Any) -> list[str]:
    """The JSON types a parameter schema allows, in declaration order ([] when unknown)."""
    if not isinstance(schema, dict):
        return []
    t = schema.get("type")
    out: list[str] = []
    if isinstance(t, str):
        out.append(t)
    elif isinstance(t, list):
        out.extend(x for x in t if isinstance(x, str))
    for key in ("anyOf", "oneOf", "allOf"):
        subs = schema.get(key)
        if isinstance(subs, list):
            for s in subs:
                out.extend(x for x in _schema_types(s) if x not in out)
    if not out and "enum" in schema and isinstance(schema["enum"], list):
        for v in schema["enum"]:
            name = _json_type_name(v)
            if name not in out:
                out.append(name)
    if not out and "properties" in schema:
        out.append("object")
    if not out and "items" in schema:
        out.append("array")
    return out


def _json_type_name(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, (list, tuple)):
        return "array"
    if isinstance(v, dict):
        return "object"
    return "string"


def _as_container(raw: str, kind: type) -> Any:
    try:
        v = json.loads(raw)
        if isinstance(v, kind):
            return v
    except (ValueError, RecursionError):
        pass
    if len(raw) <= _MAX_LITERAL_EVAL:
        try:
            v = ast.literal_eval(raw)
            if isinstance(v, (tuple,)) and kind is list:
                v = list(v)
            if isinstance(v, kind):
                json.dumps(v)  # must be JSON-representable
                return v
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError, OverflowError):
            pass
    raise ValueError


_NOT_CONVERTED = object()


def _convert_as(raw: str, t: str) -> Any:
    s = raw.strip()
    if t == "null":
        if s.lower() in ("null", "none"):
            return None
    elif t == "integer":
        try:
            return int(s)
        except ValueError:
            try:
                f = float(s)
                if f.is_integer() and abs(f) < 2**63:
                    return int(f)
            except (ValueError, OverflowError):
                pass
    elif t == "number":
        try:
            if s.lstrip("+-").isdigit():
                return int(s)
            f = float(s)
            if f == f and f not in (float("inf"), float("-inf")):
                return f
        except ValueError:
            pass
    elif t == "boolean":
        if s.lower() in ("true", "false"):
            return s.lower() == "true"
    elif t == "object":
        try:
            return _as_container(s, dict)
        except ValueError:
            pass
    elif t == "array":
        try:
            return _as_container(s, list)
        except ValueError:
            pass
    elif t == "string":
        return raw
    return _NOT_CONVERTED


def convert_param_value(raw: str, schema: Any) -> Any:
    """A parameter's raw text as the JSON value its schema asks for; the text itself when it does not fit."""
    types = _schema_types(schema)
    if not types:
        return raw
    order = [t for t in ("null", "integer", "number", "boolean", "object", "array") if t in types]
    if "string" in types:
        # a string parameter keeps its text; "null" only becomes null when null is allowed as well
        if "null" in types and raw.strip() == "null":
            return None
        non_string = [t for t in order if t != "null"]
        if not non_string:
            return raw
        order = non_string + ["string"]
    for t in order:
        v = _convert_as(raw, t)
        if v is not _NOT_CONVERTED:
            return v
    return raw


# ---------------------------------------------------------------- parsing


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


def _valid_name(name: str) -> bool:
    return bool(name) and not any(c in name for c in "<>\n\r\t ") and len(name) <= 256


def _parse_function_body(body: str) -> tuple[str, list[tuple[str, str]]] | None:
    """body: the text between "<function=" and "</function>". None when malformed."""
    name, sep, rest = body.partition(">")
    name = name.strip()
    if not sep or not _valid_name(name):
        return None
    params: list[tuple[str, str]] = []
    i = 0
    n = len(rest)
    while True:
        j = rest.find(PARAMETER_PREFIX, i)
        if j < 0:
            break
        k = rest.find(">", j + len(PARAMETER_PREFIX))
        if k < 0:
            return None
        pname = rest[j + len(PARAMETER_PREFIX):k].strip()
        if not _valid_name(pname):
            return None
        vstart = k + 1
        end = rest.find(PARAMETER_END, vstart)
        nxt = rest.find(PARAMETER_PREFIX, vstart)
        if end >= 0 and (nxt < 0 or end < nxt):
            vend, i = end, end + len(PARAMETER_END)
        elif nxt >= 0:  # a missing </parameter> before the next parameter
            vend, i = nxt, nxt
        else:  # a missing </parameter> before </function>
            vend, i = n, n
        value = rest[vstart:vend]
        if value.startswith("\n"):
            value = value[1:]
        if value.endswith("\n"):
            value = value[:-1]
        params.append((pname, value))
    return name, params


def _parse_call(text: str, start: int, final: bool) -> tuple[str, Any]:
    """Parse the call whose marker is at text[start].

    -> ("ok", (name, params, end)) | ("wait", None) while it may still complete | ("bad", None)."""
    i = start
    wrapped = text.startswith(TOOL_CALL_START, i)
    if wrapped:
        i += len(TOOL_CALL_START)
        while i < len(text) and text[i].isspace():
            i += 1
        rest = text[i:i + len(FUNCTION_PREFIX)]
        if not text.startswith(FUNCTION_PREFIX, i):
            if not final and FUNCTION_PREFIX.startswith(rest):
                return "wait", None
            return "bad", None
    head = i + len(FUNCTION_PREFIX)
    gt = text.find(">", head)
    if gt < 0:
        tail = text[head:]
        if final or any(c in tail for c in "<\n") or len(tail) > 256:
            return "bad", None
        return "wait", None
    if not _valid_name(text[head:gt].strip()):
        return "bad", None
    e = text.find(FUNCTION_END, gt)
    if e < 0:
        return ("bad", None) if final else ("wait", None)
    parsed = _parse_function_body(text[head:e])
    if parsed is None:
        return "bad", None
    j = e + len(FUNCTION_END)
    if wrapped:
        k = j
        while k < len(text) and text[k].isspace():
            k += 1
        if text.startswith(TOOL_CALL_END, k):
            j = k + len(TOOL_CALL_END)
        elif not final and TOOL_CALL_END.startswith(text[k:k + len(TOOL_CALL_END)]):
            return "wait", None  # the closing tag may still come
        # else: the closing tag is missing; the call itself is complete
    return "ok", (parsed[0], parsed[1], j)


def _parse_partial_call(text: str, start: int, names: list[str], forced_name: str | None
                        ) -> tuple[str, list[tuple[str, str]]] | None:
    """The call at text[start] that max_tokens cut short: (name, parameters written so far), or None when not even
    its function is known. The parameter being written ends where the text does (a partial closing tag dropped);
    a parameter whose name was not finished is dropped."""
    i = start
    if text.startswith(TOOL_CALL_START, i):
        i += len(TOOL_CALL_START)
        while i < len(text) and text[i].isspace():
            i += 1
    elif not text.startswith(FUNCTION_PREFIX, i) and not TOOL_CALL_START.startswith(text[i:]):
        return None
    if not text.startswith(FUNCTION_PREFIX, i):
        return (forced_name, []) if forced_name else None
    head = i + len(FUNCTION_PREFIX)
    gt = text.find(">", head)
    if gt < 0:  # the name itself was cut: the forced one, or the only tool it can still be
        partial = text[head:]
        fits = [n for n in names if n.startswith(partial)]
        name = forced_name or (fits[0] if len(fits) == 1 else None)
        return (name, []) if name else None
    name = text[head:gt].strip()
    body = text[gt + 1:]
    e = body.find(FUNCTION_END)
    if e >= 0:
        body = body[:e]
    params: list[tuple[str, str]] = []
    pos = 0
    while True:
        j = body.find(PARAMETER_PREFIX, pos)
        if j < 0:
            break
        k = body.find(">", j + len(PARAMETER_PREFIX))
        if k < 0:
            break  # the parameter's name was cut
        pname = body[j + len(PARAMETER_PREFIX):k].strip()
        vstart = k + 1
        end = body.find(PARAMETER_END, vstart)
        nxt = body.find(PARAMETER_PREFIX, vstart)
        if end >= 0 and (nxt < 0 or end < nxt):
            value, pos = body[vstart:end], end + len(PARAMETER_END)
        elif nxt >= 0:
            value, pos = body[vstart:nxt], nxt
        else:  # the value being written when the budget ran out
            value = body[vstart:]
            cut = _partial_suffix(value, ("\n" + PARAMETER_END,))
            value, pos = value[:len(value) - cut], len(body)
        if value.startswith("\n"):
            value = value[1:]
        if value.endswith("\n"):
            value = value[:-1]
        if _valid_name(pname):
            params.append((pname, value))
    return (name, params) if _valid_name(name) else None


class Qwen3CoderToolParser:
    """Streaming qwen3_coder parser. feed(delta) -> (content_delta, [completed ToolCall]); finish() likewise.
    forced: the output is under a forced-call grammar (forced_name: the named function), so finish(salvage=True)
    returns a call that max_tokens cut short instead of its markup as content."""

    def __init__(self, tools: list[dict] | None = None, forced_name: str | None = None, forced: bool = False):
        self._forced_name = forced_name
        self._forced = forced or forced_name is not None
        self._schemas: dict[str, dict] = {}
        for t in tools or []:
            fn = t.get("function") if isinstance(t, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                params = fn.get("parameters")
                props = params.get("properties") if isinstance(params, dict) else None
                self._schemas[fn["name"]] = props if isinstance(props, dict) else {}
        self._text = ""
        self._pos = 0  # text[:_pos] has been emitted (as content or as calls) or dropped
        self._fallback = False  # after a malformed call everything is content
        self.tool_calls: list[ToolCall] = []

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self._text += delta
        return self._run(final=False)

    def finish(self, salvage: bool = False) -> tuple[str, list[ToolCall]]:
        """The end of the output. salvage (a forced call cut by max_tokens): the unfinished call comes back as a
        call with the arguments written so far; its markup never becomes content."""
        if not (salvage and self._forced):
            return self._run(final=True)
        content, calls = self._run(final=False)  # complete calls; _pos stops at the unfinished one
        rest = self._text[self._pos:]
        if not self._fallback and rest.strip():
            starts = [p for p in (rest.find(x) for x in _MARKERS) if p >= 0]
            m = min(starts) if starts else len(rest) - len(rest.lstrip())
            if starts and _parse_call(rest, m, final=True)[0] == "ok":  # complete after all (no </tool_call>)
                c2, k2 = self._run(final=True)
                tail = c2.strip()
                if TOOL_CALL_END.startswith(tail) or TOOL_CALL_START.startswith(tail):
                    c2 = ""  # the cut closing tag (or the next call's first bytes): markup, not content
                return content + c2, calls + k2
            part = _parse_partial_call(rest, m, list(self._schemas), self._forced_name)
            if part is not None:
                name, params = part
                call = ToolCall(len(self.tool_calls), new_tool_call_id(), name, self.arguments_json(name, params),
                                complete=False)
                self.tool_calls.append(call)
                calls.append(call)
            elif not rest[m:].startswith(_MARKERS) and not TOOL_CALL_START.startswith(rest[m:].rstrip()):
                content += rest.rstrip()  # not markup at all: text stays text
            self._pos = len(self._text)
        else:
            c2, k2 = self._run(final=True)
            content, calls = content + c2, calls + k2
        return content, calls

    def arguments_json(self, name: str, params: list[tuple[str, str]]) -> str:
        schema = self._schemas.get(name, {})
        args: dict[str, Any] = {}
        for pname, raw in params:
            args[pname] = convert_param_value(raw, schema.get(pname))
        return json.dumps(args, ensure_ascii=False)

    def _run(self, final: bool) -> tuple[str, list[ToolCall]]:
        text = self._text
        content: list[str] = []
        calls: list[ToolCall] = []
        while self._pos < len(text):
            if self._fallback:
                content.append(text[self._pos:])
                self._pos = len(text)
                break
            starts = [p for p in (text.find(m, self._pos) for m in _MARKERS) if p >= 0]
            if not starts:
                if final:
                    rest = text[self._pos:]
                    if not (self.tool_calls and not rest.strip()):
                        content.append(rest)  # after calls, whitespace alone is dropped
                    self._pos = len(text)
                    break
                safe = len(text) - _partial_suffix(text[self._pos:], _MARKERS)
                piece = text[self._pos:safe]
                keep = len(piece.rstrip())  # trailing whitespace waits: it is dropped if a call follows
                content.append(piece[:keep])
                self._pos += keep
                break
            m = min(starts)
            before = text[self._pos:m]
            if before.strip():
                keep = len(before.rstrip())
                content.append(before[:keep])
                self._pos += keep
            status, val = _parse_call(text, m, final)
            if status == "wait":
                break
            if status == "bad":
                self._fallback = True
                continue
            name, params, end = val
            call = ToolCall(len(self.tool_calls), new_tool_call_id(), name, self.arguments_json(name, params))
            self.tool_calls.append(call)
            calls.append(call)
            self._pos = end
        return "".join(content), calls


def extract_tool_calls(text: str, tools: list[dict] | None = None) -> tuple[str | None, list[ToolCall]]:
    """Non-streaming: (content or None when empty, tool calls)."""
    p = Qwen3CoderToolParser(tools)
    c1, calls1 = p.feed(text)
    c2, calls2 = p.finish()
    content = c1 + c2
    return (content if content else None), calls1 + calls2
