"""The chat template llama-server gets in `bench agents`: the checkpoint's own, with one change where it needs one.

Qwen3.5's template raises `System message must be at the beginning.` on a system message that is not the first
one, and both Claude Code (its environment text, a system-role message after the first user message) and Codex
CLI (developer messages after its instructions, which llama-server maps to system) send one on every request:
llama-server, rendering with the template as shipped, answers each of them 500, so no turn completes and there
is no time to set beside deltaserve's. deltaserve renders such a message as a user message in its place
(docs/api-fields.md); the copy written here does the same inside the template (a user turn holding the
message's text) and changes nothing else. A template without that raise is used as it is (None).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

# the branch of the template's message loop that refuses a system message after the first
_RAISE = re.compile(r"\{%-?\s*if not loop\.first\s*-?%\}\s*\{\{-?\s*raise_exception\(\s*['\"]System message must be at "
                    r"the beginning\.['\"]\s*\)\s*-?\}\}\s*\{%-?\s*endif\s*-?%\}")
_AS_USER = "{%- if not loop.first %}{{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' }}{%- endif %}"


def model_template(model_dir: str) -> str | None:
    """The checkpoint's chat template: chat_template.jinja, else tokenizer_config.json's chat_template."""
    d = Path(model_dir)
    if (d / "chat_template.jinja").exists():
        return (d / "chat_template.jinja").read_text()
    cfg = d / "tokenizer_config.json"
    if cfg.exists():
        t = json.loads(cfg.read_text()).get("chat_template")
        return t if isinstance(t, str) else None
    return None


def patched(template: str) -> str | None:
    """The template with a later system message rendered as a user turn, or None: it has no such refusal."""
    out, n = _RAISE.subn(_AS_USER, template)
    return out if n == 1 else None


def write_peer_template(model_dir: str, folder: Path) -> Path | None:
    """Write the patched template for llama-server (`--chat-template-file`) into folder; None: the model's own
    template serves as it is."""
    t = model_template(model_dir)
    fixed = patched(t) if t else None
    if fixed is None:
        return None
    path = folder / "llama-server-chat-template.jinja"
    path.write_text(fixed)
    return path
