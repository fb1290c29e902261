"""The engine core in a process of its own, as `replayserve serve` runs it.

Why a process: on a thread of the server, the step loop shared one interpreter lock with
tokenizing, detokenizing, JSON and the event loop; under load the GPU waited for Python (on an
H100, 29% of offline throughput at 64 requests in flight). Here the core's busy loop owns its
interpreter: it admits and aborts what the front end sent, steps, and sends each step's
`CoreOutputs` back. The two talk over a pair of ZeroMQ sockets (PUSH/PULL, an ipc:// path in a
private temporary directory): messages are framed and queued by libzmq's own threads, so a send
never waits for the reader, and neither side needs a thread to move bytes.

`ProcessCore` is the front end's handle: it starts the process, waits for `Ready` (the model loaded
and warmed up), sends commands, hands outputs to a callback on the event loop, and reports the
process's death. The core exits when told to (`Shutdown`), or on its own when its parent dies.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import pickle
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from replayserve.build import build_engine
from replayserve.config import EngineConfig
from replayserve.server.core_messages import (
    Abort,
    AddRequest,
    CoreOutputs,
    Ready,
    Shutdown,
    StartFailed,
    decode_from_core,
    decode_to_core,
    encode,
)
from replayserve.server.engine_core import EngineCore

logger = logging.getLogger(__name__)

# An idle core wakes this often (ms) to see whether its parent is still alive.
_IDLE_POLL_MS = 1000


class EngineStartError(RuntimeError):
    """The engine core could not start (its error, as it reported it, or how it died)."""


def run_engine_core(model: str, engine_options: dict[str, Any], input_address: str, output_address: str,
                    log_level: int = logging.INFO) -> None:
    """The core process's main: loads the model, says `Ready`, then serves until `Shutdown`."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s engine-core %(name)s: %(message)s")

    context = zmq.Context()
    commands = context.socket(zmq.PULL)
    commands.connect(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.connect(output_address)
    try:
        try:
            built = build_engine(model, engine_options)
        except Exception as e:  # noqa: BLE001 - reported to the front end, which prints it
            outputs.send(encode(StartFailed(f"{type(e).__name__}: {e}")))
            return
        outputs.send(encode(Ready(pickle.dumps(built.config))))
        _serve(EngineCore(built.engine), commands, outputs)
        built.close()
    finally:
        outputs.close(linger=2000)  # let the last outputs reach the front end
        commands.close(linger=0)
        context.term()


def _serve(core: EngineCore, commands: zmq.Socket, outputs: zmq.Socket) -> None:
    """The busy loop: drain commands (waiting for one only when idle), step, send outputs."""
    poller = zmq.Poller()
    poller.register(commands, zmq.POLLIN)
    parent = multiprocessing.parent_process()
    while True:
        busy = core.has_work()
        if not poller.poll(0 if busy else _IDLE_POLL_MS) and not busy:
            if parent is not None and not parent.is_alive():
                logger.error("the server process died; the engine core exits")
                return
            continue
        messages = []
        while True:
            try:
                messages.append(decode_to_core(commands.recv(zmq.NOBLOCK)))
            except zmq.Again:
                break
        out, stopping = core.handle(messages)
        if out is not None:
            outputs.send(encode(out))
        if stopping:
            return


class ProcessCore:
    """The front end's handle on an engine core process. ``launch`` (blocking) starts it and
    waits until it is ready; ``start`` (on the event loop) begins delivering its outputs."""

    def __init__(self, model: str, engine_options: dict[str, Any],
                 target: Callable[..., None] = run_engine_core, log_level: int = logging.INFO) -> None:
        self.model = model
        self.engine_options = engine_options
        self.config: EngineConfig | None = None
        self._target = target
        self._log_level = log_level
        self._dir = tempfile.mkdtemp(prefix="replayserve-")
        self._context = zmq.Context()
        self._commands = self._context.socket(zmq.PUSH)
        self._commands.setsockopt(zmq.SNDHWM, 0)  # admission bounds what is queued, not the socket
        self._commands.bind(f"ipc://{self._dir}/commands")
        self._outputs = self._context.socket(zmq.PULL)
        self._outputs.bind(f"ipc://{self._dir}/outputs")
        self._process: multiprocessing.process.BaseProcess | None = None
        self._reader: asyncio.Task | None = None
        self._stopped = False

    @property
    def exitcode(self) -> int | None:
        return None if self._process is None else self._process.exitcode

    def launch(self, timeout: float | None = None) -> EngineConfig:
        """Starts the process and waits for its `Ready`; raises EngineStartError if it reports a
        failure, dies, or is not ready within ``timeout`` seconds (None: no limit)."""
        # spawn, not fork: the parent may hold CUDA or threads (uvicorn, tokenizers) a fork would break
        ctx = multiprocessing.get_context("spawn")
        self._process = ctx.Process(
            target=self._target, name="replayserve-engine-core",
            args=(self.model, self.engine_options, f"ipc://{self._dir}/commands", f"ipc://{self._dir}/outputs",
                  self._log_level))
        self._process.start()
        started = time.monotonic()
        while not self._outputs.poll(200):
            if not self._process.is_alive():
                raise EngineStartError(f"the engine core died while starting (exit code {self._process.exitcode})")
            if timeout is not None and time.monotonic() - started > timeout:
                self.stop(0)
                raise EngineStartError(f"the engine core was not ready within {timeout:.0f} s")
        message = decode_from_core(self._outputs.recv())
        if isinstance(message, StartFailed):
            self._process.join(10)
            raise EngineStartError(message.error)
        assert isinstance(message, Ready), f"the engine core said {type(message).__name__} before Ready"
        self.config = pickle.loads(message.config)
        logger.info("engine core ready in %.1f s (pid %d)", time.monotonic() - started, self._process.pid)
        return self.config

    def start(self, deliver: Callable[[CoreOutputs], None], on_death: Callable[[str], None]) -> None:
        """On the event loop: ``deliver`` gets each `CoreOutputs`; ``on_death`` is called once,
        with why, if the process ends without being stopped."""
        assert self._process is not None and self.config is not None, "launch() first"
        outputs = zmq.asyncio.Socket.from_socket(self._outputs)
        process = self._process

        async def read() -> None:
            loop = asyncio.get_running_loop()
            died = loop.create_future()  # its sentinel turns readable when it ends (nothing reaps it here)
            loop.add_reader(process.sentinel, lambda: died.done() or died.set_result(None))
            try:
                while True:
                    received = asyncio.ensure_future(outputs.recv())
                    await asyncio.wait({received, died}, return_when=asyncio.FIRST_COMPLETED)
                    if received.done():
                        self._deliver(deliver, received.result())
                        continue
                    received.cancel()
                    while self._outputs.poll(100):  # what it sent before it died still counts
                        self._deliver(deliver, self._outputs.recv(zmq.NOBLOCK))
                    if not self._stopped:
                        process.join(1)
                        on_death(f"the engine core process died (exit code {process.exitcode})")
                    return
            finally:
                loop.remove_reader(process.sentinel)

        self._reader = asyncio.ensure_future(read())

    @staticmethod
    def _deliver(deliver: Callable[[CoreOutputs], None], data: bytes) -> None:
        try:
            deliver(decode_from_core(data))  # type: ignore[arg-type]
        except Exception:  # a bug in handling one message must not stop the reader
            logger.exception("could not handle the engine core's outputs")

    def send(self, message: AddRequest | Abort) -> None:
        """Queues a command for the core; ConnectionError when no core is there to take it (it
        died, and the reader has not noticed yet)."""
        try:
            self._commands.send(encode(message), zmq.NOBLOCK)
        except zmq.Again as e:
            raise ConnectionError("the engine core process is not running") from e

    def is_alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Asks the core to stop (requests in flight end with an error) and waits for it; kills it
        if it does not exit in time. Idempotent."""
        self._stopped = True
        process = self._process
        if process is not None and process.is_alive():
            try:
                self._commands.send(encode(Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            process.join(timeout)
            if process.is_alive():
                logger.error("the engine core did not stop within %.0f s; killing it", timeout)
                process.kill()
                process.join(5)
        if self._reader is not None:
            self._reader.cancel()
        if not self._context.closed:
            self._commands.close(linger=0)
            self._outputs.close(linger=0)
            self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def kill(self) -> None:
        """Kills the process without asking (tests: the engine dying mid-stream)."""
        if self._process is not None:
            self._process.kill()
