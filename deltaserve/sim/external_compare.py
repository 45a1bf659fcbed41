"""`deltaserve simulate external`: our scheduler on an LLMServingSim bundle against what the real engine measured.

    deltaserve simulate external --example DIR | --all ROOT      (their bench/examples/<hw>/<model>, or all of them)
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
from ..memory.sizing import geometry
from .external import VLLM_CUSTOM_ALL_REDUCE_BYTES, Comm, Experts, ExternalBundle, ExternalLatency
from .external_replay import (
    ExternalRequest,
    ForeignEngine,
    decoder_model_config,
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
    p.add_argument("--example", help="one of their examples, bench/examples/<hw>/<model> (config.json, vllm/, "
                                     "validation/): every file below is found from it")
    p.add_argument("--all", metavar="ROOT", help="every example under ROOT/bench/examples: one table of errors")
    p.add_argument("--bundle", help="their profiler/perf/<hw>/<model>/<dtype> (meta.yaml, tp<N>/)")
    p.add_argument("--model-config", help="the model's config.json")
    p.add_argument("--trace", help="their workload JSONL (input_toks, output_toks, arrival_time_ns)")
    p.add_argument("--measured", help="requests.jsonl the real engine wrote (queued_ts, ...)")
    p.add_argument("--cluster-config", help="their cluster config.json (npu_mem size GiB / util, tp_size, link_bw "
                                            "GB/s, link_latency ns), read where the flags below do not say")
    p.add_argument("--reference-summary", help="their validation/summary.txt, shown beside")
    p.add_argument("--output", help="per-request CSV: measured and simulated TTFT, TPOT, latency")
    p.add_argument("--num-reqs", type=int, help="only the first N requests")
    p.add_argument("--device-memory", type=parse_bytes,
                   help="device memory in bytes (e.g. 96GiB); default: the cluster config's")
    p.add_argument("--tp", type=int, help="tensor-parallel degree (default: the cluster config's, else 1)")
    p.add_argument("--link-bandwidth", type=float, help="GB/s per link for TP and EP collectives (GB = 2^30 bytes, "
                                                      "as their cluster config's link_bw)")
    p.add_argument("--link-latency", type=float, help="microseconds per ring hop")
    p.add_argument("--reserved-memory", type=parse_bytes, default=0,
                   help="bytes vLLM's profiling run keeps from the KV cache (activations, graphs); default 0")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="emulate vLLM's async scheduling (plan one step ahead; default: the run's resolved config, "
                        "else on, as recent vLLM V1)")
    p.add_argument("--no-skew", action="store_true", help="price decodes at their mean context only")
    p.add_argument("--quiet", action="store_true")
    add_engine_args(p, ENGINE_FLAGS, title="the replayed engine's flags (where not given: the cluster config's "
                                          "mem_util, the meta.json beside --measured (engine_kwargs), else vLLM's "
                                          "defaults 256 / 2048 / 16 / 0.9; the defaults shown are deltaserve's)")
    return p


def run_meta(measured: str) -> dict:
    """The meta.json beside the measured requests.jsonl ({} when there is none)."""
    path = os.path.join(os.path.dirname(os.path.abspath(measured)), "meta.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def run_settings(measured: str) -> dict:
    """The measured run's engine flags from the meta.json beside its requests.jsonl: engine_kwargs, then what vLLM
    resolved and reported (kv_cache: block size, prefix caching), if any."""
    meta = run_meta(measured)
    kw = meta.get("engine_kwargs") or {}
    kv = meta.get("kv_cache") or {}
    out = {k: int(kw[k]) for k in ("max_num_seqs", "max_num_batched_tokens", "block_size") if kw.get(k) is not None}
    if kv.get("block_size") is not None:
        out["block_size"] = int(kv["block_size"])
    if kw.get("gpu_memory_utilization") is not None:
        out["memory_utilization"] = float(kw["gpu_memory_utilization"])
    for src in (kw, kv):
        if src.get("enable_prefix_caching") is not None:
            out["enable_prefix_caching"] = bool(src["enable_prefix_caching"])
    return out


def reported_blocks(measured: str) -> int | None:
    """The KV blocks vLLM reported for the run (meta.json kv_cache.num_gpu_blocks), if it did."""
    n = (run_meta(measured).get("kv_cache") or {}).get("num_gpu_blocks")
    return int(n) if n else None


def util_of(npu_mem: dict) -> dict:
    return {"memory_utilization": float(npu_mem["mem_util"])} if "mem_util" in npu_mem else {}


def _cluster_instances(path: str | None) -> tuple[dict, list[dict]]:
    """Their cluster config and its instances: one, or the identical members of one data-parallel group."""
    if not path:
        return {}, [{}]
    with open(path) as f:
        c = json.load(f)
    insts = [i for n in c.get("nodes", []) for i in n.get("instances", [])]
    if not insts:
        raise ConfigError(f"{path}: no instances")
    if len(insts) > 1:
        groups = {i.get("dp_group") for i in insts}
        if len(groups) != 1 or None in groups:
            raise ConfigError(f"{path}: {len(insts)} instances that are not one data-parallel group (dp_group); the "
                              f"external replay simulates one engine")
        keys = ("model_name", "hardware", "npu_mem", "num_npus", "tp_size", "ep_size")
        if any(tuple(i.get(k) for k in keys) != tuple(insts[0].get(k) for k in keys) for i in insts):
            raise ConfigError(f"{path}: the members of its data-parallel group differ")
    return c, insts


@dataclass
class Setup:
    """Everything `run` derives from the arguments before it simulates."""

    model: object  # ModelConfig
    latency: ExternalLatency
    foreign: ForeignEngine
    shape: object  # scheduler.build.EngineShape
    schedulers: list  # one per data-parallel rank
    kv_bytes: int
    weight_bytes: int
    tp: int
    dp: int = 1
    ep: int = 1
    pool_source: str = "computed"

    @property
    def scheduler(self):
        return self.schedulers[0]


def pool_bytes(mc, blocks: int, block_size: int) -> int:
    """The TP-1 KV bytes that hold `blocks` blocks (the pool is sized on the TP-1 geometry)."""
    g = geometry(mc, "bfloat16", "bfloat16", "float32")
    return blocks * block_size * g.kv_bytes_per_token


def setup(a: argparse.Namespace) -> Setup:
    """The replayed engine's flags (flags > cluster config > the measured run's meta.json > vLLM's defaults), the
    model, the latency model and our scheduler(s) with the foreign engine's rules.

    The pool: vLLM's own count when the run reports it (meta.json kv_cache.num_gpu_blocks, less the one null
    block vLLM keeps out of use), else device memory x utilization - weights."""
    cluster, insts = _cluster_instances(a.cluster_config)
    inst = insts[0]
    mem = inst.get("npu_mem") or {}
    eng = EngineConfig.from_kwargs(**{**VLLM_DEFAULTS, **run_settings(a.measured), **util_of(mem), **engine_args(a)})
    tp = a.tp or int(inst.get("tp_size", 1))
    dp, ep = len(insts), int(inst.get("ep_size", 1))
    with open(a.model_config) as f:
        mc = decoder_model_config(json.load(f))
    if ep > 1 and (not mc.num_experts or ep != dp * tp):
        raise ConfigError(f"ep_size {ep}: expert parallelism spans the data-parallel group's ranks (dp {dp} x tp "
                          f"{tp}) of a MoE model")
    bundle = ExternalBundle(a.bundle, tp)
    if bundle.architecture and bundle.architecture != mc.model_type:
        raise ConfigError(f"the bundle profiles a {bundle.architecture!r} model, the config is {mc.model_type!r}")
    nbytes = dtype_bytes_of(mc)
    # link_bw in ASTRA-sim's analytical units, GB/s of 2^30 bytes (its bw_GBps_to_Bpns); link_latency in ns
    bw = (a.link_bandwidth if a.link_bandwidth is not None else cluster.get("link_bw", 0.0)) * GIB / 1e9  # GB/s
    lat = a.link_latency * 1e-6 if a.link_latency is not None else cluster.get("link_latency", 0.0) * 1e-9  # s
    experts = Experts(mc.num_experts, mc.num_experts_per_tok, ep, dp) if mc.num_experts else None
    latency = ExternalLatency(bundle, mc.num_hidden_layers, mc.hidden_size, mc.vocab_size, nbytes,
                              Comm(tp, float(bw) * 1e9, float(lat), VLLM_CUSTOM_ALL_REDUCE_BYTES), skew=not a.no_skew, arch=mc.model_type,
                              experts=experts, ep_comm=Comm(ep, float(bw) * 1e9, float(lat)))
    weights = dense_weight_bytes(mc, nbytes, tp, ep)
    blocks = reported_blocks(a.measured)
    source = "computed"
    if eng.kv_cache_memory:
        kv, source = eng.kv_cache_memory, "--kv-cache-memory"
    elif blocks and not a.device_memory:
        kv, source = pool_bytes(mc, blocks - 1, eng.block_size), f"vLLM's {blocks:,} blocks less its null block"
    else:
        device = a.device_memory or (int(float(mem["mem_size"]) * GIB) if "mem_size" in mem else None)
        if not device:
            raise ConfigError("give --device-memory, --kv-cache-memory or a --cluster-config with npu_mem.mem_size")
        kv = kv_all_ranks(mc, vllm_kv_bytes(device, eng.memory_utilization, weights, a.reserved_memory), tp)
    resolved_config = run_meta(a.measured).get("resolved_config") or {}
    resolved = resolved_config.get("scheduler_config") or {}
    async_on = a.async_scheduling if a.async_scheduling is not None else resolved.get("async_scheduling", True)
    # vLLM's default largest CUDA graph: min(2 x max_num_seqs, 512) tokens
    graphs = (resolved_config.get("compilation_config") or {}).get("max_cudagraph_capture_size") or \
        min(2 * eng.max_num_seqs, 512)
    foreign = ForeignEngine(eng.max_num_seqs, eng.max_num_batched_tokens, eng.block_size,
                            enable_prefix_caching=eng.enable_prefix_caching, async_scheduling=bool(async_on),
                            reserve_full_isl=bool(resolved.get("scheduler_reserve_full_isl", True)),
                            max_cudagraph_tokens=int(graphs))
    built = [foreign.build(mc, kv, mc.dtype) for _ in range(dp)]
    return Setup(mc, latency, foreign, built[0][0], [b[1] for b in built], kv, weights, tp, dp, ep, source)


def write_per_request(path: str, reqs: list[ExternalRequest], real: list[Timing], sim: list[Timing | None]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["index", "arrival", "prompt_tokens", "output_tokens"]
                   + [f"{side}_{m}" for m in METRICS for side in ("real", "sim")])
        for r, x, y in zip(reqs, real, sim):
            vals = [v for m in METRICS for v in (getattr(x, m), getattr(y, m) if y else None)]
            w.writerow([r.index, f"{r.arrival:.9f}", len(r.prompt), r.output_length]
                       + ["" if v is None else f"{v:.9f}" for v in vals])


VARIANTS = {"bfloat16": "bf16", "float16": "fp16", "auto": "bf16"}  # engine_kwargs.dtype -> their bundle variant


def _root_of(example: str) -> str:
    """The checkout an example lies in: the nearest parent with profiler/perf and configs/model."""
    d = os.path.abspath(example)
    while True:
        if os.path.isdir(os.path.join(d, "profiler", "perf")) and os.path.isdir(os.path.join(d, "configs", "model")):
            return d
        up = os.path.dirname(d)
        if up == d:
            raise ConfigError(f"{example}: no parent directory holds profiler/perf and configs/model (an "
                              f"LLMServingSim checkout)")
        d = up


def example_files(example: str) -> dict:
    """An example's files, as the flags name them: its config.json (cluster), vllm/requests.jsonl (measured),
    validation/summary.txt (their simulator's error, when present); from the checkout: the bundle
    profiler/perf/<hardware>/<model_name>/<variant>, configs/model/<model_name>.json and the workload meta.json's
    dataset_path names (None when that file is absent: the trace is then read from requests.jsonl)."""
    cfg = os.path.join(example, "config.json")
    measured = os.path.join(example, "vllm", "requests.jsonl")
    for f in (cfg, measured):
        if not os.path.exists(f):
            raise ConfigError(f"{example}: no {os.path.relpath(f, example)} (an example has config.json and "
                              f"vllm/requests.jsonl)")
    root = _root_of(example)
    _, insts = _cluster_instances(cfg)
    name, hw = insts[0].get("model_name"), insts[0].get("hardware")
    if not name or not hw:
        raise ConfigError(f"{cfg}: its instances name no model_name / hardware")
    meta = run_meta(measured)
    dtype = str((meta.get("engine_kwargs") or {}).get("dtype") or "bfloat16").replace("torch.", "")
    trace = os.path.join(root, meta["dataset_path"]) if meta.get("dataset_path") else None
    summary = os.path.join(example, "validation", "summary.txt")
    return {"bundle": os.path.join(root, "profiler", "perf", hw, name, VARIANTS.get(dtype, dtype)),
            "model_config": os.path.join(root, "configs", "model", f"{name}.json"),
            "trace": trace if trace and os.path.exists(trace) else None, "measured": measured,
            "cluster_config": cfg, "reference_summary": summary if os.path.exists(summary) else None}


def workload_of_measured(path: str, limit: int | None = None) -> list[ExternalRequest]:
    """The trace from requests.jsonl itself, when the workload file is not at hand: arrivals from arrival_time
    (wall seconds, from the first), lengths from input_toks / output_toks. No token ids: each request gets tokens
    of its own, so nothing hits the prefix cache (the real run's ShareGPT prompts sometimes share prefixes)."""
    out = []
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    t0 = min(float(d["arrival_time"]) for d in rows)
    base = 1
    for d in rows[:limit]:
        n, m = int(d["input_toks"]), int(d["output_toks"])
        out.append(ExternalRequest(len(out), float(d["arrival_time"]) - t0, tuple(range(base, base + n)), m))
        base += n
    return out


def with_example(a: argparse.Namespace) -> argparse.Namespace:
    """a with the files of --example filled in where the flags do not name them."""
    if not a.example:
        missing = [f"--{k.replace('_', '-')}" for k in ("bundle", "model_config", "measured") if not getattr(a, k)]
        if missing or not a.trace:
            raise ConfigError(f"give --example DIR, --all ROOT, or {', '.join(missing + ['--trace'] * (not a.trace))}")
        return a
    files = example_files(a.example)
    return argparse.Namespace(**{**vars(a), **{k: getattr(a, k, None) or v for k, v in files.items()}})


def simulate(a: argparse.Namespace) -> tuple[Setup, list[ExternalRequest], list[Timing], list, dict, dict]:
    """(setup, requests, measured, simulated, step stats, comparison) of one run."""
    s = setup(a)
    reqs = read_workload(a.trace, a.num_reqs) if a.trace else workload_of_measured(a.measured, a.num_reqs)
    real = read_measured(a.measured, reqs)
    f = s.foreign
    if not a.quiet:
        print(f"{len(reqs)} requests; {s.model.num_hidden_layers} layers, TP {s.tp}, DP {s.dp}, EP {s.ep}; weights "
              f"{s.weight_bytes / GIB:.2f} GiB/rank, KV {s.kv_bytes / GIB:.2f} GiB = {s.shape.pool.num_pages:,} blocks "
              f"of {s.shape.block_size} tokens per DP rank ({s.pool_source}); max_num_seqs {f.max_num_seqs}, "
              f"max_num_batched_tokens {f.max_num_batched_tokens}, prefix caching "
              f"{'on' if f.enable_prefix_caching else 'off'}, async scheduling {'on' if f.async_scheduling else 'off'}"
              f"{'' if a.trace else '; trace from requests.jsonl (no token ids)'}",
              file=sys.stderr, flush=True)
    recs, st = replay(s.schedulers, s.latency, reqs, f.async_scheduling, progress=not a.quiet,
                      dp_pad_tokens=f.max_cudagraph_tokens)
    sim = [simulated_timing(r) for r in recs]
    return s, reqs, real, sim, st, compare(real, sim)


def run(a: argparse.Namespace) -> int:
    if a.all:
        return run_all(a)
    t0 = time.perf_counter()
    a = with_example(a)
    s, reqs, real, sim, st, cmp = simulate(a)
    print(table(cmp, read_reference_summary(a.reference_summary) if a.reference_summary else None))
    print(f"\n{cmp['compared']}/{cmp['requests']} requests compared; {st['steps']} steps ({st['mixed_steps']} mixed, "
          f"{st['multi_prefill_steps']} with several prefills), busy {st['busy_s']:.2f} s; peak KV "
          f"{st['peak_kv_pages']:,}/{s.shape.pool.num_pages:,} blocks; {st['preemptions']} preemptions; "
          f"{time.perf_counter() - t0:.1f} s")
    if a.output:
        write_per_request(a.output, reqs, real, sim)
    return 0 if cmp["compared"] == cmp["requests"] else 1


def find_examples(root: str) -> list[str]:
    """Every directory under root/bench/examples (or root itself) with config.json and vllm/requests.jsonl."""
    base = os.path.join(root, "bench", "examples")
    base = base if os.path.isdir(base) else root
    out = []
    for d, _, files in os.walk(base):
        if "config.json" in files and os.path.exists(os.path.join(d, "vllm", "requests.jsonl")):
            out.append(d)
    return sorted(out)


ALL_COLUMNS = (("ttft", "Mean"), ("ttft", "P90"), ("tpot", "Mean"), ("tpot", "P90"), ("latency", "Mean"),
               ("latency", "P90"))


def all_table(rows: list[tuple[str, dict, dict | None, dict]]) -> str:
    """One line per run: each metric's error, ours / LLMServingSim's (their summary.txt), in %."""
    head = f"{'example':<42}" + "".join(f"{LABELS[m] + ' ' + st.lower():>16}" for m, st in ALL_COLUMNS)
    head += f"{'preempt':>9}"
    sub = f"{'':<42}" + f"{'ours / LSS':>16}" * len(ALL_COLUMNS)
    lines = [head, sub, "-" * len(head)]
    for name, cmp, ref, st in rows:
        cells = []
        for m, stat_name in ALL_COLUMNS:
            ours = cmp[m][stat_name][2]
            theirs = (ref or {}).get((m, stat_name))
            cells.append(f"{ours:+6.1f} / {theirs[2]:+5.1f}" if theirs else f"{ours:+6.1f} /     -")
        lines.append(f"{name:<42}" + "".join(f"{c:>16}" for c in cells) + f"{st['preemptions']:>9}")
    return "\n".join(lines)


def run_all(a: argparse.Namespace) -> int:
    examples = find_examples(a.all)
    if not examples:
        raise ConfigError(f"{a.all}: no example (a directory with config.json and vllm/requests.jsonl)")
    rows, ok, failed = [], True, []
    base = os.path.join(a.all, "bench", "examples")
    for ex in examples:
        t0 = time.perf_counter()
        name = os.path.relpath(ex, base if ex.startswith(base) else a.all)
        try:  # one example this replay cannot read (another architecture, a layout it refuses) spoils no other
            b = with_example(argparse.Namespace(**{**vars(a), "example": ex, "all": None}))
            _, _, _, _, st, cmp = simulate(b)
            ref = read_reference_summary(b.reference_summary) if b.reference_summary else None
        except ConfigError as e:
            failed.append(f"{name}: {e}")
            continue
        rows.append((name, cmp, ref, st))
        ok &= cmp["compared"] == cmp["requests"]
        print(f"  {name}: {cmp['compared']}/{cmp['requests']} requests, {st['steps']} steps, "
              f"{time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    print(all_table(rows))
    for line in failed:
        print(f"not replayed: {line}")
    return 0 if ok and not failed else 1


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))
