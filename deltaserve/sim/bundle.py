"""A profile bundle on disk: meta.yaml, config.json and the CSV tables. Written by deltaserve.profile, read by
the simulator's latency model. No torch.

Layout of a bundle directory:

  meta.yaml              model, hardware, dtypes, versions, engine_resolved.per_tp[tp].block_size, layer
                         counts, how the profile was taken, and the calibrated step overhead
  config.json            the model's config.json (so the simulator builds the same geometry)
  dense.csv              kernel, tokens, time_us, p10_us, p90_us, layers         (always-on, by token count)
  attention.csv          kernel, query_tokens, context_len, time_us, p10_us, p90_us, layers
  linear_attention.csv   kernel, regime, prefill_tokens, n_decode, time_us, p10_us, p90_us, layers
  copies.csv             op, count, time_us, p10_us, p90_us                      (whole model, all layers)
  overhead.csv           component, n_seqs, tokens, time_us, p10_us, p90_us      (per step)
  vision_encoder.csv     patches, tokens, time_us, p10_us, p90_us                (one image through the whole
                         vision encoder, by its patch count; tokens = what it makes; a model with a vision tower)
  calibration.csv        one row per calibration step: its shape, the measured wall and CPU time, the prediction

time_us is the median of the repeats. Per-layer kernels are timed inside real forwards of the model (every
layer in stack order, as a step runs them) and divided by `layers`, the number of layers of that kind on one
rank; the simulator multiplies back. With meta.profile.timer "cpu" (a CPU run on one thread) times are the
thread's CPU time, independent of how busy the machine is; meta.calibration.wall_per_cpu turns them into wall
time (the machine's contention while profiling; the simulator can be given another).
"""
from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass, field

import yaml

FORMAT = "deltaserve-profile/1"

TABLES = {
    "dense.csv": ("kernel", "tokens", "time_us", "p10_us", "p90_us", "layers"),
    "attention.csv": ("kernel", "query_tokens", "context_len", "time_us", "p10_us", "p90_us", "layers"),
    "linear_attention.csv": ("kernel", "regime", "prefill_tokens", "n_decode", "time_us", "p10_us", "p90_us", "layers"),
    "copies.csv": ("op", "count", "time_us", "p10_us", "p90_us"),
    "overhead.csv": ("component", "n_seqs", "tokens", "time_us", "p10_us", "p90_us"),
    "vision_encoder.csv": ("patches", "tokens", "time_us", "p10_us", "p90_us"),
    "calibration.csv": ("step", "n_seqs", "n_prefill", "prefill_tokens", "n_decode", "context_tokens", "n_sample",
                        "copies", "measured_us", "cpu_us", "predicted_us"),
}

# The always-on kernels (dense) and the regime-dependent GDN kernels (linear_attention), as serving simulators for hybrids split them.
DENSE_KERNELS = {
    # name: what it scales with ("tokens": every token of the step; "rows": the sampled rows)
    "embed": "tokens", "layer_norms": "tokens", "residual": "tokens",
    "gdn_in_proj": "tokens", "gdn_glue": "tokens", "gdn_norm": "tokens", "gdn_out_proj": "tokens",
    "attn_qkv_proj": "tokens", "attn_qk_norm_rope": "tokens", "attn_kv_write": "tokens", "attn_gate": "tokens",
    "attn_o_proj": "tokens", "mlp": "tokens", "final_norm": "tokens",
    "lm_head": "rows", "sampler": "rows",
}
OPTIONAL_DENSE = {"other"}  # time the profiler could not attribute to a named kernel (charged per token)
GDN_KERNELS = {  # name: regime in which it fires
    "gdn_conv_prefill": "prefill", "gdn_post_conv": "prefill", "gdn_prefill": "prefill",
    "gdn_conv_decode": "decode", "gdn_decode": "decode", "gdn_decode_glue": "decode",
}
REGIMES = ("prefill", "decode", "mixed")
ATTENTION_KERNELS = ("attn_prefill", "attn_decode")
COPY_OPS = ("zero_pages", "zero_slots", "restore", "save")


@dataclass
class Bundle:
    path: str
    meta: dict
    config: dict
    tables: dict[str, list[dict]] = field(default_factory=dict)

    def rows(self, table: str) -> list[dict]:
        return self.tables.get(table, [])

    @property
    def calibration(self) -> dict:
        return self.meta.get("calibration") or {}

    def block_size(self, tp: int = 1) -> int | None:
        per_tp = (self.meta.get("engine_resolved") or {}).get("per_tp") or {}
        e = per_tp.get(tp, per_tp.get(str(tp)))
        return None if e is None else int(e["block_size"])


def _num(v: str):
    try:
        f = float(v)
    except (TypeError, ValueError):
        return v
    return int(f) if f.is_integer() and "." not in str(v) and "e" not in str(v).lower() else f


def read_table(path: str) -> list[dict]:
    with open(path, newline="") as f:
        return [{k: _num(v) for k, v in row.items()} for row in csv.DictReader(f)]


def write_table(path: str, name: str, rows: list[dict]) -> None:
    cols = TABLES[name]
    with open(os.path.join(path, name), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()})


def load_bundle(path: str) -> Bundle:
    meta_path = os.path.join(path, "meta.yaml")
    if not os.path.exists(meta_path):
        raise FileNotFoundError(f"{path} is not a profile bundle (no meta.yaml); make one with `deltaserve profile`")
    with open(meta_path) as f:
        meta = yaml.safe_load(f) or {}
    if meta.get("format") != FORMAT:
        raise ValueError(f"{meta_path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    tables = {}
    for name in TABLES:
        p = os.path.join(path, name)
        if os.path.exists(p):
            tables[name] = read_table(p)
    return Bundle(path, meta, config, tables)


def save_meta(path: str, meta: dict) -> None:
    with open(os.path.join(path, "meta.yaml"), "w") as f:
        yaml.safe_dump(meta, f, sort_keys=False, default_flow_style=False)
