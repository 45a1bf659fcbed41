"""LLMServingSim's hybrid (gated DeltaNet + full attention) bundle as a latency model for OUR scheduler's steps.

Their historical Qwen3.8-27B bundle (vLLM 0.28, RTX PRO 6000, `profiler/perf/RTXPRO6000/Qwen/Qwen3.8-27B/bf16/`)
is a stack that is not N identical layers, so it is read apart from the dense reader (sim/external.py):

  meta.yaml                 architecture qwen3_5; engine_resolved.per_tp[tp].block_size (784 at TP 1 and 2:
                            vLLM raised the block until one attention page holds one GDN layer state)
  tp<N>/dense.csv           layer,tokens,time_us       one call of an always-on op in ONE layer of its kind
  tp<N>/linear_attention.csv layer,prefill_tokens,n_decode,time_us
                                                       the regime-dependent GDN kernels, keyed by the step's mix
  tp<N>/attention.csv       layer,prefill_chunk,kv_prefill,n_decode,kv_decode,decode_q_len,time_us
                                                       one full-attention layer (decode_q_len 1 only: no MTP)
  tp<N>/per_sequence.csv    layer,sequences,time_us    lm_head and sampler

The split this reader relies on (and refuses tables that break it):

  every layer            layernorm x2, gate_up_proj, act_fn, down_proj                    (dense.csv)
  full-attention layers  qkv_proj, qk_norm_rope, o_proj, attn_glue + attention.csv         (dense.csv)
  GDN layers             gdn_in_proj, gdn_out_proj, gdn_norm, gdn_glue                     (dense.csv: no regime)
                         + the regime's kernels of linear_attention.csv at (P, D), P the step's prefill tokens
                           and D its decodes:
                           prefill (D = 0)   gdn_conv_prefill, gdn_post_conv, gdn_prefill
                           decode  (P = 0)   gdn_conv_decode, gdn_decode
                           mixed             gdn_conv_prefill, gdn_post_conv, gdn_prefill, gdn_decode_mixed
  once per step          embedding, final_layernorm (dense.csv, by the step's tokens)
  per sequence           lm_head + sampler (every sequence of the step: vLLM computes logits at each one's last
                         scheduled token, a partial prefill's included)

A kernel that does not fire in a regime has no rows there and is charged nothing there (a decode convolution is
never charged to a pure prefill). Attention is priced as the dense reader prices it (sim/external.py: the longest
chunk is "the" chunk of the varlen batch, the others add their prefill-only row above the launch; decodes at their
mean context; never a mixed row toward a pure-decode one); this bundle records no skew fit. Interpolation is
piecewise-linear per coordinate (ScatteredGrid), extrapolating with the last segment's slope (contexts beyond the
table's 16,384 grow linearly, as a flash-attention kernel's time does). Copies (checkpoint saves, restores, zeroed
pages) are not in the tables and cost nothing here. TP 1 only is priced (no collectives). No torch.
"""
from __future__ import annotations

import os

import yaml

from ..errors import ConfigError
from .external import ScatteredGrid, read_csv
from .latency import Interp1D, StepShape

HYBRID_HEADERS = {
    "dense.csv": ("layer", "tokens", "time_us"),
    "linear_attention.csv": ("layer", "prefill_tokens", "n_decode", "time_us"),
    "attention.csv": ("layer", "prefill_chunk", "kv_prefill", "n_decode", "kv_decode", "decode_q_len", "time_us"),
    "per_sequence.csv": ("layer", "sequences", "time_us"),
}
EVERY_LAYER_OPS = {"layernorm": 2, "gate_up_proj": 1, "act_fn": 1, "down_proj": 1}
ATTENTION_LAYER_OPS = {"qkv_proj": 1, "qk_norm_rope": 1, "o_proj": 1, "attn_glue": 1}
GDN_LAYER_OPS = {"gdn_in_proj": 1, "gdn_out_proj": 1, "gdn_norm": 1, "gdn_glue": 1}
STEP_OPS = ("embedding", "final_layernorm")
SEQUENCE_OPS = ("lm_head", "sampler")
GDN_REGIMES = {
    "prefill": ("gdn_conv_prefill", "gdn_post_conv", "gdn_prefill"),
    "decode": ("gdn_conv_decode", "gdn_decode"),
    "mixed": ("gdn_conv_prefill", "gdn_post_conv", "gdn_prefill", "gdn_decode_mixed"),
}
HYBRID_ARCHS = ("qwen3_5",)


def _rows(path: str) -> list[dict]:
    return read_csv(path, HYBRID_HEADERS)


