"""Request schemas of the Anthropic Messages API (POST /v1/messages, /v1/messages/count_tokens).

Unknown fields and block types are refused with a 400 naming them (in Anthropic's error shape, see
errors.py), never ignored: image url and file sources (base64 images are served), documents, server tools (web
search, code execution, ...), citations
and a service tier are not served, and a client learns so at once. `cache_control` is accepted on every
block, and honoured: the end of each marked block (and, with a top-level `cache_control`, the end of the last
message) becomes a declared resume point, where a GDN checkpoint is kept for a later request (server/
resume_points.py); every prompt's attention blocks are cached anyway, marked or not (the ttl is not promised:
pages live until they are evicted). `resume_points` (an extension, as on the other two APIs: docs/api-fields.md)
lists message indexes whose end is a declared resume point.

Accepted as hints, because what they ask for is what happens anyway or only concerns the client's display:
`tools[].defer_loading` (every tool is in the prompt: the template lists them all), `thinking.display`
(summarized, omitted, highlights, updates: the thinking is returned as written, see input.py),
`context_management.edits` of type `clear_thinking_20251015` (the chat template shows the model the thinking
of the current turn only, whatever `keep` says; nothing is kept beyond what the client sends), and
`metadata.user_id` (informational). Honoured: `output_config.effort` (low, medium, high, xhigh, max; also on a
mid-conversation system message, from that message on) and a `system` message inside `messages` (input.py
says how both are rendered). Refused: `clear_tool_uses_20250919` (it would drop tool results this server
never drops), and every field not named here.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from ..openai.protocol import FieldError, StrictModel, check_resume_points, object_schema


class CacheControl(StrictModel):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(StrictModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None

    @field_validator("citations")
    @classmethod
    def _no_citations(cls, v):
        if v:
            raise ValueError("citations are not supported")
        return v


class ToolUseBlock(StrictModel):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ImageSource(StrictModel):
    """base64 data only: a url source is refused (this server fetches nothing), as is a file id (no file store)."""

    type: Literal["base64", "url", "file"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"] | None = None
    data: str | None = None
    url: str | None = None
    file_id: str | None = None

    @model_validator(mode="after")
    def _base64_only(self) -> "ImageSource":
        if self.type == "url":
            raise ValueError("image source type 'url' is not supported (this server has no network access): send "
                             "the image as a base64 source")
        if self.type == "file":
            raise ValueError("image source type 'file' is not supported (this server keeps no files): send the "
                             "image as a base64 source")
        if self.media_type is None or self.data is None:
            raise ValueError("a base64 image source needs media_type and data")
        return self

    def data_url(self) -> str:
        return f"data:{self.media_type};base64,{self.data}"


class ImageBlock(StrictModel):
    type: Literal["image"]
    source: ImageSource
    cache_control: CacheControl | None = None


class ToolResultBlock(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[Annotated[Union[Annotated[TextBlock, Tag("type=text")], Annotated[ImageBlock, Tag("type=image")]],
                                  Discriminator(lambda v: f"type={v.get('type') if isinstance(v, dict) else v.type}")]] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(
            b.text for b in self.content if isinstance(b, TextBlock))

    def parts(self) -> list[tuple[str, str]]:
        """("text", text) / ("image", data URL) in order (chat_spec.image_content); an error's text is marked."""
        blocks = [] if self.content is None else [TextBlock(type="text", text=self.content)] \
            if isinstance(self.content, str) else self.content
        out = [("image", b.source.data_url()) if isinstance(b, ImageBlock) else ("text", b.text) for b in blocks]
        if self.is_error:
            out.insert(0, ("text", "Error: "))
        return out


class ThinkingBlock(StrictModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None
    cache_control: CacheControl | None = None


_BLOCK_TYPES = ("text", "image", "tool_use", "tool_result", "thinking")


def _block_kind(v: Any) -> str | None:
    t = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return None if t is None else f"type={t}" if t in _BLOCK_TYPES else "unsupported block"


class UnsupportedBlock(StrictModel):
    """An unknown block type: a 400 that names it and what is served."""

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, v):
        t = v.get("type") if isinstance(v, dict) else None
        why = " (this server takes text and images)" if t in ("document", "search_result") else ""
        raise ValueError(f"content block type {t!r} is not supported{why}; this server takes "
                         f"{', '.join(_BLOCK_TYPES)}")


