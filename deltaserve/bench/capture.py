"""A recording proxy: what a client (a coding-agent CLI) really sends to a server, one JSON file per exchange.

    python -m deltaserve.bench.capture --port 8100 --upstream http://127.0.0.1:8000 --out DIR

Point the client at http://127.0.0.1:8100 instead of the server. Every request (any method, any path) is
forwarded to --upstream as it came; the response goes back as it arrives, so a streamed answer stays
streamed. Each exchange becomes DIR/NNNN-METHOD-path.json: method, path, query, request headers (the values
of credentials redacted), the request body (parsed when it is JSON), the response status and headers, and
the response body (parsed when JSON; for an event stream its first 64 KiB as text).

Stdlib threads + httpx: a capture tool must not need the server's own stack, and a thread per connection is
plenty for one client at a time.
"""
from __future__ import annotations

import argparse
import base64
import itertools
import json
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from .natural_stop import LineRewriter, rewrite_whole
from .stream_meter import StreamMeter

STREAM_KEEP = 64 * 1024
REDACTED = {"authorization", "x-api-key", "proxy-authorization", "cookie", "chatgpt-account-id"}
# hop-by-hop headers belong to one connection; httpx and this server set their own
# (this server already answered a client's Expect: 100-continue)
HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection",
       "host", "content-length", "expect"}


def _decode(raw: bytes, content_type: str):
    """JSON when it parses, else text, else base64: a fixture keeps every byte the client sent."""
    if not raw:
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return {"base64": base64.b64encode(raw).decode()}
    if "json" in content_type or text.lstrip()[:1] in ("{", "["):
        try:
            return json.loads(text)
        except ValueError:
            pass
    return text


class Recorder:
    """Numbers the exchanges in arrival order and writes each one out; `records` keeps them, in the order they
    ended, for a caller in the same process (bench agents)."""

    def __init__(self, out: Path):
        self.out = out
        self.out.mkdir(parents=True, exist_ok=True)
        self._seq = itertools.count(1)
        self._lock = threading.Lock()
        self.records: list[dict] = []

    def next_name(self, method: str, path: str) -> str:
        with self._lock:
            n = next(self._seq)
        slug = re.sub(r"[^A-Za-z0-9]+", "_", path).strip("_")[:60] or "root"
        return f"{n:04d}-{method}-{slug}.json"

    def write(self, name: str, record: dict) -> None:
        (self.out / name).write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
        with self._lock:
            self.records.append({**record, "file": name})


BUDGETS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def cap_budget(raw: bytes, cap: int) -> tuple[bytes, int | None]:
    """The request body with its output budget lowered to cap (the three APIs' names for it), and the budget the
    client asked for where it was lowered (else None). A body that is not a JSON object passes unchanged.

    Why a proxy caps it: llama-server's -n is a default that a request's own max_tokens overrides, so a bench
    that must bound every answer on every server (random weights never stop on their own) bounds it here."""
    if cap <= 0 or not raw:
        return raw, None
    try:
        body = json.loads(raw)
    except ValueError:
        return raw, None
    if not isinstance(body, dict):
        return raw, None
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and isinstance(thinking.get("budget_tokens"), int):
        cap = max(cap, thinking["budget_tokens"] + 1)  # Anthropic: max_tokens must stay above the thinking budget
    asked = {k: body[k] for k in BUDGETS if isinstance(body.get(k), int) and body[k] > cap}
    if not asked:
        return raw, None
    body.update({k: cap for k in asked})
    return json.dumps(body, ensure_ascii=False).encode(), max(asked.values())


