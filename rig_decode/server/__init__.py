"""OpenAI-compatible HTTP server (``rig serve``): FastAPI shim over the engine."""

from .app import create_app

__all__ = ["create_app"]
