"""The bundle on disk (format: sim/bundle.py): the model's config.json, the profiler's tables and meta.yaml, whose
meta this module assembles."""
from __future__ import annotations

import json
import os
import platform
import time

import torch

from .. import __version__ as ds_version
from ..config import ConfigError
from ..memory.sizing import ENGINE_KERNEL_ALIGNMENT, engine_block_size, geometry
from ..sim.bundle import FORMAT, save_meta, write_table
from .machine import cpu_model


def write_bundle(out: str, engine, prof, meta_extra: dict) -> None:
    """prof: the Profiler whose tables to write (calibration.csv only once it has rows), or None for none."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(engine.model_path, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    if prof is not None:
        for name, rows in prof.rows.items():
            if name != "calibration.csv" or rows:
                write_table(out, name, rows)
    save_meta(out, meta_extra)


def engine_resolved_per_tp(mc, dtype: str, user_block_size: int, layout: str, tps=(1, 2, 4, 8)) -> dict:
    per = {}
    for tp in tps:
        try:
            g = geometry(mc, kv_dtype=dtype, conv_dtype=dtype, ssm_dtype="float32", tp=tp)
        except ConfigError:
            continue
        per[tp] = {"block_size": engine_block_size(g, user_block_size, layout), "layout": layout,
                   "kernel_alignment": ENGINE_KERNEL_ALIGNMENT, "gdn_state_bytes": g.gdn_state_bytes,
                   "kv_bytes_per_token_per_layer": g.kv_bytes_per_token_per_layer,
                   "profiled": tp == 1}
    return per


def bundle_meta(engine, grid, timer: str, *, quick: bool, max_tokens: int, max_context: int, load0: float | None,
                source: str) -> dict:
    """The bundle's meta as the tables are written: what was profiled, on what, with which engine; calibration
    empty (calibrate.py fills it), checks and the run's end added after."""
    cfg = engine.config
    mc = engine.model_config
    meta = {
        "format": FORMAT,
        "model": {"name": engine.model_name, "source": source, "model_type": mc.model_type,
                  "num_hidden_layers": mc.num_hidden_layers, "vocab_size": mc.vocab_size},
        "layers": {"gdn": len(mc.gdn_layers), "attention": len(mc.attn_layers), "total": mc.num_hidden_layers},
        "hardware": {"device": str(engine.device), "name": (torch.cuda.get_device_name(engine.device)
                                                           if engine.device.type == "cuda" else cpu_model()),
                     "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                     "platform": platform.platform()},
        "dtypes": {"model": engine.dtype, "kv": engine.dtype, "conv": engine.dtype, "ssm": "float32"},
        "versions": {"deltaserve": ds_version, "torch": str(torch.__version__), "python": platform.python_version()},
        "engine_resolved": {"per_tp": engine_resolved_per_tp(mc, engine.dtype, cfg.block_size, cfg.cache_layout)},
        "engine": {"block_size_flag": cfg.block_size, "max_num_seqs": cfg.max_num_seqs,
                   "max_num_batched_tokens": cfg.max_num_batched_tokens, "kv_cache_memory": engine.pool.total_bytes,
                   "cache_layout": cfg.cache_layout, "enable_prefix_caching": cfg.enable_prefix_caching},
        "profile": {"quick": quick, "repeats": grid.repeats, "max_tokens": max_tokens, "max_context": max_context,
                    "statistic": "median", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "load_avg_start": load0, "timer": timer},
        "calibration": {},
    }
    assert meta["engine_resolved"]["per_tp"][1]["block_size"] == engine.block_size, "block size rule drifted"
    return meta
