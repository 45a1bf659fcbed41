"""Smoke test of `deltaserve bench throughput` (issue 2's benchmark, not a timed test): the harness runs
the deltaserve arm on the tiny preset with a very small grid and prints its table."""
from __future__ import annotations

import os

from deltaserve.bench import main
from deltaserve.bench.throughput import weight_bytes_per_token


def test_throughput_smoke(tmp_path, capsys):
    out = tmp_path / "bench.csv"
    rc = main(["throughput", "--preset", "tiny", "--peers", "none", "--prefill-lens", "32", "--streams", "1,2",
               "--decode-tokens", "2", "--decode-prompt-len", "16", "--repeats", "1", "--bandwidth-gib", "0.0625",
               "--omp-wait-policy", "inherit", "--out", str(out), "--log-dir", str(tmp_path)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| preset | row | deltaserve tok/s |" in text
    for row in ("prefill@32", "decode@1", "decode@2", "roofline@1"):
        assert f"| tiny | {row}" in text, text
    assert "n/a¹" not in text and "failed²" not in text, text
    rows = out.read_text().splitlines()
    assert rows[0].startswith("preset,row,engine") and any(",best," in r for r in rows)


def test_weight_bytes_per_token_counts_tied_head_once():
    from deltaserve.embedded import ensure_model

    d = ensure_model("tiny")
    w = weight_bytes_per_token(d)
    assert w["tied"] == 1 and w["params_read"] == w["params_total"]
    assert w["bytes_read"] == 2 * w["params_read"] and os.path.isdir(d)


def test_bench_usage():
    assert main([]) == 2 and main(["--help"]) == 0
