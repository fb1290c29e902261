"""Continuous batching with chunked prefill under a token budget, preemption by recompute, and
prefix-cache admission.

The scheduler decides which requests run and who owns which KV block and state slot; it never
touches a tensor. Its output, a `StepPlan`, is plain data.

With async scheduling the engine launches plain decode steps before the previous step's tokens
are known (`schedule_next`) and tells the scheduler which steps are on the device (`fly`,
`land`): the blocks and slot of a request that finishes while a launched step still runs it stay
taken until that step has landed, so no other request can be handed memory it still writes.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from replayserve.cache.manager import NO_HIT, BoundaryWrite, CacheManager
from replayserve.config import check_mamba_cache_mode
from replayserve.engine.penalties import uses_history
from replayserve.engine.request import Request, Status

# The input id of a row fed on the device from the previous step's sampled token (`fed_rows`).
FED_TOKEN = -1


class ScheduledSeq(NamedTuple):
    """One request's share of a step: `token_ids` at positions start_pos, start_pos + 1, ...
    (A named tuple: a step builds one per running request, and a frozen dataclass's field by
    field construction was a tenth of a large batch's host time.)"""

    request_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    state_slot: int
    is_decode: bool
    sample: bool  # the chunk ends at the request's last known token, so a new one is sampled
    # Canonical Mamba states to write: the state after `position - start_pos` of this step's tokens.
    boundary_writes: tuple[BoundaryWrite, ...] = ()
    num_drafts: int = 0  # a speculative verify: token_ids = (last known token, *drafts)
    # prompt_logprobs: the prompt tokens that this chunk's leading positions predict (position
    # start_pos + i predicts prompt_targets[i]), and how many top tokens to report with each.
    prompt_targets: tuple[int, ...] = ()
    prompt_top_k: int = 0


@dataclass(frozen=True)
class StepPlan:
    seqs: tuple[ScheduledSeq, ...]  # decodes first, then prefill chunks
    reset_slots: tuple[int, ...]  # live slots handed to a new owner with no cached state: zero them
    preempted: tuple[str, ...]
    # (boundary slot, live slot) of prefix hits: copy the cached state in before the forward.
    state_copies: tuple[tuple[int, int], ...] = ()
    # A plain decode step planned before the previous step's tokens were known (`schedule_next`):
    # row i's input is the token sampled by row fed_rows[i] of that step (token_ids: FED_TOKEN).
    fed_rows: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, cache: CacheManager,
                 mamba_cache_mode: str = "none", num_speculative_tokens: int = 0,
                 max_model_len: int | None = None) -> None:
        check_mamba_cache_mode(mamba_cache_mode)  # EngineConfig checks the engine's; tests build schedulers directly
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.cache = cache
        self.mamba_cache_mode = mamba_cache_mode
        self.num_speculative_tokens = num_speculative_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.unfinished: dict[str, Request] = {}
        self.num_preemptions = 0
        self._flying: Counter[str] = Counter()  # request id -> launched steps with a row of it, not landed
        self._parked: list[Request] = []  # finished while flying: blocks and slot not yet returned
        self._held: list[Request] = []  # set aside by `hold`
        # Requests that cannot run yet (their grammar compiles), beside the queue until `ready`.
        self.unready: dict[str, Request] = {}

    def add(self, request: Request, ready: bool = True) -> None:
        """Queues a request; ready=False keeps it beside the queue until `ready` is called."""
        if ready:
            self.waiting.append(request)
        else:
            self.unready[request.request_id] = request
        self.unfinished[request.request_id] = request

    def ready(self, request: Request) -> None:
        """A request added with ready=False can run: it joins the queue."""
        del self.unready[request.request_id]
        self.waiting.append(request)

    def hold(self, keep: Collection[str]) -> None:
        """Sets aside every unfinished request whose id is not in ``keep`` (running ones are
        preempted first), so that the following steps run only ``keep``'s; `release` brings them
        back. Used to find which request makes steps fail; no step may be in flight."""
        assert not self._flying and not self._held, "hold needs no step in flight and nothing held"
        for request in [r for r in self.running if r.request_id not in keep]:
            self._preempt(request, count=False)
        self._held = [r for r in self.waiting if r.request_id not in keep]
        self.waiting = deque(r for r in self.waiting if r.request_id in keep)

    def release(self) -> None:
        """Requeues what `hold` set aside, first come first served among the waiting."""
        if self._held:
            self.waiting = deque(sorted([*self.waiting, *self._held], key=lambda r: r.arrival))
            self._held = []

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.unready)

    def schedule(self, drafts: Mapping[str, tuple[int, ...]] | None = None) -> StepPlan:
        """Plans the next step. drafts: proposed tokens per decoding request (at most its
        `draft_room`), proposed before planning: the scheduler never runs a model. A row takes
        the ones the token budget leaves room for. If planning raises (an interrupt), the requests
        it admitted go back to the queue and the boundary slots it took are released."""
        admitted: list[Request] = []
        try:
            return self._schedule(admitted, drafts or {})
        except BaseException:
            for request in reversed(admitted):  # appendleft in reverse keeps their order
                if request.status is Status.RUNNING:
                    self._preempt(request, count=False)
            self.cache.end_step()
            raise

    def _schedule(self, admitted: list[Request], proposed: Mapping[str, tuple[int, ...]]) -> StepPlan:
        budget = self.max_num_batched_tokens
        decodes: list[ScheduledSeq] = []
        prefills: list[ScheduledSeq] = []
        preempted: list[str] = []
        # Decode rows first, then prefills still under way: a long prompt's chunk never takes the
        # budget a decoding request's next token needs (decoding does not stall behind prompts).
        for request in [r for r in self.running if r.decoding] + [r for r in self.running if not r.decoding]:
            if request.status is not Status.RUNNING or budget == 0:
                continue  # preempted as a victim earlier in this loop, or out of budget
            start = request.num_computed_tokens
            drafts = proposed.get(request.request_id, ())[: budget - 1] if request.decoding else ()
            n = 1 + len(drafts) if request.decoding else min(request.num_tokens - start, budget)
            if n == 0 or not self._reserve(request, n, preempted):
                continue
            budget -= n
            (decodes if request.decoding else prefills).append(self._scheduled(request, n, drafts))
        reset: list[int] = []
        copies: list[tuple[int, int]] = []
        # Admitting after a preemption would only take back the blocks just freed.
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            # A hit would skip positions whose logits score the prompt (engine/prompt_logprobs.py).
            hit = NO_HIT if request.needs_prompt_logprobs else self.cache.find_hit(request)
            if self.mamba_cache_mode == "align" and hit.attention_tokens > hit.num_tokens:
                # A branch point: keep a state where the cached KV ends, so one exists there next time.
                grid = self.cache.state_block
                request.branch_point = hit.attention_tokens // grid * grid or None
            n = min(request.num_tokens - hit.num_tokens, budget)
            if n == 0 or not self.cache.can_admit(hit, hit.num_tokens + n):
                break
            self.waiting.popleft()
            request.state_slot = self.cache.admit(request, hit, hit.num_tokens + n)
            request.num_computed_tokens = hit.num_tokens
            request.status = Status.RUNNING
            self.running.append(request)
            admitted.append(request)
            if hit.state_slot is not None:
                copies.append((hit.state_slot, request.state_slot))
            else:
                reset.append(request.state_slot)
            budget -= n
            prefills.append(self._scheduled(request, n))
        return StepPlan(tuple(decodes + prefills), tuple(reset), tuple(preempted), tuple(copies))

    def overlappable(self, plan: StepPlan) -> bool:
        """Every row decodes one token and nothing between the steps needs the host: no drafts,
        no Mamba boundary state, no slot reset or copy, no penalties or min_tokens (the sampler
        reads those rows' tokens so far). The step after such a step can be planned before its
        tokens are known (`schedule_next`). A grammar's mask needs the previous token, but only
        the sampling reads it: the engine queues such a step's forward first (`Engine._launch`)."""
        if not plan.seqs or plan.reset_slots or plan.state_copies:
            return False
        return all(s.is_decode and not s.num_drafts and not s.boundary_writes
                   and not uses_history(self.unfinished[s.request_id].params) for s in plan.seqs)

    def schedule_next(self, plan: StepPlan) -> StepPlan | None:
        """The plain decode step after `plan`, planned while `plan` runs (async scheduling): its
        requests' tokens are not updated by it yet, and each row goes on from the token `plan`
        samples for it, which the runner feeds on the device (`StepPlan.fed_rows`). A request
        that token surely ends (max_tokens, max_model_len) gets no row; one that a stop token or
        string ends runs once more, and the engine drops that row's result.

        None when `schedule` might plan anything else once `plan`'s tokens are in: an admission
        (a request waits and there is room), a prefill chunk, a request the budget leaves out, a
        preemption (too few free KV blocks), a Mamba boundary state. Only KV blocks are taken.
        `plan` must be `overlappable`."""
        rows: list[tuple[int, Request, ScheduledSeq]] = []
        in_plan = 0
        for i, seq in enumerate(plan.seqs):
            request = self.unfinished.get(seq.request_id)
            if request is None or request.status is not Status.RUNNING:
                continue  # aborted while the step ran
            in_plan += 1
            num_output = len(request.output_token_ids) + 1  # with the token `plan` samples
            if num_output >= request.params.max_tokens or (
                    self.max_model_len is not None
                    and len(request.prompt_token_ids) + num_output >= self.max_model_len):
                continue
            rows.append((i, request, seq))
        room = min(self.max_num_seqs, self.max_num_batched_tokens)
        if (not rows or in_plan != len(self.running) or len(rows) > self.max_num_batched_tokens
                or (self.waiting and len(rows) < room)):
            return None
        grid = self.cache.state_block if self.mamba_cache_mode != "none" else 0
        need = 0
        for _, request, seq in rows:
            end = seq.start_pos + 2  # the next step computes position start_pos + 1
            if grid and end % grid == 0:
                return None
            need += self.cache.new_blocks(request.request_id, end)
        if need > self.cache.kv.num_free:
            return None
        seqs = []
        for _, request, seq in rows:
            end = seq.start_pos + 2
            if not self.cache.holds(request.request_id, end):
                self.cache.grow(request.request_id, end)
            seqs.append(ScheduledSeq(request.request_id, (FED_TOKEN,), end - 1, self.cache.table(request.request_id),
                                     seq.state_slot, is_decode=True, sample=True))
        return StepPlan(tuple(seqs), (), (), fed_rows=tuple(i for i, _, _ in rows))

    def fly(self, plan: StepPlan) -> None:
        """`plan` was launched: until it lands, its requests' blocks and slots stay taken."""
        self._flying.update(s.request_id for s in plan.seqs)

    def land(self, plan: StepPlan) -> None:
        """`plan` has finished on the device: requests that finished while it ran give back their
        blocks and slot once no other launched step has a row of them."""
        for seq in plan.seqs:
            self._flying[seq.request_id] -= 1
            if self._flying[seq.request_id] <= 0:
                del self._flying[seq.request_id]
        self._return_parked()

    def land_all(self) -> None:
        """Forgets every launched step (they are abandoned): every later use of what they held is
        queued behind them on the device."""
        self._flying.clear()
        self._return_parked()

    def _return_parked(self) -> None:
        for request in [r for r in self._parked if r.request_id not in self._flying]:
            self._parked.remove(request)
            self._free(request)

    def draft_room(self, request: Request) -> int:
        """How many drafts a running request may verify next step (0: none): at most k, and what
        max_tokens and max_model_len leave room for (every kept token must still be a legal
        output). Rows with penalties or min_tokens take none: those read one position per row."""
        if not self.num_speculative_tokens or not request.decoding or uses_history(request.params):
            return 0
        room = min(self.num_speculative_tokens, request.params.max_tokens - len(request.output_token_ids) - 1)
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - request.num_tokens - 1)
        return max(room, 0)

    def _keep_points(self, request: Request) -> tuple[int, ...]:
        """``align``: grid points inside a prefill chunk whose states are kept besides the last one
        it crosses (chunks are cut by the budget alone, as in ``none``: cutting them on the grid
        cost a whole extra step per wave of long prompts): the last one before the last known
        token (or a prompt that is a whole number of grid blocks never leaves a usable state) and a
        branch point. The scan emits them all."""
        if self.mamba_cache_mode != "align" or request.decoding:
            return ()
        grid = self.cache.state_block
        return tuple(p for p in ((request.num_tokens - 1) // grid * grid, request.branch_point) if p)

    def _reserve(self, request: Request, n: int, preempted: list[str]) -> bool:
        """Allocates blocks for n more tokens, preempting the newest running requests if needed."""
        total = request.num_computed_tokens + n
        if self.cache.holds(request.request_id, total):
            return True
        while not self.cache.can_grow(request.request_id, total):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        self.cache.grow(request.request_id, total)
        return True

    def _scheduled(self, request: Request, n: int, drafts: tuple[int, ...] = ()) -> ScheduledSeq:
        start = request.num_computed_tokens
        assert request.state_slot is not None
        writes = ()
        if self.mamba_cache_mode != "none":
            # A verify may end anywhere in its window: plan every boundary it can reach; the
            # ones beyond what is accepted are dropped after the step.
            every = self.mamba_cache_mode == "all" or bool(drafts)
            writes = tuple(self.cache.plan_boundaries(request, start, n, every=every,
                                                      also=() if every else self._keep_points(request)))
        targets: tuple[int, ...] = ()
        if request.needs_prompt_logprobs and not drafts:  # positions p in [start, start + n) predict p + 1
            targets = tuple(request.prompt_token_ids[start + 1 : min(start + n, len(request.prompt_token_ids) - 1) + 1])
        return ScheduledSeq(
            request_id=request.request_id,
            token_ids=tuple(request.token_range(start, start + n - len(drafts))) + drafts,
            start_pos=start,
            block_table=self.cache.table(request.request_id),
            state_slot=request.state_slot,
            is_decode=request.decoding,
            sample=start + n - len(drafts) == request.num_tokens,
            boundary_writes=writes,
            num_drafts=len(drafts),
            prompt_targets=targets,
            prompt_top_k=request.params.prompt_logprobs or 0,
        )

    def _preempt(self, request: Request, count: bool = True) -> None:
        """Recompute preemption: drop the request's KV and state; it prefills again on readmission."""
        assert request.request_id not in self._flying, "a request is preempted while a launched step runs it"
        self._release(request)
        request.status = Status.WAITING
        request.num_computed_tokens = 0
        request.decoding = False
        request.branch_point = None
        self.waiting.appendleft(request)
        self.num_preemptions += count

    def _release(self, request: Request) -> None:
        self.running.remove(request)
        if request.request_id in self._flying:  # a launched step still writes its KV and state
            self._parked.append(request)
        else:
            self._free(request)

    def _free(self, request: Request) -> None:
        self.cache.free(request)
        request.state_slot = None

    def update(self, plan: StepPlan, emitted: dict[str, int] | None = None) -> None:
        """After the step ran and its sampled tokens were appended: marks the computed tokens and
        publishes what they filled. ``emitted[request_id]``, for a verify row: the tokens it
        appended (accepted drafts and the bonus token, cut after a stop); the last known token and
        the accepted drafts among them are now computed, the rest were rejected or lie past the stop."""
        for seq in plan.seqs:
            request = self.unfinished[seq.request_id]
            if seq.num_drafts and emitted is None:
                raise ValueError(f"request {seq.request_id} verified drafts: update needs its emitted count")
            request.num_computed_tokens += emitted[seq.request_id] if seq.num_drafts else len(seq.token_ids)
            if request.branch_point is not None and request.num_computed_tokens >= request.branch_point:
                request.branch_point = None
            if seq.sample:
                request.decoding = True
            if seq.boundary_writes or self.cache.enable_caching:
                self.cache.publish(request, seq.boundary_writes)
        self.cache.end_step()

    def abandon(self, plan: StepPlan) -> None:
        """A step that raised part-way (in the forward or after it): its requests' states may be
        half-written, so those still running are preempted (recomputed from scratch when
        readmitted), and the boundary slots the step still holds go back unpublished. Published
        KV blocks and states stay: they hold exactly what their hashes name."""
        for seq in plan.seqs:
            request = self.unfinished.get(seq.request_id)
            if request is not None and request.status is Status.RUNNING:
                self._preempt(request, count=False)
        self.cache.end_step()

    def finish(self, request: Request, reason: str) -> None:
        if request.status is Status.RUNNING:
            self._release(request)
        elif request.request_id in self.unready:
            del self.unready[request.request_id]
        elif request.status is Status.WAITING:
            self.waiting.remove(request)
        request.status = Status.FINISHED
        request.finish_reason = reason
        del self.unfinished[request.request_id]
