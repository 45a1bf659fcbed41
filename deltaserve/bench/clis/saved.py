"""What deltaserve's resume-point policy spent on a turn, for `bench agents`: the GDN checkpoints it saved, by
kind (the policy's sources), and their bytes, read off the server's /metrics before and after the turn. The CLIs
run one turn at a time, so the difference is the turn's own (its main request and its side requests together).
A checkpoint's bytes are the kept checkpoints' memory over their count at the turn's end (its pages, rounded up
to the pool's page)."""
from __future__ import annotations

import httpx

SAVED = "deltaserve_checkpoints_saved_by_kind_total{"


def read(base: str) -> dict | None:
    """{"saved": {kind: count}, "bytes_each": float | None} from deltaserve's /metrics; None where it cannot be
    read (the cells then say so)."""
    try:
        text = httpx.get(base.rstrip("/") + "/metrics", timeout=30).text
    except httpx.HTTPError:
        return None
    saved, gauges = {}, {}
    for line in text.splitlines():
        if line.startswith(SAVED):
            saved[line.split('kind="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
        elif line.startswith(("deltaserve_checkpoints_kept", "deltaserve_checkpoint_bytes")):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            gauges[name] = float(line.rsplit(" ", 1)[1])
    kept = gauges.get("deltaserve_checkpoints_kept")
    each = gauges["deltaserve_checkpoint_bytes"] / kept if kept else None
    return {"saved": saved, "bytes_each": each}


def spent(before: dict | None, after: dict | None) -> dict | None:
    """The checkpoints a turn saved, by kind, and their MB: {"by_kind": {kind: n}, "count": n, "mb": float|None}."""
    if before is None or after is None:
        return None
    by_kind = {k: int(v - before["saved"].get(k, 0.0)) for k, v in after["saved"].items()}
    by_kind = {k: n for k, n in by_kind.items() if n}
    count = sum(by_kind.values())
    each = after["bytes_each"] or before["bytes_each"]
    return {"by_kind": by_kind, "count": count, "mb": round(count * each / 1e6, 1) if each else (0.0 if not count
                                                                                                  else None)}
