"""`deltaserve simulate external`: our scheduler on an LLMServingSim bundle against what the real engine measured.

    deltaserve simulate external --bundle DIR --model-config FILE --trace FILE --measured FILE
        [--cluster-config FILE] [--reference-summary FILE] [--output CSV]
        [--max-num-seqs N --max-num-batched-tokens N --block-size N --memory-utilization F
         --device-memory BYTES --tp N --link-bandwidth GB/s --link-latency us --no-async-scheduling]

DIR is their profiler/perf/<hw>/<model>/<dtype>; FILE their config.json (the model), workload JSONL,
requests.jsonl (what vLLM measured per request) and, optionally, their cluster config.json (GPU memory, its
utilization, TP, link bandwidth and latency, read where the flags do not say) and validation/summary.txt (their
simulator's own error, printed beside ours). The measured run's definitions, request by request:

    TTFT    = first_token_ts - queued_ts
    TPOT    = (last_token_ts - first_token_ts) / (output_toks - 1)
    latency = last_token_ts - queued_ts

and the simulator's the same from its arrival (the trace's time), first and last token. No torch.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
import sys
import time
from dataclasses import dataclass

from ..config import ConfigError, EngineConfig, add_engine_args, engine_args, parse_bytes
from .external import Comm, ExternalBundle, ExternalLatency
from .external_replay import (
    ExternalRequest,
    ForeignEngine,
    dense_model_config,
    dense_weight_bytes,
    dtype_bytes_of,
    kv_all_ranks,
    read_workload,
    replay,
    vllm_kv_bytes,
)
from .report import RequestRecord, mean, percentile

METRICS = ("ttft", "tpot", "latency")
LABELS = {"ttft": "TTFT", "tpot": "TPOT", "latency": "Latency"}
STATS = (("Mean", None), ("Median", 50), ("P90", 90), ("P95", 95), ("P99", 99))
GIB = 1 << 30
# vLLM's defaults, for what neither the flags, the cluster config nor the measured run's meta.json says
# (prefix caching: off, as the published runs state; vLLM V1 itself defaults to on)
VLLM_DEFAULTS = {"max_num_seqs": 256, "max_num_batched_tokens": 2048, "block_size": 16, "memory_utilization": 0.9,
                 "enable_prefix_caching": False}
ENGINE_FLAGS = ("max_num_seqs", "max_num_batched_tokens", "block_size", "memory_utilization", "kv_cache_memory",
                "enable_prefix_caching")


@dataclass(frozen=True)
class Timing:
    """One request's three figures in seconds (TPOT None for a single output token)."""

    ttft: float
    tpot: float | None
    latency: float


def measured_timing(d: dict) -> Timing:
    """The measured run's definitions (vLLM's RequestStateStats, engine-core monotonic clock)."""
    q, first, last, n = d["queued_ts"], d["first_token_ts"], d["last_token_ts"], int(d["output_toks"])
    return Timing(first - q, (last - first) / (n - 1) if n > 1 else None, last - q)


def simulated_timing(r: RequestRecord) -> Timing | None:
    if r.first_token is None or r.finish is None:
        return None
    n = r.output_tokens
    return Timing(r.first_token - r.arrival, (r.finish - r.first_token) / (n - 1) if n > 1 else None,
                  r.finish - r.arrival)


def read_measured(path: str, reqs: list[ExternalRequest]) -> list[Timing]:
    """requests.jsonl in trace order (line i is trace request i; lengths must agree)."""
    rows = []
    with open(path) as f:
        for i, line in enumerate(f):
            if line.strip():
                d = json.loads(line)
                for k in ("input_toks", "output_toks", "queued_ts", "first_token_ts", "last_token_ts"):
                    if k not in d:
                        raise ConfigError(f"{path}:{i + 1}: no {k!r}")
                rows.append(d)
    if len(rows) < len(reqs):
        raise ConfigError(f"{path}: {len(rows)} measured requests for {len(reqs)} in the trace")
    for r, d in zip(reqs, rows):
        if (int(d["input_toks"]), int(d["output_toks"])) != (len(r.prompt), r.output_length):
            raise ConfigError(f"{path}: request {r.index} measured {d['input_toks']} + {d['output_toks']} tokens, "
                              f"the trace has {len(r.prompt)} + {r.output_length}")
    return [measured_timing(d) for d in rows[:len(reqs)]]


