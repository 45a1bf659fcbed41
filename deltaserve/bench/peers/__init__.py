"""Peers of the throughput benchmark: each arm runs the same prompts on the same checkpoint.

An arm has `name`, `prefill(prompts) -> (seconds, tokens)`, `decode(prompts, max_tokens) -> (seconds,
tokens)` (decode phase only: from the step where every stream has its first token to the end) and
`close()`. A peer that cannot start raises PeerUnavailable with the reason for the table.
"""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request


class PeerUnavailable(RuntimeError):
    """The peer cannot run here; str(exc) is the reason printed in the table."""


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, for a server this process is about to start. Picked below the kernel's
    ephemeral range where there is room: a port from bind(0) is one the kernel also hands to outgoing connections,
    and a busy neighbour's HTTP clients (another test worker) took such a port between the pick and the server's
    bind. Nothing can hold a port for another process, so a caller that starts a server still checks it came up."""
    lo, _ = _ephemeral_range()
    if lo > 12000:
        for port in random.sample(range(10000, lo), 50):
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def post_json(base: str, path: str, body: dict, who: str, timeout: float = 3600.0) -> dict:
    """POST a JSON body to a benchmark's server, its JSON answer; RuntimeError naming `who`, the status and the start
    of the body otherwise."""
    import json

    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{who} {path}: HTTP {e.code}: {e.read()[:300]!r}") from None


def wait_healthy(p: subprocess.Popen, url: str, timeout: float) -> str | None:
    """Wait until the server process p answers GET url 200: None, or why not ("exited (rc)", "not ready within
    N s"). Every server a benchmark starts (llama-server, deltaserve serve) is waited for here."""
    t0 = time.time()
    while True:
        if p.poll() is not None:
            return f"exited ({p.returncode})"
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return None
        except (urllib.error.URLError, OSError):
            pass
        if time.time() - t0 > timeout:
            return f"not ready within {timeout:.0f}s"
        time.sleep(0.2)


def stop_group(p: subprocess.Popen, grace_s: float = 15.0) -> None:
    """End a peer server started with start_new_session=True and everything it spawned: SIGTERM to its process
    group, SIGKILL if it is still there after grace_s."""
    if p.poll() is not None:
        return
    try:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(timeout=grace_s)
    except Exception:  # noqa: BLE001
        try:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=5)
        except Exception:  # noqa: BLE001, S110 - already gone
            pass
