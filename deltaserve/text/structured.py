"""Constrained decoding: response_format (json_object, json_schema) and forced tool calls, through llguidance.

llguidance (Microsoft's Rust structured-generation engine; the backend vLLM and SGLang ship too)
was picked over xgrammar here: a single abi3 wheel with no GPU-only dependencies, it loads a
byte-level BPE tokenizer.json as is, and computes a token mask in well under a millisecond.

A `GrammarGuide` implements deltaserve.sampler.Guide:
    allowed_tokens(vocab_size) -> torch.BoolTensor [vocab_size] | None   (None = no constraint now)
    accept(token_id)            the token the engine sampled
    is_finished()               the grammar is complete (only end-of-sequence may follow)

Guides are per engine request (stateful); build them with `GuideFactory.for_tokenizer(tok)` and
its json_object / json_schema / tool_calls methods, which raise GrammarError (an HTTP 400) for a
schema or tool definition that cannot be compiled.

Reasoning: when the prompt leaves a <think> block open, the guide stays inactive until the model
has written "</think>" (as vLLM does with a reasoning parser), then constrains what follows.
"""
from __future__ import annotations

import json
import logging
import re
import threading
from typing import Any

import numpy as np
import torch

log = logging.getLogger("deltaserve.text.structured")

THINK_END = "</think>"
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Raw parameter text: anything that does not contain the closing tag.
_FREE_TEXT = r"/(?s:.*)/ & ~/(?s:.*<\/parameter>.*)/"
_NAME_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")


class GrammarError(ValueError):
    """A schema, grammar or tool definition that cannot be enforced; the message says why."""


def _hf_fast_tokenizer(tok: Any):
    """Find the transformers PreTrainedTokenizerFast behind deltaserve's Tokenizer (or take it as is)."""
    from transformers import PreTrainedTokenizerFast  # seconds to import: only when a grammar is first built

    if isinstance(tok, PreTrainedTokenizerFast):
        return tok
    for name in ("hf_tokenizer", "hf", "_hf", "tokenizer", "_tokenizer", "_tok", "tok", "backend"):
        inner = getattr(tok, name, None)
        if isinstance(inner, PreTrainedTokenizerFast):
            return inner
    for name in ("hf_tokenizer", "hf", "_hf", "tokenizer", "_tokenizer", "_tok", "tok", "backend"):
        inner = getattr(tok, name, None)
        if inner is not None and hasattr(inner, "to_str") and hasattr(inner, "encode"):  # tokenizers.Tokenizer
            return PreTrainedTokenizerFast(tokenizer_object=inner)
    raise GrammarError("structured output needs a fast (tokenizer.json) tokenizer")


