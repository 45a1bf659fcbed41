"""Output parsers for Qwen3.5-family chat output: the qwen3 reasoning parser and the qwen3_coder tool-call parser.

Both are written once, as streaming parsers; the non-streaming result is the streaming parser fed the
whole text at once, so a streamed response always assembles to exactly the non-streamed one.
"""
from .qwen3_coder import Qwen3CoderToolParser, ToolCall, convert_param_value, extract_tool_calls
from .qwen3_reasoning import Qwen3ReasoningParser, extract_reasoning, prompt_opens_thinking

__all__ = [
    "Qwen3CoderToolParser",
    "Qwen3ReasoningParser",
    "ToolCall",
    "convert_param_value",
    "extract_reasoning",
    "extract_tool_calls",
    "prompt_opens_thinking",
]
