"""Measure this engine's step costs on this machine and write a profile bundle (deltaserve/sim/bundle.py).

The profiler builds a real LLMEngine (the same model loading, dtype, cache store and runner the server
uses) and times the pieces of a step inside real forwards of the model (Instrument runs them on a timed copy
of the model's op table, with forward hooks on its layers; every call records its self time, so the kernels of
a forward add up to the forward):

  prefill runs (one span of T tokens)   dense.csv: embedding + step context, layer norms, residual/layer glue,
                                        GDN in/out projections, GDN gated norm and glue, attention qkv/o
                                        projections, q/k norm + rotary, K/V writes, output gate, MLP (or MoE),
                                        final norm; linear_attention.csv prefill rows (conv, post-conv glue,
                                        chunked rule); attention.csv at prior context 0
  decode runs (D sequences, context c)  linear_attention.csv decode rows (conv step, recurrent step, gather /
                                        scatter glue); attention.csv decode rows; batch preparation per sequence
  mixed runs (a span + D decodes)       gdn_core_mixed rows: do the regimes add up?
  alone                                 lm head and sampler per sampled row; attention at longer prior contexts
                                        (scaled by the in-context / alone ratio at prior 0); copies (zeroing pages
                                        and slots, checkpoint restore and save); the torch-free scheduler's
                                        schedule() + update()
  calibration                           real engine.step()s of a calibration workload (plans captured), fitted:
                                        fixed + per sequence + per prefill span overhead and a compute scale, by
                                        least absolute deviations. Leaving the fixed per-step overhead out is
                                        what biases other simulators' TTFT low.

Times are medians of repeats. On a CPU with one torch thread they are the thread's CPU time (the machine may
be shared; wall time moves with everyone's load) and meta.calibration.wall_per_cpu records the contention seen
while calibrating; elsewhere wall time (CUDA: synchronized).
"""
from __future__ import annotations

import logging
import math
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from ..sim.bundle import FORMAT, save_meta, write_table

log = logging.getLogger("deltaserve.profile")


@dataclass
class Grid:
    tokens: list[int]  # prefill runs: one span of T tokens (dense kernels, GDN prefill, attention at prior 0)
    rows: list[int]  # sampled rows (lm head, sampler)
    gdn_decode: list[int]  # decode runs: D sequences ...
    decode_ctx: list[int]  # ... at these contexts (GDN decode kernels, decode attention)
    attn_q: list[int]  # prefill attention alone: q tokens ...
    attn_prior: list[int]  # ... after this much context
    copies: list[int]
    seqs: list[int]  # scheduler overhead
    mixed: list[tuple[int, int]]  # (prefill tokens, decodes) through one forward: additivity check
    repeats: int


def make_grid(quick: bool, max_tokens: int, max_seqs: int, max_context: int, repeats: int | None) -> Grid:
    cap = lambda xs, m: sorted({x for x in xs if x <= m} | {m})  # noqa: E731
    if quick:
        tokens = [1, 4, 16, 64, 256, 512, 1024, 2048]
        rows = [1, 4, 16, 64]
        gd = [1, 4, 16, 64]
        dctx = [128, 1024, 4096]
        prior = [0, 1024, 4096]
        copies = [1, 4, 16]
        seqs = [1, 4, 16, 64]
        mixed = [(256, 4)]
        reps = repeats or 3
    else:
        tokens = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 640, 768, 1024, 1280, 1536,
                  2048, 3072, 4096, 8192]
        rows = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256]
        gd = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256]
        dctx = [64, 256, 1024, 2048, 4096, 8192, 16384, 32768]
        prior = [0, 256, 1024, 2048, 4096, 8192, 16384]
        copies = [1, 2, 4, 8, 16, 32, 64]
        seqs = [1, 2, 4, 8, 16, 32, 64, 128, 256]
        mixed = [(64, 1), (256, 4), (512, 8), (1024, 16)]
        reps = repeats or 5
    toks = cap(tokens, max_tokens)
    aq = [t for t in toks if t in (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192) or t == max_tokens]
    dctx = [c for c in dctx if c <= max_context] or [max_context]
    return Grid(tokens=toks, rows=cap(rows, max(1, max_seqs)), gdn_decode=cap(gd, max_seqs), decode_ctx=dctx,
                attn_q=aq, attn_prior=[p for p in prior if p < max_context], copies=cap(copies, max_seqs),
                seqs=cap(seqs, max_seqs),
                mixed=[(p, d) for p, d in mixed if p <= max_tokens and d <= max_seqs] or [(min(64, max_tokens), 1)],
                repeats=reps)


def _stats(ts: list[float]) -> tuple[float, float, float]:
    s = sorted(ts)
    q = lambda p: s[min(len(s) - 1, max(0, round(p * (len(s) - 1))))]  # noqa: E731
    return statistics.median(s), q(0.1), q(0.9)


def _layers_to_time(n: int, tokens: int) -> int:
    """All layers while weight streaming matters (few tokens); a quarter (at least 2) when compute dominates."""
    if tokens <= 128 or n <= 2:
        return n
    return max(2, math.ceil(n / 4))


