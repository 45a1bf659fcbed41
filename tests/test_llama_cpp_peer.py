"""llama.cpp as a benchmark peer: the pieces that need no llama.cpp binary
(command lines, the converter wrapper's pre-tokenizer choice, the mmproj conversion's link directory and cache,
timings parsing, the table), and an end-to-end
run of the real llama-server on the tiny model, which skips unless scripts/setup_llama_cpp.sh has built it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from deltaserve.bench import main
from deltaserve.bench.peers import PeerUnavailable, gguf_convert
from deltaserve.bench.peers import llama_cpp as lc


@pytest.fixture(scope="module")
def tiny_dir():
    from deltaserve.embedded.model import ensure_model

    return ensure_model("tiny")


# --------------------------------------------------------------------------- no binary needed
def test_server_command_assembly():
    cmd = lc.server_command("/x/llama-server", "/m/t.gguf", port=8123, ctx=32768, slots=8, threads=2)
    assert cmd == ["/x/llama-server", "-m", "/m/t.gguf", "--host", "127.0.0.1", "--port", "8123", "-c", "32768",
                   "-np", "8", "-t", "2", "--no-webui"]
    cmd = lc.server_command("s", "g", port=1, ctx=4, slots=1, threads=1, extra=("-ub", "2048"))
    assert cmd[-2:] == ["-ub", "2048"]
    for bad in ({"slots": 0, "threads": 1, "ctx": 8}, {"slots": 1, "threads": 0, "ctx": 8},
                {"slots": 8, "threads": 1, "ctx": 4}):
        with pytest.raises(ValueError, match="slots >= 1"):
            lc.server_command("s", "g", port=1, **bad)


def test_convert_command(tiny_dir, tmp_path):
    cmd = lc.convert_command(tiny_dir, "q8_0", "/o/t.gguf", tree="/tree", python="/py")
    # the tiny preset stores one MTP layer (speculative decoding runs on it): converted with it
    assert cmd == ["/py", lc.CONVERTER, "/tree", tiny_dir, "--outtype", "q8_0", "--outfile", "/o/t.gguf"]
    assert os.path.exists(lc.CONVERTER)
    # MTP tensors decide, not the config's mtp_num_hidden_layers (the 0.8B shape declares one, stores none)
    import torch
    from safetensors.torch import save_file

    for name, keys in (("mtp", ["model.norm.weight", "mtp.fc.weight"]), ("declared", ["model.norm.weight"])):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"mtp_num_hidden_layers": 1}))
        save_file({k: torch.zeros(2) for k in keys}, str(d / "model.safetensors"))
    assert lc.has_mtp_layers(str(tmp_path / "mtp")) and not lc.has_mtp_layers(str(tmp_path / "declared"))
    assert lc.has_mtp_layers(tiny_dir)
    d = tmp_path / "mtp"
    assert "--no-mtp" not in lc.convert_command(str(d), "bf16", "o", tree="t")
    with pytest.raises(ValueError, match="choose from bf16, f32, q8_0"):
        lc.convert_command(tiny_dir, "q4_k", "o", tree="t")


def test_gguf_path_is_keyed_by_checkpoint_type_and_build(tiny_dir):
    a, b = lc.gguf_path(tiny_dir, "bf16"), lc.gguf_path(tiny_dir, "q8_0")
    assert a != b and os.path.basename(tiny_dir) in a and a.endswith(f"-bf16-{lc.BUILD}.gguf")


def test_pre_tokenizer_fallback_only_for_qwen2_regex(tiny_dir, tmp_path):
    """The embedded tokenizer splits exactly as llama.cpp's qwen2 pre-tokenizer; any other regex keeps
    the converter's own error (None here)."""
    assert gguf_convert.fallback_pre(tiny_dir) == "qwen2"
    tok = json.load(open(os.path.join(tiny_dir, "tokenizer.json"), encoding="utf-8"))
    assert gguf_convert.split_regexes(tok) == [gguf_convert.QWEN2_SPLIT_REGEX]
    tok["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\p{L}+|\s+"
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    assert gguf_convert.fallback_pre(str(tmp_path)) is None
    assert gguf_convert.fallback_pre(str(tmp_path / "missing")) is None
    assert gguf_convert.split_regexes({"pre_tokenizer": {"type": "Split", "pattern": {"Regex": "x"}}}) == ["x"]


def test_converter_wrapper_refuses_a_missing_tree(tmp_path, tiny_dir):
    r = subprocess.run([sys.executable, lc.CONVERTER, str(tmp_path), tiny_dir], capture_output=True, text=True)
    assert r.returncode != 0 and "setup_llama_cpp.sh" in r.stderr


def test_parse_timings():
    resp = {"content": "x", "timings": {"cache_n": 3, "prompt_n": 509, "prompt_ms": 98.5, "prompt_per_token_ms": 0.19,
                                        "prompt_per_second": 5167.5, "predicted_n": 32, "predicted_ms": 31.0,
                                        "predicted_per_token_ms": 1.0, "predicted_per_second": 1000.0}}
    t = lc.parse_timings(resp)
    assert t == lc.Timings(prompt_n=509, cache_n=3, prompt_ms=98.5, predicted_n=32, predicted_ms=31.0)
    with pytest.raises(ValueError, match="no timings"):
        lc.parse_timings({"content": "x"})
    with pytest.raises(ValueError, match="predicted_ms"):
        lc.parse_timings({"timings": {"prompt_n": 1, "prompt_ms": 1.0, "predicted_n": 1}})


def _fake_llama_server(events_for):
    """A stand-in for llama-server's streamed /completion: events_for(body) gives the events (dicts) to send, each
    as an SSE `data:` line flushed on its own, with a short pause between them."""
    import http.server
    import threading
    import time

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for ev in events_for(body):
                self.wfile.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
                self.wfile.flush()
                time.sleep(0.01)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    server = lc.LlamaServer.__new__(lc.LlamaServer)
    server.base, server.slots = f"http://127.0.0.1:{srv.server_address[1]}", 4
    return srv, server


def test_llama_server_stream_counts_each_event_by_its_timings():
    """The streamed completion asks for per-token timings and reports, as each event arrives, the tokens the
    stream holds: what the client-side decode phase is counted from."""
    seen = []

    def events(body):
        seen.append(body)
        t = {"prompt_n": len(body["prompt"]), "prompt_ms": 5.0, "predicted_ms": 1.0}
        return ([{"content": "a", "stop": False, "timings": {**t, "predicted_n": i}} for i in range(1, 4)]
                + [{"content": "", "stop": True, "timings": {**t, "predicted_n": 3}}])

    srv, server = _fake_llama_server(events)
    try:
        counts = []
        t = server.stream([1, 2, 3], 3, counts.append)
        assert counts == [1, 2, 3, 3] and t.predicted_n == 3
        assert seen[0]["stream"] is True and seen[0]["timings_per_token"] is True and seen[0]["ignore_eos"] is True
        with pytest.raises(RuntimeError, match="streamed 3 tokens, asked for 4"):
            server.stream([1, 2, 3], 4, counts.append)
    finally:
        srv.shutdown()


def test_llama_cpp_decode_is_the_client_side_decode_phase():
    """Two streams, the second's first token sent only after the first stream's third: the phase starts when both
    hold a token, so the first stream's earlier tokens are not in it (llama-server's own predicted_ms of the
    longer stream would have counted them)."""
    import threading
    import time

    early_third, late_first = threading.Event(), threading.Event()

    def events(body):
        t = {"prompt_n": len(body["prompt"]), "prompt_ms": 1.0, "predicted_ms": 1.0}
        late = len(body["prompt"]) > 2
        for i in range(1, 6):
            if late and i == 1:
                early_third.wait(10)
                time.sleep(0.1)
            if not late and i == 4:
                late_first.wait(10)
                time.sleep(0.1)
            yield {"content": "a", "stop": False, "timings": {**t, "predicted_n": i}}
            if not late and i == 3:
                early_third.set()
            if late and i == 1:
                late_first.set()

    srv, server = _fake_llama_server(events)
    peer = lc.LlamaCppPeer.__new__(lc.LlamaCppPeer)
    peer.server, peer.info = server, {}
    try:
        _, n = peer.decode([[1, 2], [1, 2, 3]], 5)
    finally:
        srv.shutdown()
    assert n == 10 - (3 + 1)  # the early stream held 3 and the late one 1 when the phase began


def test_decode_phase_one_definition():
    from deltaserve.bench.decode_phase import decode_phase

    # stream a: tokens at 1, 2, 3, 4; stream b: its first at 2.5, then 3.5, 4.5
    arrivals = [(1.0, "a", 1), (2.0, "a", 2), (2.5, "b", 1), (3.0, "a", 3), (3.5, "b", 2), (4.0, "a", 4),
                (4.5, "b", 3)]
    assert decode_phase(reversed(arrivals), 2) == (2.0, 7 - 3)  # from 2.5 (a holds 2, b 1) to 4.5
    assert decode_phase([(0.0, "a", 1), (0.5, "a", 3)], 1) == (0.5, 2)
    with pytest.raises(ValueError, match="first token"):
        decode_phase([(0.0, "a", 1), (1.0, "a", 2)], 2)
    with pytest.raises(ValueError, match="after"):
        decode_phase([(0.0, "a", 1)], 1)
    with pytest.raises(ValueError, match="went from"):
        decode_phase([(0.0, "a", 2), (1.0, "a", 1)], 1)


def test_peer_without_binary_says_how_to_build(tmp_path, tiny_dir):
    with pytest.raises(PeerUnavailable, match="setup_llama_cpp.sh"):
        lc.LlamaCppPeer(tiny_dir, "bf16", slots=1, threads=1, ctx_per_slot=512, log_dir=str(tmp_path),
                        root=str(tmp_path))
    with pytest.raises(PeerUnavailable, match="setup_llama_cpp.sh"):
        lc.require_server(str(tmp_path))


def test_salt_keeps_llama_cpp_requests_off_its_cache():
    from deltaserve.bench.agent.drivers import HttpDriver, LlamaCppDriver

    drv = object.__new__(LlamaCppDriver)
    assert drv._salt_body("s") == {"cache_prompt": False} and drv._salt_body(None) == {}
    assert HttpDriver._salt_body(object.__new__(HttpDriver), "s") == {"cache_salt": "s"}


def test_render_llama_cpp_columns_and_fp8_hook():
    from deltaserve.bench.throughput_report import Results, render

    def res(with_fp8: bool) -> Results:
        r = Results()
        r.info.update(rows={"tiny": ["decode@1"]}, peers=["llama.cpp"], llama_cpp_types=["bf16", "q8_0"],
                      decode_tokens={"tiny": 8}, repeats=1, decode_prompt_len=16)
        r.best.update({("tiny", "decode@1", "deltaserve"): 100.0, ("tiny", "decode@1", "llama.cpp-bf16"): 200.0,
                       ("tiny", "decode@1", "llama.cpp-q8_0"): 400.0})
        r.arm_info.update({("tiny", "deltaserve"): {}, ("tiny", "llama.cpp-bf16"): {"build": "b1", "threads": 2,
                                                                                   "slots": 8, "gguf_bytes": 1e6},
                           ("tiny", "llama.cpp-q8_0"): {"gguf_bytes": 5e5}})
        if with_fp8:
            r.best[("tiny", "decode@1", "deltaserve-fp8")] = 300.0
            r.arm_info[("tiny", "deltaserve-fp8")] = {}
        return r

    text = render(res(False))
    head = text.splitlines()[0]
    assert "llama.cpp-bf16 tok/s | llama.cpp-q8_0 tok/s |" in head and "ds/llama.cpp-bf16 | ds/llama.cpp-q8_0 |" in head
    assert "| tiny | decode@1 | 100 | 200 | 400 | n/a | n/a | 0.50x | 0.25x |" in text, text
    assert "llama-server -t 2 -np 8" in text
    text = render(res(True))
    assert "deltaserve-fp8/llama.cpp-q8_0" in text.splitlines()[0] and "| 0.50x | 0.75x |" in text, text
    assert "- tiny: FP8 decode@1 3.00x our bf16 (meets the 1.7x bar)" in text, text
    r = res(True)  # the --fp8-head arm: its column, its ratio to q8_0 (both quantize the head), its bar
    r.best[("tiny", "decode@1", "deltaserve-fp8-head")] = 320.0
    r.arm_info[("tiny", "deltaserve-fp8-head")] = {}
    text = render(r)
    assert "| deltaserve-fp8-head tok/s |" in text.splitlines()[0] and "deltaserve-fp8-head/llama.cpp-q8_0 |" in text
    assert "| 0.50x | 0.75x | 0.80x |" in text and "FP8 with the head in FP8 decode@1 3.20x our bf16" in text, text


def test_render_int4_arms_against_llama_cpp_4bit():
    """Each 4-bit GGUF is set against the int4-head arm, then the int4 arm with its head in FP8 (8 bits against
    their Q6_K head), then the bf16-head int4 arm; the decode@1 targets are checked for both quantized heads."""
    from deltaserve.bench.throughput_report import Results, llama_cpp_targets, render

    r = Results()
    r.info.update(rows={"tiny": ["decode@1"]}, peers=["llama.cpp"], llama_cpp_types=["q4_k_m"],
                  decode_tokens={"tiny": 8}, repeats=1, decode_prompt_len=16)
    tok = {"deltaserve-int4": 80.0, "deltaserve-int4-head": 120.0, "deltaserve-int4-fp8-head": 110.0,
           "llama.cpp-q4_k_m": 100.0}
    for arm, v in tok.items():
        r.best[("tiny", "decode@1", arm)] = v
        r.arm_info[("tiny", arm)] = {"gguf_bytes": 5e5} if arm.startswith("llama") else {}
    text = render(r)
    head = text.splitlines()[0]
    assert head.index("deltaserve-int4 tok/s") < head.index("deltaserve-int4-head tok/s") \
        < head.index("deltaserve-int4-fp8-head tok/s") < head.index("llama.cpp-q4_k_m tok/s"), head
    assert head.endswith("| deltaserve-int4-head/llama.cpp-q4_k_m | deltaserve-int4-fp8-head/llama.cpp-q4_k_m "
                         "| deltaserve-int4/llama.cpp-q4_k_m |"), head
    assert "| 1.20x | 1.10x | 0.80x |" in text, text
    assert llama_cpp_targets(r) == [
        "- tiny decode@1: deltaserve-int4-head / llama.cpp-q4_k_m 1.20x (met, target >= 1.15x)",
        "- tiny decode@1: deltaserve-int4-fp8-head / llama.cpp-q4_k_m 1.10x (missed, target >= 1.15x)"]


def test_cli_rejects_unknown_peers_and_types(capsys):
    with pytest.raises(SystemExit):
        main(["throughput", "--peers", "llamacpp"])
    assert "choose from transformers, vllm, llama.cpp" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["throughput", "--peers", "llama.cpp", "--llama-cpp-types", "q3_k"])
    assert "choose from bf16, f32, q8_0, q4_k_m, q4_0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["throughput", "--int4", "int3"])
    assert "--int4 int3: choose from int4, int4-head" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["agent", "--peers", "llama"])
    assert "llama.cpp" in capsys.readouterr().err