def make_handler(upstream: str, recorder: Recorder, client: httpx.Client, quiet: bool, cap_output: int = 0,
                 natural_stop: bool = False, after=None):
    """The proxy's request handler; cap_output > 0 lowers every request's output budget to it (cap_budget);
    natural_stop presents a budget-cut answer as one the model ended (bench/natural_stop.py). The record keeps
    the answer as the server sent it. after(record) -> dict, when given, runs once the whole answer has come from
    the server and before its end reaches the client (so the client's next request has not started): what it
    returns joins the record (bench agents reads llama-server's own prompt there)."""
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive and chunked replies, as the clients expect

        def _read_body(self) -> bytes:
            if self.headers.get("transfer-encoding", "").lower() == "chunked":
                parts = []
                while (size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)):
                    parts.append(self.rfile.read(size))
                    self.rfile.readline()
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return b"".join(parts)
            return self.rfile.read(int(self.headers.get("content-length") or 0))

        def _send_chunk(self, data: bytes) -> None:
            if data:  # an empty chunk would end the chunked reply early
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

        def _exchange(self) -> None:
            started = time.time()
            meter = StreamMeter()
            body = self._read_body()
            path, _, query = self.path.partition("?")
            name = recorder.next_name(self.command, path)
            record = {
                "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
                "method": self.command, "path": path, "query": query,
                "headers": {k: ("<redacted>" if k.lower() in REDACTED else v) for k, v in self.headers.items()},
                "body": _decode(body, self.headers.get("content-type", "")),
            }
            body, asked = cap_budget(body, cap_output)
            if asked is not None:
                record["budget_capped_from"] = asked
            headers = [(k, v) for k, v in self.headers.items() if k.lower() not in HOP]
            try:
                req = client.build_request(self.command, upstream + self.path, headers=headers, content=body)
                # httpx adds its own defaults (user-agent, accept-encoding): the server must see only the client's
                sent = {k.lower() for k, _ in headers} | {"host", "content-length"}
                for k in [k for k in req.headers if k.lower() not in sent]:
                    del req.headers[k]
                resp = client.send(req, stream=True)
            except httpx.HTTPError as e:
                record.update(status=502, response_body=f"upstream unreachable: {e}")
                recorder.write(name, record)
                self.send_error(502, "upstream unreachable")
                return
            ctype = resp.headers.get("content-type", "")
            streamed = "event-stream" in ctype or "ndjson" in ctype
            meter.streamed = streamed
            kept = bytearray()
            rewritten = False
            finished = False
            try:
                # send_response_only: the upstream's own date and server headers go through, not a second pair
                self.send_response_only(resp.status_code)
                for k, v in resp.headers.multi_items():
                    if k.lower() not in HOP:
                        self.send_header(k, v)
                bodiless = self.command == "HEAD" or resp.status_code in (204, 304)
                # a compressed answer passes untouched: rewriting needs its text
                rewrite = natural_stop and not bodiless and not resp.headers.get("content-encoding")
                lines = LineRewriter() if rewrite and streamed else None
                if not bodiless:
                    self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                # raw bytes: the client gets exactly what the server sent (compressed or not), but for the
                # natural_stop rewrite, which holds a whole answer back until its end and a stream line by line;
                # with an after hook the last piece waits for it: a stream's closing event ends in that piece
                held = b""
                for chunk in () if bodiless else resp.iter_raw():
                    if not chunk:
                        continue  # an empty chunk would end the chunked reply early
                    meter.feed(chunk)
                    if not streamed:
                        kept += chunk  # a whole answer is kept whole, a stream only its start
                    elif len(kept) < STREAM_KEEP:
                        kept += chunk[: STREAM_KEEP - len(kept)]
                    if rewrite and not streamed:
                        continue  # sent whole, rewritten, below
                    out = lines.feed(chunk) if lines else chunk
                    if after is not None:
                        out, held = held, out
                    self._send_chunk(out)
                meter.finish()
                finished = True
                if after is not None:
                    record.update(after({**record, "status": resp.status_code, "usage": vars(meter.usage)}))
                    self._send_chunk(held)
                if lines:
                    self._send_chunk(lines.finish())
                    rewritten = lines.changed
                elif rewrite:
                    out = rewrite_whole(bytes(kept))
                    self._send_chunk(out)
                    rewritten = out != kept
                if not bodiless:
                    self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                record["client_disconnected"] = True
                self.close_connection = True
            finally:
                resp.close()
                if not finished:
                    meter.finish()
                record.update(status=resp.status_code, response_headers=dict(resp.headers), streamed=streamed,
                              seconds=round(time.time() - started, 3), first_content_s=meter.first_content_s,
                              stop_rewritten=rewritten,
                              usage=vars(meter.usage), reasoned=meter.reasoned,
                              response_body=kept.decode("utf-8", "replace") if streamed
                              else _decode(bytes(kept), ctype))
                recorder.write(name, record)
                if not quiet:
                    print(f"[capture] {self.command} {self.path} -> {resp.status_code} ({name})",
                          file=sys.stderr, flush=True)

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _exchange

        def log_message(self, format, *args):  # the one line per exchange above says enough
            pass

    return Handler


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deltaserve.bench.capture", description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--upstream", default="http://127.0.0.1:8000", help="the server the requests go to")
    ap.add_argument("--out", required=True, type=Path, help="folder for one JSON file per exchange")
    ap.add_argument("--quiet", action="store_true", help="no line per exchange on stderr")
    ap.add_argument("--cap-output", type=int, default=0, help="lower every request's output budget to N (0: off)")
    ap.add_argument("--natural-stop", action="store_true",
                    help="present budget-cut answers as ended by the model (for random weights)")
    args = ap.parse_args(argv)
    # no read timeout: a slow first token on a CPU server is not an error; no decoding: bytes pass through
    client = httpx.Client(timeout=httpx.Timeout(30.0, read=None), follow_redirects=False)
    server = ThreadingHTTPServer((args.host, args.port),
                                 make_handler(args.upstream.rstrip("/"), Recorder(args.out), client, args.quiet,
                                              args.cap_output, args.natural_stop))
    server.daemon_threads = True  # an open keep-alive connection must not hold up Ctrl-C
    print(f"[capture] http://{args.host}:{args.port} -> {args.upstream}, recording into {args.out}",
          file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
