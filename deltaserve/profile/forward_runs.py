"""The phases timed inside real forwards of the model (Profiler.forward_profile: every kernel's self time in the
step it belongs to, so the kernels of a forward add up to the forward):

  prefill runs (one span of T tokens)   dense.csv: embedding + step context, layer norms, residual/layer glue,
                                        GDN in/out projections, GDN gated norm and glue, attention qkv/o
                                        projections, q/k norm + rotary, K/V writes, output gate, MLP (or MoE),
                                        final norm; linear_attention.csv prefill rows (conv, post-conv glue,
                                        chunked rule); attention at prior context 0 (PrefillFacts)
  decode runs (D sequences, context c)  linear_attention.csv decode rows (conv step, recurrent step, gather /
                                        scatter glue); attention.csv decode rows; batch preparation per sequence
  mixed runs (a span + D decodes)       gdn_core_mixed rows: do the regimes add up?
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from ..sim.bundle import Bundle
from ..sim.latency import Interp1D, LatencyModel, StepShape


@dataclass
class PrefillFacts:
    """Per token count T of the prefill runs, per attention layer where it says so: what later phases price from."""

    attn_incontext: dict[int, float] = field(default_factory=dict)  # prefill attention at prior 0, per layer
    attn_gate: dict[int, float] = field(default_factory=dict)  # output gate + mixer glue, per layer
    embed: dict[int, float] = field(default_factory=dict)  # embedding + step context


def prefill_runs(prof) -> PrefillFacts:
    nl, ng, na = prof.n_layers, prof.n_gdn, prof.n_attn
    per_layer = {"layer_norms": nl, "residual": nl, "mlp": nl, "gdn_in_proj": ng, "gdn_glue": ng, "gdn_norm": ng,
                 "gdn_out_proj": ng, "attn_qkv_proj": na, "attn_qk_norm_rope": na, "attn_kv_write": na,
                 "attn_gate": na, "attn_o_proj": na}  # the layers each dense kernel runs in
    facts = PrefillFacts()
    for T in prof.grid.tokens:
        ev, total = prof.forward_profile(prof.work([(T, 0, False)]))
        k = prof.by_kernel(ev)
        # frames' self times are the glue they name: a layer's is the residual, the model's the embedding and
        # step context, the attention mixer's goes with the output gate
        k["residual"] = k.pop("layer", 0.0)
        k["embed"] = k.pop("model", 0.0)
        k["attn_gate"] = k.get("attn_gate", 0.0) + k.pop("attn_mixer", 0.0)
        for name in ("embed", "final_norm"):
            prof.dense_row(name, T, k.get(name, 0.0), 1)
        for name, n in per_layer.items():
            if n:
                prof.dense_row(name, T, k.get(name, 0.0), n)
        other = k.get("linear_other", 0.0) + k.get("glue", 0.0)
        if other:
            prof.dense_row("other", T, other, 1)
        facts.embed[T] = k["embed"]
        if ng:
            prof.la_row("gdn_conv_prefill", "prefill", T, 0, k.get("gdn_conv_prefill", 0.0), ng)
            prof.la_row("gdn_post_conv", "prefill", T, 0, k.get("gdn_mixer", 0.0), ng)
            prof.la_row("gdn_prefill", "prefill", T, 0, k.get("gdn_prefill", 0.0), ng)
        if na:
            facts.attn_incontext[T] = k.get("attn_prefill", 0.0) / na
            facts.attn_gate[T] = k["attn_gate"] / na
        prof.checks.setdefault("forward_us", {})[f"prefill{T}"] = round(total, 1)
        prof.tick(f"prefill T={T}")
    return facts


def decode_runs(prof, facts: PrefillFacts) -> None:
    ng, na = prof.n_gdn, prof.n_attn
    gate = Interp1D(facts.attn_gate.items()) if facts.attn_gate else None
    embed = Interp1D(facts.embed.items())
    gdn: dict[str, dict[int, list[float]]] = {}
    attn: dict[int, list[float]] = {}
    prep: dict[int, list[float]] = {}
    for B in prof.grid.gdn_decode:
        for c in prof.grid.decode_ctx:
            work = prof.work([(1, c - 1, True) for _ in range(B)])
            ev, total = prof.forward_profile(work)
            k = prof.by_kernel(ev)
            for name in ("gdn_conv_decode", "gdn_decode"):
                gdn.setdefault(name, {}).setdefault(B, []).append(k.get(name, 0.0))
            gdn.setdefault("gdn_decode_glue", {}).setdefault(B, []).append(k.get("gdn_mixer", 0.0))
            if na:
                # the mixer's glue beyond the output gate (priced per token from the prefill runs) is the
                # decode path's own; noise can put the difference below zero, never the attention itself
                extra = max(0.0, k.get("attn_mixer", 0.0) / na - (gate(B) if gate else 0.0))
                attn.setdefault(c, []).append((k.get("attn_decode", 0.0) / na + extra) / B)
            bt = prof.timeit(lambda: prof.engine.runner.build_batch(work))[0]
            prep.setdefault(B, []).append(max(0.0, k.get("model", 0.0) - embed(B)) + bt)
            prof.tick(f"decode B={B} c={c}")
    if ng:
        for name, d in gdn.items():
            for B, xs in sorted(d.items()):
                prof.la_row(name, "decode", 0, B, statistics.median(xs), ng, min(xs), max(xs))
    for c, xs in sorted(attn.items()):
        prof.rows["attention.csv"].append({"kernel": "attn_decode", "query_tokens": 1, "context_len": c,
                                           "time_us": statistics.median(xs), "p10_us": min(xs), "p90_us": max(xs),
                                           "layers": na})
    for B, xs in sorted(prep.items()):
        prof.rows["overhead.csv"].append({"component": "batch_prep", "n_seqs": B, "tokens": B,
                                          "time_us": statistics.median(xs), "p10_us": min(xs), "p90_us": max(xs)})


def mixed_runs(prof) -> None:
    """A prefill span and D decodes through one forward: the GDN core's time (gdn_core_mixed rows) and, in
    meta.checks, the forward against what the tables so far predict for it. Runs last: it reads every table."""
    if not prof.n_gdn:
        return
    tmp = Bundle("<profiling>", {"layers": {"gdn": prof.n_gdn, "attention": prof.n_attn}}, {},
                 {k: v for k, v in prof.rows.items()})
    lm = LatencyModel(tmp)
    checks = []
    for L, D in prof.grid.mixed:
        c = prof.grid.decode_ctx[0]
        work = prof.work([(L, 0, False)] + [(1, c - 1, True) for _ in range(D)])
        ev, total = prof.forward_profile(work)
        k = prof.by_kernel(ev)
        core = sum(k.get(n, 0.0) for n in ("gdn_conv_prefill", "gdn_prefill", "gdn_conv_decode", "gdn_decode",
                                            "gdn_mixer"))
        prof.la_row("gdn_core_mixed", "mixed", L, D, core, prof.n_gdn)
        pred = lm.compute_us(StepShape([(L, 0)], [c] * D, 0)) + lm.overhead_us(StepShape([(L, 0)], [c] * D, 0))
        checks.append({"prefill": L, "decode": D, "forward_us": round(total, 1), "predicted_us": round(pred, 1)})
        prof.tick(f"mixed L={L} D={D}")
    prof.checks["mixed"] = checks