def stat(xs: list[float], p: int | None) -> float:
    return mean(xs) if p is None else percentile(xs, p)


def compare(real: list[Timing], sim: list[Timing | None]) -> dict:
    """{metric: {stat: (real, sim, diff %)}} over the requests both sides finished, plus per-request errors."""
    pairs = [(a, b) for a, b in zip(real, sim) if b is not None]
    out: dict = {"requests": len(real), "compared": len(pairs)}
    for m in METRICS:
        ab = [(getattr(a, m), getattr(b, m)) for a, b in pairs]
        ab = [(x, y) for x, y in ab if x is not None and y is not None]
        ra, sa = [x for x, _ in ab], [y for _, y in ab]
        rows = {}
        for name, p in STATS:
            x, y = stat(ra, p), stat(sa, p)
            rows[name] = (x, y, 100.0 * (y - x) / x if x else float("nan"))
        rel = sorted(abs(b - a) / a for a, b in ab if a > 0)
        rows["per-request |err| median %"] = 100.0 * percentile(rel, 50) if rel else float("nan")
        out[m] = rows
    return out


_LINE = re.compile(r"^(TTFT|TPOT|Latency)\s+(Mean|Median|P\d+)\s+([-\d.]+)\s+([-\d.]+)\s+([-+\d.]+)%\s*$")


def read_reference_summary(path: str) -> dict:
    """Their validation/summary.txt: {(metric, stat): (vllm_ms, sim_ms, diff %)}."""
    out = {}
    with open(path) as f:
        for line in f:
            m = _LINE.match(line.strip())
            if m:
                out[(m.group(1).lower(), m.group(2))] = (float(m.group(3)), float(m.group(4)), float(m.group(5)))
    if not out:
        raise ConfigError(f"{path}: no 'TTFT Mean  vLLM  Sim  Diff%' lines")
    return out


def table(cmp: dict, reference: dict | None = None) -> str:
    """Their summary.txt's layout (ms), with LLMServingSim's diff beside ours when given."""
    head = f"{'Metric':<22}{'vLLM':>12}{'sim':>12}{'Diff%':>9}"
    if reference:
        head += f"{'LLMServingSim':>15}{'Diff%':>9}"
    lines = [head, "-" * len(head)]
    for m in METRICS:
        for name, _ in STATS:
            x, y, d = cmp[m][name]
            row = f"{LABELS[m] + ' ' + name:<22}{1e3 * x:>12.1f}{1e3 * y:>12.1f}{d:>+8.1f}%"
            ref = (reference or {}).get((m, name))
            if reference:
                row += f"{ref[1]:>15.1f}{ref[2]:>+8.1f}%" if ref else f"{'-':>15}{'':>9}"
            lines.append(row)
        lines.append(f"  per-request |sim - vLLM| / vLLM, median: {cmp[m]['per-request |err| median %']:.1f}%")
        lines.append("")
    return "\n".join(lines).rstrip()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deltaserve simulate external",
                                description="replay a real engine's run (an LLMServingSim example) on deltaserve's "
                                            "scheduler with that GPU's profiled tables; compare request by request")
    p.add_argument("--bundle", required=True, help="their profiler/perf/<hw>/<model>/<dtype> (meta.yaml, tp<N>/)")
    p.add_argument("--model-config", required=True, help="the model's config.json")
    p.add_argument("--trace", required=True, help="their workload JSONL (input_toks, output_toks, arrival_time_ns)")
    p.add_argument("--measured", required=True, help="requests.jsonl the real engine wrote (queued_ts, ...)")
    p.add_argument("--cluster-config", help="their cluster config.json (npu_mem size GiB / util, tp_size, link_bw "
                                            "GB/s, link_latency ns), read where the flags below do not say")
    p.add_argument("--reference-summary", help="their validation/summary.txt, shown beside")
    p.add_argument("--output", help="per-request CSV: measured and simulated TTFT, TPOT, latency")
    p.add_argument("--num-reqs", type=int, help="only the first N requests")
    p.add_argument("--device-memory", type=parse_bytes,
                   help="device memory in bytes (e.g. 96GiB); default: the cluster config's")
    p.add_argument("--tp", type=int, help="tensor-parallel degree (default: the cluster config's, else 1)")
    p.add_argument("--link-bandwidth", type=float, help="GB/s per link for TP all-reduces")
    p.add_argument("--link-latency", type=float, help="microseconds per ring hop")
    p.add_argument("--reserved-memory", type=parse_bytes, default=0,
                   help="bytes vLLM's profiling run keeps from the KV cache (activations, graphs); default 0")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="emulate vLLM's async scheduling (plan one step ahead; default: on, as recent vLLM V1)")
    p.add_argument("--no-skew", action="store_true", help="price decodes at their mean context only")
    p.add_argument("--quiet", action="store_true")
    add_engine_args(p, ENGINE_FLAGS, title="the replayed engine's flags (where not given: the cluster config's "
                                          "mem_util, the meta.json beside --measured (engine_kwargs), else vLLM's "
                                          "defaults 256 / 2048 / 16 / 0.9; the defaults shown are deltaserve's)")
    return p