class HybridBundle:
    """The tables of one TP degree of a qwen3_5 bundle, read and checked; `block_size` is the one the engine
    resolved when they were taken (meta.yaml engine_resolved.per_tp)."""

    def __init__(self, path: str, tp: int = 1):
        meta_path = os.path.join(path, "meta.yaml")
        if not os.path.exists(meta_path):
            raise ConfigError(f"{path}: no meta.yaml (give the directory that holds meta.yaml and tp<N>/)")
        with open(meta_path) as f:
            self.meta = yaml.safe_load(f) or {}
        arch = self.meta.get("architecture")
        if arch not in HYBRID_ARCHS:
            raise ConfigError(f"{path}: architecture {arch!r}; the hybrid reader prices {', '.join(HYBRID_ARCHS)}")
        tdir = os.path.join(path, f"tp{tp}")
        if not os.path.isdir(tdir):
            raise ConfigError(f"{path}: no tables for TP {tp}")
        self.path, self.tp = path, tp
        per = ((self.meta.get("engine_resolved") or {}).get("per_tp") or {})
        entry = per.get(str(tp)) or per.get(tp) or {}
        self.block_size = int(entry["block_size"]) if entry.get("block_size") else None
        self.dense = _rows(os.path.join(tdir, "dense.csv"))
        self.linear = _rows(os.path.join(tdir, "linear_attention.csv"))
        self.attention = _rows(os.path.join(tdir, "attention.csv"))
        self.per_sequence = _rows(os.path.join(tdir, "per_sequence.csv"))


