"""deltaserve: a serving engine for Gated DeltaNet hybrid language models (Qwen3.5, Qwen3.6, Qwen3-Next)."""
from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "LLMEngine", "EngineConfig", "__version__"]


def __getattr__(name: str):
    # lazy, so `deltaserve plan` and the pure-Python parts start without importing torch
    if name == "LLM":
        from .engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from .engine.sampling_params import SamplingParams
        return SamplingParams
    if name == "LLMEngine":
        from .engine.llm_engine import LLMEngine
        return LLMEngine
    if name == "EngineConfig":
        from .config import EngineConfig
        return EngineConfig
    raise AttributeError(name)
