"""The latency model: the time of one engine step as a function of its StepPlan, from a profile bundle. No torch.

    step time = dense(T) + lm_head(S) + sampler(S)                                  always-on kernels
              + n_gdn  * [ sum over prefill spans  conv_prefill(L) + post_conv(L) + prefill(L + lead)
                           + (if D decodes)        conv_decode(D) + decode(D) + decode_glue(D) ]
              + n_attn * [ sum over prefill spans  attn_prefill(L, pos + L)
                           + sum over decodes       attn_decode(context) ]
              + copies: zero_pages(P) + zero_slots(Z) + restore(R) + save(W)
              + overhead: scheduler(N) + batch_prep(N) + engine_emit(S)
              + vision encoder: sum over the images the step encodes  encoder(patches)
              + calibrated residual: fixed + per_seq * N + per_prefill * P (and two compute scales: one
                for the prefill part of the tables, one for the decode part, see compute_parts)
    wall time = wall_per_cpu * all of it   (1 when the bundle was timed in wall time; or speed(t), a SpeedTrace
                                           measured while a real run went on, per step kind)

T tokens in the step, S sampled rows, N sequences, L a prefill span's length, lead its start position
modulo the 64-token GDN chunk (the chunked kernel pads to its grid). This mirrors how the engine runs a
step: linear layers over all T tokens at once, GDN prefill and attention per sequence, GDN decode batched.
Tables are interpolated piecewise-linearly and extrapolated with the slope of their last segment.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

from .bundle import DENSE_KERNELS, Bundle
from .report import percentile

GDN_CHUNK = 64


class Interp1D:
    """Piecewise-linear y(x) through sorted points; linear extrapolation, clamped at 0."""

    __slots__ = ("xs", "ys")

    def __init__(self, points, monotone: bool = False):
        """points: (x, y), repeated x -> their median. monotone: y never falls as x grows (a running maximum),
        for costs that cannot shrink with size: more tokens or sequences never cost less, whatever the noise of
        two neighbouring measurements."""
        pts: dict[float, list[float]] = {}
        for x, y in points:
            pts.setdefault(float(x), []).append(float(y))
        if not pts:
            raise ValueError("no points to interpolate")
        self.xs = sorted(pts)
        self.ys = [sorted(pts[x])[len(pts[x]) // 2] for x in self.xs]
        if monotone:
            for i in range(1, len(self.ys)):
                self.ys[i] = max(self.ys[i], self.ys[i - 1])

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        n = len(xs)
        if n == 1:
            return ys[0] * (x / xs[0]) if xs[0] > 0 else ys[0]
        i = bisect_right(xs, x) - 1
        if i < 0:
            i = 0
        elif i >= n - 1:
            i = n - 2
        x0, x1 = xs[i], xs[i + 1]
        y = ys[i] + (ys[i + 1] - ys[i]) * (x - x0) / (x1 - x0)
        return y if y > 0.0 else 0.0


class SpeedTrace:
    """The machine's speed over time: factor(t) = measured / predicted time of the probe steps nearest to t.

    samples: (t, measured_us, predicted_us) per probe step, t on the clock of the run being simulated. The
    factor at t pools the `window` samples centred on the one nearest t (off centre at the ends), so that one
    noisy step moves it by little; a speed that drifts over seconds is followed, a single slow step is not."""

    def __init__(self, samples, window: int = 32):
        if not samples:
            raise ValueError("a speed trace needs at least one probe sample")
        pts = sorted(samples)
        self.ts = [t for t, _, _ in pts]
        meas = [0.0]
        pred = [0.0]
        for _, m, p in pts:
            meas.append(meas[-1] + m)
            pred.append(pred[-1] + p)
        n, h = len(pts), max(1, window) // 2
        self.factors = []
        for i in range(n):
            lo = max(0, min(i - h, n - 2 * h - 1))  # at an end the window keeps its size, off centre
            hi = min(n, lo + 2 * h + 1)
            dp = pred[hi] - pred[lo]
            self.factors.append((meas[hi] - meas[lo]) / dp if dp > 0 else 1.0)
        self.mean = meas[-1] / pred[-1] if pred[-1] > 0 else 1.0

    def __call__(self, t: float) -> float:
        i = bisect_right(self.ts, t)
        if i == 0:
            return self.factors[0]
        if i == len(self.ts) or t - self.ts[i - 1] <= self.ts[i] - t:
            return self.factors[i - 1]
        return self.factors[i]


class Interp2D:
    """y(q, c): piecewise-linear in c along each profiled q, then linear in q between the two nearest q."""

    def __init__(self, points):
        rows: dict[float, list[tuple[float, float]]] = {}
        for q, c, y in points:
            rows.setdefault(float(q), []).append((c, y))
        self.qs = sorted(rows)
        self.rows = [Interp1D(rows[q]) for q in self.qs]

    def __call__(self, q: float, c: float) -> float:
        qs = self.qs
        if len(qs) == 1:
            return self.rows[0](c) * q / qs[0]
        i = bisect_right(qs, q) - 1
        i = min(max(i, 0), len(qs) - 2)
        y0, y1 = self.rows[i](c), self.rows[i + 1](c)
        y = y0 + (y1 - y0) * (q - qs[i]) / (qs[i + 1] - qs[i])
        return y if y > 0.0 else 0.0


@dataclass
class StepShape:
    """What the latency model reads from a StepPlan."""

    prefill: list[tuple[int, int]]  # (length, start position) per prefill span
    decode_ctx: list[int]  # context length (tokens attended, itself included) per decode
    n_sample: int
    zero_pages: int = 0
    zero_slots: int = 0
    restores: int = 0
    saves: int = 0
    after_prefill: bool = False  # the engine's previous step computed prompt tokens (caches cold for a decode)
    encoder_images: tuple[int, ...] = ()  # image tokens of each image the vision encoder makes in the step

    @property
    def decode_only(self) -> bool:
        return bool(self.decode_ctx) and not self.prefill

    @property
    def n_tokens(self) -> int:
        return sum(n for n, _ in self.prefill) + len(self.decode_ctx)

    @property
    def n_seqs(self) -> int:
        return len(self.prefill) + len(self.decode_ctx)

    @classmethod
    def of(cls, plan, after_prefill: bool = False) -> "StepShape":
        prefill, decode, sample = [], [], 0
        for w in plan.work:
            n = len(w.token_ids)
            # a decode row per token: a verify span (the last token and its drafts) is n rows, each attending to its
            # own context and sampled (the head on every row: the lazy head, row 0 alone, is not priced)
            if w.is_decode:
                decode.extend(w.start_pos + 1 + j for j in range(n))
            else:
                prefill.append((n, w.start_pos))
            if w.sample:
                sample += n if w.is_decode else 1
        return cls(prefill, decode, sample, len(plan.zero_pages), len(plan.zero_slots), len(plan.restores),
                   len(plan.saves), after_prefill, tuple(getattr(plan, "encoder_images", ())))


class LatencyModel:
    """step_us(plan) -> microseconds, from a profile bundle."""

    def __init__(self, bundle: Bundle, tp: int = 1, wall_per_cpu: float | None = None,
                 speed: SpeedTrace | None = None, decode_speed: SpeedTrace | None = None):
        """wall_per_cpu: the machine's contention to simulate (default: the bundle's, measured while profiling).
        speed: instead, a speed that changes over time (measured by a probe while a real run went on); a step
        starting at `now` takes speed(now) times the bundle's CPU time. decode_speed: the same for decode-only
        steps, where it was measured apart: on a shared machine the memory-bound decodes and the compute-bound
        prefills drift apart (neighbours take bandwidth, not FLOPs); default: speed."""
        self.bundle = bundle
        meta = bundle.meta
        layers = meta.get("layers") or {}
        self.n_gdn = int(layers.get("gdn", 0))
        self.n_attn = int(layers.get("attention", 0))
        if tp != 1 and bundle.block_size(tp) is None:
            raise ValueError(f"the bundle has no entry for tensor-parallel size {tp}")
        # dense: one combined per-token curve and one per-sampled-row curve (sum over kernels of layers * time)
        tok, row = {}, {}
        for r in bundle.rows("dense.csv"):
            k = r["kernel"]
            kind = DENSE_KERNELS.get(k, "tokens")
            (row if kind == "rows" else tok).setdefault(k, []).append((r["tokens"], r["time_us"] * r["layers"]))
        if not tok:
            raise ValueError(f"{bundle.path}: dense.csv has no rows")
        self.dense_kernels = {k: Interp1D(v) for k, v in tok.items()}
        self.row_kernels = {k: Interp1D(v) for k, v in row.items()}
        grid = sorted({x for f in self.dense_kernels.values() for x in f.xs})
        self.dense = Interp1D([(x, sum(f(x) for f in self.dense_kernels.values())) for x in grid], monotone=True)
        rgrid = sorted({x for f in self.row_kernels.values() for x in f.xs}) or [1.0]
        self.rows_fn = Interp1D([(x, sum(f(x) for f in self.row_kernels.values())) for x in rgrid], monotone=True) \
            if self.row_kernels else None
        # GDN, by regime
        pre: dict[str, list] = {}
        dec: dict[str, list] = {}
        for r in bundle.rows("linear_attention.csv"):
            if r["regime"] == "prefill":
                pre.setdefault(r["kernel"], []).append((r["prefill_tokens"], r["time_us"]))
            elif r["regime"] == "decode":
                dec.setdefault(r["kernel"], []).append((r["n_decode"], r["time_us"]))
        self.gdn_prefill_chunked = Interp1D(pre.pop("gdn_prefill"), monotone=True) if "gdn_prefill" in pre else None
        pgrid = sorted({x for v in pre.values() for x, _ in v}) or [1.0]
        fs = [Interp1D(v) for v in pre.values()]
        self.gdn_prefill_other = Interp1D([(x, sum(f(x) for f in fs)) for x in pgrid], monotone=True) if fs else None
        dgrid = sorted({x for v in dec.values() for x, _ in v}) or [1.0]
        fs = [Interp1D(v) for v in dec.values()]
        self.gdn_decode = Interp1D([(x, sum(f(x) for f in fs)) for x in dgrid], monotone=True) if fs else None
        # attention
        ap = [(r["query_tokens"], r["context_len"], r["time_us"]) for r in bundle.rows("attention.csv")
              if r["kernel"] == "attn_prefill"]
        ad = [(r["context_len"], r["time_us"]) for r in bundle.rows("attention.csv") if r["kernel"] == "attn_decode"]
        self.attn_prefill = Interp2D(ap) if ap else None
        self.attn_decode = Interp1D(ad, monotone=True) if ad else None
        # copies and overhead
        cp: dict[str, list] = {}
        for r in bundle.rows("copies.csv"):
            cp.setdefault(r["op"], []).append((r["count"], r["time_us"]))
        self.copies = {k: Interp1D(v, monotone=True) for k, v in cp.items()}
        ov: dict[str, list] = {}
        for r in bundle.rows("overhead.csv"):
            x = r["tokens"] if r["component"] == "engine_emit" else r["n_seqs"]
            ov.setdefault(r["component"], []).append((x, r["time_us"]))
        self.overhead = {k: Interp1D(v, monotone=True) for k, v in ov.items()}
        # the vision encoder, per image by its patch count (a model without one profiles no rows)
        enc = bundle.rows("vision_encoder.csv")
        self.encoder = Interp1D([(r["patches"], r["time_us"]) for r in enc], monotone=True) if enc else None
        self.patches_per_token = (enc[0]["patches"] / enc[0]["tokens"]) if enc else None
        cal = bundle.calibration
        self.fixed_us = float(cal.get("fixed_us", 0.0))
        self.per_seq_us = float(cal.get("per_seq_us", 0.0))
        self.per_prefill_us = float(cal.get("per_prefill_us", 0.0))
        self.compute_scale = float(cal.get("compute_scale", 1.0))
        self.compute_scale_decode = float(cal.get("compute_scale_decode", self.compute_scale))  # older bundles: one
        # decode-only steps: an offset (the tables, timed op by op, carry the timers' cost) and the extra cost of
        # the first decode step after a prefill (the prefill's temporaries pushed weights out of the caches)
        self.decode_fixed_us = float(cal.get("decode_fixed_us", 0.0))
        self.after_prefill_us = float(cal.get("after_prefill_us", 0.0))
        self.wall_per_cpu = float(wall_per_cpu if wall_per_cpu is not None else cal.get("wall_per_cpu", 1.0))
        self.speed = speed
        self.decode_speed = decode_speed if decode_speed is not None else speed
        self._dense_cache: dict[int, float] = {}
        self._dec_cache: dict[int, float] = {}

    # ------------------------------------------------------------------ parts
    def _dense(self, t: int) -> float:
        v = self._dense_cache.get(t)
        if v is None:
            v = self._dense_cache[t] = self.dense(t)
        return v

    def _gdn_decode(self, d: int) -> float:
        v = self._dec_cache.get(d)
        if v is None:
            v = self._dec_cache[d] = self.gdn_decode(d) if self.gdn_decode else 0.0
        return v

    def compute_us(self, s: StepShape) -> float:
        """The model's share of the step (kernels and copies), before calibration."""
        return sum(self.compute_parts(s))

    def compute_parts(self, s: StepShape) -> tuple[float, float]:
        """compute_us split into (prefill part, decode part), which calibration scales apart: decode steps run
        with the weights hot in cache, prefill-heavy ones do not, and the tables (timed in loops) sit between.
        The dense kernels are shared by token count; the sampled rows go with the decodes when there are any;
        copies (zeroing, restores, saves) go with the prefills."""
        t = s.n_tokens
        dense = self._dense(t) if t else 0.0
        d_share = len(s.decode_ctx) / t if t else 0.0
        pre, dec = dense * (1.0 - d_share), dense * d_share
        if s.n_sample and self.rows_fn is not None:
            if s.decode_ctx:
                dec += self.rows_fn(s.n_sample)
            else:
                pre += self.rows_fn(s.n_sample)
        gdn = attn = 0.0
        for n, pos in s.prefill:
            if self.gdn_prefill_other is not None:
                gdn += self.gdn_prefill_other(n)
            if self.gdn_prefill_chunked is not None:
                gdn += self.gdn_prefill_chunked(n + pos % GDN_CHUNK)
            if self.attn_prefill is not None:
                attn += self.attn_prefill(n, pos + n)
        pre += self.n_gdn * gdn + self.n_attn * attn
        if s.decode_ctx:
            gdn = self._gdn_decode(len(s.decode_ctx))
            attn = sum(self.attn_decode(c) for c in s.decode_ctx) if self.attn_decode is not None else 0.0
            dec += self.n_gdn * gdn + self.n_attn * attn
        for name, n in (("zero_pages", s.zero_pages), ("zero_slots", s.zero_slots), ("restore", s.restores),
                        ("save", s.saves)):
            if n and name in self.copies:
                pre += self.copies[name](n)
        return pre, dec

    def overhead_us(self, s: StepShape) -> float:
        n = s.n_seqs
        us = self.fixed_us + self.per_seq_us * n + self.per_prefill_us * len(s.prefill)
        if s.decode_only:
            us += self.decode_fixed_us + (self.after_prefill_us if s.after_prefill else 0.0)
        for name, x in (("scheduler", n), ("batch_prep", n), ("engine_emit", s.n_sample)):
            f = self.overhead.get(name)
            if f is not None:
                us += f(x)
        return us

    def encoder_us(self, s: StepShape) -> float:
        """The vision encoder's runs in the step: each image priced by its patch count (image tokens x the merge
        unit). Timed as whole encoder calls, so it takes no compute scale (those calibrate the per-kernel tables
        to real steps). Images with a bundle that has no encoder table: an error, not a free encoder."""
        if not s.encoder_images:
            return 0.0
        if self.encoder is None:
            raise ValueError(f"{self.bundle.path}: the step encodes images but the bundle has no vision_encoder.csv "
                             "(profile a model with a vision tower)")
        return sum(self.encoder(n * self.patches_per_token) for n in s.encoder_images)

    def shape_us(self, s: StepShape, now: float = 0.0) -> float:
        if not s.n_seqs:
            return 0.0
        pre, dec = self.compute_parts(s)
        sp = self.decode_speed if s.decode_only else self.speed
        f = sp(now) if sp is not None else self.wall_per_cpu
        return f * (self.compute_scale * pre + self.compute_scale_decode * dec + self.overhead_us(s)
                    + self.encoder_us(s))

    def step_us(self, plan) -> float:
        return self.shape_us(StepShape.of(plan))


