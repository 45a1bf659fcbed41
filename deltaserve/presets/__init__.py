"""Shipped model geometries: Hugging Face config.json dicts (text configs) that ModelConfig.from_hf reads.

`tiny` is the embedded default model (seeded random weights); the others are the published geometries of
Qwen3.5 / Qwen3.6 / Qwen3-Next models, each citing its source in a "_source" key (left out of the dict
load_preset returns). Pure Python, no torch.
"""
from __future__ import annotations

import copy
import json
import os
from functools import lru_cache
from typing import Any

_DIR = os.path.dirname(os.path.abspath(__file__))

# Other names for a shipped geometry (the same text config, published under another model name).
ALIASES = {
    "qwen3.6-27b": "qwen3.5-27b",
    "qwen3.6-35b-a3b": "qwen3.5-35b-a3b",
    "qwen3-coder-next": "qwen3-next-80b-a3b",
}


def preset_names(include_aliases: bool = False) -> list[str]:
    """The shipped presets (file names without .json), sorted; with aliases when asked."""
    names = sorted(f[:-5] for f in os.listdir(_DIR) if f.endswith(".json"))
    return sorted(names + list(ALIASES)) if include_aliases else names


def _canonical(name: str) -> str:
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in preset_names():
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(preset_names(include_aliases=True))}")
    return key


@lru_cache(maxsize=None)
def _raw(key: str) -> dict[str, Any]:
    with open(os.path.join(_DIR, key + ".json")) as f:
        return json.load(f)


def load_preset(name: str) -> dict[str, Any]:
    """A fresh copy of the preset's config.json dict, without the "_"-prefixed annotation keys."""
    return {k: copy.deepcopy(v) for k, v in _raw(_canonical(name)).items() if not k.startswith("_")}


# A preset's keys that describe its vision tower (model/make.py writes them beside text_config)
MEDIA_KEYS = ("vision_config", "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def text_preset(name: str) -> dict[str, Any]:
    """The preset's text model alone (load_preset without its vision tower's keys): a text config to build
    another model on."""
    return {k: v for k, v in load_preset(name).items() if k not in MEDIA_KEYS}


def preset_source(name: str) -> str:
    """Where the preset's geometry comes from (its "_source" key)."""
    return _raw(_canonical(name)).get("_source", "")


def is_preset(name: str) -> bool:
    try:
        _canonical(name)
    except KeyError:
        return False
    return True
