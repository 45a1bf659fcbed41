"""Anthropic's Messages API: the routes (routes.py; its register(app, state) adds them to an app), messages to
chat messages (input.py), the delta stream to content blocks (output.py) and the request models (protocol.py)."""
from .routes import register

__all__ = ["register"]
