"""What the engine refuses before it queues a request: the checks every entry point shares (torch-free).

`check_request` validates a request's values with messages in the API's words (the prompt's token ids, the
sampling values against the vocabulary, the context length). `Scheduler.add` checks its own preconditions
again (unique id, a prompt, a budget within the model length) because the simulator adds requests without
passing through here; behind check_request they never fire.
"""
from __future__ import annotations


class EngineInputError(ValueError):
    """A request the engine refuses (empty or too-long prompt, bad sampling values, bad token ids).

    The message says what to fix; `param` names the request field at fault ("prompt", "max_tokens", a
    sampling field) and `code` the kind of error; the server turns it into an HTTP 400. Other requests are
    unaffected.
    """

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.code = param, code


def check_request(ids: list[int], params, vocab_size: int, max_model_len: int, strict_max_tokens: bool = False,
                  max_output_tokens: int = 0):
    """The one validation of a request (the engine's add_request; the server relies on it): returns the
    params to run with or raises EngineInputError naming the field.

    max_tokens None is what is left of the context; a max_tokens beyond it is clamped to it (the request ends
    with finish_reason "length" if it runs that far), as agent clients expect: they ask for 32,000 or more
    whatever the prompt. strict_max_tokens (--strict-max-tokens) refuses such a request instead. A prompt that
    leaves no room at all is refused either way. max_output_tokens (--max-output-tokens, 0 = none) caps every
    request's budget first, a server's own limit as llama-server's --n-predict."""
    if not ids:
        raise EngineInputError("The prompt is empty; send at least one token.", "prompt", "empty_prompt")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise EngineInputError(f"Prompt token id {bad} is out of range [0, {vocab_size}) (the vocabulary).", "prompt",
                               "invalid_token_id")
    try:
        params.validate_for(vocab_size)
    except ValueError as e:
        first = str(e).split(" ", 1)[0]
        raise EngineInputError(str(e), first if first.isidentifier() else None) from None
    if params.n != 1:
        raise EngineInputError("the engine takes n=1 per request; the server and LLM fan n out into requests", "n")
    n = len(ids)
    if n >= max_model_len:
        raise EngineInputError(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has {n} input "
            f"tokens, which leaves no room for the completion. Please reduce the length of the input.", "prompt",
            "context_length_exceeded")
    if max_output_tokens and (params.max_tokens is None or params.max_tokens > max_output_tokens):
        params = params.clone()
        params.max_tokens = max_output_tokens
    if params.max_tokens is None or (n + params.max_tokens > max_model_len and not strict_max_tokens):
        params = params.clone()
        params.max_tokens = max_model_len - n
    if n + params.max_tokens > max_model_len:
        raise EngineInputError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} in the completion). Please "
            f"reduce the length of the prompt or the completion.", "max_tokens", "context_length_exceeded")
    return params
