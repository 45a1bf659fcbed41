"""The agents bench's figures from the proxy's records: per server and client, turns that exited 0, what each
turn's first main request read from the cache and how long its first content took, and why a request read less
than it could (divergence.explain).

A main request is a POST to one of the three APIs whose body offers tools (the turn's work); the others (a title,
a summary, a token count) are side requests, counted only. Each main request is set against the earlier main
request of the same client and server (any session) whose rendering it shares the longest prefix with: what a
prefix cache could serve it, in the server's own tokens (analyse). The share of a turn (its first main request) is
cached / that shared prefix:
- first turns of sessions 2..N: the tools, the system text and what else the CLI puts before the first prompt;
- later turns: the previous request's prompt, which the turn re-sends (a CLI's side agents with their own tool
  lists, such as Qwen Code's memory extraction, are not what a turn continues).
"""
from __future__ import annotations

import statistics
from dataclasses import replace

from .divergence import explain, first_difference, render

APIS = ("/v1/messages", "/v1/chat/completions", "/v1/responses")
# What each server changes in a request before its template renders it: what makes two sessions' prompts share
# more (or less) in that server's tokens. deltaserve's list is docs/api-fields.md's, in short.
NORMALISATIONS = {
    "deltaserve": "its own rendering (tokens: the checkpoint's tokenizer). Leaves out Claude Code's "
                  "`x-anthropic-billing-header:` system block (client telemetry that differs per session); renders "
                  "a system message after the first as a user message; flattens Responses namespace tools to "
                  "`<namespace>__<name>` and leaves built-in tools (web_search, ...) out of the prompt.",
    "llama.cpp": "the prompt it ran (tokens: its /slots text through its /tokenize). Its own conversion of "
                 "Anthropic Messages and Responses to chat messages (a Responses request keeps only its `function` "
                 "tools); Claude Code's billing block kept as system text, its per-request `cch=` stamp set to a "
                 "constant; the checkpoint's template with a later system message rendered as a user turn (as "
                 "shipped it raises on one).",
}
SLACK = 64  # a hit on the 64-token grid counts as whole: less than a page short is not a divergence


def is_main(q: dict) -> bool:
    body = q.get("body")
    return (q.get("method") == "POST" and q.get("path") in APIS and isinstance(body, dict)
            and bool(body.get("tools")))


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(statistics.fmean(xs), 3) if xs else None