# ---------------------------------------------------------------------------------------------- per-step error
STEP_KINDS = ("prefill", "mixed", "decode")


def step_kind(s: StepShape) -> str:
    """prefill: prompt (or recompute) tokens only; decode: decode tokens only; mixed: both in one step."""
    return "decode" if s.decode_only else "mixed" if s.decode_ctx else "prefill"


def step_errors(model, steps) -> list[tuple[str, float]]:
    """(kind, (predicted - measured) / measured in %) per step. steps: (shape, measured us, clock at its start);
    model: anything with shape_us(shape, now), priced at the step's start as the simulator prices it. A step
    measured at 0 us is left out (no relative error)."""
    return [(step_kind(s), 100.0 * (model.shape_us(s, t) - us) / us) for s, us, t in steps if us > 0]


def error_summary(errors: list[tuple[str, float]]) -> dict[str, dict]:
    """Per step kind: steps, median and p90 of |error|, and the median signed error (the model's bias), in %."""
    out = {}
    for kind in STEP_KINDS:
        es = [e for k, e in errors if k == kind]
        if es:
            ab = [abs(e) for e in es]
            out[kind] = {"n": len(es), "median_abs_pct": percentile(ab, 50), "p90_abs_pct": percentile(ab, 90),
                         "median_pct": percentile(es, 50)}
    return out
