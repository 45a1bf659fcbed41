"""Responses API tools -> the function tools the chat template shows, and a call back to the tool it names.

The model behind this server calls functions only (the qwen3_coder format: a name and named parameters), so
every tool kind the Responses API offers is either turned into a function the model is shown, or left out:

- `function`: as it is.
- `namespace` (`{"type": "namespace", "name": "crm", "description", "tools": [function or custom tools]}`):
  each tool inside is a function of its own whose name is qualified by the namespace, `crm__lookup` (the
  namespace, two underscores, the name -- the flat form Codex CLI itself writes for a namespaced tool, with
  stray underscores around the delimiter trimmed); the namespace's description, when it has one, starts each
  of its tools' descriptions. A call the model writes to `crm__lookup` comes back as OpenAI's API writes a
  call to a namespaced tool: the bare name plus the namespace, `{"type": "function_call", "name": "lookup",
  "namespace": "crm", ...}` (`custom_tool_call` likewise), which is what Codex CLI reads
  (codex-rs: `ResponseItem::FunctionCall { name, namespace, .. }`). A namespaced call sent back as input
  (name + namespace) renders as the qualified name again, so the conversation reads the same to the model.
- `custom` (free-form text input, `format` text or a lark / regex grammar): a function with one required
  string parameter, `input`, which holds the whole text. Its call comes back as a `custom_tool_call` output
  item, `{"type": "custom_tool_call", "call_id", "name", "input"}`, streamed as `response.custom_tool_call_
  input.delta` / `.done`. A grammar is shown to the model in the tool's description; it is NOT enforced (the
  call's value is free text, as for any string parameter), and the response says so in its warning header.
- OpenAI's built-in tools (`web_search`, `file_search`, `code_interpreter`, `computer_use_preview`,
  `image_generation`, `mcp`, `local_shell`, `shell`, `apply_patch`, `tool_search`, ...): hosted tools this
  server cannot run, or tools whose calls are output items of their own that this model does not write. When
  merely offered they are left out of the prompt, and the response carries an `x-deltaserve-warning` header
  naming each one; a `tool_choice` that forces one is a 400 naming `tool_choice` (see protocol.py).

`additional_tools` input items (what Codex CLI's "responses-lite" requests carry their tools in) add their tools
to the request's: every tool is shown in the system prompt, whichever item it came in (the chat template has
one place for tools).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..errors import bad_request
from .protocol import (
    AdditionalToolsItem,
    BuiltinTool,
    CustomChoice,
    CustomTool,
    FunctionChoice,
    FunctionTool,
    NamespaceTool,
)

DELIMITER = "__"
CUSTOM_INPUT = "input"  # the one string parameter a custom tool becomes
WARNING_HEADER = "x-deltaserve-warning"


def qualified(namespace: str | None, name: str) -> str:
    """The flat name the model is shown for a tool (its namespace, if any, joined by two underscores)."""
    if not namespace:
        return name
    return namespace.rstrip("_") + DELIMITER + name.lstrip("_")


@dataclass(frozen=True)
class ToolRef:
    """What a flat function name stands for: kind "function" or "custom", the tool's own name, its namespace."""

    kind: str
    name: str
    namespace: str | None = None


@dataclass
class ToolSet:
    """The request's tools as the template's function tools (chat_tools), what each flat name stands for (refs),
    the flat name a named tool_choice forces (forced), and what the response warns about (warnings)."""

    chat_tools: list[dict] = field(default_factory=list)
    refs: dict[str, ToolRef] = field(default_factory=dict)
    forced: str | None = None
    warnings: list[str] = field(default_factory=list)

    def header(self) -> dict[str, str]:
        """The warning header, when there is something to warn about."""
        return {WARNING_HEADER: "; ".join(self.warnings)} if self.warnings else {}


def _function(name: str, description: str | None, parameters: dict | None) -> dict:
    fn: dict[str, Any] = {"name": name}
    if description is not None:
        fn["description"] = description
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