class GuideFactory:
    """Per-tokenizer compiler of grammars into guides. The llguidance tokenizer is built once (cached)."""

    _cache: dict[int, "GuideFactory"] = {}
    _lock = threading.Lock()

    def __init__(self, tokenizer: Any):
        import llguidance  # optional on a server: chat_spec refuses constrained decoding without it
        import llguidance.hf

        self._llg = llguidance
        hf = _hf_fast_tokenizer(tokenizer)
        eos = list(getattr(tokenizer, "eos_token_ids", None) or [])
        if not eos and hf.eos_token_id is not None:
            eos = [hf.eos_token_id]
        self.ll_tokenizer = llguidance.hf.from_tokenizer(hf, eos_token=eos or None)
        self.vocab_size = self.ll_tokenizer.vocab_size
        # tags that are single (added) tokens: a grammar accepts either the token or the spelled-out text
        vocab = hf.get_vocab()
        self._special = {s for s in ("<tool_call>", "</tool_call>", "</think>") if s in vocab
                         and self.ll_tokenizer.is_special_token(vocab[s])}
        self._think_end_id = vocab.get(THINK_END)

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> "GuideFactory":
        key = id(tokenizer)
        with cls._lock:
            f = cls._cache.get(key)
            if f is None:
                f = cls._cache[key] = GuideFactory(tokenizer)
            return f

    # ---------------------------------------------------------------- grammars

    def _matcher(self, grammar: str):
        m = self._llg.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if m.is_error():
            raise GrammarError(_short_error(m.get_error()))
        return m

    def _check(self, grammar: str) -> str:
        err, msgs = self._llg.LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer)
        if err:
            raise GrammarError(_short_error(msgs[0] if msgs else "invalid grammar"))
        return grammar

    def json_schema_grammar(self, schema: Any) -> str:
        if not isinstance(schema, dict):
            raise GrammarError("a JSON schema must be an object")
        try:
            g = self._llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=_JSON_OPTIONS)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"invalid JSON schema: {e}") from None
        return self._check(g)

    def json_object_grammar(self) -> str:
        return self.json_schema_grammar({"type": "object"})

    def tool_call_grammar(self, tools: list[dict], function_name: str | None = None, parallel: bool = True) -> str:
        """qwen3_coder XML calls: one named function, or (tool_choice "required") one or more of `tools`."""
        fns = [t["function"] for t in tools]
        if function_name is not None:
            fns = [f for f in fns if f["name"] == function_name]
            if not fns:
                raise GrammarError(f"tool_choice names function {function_name!r}, which is not in tools")
        if not fns:
            raise GrammarError("tool_choice requires at least one tool")
        lines: list[str] = []
        call_rules = []
        for i, fn in enumerate(fns):
            call_rules.append(f"call_{i}")
            lines.extend(self._function_rules(i, fn))
        tc, tce = self._tag("<tool_call>"), self._tag("</tool_call>")
        lines.append(f"tool_call: {tc} \"\\n\" ({' | '.join(call_rules)}) {tce}")
        if function_name is not None or not parallel:
            lines.insert(0, "start: tool_call")
        else:
            lines.insert(0, 'start: tool_call ("\\n" tool_call)*')
        return self._check(self._llg.LLMatcher.grammar_from_lark("\n".join(lines)))

    def _tag(self, s: str) -> str:
        lit = json.dumps(s)
        return f"({lit} | {s})" if s in self._special else lit

    def _function_rules(self, i: int, fn: dict) -> list[str]:
        name = fn["name"]
        params = fn.get("parameters") or {}
        props = params.get("properties") or {}
        if not isinstance(props, dict):
            raise GrammarError(f"function {name!r}: parameters.properties must be an object")
        required = params.get("required") or []
        rules = []
        seq = []
        for j, (pname, pschema) in enumerate(props.items()):
            if not _NAME_RE.match(pname):
                raise GrammarError(f"function {name!r}: parameter name {pname!r} cannot be written "
                                   "as a qwen3_coder tag")
            rule = f"p_{i}_{j}"
            value = self._value_rule(name, pname, pschema)
            # regex values are terminals (UPPERCASE: & and ~ work on terminals only); %json and enums are rules
            vname = f"V_{i}_{j}" if value.startswith("/") else f"v_{i}_{j}"
            rules.append(f"{rule}: {json.dumps(f'<parameter={pname}>' + chr(10))} {vname} \"\\n</parameter>\\n\"")
            rules.append(f"{vname}: {value}")
            seq.append(rule if pname in required else f"{rule}?")
        body = " ".join(seq)
        header = json.dumps(f"<function={name}>\n")
        rules.insert(0, f"call_{i}: {header} {body} \"</function>\\n\"")
        return rules

    def _value_rule(self, fname: str, pname: str, schema: Any) -> str:
        """A parameter value's rule. Strings are raw text (no quotes) so their bounds are regexes: enum / const
        (the alternatives), pattern (a full match, as llguidance's JSON schemas take it), minLength / maxLength
        (intersected with the pattern), and never the closing tag; any other type is its JSON schema (%json:
        numeric bounds, enums of numbers, objects, arrays), so a bounded value ends."""
        if schema is True or schema == {} or not isinstance(schema, dict):
            return _FREE_TEXT
        t = schema.get("type")
        types = [t] if isinstance(t, str) else (list(t) if isinstance(t, list) else [])
        choices = [schema["const"]] if "const" in schema else schema.get("enum")
        if isinstance(choices, list) and choices:
            alts = []
            for v in choices:
                text = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
                alts.append(json.dumps(text, ensure_ascii=False))
            return " | ".join(alts)
        if "string" in types or not types and not any(k in schema for k in ("anyOf", "oneOf", "properties", "items")):
            lo = schema.get("minLength")
            hi = schema.get("maxLength")
            pattern = schema.get("pattern")
            parts = []
            if pattern is not None:
                if not isinstance(pattern, str):
                    raise GrammarError(f"{fname}.{pname}: pattern must be a string")
                parts.append("/" + self._llg.regex_to_lark(pattern) + "/")
            if isinstance(lo, int) or isinstance(hi, int):
                lo_s = str(max(int(lo or 0), 0))
                hi_s = str(int(hi)) if isinstance(hi, int) else ""
                if hi_s and int(hi_s) < int(lo_s):
                    raise GrammarError(f"{fname}.{pname}: maxLength {hi_s} is below minLength {lo_s}")
                parts.append(f"/(?s:.{{{lo_s},{hi_s}}})/")
            if not parts:
                return _FREE_TEXT
            return " & ".join(parts + ["~/(?s:.*<\\/parameter>.*)/"])
        sub = dict(schema)
        sub["x-guidance"] = _JSON_OPTIONS
        return "%json " + json.dumps(sub, ensure_ascii=False)

    # ---------------------------------------------------------------- guides

    def guide(self, grammar: str, wait_for_think_end: bool = False) -> "GrammarGuide":
        return GrammarGuide(self, self._matcher(grammar), wait_for_think_end)


