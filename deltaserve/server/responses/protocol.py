"""Request schemas of the OpenAI Responses API (POST /v1/responses), the part deltaserve implements.

As everywhere in the server, unknown fields are refused with a 400 naming them, never silently ignored:
a client that asks for background mode or a service tier learns at once that it is not served. Input items
are told apart by `type` (a message may leave it out, as the API allows).

Tools (tools.py says how each reaches the prompt): `function`, `custom` and `namespace` tools are served;
OpenAI's built-in tools (BUILTIN_TOOLS: web_search, file_search, ...) are accepted with whatever settings they
carry and left out of the prompt (the response's x-deltaserve-warning header names them), and a tool_choice
that forces one is a 400 naming tool_choice. Hints, accepted and not acted on because they cannot change what
this server writes or because it has no such knob: `client_metadata` (strings, for the client's own
bookkeeping), `prompt_cache_key` (the one prefix cache serves every request anyway), `reasoning.context` (earlier
turns' reasoning is rendered as the model's chat template does), `text.verbosity`, `user`.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from ..openai.protocol import FieldError, StrictModel, check_resume_points, object_schema

INCLUDABLE = ("reasoning.encrypted_content",)


class InputText(StrictModel):
    type: Literal["input_text"]
    text: str


class InputImage(StrictModel):
    """An image as a data: URL (image_url); file ids are refused (no file store), as are remote URLs (no network)."""

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["auto", "low", "high"] | None = None

    @model_validator(mode="after")
    def _source(self) -> "InputImage":
        if self.file_id is not None:
            raise ValueError("input_image file_id is not supported (this server keeps no files): send image_url "
                             "as a data: URL")
        if not self.image_url:
            raise ValueError("input_image needs image_url (a data: URL)")
        return self


class OutputText(StrictModel):
    """An assistant message's text as this server (or OpenAI) returned it, sent back as input."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None

    @field_validator("annotations")
    @classmethod
    def _no_annotations(cls, v):
        if v:
            raise ValueError("output_text annotations are not supported (this server writes none)")
        return v


class Refusal(StrictModel):
    type: Literal["refusal"]
    refusal: str


class Unsupported(StrictModel):
    """What a discriminated union sends an unknown `type` to: a 400 that names the type and what is served."""

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, v):
        t = v.get("type") if isinstance(v, dict) else None
        raise ValueError(f"type {t!r} is not supported{_WHY.get(t, '')}")


_WHY = {"input_file": " (this server takes text and images)", "input_audio": " (this server takes text and images)"}
_PARTS = ("input_text", "input_image", "output_text", "refusal")


def _part_kind(v: Any) -> str | None:
    t = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return None if t is None else f"type={t}" if t in _PARTS else "unsupported type"


# tags are not identifiers, so they stay out of the field path a 400 names (input.0.content.1.text)
ContentPart = Annotated[Union[Annotated[InputText, Tag("type=input_text")],
                              Annotated[InputImage, Tag("type=input_image")],
                              Annotated[OutputText, Tag("type=output_text")], Annotated[Refusal, Tag("type=refusal")],
                              Annotated[Unsupported, Tag("unsupported type")]], Discriminator(_part_kind)]


class MessageItem(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.refusal if isinstance(p, Refusal) else p.text for p in self.content
                       if not isinstance(p, InputImage))

    def parts(self) -> list[tuple[str, str]]:
        """("text", text) / ("image", data URL) in order (chat_spec.image_content)."""
        if isinstance(self.content, str):
            return [("text", self.content)]
        return [("image", p.image_url) if isinstance(p, InputImage) else
                ("text", p.refusal if isinstance(p, Refusal) else p.text) for p in self.content]


class CallFields(StrictModel):
    """What every call item carries; namespace: the namespace tool it belongs to (the name is then the bare name)."""

    call_id: str = Field(min_length=1)
    name: str
    namespace: str | None = None
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallItem(CallFields):
    """A call the model made: its arguments, a JSON string."""

    type: Literal["function_call"]
    arguments: str


