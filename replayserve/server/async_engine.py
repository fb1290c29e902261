"""The front end's side of the engine: requests go to an engine core as token ids and
`SamplingParams`, and its per-step token outputs come back here, on the event loop, where they are
detokenized and handed to per-request asyncio queues as `Delta`s.

The core runs either in a process of its own (`core_process.ProcessCore`, what `serve` uses: the
step loop then shares no interpreter lock with HTTP, tokenizing, detokenizing and JSON) or on a
thread of this process (`ThreadCore`, for `create_app(llm)` with an `LLM` already loaded). Both
speak the same messages (`core_messages.py`) and run the same `EngineCore`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from replayserve.config import EngineConfig
from replayserve.engine.engine import Engine
from replayserve.engine.request_checks import validate_request
from replayserve.sampling_params import SamplingParams
from replayserve.server.core_messages import Abort, AddRequest, CoreOutputs, ToCore, TokenOutput, params_to_dict
from replayserve.server.detokenize import IncrementalDetokenizer
from replayserve.server.engine_core import EngineCore
from replayserve.server.metrics import EngineSnapshot, ServerMetrics
from replayserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# How long an idle engine thread waits for a command before it looks at the stop flag again.
_IDLE_POLL_S = 0.05


class Overloaded(RuntimeError):
    """More requests are in flight than the server admits; the client should retry later."""


class EngineError(RuntimeError):
    """The engine failed (or stopped) while the request was in flight."""


class CoreHandle(Protocol):
    """How the front end reaches an engine core (`ThreadCore`, `core_process.ProcessCore`)."""

    config: EngineConfig | None

    def start(self, deliver: Callable[[CoreOutputs], None], on_death: Callable[[str], None]) -> None: ...
    def send(self, message: AddRequest | Abort) -> None: ...
    def is_alive(self) -> bool: ...
    def stop(self, timeout: float = 10.0) -> None: ...


@dataclass(frozen=True)
class Delta:
    """What one completion gained in a step. index: the choice's index in its HTTP request;
    token_ids and logprobs: the new tokens ({token id: log-probability}, or None when not asked);
    text: their text (held back while a stop string may be forming); finish_reason: set on a
    completion's last delta ("stop" or "length"), with the matched stop token id or string."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(eq=False)
class _Completion:
    """One engine request of a group, as the front end tracks it."""

    request_id: str
    index: int
    group: RequestGroup
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    last_output_at: float | None = None


@dataclass(eq=False)
class RequestGroup:
    """The completions of one HTTP request (its prompts times n); their deltas share one queue,
    so a handler reads all of them in the order they were produced."""

    arrival: float = field(default_factory=time.perf_counter)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    completions: list[_Completion] = field(default_factory=list)
    closed: bool = False  # no more deltas are wanted

    async def deltas(self) -> AsyncIterator[Delta]:
        """Every completion's deltas until each has finished; raises EngineError if the engine fails."""
        remaining = len(self.completions)
        while remaining:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            remaining -= item.finish_reason is not None
            yield item


