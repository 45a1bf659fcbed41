"""One chat request in the engine's terms, whatever API it came in on.

Chat Completions, Responses and Messages are three shapes of the same request: a conversation in the chat
template's message form, tools (OpenAI function shape), a tool choice, sampling values and a token budget.
Each route converts its request into a ChatSpec at the edge; `start_chat` then does everything once --
renders the prompt with the model's template, compiles the grammar of a forced tool call or a JSON
format, makes one engine request per sample with its reasoning and tool-call parsers -- and submits them.
The route formats the resulting delta stream (core.ServingCore.deltas) in its own shape.
"""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..engine.inputs import EngineInputError
from ..text.parsers import Qwen3CoderToolParser, Qwen3ReasoningParser, prompt_opens_thinking
from ..text.structured import GrammarError, GuideFactory, ThinkingBudgetGuide
from ..text.tokenizer import TokenizerError
from .async_engine import RequestSink
from .core import Job, ServingCore
from .errors import bad_request
from .limits import encode_capped, token_bounds
from .resume_points import parted, resume_points

RESERVED_TEMPLATE_KWARGS = {"messages", "tools", "tokenize", "add_generation_prompt", "chat_template",
                            "conversation", "return_dict", "return_tensors", "padding", "truncation",
                            "max_length", "continue_final_message", "documents", "tokenizer_kwargs"}


@dataclass
class ChatSpec:
    """messages: template messages ({"role": system|user|assistant|tool, "content": str, "tool_calls":
    [{"id", "type": "function", "function": {"name", "arguments"}}], "reasoning_content", "tool_call_id"}).
    tools: [{"type": "function", "function": {"name", "description", "parameters"}}].
    tool_choice: "none" | "auto" | "required" | "function" (then tool_name); None = auto with tools.
    names: the request's own word for an engine field ({"prompt": "input", "max_tokens": "max_output_tokens"}),
    so a 400 names the field the client sent."""

    messages: list[dict]
    tools: list[dict] | None = None
    tool_choice: str | None = None
    tool_name: str | None = None
    parallel_tool_calls: bool = True
    max_tokens: int | None = None
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields (None = default)
    seed: int | None = None
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    response_format: tuple[str, Any] | None = None  # ("json_object", None) | ("json_schema", schema)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    cache_salt: str | None = None
    cache_key: str | None = None  # groups requests for the learned resume points (prompt_cache_key)
    declared_tools: bool = False  # the client marked a tool with cache_control: the system prefix's end is declared
    thinking_budget: int | None = None  # at most this many reasoning tokens, then </think> is forced
    prefill: str = ""  # text the answer starts with (Anthropic's final assistant message); not in the output
    names: dict[str, str] = field(default_factory=dict)
    id_prefix: str = "chatcmpl-"  # the response id is this prefix and a uuid

    @property
    def images(self) -> list[str]:
        """The conversation's images in order of appearance: the {"type": "image", "image": data} parts of the
        messages' contents (image_content), which the chat template renders as <|vision_start|><|image_pad|>
        <|vision_end|>, one placeholder each."""
        return [p["image"] for m in self.messages if isinstance(m.get("content"), list)
                for p in m["content"] if isinstance(p, dict) and p.get("type") == "image"]

    def name(self, engine_field: str) -> str:
        return self.names.get(engine_field, engine_field)

    @property
    def forced(self) -> bool:
        return self.tool_choice in ("required", "function")

    @property
    def template_tools(self) -> list[dict] | None:
        """The tools the model is shown (none with tool_choice "none")."""
        choice = self.tool_choice or ("auto" if self.tools else "none")
        return self.tools if self.tools and choice != "none" else None


def image_content(parts: list[tuple[str, str]], role: str, where: str, sep: str = "\n",
                  marked: tuple[int, ...] = ()) -> str | list[dict]:
    """A message's content from its parts in order, ("text", text) or ("image", data URL / base64). Without
    images: the texts joined by sep (a plain string, as every template takes). With images: the template's
    part list, {"type": "text", "text": ...} and {"type": "image", "image": data} (the Qwen3.5 template renders
    an image part as <|vision_start|><|image_pad|><|vision_end|> and the texts as they are, unseparated).
    Images go in user messages and tool results only (400 elsewhere; `where` names the field). marked: the indexes
    of the parts whose end the client declared a resume point (resume_points.parted; a part list keeps none)."""
    if not any(kind == "image" for kind, _ in parts):
        return parted([text for _, text in parts], sep, marked)
    if role not in ("user", "tool"):
        raise bad_request(f"Images go in user messages and tool results, not in a {role} message.", where,
                          "invalid_value")
    return [{"type": "image", "image": v} if kind == "image" else {"type": "text", "text": v} for kind, v in parts]


@dataclass
class ChatRun:
    """A submitted chat request: its jobs (one per sample) and what the formatters need."""

    rid: str
    jobs: list[Job]
    sink: RequestSink
    prompt_text: str
    prompt_ids: list[int]
    thinking: bool  # the prompt opened a think block


def render_prompt(tok, spec: ChatSpec) -> str:
    """The conversation through the model's chat template (400 on what the template refuses)."""

    kwargs = dict(spec.template_kwargs)
    bad = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
    if bad:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(bad)}", "chat_template_kwargs")
    try:
        text = tok.apply_chat_template(spec.messages, tools=spec.template_tools, add_generation_prompt=True,
                                       **kwargs)
    except TokenizerError as e:
        raise bad_request(str(e), spec.name("prompt"), "invalid_messages") from None
    except TypeError as e:
        raise bad_request(f"chat_template_kwargs: {e}", "chat_template_kwargs") from None
    return text + spec.prefill


