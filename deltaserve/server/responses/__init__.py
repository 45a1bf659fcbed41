"""OpenAI's Responses API: the routes (routes.py; its register(app, state) adds them to an app), input items to
chat messages (input.py), the delta stream to output items (output.py), the request models (protocol.py) and the
stored responses (store.py)."""
from .routes import register

__all__ = ["register"]