def _custom_function(t: CustomTool, name: str, prefix: str) -> dict:
    how = (f"Its input is free-form text, not JSON: write the whole text as the string parameter "
           f"`{CUSTOM_INPUT}`.")
    fmt = t.format
    if fmt is not None and fmt.type == "grammar":
        how += f" The text must match this {fmt.syntax} grammar:\n{fmt.definition.strip()}"
    description = "\n\n".join(x for x in (prefix, (t.description or "").strip(), how) if x)
    params = {"type": "object", "properties": {CUSTOM_INPUT: {"type": "string",
                                                              "description": "The tool's whole input text."}},
              "required": [CUSTOM_INPUT]}
    return _function(name, description, params)


def collect_tools(tools: list | None, items: str | list, tool_choice: Any) -> ToolSet:
    """The request's tools and those of its additional_tools input items, flattened; tool_choice resolved against
    them (400 on a name it does not know, or `required` with no tool the model can call)."""
    out = ToolSet()
    sources: list[tuple[str, list]] = [("tools", tools or [])]
    if isinstance(items, list):
        sources += [(f"input[{i}].tools", it.tools) for i, it in enumerate(items)
                    if isinstance(it, AdditionalToolsItem)]
    for where, group in sources:
        for j, t in enumerate(group):
            at = f"{where}[{j}]"
            if isinstance(t, BuiltinTool):
                out.warnings.append(f"{at} ({t.type}) left out of the prompt: a built-in tool this server cannot run")
            elif isinstance(t, NamespaceTool):
                prefix = (t.description or "").strip()
                for k, inner in enumerate(t.tools):
                    _add(out, inner, f"{at}.tools[{k}]", where, t.name, prefix)
            else:
                _add(out, t, at, where, None, "")
    _resolve_choice(out, tool_choice)
    return out


def _add(out: ToolSet, t: FunctionTool | CustomTool, at: str, where: str, namespace: str | None,
         prefix: str) -> None:
    flat = qualified(namespace, t.name)
    if flat in out.refs:
        raise bad_request(f"Two tools are named {flat!r} (a namespaced tool is called <namespace>{DELIMITER}<name>); "
                          "tool names must be unique.", where, "invalid_value")
    if isinstance(t, CustomTool):
        out.chat_tools.append(_custom_function(t, flat, prefix))
        out.refs[flat] = ToolRef("custom", t.name, namespace)
        if t.format is not None and t.format.type == "grammar":
            out.warnings.append(f"{at}.format ({t.format.syntax} grammar of custom tool {flat}) shown to the model, "
                                "not enforced")
    else:
        description = t.description
        if prefix:
            description = "\n\n".join(x for x in (prefix, (t.description or "").strip()) if x)
        out.chat_tools.append(_function(flat, description, t.parameters))
        out.refs[flat] = ToolRef("function", t.name, namespace)


def _resolve_choice(out: ToolSet, tc: Any) -> None:
    if tc is None or tc in ("none", "auto"):
        return
    if tc == "required":
        if not out.chat_tools:
            raise bad_request("tool_choice 'required' needs a function or custom tool (built-in tools such as "
                              "web_search are not run by this server).", "tool_choice", "invalid_value")
        return
    kind = "custom" if isinstance(tc, CustomChoice) else "function"
    assert isinstance(tc, (CustomChoice, FunctionChoice))
    ref = out.refs.get(tc.name)
    if ref is not None and ref.kind == kind:
        out.forced = tc.name
        return
    # a namespaced tool may be named bare when that names one tool only
    bare = [flat for flat, r in out.refs.items() if r.kind == kind and r.name == tc.name]
    if len(bare) == 1:
        out.forced = bare[0]
        return
    raise bad_request(f"tool_choice names {kind} tool {tc.name!r}, which is not in tools"
                      + (" (several namespaces have it: name it <namespace>__<name>)" if bare else ""),
                      "tool_choice", "invalid_value")


def custom_input(arguments: str) -> str:
    """A custom tool's text from the arguments the model wrote for its function form."""
    try:
        args = json.loads(arguments or "{}")
    except ValueError:
        return arguments
    if isinstance(args, dict):
        if isinstance(args.get(CUSTOM_INPUT), str):
            return args[CUSTOM_INPUT]
        if len(args) == 1:
            (v,) = args.values()
            return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
    return arguments