def prompt_token_ids(eng, ids: list[int], images: list | None, where: str = "messages") -> list[int]:
    """The prompt's ids as the engine runs them (token counting): each image has its real placeholder tokens
    (its merged grid, e.g. 196 for 448x448), not the one <|image_pad|> the template writes. A 400 for what
    the engine would refuse (no vision encoder, too many images, an unreadable one); `where` names the field."""
    if not images:
        return ids
    try:
        return eng.prompt_token_ids(ids, images)
    except EngineInputError as e:
        raise bad_request(str(e), where) from None


def grammar_for(tok, spec: ChatSpec) -> str | None:
    """The grammar of a forced tool call or a JSON response format (None: unconstrained)."""
    if not spec.forced and spec.response_format is None:
        return None
    param = spec.name("tool_choice") if spec.forced else spec.name("response_format")
    try:
        import llguidance  # noqa: F401
    except ImportError:
        raise bad_request("Constrained decoding (a JSON response format, a forced tool call) needs the llguidance "
                          "package, which is not installed on this server.", param, "unsupported") from None

    try:
        f = GuideFactory.for_tokenizer(tok)
        if spec.forced:
            return f.tool_call_grammar(spec.tools or [], spec.tool_name, spec.parallel_tool_calls)
        kind, schema = spec.response_format
        if kind == "json_object":
            return f.json_object_grammar()
        if schema is None or schema is True:
            return f.json_schema_grammar({})
        if schema is False:
            raise GrammarError("a false schema matches nothing")
        return f.json_schema_grammar(schema)
    except GrammarError as e:
        param = spec.name("tools") if spec.forced else param
        raise bad_request(f"Cannot enforce {param}: {e}", param, "invalid_schema") from None


def guide_for(tok, grammar: str | None, thinking: bool, budget: int | None):
    """A fresh guide for one sample: the grammar (from </think> on when the prompt opened a think block),
    wrapped in the thinking budget when there is one."""

    inner = GuideFactory.for_tokenizer(tok).guide(grammar, thinking) if grammar is not None else None
    if budget is not None and thinking:
        end_id = tok.token_to_id("</think>")
        if end_id is None:
            raise bad_request("This model's tokenizer has no </think> token, so a thinking budget cannot be "
                              "enforced.", None, "unsupported")
        return ThinkingBudgetGuide(inner, end_id, budget)
    return inner


def prompt_ids(eng, tok, spec: ChatSpec) -> tuple[str, list[int], list[int] | None]:
    """The rendered prompt, its token ids and where each ends (characters); a 400 (context_length_exceeded, naming
    the route's prompt field) for a prompt that cannot fit the context, found from its length or by counting
    no further than the context (limits.encode_capped). Slow for a long prompt: call it off the event loop."""
    prompt_text = render_prompt(tok, spec)
    try:
        ids, ends = encode_capped(tok, prompt_text, int(eng.max_model_len), token_bounds(tok))
    except EngineInputError as e:
        raise bad_request(str(e), spec.name("prompt"), e.code) from None
    return prompt_text, ids, ends


def _chat_jobs(core: ServingCore, eng, tok, spec: ChatSpec) -> tuple[str, str, list[int], list[Job], bool]:
    """Render, tokenize, compile, one job per sample (every 400 is raised here): (rid, prompt text, its ids, jobs,
    thinking). The CPU work of a chat request, run in a worker thread by start_chat."""
    prompt_text, ids, ends = prompt_ids(eng, tok, spec)
    thinking = prompt_opens_thinking(prompt_text)
    grammar = grammar_for(tok, spec)
    tools = spec.template_tools
    rid = f"{spec.id_prefix}{uuid.uuid4().hex}"
    images = spec.images
    hints = resume_points(tok, spec, prompt_text, ids, ends)
    jobs: list[Job] = []
    for s in range(spec.n):
        seed = None if spec.seed is None else spec.seed + s
        sp = core.sampling_params(spec.sampling, max_tokens=spec.max_tokens, seed=seed,
                                  guide=guide_for(tok, grammar, thinking, spec.thinking_budget),
                                  logprobs=spec.logprobs, prompt_logprobs=spec.prompt_logprobs,
                                  min_tokens=spec.min_tokens, ignore_eos=spec.ignore_eos, names=spec.names)
        j = Job(s, f"{rid}-{s}", ids, sp, prompt_text, only_first_call=not spec.parallel_tool_calls,
                forced_tool=spec.forced, images=images or None, cache_hints=hints)
        j.reasoning = Qwen3ReasoningParser(thinking)
        j.tools = Qwen3CoderToolParser(tools, forced_name=spec.tool_name if spec.forced else None,
                                       forced=spec.forced) if tools else None
        jobs.append(j)
    return rid, prompt_text, ids, jobs, thinking


async def start_chat(core: ServingCore, spec: ChatSpec) -> ChatRun:
    """Render, compile, make one job per sample and submit them (every 400 is raised before the engine runs). The
    rendering, tokenizing and compiling run in a worker thread: a long prompt never holds up the event loop, so
    other requests' streams go on meanwhile."""
    eng, tok = core.ready()
    rid, prompt_text, ids, jobs, thinking = await asyncio.to_thread(_chat_jobs, core, eng, tok, spec)
    sink = RequestSink(asyncio.get_running_loop())
    names = {"prompt": spec.name("prompt"), "multi_modal_data": spec.name("multi_modal_data"), **spec.names}
    await core.submit(jobs, sink, spec.cache_salt, names=names, cache_key=spec.cache_key)
    return ChatRun(rid, jobs, sink, prompt_text, jobs[0].prompt_ids if jobs else ids, thinking)
