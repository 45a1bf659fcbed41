"""Request schemas of the OpenAI Responses API (POST /v1/responses), the part deltaserve implements.

As everywhere in the server, unknown fields are refused with a 400 naming them, never silently ignored:
a client that asks for web search, background mode or a service tier learns at once that it is not
served. Input items are told apart by `type` (a message may leave it out, as the API allows).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from ..openai.protocol import FieldError, StrictModel, object_schema

INCLUDABLE = ("reasoning.encrypted_content",)


class InputText(StrictModel):
    type: Literal["input_text"]
    text: str


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


_WHY = {"input_image": " (this server serves text models)", "input_file": " (this server serves text models)",
        "input_audio": " (this server serves text models)"}
_PARTS = ("input_text", "output_text", "refusal")


def _part_kind(v: Any) -> str | None:
    t = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return None if t is None else f"type={t}" if t in _PARTS else "unsupported type"


# tags are not identifiers, so they stay out of the field path a 400 names (input.0.content.1.text)
ContentPart = Annotated[Union[Annotated[InputText, Tag("type=input_text")],
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
        return "".join(p.refusal if isinstance(p, Refusal) else p.text for p in self.content)


class FunctionCallItem(StrictModel):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputText]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


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


_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


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


InputItem = Annotated[Union[Annotated[MessageItem, Tag("type=message")],
                            Annotated[FunctionCallItem, Tag("type=function_call")],
                            Annotated[FunctionCallOutputItem, Tag("type=function_call_output")],
                            Annotated[ReasoningItem, Tag("type=reasoning")],
                            Annotated[UnsupportedItem, Tag("unsupported item")]], Discriminator(_item_kind)]


class FunctionTool(StrictModel):
    """A function tool in the Responses shape (flat: name and parameters beside type)."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.:\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v):
        return object_schema(v)

    def as_chat_tool(self) -> dict:
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        if self.parameters is not None:
            fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


class FunctionChoice(StrictModel):
    type: Literal["function"]
    name: str


class Reasoning(StrictModel):
    """effort none / minimal turns the model's thinking off (the template's enable_thinking false); low, medium,
    high leave it on. summary: the reasoning item carries the reasoning text as its summary too."""

    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


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


class ResponsesRequest(StrictModel):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
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
    # a cache-routing hint; this server has one prefix cache that every request already shares
    prompt_cache_key: str | None = None

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
        tc = self.tool_choice
        if tc is not None and tc not in ("none", "auto") and not self.tools:
            raise FieldError("tool_choice", "tool_choice 'required' or a named function needs tools")
        if isinstance(tc, FunctionChoice) and tc.name not in {t.name for t in self.tools or []}:
            raise FieldError("tool_choice", f"tool_choice names function {tc.name!r}, which is not in tools")
        if self.tools:
            names = [t.name for t in self.tools]
            if len(set(names)) != len(names):
                raise FieldError("tools", "tools have duplicate function names")
        return self
