"""The recording proxy (python -m deltaserve.bench.capture) in front of a stand-in upstream on loopback: the
request reaches the upstream as sent, the answer reaches the client as sent (a stream too), and one record per
exchange holds the body with the credentials redacted."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from deltaserve.bench.capture import Recorder, make_handler


class Upstream(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list[dict] = []

    def do_POST(self):
        body = self.rfile.read(int(self.headers["content-length"]))
        Upstream.seen.append({"path": self.path, "body": json.loads(body), "auth": self.headers.get("authorization")})
        if self.path.endswith("stream"):
            data = b"data: one\n\ndata: two\n\n"
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
        else:
            data = b'{"ok": true}'
            self.send_response(200)
            self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


def _serve(server):
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}"


def test_proxy_forwards_and_records(tmp_path):
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    client = httpx.Client(timeout=30)
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(_serve(upstream), Recorder(tmp_path), client, True))
    base = _serve(proxy)
    try:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 32000}
        r = httpx.post(base + "/v1/chat/completions?x=1", json=body, headers={"authorization": "Bearer sekret"})
        assert r.status_code == 200 and r.json() == {"ok": True}
        s = httpx.post(base + "/v1/stream", json={"stream": True})
        assert s.status_code == 200 and s.text == "data: one\n\ndata: two\n\n"
    finally:
        proxy.shutdown()
        upstream.shutdown()
        client.close()
    assert Upstream.seen[0] == {"path": "/v1/chat/completions?x=1", "body": body, "auth": "Bearer sekret"}
    records = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("*.json"))]
    assert len(records) == 2
    first = records[0]
    assert first["method"] == "POST" and first["path"] == "/v1/chat/completions" and first["body"] == body
    assert first["status"] == 200 and "sekret" not in json.dumps(first)
    assert "data: two" in json.dumps(records[1])
