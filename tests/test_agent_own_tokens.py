"""bench agents measures each server in its own tokens: llama-server's prompts are read off its /slots through the
metering proxy's hook (bench/clis/own_tokens.py), before the client can send its next request, and the report's
shares use them; a request whose prompt could not be read is left unmeasured."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from deltaserve.bench.capture import Recorder, make_handler
from deltaserve.bench.clis.own_tokens import SlotWatch
from deltaserve.bench.clis.report import analyse, format_report
from deltaserve.text.tokenizer import load_tokenizer

TOOLS = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]


class FakeLlama(BaseHTTPRequestHandler):
    """A stand-in llama-server: a prompt is its words, each word a token id; a chat request runs on slot 0 (its
    last task's prompt and counts are what /slots shows) and answers as a stream with llama-server's usage."""
    protocol_version = "HTTP/1.1"
    slots: list[dict] = []
    task = 0
    client_done = threading.Event()
    done_at_slots: list[bool] = []

    def _send(self, data: bytes, ctype: str):
        self.send_response(200)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        # a client that had the closing event would say so within this wait: a real one may send its next request
        FakeLlama.done_at_slots.append(FakeLlama.client_done.wait(0.3))
        self._send(json.dumps(FakeLlama.slots).encode(), "application/json")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if self.path == "/tokenize":
            ids = [int(w) for w in body["content"].split()]
            return self._send(json.dumps({"tokens": ids}).encode(), "application/json")
        prompt, cached = body["messages"][0]["content"], body.get("cached", 0)
        n = len(prompt.split()) + body.get("extra", 0)  # extra: a prompt whose text does not give its count
        FakeLlama.task += 1
        # llama-server resets a task's counts when it ends: /slots shows zeros beside its prompt
        FakeLlama.slots[0] = {"id": 0, "id_task": FakeLlama.task, "is_processing": False, "prompt": prompt,
                              "n_prompt_tokens_processed": 0, "n_prompt_tokens_cache": 0}
        usage = {"prompt_tokens": n, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": cached}}
        events = [{"choices": [{"delta": {"content": "hi"}}]}, {"choices": [], "usage": usage}]
        self._send(b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n",
                   "text/event-stream")

    def log_message(self, *a):
        pass


@pytest.fixture
def llama():
    FakeLlama.slots = [{"id": 0}, {"id": 1, "id_task": 0, "is_processing": False, "prompt": "9 9 9 9"}]
    FakeLlama.task, FakeLlama.done_at_slots = 0, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeLlama)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _proxy(upstream: str, tmp_path, after):
    recorder, client = Recorder(tmp_path), httpx.Client(timeout=30)
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(upstream, recorder, client, True, after=after))
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    return recorder, f"http://127.0.0.1:{proxy.server_address[1]}", proxy


def _chat(base: str, prompt: str, **extra) -> str:
    FakeLlama.client_done.clear()
    body = {"model": "m", "stream": True, "tools": TOOLS, "messages": [{"role": "user", "content": prompt}], **extra}
    lines = []
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line == "data: [DONE]":
                FakeLlama.client_done.set()  # where a client stops reading and may send its next request
            lines.append(line)
    return "\n".join(lines)


def test_the_proxy_reads_each_prompt_in_the_servers_tokens_before_the_client_has_its_answer(llama, tmp_path):
    watch = SlotWatch(llama)
    recorder, base, proxy = _proxy(llama, tmp_path, watch.after)
    try:
        assert "data: [DONE]" in _chat(base, "1 2 3 4")  # the stream reaches the client whole
        _chat(base, "1 2 3 4 5 6", cached=4)
        _chat(base, "7 8", extra=1)  # its text tokenizes to 2, the server counted 3: not its prompt
        side = {"model": "m", "messages": [{"role": "user", "content": "5"}]}  # no tools: a side request
        httpx.post(base + "/v1/chat/completions", json=side, timeout=30)
    finally:
        proxy.shutdown()
        watch.close()
    first, second, third, fourth = recorder.records
    assert first["own_ids"] == [1, 2, 3, 4] and second["own_ids"] == [1, 2, 3, 4, 5, 6]
    assert second["own_how"] == "slot 0, task 2"
    # "9 9 9 9" (slot 1's older task) has 4 tokens, not 3: no slot ran this prompt
    assert third["own_ids"] is None and third["own_how"] == "no idle slot's last prompt has the answer's 3 tokens " \
        "(theirs: [2, 4])"
    assert "own_ids" not in fourth  # side requests are not measured
    # /slots was read before each client had its whole answer, so its next request could not have started
    assert FakeLlama.done_at_slots == [False, False, False]


def test_a_slot_is_claimed_once_and_the_newest_of_equals_wins(llama):
    FakeLlama.slots = [{"id": 0, "id_task": 5, "is_processing": False, "prompt": "1 2"},
                       {"id": 1, "id_task": 7, "is_processing": False, "prompt": "3 4"},
                       {"id": 2, "id_task": 9, "is_processing": True, "prompt": "5 6"}]
    watch = SlotWatch(llama)
    try:
        assert watch.own_ids({"prompt": 2}) == ([3, 4], "slot 1, task 7")  # 9 is still running
        assert watch.own_ids({"prompt": 2}) == ([1, 2], "slot 0, task 5")
        assert watch.own_ids({"prompt": 2}) == (None, "no idle slot's last prompt has the answer's 2 tokens (theirs: [])")
        FakeLlama.slots += [{"id": 3, "id_task": 4, "is_processing": False, "prompt": "7"},
                            {"id": 4, "id_task": 3, "is_processing": False, "prompt": "8 8 8"}]
        assert watch.own_ids({"prompt": None}) == ([7], "slot 3, task 4 (the newest: the answer gave no prompt count)")
        FakeLlama.slots = [{"id": 0, "id_task": 11, "is_processing": False}]  # no LLAMA_SERVER_SLOTS_DEBUG=1
        ids, why = watch.own_ids({"prompt": 2})
        assert ids is None and "without LLAMA_SERVER_SLOTS_DEBUG=1" in why
    finally:
        watch.close()


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


def _row(session, turn, *requests):
    return {"client": "codex", "session": session, "turn": turn, "rc": 0, "wall_s": 2.0, "requests": list(requests)}


def _req(text: str, cached: int, own: bool, file: str, ttft: float = 1.0) -> dict:
    body = {"model": "m", "tools": TOOLS, "messages": [{"role": "user", "content": text}]}
    q = {"file": file, "method": "POST", "path": "/v1/chat/completions", "body": body, "status": 200,
         "first_content_s": ttft, "usage": {"prompt": None, "cached": cached, "output": 0}, "reasoned": False}
    if own:  # the server's own tokens: here the text's words, so nothing like deltaserve's rendering
        q["own_ids"] = [int(w) for w in text.split()]
    return q


def test_the_report_divides_by_what_each_servers_own_tokens_share(tok):
    """The same file names on both servers (each recorder numbers its own), different bodies: each request is
    rendered as its own server ran it. llama-server's shares use its own ids; a request it could not read is
    counted as unmeasured and gives no share."""
    ours = [_row(0, 0, _req("1 2 3 4 5 6 7 8", 0, False, "0001", 4.0)),
            _row(1, 0, _req("1 2 3 4 5 6 9 9", 0, False, "0002", 2.0))]
    peer = [_row(0, 0, _req("1 2 3 4 5 6 7 8 10 11", 0, True, "0002", 8.0)),
            _row(1, 0, _req("1 2 3 4 5 6 7 8 12", 4, True, "0001", 6.0)),
            _row(2, 0, {**_req("1 2", 0, True, "0003"), "own_ids": None})]
    result = analyse({"deltaserve": ours, "llama.cpp": peer}, tok)
    mine = result["servers"]["deltaserve"]["codex"]["turns"][1]
    assert mine["base"] > 8  # deltaserve's rendering: the template and the tool block come first
    theirs = result["servers"]["llama.cpp"]["codex"]
    t1 = theirs["turns"][1]
    assert (t1["base"], t1["share"]) == (8, 0.5)  # 8 ids shared in its tokens, 4 of them read
    assert theirs["unmeasured"] == 1 and theirs["turns"][2]["base"] is None
    assert result["peer_over_deltaserve"]["llama.cpp"]["codex"]["first_turn_ttft_s"] == 1.75  # (6 + 1) / 2 over 2
    text = format_report(result, {"sessions": 3, "turns": 1, "model": "m", "model_dir": "-", "max_output_tokens": 16})
    assert "llama.cpp / deltaserve, the same client's runs" in text
    assert "- llama.cpp: the prompt it ran (tokens: its /slots text through its /tokenize)" in text
    assert "could not be read in its tokens (left out of the shares): 1." in text
    assert "- deltaserve: its own rendering" in text and "x-anthropic-billing-header" in text


def test_the_report_gives_the_checkpoints_each_deltaserve_turn_saved(tok):
    """The checkpoints a turn saved (read off /metrics around it) per turn and as a client's mean per kind of turn;
    a server that publishes none (llama-server) shows '-'."""
    spend = [{"by_kind": {"structural": 3, "prompt": 1}, "count": 4, "mb": 80.0},
             {"by_kind": {"learned": 1}, "count": 1, "mb": 20.0}, {"by_kind": {}, "count": 0, "mb": 0.0}]
    ours = [{**_row(s, t, _req("1 2 3", 0, False, f"000{s}{t}")), "checkpoints": c}
            for (s, t), c in zip(((0, 0), (1, 0), (0, 1)), spend)]
    peer = [_row(0, 0, _req("1 2 3", 0, True, "0001"))]
    result = analyse({"deltaserve": ours, "llama.cpp": peer}, tok)
    assert result["servers"]["deltaserve"]["codex"]["checkpoint_mb"] == {"session1": 80.0, "first": 20.0,
                                                                         "later": 0.0}
    text = format_report(result, {"sessions": 2, "turns": 2, "model": "m", "model_dir": "-", "max_output_tokens": 16})
    assert "| 80.0, 20.0, 0.0 |" in text and "| 4 (structural 3, prompt 1), 80.0 MB |" in text
    assert text.count("| llama.cpp | codex | 1/1 |") == 1 and "| - |" in text.split("| llama.cpp | codex | 1/1 |")[1]


def test_a_turns_checkpoints_are_read_off_the_servers_metrics():
    """bench agents' reading of deltaserve's /metrics around a turn: the checkpoints saved by kind and their bytes
    (each the kept checkpoints' bytes over their count), against the real engine."""
    from deltaserve.bench.clis import saved
    from deltaserve.config import EngineConfig
    from deltaserve.server import build_app
    from tests.server_support import InProcessServer, wait_healthy

    srv = InProcessServer(build_app(EngineConfig(kv_cache_memory=16 << 20), accept_any_model_name=True))
    try:
        wait_healthy(srv.base, timeout=240)
        before = saved.read(srv.base)
        assert before == {"saved": {}, "bytes_each": None} or sum(before["saved"].values()) == 0
        words = " ".join(f"word{i}" for i in range(400))
        r = httpx.post(srv.base + "/v1/chat/completions", timeout=120, json={
            "model": "m", "max_tokens": 1, "messages": [{"role": "system", "content": "You help."},
                                                         {"role": "user", "content": words}]})
        assert r.status_code == 200, r.text
        after = saved.read(srv.base)
        spent = saved.spent(before, after)
        assert spent["count"] >= 2 and spent["count"] == sum(after["saved"].values())
        assert after["bytes_each"] > 0 and spent["mb"] == round(spent["count"] * after["bytes_each"] / 1e6, 1)
        assert saved.spent(after, saved.read(srv.base)) == {"by_kind": {}, "count": 0, "mb": 0.0}
    finally:
        srv.stop()
