"""The embedded default model: seeded random weights of a preset, written once in Hugging Face format.

Built locally and deterministically (no network), cached under $DELTASERVE_HOME (default
~/.cache/deltaserve) keyed by the preset's content, so every machine gets the same bytes.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile

log = logging.getLogger("deltaserve")

DEFAULT_PRESET = "tiny"


def home() -> str:
    return os.environ.get("DELTASERVE_HOME", os.path.join(os.path.expanduser("~"), ".cache", "deltaserve"))


def make_model(preset: str, out_dir: str, seed: int = 0) -> str:
    """Write preset `preset` (random weights + the embedded tokenizer) to out_dir."""
    from .model.make import make_random_model
    from .presets import load_preset
    from .tokenizer import write_tokenizer

    cfg = {k: v for k, v in load_preset(preset).items() if not k.startswith("_")}
    os.makedirs(out_dir, exist_ok=True)
    make_random_model(cfg, out_dir, seed=seed)
    write_tokenizer(out_dir)
    return out_dir


def ensure_model(preset: str = DEFAULT_PRESET, seed: int = 0) -> str:
    """The directory of the embedded model for `preset`, made on first use (atomically)."""
    from .presets import load_preset

    key = hashlib.sha256(json.dumps([load_preset(preset), seed, _assets_digest()], sort_keys=True).encode()).hexdigest()[:12]
    path = os.path.join(home(), "models", f"{preset}-{key}")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    log.info("making the embedded %s model (seeded random weights) in %s", preset, path)
    tmp = tempfile.mkdtemp(prefix=f".{preset}-", dir=os.path.dirname(path))
    try:
        make_model(preset, tmp, seed=seed)
        try:
            os.rename(tmp, path)
        except OSError:  # another process made it first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _assets_digest() -> str:
    """Changes when the shipped tokenizer changes, so a stale cached model is never reused."""
    root = os.path.join(os.path.dirname(__file__), "assets", "tokenizer")
    h = hashlib.sha256()
    if os.path.isdir(root):
        for name in sorted(os.listdir(root)):
            with open(os.path.join(root, name), "rb") as f:
                h.update(name.encode() + f.read())
    return h.hexdigest()[:12]
