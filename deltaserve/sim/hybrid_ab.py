"""`deltaserve simulate hybrid-ab`: closed-loop agent sessions on a hybrid (GDN + attention) model, cache layouts A/B,
on OUR scheduler and memory manager priced by another engine's GPU tables (sim/external_hybrid.py), side by side
with figures measured on real hardware. No torch.

A scenario is a SessionSpec (sim/sessions.py), the engine's batch limits and two or more arms; an arm is a cache
arrangement at a pool size:

  off        prefix caching off (every turn recomputes its whole prompt)
  in-page    GDN checkpoints in pool pages owned by GDN groups (memory/layouts.py InPage), at the bundle's recorded
             block size (the foreign engine's kernel alignment, 16 on CUDA: 784 tokens on Qwen3.8-27B)
  per-block  a state tensor beside the pool holds the checkpoints (PerBlock): the pool holds fewer tokens
  runs       this engine's own layout: 64-token pages on its 64-token GDN grid, a checkpoint spans several pages

An arm's pool is given in tokens (the figure the real engine logged at start-up) or as "the bytes of another arm"
(runs takes in-page's bytes), less `state_blocks_per_seq` blocks per sequence where the measured engine kept its
running sequences' GDN states in pool blocks (vLLM's align mode: the state being written and the last checkpoint,
2 blocks per GDN group; this engine keeps live states in slots beside the pool); `pool_bytes` turns tokens into the
kv_cache_memory that yields that many whole pages after the live GDN slots, so every arm is built by the engine's own
builders (scheduler/build.py resolve_shape + build_scheduler) with the engine's defaults for everything else.
Invariant: arms of one scenario differ only in layout, caching, block alignment and pool size; the workload, the
batch limits and the latency model are shared.

Measured figures come with each scenario (`Measured`): the real A/B's wall time, later-turn TTFT and what it logged
of its pools; the table prints the simulated ratios next to them and flags a ratio more than 25% off.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass, field, replace

from ..config import EngineConfig, ModelConfig, resolve_dtype
from ..errors import ConfigError
from ..memory.sizing import ENGINE_KERNEL_ALIGNMENT, KERNEL_ALIGNMENTS, engine_block_size, geometry, size_pool
from ..presets import load_preset
from ..scheduler.build import build_scheduler, resolve_shape
from .external_hybrid import HybridBundle, HybridLatency
from .sessions import SessionRun, SessionSpec, run_sessions

DEFAULT_BUNDLE = os.path.join(os.path.dirname(__file__), "tables", "qwen3.8-27b")  # shipped with the package
ARM_KINDS = ("off", "in-page", "per-block", "runs")
TOLERANCE = 0.25  # a simulated ratio within 25% of the measured one reproduces it


@dataclass(frozen=True)
class Arm:
    """One cache arrangement. pool_tokens: the pool the real engine logged; same_bytes_as: or the budget of that
    arm of the scenario (exactly one of the two). state_blocks_per_seq: blocks of the logged pool each running
    sequence's GDN states took in the measured engine, held back here for every seat (max_num_seqs).
    measured_as: the measured arm this one stands for (default its name)."""

    name: str
    kind: str
    pool_tokens: int | None = None
    same_bytes_as: str | None = None
    state_blocks_per_seq: int = 0
    measured_as: str | None = None

    def __post_init__(self):
        if self.kind not in ARM_KINDS:
            raise ConfigError(f"arm {self.name}: kind must be one of {', '.join(ARM_KINDS)}, not {self.kind!r}")
        if (self.pool_tokens is None) == (self.same_bytes_as is None):
            raise ConfigError(f"arm {self.name}: give pool_tokens or same_bytes_as, not both or neither")
        if self.state_blocks_per_seq < 0 or (self.state_blocks_per_seq and self.pool_tokens is None):
            raise ConfigError(f"arm {self.name}: state_blocks_per_seq needs pool_tokens and must be >= 0")

    @property
    def measured(self) -> str:
        return self.measured_as or self.name

    @property
    def caching(self) -> bool:
        return self.kind != "off"

    @property
    def layout(self) -> str:
        return "in-page" if self.kind == "off" else self.kind

    @property
    def alignment(self) -> int:
        """The smallest kernel block the arm's pages derive from: this engine's grid for runs, else the foreign
        engine's (CUDA 16), so in-page / per-block / off pages are the bundle's recorded block."""
        return ENGINE_KERNEL_ALIGNMENT if self.kind == "runs" else KERNEL_ALIGNMENTS["cuda"]


@dataclass(frozen=True)
class Measured:
    """What the real A/B measured, arm by arm (None where it reported nothing)."""

    source: str
    wall_s: dict = field(default_factory=dict)
    later_ttft_mean_s: dict = field(default_factory=dict)
    later_ttft_p90_s: dict = field(default_factory=dict)
    decode_tok_s: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Scenario:
    name: str
    model: str  # the real run's model (the tables are the bundle's)
    spec: SessionSpec
    arms: tuple[Arm, ...]
    baseline: str  # the measured arm the ratios divide (the slow one): every arm measured as it, over every other
    max_num_seqs: int
    max_num_batched_tokens: int = 1024
    measured: Measured | None = None

    def __post_init__(self):
        names = [a.name for a in self.arms]
        if len(set(names)) != len(names) or self.baseline not in [a.measured for a in self.arms]:
            raise ConfigError(f"scenario {self.name}: arm names must be unique and include {self.baseline!r}")
        for a in self.arms:
            if a.same_bytes_as is not None and a.same_bytes_as not in names:
                raise ConfigError(f"scenario {self.name}: {a.name} takes the bytes of unknown arm {a.same_bytes_as}")


# The real A/Bs (one Gaudi 2 per replica, 256K context, synthetic agent sessions: shared system prompt and tools,
# ~3K new tokens and 200 output tokens per turn, 4 sequences and 1024-token batches on Qwen3.8-27B). Pools are the
# start-up logs' token counts.
SESSIONS_64K = SessionSpec(sessions=4, start_tokens=8192, end_tokens=65536, shared_tokens=4096, new_tokens=3072,
                           output_tokens=200)
SCENARIOS = (
    Scenario("caching-4", "Qwen3.8-27B, util 0.60", SESSIONS_64K,
             (Arm("off", "off", pool_tokens=291_369), Arm("in-page", "in-page", pool_tokens=288_446),
              Arm("runs", "runs", same_bytes_as="in-page")),
             baseline="off", max_num_seqs=4,
             measured=Measured("same-pod A/B, caching off vs on", wall_s={"off": 1214, "in-page": 281},
                               later_ttft_mean_s={"off": 19.8, "in-page": 2.6},
                               later_ttft_p90_s={"off": 31.6, "in-page": 4.2},
                               decode_tok_s={"off": 7.5, "in-page": 18.0})),
    Scenario("layout-8", "Qwen3.5-27B-FP8, util 0.85", replace(SESSIONS_64K, sessions=8),
             (Arm("per-block", "per-block", pool_tokens=332_282),
              Arm("per-block, state blocks", "per-block", pool_tokens=332_282, state_blocks_per_seq=6,
                  measured_as="per-block"),
              Arm("in-page", "in-page", pool_tokens=623_359), Arm("runs", "runs", same_bytes_as="in-page")),
             baseline="per-block", max_num_seqs=8,
             measured=Measured("same-node A/B, same time", wall_s={"per-block": 1886, "in-page": 414},
                               later_ttft_mean_s={"per-block": 48.9, "in-page": 2.65})),
    Scenario("layout-4", "Qwen3.5-27B-FP8, util 0.85", SESSIONS_64K,
             (Arm("per-block", "per-block", pool_tokens=332_282),
              Arm("per-block, state blocks", "per-block", pool_tokens=332_282, state_blocks_per_seq=6,
                  measured_as="per-block"),
              Arm("in-page", "in-page", pool_tokens=623_359), Arm("runs", "runs", same_bytes_as="in-page")),
             baseline="per-block", max_num_seqs=4,
             measured=Measured("same-node A/B", wall_s={"per-block": 251, "in-page": 254})),
)


def model_config() -> ModelConfig:
    """The 27B hybrid geometry (the bundle's Qwen3.8-27B config equals the qwen3.5-27b preset's text config)."""
    return ModelConfig.from_hf(load_preset("qwen3.5-27b"))


def pool_bytes(mc: ModelConfig, arm: Arm, tokens: int, max_num_seqs: int) -> int:
    """The kv_cache_memory whose pool, in this arm's layout, holds round(tokens / block) whole pages after the
    max_num_seqs live GDN slots, less the arm's state blocks for every seat."""
    dt = resolve_dtype("auto", mc)
    geom = geometry(mc, kv_dtype=dt, conv_dtype=dt, ssm_dtype="float32")  # as resolve_shape derives it
    block = engine_block_size(geom, EngineConfig().block_size, arm.layout, kernel_alignment=arm.alignment)
    p = size_pool(geom, 0, block, max_num_seqs, arm.layout)  # no pages: the per-page and per-slot costs
    pages = max(2, round(tokens / p.block_size) - max_num_seqs * arm.state_blocks_per_seq)
    return p.num_slots * p.slot_bytes + pages * p.bytes_per_page