class HybridLatency:
    """step_us(plan) for a hybrid of `n_attn` full-attention and `n_gdn` GDN layers from a HybridBundle.

    Invariant: every row of every table is priced by exactly one rule above; an op or kernel the reader does not
    place is an error, not a silent zero."""

    def __init__(self, bundle: HybridBundle, n_attn: int, n_gdn: int):
        self.bundle, self.n_attn, self.n_gdn = bundle, int(n_attn), int(n_gdn)
        ops: dict[str, list] = {}
        for r in bundle.dense:
            ops.setdefault(r["layer"], []).append((float(r["tokens"]), float(r["time_us"])))
        known = {**EVERY_LAYER_OPS, **ATTENTION_LAYER_OPS, **GDN_LAYER_OPS}
        unknown = sorted(set(ops) - set(known) - set(STEP_OPS))
        missing = sorted((set(known) | set(STEP_OPS)) - set(ops))
        if unknown or missing:
            raise ConfigError(f"{bundle.path}: dense.csv has op(s) {unknown} no layer kind runs, lacks {missing}")
        n_layers = self.n_attn + self.n_gdn

        def calls(op: str) -> int:
            if op in STEP_OPS:
                return 1
            if op in EVERY_LAYER_OPS:
                return n_layers * EVERY_LAYER_OPS[op]
            if op in ATTENTION_LAYER_OPS:
                return self.n_attn * ATTENTION_LAYER_OPS[op]
            return self.n_gdn * GDN_LAYER_OPS[op]

        fs = {k: Interp1D(v) for k, v in ops.items()}
        grid = sorted({x for f in fs.values() for x in f.xs})
        self.dense = Interp1D([(t, sum(calls(k) * f(t) for k, f in fs.items())) for t in grid])
        kern: dict[str, list] = {}
        for r in bundle.linear:
            kern.setdefault(r["layer"], []).append(
                ((float(r["prefill_tokens"]), float(r["n_decode"])), float(r["time_us"])))
        placed = {k for ks in GDN_REGIMES.values() for k in ks}
        if sorted(kern) != sorted(placed):
            raise ConfigError(f"{bundle.path}: linear_attention.csv has kernels {sorted(kern)}, expected "
                              f"{sorted(placed)} (prefill / decode / mixed regimes)")
        for k in GDN_REGIMES["decode"]:
            if any(p for (p, _), _ in kern[k]):
                raise ConfigError(f"{bundle.path}: decode kernel {k} has rows with prefill tokens")
        if any(not d for (_, d), _ in kern["gdn_decode_mixed"]):
            raise ConfigError(f"{bundle.path}: gdn_decode_mixed has rows without decodes")
        # decode kernels by D alone; the others over (P, D)
        self.gdn = {k: (Interp1D((d, t) for (_, d), t in v) if k in GDN_REGIMES["decode"] else ScatteredGrid(v))
                    for k, v in kern.items()}
        dec, mix = [], []
        for r in bundle.attention:
            if r["layer"] != "attention" or float(r["decode_q_len"]) != 1:
                raise ConfigError(f"{bundle.path}: attention.csv row {r}: only 'attention' rows of one-token decodes "
                                  f"are priced (no speculative decoding)")
            pc, kp, n, kv, t = (float(r[k]) for k in ("prefill_chunk", "kv_prefill", "n_decode", "kv_decode",
                                                       "time_us"))
            (mix.append(((pc, kp, n, kv), t)) if pc else dec.append(((n, kv), t)))
        if not dec or not mix:
            raise ConfigError(f"{bundle.path}: attention.csv needs pure-decode rows and rows with a prefill chunk")
        self.attn_decode = ScatteredGrid(dec)
        self.attn_mixed = ScatteredGrid(mix)
        self.min_chunk = min(k[0] for k, _ in mix)
        self.launch_us = self.attn_mixed(self.min_chunk, 0, 0, 0)
        # beyond the grid's largest contexts a context costs what its last doubling cost per token (the kernels are
        # linear in context there), added to the row at the edge: extrapolating the mixed rows multilinearly would
        # cross a prefill-bound slice with a decode-bound one and can go negative
        self.kp_max = max(k[1] for k, _ in mix)
        self.kv_max = max(k[1] for k, _ in dec)
        for edge in (self.kp_max, self.kv_max):
            if edge < 2:
                raise ConfigError(f"{bundle.path}: attention.csv contexts end at {edge}")
        seq: dict[str, list] = {}
        for r in bundle.per_sequence:
            seq.setdefault(r["layer"], []).append((float(r["sequences"]), float(r["time_us"])))
        if sorted(seq) != sorted(SEQUENCE_OPS):
            raise ConfigError(f"{bundle.path}: per_sequence.csv has {sorted(seq)}, expected {list(SEQUENCE_OPS)}")
        sf = [Interp1D(v) for v in seq.values()]
        self.head = Interp1D([(s, sum(f(s) for f in sf)) for s in sorted({x for f in sf for x in f.xs})])

    # ------------------------------------------------------------------ parts (us)
    def gdn_layer_us(self, prefill_tokens: int, n_decode: int) -> float:
        """One GDN layer's regime-dependent kernels for a step of P prefill tokens and D decodes."""
        p, d = prefill_tokens, n_decode
        if not p and not d:
            return 0.0
        regime = "mixed" if p and d else ("prefill" if p else "decode")
        if regime == "decode":
            return sum(self.gdn[k](d) for k in GDN_REGIMES[regime])
        return sum(self.gdn[k](p, d) for k in GDN_REGIMES[regime])

    def prefill_slope_us(self, pc: float) -> float:
        """us per prior-context token of one chunk of pc tokens beyond the grid's largest prefill context."""
        hi, half = self.kp_max, self.kp_max / 2
        return max(0.0, (self.attn_mixed(pc, hi, 0, 0) - self.attn_mixed(pc, half, 0, 0)) / (hi - half))

    def decode_slope_us(self, n: int) -> float:
        """us per context token of n decodes beyond the grid's largest decode context."""
        hi, half = self.kv_max, self.kv_max / 2
        return max(0.0, (self.attn_decode(n, hi) - self.attn_decode(n, half)) / (hi - half))

    def _attn(self, pc: int, kp: int, n: int, kv: float) -> float:
        kv = kv if n else 0
        extra = (kv - self.kv_max) * self.decode_slope_us(n) if kv > self.kv_max else 0.0
        kv = min(kv, self.kv_max)
        if pc > 0:
            pc = max(pc, self.min_chunk)
            if kp > self.kp_max:
                extra += (kp - self.kp_max) * self.prefill_slope_us(pc)
            return self.attn_mixed(pc, min(kp, self.kp_max), n, kv) + extra
        return self.attn_decode(n, kv) + extra if n else 0.0

    def attention_layer_us(self, s: StepShape) -> float:
        """One full-attention layer for the step's varlen batch."""
        pre = sorted(s.prefill, reverse=True)
        pc, kp = pre[0] if pre else (0, 0)
        ctx = s.decode_ctx
        t = self._attn(pc, kp, len(ctx), sum(ctx) / len(ctx) if ctx else 0)
        for length, start in pre[1:]:
            t += max(0.0, self._attn(length, start, 0, 0) - self.launch_us)
        return max(0.0, t)

    def parts_us(self, s: StepShape) -> dict[str, float]:
        if not s.n_seqs:
            return {"dense": 0.0, "attention": 0.0, "gdn": 0.0, "head": 0.0}
        p = sum(n for n, _ in s.prefill)
        return {"dense": self.dense(s.n_tokens), "attention": self.n_attn * self.attention_layer_us(s),
                "gdn": self.n_gdn * self.gdn_layer_us(p, len(s.decode_ctx)), "head": self.head(s.n_seqs)}

    def shape_us(self, s: StepShape, now: float = 0.0) -> float:
        return sum(self.parts_us(s).values())

    def step_us(self, plan) -> float:
        return self.shape_us(StepShape.of(plan))