def load_avg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class Instrument:
    """Times the model's own forward kernel by kernel, without touching the model: forward() runs it on a timed
    copy of its op table (model/ops/table.py: every op the layers call), and torch forward hooks on the mixers
    and layers (registered for the `with` block, removed after) time what runs between the ops.

    Every op and frame records its self time (inclusive time minus timed callees), so the self times of one
    forward add up to the forward's total; a frame's self time is its glue. Each op of the table has its kernel
    name in OP_KERNELS; a table with an op missing there is refused, so a new or renamed op cannot hide its time
    in its caller's. Events are (kernel, key, microseconds).
    """

    def __init__(self, model, timer):
        if model.ops is None:
            model.select_decode_kernels()
        self.model, self.timer = model, timer
        self.stack: list[list] = []  # [frame, time of timed callees]
        self.events: list[tuple[str, object, float]] = []
        self._pending_gather = 0.0
        self.wmap: dict[int, str] = {}  # weight -> kernel (which projection a linear is)
        self.nmap: dict[int, str] = {id(model.norm): "final_norm"}  # norm weight -> kernel
        self.frames: dict[object, tuple[str, str | None]] = {}  # module -> (kernel, frame)
        for layer in model.layers:
            self.frames[layer] = ("layer", None)
            for n in ("input_layernorm", "post_attention_layernorm"):
                self.nmap[id(getattr(layer, n))] = "layer_norms"
            if layer.is_gdn:
                mx = layer.linear_attn
                self.frames[mx] = ("gdn_mixer", "gdn")
                self.wmap[id(getattr(mx, "in_proj"))] = "gdn_in_proj"
                self.wmap[id(getattr(mx, "out_proj"))] = "gdn_out_proj"
            else:
                am = layer.self_attn
                self.frames[am] = ("attn_mixer", "attn")
                self.wmap[id(getattr(am, "qkv_proj"))] = "attn_qkv_proj"
                self.wmap[id(getattr(am, "o_proj"))] = "attn_o_proj"
                self.nmap[id(am.q_norm)] = "attn_qk_norm_rope"
                self.nmap[id(am.k_norm)] = "attn_qk_norm_rope"
        missing = set(model.ops.names()) - set(self._rules())
        if missing:
            raise RuntimeError(f"the profiler has no kernel name for op(s) {sorted(missing)}: add them to "
                               f"Instrument._rules")
        self.ops = model.ops.wrapped(self._timed)
        self._hooks: list = []

    def _rules(self) -> dict[str, tuple]:
        """op name -> (kernel or kernel_of(args), key_of(args) or None, after or None)."""
        shape0 = lambda a: int(a[0].shape[0])  # noqa: E731

        def gather_after(us):  # a gather belongs to the attention call that reads it
            self._pending_gather += us
            return 0.0

        def attn_after(us):
            us, self._pending_gather = us + self._pending_gather, 0.0
            return us

        return {
            "linear": (lambda a: self.wmap.get(id(a[1]), "linear_other"), None, None),
            "rms_norm": (lambda a: self.nmap.get(id(a[1]), "layer_norms"), None, None),
            "add_rms_norm": (lambda a: self.nmap.get(id(a[2]), "layer_norms"), None, None),
            "rms_norm_gated": ("gdn_norm", None, None),
            "gdn_gates": ("gdn_glue", None, None),
            "gate_output": ("attn_gate", None, None),
            "swiglu": ("mlp", None, None),
            "moe": ("mlp", None, None),
            "qk_norm_rope": ("attn_qk_norm_rope", None, None),
            "kv_write": ("attn_kv_write", None, None),
            "kv_gather": ("attn_gather", None, gather_after),
            "prefill_attention": ("attn_prefill", lambda a: (int(a[0].shape[0]), int(a[3]) + int(a[0].shape[0])),
                                  attn_after),
            "decode_attention": ("attn_decode", lambda a: int(a[1].shape[0]), attn_after),
            "causal_conv1d_prefill": ("gdn_conv_prefill", shape0, None),
            "chunk_gated_delta_rule": ("gdn_prefill", shape0, None),
            "causal_conv1d_step": ("gdn_conv_decode", shape0, None),
            "recurrent_gated_delta_rule_step": ("gdn_decode", shape0, None),
            # the compiled decode kernels (ops/cpu_kernels.py): one call per layer for all decode sequences
            "paged_decode_attention": ("attn_decode", shape0, attn_after),
            "conv1d_decode_step": ("gdn_conv_decode", lambda a: int(a[1].shape[0]), None),
            "gdn_decode_step": ("gdn_decode", shape0, None),
        }

    def _timed(self, name: str, fn):
        kernel_of, key_of, after = self._rules()[name]
        timer, stack = self.timer, self.stack

        def op(*a, **k):
            t0 = timer()
            stack.append([None, 0.0])
            try:
                return fn(*a, **k)
            finally:
                incl = timer() - t0
                fr = stack.pop()
                if stack:
                    stack[-1][1] += incl
                us = (incl - fr[1]) * 1e6
                if after is not None:
                    us = after(us)
                kern = kernel_of(a) if callable(kernel_of) else kernel_of
                self.events.append((kern, key_of(a) if key_of else None, us))
        return op

    def _mixer(self) -> str | None:
        for fr in reversed(self.stack):
            if fr[0] in ("gdn", "attn"):
                return fr[0]
        return None

    # ---- frames: the model, its layers and mixers
    def _enter(self, frame: str | None) -> None:
        self.stack.append([frame, 0.0, self.timer()])

    def _leave(self, kernel: str) -> None:
        fr = self.stack.pop()
        incl = self.timer() - fr[2]
        if self.stack:
            self.stack[-1][1] += incl
        self.events.append((kernel, None, (incl - fr[1]) * 1e6))

    def forward(self, batch, caches):
        """The model's forward on the timed op table, inside the "model" frame (embedding + step context)."""
        self._enter(None)
        try:
            return self.model.forward(batch, caches, ops=self.ops)
        finally:
            self._leave("model")

    def __enter__(self):
        for module, (kernel, frame) in self.frames.items():
            self._hooks.append(module.register_forward_pre_hook(lambda m, args, f=frame: self._enter(f)))
            self._hooks.append(module.register_forward_hook(lambda m, args, out, k=kernel: self._leave(k)))
        return self

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.stack.clear()
        return False

    def take(self) -> list[tuple[str, object, float]]:
        ev, self.events = self.events, []
        return ev


