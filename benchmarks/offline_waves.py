"""A workload run on the offline engine the way `bench_serve.drive` runs it against a server: the same
arrival times and in-flight cap, with per-request time to first token and inter-token gaps.

`LLM.generate` takes every prompt at once and reports no per-token times, so this steps
`LLM.engine` itself, as `LLM.generate` does (validate, `add_request`, `step` until done, abort
what an interruption leaves). Times are what a caller of the engine loop sees:

- A request is sent at its arrival time, or, when `in_flight` requests are already in the engine,
  at the end of the step that finished one of them (a closed-loop client sends its next request
  when a response ends). With `follow_up_steps=0` such a follow-up is queued before the next step
  is planned, which no networked client can do; `follow_up_steps=1` queues it after one more
  `step()` call, as a server sees it: the client's request arrives while the next step runs and
  waits for it to end. Its TTFT still counts from when it was sent.
- Its first token appears at the end of the `step()` call after which its `output_token_ids` is
  no longer empty (tokens reach the host inside `step()`; with async scheduling that is the call
  that reads the step back). TTFT is that time minus the send time; each later step that adds
  tokens adds one inter-token gap (a server chunk carries one step's tokens too).
- The wave lasts from its start to the end of the step that finishes its last request.
"""

from __future__ import annotations

import math
import time
from collections import deque

from bench_serve import Result

from replayserve.engine.engine import Engine
from replayserve.engine.request import Request, Status
from replayserve.sampling_params import SamplingParams


def offline_wave(engine: Engine, workload: list[tuple[list[int], int]], arrivals: list[float],
                 in_flight: int | None = None, follow_up_steps: int = 0) -> tuple[list[Result], float, int]:
    """Runs `workload` ((prompt ids, output tokens) per request, each sent `arrivals[i]` seconds after
    the start, at most `in_flight` in the engine at once; None: no cap beyond the engine's own
    `max_num_seqs`) greedily with EOS ignored; a request sent when room opens is queued
    `follow_up_steps` step() calls later (the module docstring says why). Returns the results in
    workload order, the wave's seconds and the most requests that were in the engine at once."""
    if follow_up_steps < 0:
        raise ValueError(f"follow_up_steps must be >= 0, got {follow_up_steps}")
    if engine.has_unfinished():
        raise RuntimeError("offline_wave needs an idle engine: another caller's requests would share its steps")
    cap = in_flight or len(workload)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in workload]
    for (prompt, _), p in zip(workload, params, strict=True):
        engine.validate(prompt, p)
    results = [Result(ok=False) for _ in workload]
    pending = deque(range(len(workload)))
    active: dict[int, Request] = {}
    sent, last = [math.nan] * len(workload), [math.nan] * len(workload)
    most = 0
    start = time.perf_counter()
    room_since, end = start, start  # room_since: when the engine last went from full to having room
    steps, room_step = 0, 0  # step() calls so far, and how many had run when room opened
    try:
        while pending or active:
            now = time.perf_counter()
            while pending and len(active) < cap and start + arrivals[pending[0]] <= now:
                if (room_since > start + arrivals[pending[0]] and steps < room_step + follow_up_steps
                        and engine.has_unfinished()):
                    break  # a follow-up on its way while a step runs: that step ends without it
                i = pending.popleft()
                sent[i] = max(start + arrivals[i], room_since)
                active[i] = engine.add_request(workload[i][0], params[i])
            most = max(most, len(active))
            if len(active) >= cap:
                room_since = math.inf
            if not engine.has_unfinished():  # idle until the next arrival
                if active:
                    raise RuntimeError(f"the engine is idle with {len(active)} of this wave's requests unfinished")
                time.sleep(max(0.0, start + arrivals[pending[0]] - time.perf_counter()))
                continue
            engine.step()
            steps += 1
            end = time.perf_counter()
            for i, request in list(active.items()):
                if len(request.output_token_ids) > results[i].output_tokens:
                    _new_tokens(results[i], len(request.output_token_ids), end - sent[i], end - last[i])
                    last[i] = end
                if request.status is Status.FINISHED:
                    _finished(results[i], request, end - sent[i])
                    del active[i]
            if room_since == math.inf and len(active) < cap:
                room_since, room_step = end, steps
    finally:
        for request in active.values():  # an interrupted wave keeps no block or slot
            engine.abort(request)
    return results, end - start, most


def _new_tokens(result: Result, num_tokens: int, since_sent: float, since_last: float) -> None:
    """A step gave the request tokens: its first (TTFT) or one more chunk (an inter-token gap)."""
    if result.output_tokens == 0:
        result.ttft = since_sent
    else:
        result.itl.append(since_last)
    result.output_tokens = num_tokens


def _finished(result: Result, request: Request, latency: float) -> None:
    result.ok = request.finish_reason == "length"
    result.error = "" if result.ok else f"finished by {request.finish_reason!r}, not by its length"
    result.prompt_tokens, result.latency = len(request.prompt_token_ids), latency
