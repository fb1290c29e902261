"""Continuous batching with chunked prefill under a token budget, and preemption by recompute.

The scheduler decides which requests run and who owns which KV block and state slot; it never
touches a tensor. Its output, a `StepPlan`, is plain data.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from replayserve.cache.block_pool import IdPool, KVBlockManager
from replayserve.engine.request import Request, Status


@dataclass(frozen=True)
class ScheduledSeq:
    """One request's share of a step: `token_ids` at positions start_pos, start_pos + 1, ..."""

    request_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    state_slot: int
    is_decode: bool
    sample: bool  # the chunk ends at the request's last known token, so a new one is sampled


@dataclass(frozen=True)
class StepPlan:
    seqs: tuple[ScheduledSeq, ...]  # decodes first, then prefill chunks
    reset_slots: tuple[int, ...]  # state slots handed to a new owner this step: zero them first
    preempted: tuple[str, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, kv: KVBlockManager, slots: IdPool) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kv = kv
        self.slots = slots
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.unfinished: dict[str, Request] = {}
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)
        self.unfinished[request.request_id] = request

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        budget = self.max_num_batched_tokens
        decodes: list[ScheduledSeq] = []
        prefills: list[ScheduledSeq] = []
        preempted: list[str] = []
        for request in list(self.running):
            if request.status is not Status.RUNNING or budget == 0:
                continue  # preempted as a victim earlier in this loop, or out of budget
            n = 1 if request.decoding else min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._reserve(request, n, preempted):
                continue
            budget -= n
            (decodes if request.decoding else prefills).append(self._scheduled(request, n))
        reset: list[int] = []
        # Admitting after a preemption would only take back the blocks just freed.
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            n = min(request.num_tokens, budget)
            if self.slots.num_free == 0 or not self.kv.can_allocate(request.request_id, n):
                break
            self.waiting.popleft()
            request.state_slot = self.slots.allocate()[0]
            request.status = Status.RUNNING
            reset.append(request.state_slot)
            self.running.append(request)
            self.kv.allocate(request.request_id, n)
            budget -= n
            prefills.append(self._scheduled(request, n))
        return StepPlan(tuple(decodes + prefills), tuple(reset), tuple(preempted))

    def _reserve(self, request: Request, n: int, preempted: list[str]) -> bool:
        """Allocates blocks for n more tokens, preempting the newest running requests if needed."""
        total = request.num_computed_tokens + n
        while not self.kv.can_allocate(request.request_id, total):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        self.kv.allocate(request.request_id, total)
        return True

    def _scheduled(self, request: Request, n: int) -> ScheduledSeq:
        start = request.num_computed_tokens
        assert request.state_slot is not None
        return ScheduledSeq(
            request_id=request.request_id,
            token_ids=tuple(request.all_token_ids[start : start + n]),
            start_pos=start,
            block_table=tuple(self.kv.tables[request.request_id]),
            state_slot=request.state_slot,
            is_decode=request.decoding,
            sample=start + n == request.num_tokens,
        )

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: drop the request's KV and state; it prefills again on readmission."""
        self._release(request)
        request.status = Status.WAITING
        request.num_computed_tokens = 0
        request.decoding = False
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _release(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request.request_id)
        if request.state_slot is not None:
            self.slots.free([request.state_slot])
            request.state_slot = None

    def update(self, plan: StepPlan) -> None:
        """Marks the planned tokens as computed; sampled tokens are appended by the engine."""
        for seq in plan.seqs:
            request = self.unfinished[seq.request_id]
            request.num_computed_tokens += len(seq.token_ids)
            if seq.sample:
                request.decoding = True

    def finish(self, request: Request, reason: str) -> None:
        if request.status is Status.RUNNING:
            self._release(request)
        elif request.status is Status.WAITING:
            self.waiting.remove(request)
        request.status = Status.FINISHED
        request.finish_reason = reason
        del self.unfinished[request.request_id]