# tags are not identifiers, so they stay out of the field path a 400 names (messages.0.content.1.tool_use_id)
Block = Annotated[Union[Annotated[TextBlock, Tag("type=text")], Annotated[ImageBlock, Tag("type=image")],
                        Annotated[ToolUseBlock, Tag("type=tool_use")],
                        Annotated[ToolResultBlock, Tag("type=tool_result")],
                        Annotated[ThinkingBlock, Tag("type=thinking")],
                        Annotated[UnsupportedBlock, Tag("unsupported block")]], Discriminator(_block_kind)]


Effort = Literal["low", "medium", "high", "xhigh", "max"]


class TurnOutputConfig(StrictModel):
    """A mid-conversation system message's output_config: the effort from that message on."""

    effort: Effort | None = None


class Message(StrictModel):
    """A user or assistant message, or a system message inside the conversation (Claude Code sends its
    environment text so, carrying the turn's effort in output_config)."""

    role: Literal["user", "assistant", "system"]
    content: str | list[Block]
    output_config: TurnOutputConfig | None = None

    @model_validator(mode="after")
    def _blocks_by_role(self) -> "Message":
        if self.output_config is not None and self.role != "system":
            raise FieldError("output_config", "output_config on a message is taken on a system message only")
        if isinstance(self.content, list):
            for b in self.content:
                if self.role == "assistant" and isinstance(b, ImageBlock):
                    raise ValueError("an assistant message cannot carry an image block")
                if self.role == "user" and isinstance(b, (ToolUseBlock, ThinkingBlock)):
                    raise ValueError(f"a user message cannot carry a {b.type} block")
                if self.role == "assistant" and isinstance(b, ToolResultBlock):
                    raise ValueError("an assistant message cannot carry a tool_result block")
                if self.role == "system" and not isinstance(b, TextBlock):
                    raise ValueError(f"a system message holds text blocks only, not a {b.type} block")
        return self


class Tool(StrictModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    defer_loading: bool | None = None  # a hint: every tool is in the prompt anyway (the template lists them all)

    @model_validator(mode="before")
    @classmethod
    def _server_tools(cls, v):
        if isinstance(v, dict) and v.get("type") not in (None, "custom"):
            raise ValueError(f"tool type {v.get('type')!r} (a server tool) is not supported; this server runs "
                             "client tools (name, description, input_schema)")
        return v

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, v):
        return object_schema(v, "input_schema")

    def as_chat_tool(self) -> dict:
        fn: dict[str, Any] = {"name": self.name}  # chat's key order: the template writes the tool as JSON
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.input_schema
        return {"type": "function", "function": fn}


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name(self) -> "ToolChoice":
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("tool_choice of type tool needs a name (and only that type takes one)")
        return self


# how the client wants thinking shown: a display preference, the thinking is returned as written (input.py)
ThinkingDisplay = Literal["summarized", "omitted", "highlights", "updates"]


class ThinkingEnabled(StrictModel):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1024)
    display: ThinkingDisplay | None = None


class ThinkingDisabled(StrictModel):
    type: Literal["disabled"]


class ThinkingAdaptive(StrictModel):
    """Thinking as the model wants it: output_config.effort decides (input.py), on without a budget when absent."""

    type: Literal["adaptive"]
    display: ThinkingDisplay | None = None


class JsonOutputFormat(StrictModel):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")

    model_config = StrictModel.model_config | {"populate_by_name": True}


class OutputConfig(StrictModel):
    """format: structured output, the text is JSON of the schema (enforced by the grammar, as response_format in
    chat). effort: the thinking switch and budget (input.py)."""

    format: JsonOutputFormat | None = None
    effort: Effort | None = None


class KeepThinkingTurns(StrictModel):
    type: Literal["thinking_turns"]
    value: int = Field(ge=1)


class ClearThinkingEdit(StrictModel):
    """A hint: the chat template shows the model the thinking of the current turn only (the assistant messages
    after the last user message), whatever `keep` says."""

    type: Literal["clear_thinking_20251015"]
    keep: Literal["all"] | KeepThinkingTurns | None = None

    @model_validator(mode="before")
    @classmethod
    def _other_edits(cls, v):
        if isinstance(v, dict) and v.get("type") != "clear_thinking_20251015":
            raise ValueError(f"context edit type {v.get('type')!r} is not supported (it would change the prompt "
                             "in a way this server does not do); this server takes clear_thinking_20251015")
        return v


