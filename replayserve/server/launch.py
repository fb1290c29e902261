"""Runs the app under uvicorn until SIGTERM or SIGINT, then shuts down gracefully: no new
requests, in-flight ones finish (or are aborted after ``shutdown_timeout`` seconds), exit 0."""

from __future__ import annotations

import logging
import signal
from types import FrameType

import uvicorn
from fastapi import FastAPI

logger = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn's server that also marks the app draining on the first signal, so a request that
    arrives on an open connection during shutdown is answered 503 instead of started."""

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self._app = app

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._app.state.draining = True
        super().handle_exit(sig, frame)


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, shutdown_timeout: float = 10.0,
          log_level: str = "info") -> None:
    """Serves ``app`` until SIGTERM/SIGINT; returns once it has shut down."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=max(1, round(shutdown_timeout)))
    # uvicorn re-raises the signal it caught once it has shut down, to the handlers that were in
    # place before it: with the defaults SIGTERM would then kill the process (status -15) and SIGINT
    # raise KeyboardInterrupt. These no-op handlers make a graceful shutdown a normal return.
    previous = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        _Server(config, app).run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    logger.info("replayserve server stopped")


def _ignore(sig: int, frame: FrameType | None) -> None:
    pass
