"""The engine core: admits, aborts and steps an `Engine`, and turns each step into per-request
`TokenOutput`s (token ids, log-probabilities, finish reasons; no text). It knows nothing of how it
is reached: `core_process.py` runs it in a process of its own behind a socket (what `serve` uses),
`async_engine.ThreadCore` on a thread of the caller's process.

A step that raises changed nothing a request can see (`Engine.step`). The core then looks for the
request to blame: it retries the unfinished requests as a group and, while a group fails, in
halves, each alone set aside from the others (`Scheduler.hold`), until a group of one fails: that
request is failed with the error and the rest go on with the tokens the retries gave them (real
steps, the same tokens a normal step would give). When every request fails alone the fault is the
engine's, not a request's, and all of them fail; when none does (a transient fault) all go on.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from replayserve.engine.engine import Engine
from replayserve.engine.request import Request, Status
from replayserve.server.core_messages import (
    Abort,
    AddRequest,
    CoreOutputs,
    Snapshot,
    ToCore,
    TokenOutput,
    params_from_dict,
)

logger = logging.getLogger(__name__)

# How often a busy core attaches the engine's counters to its outputs (for /metrics).
SNAPSHOT_INTERVAL_S = 0.25


@dataclass(eq=False)
class _Tracked:
    """A request the front end asked for, and how many of its tokens it has been sent."""

    request_id: str  # the front end's id
    request: Request
    added_at: float  # time.monotonic() when the core queued it
    num_sent: int = 0


class EngineCore:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._active: dict[str, _Tracked] = {}  # by the front end's id
        self._snapshot_at = 0.0
        # Time to first token inside the core (from queueing to the step that produced it): with the
        # front end's own TTFT it tells the core's share of a request's wait from the transport's.
        self._ttft_sum_s = 0.0
        self._ttft_count = 0

    # -- commands ----------------------------------------------------------------------------------
    def add(self, message: AddRequest) -> TokenOutput | None:
        """Queues the request; an output that fails it when the engine refuses it (the front end
        validated it against the same config, so a refusal here is a bug worth reporting)."""
        try:
            params = params_from_dict(message.params)
            request = self.engine.add_request(message.prompt_token_ids, params)
        except (TypeError, ValueError) as e:
            return TokenOutput(message.request_id, [], finish_reason="error", error=f"the engine refused it: {e}")
        self._active[message.request_id] = _Tracked(message.request_id, request, time.monotonic())
        return None

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            tracked = self._active.pop(request_id, None)
            if tracked is not None:
                self.engine.abort(tracked.request)

    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def fail_all(self, why: str) -> list[TokenOutput]:
        """Aborts every request in flight; their outputs say why."""
        outputs = [TokenOutput(t.request_id, [], finish_reason="error", error=why) for t in self._active.values()]
        self.abort(list(self._active))
        return outputs

    def handle(self, messages: list[ToCore]) -> tuple[CoreOutputs | None, bool]:
        """One turn of a core's loop: applies ``messages``, steps once if there is work. Returns
        what to send (None: nothing changed) and whether a `Shutdown` came (then every request
        in flight has been failed and the loop should end)."""
        outputs: list[TokenOutput] = []
        stopping = False
        for message in messages:
            if isinstance(message, AddRequest):
                if (refused := self.add(message)) is not None:
                    outputs.append(refused)
            elif isinstance(message, Abort):
                self.abort(message.request_ids)
            else:
                outputs += self.fail_all("the server is shutting down")
                stopping = True
        if not stopping and self.has_work():
            outputs += self.step()
        snapshot = self.snapshot(force=not self.has_work())  # exact once idle; while busy, timed
        return (CoreOutputs(outputs, snapshot) if outputs or snapshot is not None else None), stopping

    # -- steps -------------------------------------------------------------------------------------
    def step(self) -> list[TokenOutput]:
        """One engine step (or, after a failed one, the retries that find its culprit); the
        outputs of every request that gained tokens or ended."""
        try:
            self.engine.step()
            failed: list[TokenOutput] = []
        except Exception as e:  # noqa: BLE001 - any failure of a step is isolated, not fatal
            failed = self._isolate(e)
        return failed + self._collect()

    def snapshot(self, force: bool = False) -> Snapshot | None:
        """The engine's counters, at most every SNAPSHOT_INTERVAL_S unless ``force``."""
        now = time.monotonic()
        if not force and now - self._snapshot_at < SNAPSHOT_INTERVAL_S:
            return None
        self._snapshot_at = now
        engine = self.engine
        cache = engine.cache
        usage = {"kv_blocks": 1 - cache.kv.num_free / cache.kv.size,
                 "mamba_slots": 1 - cache.live.num_free / cache.live.size}
        if cache.states is not None:
            usage["mamba_cache_states"] = 1 - cache.states.num_free / cache.states.size
        metrics = {k: float(v) for k, v in engine.get_metrics().items() if isinstance(v, int | float)}
        metrics.update(core_ttft_seconds_sum=self._ttft_sum_s, core_ttft_count=float(self._ttft_count))
        return Snapshot(len(engine.scheduler.running), len(engine.scheduler.waiting), metrics, usage)

    def _collect(self) -> list[TokenOutput]:
        outputs = []
        now = time.monotonic()
        for request_id, tracked in list(self._active.items()):
            request = tracked.request
            new = request.output_token_ids[tracked.num_sent :]
            finished = request.status is Status.FINISHED
            if not new and not finished:
                continue
            if new and tracked.num_sent == 0:
                self._ttft_sum_s += now - tracked.added_at
                self._ttft_count += 1
            logprobs = None
            if request.params.logprobs is not None:
                logprobs = request.output_logprobs[tracked.num_sent : tracked.num_sent + len(new)]
            tracked.num_sent += len(new)
            if not finished:
                outputs.append(TokenOutput(request_id, list(new), logprobs))
                continue
            del self._active[request_id]
            cut = request.text if isinstance(request.stop_reason, str) else None  # a stop string cut it
            outputs.append(TokenOutput(request_id, list(new), logprobs, request.finish_reason, request.stop_reason,
                                       cut))
        return outputs

    # -- fault isolation ---------------------------------------------------------------------------
    def _isolate(self, error: Exception) -> list[TokenOutput]:
        by_engine_id = {t.request.request_id: t for t in self._active.values()}
        suspects = [r for r in self.engine.scheduler.unfinished.values() if r.request_id in by_engine_id]
        suspects.sort(key=lambda r: r.arrival)
        logger.warning("an engine step failed (%s: %s); looking for the request to blame among %d",
                       type(error).__name__, error, len(suspects))
        culprits: list[tuple[Request, BaseException]] = []
        groups = [suspects]
        while groups:
            group = groups.pop()
            fault = self._trial(group)
            if fault is None:
                continue
            if len(group) == 1:
                culprits.append((group[0], fault))
            else:
                groups += [group[len(group) // 2 :], group[: len(group) // 2]]
        if len(culprits) == len(suspects) > 1:
            logger.error("every request fails alone: the fault is the engine's; failing all %d", len(suspects))
        elif culprits:
            logger.warning("failing %d request(s) that make steps fail; %d go on", len(culprits),
                           len(suspects) - len(culprits))
        outputs = []
        for request, fault in culprits:
            tracked = by_engine_id[request.request_id]
            self.engine.abort(request)
            del self._active[tracked.request_id]
            outputs.append(TokenOutput(tracked.request_id, [], finish_reason="error",
                                       error=f"the engine failed on this request: {type(fault).__name__}: {fault}"))
        return outputs

    def _trial(self, group: list[Request]) -> BaseException | None:
        """Steps ``group`` alone until each of its requests gained a token or finished; the
        exception if a step raised. The steps are real: what they generate is kept."""
        marks = {r.request_id: len(r.output_token_ids) for r in group}
        scheduler = self.engine.scheduler
        budget = scheduler.max_num_batched_tokens
        max_steps = 4 + len(group) + sum(r.num_tokens for r in group) // budget
        scheduler.hold(marks)
        try:
            for _ in range(max_steps):
                if all(r.status is Status.FINISHED or len(r.output_token_ids) > marks[r.request_id] for r in group):
                    break
                try:
                    self.engine.step(overlap=False)
                except Exception as e:  # noqa: BLE001
                    return e
        finally:
            scheduler.release()
        return None