def test_four_bit_files_are_llama_quantize_of_the_bf16_conversion(tmp_path, monkeypatch):
    """A 4-bit arm's GGUF: the bf16 conversion (kept), then llama-quantize into the type in capitals; no
    llama-quantize: the arm is unavailable with the script that builds it."""
    from deltaserve.bench.peers import llama_cpp as lc

    assert lc.quantize_command("/b/llama-quantize", "m.gguf", "o.gguf", "q4_k_m", 2) == [
        "/b/llama-quantize", "m.gguf", "o.gguf", "Q4_K_M", "2"]
    with pytest.raises(ValueError, match="not made here"):
        lc.quantize_command("/b/llama-quantize", "m.gguf", "o.gguf", "q8_0")
    monkeypatch.setenv("DELTASERVE_HOME", str(tmp_path))
    root = tmp_path / "llama"
    (root / "src").mkdir(parents=True)
    (root / "src" / "convert_hf_to_gguf.py").write_text("")
    model = tmp_path / "m"
    model.mkdir()
    os.makedirs(os.path.dirname(lc.gguf_path(str(model), "bf16")), exist_ok=True)
    with open(lc.gguf_path(str(model), "bf16"), "w") as f:
        f.write("bf16 file")
    with pytest.raises(lc.PeerUnavailable, match="no llama-quantize .*setup_llama_cpp.sh"):
        lc.ensure_gguf(str(model), "q4_0", root=str(root))
    tool = root / "build" / "bin" / "llama-quantize"
    tool.parent.mkdir(parents=True)
    tool.write_text('#!/bin/sh\necho "$@" > "$2"\n')
    tool.chmod(0o755)
    out = lc.ensure_gguf(str(model), "q4_0", root=str(root))
    assert out == lc.gguf_path(str(model), "q4_0")
    with open(out) as f:
        assert f.read().split()[2:] == ["Q4_0", str(os.cpu_count())]