def run_settings(measured: str) -> dict:
    """The measured run's engine flags from the meta.json beside its requests.jsonl (engine_kwargs), if any."""
    path = os.path.join(os.path.dirname(os.path.abspath(measured)), "meta.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        kw = (json.load(f).get("engine_kwargs") or {})
    out = {k: int(kw[k]) for k in ("max_num_seqs", "max_num_batched_tokens", "block_size") if kw.get(k) is not None}
    if kw.get("gpu_memory_utilization") is not None:
        out["memory_utilization"] = float(kw["gpu_memory_utilization"])
    if kw.get("enable_prefix_caching") is not None:
        out["enable_prefix_caching"] = bool(kw["enable_prefix_caching"])
    return out


def util_of(npu_mem: dict) -> dict:
    return {"memory_utilization": float(npu_mem["mem_util"])} if "mem_util" in npu_mem else {}


def _cluster_instance(path: str | None) -> tuple[dict, dict]:
    if not path:
        return {}, {}
    with open(path) as f:
        c = json.load(f)
    insts = [i for n in c.get("nodes", []) for i in n.get("instances", [])]
    if len(insts) != 1:
        raise ConfigError(f"{path}: {len(insts)} instances; the external replay simulates one")
    return c, insts[0]


@dataclass
class Setup:
    """Everything `run` derives from the arguments before it simulates."""

    model: object  # ModelConfig
    latency: ExternalLatency
    foreign: ForeignEngine
    shape: object  # scheduler.build.EngineShape
    scheduler: object
    kv_bytes: int
    weight_bytes: int
    tp: int


def setup(a: argparse.Namespace) -> Setup:
    """The replayed engine's flags (flags > cluster config > the measured run's meta.json > vLLM's defaults), the
    model, the latency model and our scheduler with the foreign engine's rules."""
    cluster, inst = _cluster_instance(a.cluster_config)
    mem = inst.get("npu_mem") or {}
    eng = EngineConfig.from_kwargs(**{**VLLM_DEFAULTS, **run_settings(a.measured), **util_of(mem), **engine_args(a)})
    tp = a.tp or int(inst.get("tp_size", 1))
    with open(a.model_config) as f:
        mc = dense_model_config(json.load(f))
    bundle = ExternalBundle(a.bundle, tp)
    if bundle.architecture and bundle.architecture != mc.model_type:
        raise ConfigError(f"the bundle profiles a {bundle.architecture!r} model, the config is {mc.model_type!r}")
    nbytes = dtype_bytes_of(mc)
    bw = a.link_bandwidth if a.link_bandwidth is not None else cluster.get("link_bw", 0.0)  # GB/s
    lat = a.link_latency * 1e-6 if a.link_latency is not None else cluster.get("link_latency", 0.0) * 1e-9  # s
    latency = ExternalLatency(bundle, mc.num_hidden_layers, mc.hidden_size, mc.vocab_size, nbytes,
                              Comm(tp, float(bw) * 1e9, float(lat)), skew=not a.no_skew)
    weights = dense_weight_bytes(mc, nbytes, tp)
    if eng.kv_cache_memory:
        kv = eng.kv_cache_memory
    else:
        device = a.device_memory or (int(float(mem["mem_size"]) * GIB) if "mem_size" in mem else None)
        if not device:
            raise ConfigError("give --device-memory, --kv-cache-memory or a --cluster-config with npu_mem.mem_size")
        kv = kv_all_ranks(mc, vllm_kv_bytes(device, eng.memory_utilization, weights, a.reserved_memory), tp)
    foreign = ForeignEngine(eng.max_num_seqs, eng.max_num_batched_tokens, eng.block_size,
                            enable_prefix_caching=eng.enable_prefix_caching, async_scheduling=a.async_scheduling)
    shape, sched = foreign.build(mc, kv, mc.dtype)
    return Setup(mc, latency, foreign, shape, sched, kv, weights, tp)


def write_per_request(path: str, reqs: list[ExternalRequest], real: list[Timing], sim: list[Timing | None]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["index", "arrival", "prompt_tokens", "output_tokens"]
                   + [f"{side}_{m}" for m in METRICS for side in ("real", "sim")])
        for r, x, y in zip(reqs, real, sim):
            vals = [v for m in METRICS for v in (getattr(x, m), getattr(y, m) if y else None)]
            w.writerow([r.index, f"{r.arrival:.9f}", len(r.prompt), r.output_length]
                       + ["" if v is None else f"{v:.9f}" for v in vals])


def run(a: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    s = setup(a)
    reqs = read_workload(a.trace, a.num_reqs)
    real = read_measured(a.measured, reqs)
    f = s.foreign
    if not a.quiet:
        print(f"{len(reqs)} requests; {s.model.num_hidden_layers} layers, TP {s.tp}; weights "
              f"{s.weight_bytes / GIB:.2f} GiB, KV {s.kv_bytes / GIB:.2f} GiB = {s.shape.pool.num_pages:,} blocks of "
              f"{s.shape.block_size} tokens; max_num_seqs {f.max_num_seqs}, max_num_batched_tokens "
              f"{f.max_num_batched_tokens}, prefix caching {'on' if f.enable_prefix_caching else 'off'}, async "
              f"scheduling {'on' if f.async_scheduling else 'off'}",
              file=sys.stderr, flush=True)
    recs, st = replay(s.scheduler, s.latency, reqs, f.async_scheduling, progress=not a.quiet)
    sim = [simulated_timing(r) for r in recs]
    cmp = compare(real, sim)
    print(table(cmp, read_reference_summary(a.reference_summary) if a.reference_summary else None))
    print(f"\n{cmp['compared']}/{cmp['requests']} requests compared; {st['steps']} steps ({st['mixed_steps']} mixed, "
          f"{st['multi_prefill_steps']} with several prefills), busy {st['busy_s']:.2f} s; peak KV "
          f"{st['peak_kv_pages']:,}/{s.shape.pool.num_pages:,} blocks; {st['preemptions']} preemptions; "
          f"{time.perf_counter() - t0:.1f} s")
    if a.output:
        write_per_request(a.output, reqs, real, sim)
    return 0 if cmp["compared"] == cmp["requests"] else 1


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))