def _min(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(min(xs), 4) if xs else None


def analyse(rows: dict[str, list[dict]], tok) -> dict:
    """{server: {client: summary}} plus the side-by-side TTFT ratios (each llama-server arm / deltaserve) per
    client. A request's tokens are its server's own: `own_ids` where the bench read them off the server (None: not
    read, so not measured), else deltaserve's rendering of its body."""
    ids_of: dict[int, list[int] | None] = {}

    def ids(q: dict) -> list[int] | None:
        if "own_ids" in q:
            return q["own_ids"]
        key = id(q)  # the record itself: file names repeat across servers
        if key not in ids_of:
            try:
                ids_of[key] = tok.encode(render(q["path"], q["body"], tok))
            except Exception:  # noqa: BLE001 - a body our renderer refuses is reported, not fatal
                ids_of[key] = None
        return ids_of[key]

    out: dict = {}
    for server, srows in rows.items():
        for client in dict.fromkeys(r["client"] for r in srows):
            crow = [r for r in srows if r["client"] == client]
            out.setdefault(server, {})[client] = _client(crow, ids, tok)
    sides: dict = {}
    peers = [s for s in out if s != "deltaserve"]
    for server in peers if "deltaserve" in out else ():
        for client, ours in out["deltaserve"].items():
            peer = out[server].get(client)
            if not peer:
                continue
            sides.setdefault(server, {})[client] = {
                k: (round(peer[k] / ours[k], 2) if peer.get(k) and ours.get(k) else None)
                for k in ("first_turn_ttft_s", "later_turn_ttft_s", "wall_s")}
    return {"servers": out, "peer_over_deltaserve": sides}


def _client(crow: list[dict], ids, tok) -> dict:
    """Each main request against the earlier main request (any session) its rendering shares the most with:
    what the prefix cache could serve it. A turn's row is its first main request."""
    turns = []
    divergences = []
    earlier: list[dict] = []
    for r in sorted(crow, key=lambda r: (r["turn"], r["session"])):  # the order the bench ran them in
        mains = [q for q in r["requests"] if is_main(q)]
        head = mains[0] if mains else None
        answered = head is not None and head.get("status") == 200  # an error's last byte is no first token
        u = (head or {}).get("usage") or {}
        t = {"session": r["session"], "turn": r["turn"], "rc": r["rc"], "wall_s": r["wall_s"],
             "requests": len(r["requests"]), "main": len(mains), "prompt": u.get("prompt"),
             "cached": u.get("cached"), "output": u.get("output"),
             "ttft_s": round(head["first_content_s"], 3) if answered and head.get("first_content_s") is not None
             else None, "share": None, "base": None, "checkpoints": r.get("checkpoints"),
             "error": None if answered or head is None else f"{head.get('status')}: {str(head.get('response_body'))[-160:]}"}
        for q in mains:
            qu = q.get("usage") or {}
            best, shared = _best(earlier, q, ids)
            earlier.append(q)
            if best is None:
                continue
            if q is head and shared:
                t["base"] = shared
                t["share"] = round(qu["cached"] / shared, 4) if qu.get("cached") is not None else None
            bu = best.get("usage") or {}
            whole = shared == len(ids(best))
            ideal = shared + ((bu.get("output") or 0) if whole else 0)
            if qu.get("cached") is not None and qu["cached"] + 2 * SLACK < ideal:
                d = explain(tok, ids(best), (bu.get("output") or 0) if whole else 0, bool(best.get("reasoned")),
                            ids(q))
                if qu["cached"] + 2 * SLACK < min(d.position, shared):  # the renderings agree further than it read
                    why = d.cause if d.where in d.cause else f"{d.cause} in {d.where}"
                    d = replace(d, cause=f"the server did not serve the {shared} tokens both renderings share "
                                         f"(they part at token {d.position}: {why}; it held no "
                                         f"recurrent state nearer to there than token {qu['cached']}, and a hybrid "
                                         f"model's hit ends where one was taken)")
                against = "its previous request + answer" if whole else "the earlier request it shares most with"
                divergences.append(_div(r, qu, ideal, d, against))
        turns.append(t)
    ok = [t for t in turns if t["rc"] == 0]
    first_later = [t for t in turns if t["turn"] == 0 and t["session"] > 0]
    later = [t for t in turns if t["turn"] > 0]
    return {"turns": turns, "turns_ok": len(ok), "turns_total": len(turns),
            "wall_s": round(sum(t["wall_s"] for t in turns), 2),
            "unmeasured": sum(1 for r in crow for q in r["requests"] if is_main(q) and ids(q) is None),
            "requests": sum(t["requests"] for t in turns), "main_requests": sum(t["main"] for t in turns),
            "session1_ttft_s": _mean([t["ttft_s"] for t in turns if t["turn"] == 0 and t["session"] == 0]),
            "first_turn_ttft_s": _mean([t["ttft_s"] for t in first_later]),
            "later_turn_ttft_s": _mean([t["ttft_s"] for t in later]),
            "first_turn_share_min": _min([t["share"] for t in first_later]),
            "later_turn_share_min": _min([t["share"] for t in later]),
            "checkpoint_mb": {k: _mean([t["checkpoints"]["mb"] for t in ts if t["checkpoints"]])
                              for k, ts in (("session1", [t for t in turns if t["turn"] == 0 and t["session"] == 0]),
                                            ("first", first_later), ("later", later))},
            "divergences": divergences}


def _best(earlier: list[dict], q: dict, ids) -> tuple[dict | None, int]:
    """The earlier request whose rendering shares the longest prefix with q's, and that length."""
    mine = ids(q)
    if not mine:
        return None, 0
    best, shared = None, 0
    for p in earlier:
        theirs = ids(p)
        if theirs:
            n = first_difference(theirs, mine)
            if best is None or n > shared:
                best, shared = p, n
    return best, shared


def _div(r: dict, u: dict, ideal: int, d, against: str) -> dict:
    return {"session": r["session"], "turn": r["turn"], "cached": u.get("cached"), "could": ideal,
            "against": against, "position": d.position, "where": d.where, "cause": d.cause,
            "before": d.before, "after": d.after}


def _mb(s: dict) -> str:
    """A client's mean checkpoint MB per turn: session 1's first turn, sessions 2..N's, later turns."""
    m = s.get("checkpoint_mb") or {}
    return "-" if all(v is None for v in m.values()) else ", ".join(
        f"{v:.1f}" if v is not None else "-" for v in (m.get("session1"), m.get("first"), m.get("later")))


def _saved(c: dict | None) -> str:
    if not c:
        return "-"
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(c["by_kind"].items(), key=lambda kv: -kv[1]))
    mb = "? MB" if c["mb"] is None else f"{c['mb']:.1f} MB"
    return f"{c['count']} ({kinds}), {mb}" if c["count"] else "0"


