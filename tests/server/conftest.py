"""A real server on 127.0.0.1 (an ephemeral port, uvicorn on a background thread) over the tiny
model, and an offline `LLM` with the same engine options to compare its outputs with."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI

from replayserve import LLM
from replayserve.server import create_app
from replayserve.server.async_engine import AsyncEngine
from tests.conftest import assert_pools_full

MODEL_NAME = "tiny"
# float64 so that outputs do not depend on how requests were batched; prefix caching and
# speculation on, as the issue asks of the load test.
ENGINE_OPTIONS: dict[str, Any] = {
    "dtype": "float64", "device": "cpu", "max_num_seqs": 16, "enable_prefix_caching": True,
    "speculative": {"method": "ngram", "num_speculative_tokens": 2},
}


@dataclass
class RunningServer:
    llm: LLM
    app: FastAPI
    server: uvicorn.Server
    thread: threading.Thread
    base_url: str  # http://127.0.0.1:PORT

    @property
    def engine(self) -> AsyncEngine:
        return self.app.state.engine

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until no request is in flight, queued or running (two quiet polls in a row), so the
        engine may be inspected from this thread."""
        deadline, quiet = time.monotonic() + timeout, 0
        while quiet < 2:
            core = self.engine.core  # a ThreadCore over self.llm's engine
            busy = self.engine.num_in_flight or not core._commands.empty() or self.llm.engine.has_unfinished()
            quiet = 0 if busy else quiet + 1
            assert time.monotonic() < deadline, "the server did not go idle"
            time.sleep(0.05)

    def assert_pools_full(self) -> None:
        self.wait_idle()
        assert_pools_full(self.llm)


def with_chat_template(model_dir: Path, out: Path, template: str) -> Path:
    """A copy of ``model_dir`` at ``out`` whose tokenizer_config.json holds ``template``."""
    shutil.copytree(model_dir, out)
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return out


def start_server(model_dir: Path, **app_options: Any) -> RunningServer:
    llm = LLM(model=str(model_dir), **{**ENGINE_OPTIONS, **app_options.pop("engine", {})})
    app = create_app(llm, MODEL_NAME, **app_options)
    return RunningServer(llm, app, *run_uvicorn(app))


def run_uvicorn(app: FastAPI) -> tuple[uvicorn.Server, threading.Thread, str]:
    """``app`` under uvicorn on a background thread and an ephemeral port, once it listens:
    (server, thread, base URL)."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, thread, f"http://127.0.0.1:{port}"


def stop_server(running: RunningServer) -> None:
    running.server.should_exit = True
    running.thread.join(15)
    assert not running.thread.is_alive(), "the server did not stop"


@pytest.fixture(scope="session")
def server(tiny_model_dir: Path) -> Iterator[RunningServer]:
    running = start_server(tiny_model_dir)
    yield running
    stop_server(running)


@pytest.fixture(scope="session")
def offline(tiny_model_dir: Path) -> LLM:
    return LLM(model=str(tiny_model_dir), **ENGINE_OPTIONS)
