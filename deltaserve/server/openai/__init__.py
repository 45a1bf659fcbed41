"""OpenAI's Chat Completions and Completions routes (routes.py) and their request models (protocol.py)."""
