"""A standard load generator drives the server: guidellm against /v1/chat/completions, streamed (the short form of
scripts/bench_guidellm.sh, whose full run is in docs/benchmarks.md). Marked slow: make test-all runs it."""
import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server_support import RealServer

MODEL = "deltaserve/tiny"


@pytest.mark.slow
def test_guidellm_streams_chat_completions(tmp_path):
    from deltaserve.embedded.model import ensure_model

    srv = RealServer("--max-num-seqs", "16", "--seed", "0")
    try:
        cmd = ["guidellm", "run",
               "--backend", f"kind=openai_http,target={srv.base},model={MODEL},"
                            "request_format=/v1/chat/completions,stream=true",
               "--profile", "kind=concurrent,streams=4", "--constraint", "kind=max_requests,count=16",
               "--tokenizer", f"kind=huggingface_auto,model={ensure_model('tiny')}",
               "--data", "kind=synthetic_text,prompt_tokens=128,output_tokens=32",
               "--output", f"kind=json,path={tmp_path / 'report.json'}", "--disable-progress"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                           env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    finally:
        srv.stop()
    report = json.loads((tmp_path / "report.json").read_text())
    b = report["benchmarks"][0]
    totals = b["metrics"]["request_totals"]
    assert (totals["successful"], totals["errored"], totals["incomplete"]) == (16, 0, 0), totals
    # every request streamed its 32 tokens (ignore_eos), and the server's usage said so
    out = b["metrics"]["output_token_count"]["successful"]
    assert out["total_sum"] == 16 * 32, out
    ttft = b["metrics"]["time_to_first_token_ms"]["successful"]
    assert 0 < ttft["median"] < 60_000