class FunctionCallOutputItem(StrictModel):
    """A call's result; name / namespace (the tool that produced it) are informational: call_id links it."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[Annotated[Union[Annotated[InputText, Tag("type=input_text")],
                                       Annotated[InputImage, Tag("type=input_image")],
                                       Annotated[Unsupported, Tag("unsupported type")]], Discriminator(_part_kind)]]
    name: str | None = None
    namespace: str | None = None
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(
            p.text for p in self.output if isinstance(p, InputText))

    def parts(self) -> list[tuple[str, str]]:
        """("text", text) / ("image", data URL) in order (chat_spec.image_content)."""
        if isinstance(self.output, str):
            return [("text", self.output)]
        return [("image", p.image_url) if isinstance(p, InputImage) else ("text", p.text) for p in self.output]


class CustomToolCallItem(CallFields):
    """A call of a custom tool: its free-form input text."""

    type: Literal["custom_tool_call"]
    input: str


class CustomToolCallOutputItem(FunctionCallOutputItem):
    type: Literal["custom_tool_call_output"]  # type: ignore[assignment]


class SummaryText(StrictModel):
    type: Literal["summary_text"]
    text: str


class ReasoningText(StrictModel):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(StrictModel):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


_ITEM_TYPES = ("message", "function_call", "function_call_output", "custom_tool_call", "custom_tool_call_output",
               "reasoning", "additional_tools")


def _item_kind(v: Any) -> str | None:
    if isinstance(v, dict):
        t = v.get("type", "message" if "role" in v else None)
    else:
        t = getattr(v, "type", None)
    return None if t is None else f"type={t}" if t in _ITEM_TYPES else "unsupported item"


class UnsupportedItem(Unsupported):
    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, v):
        t = v.get("type") if isinstance(v, dict) else None
        raise ValueError(f"input item type {t!r} is not supported; this server takes {', '.join(_ITEM_TYPES)}")


TOOL_NAME = r"^[A-Za-z0-9_.:\-]{1,64}$"


class FunctionTool(StrictModel):
    """A function tool in the Responses shape (flat: name and parameters beside type)."""

    type: Literal["function"]
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v):
        return object_schema(v)


class CustomFormatText(StrictModel):
    type: Literal["text"]


class CustomFormatGrammar(StrictModel):
    type: Literal["grammar"]
    syntax: Literal["lark", "regex"]
    definition: str


class CustomTool(StrictModel):
    """A tool whose input is free-form text (format: unconstrained text, or a lark / regex grammar)."""

    type: Literal["custom"]
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    format: Annotated[Union[CustomFormatText, CustomFormatGrammar], Field(discriminator="type")] | None = None


# OpenAI's built-in tool types: hosted tools that OpenAI's servers run (web search, file search, code
# interpreter, image generation, MCP servers, tool search) and tools whose calls are output items of their own
# (computer use, local_shell, shell, apply_patch). None of them can be run or written by this server.
BUILTIN_TOOLS = ("web_search", "web_search_2025_08_26", "web_search_preview", "web_search_preview_2025_03_11",
                 "file_search", "code_interpreter", "image_generation", "mcp", "tool_search",
                 "programmatic_tool_calling", "computer", "computer_use", "computer_use_preview", "local_shell",
                 "shell", "apply_patch")


class BuiltinTool(StrictModel):
    """A built-in tool offered to the model: accepted with whatever settings it carries (they configure a tool
    that is not run) and left out of the prompt."""

    model_config = StrictModel.model_config | {"extra": "allow"}

    type: Literal[BUILTIN_TOOLS]  # type: ignore[valid-type]


class UnsupportedTool(Unsupported):
    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, v):
        t = v.get("type") if isinstance(v, dict) else None
        raise ValueError(f"tool type {t!r} is not supported; this server takes function, custom and namespace "
                         "tools (and leaves built-in tools such as web_search out of the prompt)")


def _kind(v: Any, served: tuple[str, ...], other: str) -> str | None:
    t = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    if t is None:
        return None
    return f"type={t}" if t in served else "type=builtin" if t in BUILTIN_TOOLS and "builtin" in served else other


NamespacedTool = Annotated[Union[Annotated[FunctionTool, Tag("type=function")],
                                 Annotated[CustomTool, Tag("type=custom")],
                                 Annotated[UnsupportedTool, Tag("unsupported tool")]],
                           Discriminator(lambda v: _kind(v, ("function", "custom"), "unsupported tool"))]


class NamespaceTool(StrictModel):
    """Function and custom tools grouped under a namespace (tools.py: how they are shown and called)."""

    type: Literal["namespace"]
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    tools: list[NamespacedTool] = Field(min_length=1)


Tool = Annotated[Union[Annotated[FunctionTool, Tag("type=function")], Annotated[CustomTool, Tag("type=custom")],
                       Annotated[NamespaceTool, Tag("type=namespace")], Annotated[BuiltinTool, Tag("type=builtin")],
                       Annotated[UnsupportedTool, Tag("unsupported tool")]],
                 Discriminator(lambda v: _kind(v, ("function", "custom", "namespace", "builtin"), "unsupported tool"))]


class AdditionalToolsItem(StrictModel):
    """More tools, carried as an input item (Codex CLI's "responses-lite" requests): added to the request's tools."""

    type: Literal["additional_tools"]
    role: Literal["developer"] = "developer"
    tools: list[Tool]
    id: str | None = None


InputItem = Annotated[Union[Annotated[MessageItem, Tag("type=message")],
                            Annotated[FunctionCallItem, Tag("type=function_call")],
                            Annotated[FunctionCallOutputItem, Tag("type=function_call_output")],
                            Annotated[CustomToolCallItem, Tag("type=custom_tool_call")],
                            Annotated[CustomToolCallOutputItem, Tag("type=custom_tool_call_output")],
                            Annotated[ReasoningItem, Tag("type=reasoning")],
                            Annotated[AdditionalToolsItem, Tag("type=additional_tools")],
                            Annotated[UnsupportedItem, Tag("unsupported item")]], Discriminator(_item_kind)]


class FunctionChoice(StrictModel):
    """Forces a function tool: its name, or for a namespaced one <namespace>__<name> (the bare name when only one
    namespace has it)."""

    type: Literal["function"]
    name: str


class CustomChoice(StrictModel):
    type: Literal["custom"]
    name: str


class Reasoning(StrictModel):
    """effort none / minimal turns the model's thinking off (the template's enable_thinking false); low, medium,
    high, xhigh, max leave it on. summary: the reasoning item carries the reasoning text as its summary too.
    context (which turns' reasoning is rendered back): a hint; the chat template decides (Qwen's renders the
    reasoning of the assistant messages after the last user message)."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    context: Literal["auto", "current_turn", "all_turns"] | None = None


