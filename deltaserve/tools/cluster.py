"""N replicas behind vllm-router's kv_aware policy, on one machine, loopback only (docs/cluster.md).

    python -m deltaserve.tools.cluster --replicas 2 [--port 8000] [--base-port 8100] [--policy kv_aware]
                                 [-- deltaserve serve flags for every replica ...]
    scripts/serve_cluster.sh 2 -- --kv-cache-memory 1G

Replica i serves on 127.0.0.1:(base-port + i) and publishes its KV events on 127.0.0.1:(base-port + 100 + i);
the router listens on 127.0.0.1:port and reads each replica's event block size (the checkpoint grid) from its
/metrics, so its --kv-event-block-size always matches. Everything stops on Ctrl-C or when one process exits.
The tests start the same processes through `Cluster`.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

HOST = "127.0.0.1"


def _get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except Exception as e:  # noqa: BLE001 - not up yet
        return getattr(e, "code", 0) or 0, ""


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {proc.returncode}")
        if _get(url + "/health")[0] == 200:
            return
        time.sleep(0.25)
    raise TimeoutError(f"{url} did not become healthy in {timeout:.0f}s")


def metric(text: str, name: str) -> float | None:
    """The value of an unlabelled-or-labelled sample `name{...} value` in Prometheus text (the first one)."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def find_router() -> str | None:
    """vllm-router beside this interpreter (a venv's bin/, which need not be on PATH: `make test` runs
    .venv/bin/python without activating it), else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "vllm-router")
    return beside if os.access(beside, os.X_OK) else shutil.which("vllm-router")


def router_command(worker_urls: list[str], event_endpoints: list[str], block_size: int, model: str, port: int,
                   prometheus_port: int, policy: str = "kv_aware", router: str | None = None) -> list[str]:
    exe = router or find_router()
    if exe is None:
        raise RuntimeError("vllm-router is not installed (pip install vllm-router; the test extra has it)")
    cmd = [exe, "--host", HOST, "--port", str(port), "--worker-urls", *worker_urls, "--policy", policy,
           "--prometheus-host", HOST, "--prometheus-port", str(prometheus_port)]
    if policy == "kv_aware":
        for url, ep in zip(worker_urls, event_endpoints):
            cmd += ["--kv-event-source", f"{url}={ep}"]
        cmd += ["--kv-event-block-size", str(block_size), "--kv-event-model", model]
    return cmd


class Cluster:
    """Replicas (`deltaserve serve` subprocesses with --kv-events-endpoint) and the router in front of them."""

    def __init__(self, replicas: int, ports: list[int], event_ports: list[int], router_port: int,
                 prometheus_port: int, serve_args: list[str] = (), policy: str = "kv_aware",
                 log_dir: str | None = None, timeout: float = 300.0, env: dict | None = None):
        assert replicas >= 1 and len(ports) >= replicas and len(event_ports) >= replicas
        self.urls = [f"http://{HOST}:{p}" for p in ports[:replicas]]
        self.event_endpoints = [f"tcp://{HOST}:{p}" for p in event_ports[:replicas]]
        self.router_url = f"http://{HOST}:{router_port}"
        self.prometheus_url = f"http://{HOST}:{prometheus_port}"
        self.procs: list[subprocess.Popen] = []
        self.logs: list[str] = []
        self._files = []
        log_dir = log_dir or os.environ.get("TMPDIR", "/tmp")
        e = dict(os.environ)
        e.update(env or {})
        try:
            for i, (url, ep) in enumerate(zip(self.urls, self.event_endpoints)):
                port = url.rsplit(":", 1)[1]
                cmd = [sys.executable, "-m", "deltaserve.server", "--host", HOST, "--port", port,
                       "--kv-events-endpoint", ep, *serve_args]
                self._spawn(cmd, os.path.join(log_dir, f"deltaserve-replica-{port}.log"), e)
            for k, url in enumerate(self.urls):
                self._wait(k, url, timeout)
            metrics = _get(self.urls[0] + "/metrics")[1]
            self.block_size = int(metric(metrics, "deltaserve_kv_event_block_size") or 0)
            self.model = json.loads(_get(self.urls[0] + "/v1/models")[1])["data"][0]["id"]
            if not self.block_size:
                raise RuntimeError("the replica publishes no KV events block size (is --checkpoint-grid 0?)")
            cmd = router_command(self.urls, self.event_endpoints, self.block_size, self.model, router_port,
                                 prometheus_port, policy)
            self._spawn(cmd, os.path.join(log_dir, f"vllm-router-{router_port}.log"), e)
            self._wait(len(self.procs) - 1, self.router_url, 60.0)
        except BaseException:
            self.stop()
            raise

    def _wait(self, k: int, url: str, timeout: float) -> None:
        """Wait for process k to answer at url; one that exits fails with the end of its log (why it stopped: a
        port in use, a bad flag)."""
        try:
            wait_healthy(url, self.procs[k], timeout)
        except RuntimeError as e:
            with open(self.logs[k], errors="replace") as f:
                tail = "".join(f.readlines()[-5:])
            raise RuntimeError(f"{e}; the end of its log ({self.logs[k]}):\n{tail}") from None

    def _spawn(self, cmd: list[str], log_path: str, env: dict) -> None:
        f = open(log_path, "w")
        self._files.append(f)
        self.logs.append(log_path)
        self.procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env))

    def router_metrics(self) -> str:
        return _get(self.prometheus_url + "/metrics")[1]

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        for f in self._files:
            f.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    serve_args: list[str] = []
    if "--" in argv:
        k = argv.index("--")
        argv, serve_args = argv[:k], argv[k + 1:]
    p = argparse.ArgumentParser(prog="python -m deltaserve.tools.cluster", description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--port", type=int, default=8000, help="the router's port")
    p.add_argument("--base-port", type=int, default=8100, help="replica i serves on base-port + i, publishes "
                   "KV events on base-port + 100 + i")
    p.add_argument("--prometheus-port", type=int, default=29000, help="the router's metrics")
    p.add_argument("--policy", default="kv_aware", help="vllm-router --policy (kv_aware reads the KV events)")
    p.add_argument("--log-dir", default=".", help="where each process's log goes")
    args = p.parse_args(argv)
    if args.replicas < 1:
        p.error("--replicas must be >= 1")
    n = args.replicas
    c = Cluster(n, [args.base_port + i for i in range(n)], [args.base_port + 100 + i for i in range(n)], args.port,
                args.prometheus_port, serve_args, args.policy, args.log_dir)
    print(f"router on {c.router_url} (metrics {c.prometheus_url}/metrics), replicas {' '.join(c.urls)}, "
          f"KV event block {c.block_size} tokens; logs in {args.log_dir}", flush=True)
    stop = {"now": False}

    def on_signal(*_):
        stop["now"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        while not stop["now"] and c.alive():
            time.sleep(0.5)
    finally:
        c.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
