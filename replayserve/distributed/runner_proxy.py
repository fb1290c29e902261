"""The runner on each side of tensor parallelism: rank 0's mirrors every call that runs the model
or changes its state to the workers, whose runners replay them in the same order.

Mirrored: `execute` (the plan: slot resets and copies for prefix caching, the forward, boundary
states, the SSM backend's step), a model proposer's `propose_batch` (MTP), the startup warm-up's
MoE sweep and decode graphs (`prepare_for_serving`), and `forget` (queued, sent with the next
call). Each rank computes the same full logits; rank 0 alone samples and sends the results, so
every rank commits the same accepted tokens to its Mamba states and records the same hidden
states for MTP, whatever the sampling parameters and seeds.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any, BinaryIO

import torch

from replayserve.config import EngineConfig
from replayserve.distributed.group import Workers
from replayserve.engine.runner import Runner, StepOutput
from replayserve.engine.sampler import SampleResult
from replayserve.engine.scheduler import StepPlan
from replayserve.models.nemotron_h import NemotronHForCausalLM
from replayserve.ops.token_bitmask import TokenMask
from replayserve.sampling_params import SamplingParams
from replayserve.speculative.mtp import HiddenStore
from replayserve.speculative.proposers import DraftRequest, Proposer


class DriverRunner(Runner):
    """Rank 0's runner."""

    def __init__(self, config: EngineConfig, model: NemotronHForCausalLM, workers: Workers,
                 hidden_store: HiddenStore | None = None) -> None:
        super().__init__(config, model, hidden_store)
        self.workers = workers
        self._forgotten: list[str] = []

    def call(self, name: str, payload: Any) -> None:
        """Sends a call to the workers, with the requests forgotten since the last one."""
        forgotten, self._forgotten = self._forgotten, []
        self.workers.send((name, (payload, forgotten)))

    def execute(self, plan: StepPlan, params: list[SamplingParams], generators: list[torch.Generator | None],
                histories: list[tuple[list[int], list[int]]] | None = None,
                grammar_masks: Callable[[], TokenMask | None] | None = None) -> StepOutput:
        self.call("execute", plan)
        with self.workers.watch():
            return super().execute(plan, params, generators, histories, grammar_masks)

    def prepare_for_serving(self) -> tuple[tuple[int, int], ...]:
        self.call("prepare_for_serving", None)  # every rank compiles, and captures graphs with collectives
        with self.workers.watch():
            return super().prepare_for_serving()

    def _draw(self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
              drafts: list[tuple[int, ...]] | None, histories: list[tuple[list[int], list[int]]] | None,
              grammar: TokenMask | None = None) -> list[SampleResult]:
        results = super()._draw(logits, params, generators, drafts, histories, grammar)
        self.workers.send(("results", results))
        return results

    def forget(self, request_id: str) -> None:
        super().forget(request_id)
        if self.hidden_store is not None:
            self._forgotten.append(request_id)

    def mirror(self, proposer: Proposer) -> Proposer:
        return MirroredProposer(proposer, self)


class MirroredProposer(Proposer):
    """A proposer that runs the sharded model (MTP): each rank runs the same batch."""

    def __init__(self, proposer: Proposer, runner: DriverRunner) -> None:
        self.proposer, self.runner = proposer, runner

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        return self.proposer.propose(token_ids, k)

    def propose_batch(self, requests: Sequence[DraftRequest]) -> dict[str, tuple[int, ...]]:
        self.runner.call("propose", list(requests))
        with self.runner.workers.watch():
            return self.proposer.propose_batch(requests)


class WorkerRunner(Runner):
    """A worker's runner: replays rank 0's calls and takes its sampling results from `inbox`."""

    def __init__(self, config: EngineConfig, model: NemotronHForCausalLM, inbox: BinaryIO,
                 hidden_store: HiddenStore | None = None) -> None:
        super().__init__(config, model, hidden_store)
        self.inbox = inbox

    def receive(self) -> tuple[str, Any]:
        """The next message from rank 0 (EOFError once rank 0 has gone)."""
        return pickle.load(self.inbox)

    def _draw(self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
              drafts: list[tuple[int, ...]] | None, histories: list[tuple[list[int], list[int]]] | None,
              grammar: TokenMask | None = None) -> list[SampleResult]:
        kind, results = self.receive()
        assert kind == "results", f"rank 0 sent {kind!r} where a step's sampling results belong"
        return results