def _short_error(msg: str) -> str:
    msg = msg.split("<state>")[0].strip()
    return msg[:500]


class GrammarGuide:
    """deltaserve.sampler.Guide over an llguidance matcher. One per engine request; not shared."""

    def __init__(self, factory: GuideFactory, matcher: Any, wait_for_think_end: bool = False):
        self._f = factory
        self._m = matcher
        self._waiting = wait_for_think_end
        self._tail = b""  # recent bytes while waiting for </think> spelled out in pieces
        self._finished = False

    @property
    def active(self) -> bool:
        return not self._waiting

    def allowed_tokens(self, vocab_size: int) -> torch.Tensor | None:
        if self._waiting:
            return None
        if self._finished or self._m.is_error() or self._m.is_stopped():
            mask = torch.zeros(vocab_size, dtype=torch.bool)
            for e in self._f.ll_tokenizer.eos_tokens:
                if 0 <= e < vocab_size:
                    mask[e] = True
            return mask
        bits = np.unpackbits(np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        n = min(vocab_size, self._f.vocab_size)
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[:n] = torch.from_numpy(bits[:n].astype(np.bool_))
        if not bool(mask.any()):  # never leave the sampler without a choice
            for e in self._f.ll_tokenizer.eos_tokens:
                if 0 <= e < vocab_size:
                    mask[e] = True
        return mask

    def accept(self, token_id: int) -> None:
        token_id = int(token_id)
        if self._waiting:
            if token_id == self._f._think_end_id:
                self._waiting = False
                return
            if 0 <= token_id < self._f.vocab_size:
                self._tail = (self._tail + self._f.ll_tokenizer.decode_bytes([token_id]))[-64:]
                if THINK_END.encode() in self._tail:
                    self._waiting = False
            return
        if self._finished:
            return
        if token_id in self._f.ll_tokenizer.eos_tokens and self._m.is_accepting():
            self._finished = True
            return
        if not self._m.consume_token(token_id):
            log.warning("constrained decoding: token %d rejected (%s)", token_id,
                        _short_error(self._m.get_error())[:200])
            self._finished = True
        elif self._m.is_stopped():
            self._finished = True

    def is_finished(self) -> bool:
        return self._finished or (not self._waiting and self._m.is_stopped())


class ThinkingBudgetGuide:
    """At most `budget` reasoning tokens: once a think block the prompt opened has used them, only </think> may
    follow (Anthropic's thinking.budget_tokens, enforced rather than hinted). After </think> the inner guide (a
    forced tool call's or a JSON format's grammar, itself waiting for </think>) constrains the answer, or nothing."""

    def __init__(self, inner: Any, think_end_id: int, budget: int):
        self._inner = inner
        self._end = int(think_end_id)
        self._budget = int(budget)
        self._used = 0
        self._thinking = True

    def allowed_tokens(self, vocab_size: int) -> torch.Tensor | None:
        if self._thinking and self._used >= self._budget:
            mask = torch.zeros(vocab_size, dtype=torch.bool)
            mask[self._end] = True
            return mask
        return self._inner.allowed_tokens(vocab_size) if self._inner is not None else None

    def accept(self, token_id: int) -> None:
        if self._thinking:
            if int(token_id) == self._end:
                self._thinking = False
            else:
                self._used += 1
        if self._inner is not None:
            self._inner.accept(token_id)

    def is_finished(self) -> bool:
        return self._inner is not None and self._inner.is_finished()