def _f(v, pct: bool = False) -> str:
    if v is None:
        return "-"
    return f"{100 * v:.1f}%" if pct else (f"{v:.2f}" if isinstance(v, float) else str(v))


def format_report(result: dict, args: dict) -> str:
    lines = [f"# deltaserve bench agents: {args['sessions']} sessions x {args['turns']} turns, model "
             f"{args['model']} ({args['model_dir']}), answers capped at {args['max_output_tokens']} tokens", ""]
    lines += ["| server | client | turns exit 0 | requests (main) | session 1 TTFT s | sessions 2..N first-turn "
              "TTFT s | later-turn TTFT s | first turn cached / shared prefix (min) | later turn cached / shared "
              "prefix (min) | checkpoint MB per turn: session 1, sessions 2..N first turn, later turns (mean) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for server, clients in result["servers"].items():
        for client, s in clients.items():
            lines.append(f"| {server} | {client} | {s['turns_ok']}/{s['turns_total']} | {s['requests']} "
                         f"({s['main_requests']}) | {_f(s['session1_ttft_s'])} | {_f(s['first_turn_ttft_s'])} | "
                         f"{_f(s['later_turn_ttft_s'])} | {_f(s['first_turn_share_min'], True)} | "
                         f"{_f(s['later_turn_share_min'], True)} | {_mb(s)} |")
    for server, sides in result["peer_over_deltaserve"].items():
        lines += ["", f"{server} / deltaserve, the same client's runs (above 1.0x deltaserve is faster):", "",
                  "| client | TTFT, sessions 2..N first turn | TTFT, later turns | wall, all turns |", "|---|---|---|---|"]
        for client, r in sides.items():
            lines.append(f"| {client} | {_f(r['first_turn_ttft_s'])}x | {_f(r['later_turn_ttft_s'])}x | "
                         f"{_f(r['wall_s'])}x |")
    lines += ["", "## Each server's tokens and what it changes before rendering", ""]
    for server, clients in result["servers"].items():
        unmeasured = sum(s["unmeasured"] for s in clients.values())
        lines.append(f"- {server}: {NORMALISATIONS[server.removesuffix('-tuned')]}"
                     + (f" Main requests whose prompt could not be read in its tokens (left out of the shares): "
                        f"{unmeasured}." if unmeasured else ""))
    lines += ["", "## Per turn (first main request)", "",
              "| server | client | session | turn | exit | prompt | cached | share | TTFT s | requests | "
              "checkpoints saved (by kind), MB |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for server, clients in result["servers"].items():
        for client, s in clients.items():
            for t in s["turns"]:
                lines.append(f"| {server} | {client} | {t['session'] + 1} | {t['turn'] + 1} | {t['rc']} | "
                             f"{_f(t['prompt'])} | {_f(t['cached'])} | {_f(t['share'], True)} | {_f(t['ttft_s'])} | "
                             f"{t['requests']} | {_saved(t['checkpoints'])} |")
    errors = [(server, client, t) for server, clients in result["servers"].items() for client, s in clients.items()
              for t in s["turns"] if t.get("error")]
    if errors:
        lines += ["", "## Turns whose first main request failed", ""]
        lines += [f"- {server} / {client}, session {t['session'] + 1} turn {t['turn'] + 1}: {t['error']!r}"
                  for server, client, t in errors]
    lines += ["", "## Where a request read less than it could", ""]
    any_div = False
    for server, clients in result["servers"].items():
        for client, s in clients.items():
            for d in s["divergences"]:
                any_div = True
                lines.append(f"- {server} / {client}, session {d['session'] + 1} turn {d['turn'] + 1}: cached "
                             f"{d['cached']} of {d['could']} ({d['against']}); first divergent token {d['position']}"
                             f" in {d['where']}: {d['cause']}; was {d['before']!r}, now {d['after']!r}")
    if not any_div:
        lines.append("- none")
    return "\n".join(lines) + "\n"
