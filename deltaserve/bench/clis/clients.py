"""The four coding-agent CLIs as a user points them at an OpenAI / Anthropic compatible server, headless: where
scripts/setup_agents.sh installs each, the settings and files that aim it at a base URL, and the command of a
session's first and of its continued turns.

A session is a working directory of its own. The sessions of one client share a home, as one user's sessions do
(the CLIs keep their settings, caches and conversations there, and some write paths under it into the system
prompt: a home per session would make every session's prompt differ there), where the CLI's "continue" picks the
newest conversation of the working directory (`claude -c`, `codex exec resume --last`, `qwen -c`); opencode's
`run -c` continues the newest conversation of the project, and a folder outside git is one global project, so its
sessions keep a home each. The model is asked for as `deltaserve`.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ...home import home

MODEL = "deltaserve"
CODEX_CONFIG = """model = "{model}"
model_provider = "deltaserve"
[model_providers.deltaserve]
name = "deltaserve"
base_url = "{base}/v1"
wire_api = "responses"
env_key = "DELTASERVE_API_KEY"
"""


def agents_bin() -> str:
    """The folder scripts/setup_agents.sh puts the CLIs' commands in."""
    return os.path.join(home(), "agents", "node_modules", ".bin")


@dataclass(frozen=True)
class Client:
    name: str  # the command: claude, codex, qwen, opencode
    label: str  # what users call it
    api: str  # the path of its main requests
    shares_home: bool  # its sessions share one home (its "continue" is scoped by working directory)

    def command(self) -> str:
        return os.path.join(agents_bin(), self.name)

    def installed(self) -> bool:
        return os.access(self.command(), os.X_OK)

    def prepare(self, base: str, session: str, home_dir: str | None = None) -> dict[str, str]:
        """Write the client's settings for a session folder (work/ below it) aimed at base (no trailing slash), with
        home_dir as its home (default: home/ in the session folder); the environment to run it with."""
        work, home_dir = os.path.join(session, "work"), home_dir or os.path.join(session, "home")
        os.makedirs(work, exist_ok=True)
        os.makedirs(home_dir, exist_ok=True)
        env = {"PATH": os.environ.get("PATH", ""), "HOME": home_dir}
        if self.name == "claude":
            return env | {"ANTHROPIC_BASE_URL": base, "ANTHROPIC_API_KEY": "x", "ANTHROPIC_MODEL": MODEL}
        if self.name == "codex":
            codex_home = os.path.join(home_dir, ".codex")
            os.makedirs(codex_home, exist_ok=True)
            with open(os.path.join(codex_home, "config.toml"), "w") as f:
                f.write(CODEX_CONFIG.format(model=MODEL, base=base))
            return env | {"CODEX_HOME": codex_home, "DELTASERVE_API_KEY": "x"}
        if self.name == "qwen":
            return env | {"OPENAI_BASE_URL": base + "/v1", "OPENAI_API_KEY": "x", "OPENAI_MODEL": MODEL}
        config = {"provider": {"deltaserve": {"npm": "@ai-sdk/openai-compatible", "name": "deltaserve",
                                              "options": {"baseURL": base + "/v1", "apiKey": "x"},
                                              "models": {MODEL: {"name": MODEL}}}},
                  "model": f"deltaserve/{MODEL}"}
        path = os.path.join(session, "opencode.json")
        with open(path, "w") as f:
            json.dump(config, f)
        return env | {"OPENCODE_CONFIG": path, "OPENCODE_DISABLE_MODELS_FETCH": "true"}

    def argv(self, prompt: str, continued: bool) -> list[str]:
        """The headless command of one turn; continued: the session's latest conversation goes on."""
        cmd = self.command()
        if self.name == "claude":
            return [cmd, *(["-c"] if continued else []), "-p", prompt]
        if self.name == "codex":
            return [cmd, "exec", "--skip-git-repo-check", *(["resume", "--last"] if continued else []), prompt]
        if self.name == "qwen":
            return [cmd, *(["-c"] if continued else []), prompt]
        return [cmd, "run", *(["-c"] if continued else []), prompt]


CLIENTS = {c.name: c for c in (Client("claude", "Claude Code", "/v1/messages", True),
                               Client("codex", "Codex CLI", "/v1/responses", True),
                               Client("qwen", "Qwen Code", "/v1/chat/completions", True),
                               Client("opencode", "opencode", "/v1/chat/completions", False))}
