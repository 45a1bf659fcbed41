"""The real coding-agent CLIs against a real server: each completes a headless turn (slow; skipped where
scripts/setup_agents.sh has not installed them under $DELTASERVE_HOME/agents).

The server runs the embedded tiny model with `--accept-any-model-name`, as a user would point each CLI at it
(docs/agents.md); each CLI runs in a fresh working directory and home. The tiny model's random
weights answer nonsense: what is checked is that every turn ends with exit status 0 and that the engine
finished the CLI's requests.
"""
from __future__ import annotations

import subprocess

import httpx
import pytest
from server_support import RealServer

from deltaserve.bench.clis.clients import CLIENTS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    srv = RealServer("--served-model-name", "deltaserve", "--accept-any-model-name",
                     "--kv-cache-memory", "512M")  # room for a 30K-token agent prompt and its answer
    yield srv
    srv.stop()


@pytest.mark.parametrize("name", ["claude", "codex", "qwen", "opencode"])
def test_cli_completes_a_turn(server, tmp_path, name):
    client = CLIENTS[name]
    if not client.installed():
        pytest.skip(f"{name} is not installed (scripts/setup_agents.sh)")
    env = client.prepare(server.base, str(tmp_path))
    before = _finished(server)
    r = subprocess.run(client.argv("say hi", continued=False), cwd=tmp_path / "work", env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, f"{name} exited {r.returncode}: {r.stderr[-2000:]}"
    assert _finished(server) > before, f"{name} exited 0 but the engine finished no request of it"


def _finished(server) -> float:
    """Requests the engine finished, from /metrics (vllm:request_success, every finish reason)."""
    text = httpx.get(server.base + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))
