"""`deltaserve profile coverage BUNDLE`: which kernels have rows in which regime, over which range, and what is
missing for the model the bundle describes. No torch.

Regimes: prefill (a step with prefill spans only), decode (decode only), mixed (both). The always-on kernels
(dense.csv) run in every regime; a GDN kernel runs only where it fires (linear_attention.csv): this engine
has no mixed-only GDN kernel, a mixed step runs the prefill kernels per span and the decode kernels once,
and the gdn_core_mixed rows check that they add up.
"""
from __future__ import annotations

import argparse

from ..sim.bundle import ATTENTION_KERNELS, COPY_OPS, DENSE_KERNELS, GDN_KERNELS, OPTIONAL_DENSE, REGIMES, load_bundle


def coverage(bundle) -> dict:
    meta = bundle.meta
    layers = meta.get("layers") or {}
    has_gdn, has_attn = layers.get("gdn", 0) > 0, layers.get("attention", 0) > 0
    dense = {}
    for r in bundle.rows("dense.csv"):
        dense.setdefault(r["kernel"], []).append(r["tokens"])
    gdn: dict[tuple[str, str], list] = {}
    for r in bundle.rows("linear_attention.csv"):
        gdn.setdefault((r["kernel"], r["regime"]), []).append((r["prefill_tokens"], r["n_decode"]))
    attn = {}
    for r in bundle.rows("attention.csv"):
        attn.setdefault(r["kernel"], []).append((r["query_tokens"], r["context_len"]))
    copies = {}
    for r in bundle.rows("copies.csv"):
        copies.setdefault(r["op"], []).append(r["count"])
    overhead = {}
    for r in bundle.rows("overhead.csv"):
        overhead.setdefault(r["component"], []).append(r["n_seqs"])

    rows, missing = [], []
    for k in list(DENSE_KERNELS) + sorted(OPTIONAL_DENSE & set(dense)):
        expect = k not in OPTIONAL_DENSE and not ((k.startswith("gdn_") and not has_gdn) or (k.startswith("attn_") and not has_attn))
        xs = dense.get(k, [])
        for reg in REGIMES:
            rows.append((k, "dense", reg, len(xs), f"{min(xs)}..{max(xs)} {'rows' if DENSE_KERNELS.get(k) == 'rows' else 'tokens'}"
                         if xs else "-"))
        if expect and not xs:
            missing.append(f"dense kernel {k}")
    for k, fires in GDN_KERNELS.items():
        for reg in REGIMES:
            pts = gdn.get((k, reg), [])
            fires_here = fires == reg or reg == "mixed"
            if reg == "mixed":
                pts = gdn.get((k, fires), [])
                desc = f"from {fires} rows" if pts else "-"
            else:
                key = 0 if fires == "prefill" else 1
                desc = f"{min(p[key] for p in pts)}..{max(p[key] for p in pts)} " \
                       f"{'prefill tokens' if key == 0 else 'decodes'}" if pts else ("-" if fires_here else "does not fire")
            rows.append((k, "linear_attention", reg, len(pts) if reg != "mixed" else 0, desc))
        if has_gdn and not gdn.get((k, fires)):
            missing.append(f"linear_attention kernel {k} ({fires})")
    mixed = gdn.get(("gdn_core_mixed", "mixed"), [])
    rows.append(("gdn_core_mixed", "linear_attention", "mixed", len(mixed),
                 ", ".join(f"({p},{d})" for p, d in mixed) + " (additivity check)" if mixed else "-"))
    for k in ATTENTION_KERNELS:
        pts = attn.get(k, [])
        reg = "prefill" if k == "attn_prefill" else "decode"
        desc = (f"q {min(p[0] for p in pts)}..{max(p[0] for p in pts)}, context {min(p[1] for p in pts)}.."
                f"{max(p[1] for p in pts)}") if pts else "-"
        for r in REGIMES:
            rows.append((k, "attention", r, len(pts) if r in (reg, "mixed") else 0,
                         desc if r in (reg, "mixed") else "does not fire"))
        if has_attn and not pts:
            missing.append(f"attention kernel {k}")
    for op in COPY_OPS:
        xs = copies.get(op, [])
        rows.append((op, "copies", "any", len(xs), f"1..{max(xs)} copies" if xs else "-"))
        if not xs:
            missing.append(f"copy {op}")
    for comp, xs in sorted(overhead.items()):
        rows.append((comp, "overhead", "any", len(xs), f"{min(xs)}..{max(xs)} seqs"))
    cal = bundle.calibration
    return {"rows": rows, "missing": missing, "calibrated": bool(cal), "calibration": cal}


def format_coverage(bundle, cov: dict) -> str:
    m = bundle.meta
    lines = [f"bundle {bundle.path}: {m['model']['name']} ({m['model']['model_type']}), "
             f"{m['layers']['gdn']} GDN + {m['layers']['attention']} attention layers, dtype {m['dtypes']['model']}, "
             f"{m['hardware']['device']} ({m['hardware'].get('name', '')}, {m['hardware'].get('torch_threads')} threads)",
             "engine-resolved block size per TP: " + ", ".join(f"tp{tp}={e['block_size']}" for tp, e in
                                                                m['engine_resolved']['per_tp'].items()),
             "", f"{'kernel':<20}{'table':<18}{'regime':<9}{'rows':>5}  range"]
    for k, t, reg, n, desc in cov["rows"]:
        lines.append(f"{k:<20}{t:<18}{reg:<9}{n:>5}  {desc}")
    lines.append("")
    cal = cov["calibration"]
    if cal:
        lines.append(f"calibration: fixed {cal.get('fixed_us')} us + {cal.get('per_seq_us')} us/seq + "
                     f"{cal.get('per_prefill_us')} us/prefill span, compute x{cal.get('compute_scale')} (decode x{cal.get('compute_scale_decode')}) over "
                     f"{cal.get('steps')} steps (median |error| {cal.get('median_abs_error_pct')}%)")
    else:
        lines.append("calibration: MISSING (the per-step overhead is not fitted; TTFT will be biased low)")
    lines.append("missing: " + (", ".join(cov["missing"]) if cov["missing"] else "nothing"))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="deltaserve profile coverage",
                                description="which kernels have rows in which regime, and what is missing")
    p.add_argument("bundle", help="profile bundle directory")
    a = p.parse_args(argv)
    b = load_bundle(a.bundle)
    cov = coverage(b)
    print(format_coverage(b, cov))
    return 1 if cov["missing"] else 0
