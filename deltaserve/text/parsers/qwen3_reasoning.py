"""The qwen3 reasoning parser: `<think> ... </think>` in the output becomes `reasoning_content`.

Qwen3.5's chat template opens the think block in the prompt (the generation prompt ends with
"<think>\\n") unless thinking is disabled, in which case it writes an empty "<think>\\n\\n</think>\\n\\n".
So whether the output *starts* inside a think block is a property of the prompt's generation prompt (the
turn the model is about to write, after the last "<|im_start|>assistant\n"): the caller passes
`start_in_reasoning=prompt_opens_thinking(prompt_text)`. A "<think>" earlier in the prompt (a user asking what the
tag means, a tool result, an earlier answer re-sent with one) is text of a finished turn and does not count. An output that itself starts with
"<think>" enters reasoning too. Reasoning that never closes (a short max_tokens) is all reasoning,
and the content is empty. Leading newlines after "</think>" are dropped from the content.
"""
from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"
ASSISTANT_OPEN = "<|im_start|>assistant\n"  # ChatML's opening of an assistant turn: the generation prompt's start
TURN_END = "<|im_end|>"


def generation_prompt(prompt_text: str) -> str:
    """The tail of a rendered chat prompt after its last assistant opening: the turn the model writes (with
    what the template and an Anthropic prefill put in it). "" when the prompt leaves no assistant turn open
    (no opening, or the last assistant turn is closed)."""
    i = prompt_text.rfind(ASSISTANT_OPEN)
    tail = "" if i < 0 else prompt_text[i + len(ASSISTANT_OPEN):]
    return "" if TURN_END in tail else tail


def prompt_opens_thinking(prompt_text: str) -> bool:
    """True when the generation prompt opens a think block it does not close (Qwen3.5's "<think>\n").

    Only the generation prompt counts: the template appends it last, so a "<think>" in any earlier message
    (user text, a tool result, an earlier assistant turn) lies before it and cannot make the new answer's
    content be filed as reasoning."""
    tail = generation_prompt(prompt_text)
    s = tail.rfind(THINK_START)
    return s != -1 and s > tail.rfind(THINK_END)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker (held back while streaming)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class Qwen3ReasoningParser:
    """Streaming splitter of model output into (reasoning, content).

    feed(delta) -> (reasoning_delta, content_delta); finish() flushes what was held back (a partial tag).
    """

    def __init__(self, start_in_reasoning: bool = False):
        self.state = "reasoning" if start_in_reasoning else "start"
        self._buf = ""  # text not yet classified (a possible partial tag)
        self._strip_newlines = False  # drop newlines right after </think>
        self.saw_reasoning = start_in_reasoning

    def feed(self, delta: str) -> tuple[str, str]:
        self._buf += delta
        return self._run(final=False)

    def finish(self) -> tuple[str, str]:
        return self._run(final=True)

    def _run(self, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        while self._buf:
            if self.state == "start":
                stripped = self._buf.lstrip()
                if stripped.startswith(THINK_START):
                    self._buf = stripped[len(THINK_START):]
                    self.state = "reasoning"
                    self.saw_reasoning = True
                    continue
                if not final and THINK_START.startswith(stripped):
                    break  # could still become "<think>"
                self.state = "content"
                continue
            if self.state == "reasoning":
                i = self._buf.find(THINK_END)
                if i >= 0:
                    reasoning.append(self._buf[:i])
                    self._buf = self._buf[i + len(THINK_END):]
                    self.state = "content"
                    self._strip_newlines = True
                    continue
                hold = 0 if final else _partial_suffix(self._buf, THINK_END)
                reasoning.append(self._buf[:len(self._buf) - hold])
                self._buf = self._buf[len(self._buf) - hold:]
                break
            # content
            if self._strip_newlines:
                self._buf = self._buf.lstrip("\r\n")
                if not self._buf:
                    break
                self._strip_newlines = False
            content.append(self._buf)
            self._buf = ""
        return "".join(reasoning), "".join(content)


def extract_reasoning(text: str, start_in_reasoning: bool = False) -> tuple[str | None, str]:
    """Non-streaming: (reasoning or None when the output had no think block, content)."""
    p = Qwen3ReasoningParser(start_in_reasoning)
    r1, c1 = p.feed(text)
    r2, c2 = p.finish()
    return (r1 + r2 if p.saw_reasoning else None), c1 + c2
