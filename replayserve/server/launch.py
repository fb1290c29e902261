"""Runs the app under uvicorn until SIGTERM or SIGINT, then shuts down gracefully: no new
requests, in-flight ones finish, and those still running after ``shutdown_timeout`` seconds end
with OpenAI's error body (or an error event and ``data: [DONE]`` in a stream); then it returns.
It also returns, at once, if the engine core dies."""

from __future__ import annotations

import logging
import signal
from types import FrameType

import uvicorn
from fastapi import FastAPI

logger = logging.getLogger(__name__)

# Seconds uvicorn waits, past the shutdown timeout, for handlers to write the errors of the requests
# the timeout failed, before it cancels them.
_WRITE_ERRORS_S = 2.0


class _Server(uvicorn.Server):
    """uvicorn's server that also marks the app draining on the first signal, so a request that
    arrives on an open connection during shutdown is answered 503 instead of started."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, shutdown_timeout: float) -> None:
        super().__init__(config)
        self._app = app
        self._shutdown_timeout = shutdown_timeout

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        state = self._app.state
        if not state.draining and getattr(state, "loop", None) is not None:
            # After the timeout the requests still in flight fail: their handlers write a proper
            # error while uvicorn still lets them (its own deadline is later), instead of being cut.
            why = f"the server is shutting down and this request did not finish within {self._shutdown_timeout:g} s"
            state.loop.call_soon_threadsafe(state.loop.call_later, self._shutdown_timeout, state.engine.fail_all, why)
        state.draining = True
        super().handle_exit(sig, frame)


def serve(app: FastAPI, keep_alive_timeout: float, host: str = "127.0.0.1", port: int = 8000,
          shutdown_timeout: float = 10.0, log_level: str = "info") -> bool:
    """Serves ``app`` until SIGTERM/SIGINT; returns once it has shut down: False if it stopped
    because the engine core died (the caller should exit non-zero). An idle connection is closed
    after ``keep_alive_timeout`` seconds (the CLI's --keep-alive-timeout says why it is not uvicorn's 5)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout + _WRITE_ERRORS_S,
                            timeout_keep_alive=keep_alive_timeout)
    # uvicorn re-raises the signal it caught once it has shut down, to the handlers that were in
    # place before it: with the defaults SIGTERM would then kill the process (status -15) and SIGINT
    # raise KeyboardInterrupt. These no-op handlers make a graceful shutdown a normal return.
    previous = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGTERM, signal.SIGINT)}
    server = _Server(config, app, shutdown_timeout)
    app.state.on_fatal = lambda: setattr(server, "should_exit", True)
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    logger.info("replayserve server stopped")
    return app.state.engine.death is None


def _ignore(sig: int, frame: FrameType | None) -> None:
    pass