class AsyncEngine:
    """Submits requests to ``core`` and turns its outputs into deltas. Every method runs on the
    event loop.

    max_waiting_requests: engine requests (a prompt times n) admitted beyond the running batch
    (max_num_seqs); `submit` raises Overloaded past that. on_death: called once if the core dies.
    """

    def __init__(self, core: CoreHandle, tokenizer: Tokenizer | None, metrics: ServerMetrics,
                 max_waiting_requests: int = 256) -> None:
        if max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {max_waiting_requests}")
        assert core.config is not None, "the engine core is not ready"
        self.core = core
        self.config: EngineConfig = core.config
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.capacity = self.config.max_num_seqs + max_waiting_requests
        self.num_in_flight = 0  # engine requests submitted and not closed
        self.death: str | None = None  # why the core died, once it has
        self.on_death: Callable[[str], None] | None = None
        self._completions: dict[str, _Completion] = {}  # unfinished, by request id
        self._ids = itertools.count()
        self._stopping = False

    def start(self) -> None:
        self.core.start(self._deliver, self._died)

    def is_alive(self) -> bool:
        return self.death is None and not self._stopping and self.core.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Stops the core; requests still in flight fail with EngineError."""
        self._stopping = True
        self.core.stop(timeout)
        self._fail_all(EngineError("the server is shutting down"))

    def submit(self, prompts: list[list[int]], params: SamplingParams) -> RequestGroup:
        """Queues n completions of each prompt, choice index = prompt index * n + completion.
        Raises ValueError (nothing queued) for a request the engine cannot serve, Overloaded when full."""
        if self.death is not None:
            raise EngineError(self.death)
        if self._stopping:
            raise EngineError("the server is shutting down")
        for ids in prompts:
            validate_request(self.config, self.tokenizer is not None, ids, params)
        count = len(prompts) * params.n
        if count > self.capacity:
            raise ValueError(f"SamplingParams.n: {len(prompts)} prompt(s) x n={params.n} is more completions than "
                             f"the server ever admits at once ({self.capacity})")
        if self.num_in_flight + count > self.capacity:
            raise Overloaded(f"{self.num_in_flight} requests are in flight and this one adds {count}; the server "
                             f"admits {self.capacity} (max_num_seqs + max_waiting_requests)")
        group = RequestGroup()
        holdback = max((len(s) for s in params.stop), default=1) - 1
        adds = []
        for i, ids in enumerate(prompts):
            for j in range(params.n):
                detok = None if self.tokenizer is None else IncrementalDetokenizer(self.tokenizer, holdback)
                c = _Completion(str(next(self._ids)), i * params.n + j, group, detok)
                group.completions.append(c)
                self._completions[c.request_id] = c
                adds.append(AddRequest(c.request_id, ids, params_to_dict(params.for_completion(j))))
        self.num_in_flight += count
        try:
            for add in adds:
                self.core.send(add)
                self.metrics.prompt_tokens.inc(len(add.prompt_token_ids))
        except ConnectionError as e:
            self.close(group)
            raise EngineError(str(e)) from e
        return group

    def close(self, group: RequestGroup) -> None:
        """Ends a group (its handler returned, failed, or its client went away): unfinished
        completions are aborted at the core's next step boundary, freeing their blocks and slots."""
        if group.closed:
            return
        group.closed = True
        self.num_in_flight -= len(group.completions)
        unfinished = [c.request_id for c in group.completions if self._completions.pop(c.request_id, None)]
        for _ in unfinished:
            self.metrics.finish("abort")
        if unfinished and self.death is None and not self._stopping:
            try:
                self.core.send(Abort(unfinished))
            except ConnectionError:  # the core is gone: its death fails what is left
                logger.warning("could not abort %d request(s): the engine core is not running", len(unfinished))

    def fail_all(self, why: str) -> None:
        """Fails every request in flight with ``why`` (shutdown timeout) and aborts them in the core."""
        ids = list(self._completions)
        self._fail_all(EngineError(why))
        if ids and self.death is None:
            try:
                self.core.send(Abort(ids))
            except ConnectionError:
                logger.warning("could not abort %d request(s): the engine core is not running", len(ids))

    # -- outputs -----------------------------------------------------------------------------------
    def _deliver(self, outputs: CoreOutputs) -> None:
        now = time.perf_counter()
        for out in outputs.outputs:
            c = self._completions.get(out.request_id)
            if c is not None:
                self._apply(c, out, now)
        if (s := outputs.snapshot) is not None:
            self.metrics.snapshot = EngineSnapshot(s.num_running, s.num_waiting, s.engine_metrics, s.usage)

    def _apply(self, c: _Completion, out: TokenOutput, now: float) -> None:
        if out.error is not None:
            del self._completions[c.request_id]
            self.metrics.finish("error")
            c.group.queue.put_nowait(EngineError(out.error))
            return
        new = out.token_ids
        if new:
            self._observe_latency(c, len(new), now)
            c.token_ids += new
        finished = out.finish_reason is not None
        text = ""
        if c.detokenizer is not None:
            c.detokenizer.add(new)
            if finished:  # the text a stop string cut, else the whole output decoded at once
                final = out.text if out.text is not None else c.detokenizer.tokenizer.decode(c.token_ids)
                text = c.detokenizer.rest(final)
            else:
                text = c.detokenizer.new_text()
        if finished:
            del self._completions[c.request_id]
            self.metrics.finish(out.finish_reason)
        c.group.queue.put_nowait(Delta(c.index, text, new, out.logprobs, out.finish_reason, out.stop_reason))

    def _observe_latency(self, c: _Completion, num_tokens: int, now: float) -> None:
        self.metrics.generation_tokens.inc(num_tokens)
        if c.last_output_at is None:
            self.metrics.ttft.observe(now - c.group.arrival)
        else:
            gap = (now - c.last_output_at) / num_tokens
            for _ in range(num_tokens):
                self.metrics.itl.observe(gap)
        c.last_output_at = now

    def _died(self, why: str) -> None:
        logger.error("%s; failing the %d requests in flight", why, len(self._completions))
        self.death = why
        self._fail_all(EngineError(why))
        if self.on_death is not None:
            self.on_death(why)

    def _fail_all(self, error: EngineError) -> None:
        groups = {id(c.group): c.group for c in self._completions.values()}
        for _ in self._completions:
            self.metrics.finish("error")
        self._completions.clear()
        for group in groups.values():
            group.queue.put_nowait(error)


class ThreadCore:
    """An `EngineCore` on a thread of this process, over an `Engine` already built (an `LLM`'s).
    Only that thread touches the engine once started."""

    def __init__(self, engine: Engine) -> None:
        self.config: EngineConfig | None = engine.config
        self.core = EngineCore(engine)
        self._commands: queue.SimpleQueue[ToCore] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, deliver: Callable[[CoreOutputs], None], on_death: Callable[[str], None]) -> None:
        loop = asyncio.get_running_loop()

        def to_loop(outputs: CoreOutputs) -> None:
            try:
                loop.call_soon_threadsafe(deliver, outputs)
            except RuntimeError:  # the loop is closed: the server is gone, nobody reads these
                pass

        self._thread = threading.Thread(target=self._run, args=(to_loop,), name="replayserve-engine", daemon=True)
        self._thread.start()

    def send(self, message: AddRequest | Abort) -> None:
        self._commands.put(message)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.error("the engine thread did not stop within %.0f s", timeout)
                return
        self._drain()  # adds never applied reached no pool; fail_all aborts every request that did
        self.core.fail_all("the server is shutting down")

    def _drain(self, wait: float = 0.0) -> list[ToCore]:
        messages: list[ToCore] = []
        try:
            messages.append(self._commands.get(timeout=wait) if wait else self._commands.get_nowait())
            while True:
                messages.append(self._commands.get_nowait())
        except queue.Empty:
            return messages

    def _run(self, deliver: Callable[[CoreOutputs], None]) -> None:
        while not self._stopping.is_set():
            messages = self._drain(0.0 if self.core.has_work() else _IDLE_POLL_S)
            if not messages and not self.core.has_work():
                continue
            try:
                out, _ = self.core.handle(messages)
            except Exception as e:  # noqa: BLE001 - a bug outside the step: fail what is in flight, go on
                logger.exception("the engine core failed outside a step")
                out = CoreOutputs(self.core.fail_all(f"the engine failed: {type(e).__name__}: {e}"))
            if out is not None:
                deliver(out)
