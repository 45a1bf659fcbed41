"""LLMServingSim's profile bundle as a latency model: price a step of OUR scheduler on another engine's GPU tables.

A bundle directory (their `profiler/perf/<hw>/<model>/<dtype>/`):

  meta.yaml               how the tables were taken (vLLM version, GPU, `tp_degrees`, `attention_grid`,
                          `skew_fit.bucket_axes` and `skew_fit.per_tp[tp].alpha_default`)
  tp<N>/dense.csv         layer,tokens,time_us        one decoder layer's op by token count (the profiler runs
                                                      vLLM with num_hidden_layers 1), plus the once-per-step
                                                      `embedding` and `final_layernorm`
  tp<N>/attention.csv     prefill_chunk,kv_prefill,n_decode,kv_decode,time_us
                                                      one attention layer for one prefill chunk (its tokens, its
                                                      cached context) plus n_decode decodes at one context
  tp<N>/per_sequence.csv  layer,sequences,time_us     lm_head and sampler by the sequences in the step
  tp<N>/skew_fit.csv      pc,n_label,skew_rate_label,kv_big_label,kp_label,alpha,n_samples
                                                      t = t(mean ctx) + alpha * (t(max ctx) - t(mean ctx))
  tp1/moe.csv             tokens,activated_experts,time_us  (MoE) one layer's fused expert block, all experts

Times are microseconds of one GPU (one rank). How this model reads them (checked against the data, see
docs/simulator.md): a dense row is ONE call of that op in ONE layer (qkv_proj at 1 token is 36 us, what the
4096 x 6144 bf16 weight takes to stream at the card's bandwidth; `layernorm` at 1 token equals
`final_layernorm`, one RMSNorm call, and a llama layer makes two: input and post-attention). So

    step = embedding(T) + final_layernorm(T) + L * sum(calls * op(T))          T tokens in the step
         + L * attention(step)                                                  L decoder layers
         + L * moe(Experts.rank_load(G))                                        MoE: G tokens gathered
         + lm_head(S) + sampler(S)                                              S sequences in the step
         + comm (TP > 1): per layer 2 all-reduces of T x hidden, one for the embedding, one logits gather
              (EP > 1): per layer a dispatch all-gather and a combine reduce-scatter of the G tokens

The ops and their calls per layer are the architecture's (ARCH_OPS: llama, qwen3's extra q/k norm row, qwen3_moe's
layer without a dense MLP).

S counts every sequence of the step: vLLM computes logits at the last scheduled token of each request, a
partial prefill's included, and drops those samples. attention(step): a step's batch is one varlen kernel;
the table holds batches of one prefill chunk with n decodes, so the longest prefill chunk is "the" chunk and
every other prefill adds its prefill-only row above the table's smallest batch (the launch is paid once).
Decodes are priced at their mean context with the skew correction of skew_fit.csv (bucketed as meta.yaml
says; the skew rate of a two-level profiled batch, the share of long contexts, is (mean - min) / (max - min)
of a real batch). A batch with any prefill runs the kernel's mixed path (no split-KV: the table jumps from
405 to 672 us for 128 decodes at 1024 when a 16-token chunk joins), so mixed rows are never interpolated
toward pure-decode ones: a chunk shorter than the smallest profiled one is priced at it.
Interpolation is multilinear over the profiled points (the grid is a union of a x2 and a x1.5 lattice, so
each slice brackets among the points it has), extrapolating with the last segment's slope. No torch.
"""
from __future__ import annotations

import csv
import math
import os
from bisect import bisect_left, bisect_right
from dataclasses import dataclass

import yaml

from ..errors import ConfigError
from .latency import Interp1D, StepShape

# op -> calls per decoder layer, by architecture (meta.yaml's `architecture`, config.json's model_type); "step"
# ops run once per step. Unknown ops are errors: a table from another architecture must not be priced as if its
# extra rows were not there. qwen3's `qk_norm` row is the q and k RMSNorms of one layer summed (the profiler's
# catalog merges every RMSNorm inside the attention module into one entry), so it counts once. qwen3_moe has no
# dense MLP rows: its MLP is moe.csv's fused block (router, top-k, experts), one call per layer.
LLAMA_OPS = {"layernorm": 2, "qkv_proj": 1, "rotary_emb": 1, "o_proj": 1, "gate_up_proj": 1, "act_fn": 1,
             "down_proj": 1}
