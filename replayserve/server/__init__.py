"""An OpenAI-compatible HTTP server over the engine: `create_app` builds the FastAPI app for a
loaded `LLM`, `serve` runs it under uvicorn (`replayserve serve` on the command line)."""

from __future__ import annotations

from replayserve.server.app import create_app
from replayserve.server.launch import serve

__all__ = ["create_app", "serve"]
