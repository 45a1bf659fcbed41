"""Anthropic's Messages API: the routes (routes.py), messages to chat messages (input.py), the delta stream to
content blocks (output.py) and the request models (protocol.py)."""