QWEN3_OPS = {**LLAMA_OPS, "qk_norm": 1}
QWEN3_MOE_OPS = {"layernorm": 2, "qkv_proj": 1, "qk_norm": 1, "rotary_emb": 1, "o_proj": 1}
ARCH_OPS = {"llama": LLAMA_OPS, "mistral": LLAMA_OPS, "qwen2": LLAMA_OPS, "qwen3": QWEN3_OPS,
            "qwen3_moe": QWEN3_MOE_OPS}
MOE_ARCHS = ("qwen3_moe",)
LAYER_OPS = LLAMA_OPS  # the dense decoder's, kept under its old name
STEP_OPS = ("embedding", "final_layernorm")
SEQUENCE_OPS = ("lm_head", "sampler")
HEADERS = {
    "dense.csv": ("layer", "tokens", "time_us"),
    "attention.csv": ("prefill_chunk", "kv_prefill", "n_decode", "kv_decode", "time_us"),
    "per_sequence.csv": ("layer", "sequences", "time_us"),
    "skew_fit.csv": ("pc", "n_label", "skew_rate_label", "kv_big_label", "kp_label", "alpha", "n_samples"),
    "moe.csv": ("tokens", "activated_experts", "time_us"),
}
SKEW_AXES = ("n", "skew_rate", "kv_big", "kp")  # bucket_axes.<axis>_bins / <axis>_labels in meta.yaml


def read_csv(path: str, headers: dict[str, tuple[str, ...]] = HEADERS) -> list[dict]:
    """Rows of one of the bundle's tables; the header must be exactly the format's (headers: file -> columns)."""
    name = os.path.basename(path)
    if not os.path.exists(path):
        raise ConfigError(f"{path}: missing (an LLMServingSim bundle has {', '.join(headers)} per TP degree)")
    with open(path, newline="") as f:
        r = csv.DictReader(f)
        if tuple(r.fieldnames or ()) != headers[name]:
            raise ConfigError(f"{path}: columns {r.fieldnames}, expected {list(headers[name])}")
        return list(r)


class ScatteredGrid:
    """y(x_1..x_k) through points that need not fill a lattice: bracket x_1 among the values present, then
    x_2 among those present under each bracket, and so on; linear in each, the last by Interp1D. Outside a
    slice's range: the slope of its last segment. Never below 0."""

    def __init__(self, points):
        pts = [(tuple(float(v) for v in key), float(y)) for key, y in points]
        if not pts:
            raise ValueError("no points to interpolate")
        self.dims = len(pts[0][0])
        self.root = self._build(pts, 0)

    def _build(self, pts, d):
        if d == self.dims - 1:
            return Interp1D((k[d], y) for k, y in pts)
        groups: dict[float, list] = {}
        for k, y in pts:
            groups.setdefault(k[d], []).append((k, y))
        xs = sorted(groups)
        return xs, [self._build(groups[x], d + 1) for x in xs]

    def _eval(self, node, q, d):
        if d == self.dims - 1:
            return node(q[d])
        xs, kids = node
        if len(xs) == 1:
            return self._eval(kids[0], q, d + 1)
        i = min(max(bisect_right(xs, q[d]) - 1, 0), len(xs) - 2)
        w = (q[d] - xs[i]) / (xs[i + 1] - xs[i])
        if w == 0.0:
            return self._eval(kids[i], q, d + 1)
        if w == 1.0:
            return self._eval(kids[i + 1], q, d + 1)
        return (1.0 - w) * self._eval(kids[i], q, d + 1) + w * self._eval(kids[i + 1], q, d + 1)

    def __call__(self, *q: float) -> float:
        if len(q) != self.dims:
            raise ValueError(f"{self.dims} coordinates expected, got {len(q)}")
        return max(0.0, self._eval(self.root, q, 0))


