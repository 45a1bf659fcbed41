"""Peers of the throughput benchmark: each arm runs the same prompts on the same checkpoint.

An arm has `name`, `prefill(prompts) -> (seconds, tokens)`, `decode(prompts, max_tokens) -> (seconds,
tokens)` (decode phase only: from the step where every stream has its first token to the end) and
`close()`. A peer that cannot start raises PeerUnavailable with the reason for the table.
"""
from __future__ import annotations

import os
import signal
import subprocess


class PeerUnavailable(RuntimeError):
    """The peer cannot run here; str(exc) is the reason printed in the table."""


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