def _median_events(runs: list[dict]) -> dict:
    keys = set().union(*runs)
    return {k: statistics.median(r.get(k, 0.0) for r in runs) for k in keys}


class Profiler:
    def __init__(self, engine, grid: Grid, progress: bool = True, timer: str = "auto"):
        self.engine = engine
        self.model = engine.model
        self.store = engine.store
        self.grid = grid
        self.progress = progress
        self.device = engine.device
        self.dtype = self.model.dtype
        self.cfg = self.model.config
        self.n_layers = len(self.model.layers)
        self.n_gdn = sum(1 for l in self.model.layers if l.is_gdn)
        self.n_attn = self.n_layers - self.n_gdn
        if timer == "auto":
            timer = "cpu" if self.device.type == "cpu" and torch.get_num_threads() == 1 else "wall"
        self.timer_name = timer
        if self.device.type == "cuda":
            def t():
                torch.cuda.synchronize()
                return time.perf_counter()
            self.timer = t
        else:
            self.timer = time.thread_time if timer == "cpu" else time.perf_counter
        self.rows: dict[str, list[dict]] = {k: [] for k in ("dense.csv", "attention.csv", "linear_attention.csv",
                                                            "copies.csv", "overhead.csv", "calibration.csv")}
        self.checks: dict[str, object] = {}
        self._bar = None
        self._gen = torch.Generator().manual_seed(0)
        bs = self.store.block_size
        self.bs = bs
        self.num_pages = engine.pool.num_pages
        self.num_slots = engine.pool.num_slots
        self._perm = torch.randperm(self.num_pages, generator=self._gen).tolist()

    # ------------------------------------------------------------------ helpers
    def _tick(self, what: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(what[:40], refresh=False)
            self._bar.update(1)

    def timeit(self, fn, reps=None, budget_s: float = 30.0):
        timer = self.timer
        reps = reps or self.grid.repeats
        fn()
        ts = []
        start = time.perf_counter()
        for i in range(reps):
            t = timer()
            fn()
            ts.append((timer() - t) * 1e6)
            if i >= 1 and time.perf_counter() - start > budget_s:
                break
        return _stats(ts)

    def num_items(self) -> int:
        g = self.grid
        return (len(g.tokens) + len(g.gdn_decode) * len(g.decode_ctx) + len(g.mixed) + len(g.rows)
                + len(g.attn_q) * len(g.attn_prior) + len(g.copies) + len(g.seqs))

    def work(self, spans: list[tuple[int, int, bool]]):
        """SeqWork for spans (n tokens, start position, is_decode): distinct slots (decode slots not consecutive,
        the engine's general gather path) and page tables drawn from a shuffled pool (distinct while they fit)."""
        from ..scheduler.plan import SeqWork

        out, cursor = [], 0
        nd = sum(1 for s in spans if s[2])
        for i, (n, pos, dec) in enumerate(spans):
            npg = -(-(pos + n) // self.bs)
            pages = tuple(self._perm[(cursor + j) % self.num_pages] for j in range(npg))
            cursor += npg
            slot = (self.num_slots - 1 - i) % self.num_slots if dec else i % self.num_slots
            toks = tuple(int(t) for t in torch.randint(10, min(self.cfg.vocab_size, 4000), (n,), generator=self._gen))
            out.append(SeqWork(f"p{i}", toks, pos, slot, pages, dec, True))
        del nd
        return out

    @torch.inference_mode()
    def forward_profile(self, work, reps: int | None = None) -> tuple[dict, float]:
        """Per (kernel, key): median self time (us) over instrumented forwards, scaled so their total matches the
        median un-instrumented forward; and that median (us)."""
        reps = reps or self.grid.repeats
        runner, model = self.engine.runner, self.model
        caches = self.store.caches()
        batch = runner.build_batch(work)
        plain = self.timeit(lambda: model.forward(batch, caches), reps=max(2, reps))[0]
        runs = []
        with Instrument(model, self.timer) as ins:
            ins.forward(batch, caches)
            ins.take()
            start = time.perf_counter()
            for i in range(reps):
                ins.forward(batch, caches)
                agg: dict = {}
                for k, key, us in ins.take():
                    agg[(k, key)] = agg.get((k, key), 0.0) + us
                runs.append(agg)
                if i >= 1 and time.perf_counter() - start > 30:
                    break
        med = _median_events(runs)
        total = sum(med.values())
        f = plain / total if total > 0 else 1.0
        return {k: v * f for k, v in med.items()}, plain

    @staticmethod
    def by_kernel(ev: dict) -> dict[str, float]:
        out: dict[str, float] = {}
        for (k, _), us in ev.items():
            out[k] = out.get(k, 0.0) + us
        return out

    def _dense_row(self, kernel, T, us, layers):
        self.rows["dense.csv"].append({"kernel": kernel, "tokens": T, "time_us": us / max(1, layers),
                                       "p10_us": "", "p90_us": "", "layers": layers})

    def _la_row(self, kernel, regime, L, D, us, layers, p10=None, p90=None):
        """us (and p10, p90): the time of all `layers` GDN layers together."""
        n = max(1, layers)
        self.rows["linear_attention.csv"].append({"kernel": kernel, "regime": regime, "prefill_tokens": L, "n_decode": D,
                                                  "time_us": us / n, "p10_us": "" if p10 is None else p10 / n,
                                                  "p90_us": "" if p90 is None else p90 / n, "layers": layers})

    # ------------------------------------------------------------------ prefill runs: dense, GDN prefill, attention
    def profile_prefill(self) -> None:
        nl, ng, na = self.n_layers, self.n_gdn, self.n_attn
        self.attn_incontext: dict[int, float] = {}
        self.attn_gate: dict[int, float] = {}
        self.embed: dict[int, float] = {}
        for T in self.grid.tokens:
            ev, total = self.forward_profile(self.work([(T, 0, False)]))
            k = self.by_kernel(ev)
            per_layer = {"layer_norms": nl, "residual": nl, "mlp": nl, "gdn_in_proj": ng, "gdn_glue": ng,
                         "gdn_norm": ng, "gdn_out_proj": ng, "attn_qkv_proj": na, "attn_qk_norm_rope": na,
                         "attn_kv_write": na, "attn_gate": na, "attn_o_proj": na}
            k["residual"] = k.pop("layer", 0.0)
            k["embed"] = k.pop("model", 0.0)
            k["attn_gate"] = k.get("attn_gate", 0.0) + k.pop("attn_mixer", 0.0)
            for name in ("embed", "final_norm"):
                self._dense_row(name, T, k.get(name, 0.0), 1)
            for name, n in per_layer.items():
                if n:
                    self._dense_row(name, T, k.get(name, 0.0), n)
            other = k.get("linear_other", 0.0) + k.get("glue", 0.0)
            if other:
                self._dense_row("other", T, other, 1)
            self.embed[T] = k["embed"]
            if ng:
                self._la_row("gdn_conv_prefill", "prefill", T, 0, k.get("gdn_conv_prefill", 0.0), ng)
                self._la_row("gdn_post_conv", "prefill", T, 0, k.get("gdn_mixer", 0.0), ng)
                self._la_row("gdn_prefill", "prefill", T, 0, k.get("gdn_prefill", 0.0), ng)
            if na:
                self.attn_incontext[T] = k.get("attn_prefill", 0.0) / na
                self.attn_gate[T] = k["attn_gate"] / na
            self.checks.setdefault("forward_us", {})[f"prefill{T}"] = round(total, 1)
            self._tick(f"prefill T={T}")

    # ------------------------------------------------------------------ decode runs: GDN decode, decode attention
    def profile_decode(self) -> None:
        from ..sim.latency import Interp1D

        ng, na = self.n_gdn, self.n_attn
        gate = Interp1D(self.attn_gate.items()) if self.attn_gate else None
        embed = Interp1D(self.embed.items())
        gdn: dict[str, dict[int, list[float]]] = {}
        attn: dict[int, list[float]] = {}
        prep: dict[int, list[float]] = {}
        for B in self.grid.gdn_decode:
            for c in self.grid.decode_ctx:
                work = self.work([(1, c - 1, True) for _ in range(B)])
                ev, total = self.forward_profile(work)
                k = self.by_kernel(ev)
                for name in ("gdn_conv_decode", "gdn_decode"):
                    gdn.setdefault(name, {}).setdefault(B, []).append(k.get(name, 0.0))
                gdn.setdefault("gdn_decode_glue", {}).setdefault(B, []).append(k.get("gdn_mixer", 0.0))
                if na:
                    # the mixer's glue beyond the output gate (priced per token from the prefill runs) is the
                    # decode path's own; noise can put the difference below zero, never the attention itself
                    extra = max(0.0, k.get("attn_mixer", 0.0) / na - (gate(B) if gate else 0.0))
                    attn.setdefault(c, []).append((k.get("attn_decode", 0.0) / na + extra) / B)
                bt = self.timeit(lambda: self.engine.runner.build_batch(work))[0]
                prep.setdefault(B, []).append(max(0.0, k.get("model", 0.0) - embed(B)) + bt)
                self._tick(f"decode B={B} c={c}")
        if ng:
            for name, d in gdn.items():
                for B, xs in sorted(d.items()):
                    self._la_row(name, "decode", 0, B, statistics.median(xs), ng, min(xs), max(xs))
        for c, xs in sorted(attn.items()):
            self.rows["attention.csv"].append({"kernel": "attn_decode", "query_tokens": 1, "context_len": c,
                                               "time_us": statistics.median(xs), "p10_us": min(xs), "p90_us": max(xs),
                                               "layers": na})
        for B, xs in sorted(prep.items()):
            self.rows["overhead.csv"].append({"component": "batch_prep", "n_seqs": B, "tokens": B,
                                              "time_us": statistics.median(xs), "p10_us": min(xs), "p90_us": max(xs)})

    # ------------------------------------------------------------------ mixed runs: do the regimes add up?
    def profile_mixed(self) -> None:
        if not self.n_gdn:
            return
        from ..sim.bundle import Bundle
        from ..sim.latency import LatencyModel, StepShape

        tmp = Bundle("<profiling>", {"layers": {"gdn": self.n_gdn, "attention": self.n_attn}}, {},
                     {k: v for k, v in self.rows.items()})
        lm = LatencyModel(tmp)
        checks = []
        for L, D in self.grid.mixed:
            c = self.grid.decode_ctx[0]
            work = self.work([(L, 0, False)] + [(1, c - 1, True) for _ in range(D)])
            ev, total = self.forward_profile(work)
            k = self.by_kernel(ev)
            core = sum(k.get(n, 0.0) for n in ("gdn_conv_prefill", "gdn_prefill", "gdn_conv_decode", "gdn_decode",
                                                "gdn_mixer"))
            self._la_row("gdn_core_mixed", "mixed", L, D, core, self.n_gdn)
            pred = lm.compute_us(StepShape([(L, 0)], [c] * D, 0)) + lm.overhead_us(StepShape([(L, 0)], [c] * D, 0))
            checks.append({"prefill": L, "decode": D, "forward_us": round(total, 1), "predicted_us": round(pred, 1)})
            self._tick(f"mixed L={L} D={D}")
        self.checks["mixed"] = checks

    # ------------------------------------------------------------------ the head and the sampler, per sampled row
    @torch.inference_mode()
    def profile_rows(self) -> None:
        from ..engine.sampler import SamplingState
        from ..engine.sampling_params import SamplingParams

        m, H = self.model, self.cfg.hidden_size
        sp = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
        eos = self.engine.tokenizer.eos_token_ids
        for R in self.grid.rows:
            hdn = (torch.randn(R, H, generator=self._gen)).to(self.dtype).to(self.device)
            st = self.timeit(lambda: m.compute_logits(hdn))
            self.rows["dense.csv"].append({"kernel": "lm_head", "tokens": R, "time_us": st[0], "p10_us": st[1],
                                           "p90_us": st[2], "layers": 1})
            logits = m.compute_logits(hdn)
            states = [SamplingState.create(sp, [1, 2, 3], eos_token_ids=eos, seed=i) for i in range(R)]
            rows_ = [logits[i] for i in range(R)]
            st = self.timeit(lambda: self.engine.sampler.sample(torch.stack(rows_), states))
            self.rows["dense.csv"].append({"kernel": "sampler", "tokens": R, "time_us": st[0], "p10_us": st[1],
                                           "p90_us": st[2], "layers": 1})
            self._tick(f"rows R={R}")

    # ------------------------------------------------------------------ attention at longer contexts
    @torch.inference_mode()
    def profile_attention_grid(self) -> None:
        """Prefill attention at (q, prior context) per layer: the kernels alone (page gather + the model's prefill
        attention op), scaled by the in-context / alone ratio measured at prior 0 in the prefill runs."""
        if not self.n_attn:
            return
        from ..model.ops.attention import kv_gather
        from ..sim.latency import Interp1D

        prefill_attention = self.model.ops.prefill_attention  # the op the model's prefill runs (untimed)
        am = next(l for l in self.model.layers if not l.is_gdn).self_attn
        kvs = self.store.kv
        max_ctx = self.num_pages * self.bs
        alone: dict[tuple[int, int], tuple] = {}
        for q in self.grid.attn_q:
            for prior in self.grid.attn_prior:
                ctx = prior + q
                if ctx > max_ctx:
                    self._tick("skip")
                    continue
                page_ids = torch.tensor(self._perm[:-(-ctx // self.bs)], dtype=torch.long, device=self.device)
                qt = (torch.randn(q, am.hq, am.d, generator=self._gen)).to(self.dtype).to(self.device)
                sel = kvs[:_layers_to_time(len(kvs), q)]

                def fn():
                    for kv in sel:
                        keys, values = kv_gather(kv, page_ids, ctx)
                        prefill_attention(qt, keys, values, prior, am.scale)
                st = self.timeit(fn)
                alone[(q, ctx)] = tuple(x / len(sel) for x in st)
                self._tick(f"attn q={q} c={ctx}")
        ratios = {q: self.attn_incontext[q] / alone[(q, q)][0] for q in self.grid.attn_q
                  if q in self.attn_incontext and (q, q) in alone and alone[(q, q)][0] > 0}
        ratio = Interp1D(ratios.items()) if ratios else (lambda q: 1.0)
        self.checks["attention_in_context_ratio"] = {q: round(r, 3) for q, r in ratios.items()}
        for (q, ctx), (med, p10, p90) in sorted(alone.items()):
            r = ratio(q)
            self.rows["attention.csv"].append({"kernel": "attn_prefill", "query_tokens": q, "context_len": ctx,
                                               "time_us": med * r, "p10_us": p10 * r, "p90_us": p90 * r,
                                               "layers": self.n_attn})

    # ------------------------------------------------------------------ copies
    @torch.inference_mode()
    def profile_copies(self) -> None:
        from ..scheduler.plan import StateCopy

        st = self.store
        pool = self.engine.pool
        nslots = pool.num_slots
        G = max(1, pool.num_gdn_groups * pool.pages_per_state)  # pages of one in-pool checkpoint

        def add(op, n, stats):
            self.rows["copies.csv"].append({"op": op, "count": n, "time_us": stats[0], "p10_us": stats[1],
                                            "p90_us": stats[2]})

        for n in self.grid.copies:
            pages = tuple(self._perm[:min(n, pool.num_pages)])
            add("zero_pages", n, self.timeit(lambda: st.zero_pages(pages)))
            slots = tuple(range(min(n, nslots)))
            add("zero_slots", n, self.timeit(lambda: st.zero_slots(slots)))
            if st.conv:
                if st.beside:
                    locs = [(p,) for p in self._perm[:min(n, pool.num_pages)]]
                else:
                    locs = [tuple(self._perm[i * G:(i + 1) * G]) for i in range(min(n, pool.num_pages // G))]
                cps = [StateCopy(i % nslots, loc) for i, loc in enumerate(locs)]
                add("restore", n, self.timeit(lambda: [st.restore(cp) for cp in cps]))
                add("save", n, self.timeit(lambda: [st.save(cp) for cp in cps]))
            self._tick(f"copies x{n}")
        st.zero_pages(tuple(range(pool.num_pages)))
        st.zero_slots(tuple(range(nslots)))

    # ------------------------------------------------------------------ the scheduler's own time
    def profile_scheduler(self) -> None:
        from ..scheduler import Request
        from ..scheduler.build import build_scheduler, resolve_shape

        eng = self.engine
        cfg = eng.config
        S = max(self.grid.seqs)
        pool = eng.pool
        ckpt = max(pool.checkpoint_pages, pool.num_gdn_groups)  # per-block takes no pool pages: keep the old margin
        kv = pool.slot_bytes * S + pool.bytes_per_page * (S * (4 + 2 * ckpt) + 64)
        shape = resolve_shape(eng.model_config, dtype=eng.dtype, block_size=cfg.block_size,
                              kv_cache_memory=max(kv, pool.total_bytes), max_num_seqs=S, cache_layout=cfg.cache_layout)
        rng = random.Random(0)
        for n in self.grid.seqs:
            mem, sch = build_scheduler(shape, max_num_seqs=max(n, 1), max_num_batched_tokens=max(4096, n),
                                       enable_prefix_caching=cfg.enable_prefix_caching)
            for i in range(n):
                sch.add(Request(f"r{i}", [rng.randrange(10, 4000) for _ in range(100 + i)], max_tokens=1000))
            for _ in range(3):  # prefill, then decodes
                p = sch.schedule()
                sch.update(p, {w.request_id: 11 for w in p.work if w.sample})
            ts = []
            for _ in range(max(5, self.grid.repeats * 2)):
                t = self.timer()
                p = sch.schedule()
                sch.update(p, {w.request_id: 11 for w in p.work if w.sample})
                ts.append((self.timer() - t) * 1e6)
            med, p10, p90 = _stats(ts)
            self.rows["overhead.csv"].append({"component": "scheduler", "n_seqs": n, "tokens": n, "time_us": med,
                                              "p10_us": p10, "p90_us": p90})
            self._tick(f"scheduler n={n}")

    # ------------------------------------------------------------------ everything
    def run_tables(self) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=self.num_items(), desc="profile", unit="shape", disable=not self.progress,
                         file=sys.stderr)
        try:
            self.profile_prefill()
            self.profile_decode()
            self.profile_rows()
            self.profile_attention_grid()
            self.profile_copies()
            self.profile_scheduler()
            self.profile_mixed()
        finally:
            self._bar.close()
            self._bar = None


# ---------------------------------------------------------------------------------------------- calibration
def calibration_workload(max_num_seqs: int, max_num_batched_tokens: int, block_size: int, quick: bool,
                         vocab: int, seed: int = 1) -> list[tuple[int, list[int], int]]:
    """(submit at step k, prompt ids, output tokens): prefills of several sizes, decode batches of several sizes,
    staggered arrivals that make mixed steps, and shared prefixes that make cache hits."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(10, min(vocab, 4000)) for _ in range(n)]  # noqa: E731
    M, S = max_num_batched_tokens, max_num_seqs
    items: list[tuple[int, list[int], int]] = []
    step = 0
    lens = [32, 200, M // 2, M, int(1.6 * M)] if quick else [16, 64, 200, M // 4, M // 2, 3 * M // 4, M, int(1.6 * M), 3 * M]
    for L in lens:  # prefill sizes, alone
        items.append((step, tok(max(8, L)), 2))
        step += 6 + L // max(1, M)
    bsz = sorted({1, 2, max(1, S // 2), S} if quick else {1, 2, 3, 4, max(1, S // 4), max(1, S // 2), S})
    for B in bsz:  # decode batches
        for _ in range(B):
            items.append((step, tok(rng.randint(16, 160)), 10 if quick else 16))
        step += 30
    for _ in range(min(S, 4)):  # decode at a longer context: attention's share of a decode step grows with it
        items.append((step, tok(M + rng.randint(0, M // 4)), 10 if quick else 16))
    step += 30
    sys_prompt = tok(2 * block_size + 17)
    for i in range(min(S, 6)):  # staggered arrivals: mixed steps; a shared prefix: hits and restores
        items.append((step + 3 * i, sys_prompt + tok(rng.randint(40, M // 2)), 12))
    return items


def run_calibration(engine, workload, progress: bool = True) -> list[dict]:
    """Run the workload through engine.step(), capturing each step's plan, wall time and thread CPU time."""
    from tqdm import tqdm

    from ..engine.sampling_params import SamplingParams
    from ..sim.latency import StepShape

    rows = []
    pending = sorted(workload, key=lambda x: x[0])
    k = 0
    step = 0
    bar = tqdm(total=len(pending), desc="calibrate", unit="req", disable=not progress, file=sys.stderr)
    while k < len(pending) or engine.has_unfinished_requests():
        if k < len(pending) and not engine.has_unfinished_requests():
            step = max(step, pending[k][0])  # idle: fast-forward to the next submission
        while k < len(pending) and pending[k][0] <= step:
            _, ids, n = pending[k]
            engine.add_request(f"cal-{k}-{time.monotonic_ns()}", ids,
                               SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
            k += 1
        c = time.thread_time()
        t = time.perf_counter()
        outs = engine.step()
        dt = (time.perf_counter() - t) * 1e6
        dc = (time.thread_time() - c) * 1e6
        step += 1
        plan = engine.last_plan
        bar.update(sum(1 for o in outs if o.finished))
        if plan.is_empty():
            continue
        s = StepShape.of(plan, after_prefill=bool(rows) and bool(rows[-1]["_shape"].prefill))
        rows.append({"step": step, "n_seqs": s.n_seqs, "n_prefill": len(s.prefill),
                     "prefill_tokens": sum(n for n, _ in s.prefill), "n_decode": len(s.decode_ctx),
                     "context_tokens": sum(s.decode_ctx) + sum(n + p for n, p in s.prefill), "n_sample": s.n_sample,
                     "copies": s.zero_slots + s.restores + s.saves, "measured_us": dt, "cpu_us": dc, "_shape": s})
    bar.close()
    return rows


def _lad(X, y, iters: int = 60):
    """Least absolute deviations by iteratively reweighted least squares."""
    import numpy as np

    w = np.ones_like(y)
    beta = None
    floor = 1e-3 * max(1.0, float(np.median(np.abs(y))))
    for _ in range(iters):
        sw = np.sqrt(w)
        beta, *_ = np.linalg.lstsq(X * sw[:, None], y * sw, rcond=None)
        w = 1.0 / np.maximum(np.abs(y - X @ beta), floor)
    return beta


def fit_calibration(rows: list[dict], model, timer: str = "cpu") -> dict:
    """The step time the tables do not explain.

    With the CPU timer: cpu = scale * compute + tables' overhead + fixed + per_seq * N + per_prefill * P
    (+ decode_fixed on decode-only steps, + after_prefill on a decode-only step right after a prefill), fitted
    on the thread CPU time of real steps (load-independent), and wall_per_cpu = total wall / total CPU time of
    those steps (how much of a core this process got while calibrating: the machine's contention). With the wall
    timer the same fit runs on wall time and wall_per_cpu is 1. Least absolute deviations: the noise of a shared
    machine has a long right tail."""
    import numpy as np

    if len(rows) < 4:
        return {"fixed_us": 0.0, "per_seq_us": 0.0, "per_prefill_us": 0.0, "compute_scale": 1.0, "wall_per_cpu": 1.0,
                "steps": len(rows), "timer": timer}
    key = "cpu_us" if timer == "cpu" else "measured_us"
    parts = np.array([model.compute_parts(r["_shape"]) for r in rows])  # [steps, 2]: prefill, decode parts
    comp, comp_d = parts[:, 0], parts[:, 1]
    base = np.array([model.overhead_us(r["_shape"]) for r in rows])
    n = np.array([r["_shape"].n_seqs for r in rows], dtype=float)
    p = np.array([len(r["_shape"].prefill) for r in rows], dtype=float)
    meas = np.array([r[key] for r in rows])
    y = meas - base
    # features: compute scales (the prefill and the decode parts of the tables), fixed, per sequence, per prefill
    # span; the overheads must not be negative and a scale must stay plausible (a negative overhead or a wild scale
    # is noise being fitted): drop it (a scale then stays 1) and refit
    dec_only = np.array([r["_shape"].decode_only for r in rows], dtype=float)
    cold = dec_only * np.array([r["_shape"].after_prefill for r in rows], dtype=float)
    # decode_fixed may be negative (the tables carry the per-op timers' cost, which a decode step's ~100 small
    # ops make visible) but not by more than half a decode step
    dec_bound = 0.5 * float(np.median(meas[dec_only > 0])) if dec_only.any() else 0.0
    scales = {"scale": comp, "scale_decode": comp_d}
    # no all-steps "fixed" term: nested with decode_fixed it made the fit flip between runs (fixed +1 ms and
    # decode_fixed -1.5 ms, or both dropped); per_prefill carries a prefill step's fixed cost instead
    feats = {**scales, "per_seq": n, "per_prefill": p, "decode_fixed": dec_only, "after_prefill": cold}
    active = [f for f in feats if (f != "scale_decode" or comp_d.any()) and (f not in ("decode_fixed", "after_prefill")
                                                                             or feats[f].sum() >= 3)]

    def implausible(f: str, c: float) -> bool:
        if f in scales:
            return not 0.8 <= c <= 1.25
        if f == "decode_fixed":
            return abs(c) > dec_bound
        return c < 0

    coef: dict[str, float] = {}
    while active:
        fixed_part = sum(v for f, v in scales.items() if f not in active)
        beta = _lad(np.stack([feats[f] for f in active], 1), y - fixed_part)
        coef = dict(zip(active, (float(b) for b in beta)))
        bad = [f for f in active if implausible(f, coef[f])]
        if not bad:
            break
        active.remove(min(bad, key=lambda f: coef[f] if f not in scales else -1e18))
    scale, scale_d = coef.get("scale", 1.0), coef.get("scale_decode", 1.0)
    fixed, per_seq, per_pre = coef.get("fixed", 0.0), coef.get("per_seq", 0.0), coef.get("per_prefill", 0.0)
    dec_fixed, after_pre = coef.get("decode_fixed", 0.0), coef.get("after_prefill", 0.0)
    pred = (scale * comp + scale_d * comp_d + base + fixed + per_seq * n + per_pre * p + dec_fixed * dec_only
            + after_pre * cold)
    wall = np.array([r["measured_us"] for r in rows])
    cpu = np.array([r["cpu_us"] for r in rows])
    wpc = float(wall.sum() / cpu.sum()) if timer == "cpu" and cpu.sum() > 0 else 1.0
    for r_, pr in zip(rows, pred):
        r_["predicted_us"] = float(pr * wpc)
    rel = np.abs(pred - meas) / meas
    return {"timer": timer, "fixed_us": round(fixed, 2), "per_seq_us": round(per_seq, 2),
            "per_prefill_us": round(per_pre, 2), "compute_scale": round(scale, 4),
            "compute_scale_decode": round(scale_d, 4), "decode_fixed_us": round(dec_fixed, 2),
            "after_prefill_us": round(after_pre, 2), "wall_per_cpu": round(wpc, 4),
            "steps": len(rows), "median_abs_error_pct": round(100 * float(np.median(rel)), 2),
            "total_error_pct": round(100 * float((pred.sum() - meas.sum()) / meas.sum()), 2),
            "uncalibrated_total_error_pct": round(100 * float(((comp + comp_d + base).sum() - meas.sum()) / meas.sum()), 2)}


# ---------------------------------------------------------------------------------------------- the bundle
def write_bundle(out: str, engine, prof: Profiler | None, meta_extra: dict) -> None:
    import json

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
    from ..config import ConfigError
    from ..memory.sizing import ENGINE_KERNEL_ALIGNMENT, engine_block_size, geometry

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


def profile(engine, out: str, *, quick: bool = False, repeats: int | None = None, max_tokens: int | None = None,
            max_context: int | None = None, calibrate: bool = True, progress: bool = True,
            source: str = "") -> dict:
    """Profile `engine` (an LLMEngine) into the bundle directory `out`; returns meta."""
    from .. import __version__ as ds_version
    from ..sim.bundle import load_bundle
    from ..sim.latency import LatencyModel

    cfg = engine.config
    mc = engine.model_config
    max_tokens = max_tokens or cfg.max_num_batched_tokens
    pool_ctx = engine.pool.num_pages * engine.block_size
    max_context = min(max_context or (4096 if quick else 16384), pool_ctx)
    grid = make_grid(quick, max_tokens, cfg.max_num_seqs, max_context, repeats)
    load0 = load_avg()
    t0 = time.time()
    prof = Profiler(engine, grid, progress=progress)
    prof.run_tables()
    threads = torch.get_num_threads()
    meta = {
        "format": FORMAT,
        "model": {"name": engine.model_name, "source": source, "model_type": mc.model_type,
                  "num_hidden_layers": mc.num_hidden_layers, "vocab_size": mc.vocab_size},
        "layers": {"gdn": len(mc.gdn_layers), "attention": len(mc.attn_layers), "total": mc.num_hidden_layers},
        "hardware": {"device": str(engine.device), "name": (torch.cuda.get_device_name(engine.device)
                                                           if engine.device.type == "cuda" else cpu_model()),
                     "cpu_count": os.cpu_count(), "torch_threads": threads, "platform": platform.platform()},
        "dtypes": {"model": engine.dtype, "kv": engine.dtype, "conv": engine.dtype, "ssm": "float32"},
        "versions": {"deltaserve": ds_version, "torch": str(torch.__version__), "python": platform.python_version()},
        "engine_resolved": {"per_tp": engine_resolved_per_tp(mc, engine.dtype, cfg.block_size, cfg.cache_layout)},
        "engine": {"block_size_flag": cfg.block_size, "max_num_seqs": cfg.max_num_seqs,
                   "max_num_batched_tokens": cfg.max_num_batched_tokens, "kv_cache_memory": engine.pool.total_bytes,
                   "cache_layout": cfg.cache_layout, "enable_prefix_caching": cfg.enable_prefix_caching},
        "profile": {"quick": quick, "repeats": grid.repeats, "max_tokens": max_tokens, "max_context": max_context,
                    "statistic": "median", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "load_avg_start": load0, "timer": prof.timer_name},
        "calibration": {},
    }
    assert meta["engine_resolved"]["per_tp"][1]["block_size"] == engine.block_size, "block size rule drifted"
    write_bundle(out, engine, prof, meta)
    if calibrate:
        # a first pass warms every shape up (oneDNN builds a primitive per new shape; first calls cost more), the
        # second (other tokens, the same kinds of steps) is measured
        for seed in (1, 2):
            work = calibration_workload(cfg.max_num_seqs, cfg.max_num_batched_tokens, engine.block_size, quick,
                                        mc.vocab_size, seed=seed)
            rows = run_calibration(engine, work, progress=progress)
        model = LatencyModel(load_bundle(out))
        meta["calibration"] = fit_calibration(rows, model, prof.timer_name)
        prof.rows["calibration.csv"] = rows
    meta["checks"] = prof.checks
    meta["profile"]["load_avg_end"] = load_avg()
    meta["profile"]["wall_s"] = round(time.time() - t0, 1)
    write_bundle(out, engine, prof, meta)
    return meta