def _cut(x: float, bins: list[float], labels: list[str]) -> str | None:
    """pandas.cut's bucket (right-inclusive: bins[i] < x <= bins[i+1]), None outside."""
    i = bisect_left(bins, x) - 1
    return labels[i] if 0 <= i < len(labels) else None


class SkewFit:
    """alpha by bucket (skew_fit.csv), with the bins and labels meta.yaml gives; alpha_default elsewhere."""

    def __init__(self, rows: list[dict], axes: dict, alpha_default: float):
        self.axes = {}
        for a in SKEW_AXES:
            bins, labels = axes.get(f"{a}_bins"), axes.get(f"{a}_labels")
            if not bins or not labels or len(bins) != len(labels) + 1:
                raise ConfigError(f"meta.yaml skew_fit.bucket_axes: {a}_bins / {a}_labels missing or of unequal size")
            self.axes[a] = ([float(b) for b in bins], list(labels))
        self.alpha_default = float(alpha_default)
        self.table = {(int(float(r["pc"])), r["n_label"], r["skew_rate_label"], r["kv_big_label"], r["kp_label"]):
                      float(r["alpha"]) for r in rows}
        self.pcs = sorted({k[0] for k in self.table if k[0] > 0})

    def pc_point(self, pc: int) -> int:
        """The profiled chunk a real chunk's bucket is read at: the nearest in log2 (pc > 0 stays > 0)."""
        if pc <= 0 or not self.pcs:
            return 0
        return min(self.pcs, key=lambda p: abs(math.log2(p) - math.log2(pc)))

    def alpha(self, pc: int, kp: int, n: int, kv_max: float, skew_rate: float) -> float:
        key = (self.pc_point(pc), _cut(n, *self.axes["n"]), _cut(skew_rate, *self.axes["skew_rate"]),
               _cut(kv_max, *self.axes["kv_big"]), _cut(kp, *self.axes["kp"]))
        return self.table.get(key, self.alpha_default)


@dataclass(frozen=True)
class Comm:
    """Collectives over p ranks. All-reduce: vLLM's custom all-reduce on two ranks is one stage (each rank reads its
    peer's buffer: one hop of latency + the bytes), up to its buffer (one_shot_bytes, vLLM's 8 MiB); above that,
    or on more ranks, NCCL's ring: 2(p-1) hops + 2(p-1)/p of the bytes. All-gather (and reduce-scatter, which
    moves the same bytes) of a `nbytes` total: a ring of p-1 hops + (p-1)/p of the bytes."""

    tp: int = 1  # p, the ranks of the group
    bandwidth: float = 0.0  # bytes/s per link
    latency: float = 0.0  # seconds per hop
    one_shot_bytes: int = 0  # all-reduces up to this size take one hop on two ranks (0: always the ring)

    def all_reduce_us(self, nbytes: float) -> float:
        if self.tp <= 1:
            return 0.0
        p = self.tp
        hops = 1 if p == 2 and nbytes <= self.one_shot_bytes else 2 * (p - 1)
        return 1e6 * (hops * self.latency + 2 * (p - 1) / p * nbytes / self.bandwidth)

    def all_gather_us(self, nbytes: float) -> float:
        if self.tp <= 1:
            return 0.0
        p = self.tp
        return 1e6 * ((p - 1) * self.latency + (p - 1) / p * nbytes / self.bandwidth)


VLLM_CUSTOM_ALL_REDUCE_BYTES = 8 << 20  # vLLM's custom all-reduce buffer (ca_max_size default)


