"""Per-request records, the output CSV and the summary table. No torch."""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass


@dataclass
class RequestRecord:
    request_id: str
    session_id: str | None
    replica: int
    arrival: float
    prompt_tokens: int
    output_length: int  # tokens the trace asks for
    first_token: float | None = None
    finish: float | None = None
    output_tokens: int = 0
    cached_tokens: int = 0
    preemptions: int = 0
    status: str = "ok"  # ok | rejected: <why> | unfinished

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finish is None else self.finish - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.finish is None or self.first_token is None or self.output_tokens < 2:
            return None
        return (self.finish - self.first_token) / (self.output_tokens - 1)


CSV_COLUMNS = ("request_id", "session_id", "replica", "arrival", "first_token", "finish", "ttft", "tpot", "e2e",
               "prompt_tokens", "output_tokens", "cached_tokens", "preemptions", "status")


def _fmt(v):
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6f}"
    return v


def write_csv(path: str, records: list[RequestRecord]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for r in records:
            w.writerow([_fmt(getattr(r, c)) for c in CSV_COLUMNS])


def read_csv(path: str) -> list[RequestRecord]:
    out = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            fl = lambda k: float(row[k]) if row[k] != "" else None  # noqa: E731
            out.append(RequestRecord(row["request_id"], row["session_id"] or None, int(row["replica"]),
                                     float(row["arrival"]), int(row["prompt_tokens"]), int(row["output_tokens"]),
                                     fl("first_token"), fl("finish"), int(row["output_tokens"]),
                                     int(row["cached_tokens"]), int(row["preemptions"]), row["status"]))
    return out


def percentile(xs: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not xs:
        return math.nan
    s = sorted(xs)
    k = (len(s) - 1) * p / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def summarize(records: list[RequestRecord]) -> dict:
    done = [r for r in records if r.status == "ok" and r.finish is not None]
    out: dict = {"requests": len(records), "completed": len(done),
                 "rejected": sum(1 for r in records if r.status.startswith("rejected")),
                 "unfinished": sum(1 for r in records if r.status == "unfinished")}
    for name in ("ttft", "tpot", "e2e"):
        xs = [getattr(r, name) for r in done if getattr(r, name) is not None]
        out[name] = {"mean": mean(xs), "p50": percentile(xs, 50), "p90": percentile(xs, 90),
                     "p99": percentile(xs, 99), "n": len(xs)}
    if done:
        span = max(r.finish for r in done) - min(r.arrival for r in records)
        out["makespan_s"] = span
        out["throughput_req_s"] = len(done) / span if span > 0 else math.nan
        out["throughput_out_tok_s"] = sum(r.output_tokens for r in done) / span if span > 0 else math.nan
        prompt = sum(r.prompt_tokens for r in done)
        out["hit_rate"] = sum(r.cached_tokens for r in done) / prompt if prompt else 0.0
        out["preemptions"] = sum(r.preemptions for r in done)
    return out


def summary_table(s: dict) -> str:
    lines = [f"requests {s['requests']}  completed {s['completed']}  rejected {s['rejected']}  "
             f"unfinished {s['unfinished']}",
             f"{'metric':<10}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}   (seconds)"]
    for name in ("ttft", "tpot", "e2e"):
        m = s[name]
        lines.append(f"{name.upper():<10}" + "".join(f"{m[k]:>10.4f}" for k in ("mean", "p50", "p90", "p99")))
    if "makespan_s" in s:
        lines.append(f"throughput {s['throughput_req_s']:.3f} req/s, {s['throughput_out_tok_s']:.1f} output tok/s "
                     f"over {s['makespan_s']:.2f} s; prefix hit rate {100 * s['hit_rate']:.1f}% of prompt tokens; "
                     f"preemptions {s['preemptions']}")
    return "\n".join(lines)