@dataclass(frozen=True)
class ScaledLatency:
    """A what-if for another machine's balance of prefill and decode: steps that compute prompt tokens cost
    `prefill` x the tables' price, decode-only steps `decode` x (1.0, 1.0: the tables as they are)."""

    latency: HybridLatency
    prefill: float = 1.0
    decode: float = 1.0

    def step_us(self, plan) -> float:
        us = self.latency.step_us(plan)
        return us * (self.decode if all(w.is_decode for w in plan.work) else self.prefill)


@dataclass
class ArmResult:
    arm: Arm
    block_size: int
    pool_tokens: int
    kv_bytes: int
    run: SessionRun

    @property
    def later_ttft(self) -> list[float]:
        return self.run.later_ttft()


def _p90(xs: list[float]) -> float:
    if not xs:
        return 0.0
    ys = sorted(xs)
    return ys[min(len(ys) - 1, round(0.9 * (len(ys) - 1)))]


def run_scenario(sc: Scenario, latency: HybridLatency | ScaledLatency,
                 mc: ModelConfig | None = None) -> dict[str, ArmResult]:
    """Every arm of the scenario on a fresh scheduler; results by arm name."""
    mc = mc or model_config()
    defaults = EngineConfig()
    budgets: dict[str, int] = {}
    for a in sorted(sc.arms, key=lambda a: a.same_bytes_as is not None):  # arms with their own pool first
        budgets[a.name] = (pool_bytes(mc, a, a.pool_tokens, sc.max_num_seqs) if a.pool_tokens is not None
                           else budgets[a.same_bytes_as])
    out = {}
    for a in sc.arms:
        shape = resolve_shape(mc, kv_cache_memory=budgets[a.name], max_num_seqs=sc.max_num_seqs,
                              cache_layout=a.layout, enable_prefix_caching=a.caching, kernel_alignment=a.alignment,
                              max_model_len=sc.spec.end_tokens)
        _, sched = build_scheduler(shape, max_num_seqs=sc.max_num_seqs,
                                   max_num_batched_tokens=sc.max_num_batched_tokens, enable_prefix_caching=a.caching,
                                   prefill_merge_tokens=defaults.prefill_merge_tokens,
                                   checkpoint_grid=defaults.checkpoint_grid if a.caching else 0,
                                   reprefill_outputs=defaults.reprefill_outputs and a.caching,
                                   reprefill_job_tokens=defaults.reprefill_job_tokens, eviction=defaults.eviction)
        run = run_sessions(sched, latency.step_us, sc.spec)
        out[a.name] = ArmResult(a, shape.block_size, shape.pool.pool_tokens, budgets[a.name], run)
    return out