# --------------------------------------------------------------------------- the real llama-server
def _need_server():
    if not os.access(lc.server_binary(), os.X_OK):
        pytest.skip(f"llama-server not built at {lc.server_binary()} (run scripts/setup_llama_cpp.sh, ~20 min)")


@pytest.mark.slow
def test_llama_server_end_to_end_tiny(tiny_dir, tmp_path, capsys):
    """Conversion (cached), the server, its tokenizer against ours, timings, then both bench commands with
    the llama.cpp arm on a very small grid."""
    _need_server()
    log = str(tmp_path / "llama.log")
    gguf = lc.ensure_gguf(tiny_dir, "bf16", log_path=log)
    assert os.path.getsize(gguf) > 1 << 20
    srv = lc.LlamaServer(gguf, ctx=2 * 1024, slots=2, threads=2, log_path=log)
    try:
        # the qwen2 pre-tokenizer the wrapper chose splits text as our tokenizer does
        from tokenizers import Tokenizer

        text = "Hello world!  It's 12345 tokens, isn't it?\n\n\tdef f(x): return x**2  # ok 😀"
        ours = Tokenizer.from_file(os.path.join(tiny_dir, "tokenizer.json")).encode(text, add_special_tokens=False).ids
        theirs = srv.post("/tokenize", {"content": text, "add_special": False})["tokens"]
        assert theirs == ours
        t = srv.complete(list(range(20, 120)), 8)
        assert t.prompt_n == 100 and t.cache_n == 0 and t.predicted_n == 8 and t.prompt_ms > 0 and t.predicted_ms > 0
        counts = []  # streamed: every event says how many tokens the stream holds (the client-side decode phase)
        t = srv.stream(list(range(20, 120)), 8, counts.append)
        assert t.predicted_n == 8 and counts[0] == 1 and counts[-1] == 8 and counts == sorted(counts)
        assert set(range(1, 9)) <= set(counts)
    finally:
        srv.close()
    assert srv.proc.poll() is not None
    rc = main(["throughput", "--preset", "tiny", "--peers", "llama.cpp", "--llama-cpp-types", "bf16",
               "--prefill-lens", "64", "--streams", "1,2", "--decode-tokens", "4", "--decode-prompt-len", "16",
               "--repeats", "1", "--bandwidth-gib", "0", "--settle", "0", "--log-dir", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    for row in ("prefill@64", "decode@1", "decode@2"):
        line = next(ln for ln in out.splitlines() if ln.startswith(f"| tiny | {row} |"))
        cells = [c.strip() for c in line.split("|")[1:-1]]
        assert cells[3] not in ("n/a¹", "failed²") and float(cells[3].replace(",", "")) > 0, out
    rc = main(["agent", "--preset", "tiny", "--arms", "none", "--peers", "llama.cpp", "--sessions", "2",
               "--target-context", "512", "--output-tokens", "3", "--no-warmup", "--ideal", "alone",
               "--ideal-context-samples", "1", "--log-dir", str(tmp_path), "--out", str(tmp_path / "agent")])
    assert rc == 0
    out = capsys.readouterr().out
    row = next(ln for ln in out.splitlines() if ln.startswith("| llama.cpp-bf16 |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert float(cells[5]) > 0.3, out  # its prompt cache hits later turns and says so in usage
    assert "does not report" not in out


def test_llama_cpp_targets_lines():
    from deltaserve.bench.throughput_report import Results, llama_cpp_targets

    r = Results()
    r.info["rows"] = {"tiny": ["decode@1", "decode@8"]}
    r.best.update({("tiny", "decode@1", "deltaserve"): 90.0, ("tiny", "decode@1", "llama.cpp-bf16"): 100.0,
                   ("tiny", "decode@8", "deltaserve"): 160.0, ("tiny", "decode@8", "llama.cpp-bf16"): 100.0,
                   ("tiny", "decode@1", "deltaserve-fp8"): 120.0})  # no q8_0 arm ran: no fp8 line
    assert llama_cpp_targets(r) == [
        "- tiny decode@1: deltaserve / llama.cpp-bf16 0.90x (missed, target >= 1.0x)",
        "- tiny decode@8: deltaserve / llama.cpp-bf16 1.60x (met, target >= 1.5x)"]
    r.best.update({("tiny", "decode@1", "llama.cpp-q8_0"): 125.0, ("tiny", "decode@1", "deltaserve-fp8-head"): 150.0})
    assert llama_cpp_targets(r)[2:] == [
        "- tiny decode@1: deltaserve-fp8 / llama.cpp-q8_0 0.96x (missed, target >= 1.0x)",
        "- tiny decode@1: deltaserve-fp8-head / llama.cpp-q8_0 1.20x (met, target >= 1.0x)"]
    r.best.update({("tiny", "decode@1", "llama.cpp-q4_k_m"): 100.0, ("tiny", "decode@1", "deltaserve-int4-head"): 110.0})
    assert llama_cpp_targets(r)[4:] == [
        "- tiny decode@1: deltaserve-int4-head / llama.cpp-q4_k_m 1.10x (missed, target >= 1.15x)"]


# --------------------------------------------------------------------------- the vision tower as an mmproj GGUF
def _checkpoint(path, processor: dict | None = None) -> str:
    """A stand-in checkpoint directory (ensure_mmproj only lists, links and hands it to the converter)."""
    path.mkdir()
    for name, text in (("config.json", "{}"), ("model.safetensors", "weights"), ("tokenizer.json", "{}")):
        (path / name).write_text(text)
    if processor is not None:
        (path / "preprocessor_config.json").write_text(json.dumps(processor))
    return str(path)


def _tree(root) -> str:
    (root / "src").mkdir(parents=True)
    (root / "src" / "convert_hf_to_gguf.py").write_text("")
    return str(root)


def test_ensure_mmproj_links_the_checkpoint_beside_the_processor_settings(tmp_path, monkeypatch):
    """Without preprocessor_config.json the converter gets a directory of the checkpoint's own name holding a link
    to each of its files (absolute: the directory is elsewhere) plus the settings the engine uses; the link
    directory is gone after; the result is cached under $DELTASERVE_HOME by checkpoint and build, and a second
    call converts nothing."""
    from deltaserve.media.images import QWEN35_PROCESSOR

    monkeypatch.setenv("DELTASERVE_HOME", str(tmp_path / "home"))
    model = _checkpoint(tmp_path / "vl-abc123")
    root, seen = _tree(tmp_path / "llama"), {}

    def convert(cmd, tmp, out, log_path, timeout, what):
        src = cmd[3]
        with open(os.path.join(src, "preprocessor_config.json")) as f:
            processor = json.load(f)
        seen.update(cmd=cmd, src=src, what=what, files=sorted(os.listdir(src)),
                    links={n: os.readlink(os.path.join(src, n)) for n in os.listdir(src)
                           if os.path.islink(os.path.join(src, n))},
                    processor=processor)
        with open(out, "w") as f:
            f.write("gguf")
        return out

    monkeypatch.setattr(lc, "_convert", convert)
    out = lc.ensure_mmproj(model, root=root)
    assert out == lc.mmproj_path(model) == str(tmp_path / "home" / "gguf" / f"vl-abc123-mmproj-bf16-{lc.BUILD}.gguf")
    assert os.path.exists(out) and "mmproj" in seen["what"]
    src = seen["src"]
    assert src != model and os.path.basename(src) == "vl-abc123" and not os.path.exists(src)  # a temporary copy
    assert seen["files"] == ["config.json", "model.safetensors", "preprocessor_config.json", "tokenizer.json"]
    assert seen["links"] == {n: os.path.join(model, n) for n in ("config.json", "model.safetensors", "tokenizer.json")}
    assert seen["processor"] == {**QWEN35_PROCESSOR, "image_processor_type": "Qwen2VLImageProcessorFast"}
    cmd = seen["cmd"]
    assert cmd[:4] == [sys.executable, lc.CONVERTER, os.path.join(root, "src"), src]
    assert cmd[4:] == ["--mmproj", "--outtype", "bf16", "--outfile", f"{out}.tmp{os.getpid()}"]
    assert not os.path.exists(os.path.join(model, "preprocessor_config.json"))  # the checkpoint is untouched

    def fail(*a, **k):
        raise AssertionError("converted again")

    monkeypatch.setattr(lc, "_convert", fail)
    assert lc.ensure_mmproj(model, root=root) == out  # cached: no converter run, no tree needed
    assert lc.ensure_mmproj(model, root=str(tmp_path / "no-tree")) == out


def test_ensure_mmproj_converts_a_checkpoint_with_its_own_processor_settings_in_place(tmp_path, monkeypatch):
    monkeypatch.setenv("DELTASERVE_HOME", str(tmp_path / "home"))
    model = _checkpoint(tmp_path / "vl-own", processor={"patch_size": 14, "merge_size": 2})
    seen = []
    monkeypatch.setattr(lc, "_convert", lambda cmd, tmp, out, *a: seen.append(cmd) or out)
    lc.ensure_mmproj(model, root=_tree(tmp_path / "llama"))
    assert seen[0][3] == model  # its own preprocessor_config.json: no link directory
    with pytest.raises(PeerUnavailable, match="setup_llama_cpp.sh"):  # no tree, nothing cached
        lc.ensure_mmproj(_checkpoint(tmp_path / "vl-other"), root=str(tmp_path / "no-tree"))


@pytest.mark.slow  # the converter in a subprocess: 15-40 s
def test_ensure_mmproj_real_converter_on_tiny(tiny_dir, tmp_path, monkeypatch):
    """llama.cpp's own converter (skips without its tree) writes the tiny vision tower as an mmproj GGUF with the
    processor settings ensure_mmproj supplied, into a fresh $DELTASERVE_HOME."""
    root = lc.default_dir()
    if not os.path.exists(os.path.join(root, "src", "convert_hf_to_gguf.py")):
        pytest.skip(f"no llama.cpp tree at {root} (run scripts/setup_llama_cpp.sh)")
    monkeypatch.setenv("DELTASERVE_HOME", str(tmp_path / "home"))
    out = lc.ensure_mmproj(tiny_dir, root=root, log_path=str(tmp_path / "convert.log"))
    assert out.startswith(str(tmp_path / "home")) and not [n for n in os.listdir(os.path.dirname(out)) if ".tmp" in n]
    sys.path.insert(0, os.path.join(root, "src", "gguf-py"))
    try:
        import gguf
    finally:
        sys.path.pop(0)
    reader = gguf.GGUFReader(out)
    fields = {k: f.contents() for k, f in reader.fields.items()}
    assert fields["general.architecture"] == "clip" and fields["clip.has_vision_encoder"]
    assert fields["clip.vision.patch_size"] == 16 and fields["clip.vision.image_mean"] == [0.5, 0.5, 0.5]
    assert any(t.name.startswith("v.blk.") for t in reader.tensors)


def _gguf(path, tensors, meta, align=32):
    """A GGUF file written by hand (version 3): `tensors` [(name, nbytes)], laid out in order, each aligned."""
    import struct

    def s(x):
        b = x.encode()
        return struct.pack("<Q", len(b)) + b

    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta))
    for k, v in meta.items():  # u32 (type 4) and string (type 8) values, an array of strings (type 9)
        if isinstance(v, int):
            out += s(k) + struct.pack("<II", 4, v)
        elif isinstance(v, list):
            out += s(k) + struct.pack("<IIQ", 9, 8, len(v)) + b"".join(s(x) for x in v)
        else:
            out += s(k) + struct.pack("<I", 8) + s(v)
    off, offsets = 0, []
    for _, n in tensors:
        offsets.append(off)
        off = -(-(off + n) // align) * align
    for (name, n), o in zip(tensors, offsets):
        out += s(name) + struct.pack("<I", 2) + struct.pack("<QQ", n, 1) + struct.pack("<IQ", 30, o)
    out += b"\0" * (-len(out) % align)
    data = bytearray(off)
    path.write_bytes(out + bytes(data[:offsets[-1] + tensors[-1][1]]))


def test_gguf_decode_bytes_count_the_files_own_tensors(tmp_path):
    """The llama.cpp arms' roofline is counted at their GGUF's own bytes: every tensor once, the embedding only
    where it is the head too, the MTP block never."""
    from deltaserve.bench.peers.gguf_bytes import decode_bytes_per_token, tensor_bytes

    meta = {"general.architecture": "qwen35", "qwen35.block_count": 3, "qwen35.nextn_predict_layers": 1,
            "tokenizer.ggml.tokens": ["a", "b"], "general.alignment": 32}
    tensors = [("token_embd.weight", 1000), ("blk.0.attn_q.weight", 180), ("blk.1.ffn_up.weight", 64),
               ("blk.2.nextn.eh_proj.weight", 500), ("output_norm.weight", 8), ("output.weight", 1000)]
    f = tmp_path / "m.gguf"
    _gguf(f, tensors, meta)
    sizes = tensor_bytes(str(f))
    assert sizes == {"token_embd.weight": 1024, "blk.0.attn_q.weight": 192, "blk.1.ffn_up.weight": 64,
                     "blk.2.nextn.eh_proj.weight": 512, "output_norm.weight": 32, "output.weight": 1000}
    assert decode_bytes_per_token(str(f)) == 192 + 64 + 32 + 1000
    tied = [t for t in tensors if t[0] != "output.weight"]  # no output tensor: the embedding is the head
    _gguf(f, tied, meta)
    assert decode_bytes_per_token(str(f)) == 1024 + 192 + 64 + 8
    f.write_bytes(b"GGML" + bytes(20))
    with pytest.raises(ValueError, match="not a GGUF"):
        decode_bytes_per_token(str(f))


def test_roofline_shares_never_pass_the_fastest_stream():
    """Each arm's share is at its own bytes per token; where an arm streamed faster than the bandwidth probe read,
    the ceiling is that arm's stream (it reads 100%), never a share above it; a speculative arm has none."""
    from deltaserve.bench.throughput_report import Columns, Results, _roofline_row

    r = Results()
    r.roofline["p"] = {"bytes_read": 8_000_000_000}
    r.bandwidth["read_Bps"] = 20e9
    r.arm_info.update({("p", "deltaserve-int4"): {"bytes_read": 3_200_000_000},
                       ("p", "deltaserve-int4-head"): {"bytes_read": 2_270_000_000},
                       ("p", "llama.cpp-q4_k_m"): {"bytes_read": 2_700_000_000}})
    r.best.update({("p", "decode@1", "deltaserve-int4"): 7.3, ("p", "decode@1", "deltaserve-int4-head"): 8.2,
                   ("p", "decode@1", "llama.cpp-q4_k_m"): 4.1, ("p", "decode@1", "deltaserve-int4-head-mtp2"): 40.0})
    cols = Columns(["deltaserve-int4", "deltaserve-int4-head", "llama.cpp-q4_k_m", "deltaserve-int4-head-mtp2"], [])
    line = _roofline_row(r, cols, "p")[0]
    assert "deltaserve-int4 streamed 23.4 GB/s, above the 20.0 GB/s probe" in line
    assert line.split("|")[3:7] == [" 100% of 3,200 MB ", " 80% of 2,270 MB ", " 47% of 2,700 MB ", " n/a "]
    r.bandwidth["read_Bps"] = 30e9  # a probe above every stream: the probe is the ceiling
    assert [c.split(" of ")[0] for c in _roofline_row(r, cols, "p")[0].split("|")[3:6]] == [" 78%", " 62%", " 37%"]


@pytest.mark.parametrize("signal_name", ["SIGILL", "SIGSEGV"])
def test_a_start_up_crash_is_retried_without_repacking(tmp_path, signal_name):
    """A llama-server that dies of SIGILL or SIGSEGV at start-up (ggml's AMX kernels on some VMs) is started again
    once with --no-repack, which keeps it off that path; another exit is not retried."""
    root = tmp_path / "llama"
    binary = root / "build" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text(f"""#!{sys.executable}
import http.server, os, signal, sys
if "--no-repack" not in sys.argv:
    os.kill(os.getpid(), signal.{signal_name})
port = int(sys.argv[sys.argv.index("--port") + 1])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(b"{{}}")
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
""")
    binary.chmod(0o755)
    server = lc.LlamaServer(str(tmp_path / "m.gguf"), ctx=512, slots=1, threads=1, log_path=str(tmp_path / "log"),
                            root=str(root), startup_timeout=30)
    try:
        assert server.no_repack and lc.NO_REPACK in server.cmd
    finally:
        server.close()
    binary.write_text(f"#!{sys.executable}\nimport sys\nsys.exit(3)\n")
    with pytest.raises(PeerUnavailable):
        lc.LlamaServer(str(tmp_path / "m.gguf"), ctx=512, slots=1, threads=1, log_path=str(tmp_path / "log"),
                       root=str(root), startup_timeout=30)
