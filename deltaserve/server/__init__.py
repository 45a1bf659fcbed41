"""The OpenAI-compatible server: `deltaserve serve` (cli.main) and build_app for embedding or tests."""
from .app import build_app
from .cli import main

__all__ = ["build_app", "main"]
