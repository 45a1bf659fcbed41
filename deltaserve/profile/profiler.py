"""Profiler: what every phase times through. The engine's model and cache store, the timer, the work of a
forward (SeqWork for spans), the instrumented forward and the rows of the bundle's tables as the phases fill them.

Times are medians of repeats. On a CPU with one torch thread they are the thread's CPU time (the machine may
be shared; wall time moves with everyone's load); elsewhere wall time (CUDA: synchronized).
"""
from __future__ import annotations

import statistics
import time

import torch

from ..scheduler.plan import SeqWork
from .instrument import Instrument


def stats(ts: list[float]) -> tuple[float, float, float]:
    """(median, p10, p90) of timings."""
    s = sorted(ts)
    q = lambda p: s[min(len(s) - 1, max(0, round(p * (len(s) - 1))))]  # noqa: E731
    return statistics.median(s), q(0.1), q(0.9)


def _median_events(runs: list[dict]) -> dict:
    keys = set().union(*runs)
    return {k: statistics.median(r.get(k, 0.0) for r in runs) for k in keys}


class Profiler:
    """grid: the shapes to time (only its `repeats` where the caller times a forward of its own). rows: table
    name -> the rows the phases appended; checks: what meta.checks reports."""

    def __init__(self, engine, grid, progress: bool = True, timer: str = "auto"):
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
        self.bar = None  # the progress bar while the phases run (run.py)
        self.gen = torch.Generator().manual_seed(0)  # every random input of the phases, drawn in their order
        bs = self.store.block_size
        self.bs = bs
        self.num_pages = engine.pool.num_pages
        self.num_slots = engine.pool.num_slots
        self.perm = torch.randperm(self.num_pages, generator=self.gen).tolist()

    # ------------------------------------------------------------------ timing
    def tick(self, what: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(what[:40], refresh=False)
            self.bar.update(1)

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
        return stats(ts)

    def work(self, spans: list[tuple[int, int, bool]]):
        """SeqWork for spans (n tokens, start position, is_decode): distinct slots (decode slots not consecutive,
        the engine's general gather path) and page tables drawn from a shuffled pool (distinct while they fit)."""
        out, cursor = [], 0
        for i, (n, pos, dec) in enumerate(spans):
            npg = -(-(pos + n) // self.bs)
            pages = tuple(self.perm[(cursor + j) % self.num_pages] for j in range(npg))
            cursor += npg
            slot = (self.num_slots - 1 - i) % self.num_slots if dec else i % self.num_slots
            toks = tuple(int(t) for t in torch.randint(10, min(self.cfg.vocab_size, 4000), (n,), generator=self.gen))
            out.append(SeqWork(f"p{i}", toks, pos, slot, pages, dec, True))
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

    # ------------------------------------------------------------------ rows
    def dense_row(self, kernel, T, us, layers):
        self.rows["dense.csv"].append({"kernel": kernel, "tokens": T, "time_us": us / max(1, layers),
                                       "p10_us": "", "p90_us": "", "layers": layers})

    def la_row(self, kernel, regime, L, D, us, layers, p10=None, p90=None):
        """us (and p10, p90): the time of all `layers` GDN layers together."""
        n = max(1, layers)
        self.rows["linear_attention.csv"].append({"kernel": kernel, "regime": regime, "prefill_tokens": L,
                                                  "n_decode": D, "time_us": us / n,
                                                  "p10_us": "" if p10 is None else p10 / n,
                                                  "p90_us": "" if p90 is None else p90 / n, "layers": layers})