class ContextManagement(StrictModel):
    edits: list[ClearThinkingEdit] | None = None


class Metadata(StrictModel):
    user_id: str | None = Field(default=None, max_length=256)  # informational, as OpenAI's `user`


# adaptive thinking's budget per effort (low turns thinking off; high and above: no budget but max_tokens)
EFFORT_BUDGET: dict[str | None, int] = {"medium": 8192}


class _Conversation(StrictModel):
    """What count_tokens and messages share: the model, the conversation and the tools."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Annotated[Union[ThinkingEnabled, ThinkingDisabled, ThinkingAdaptive],
                        Field(discriminator="type")] | None = None
    output_config: OutputConfig | None = None
    context_management: ContextManagement | None = None  # a hint (see the module doc)
    cache_control: CacheControl | None = None  # the whole request: its last message's end is a resume point
    resume_points: list[int] | None = None  # extension: messages whose end is a resume point (docs/api-fields.md)

    @model_validator(mode="after")
    def _tools(self):
        check_resume_points(self.resume_points, len(self.messages), "messages")
        tc = self.tool_choice
        if tc is not None and tc.type in ("any", "tool") and not self.tools:
            raise FieldError("tool_choice", f"tool_choice of type {tc.type} needs tools")
        if tc is not None and tc.type == "tool" and tc.name not in {t.name for t in self.tools or []}:
            raise FieldError("tool_choice", f"tool_choice names tool {tc.name!r}, which is not in tools")
        if self.tools:
            names = [t.name for t in self.tools]
            if len(set(names)) != len(names):
                raise FieldError("tools", "tools have duplicate names")
        return self

    @property
    def effort(self) -> str | None:
        """The effort of this answer: that of the last system message in `messages` that sets one (an effort holds
        from its message on), else output_config.effort."""
        for m in reversed(self.messages):
            if m.output_config is not None and m.output_config.effort is not None:
                return m.output_config.effort
        return self.output_config.effort if self.output_config is not None else None

    @property
    def thinking_on(self) -> bool:
        """enabled: on; disabled or absent: off (Anthropic's default); adaptive: on unless the effort is low."""
        if isinstance(self.thinking, ThinkingAdaptive):
            return self.effort != "low"
        return isinstance(self.thinking, ThinkingEnabled)

    @property
    def thinking_budget(self) -> int | None:
        """The most thinking tokens: enabled's budget_tokens, or the effort's under adaptive (EFFORT_BUDGET)."""
        if isinstance(self.thinking, ThinkingEnabled):
            return self.thinking.budget_tokens
        return EFFORT_BUDGET.get(self.effort) if self.thinking_on else None


class CountTokensRequest(_Conversation):
    pass


# Anthropic's ranges of the sampling fields; a value outside is a 400, as Anthropic's API answers it (the OpenAI
# routes take vLLM's wider ones, e.g. a temperature above 1: docs/api-fields.md)
SAMPLING_RANGES = {"temperature": (0.0, 1.0), "top_p": (0.0, 1.0), "top_k": (0, None)}


class MessagesRequest(_Conversation):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None

    @field_validator("temperature", "top_p", "top_k")
    @classmethod
    def _anthropic_range(cls, v, info):
        lo, hi = SAMPLING_RANGES[info.field_name]
        if v is not None and not (lo <= v and (hi is None or v <= hi)):  # a NaN is in no range
            where = f"in [{lo:g}, {hi:g}]" if hi is not None else f">= {lo:g}"
            raise ValueError(f"{info.field_name} must be {where} (Anthropic's range), got {v!r}")
        return v

    @model_validator(mode="after")
    def _budget(self) -> "MessagesRequest":
        fmt = self.output_config.format if self.output_config is not None else None
        if fmt is not None and self.tool_choice is not None and self.tool_choice.type in ("any", "tool"):
            raise FieldError("output_config.format", "output_config.format cannot be combined with a forced "
                             "tool_choice")
        if isinstance(self.thinking, ThinkingEnabled) and self.thinking.budget_tokens >= self.max_tokens:
            raise FieldError("thinking.budget_tokens", "thinking.budget_tokens must be less than max_tokens")
        return self
