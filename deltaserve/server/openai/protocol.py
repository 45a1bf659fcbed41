"""Request models of the OpenAI-compatible API (vLLM's field names and extensions).

Every model forbids unknown fields: a field deltaserve does not implement is refused with a 400
that names it, never silently ignored. Types are strict (no "0.5" for a number, no 1 for true).
Ranges that SamplingParams checks are left to it, so one message wording holds everywhere.
"""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_N = 64


class FieldError(ValueError):
    """A check across fields that blames one of them: the 400 names `field` (a dotted path), not the request."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(StrictModel):
    include_usage: bool | None = False
    # vLLM's: with include_usage, every chunk carries the usage so far (load generators such as guidellm ask for it)
    continuous_usage_stats: bool | None = False


class JsonSchemaSpec(StrictModel):
    name: str = Field(default="response", max_length=256)
    description: str | None = None
    # "schema" shadows a BaseModel attribute in pydantic; keep the wire name
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _need_schema(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"response_format of type {self.type} takes no json_schema")
        return self


def only(value, field: str, allowed, why: str):
    """A field accepted only at the value this server always behaves as (a router adds such fields to every
    body it forwards); any other value is refused, naming the field, rather than ignored."""
    if value != allowed:
        raise FieldError(field, f"{field}: {value!r} is not supported: {why} (send {allowed!r} or leave it out)")
    return value


class _SamplingFields(StrictModel):
    """Fields shared by /v1/completions and /v1/chat/completions.

    skip_special_tokens, include_stop_str_in_output are vLLM's; no_stop_trim (SGLang's, which vllm-router adds to
    every body it forwards) means the same as include_stop_str_in_output: a matched stop string stays in the text.
    """

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    cache_salt: str | None = Field(default=None, min_length=1, max_length=4096)
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None  # informational (OpenAI's end-user id); logged nowhere, changes nothing
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    no_stop_trim: bool = False
    return_hidden_states: bool = False

    @field_validator("seed")
    @classmethod
    def _seed_range(cls, v: int | None) -> int | None:
        if v is not None and not -(2**63) <= v < 2**64:
            raise ValueError("seed must fit in 64 bits")
        return v

    @model_validator(mode="after")
    def _stream_opts(self):
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options is only allowed when stream is true")
        only(self.return_hidden_states, "return_hidden_states", False, "this server returns no hidden states")
        return self

    @property
    def keeps_stop_str(self) -> bool:
        return self.include_stop_str_in_output or self.no_stop_trim


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _nonempty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list")
        return v


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ImageURL(StrictModel):
    url: str  # a data: URL (base64); remote URLs are refused (the server fetches nothing)
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(StrictModel):
    type: Literal["image_url"]
    image_url: ImageURL


class FunctionCall(StrictModel):
    name: str
    arguments: str | dict[str, Any]


class ToolCallIn(StrictModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, v):
        if isinstance(v, list):
            for i, p in enumerate(v):
                if isinstance(p, dict) and p.get("type") not in (None, "text", "image_url"):
                    raise ValueError(f"content part {i}: type {p.get('type')!r} is not supported "
                                     "(only 'text' and 'image_url' parts)")
        return v

    @model_validator(mode="after")
    def _roles(self) -> "ChatMessage":
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.reasoning_content is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry reasoning_content")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("only tool messages carry tool_call_id")
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "assistant" and self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        return self

    def text(self) -> str | None:
        if isinstance(self.content, list):
            return "\n".join(p.text for p in self.content if isinstance(p, TextPart))
        return self.content

    def parts(self) -> list[tuple[str, str]] | None:
        """("text", text) / ("image", url) in order (chat_spec.image_content); None without content."""
        if isinstance(self.content, list):
            return [("text", p.text) if isinstance(p, TextPart) else ("image", p.image_url.url) for p in self.content]
        return None if self.content is None else [("text", self.content)]


def check_resume_points(points: list[int] | None, n: int, what: str) -> None:
    """The `resume_points` extension field (every chat API): indexes into the request's `what` list (n items), each
    naming an item whose end the client declares a resume point (server/resume_points.py)."""
    if points is not None and not all(0 <= k < n for k in points):
        raise FieldError("resume_points", f"resume_points are indexes into {what} (0 to {n - 1})")


def object_schema(v: dict | None, what: str = "function parameters") -> dict | None:
    """A tool's parameter schema must be an object schema whose properties map names to schemas (every API's tools
    become qwen3_coder parameters, one tag per property)."""
    if v is None:
        return v
    if v.get("type", "object") != "object":
        raise ValueError(f"{what} must be a JSON schema of type object")
    props = v.get("properties", {})
    if not isinstance(props, dict) or not all(isinstance(p, (dict, bool)) for p in props.values()):
        raise ValueError(f"{what}.properties must map names to schemas")
    req = v.get("required", [])
    if not isinstance(req, list) or not all(isinstance(r, str) for r in req):
        raise ValueError(f"{what}.required must be a list of names")
    return v


class FunctionDef(StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.:\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v):
        return object_schema(v)


class ToolDef(StrictModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's reasoning switch: none / minimal turn the template's thinking off, the others leave it on
    # (chat_template_kwargs' enable_thinking, when given, wins)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    # hints clients send with every request: the prefix cache serves every request, and prompt_cache_key groups
    # requests for the learned resume points (server/resume_points.py); nothing is stored (store), metadata and
    # the safety id are the client's
    metadata: dict[str, str] | None = None
    store: bool | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    resume_points: list[int] | None = None  # extension: messages whose end is a resume point (docs/api-fields.md)
    # SGLang's / vLLM's, added by vllm-router to what it forwards: accepted at this server's behaviour only
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    include_reasoning: bool = True
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _checks(self) -> "ChatCompletionRequest":
        check_resume_points(self.resume_points, len(self.messages), "messages")
        only(self.separate_reasoning, "separate_reasoning", True,
             "reasoning always comes apart from the answer, in reasoning_content")
        only(self.stream_reasoning, "stream_reasoning", True, "reasoning is streamed as it is generated")
        only(self.include_reasoning, "include_reasoning", True, "reasoning_content is always returned")
        only(self.continue_final_message, "continue_final_message", False,
             "the prompt always ends with the template's generation prompt")
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs: true")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise FieldError("max_tokens", "give max_tokens or max_completion_tokens, not two different values")
        tc = self.tool_choice
        if tc is not None and tc not in ("none", "auto") and not self.tools:
            raise FieldError("tool_choice", "tool_choice 'required' or a named function needs tools")
        if isinstance(tc, NamedToolChoice) and tc.function.name not in {t.function.name for t in self.tools or []}:
            raise FieldError("tool_choice", f"tool_choice names function {tc.function.name!r}, which is not in tools")
        if self.tools:
            names = [t.function.name for t in self.tools]
            if len(set(names)) != len(names):
                raise FieldError("tools", "tools have duplicate function names")
        forced = tc == "required" or isinstance(tc, NamedToolChoice)
        if forced and self.response_format is not None and self.response_format.type != "text":
            raise FieldError("response_format", "response_format cannot be combined with a forced tool_choice")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(StrictModel):
    """vLLM's /tokenize: {model, prompt} (the prompt as given) or {model, messages, ...} (the conversation
    through the chat template, with its generation prompt: the ids a chat request with these messages sends to
    the engine)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    tools: list[ToolDef] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise FieldError("prompt", "give prompt (text) or messages (a conversation), not both or neither")
        if self.messages is None and (self.tools is not None or self.chat_template_kwargs is not None):
            raise FieldError("tools" if self.tools is not None else "chat_template_kwargs",
                             "tools and chat_template_kwargs go with messages")
        only(self.add_generation_prompt, "add_generation_prompt", True,
             "a chat prompt always ends with the template's generation prompt")
        only(self.continue_final_message, "continue_final_message", False,
             "a chat prompt always ends with the template's generation prompt")
        return self


class DetokenizeRequest(StrictModel):
    """vLLM's /detokenize: {model, tokens} -> {prompt}."""

    model: str | None = None
    tokens: list[int]
