"""docs/api-fields.md has one row per request field of every API, and no row for a field that is gone.

Each request model forbids unknown fields, so what a client may send is exactly the models' fields: read them
here (nested models and unions included) as paths like `messages[].tool_calls[].function.name` or
`input[type=function_call].call_id`, and compare with the table's rows. A field added to a model without
a row (saying whether it is honoured, accepted as a hint or refused) fails here. Rows for fields the published
API has and the models leave out are allowed only as "refused": a request that sends one gets a 400 naming it.
"""
from __future__ import annotations

import inspect
import os
import re
import typing

from pydantic import BaseModel

from deltaserve.server.anthropic import protocol as anthropic
from deltaserve.server.openai import protocol as openai
from deltaserve.server.responses import protocol as responses

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "api-fields.md")
APIS = {
    "Chat Completions": openai.ChatCompletionRequest,
    "Completions": openai.CompletionRequest,
    "Responses": responses.ResponsesRequest,
    "Messages": anthropic.MessagesRequest,
    "Count tokens": anthropic.CountTokensRequest,
}
TREATMENTS = ("honoured", "hint", "refused")


def _models(tp) -> list[type[BaseModel]]:
    if inspect.isclass(tp) and issubclass(tp, BaseModel):
        return [tp]
    found = []
    for arg in typing.get_args(tp):
        found += _models(arg)
    return found


def _is_list(tp) -> bool:
    if typing.get_origin(tp) is typing.Annotated:
        return _is_list(typing.get_args(tp)[0])
    return typing.get_origin(tp) in (list, tuple) or any(_is_list(a) for a in typing.get_args(tp)
                                                        if typing.get_origin(tp) is not dict)


def _tag(model: type[BaseModel]) -> str:
    """`[type=x]` for a model that one value of its `type` field names (a member of a tagged union)."""
    f = model.model_fields.get("type")
    if f is not None and typing.get_origin(f.annotation) is typing.Literal and len(typing.get_args(f.annotation)) == 1:
        return f"type={typing.get_args(f.annotation)[0]}"
    return ""


def field_paths(model: type[BaseModel]) -> set[str]:
    """Every field's path. A model met again under another path is read once, at its shallowest path (tools at
    `tools[]`, not again under `input[type=additional_tools].tools`): its other paths are rows of their own."""
    paths, seen, queue = set(), {model}, [(model, "")]
    while queue:  # breadth first, so a model is read where it sits shallowest
        model, prefix = queue.pop(0)
        for name, f in model.model_fields.items():
            path = prefix + (f.alias or name)
            paths.add(path)
            subs = _models(f.annotation)
            for m in subs:
                if m in seen:
                    continue
                seen.add(m)
                tag = _tag(m) if len(subs) > 1 else ""
                brackets = f"[{tag}]" if _is_list(f.annotation) or tag else ""
                queue.append((m, f"{path}{brackets}."))
    return paths


def table_rows() -> dict[str, dict[str, str]]:
    """api -> {path: treatment} from the doc's tables (a `## API` heading, rows `| `path` | treatment | ... |`)."""
    rows: dict[str, dict[str, str]] = {}
    api = None
    with open(DOC) as f:
        for line in f:
            if line.startswith("## "):
                api = line[3:].strip()
                rows.setdefault(api, {})
            m = re.match(r"\|\s*`([^`]+)`\s*\|\s*(\w+)\s*\|", line)
            if m and api is not None:
                assert m.group(1) not in rows[api], f"{api}: two rows for {m.group(1)}"
                rows[api][m.group(1)] = m.group(2)
    return rows


def test_every_request_field_has_one_row():
    rows = table_rows()
    for api, model in APIS.items():
        assert api in rows, f"docs/api-fields.md has no '## {api}' table"
        fields = field_paths(model)
        if api == "Count tokens":  # the Messages table holds the fields the two share
            fields -= field_paths(APIS["Messages"])
        missing = sorted(fields - set(rows[api]))
        assert not missing, f"{api}: fields without a row in docs/api-fields.md: {missing}"
        bad = {p: t for p, t in rows[api].items() if t not in TREATMENTS}
        assert not bad, f"{api}: treatments must be one of {TREATMENTS}: {bad}"
        stale = sorted(p for p, t in rows[api].items() if p not in fields and t != "refused")
        assert not stale, f"{api}: rows for fields no request model has (a field the models leave out is refused): {stale}"


def test_the_paths_read_nesting_lists_and_unions():
    class Part(BaseModel):
        type: typing.Literal["text"]
        text: str

    class Call(BaseModel):
        type: typing.Literal["call"]
        name: str

    class Req(BaseModel):
        model: str
        items: list[typing.Union[Part, Call]]
        one: Part | None = None  # Part again: read once, under items

    assert field_paths(Req) == {"model", "items", "items[type=text].type", "items[type=text].text",
                                "items[type=call].type", "items[type=call].name", "one"}
