"""OpenAI's Chat Completions and Completions routes (routes.py; its register(app, state) adds them to an app) and
their request models (protocol.py)."""
from .routes import register

__all__ = ["register"]