@dataclass(frozen=True)
class Experts:
    """A MoE model's experts as vLLM runs them with data + expert parallelism (the all-gather / reduce-scatter
    backend): the dp ranks all-gather their tokens, each runs the gathered tokens through its E / ep local experts
    and reduce-scatters the result. ep = dp x tp ranks, ep >= 1."""

    num_experts: int
    top_k: int
    ep: int = 1
    dp: int = 1

    def rank_load(self, gathered: float) -> tuple[float, float]:
        """(table tokens, activated experts) of one rank when the group gathered `gathered` tokens: moe.csv's row
        (t, a) runs t tokens of top_k experts each over a distinct experts, so a rank holding gathered x top_k / ep
        of the pairs reads as t = gathered / ep; its activated experts are those of its E / ep hit by at least one
        gathered token, each expert hit by a token with probability top_k / E (a balanced gate)."""
        local = self.num_experts / self.ep
        hit = local * (1.0 - (1.0 - self.top_k / self.num_experts) ** gathered)
        return gathered / self.ep, hit


class ExternalBundle:
    """The tables of one TP degree, read and checked; ExternalLatency prices steps with them."""

    def __init__(self, path: str, tp: int = 1):
        meta_path = os.path.join(path, "meta.yaml")
        if not os.path.exists(meta_path):
            raise ConfigError(f"{path}: no meta.yaml (give the directory that holds meta.yaml and tp<N>/, e.g. "
                              f"profiler/perf/<hw>/<model>/<dtype>)")
        with open(meta_path) as f:
            self.meta = yaml.safe_load(f) or {}
        degrees = [int(t) for t in self.meta.get("tp_degrees") or [1]]
        tdir = os.path.join(path, f"tp{tp}")
        if tp not in degrees or not os.path.isdir(tdir):
            raise ConfigError(f"{path}: no tables for TP {tp} (meta.yaml tp_degrees {degrees})")
        self.path, self.tp = path, tp
        self.dense = read_csv(os.path.join(tdir, "dense.csv"))
        self.attention = read_csv(os.path.join(tdir, "attention.csv"))
        self.per_sequence = read_csv(os.path.join(tdir, "per_sequence.csv"))
        # MoE bundles profile the expert block at TP 1 only (tp1/moe.csv): experts are split by expert
        # parallelism, not by TP, so every degree reads the TP-1 table
        moe = [os.path.join(tdir, "moe.csv"), os.path.join(path, "tp1", "moe.csv")]
        self.moe = next((read_csv(m) for m in moe if os.path.exists(m)), None)
        sk = self.meta.get("skew_fit") or {}
        self.skew = None
        if sk.get("enabled"):
            per = (sk.get("per_tp") or {}).get(tp) or (sk.get("per_tp") or {}).get(str(tp)) or {}
            table = per.get("bucket_table", f"tp{tp}/skew_fit.csv")
            self.skew = SkewFit(read_csv(os.path.join(path, table)), sk.get("bucket_axes") or {},
                                per.get("alpha_default", 0.0))

    @property
    def architecture(self) -> str | None:
        return self.meta.get("architecture")


