"""The async engine: one thread owns the `Engine` and steps it while any request is in flight;
the event loop hands it requests and aborts through a command queue, and it hands each step's
new tokens and text back to per-request asyncio queues.

Only the engine thread touches the engine's state (the scheduler, the pools, the requests). The
event loop reads nothing of it but `Engine.validate` (configuration only) and the snapshot the
thread publishes for metrics.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from replayserve.engine.engine import Engine
from replayserve.engine.request import Request, SamplingParams, Status
from replayserve.server.detokenize import IncrementalDetokenizer
from replayserve.server.metrics import EngineSnapshot, ServerMetrics

logger = logging.getLogger(__name__)

# How long an idle engine thread waits for a command before it looks at the stop flag again.
_IDLE_POLL_S = 0.05


class Overloaded(RuntimeError):
    """More requests are in flight than the server admits; the client should retry later."""


class EngineError(RuntimeError):
    """The engine failed (or stopped) while the request was in flight."""


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
    """One engine request of a group, as the engine thread tracks it."""

    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    group: RequestGroup
    detokenizer: IncrementalDetokenizer | None
    request: Request | None = None
    num_sent: int = 0  # output tokens already published
    last_output_at: float | None = None


@dataclass(eq=False)
class RequestGroup:
    """The completions of one HTTP request (its prompts times n); their deltas share one queue,
    so a handler reads all of them in the order they were produced."""

    loop: asyncio.AbstractEventLoop
    arrival: float = field(default_factory=time.perf_counter)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    completions: list[_Completion] = field(default_factory=list)
    closed: bool = False  # set on the event loop: no more deltas are wanted

    async def deltas(self) -> AsyncIterator[Delta]:
        """Every completion's deltas until each has finished; raises EngineError if the engine fails."""
        remaining = len(self.completions)
        while remaining:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            remaining -= item.finish_reason is not None
            yield item

    def _put(self, item: Delta | BaseException) -> None:
        """From the engine thread: queue an item on the group's event loop."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is gone, nobody reads this group
            pass


class AsyncEngine:
    """Runs ``engine`` on a thread of its own.

    max_waiting_requests: engine requests (a prompt times n) admitted beyond the running batch
    (max_num_seqs); `submit` raises Overloaded past that.
    """

    def __init__(self, engine: Engine, metrics: ServerMetrics, max_waiting_requests: int = 256) -> None:
        if max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {max_waiting_requests}")
        self.engine = engine
        self.metrics = metrics
        self.capacity = engine.config.max_num_seqs + max_waiting_requests
        self.num_in_flight = 0  # engine requests submitted and not closed; read and written on the event loop
        self._commands: queue.SimpleQueue[tuple[str, RequestGroup]] = queue.SimpleQueue()
        self._active: dict[str, _Completion] = {}  # engine thread only
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    # -- event loop side ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="replayserve-engine", daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Stops the thread after its current step; requests still in flight fail with EngineError."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.error("the engine thread did not stop within %.0f s", timeout)
                return
        self._apply_commands(block=False)
        self._fail_all(EngineError("the server is shutting down"))

    def submit(self, prompts: list[list[int]], params: SamplingParams) -> RequestGroup:
        """Queues n completions of each prompt, choice index = prompt index * n + completion.
        Raises ValueError (nothing queued) for a request the engine cannot serve, Overloaded when full."""
        if self._stopping.is_set():
            raise EngineError("the server is shutting down")
        for ids in prompts:
            self.engine.validate(ids, params)
        count = len(prompts) * params.n
        if count > self.capacity:
            raise ValueError(f"SamplingParams.n: {len(prompts)} prompt(s) x n={params.n} is more completions than "
                             f"the server ever admits at once ({self.capacity})")
        if self.num_in_flight + count > self.capacity:
            raise Overloaded(f"{self.num_in_flight} requests are in flight and this one adds {count}; the server "
                             f"admits {self.capacity} (max_num_seqs + max_waiting_requests)")
        group = RequestGroup(asyncio.get_running_loop())
        tokenizer = self.engine.tokenizer
        holdback = max((len(s) for s in params.stop), default=1) - 1
        for i, ids in enumerate(prompts):
            for j in range(params.n):
                detok = None if tokenizer is None else IncrementalDetokenizer(tokenizer, holdback)
                group.completions.append(_Completion(i * params.n + j, ids, params.for_completion(j), group, detok))
        self.num_in_flight += count
        self._commands.put(("add", group))
        return group

    def close(self, group: RequestGroup) -> None:
        """Ends a group (its handler returned, failed, or its client went away): unfinished
        completions are aborted at the next step boundary, freeing their blocks and slots."""
        if group.closed:
            return
        group.closed = True
        self.num_in_flight -= len(group.completions)
        self._commands.put(("abort", group))

    # -- engine thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while not self._stopping.is_set():
            try:
                self._apply_commands(block=not engine.has_unfinished())
                if engine.has_unfinished():
                    engine.step()
                    self._publish()
            except Exception as e:  # a failed step changed nothing a request can see; the requests fail
                logger.exception("engine step failed; failing the %d requests in flight", len(self._active))
                self._fail_all(EngineError(f"the engine failed: {type(e).__name__}: {e}"))

    def _apply_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=_IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, group = command
            (self._add if kind == "add" else self._abort)(group)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
        self._snapshot()

    def _add(self, group: RequestGroup) -> None:
        if group.closed:  # its client left before it was admitted
            return
        try:
            for c in group.completions:
                c.request = self.engine.add_request(c.prompt_token_ids, c.params)
                self._active[c.request.request_id] = c
                self.metrics.prompt_tokens.inc(len(c.prompt_token_ids))
        except ValueError as e:  # validated on submit; a second check failing here is a bug, not the client's
            self._abort(group)
            group._put(EngineError(f"the engine refused the request: {e}"))

    def _abort(self, group: RequestGroup) -> None:
        for c in group.completions:
            if c.request is not None and self._active.pop(c.request.request_id, None) is not None:
                self.engine.abort(c.request)
                self.metrics.finish("abort")

    def _fail_all(self, error: EngineError) -> None:
        groups = {id(c.group): c.group for c in self._active.values()}
        for c in list(self._active.values()):
            assert c.request is not None
            self.engine.abort(c.request)
            self.metrics.finish("error")
        self._active.clear()
        for group in groups.values():
            group._put(error)
        self._snapshot()

    def _publish(self) -> None:
        now = time.perf_counter()
        for request_id, c in list(self._active.items()):
            request = c.request
            assert request is not None
            new = request.output_token_ids[c.num_sent :]
            finished = request.status is Status.FINISHED
            if not new and not finished:
                continue
            logprobs = None
            if request.params.logprobs is not None:
                logprobs = request.output_logprobs[c.num_sent : c.num_sent + len(new)]
            c.num_sent += len(new)
            if new:
                self._observe_latency(c, len(new), now)
            text = ""
            if c.detokenizer is not None:
                c.detokenizer.add(new)
                text = c.detokenizer.rest(request.text) if finished else c.detokenizer.new_text()
            if finished:
                del self._active[request_id]
                self.metrics.finish(request.finish_reason or "stop")
                c.group._put(Delta(c.index, text, new, logprobs, request.finish_reason, request.stop_reason))
            else:  # a chunk with no text still carries its tokens (usage) and logprobs
                c.group._put(Delta(c.index, text, new, logprobs))
        self._snapshot()

    def _observe_latency(self, c: _Completion, num_tokens: int, now: float) -> None:
        self.metrics.generation_tokens.inc(num_tokens)
        if c.last_output_at is None:
            self.metrics.ttft.observe(now - c.group.arrival)
        else:
            gap = (now - c.last_output_at) / num_tokens
            for _ in range(num_tokens):
                self.metrics.itl.observe(gap)
        c.last_output_at = now

    def _snapshot(self) -> None:
        engine = self.engine
        cache = engine.cache
        usage = {"kv_blocks": 1 - cache.kv.num_free / cache.kv.size,
                 "mamba_slots": 1 - cache.live.num_free / cache.live.size}
        if cache.states is not None:
            usage["mamba_cache_states"] = 1 - cache.states.num_free / cache.states.size
        self.metrics.snapshot = EngineSnapshot(len(engine.scheduler.running), len(engine.scheduler.waiting),
                                               engine.get_metrics(), usage)
