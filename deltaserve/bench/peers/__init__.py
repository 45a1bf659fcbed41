"""Peers of the throughput benchmark: each arm runs the same prompts on the same checkpoint.

An arm has `name`, `prefill(prompts) -> (seconds, tokens)`, `decode(prompts, max_tokens) -> (seconds,
tokens)` (decode phase only: from the step where every stream has its first token to the end) and
`close()`. A peer that cannot start raises PeerUnavailable with the reason for the table.
"""
from __future__ import annotations


class PeerUnavailable(RuntimeError):
    """The peer cannot run here; str(exc) is the reason printed in the table."""