def _ratio(x, y):
    return x / y if x and y else None


def _fmt(x, nd=1, suffix=""):
    return "-" if x is None else f"{x:,.{nd}f}{suffix}"


def scenario_table(sc: Scenario, res: dict[str, ArmResult]) -> str:
    """Markdown: the arms side by side with the measured figures, then the ratios against the baseline arm."""
    m = sc.measured or Measured("")
    lines = [(f"### {sc.name}: {sc.spec.sessions} sessions {sc.spec.start_tokens // 1024}K -> "
              f"{sc.spec.end_tokens // 1024}K ({sc.spec.turns} turns), max_num_seqs {sc.max_num_seqs}, "
              f"{sc.max_num_batched_tokens}-token batches; measured: {sc.model}, {m.source}"), "",
             ("| arm | block | pool tokens (measured) | wall s (measured) | later TTFT mean s (measured) | p90 s "
              "(measured) | decode tok/s/stream (measured) | hit rate | preemptions | evictions | steps |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in res.items():
        tt = r.later_ttft
        c = r.run.counters
        mp, ms = r.arm.pool_tokens, r.arm.measured
        logged = (f"{mp:,}" + (f" less {r.arm.state_blocks_per_seq} blocks a seat" if r.arm.state_blocks_per_seq
                               else "")) if mp else f"same bytes as {r.arm.same_bytes_as}"
        lines.append(
            f"| {name} | {r.block_size} | {r.pool_tokens:,} ({logged}) "
            f"| {r.run.wall_s:,.0f} ({_fmt(m.wall_s.get(ms), 0)}) "
            f"| {_fmt(statistics.mean(tt) if tt else None, 2)} ({_fmt(m.later_ttft_mean_s.get(ms), 2)}) "
            f"| {_fmt(_p90(tt), 2)} ({_fmt(m.later_ttft_p90_s.get(ms), 2)}) "
            f"| {_fmt(r.run.decode_rate(sc.spec.output_tokens), 1)} ({_fmt(m.decode_tok_s.get(ms), 1)}) "
            f"| {100 * r.run.hit_rate():.1f}% | {c.get('preemptions', 0)} | {c.get('evictions', 0)} "
            f"| {r.run.steps:,} |")
    lines += ["", "| ratio | sim wall | measured wall | diff | sim later TTFT | measured later TTFT | diff |",
              "|---|---|---|---|---|---|---|"]
    for bname, base in res.items():
        if base.arm.measured != sc.baseline:
            continue
        for name, r in res.items():
            if r.arm.measured == sc.baseline:
                continue
            sw = _ratio(base.run.wall_s, r.run.wall_s)
            mw = _ratio(m.wall_s.get(sc.baseline), m.wall_s.get(r.arm.measured))
            bt, rt = base.later_ttft, r.later_ttft
            st = _ratio(statistics.mean(bt) if bt else None, statistics.mean(rt) if rt else None)
            mt = _ratio(m.later_ttft_mean_s.get(sc.baseline), m.later_ttft_mean_s.get(r.arm.measured))
            lines.append(f"| {bname} / {name} | {_fmt(sw, 2, 'x')} | {_fmt(mw, 2, 'x')} | {_flag(sw, mw)} "
                         f"| {_fmt(st, 2, 'x')} | {_fmt(mt, 2, 'x')} | {_flag(st, mt)} |")
    return "\n".join(lines)


def _flag(sim, measured) -> str:
    if sim is None or measured is None:
        return "-"
    d = sim / measured - 1
    return f"{100 * d:+.0f}%" + (" **>25%**" if abs(d) > TOLERANCE else "")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deltaserve simulate hybrid-ab",
                                description="closed-loop agent sessions on a GDN hybrid, cache layouts A/B on this "
                                            "engine's scheduler, priced by LLMServingSim's Qwen3.8-27B tables; "
                                            "printed beside the real A/Bs' figures")
    p.add_argument("--bundle", default=DEFAULT_BUNDLE,
                   help="a qwen3_5 bundle directory (meta.yaml, tp1/); default: the trimmed excerpt in "
                        "deltaserve/sim/tables/qwen3.8-27b")
    p.add_argument("--scenario", action="append", choices=[s.name for s in SCENARIOS],
                   help="run only these (repeatable); default: all")
    p.add_argument("--step-scale", default=None, metavar="PREFILL,DECODE",
                   help="a what-if: multiply steps with prompt tokens by PREFILL and decode-only steps by DECODE "
                        "(another machine's balance of the two; default 1,1)")
    p.add_argument("--sessions-end", type=int, default=None, help="override every scenario's end_tokens (quick runs)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    bundle = HybridBundle(a.bundle)
    mc = model_config()
    lat = HybridLatency(bundle, len(mc.attn_layers), len(mc.gdn_layers))
    if a.step_scale:
        try:
            pf, dc = (float(x) for x in a.step_scale.split(","))
        except ValueError:
            raise ConfigError(f"--step-scale takes PREFILL,DECODE, not {a.step_scale!r}") from None
        lat = ScaledLatency(lat, pf, dc)
        print(f"steps with prompt tokens x{pf:g}, decode-only steps x{dc:g}")
    print(f"bundle {os.path.normpath(a.bundle)}: {bundle.meta.get('model')} on {bundle.meta.get('gpu')}, vLLM "
          f"{bundle.meta.get('vllm_version')}, recorded block {bundle.block_size}")
    for sc in SCENARIOS:
        if a.scenario and sc.name not in a.scenario:
            continue
        if a.sessions_end:
            sc = replace(sc, spec=replace(sc.spec, end_tokens=a.sessions_end))
        t0 = time.perf_counter()
        res = run_scenario(sc, lat, mc)
        print()
        print(scenario_table(sc, res))
        print(f"\n({time.perf_counter() - t0:.1f} s to simulate)")
    return 0