class TextFormatText(StrictModel):
    type: Literal["text"]


class TextFormatJsonObject(StrictModel):
    type: Literal["json_object"]


class TextFormatJsonSchema(StrictModel):
    type: Literal["json_schema"]
    name: str = Field(max_length=256)
    json_schema: dict[str, Any] | bool = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None

    model_config = StrictModel.model_config | {"populate_by_name": True}


class TextConfig(StrictModel):
    format: Annotated[Union[TextFormatText, TextFormatJsonObject, TextFormatJsonSchema],
                      Field(discriminator="type")] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint: the model has no verbosity knob


class ResponsesRequest(StrictModel):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | CustomChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    reasoning: Reasoning | None = None
    text: TextConfig | None = None
    include: list[str] | None = None
    truncation: Literal["disabled"] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None  # informational, as in chat
    # groups requests for the learned resume points (server/resume_points.py); the one prefix cache serves all
    prompt_cache_key: str | None = None
    resume_points: list[int] | None = None  # extension: input items whose end is a resume point (docs/api-fields.md)
    client_metadata: dict[str, str] | None = None  # a hint: the client's own bookkeeping (Codex CLI's turn ids)

    @model_validator(mode="before")
    @classmethod
    def _builtin_choice(cls, v):
        tc = v.get("tool_choice") if isinstance(v, dict) else None
        if isinstance(tc, dict) and tc.get("type") in BUILTIN_TOOLS:
            raise FieldError("tool_choice", f"tool_choice forces the built-in tool {tc['type']!r}, which this server "
                             "cannot run; force a function or custom tool, or leave tool_choice 'auto'")
        return v

    @field_validator("input")
    @classmethod
    def _nonempty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("input must not be an empty list")
        return v

    @field_validator("include")
    @classmethod
    def _include(cls, v):
        for x in v or []:
            if x not in INCLUDABLE:
                raise ValueError(f"{x!r} cannot be included; this server can include {', '.join(INCLUDABLE)}")
        return v

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v):
        if v is not None and (len(v) > 16 or any(len(k) > 64 or len(x) > 512 for k, x in v.items())):
            raise ValueError("metadata holds at most 16 pairs, keys up to 64 and values up to 512 characters")
        return v

    @model_validator(mode="after")
    def _checks(self) -> "ResponsesRequest":
        check_resume_points(self.resume_points, len(self.input) if isinstance(self.input, list) else 1, "input")
        tc = self.tool_choice
        more = isinstance(self.input, list) and any(isinstance(it, AdditionalToolsItem) for it in self.input)
        if tc is not None and tc not in ("none", "auto") and not self.tools and not more:
            raise FieldError("tool_choice", "tool_choice 'required' or a named function needs tools")
        # names (a namespaced tool's qualified one) and what tool_choice names are checked in tools.collect_tools
        return self
