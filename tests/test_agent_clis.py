"""The real coding-agent CLIs against a real server: each completes a headless turn (slow; skipped where
scripts/setup_agents.sh has not installed them under $DELTASERVE_HOME/agents).

The server runs the embedded tiny model with `--accept-any-model-name`, as a user would point each CLI at it
(README.md, "Coding agents"); each CLI runs in a fresh working directory and home. The tiny model's random
weights answer nonsense: what is checked is that every turn ends with exit status 0 and that the engine
finished the CLI's requests.
"""
from __future__ import annotations

import json
import os
import subprocess

import httpx
import pytest
from server_support import RealServer

pytestmark = pytest.mark.slow

AGENTS = os.path.join(os.environ.get("DELTASERVE_HOME", os.path.expanduser("~/.cache/deltaserve")), "agents",
                      "node_modules", ".bin")
CODEX_CONFIG = """model = "deltaserve"
model_provider = "deltaserve"
[model_providers.deltaserve]
name = "deltaserve"
base_url = "{base}/v1"
wire_api = "responses"
env_key = "DELTASERVE_API_KEY"
"""


def _cli(name: str) -> str:
    path = os.path.join(AGENTS, name)
    if not os.path.exists(path):
        pytest.skip(f"{name} is not installed (scripts/setup_agents.sh)")
    return path


@pytest.fixture(scope="module")
def server():
    srv = RealServer("--served-model-name", "deltaserve", "--accept-any-model-name",
                     "--kv-cache-memory", "512M")  # room for a 30K-token agent prompt and its answer
    yield srv
    srv.stop()


def _run(tmp_path, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    full_env = {"PATH": os.environ["PATH"], "HOME": str(home), **env}
    return subprocess.run(argv, cwd=work, env=full_env, capture_output=True, text=True, timeout=600)


def _setup(name: str, base: str, tmp_path) -> tuple[list[str], dict[str, str]]:
    if name == "claude":
        return [_cli("claude"), "-p", "say hi"], {"ANTHROPIC_BASE_URL": base, "ANTHROPIC_API_KEY": "x"}
    if name == "codex":
        (tmp_path / "codex").mkdir()
        (tmp_path / "codex" / "config.toml").write_text(CODEX_CONFIG.format(base=base))
        return ([_cli("codex"), "exec", "--skip-git-repo-check", "say hi"],
                {"CODEX_HOME": str(tmp_path / "codex"), "DELTASERVE_API_KEY": "x"})
    if name == "qwen":
        return [_cli("qwen"), "say hi"], {"OPENAI_BASE_URL": base + "/v1", "OPENAI_API_KEY": "x",
                                          "OPENAI_MODEL": "deltaserve"}
    config = {"provider": {"deltaserve": {"npm": "@ai-sdk/openai-compatible", "name": "deltaserve",
                                          "options": {"baseURL": base + "/v1", "apiKey": "x"},
                                          "models": {"deltaserve": {"name": "deltaserve"}}}},
              "model": "deltaserve/deltaserve"}
    (tmp_path / "opencode.json").write_text(json.dumps(config))
    return [_cli("opencode"), "run", "say hi"], {"OPENCODE_CONFIG": str(tmp_path / "opencode.json"),
                                                  "OPENCODE_DISABLE_MODELS_FETCH": "true"}


@pytest.mark.parametrize("name", ["claude", "codex", "qwen", "opencode"])
def test_cli_completes_a_turn(server, tmp_path, name):
    argv, env = _setup(name, server.base, tmp_path)
    before = _finished(server)
    r = _run(tmp_path, argv, env)
    assert r.returncode == 0, f"{name} exited {r.returncode}: {r.stderr[-2000:]}"
    assert _finished(server) > before, f"{name} exited 0 but the engine finished no request of it"


def _finished(server) -> float:
    """Requests the engine finished, from /metrics (vllm:request_success, every finish reason)."""
    text = httpx.get(server.base + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))