class ExternalLatency:
    """step_us(StepShape) from an ExternalBundle for a model of `layers` decoder layers (config.json).

    arch picks the per-layer op counts (ARCH_OPS; default the bundle's meta.yaml `architecture`, else llama).
    A MoE architecture needs `experts` and prices each layer's expert block from moe.csv at Experts.rank_load;
    with ep > 1 it adds the dispatch all-gather (hidden + router logits per token) and the combine
    reduce-scatter (hidden) of every layer over `ep_comm`'s link."""

    def __init__(self, bundle: ExternalBundle, layers: int, hidden_size: int = 0, vocab_size: int = 0,
                 dtype_bytes: int = 2, comm: Comm | None = None, skew: bool = True, arch: str | None = None,
                 experts: Experts | None = None, ep_comm: Comm | None = None):
        self.bundle, self.layers = bundle, int(layers)
        self.hidden, self.vocab, self.dtype_bytes = hidden_size, vocab_size, dtype_bytes
        self.comm = comm or Comm(bundle.tp)
        if self.comm.tp > 1 and (self.comm.bandwidth <= 0 or not hidden_size):
            raise ConfigError("TP > 1 needs a link bandwidth (--link-bandwidth) and the model's hidden size")
        self.arch = arch or bundle.architecture or "llama"
        if self.arch not in ARCH_OPS:
            raise ConfigError(f"{bundle.path}: architecture {self.arch!r}; the external latency model prices "
                              f"{', '.join(ARCH_OPS)}")
        layer_ops = ARCH_OPS[self.arch]
        ops: dict[str, list] = {}
        for r in bundle.dense:
            ops.setdefault(r["layer"], []).append((float(r["tokens"]), float(r["time_us"])))
        unknown = sorted(set(ops) - set(layer_ops) - set(STEP_OPS))
        missing = sorted(set(layer_ops) - set(ops))
        if unknown or missing:
            raise ConfigError(f"{bundle.path}: dense.csv has op(s) {unknown} this reader does not know how often a "
                              f"{self.arch} step runs, lacks {missing}; {self.arch}: "
                              f"{sorted(layer_ops) + list(STEP_OPS)}")
        fs = {k: Interp1D(v) for k, v in ops.items()}
        grid = sorted({x for f in fs.values() for x in f.xs})
        # (tokens -> us) of the whole model's dense part: once-per-step ops + layers x (calls x op)
        self.dense = Interp1D([(t, sum((1 if k in STEP_OPS else self.layers * layer_ops[k]) * f(t)
                                       for k, f in fs.items())) for t in grid])
        self.experts, self.ep_comm, self.moe = experts, ep_comm or Comm(1), None
        if self.arch in MOE_ARCHS:
            if experts is None or not bundle.moe:
                raise ConfigError(f"{bundle.path}: a {self.arch} model needs moe.csv and its experts "
                                  f"(num_experts, num_experts_per_tok)")
            if self.ep_comm.tp != experts.ep or (experts.ep > 1 and self.ep_comm.bandwidth <= 0):
                raise ConfigError(f"expert parallelism {experts.ep} needs a link of {experts.ep} ranks with a "
                                  f"bandwidth")
            # (activated experts, tokens): every activated-expert count is profiled from the token count that can
            # reach it (8 at 1 token, 128 from 16), so the token axis is the inner one
            pts = [((float(r["activated_experts"]), float(r["tokens"])), float(r["time_us"])) for r in bundle.moe]
            self.moe = ScatteredGrid(pts)
            self.moe_min_experts = min(a for (a, _), _ in pts)
            self.moe_max_experts = max(a for (a, _), _ in pts)
        elif bundle.moe:
            raise ConfigError(f"{bundle.path}: moe.csv for a dense {self.arch} model")
        seq: dict[str, list] = {}
        for r in bundle.per_sequence:
            seq.setdefault(r["layer"], []).append((float(r["sequences"]), float(r["time_us"])))
        if sorted(seq) != sorted(SEQUENCE_OPS):
            raise ConfigError(f"{bundle.path}: per_sequence.csv has {sorted(seq)}, expected {list(SEQUENCE_OPS)}")
        fs = [Interp1D(v) for v in seq.values()]
        grid = sorted({x for f in fs for x in f.xs})
        self.head = Interp1D([(s, sum(f(s) for f in fs)) for s in grid])
        dec, mix = [], []
        for r in bundle.attention:
            pc, kp, n, kv, t = (float(r[k]) for k in HEADERS["attention.csv"])
            if pc == 0:
                if kp or not n:
                    raise ConfigError(f"{bundle.path}: attention.csv row {r} has no prefill chunk but a prefill "
                                      f"context or no decodes")
                dec.append(((n, kv), t))
            else:
                mix.append(((pc, kp, n, kv), t))
        if not dec or not mix:
            raise ConfigError(f"{bundle.path}: attention.csv needs pure-decode rows (prefill_chunk 0) and rows "
                              f"with a prefill chunk")
        self.attn_decode = ScatteredGrid(dec)  # (n_decode, kv_decode), no prefill in the batch
        self.attn_mixed = ScatteredGrid(mix)  # (prefill_chunk, kv_prefill, n_decode, kv_decode)
        self.min_chunk = min(k[0] for k, _ in mix)
        self.launch_us = self.attn_mixed(self.min_chunk, 0, 0, 0)  # the smallest batch: the kernel's fixed cost
        self.skew = bundle.skew if skew else None

    # ------------------------------------------------------------------ parts (us)
    def _table(self, pc: int, kp: int, n: int, kv: float) -> float:
        if pc > 0:
            return self.attn_mixed(max(pc, self.min_chunk), kp, n, kv if n else 0)
        return self.attn_decode(n, kv) if n else 0.0

    def attention_us(self, s: StepShape) -> float:
        """One layer's attention for the step's batch."""
        pre = sorted(s.prefill, reverse=True)  # (length, start): the longest chunk first
        pc, kp = pre[0] if pre else (0, 0)
        ctx = s.decode_ctx
        n = len(ctx)
        if n:
            lo, hi = min(ctx), max(ctx)
            mean = sum(ctx) / n
            t = self._table(pc, kp, n, mean)
            if self.skew is not None and hi > lo:
                alpha = self.skew.alpha(pc, kp, n, hi, (mean - lo) / (hi - lo))
                t += alpha * (self._table(pc, kp, n, hi) - t)
        else:
            t = self._table(pc, kp, 0, 0)
        for length, start in pre[1:]:
            t += max(0.0, self._table(length, start, 0, 0) - self.launch_us)
        return max(0.0, t)

    def moe_us(self, gathered: float) -> float:
        """One layer's expert block on one rank when the data-parallel group gathered `gathered` tokens (0 for a
        dense model)."""
        if self.moe is None or gathered <= 0:
            return 0.0
        t, a = self.experts.rank_load(gathered)
        return self.moe(min(max(a, self.moe_min_experts), self.moe_max_experts), t)

    def comm_us(self, s: StepShape, tokens: int | None = None, gathered: float | None = None) -> float:
        """TP: per layer 2 all-reduces of tokens x hidden (after o_proj and down_proj: the tables time the GEMMs
        without them, tp2's o_proj is half tp1's), one for the vocabulary-parallel embedding, the logits
        all-gather. EP: per layer the dispatch all-gather (hidden + one router logit per expert per token) and the
        combine reduce-scatter (hidden) of the `gathered` tokens."""
        tokens = s.n_tokens if tokens is None else tokens
        us = 0.0
        if self.comm.tp > 1:
            act = tokens * self.hidden * self.dtype_bytes
            logits = s.n_seqs * self.vocab * self.dtype_bytes
            us += (2 * self.layers + 1) * self.comm.all_reduce_us(act) + self.comm.all_gather_us(logits)
        if self.moe is not None and self.experts.ep > 1:
            e = self.experts
            g = e.dp * tokens if gathered is None else gathered
            dispatch = self.ep_comm.all_gather_us(g * (self.hidden + e.num_experts) * self.dtype_bytes)
            combine = self.ep_comm.all_gather_us(g * self.hidden * self.dtype_bytes)  # a ring RS moves an AG's bytes
            us += self.layers * (dispatch + combine)
        return us

    def parts_us(self, s: StepShape, tokens: int | None = None, gathered: float | None = None) -> dict[str, float]:
        """The step's parts on one rank. `tokens`: the count its dense layers run at (a data-parallel rank padded
        to the group's largest), default its own; `gathered`: the tokens the expert layers gather across the
        data-parallel group, default dp x tokens."""
        if not s.n_seqs and not tokens:
            return {"dense": 0.0, "attention": 0.0, "moe": 0.0, "head": 0.0, "comm": 0.0}
        t = max(s.n_tokens, tokens or 0)
        g = (self.experts.dp * t if self.experts else t) if gathered is None else gathered
        return {"dense": self.dense(t), "attention": self.layers * self.attention_us(s) if s.n_seqs else 0.0,
                "moe": self.layers * self.moe_us(g), "head": self.head(s.n_seqs) if s.n_seqs else 0.0,
                "comm": self.comm_us(s, t, g)}

    def shape_us(self, s: StepShape, now: float = 0.0, tokens: int | None = None,
                 gathered: float | None = None) -> float:
        return sum(self.parts_us(s, tokens, gathered).values())

    def step_us(self, plan) -> float:
        return self.shape_us(StepShape.of(plan))
