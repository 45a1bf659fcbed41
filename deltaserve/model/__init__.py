"""The model: Qwen3.5 / Qwen3.5-MoE / Qwen3-Next hybrids (GDN + gated attention) in plain torch.

    load_model(path, dtype="auto", device="cpu") -> HybridModel     (loader.py)
    HybridModel.forward(batch, caches) -> hidden; .compute_logits(hidden) -> float32 logits
    make_random_model(hf_config, out_dir, seed=0)                     (make.py)

batch.py holds the runner <-> model interface (Span, ForwardBatch, Caches); ops/ the kernels with their
references (tests/model_driver.py drives a model without the runner, for the tests). Attributes load lazily (torch imports).
"""
from __future__ import annotations

_EXPORTS = {"load_model": "loader", "WeightsError": "errors", "HybridModel": "qwen3_5",
            "make_random_model": "make"}


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
