"""deltaserve as every benchmark runs it, from one dict of EngineConfig keyword arguments (model, preset,
kv_cache_memory, ...): in this process (`in_process`: the LLM, its engine at .engine, for the arms that time
engine steps) or as a server (`DeltaserveServer`: `python -m deltaserve serve` in a process of its own, the same
dict as flags through config.engine_argv, waited for on /health, stopped with its process group). A peer served
over HTTP is measured against the server, not against an in-process engine."""
from __future__ import annotations

import subprocess
import sys
import time

from ..config import engine_argv
from .peers import free_port, post_json, stop_group, wait_healthy


def in_process(engine: dict):
    """deltaserve in this process: the LLM (engine/llm.py) of these EngineConfig keyword arguments."""
    from ..engine.llm import LLM  # imports torch: only once the caller has set its OMP_* environment

    return LLM(**engine)


class DeltaserveServer:
    """`deltaserve serve` on 127.0.0.1: base is its URL; engine: EngineConfig keyword arguments (model, preset,
    kv_cache_memory, ...); extra: other serve flags (--served-model-name, ...)."""

    def __init__(self, engine: dict, log_path: str, extra: tuple[str, ...] = (), startup_timeout: float = 600.0):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "deltaserve", "serve", "--port", str(self.port), *engine_argv(engine),
                    *extra]
        self._log = open(log_path, "a", buffering=1)  # noqa: SIM115 - lives as long as the server
        self._log.write(f"===== {time.strftime('%F %T')} {' '.join(self.cmd)}\n")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        why = wait_healthy(self.proc, self.base + "/health", startup_timeout)
        if why is not None:
            self.close()
            raise RuntimeError(f"deltaserve {why} at start-up (log: {log_path})")

    def post(self, path: str, body: dict, timeout: float = 3600.0) -> dict:
        return post_json(self.base, path, body, "deltaserve", timeout)

    def close(self) -> None:
        stop_group(self.proc)
        if not self._log.closed:
            self._log.close()
