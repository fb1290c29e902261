"""A hypothesis state machine drives the engine's prefix cache with random arrivals, second turns,
aborts and steps on small pools (so blocks are evicted and requests preempted). After every rule
the pools agree with the requests' holdings; every published Mamba boundary state equals the
state recomputed from scratch for its prefix, and every hash maps to the tokens it stands for;
at the end every pool is full again and each completed output equals caching off."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from replayserve import LLM, SamplingParams
from replayserve.builtin.tiny import make_tiny
from replayserve.engine.request import Request, Status
from tests.conftest import assert_pools_full
from tests.engine.test_prefix_cache import _llm, check_boundary_states

BASES = [torch.randint(3, 500, (14,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(3)]
_shared: dict = {}


def _model_dir():  # noqa: ANN202 - one tiny model for every example
    if "dir" not in _shared:
        import tempfile
        _shared["dir"] = make_tiny(tempfile.mkdtemp(), seed=0, layers="M*-ME")
    return _shared["dir"]


def _expected(prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy output with caching off (memoised)."""
    key = (tuple(prompt), max_tokens)
    if key not in _shared:
        llm = _shared.get("oracle") or _llm(_model_dir(), max_num_batched_tokens=256)
        _shared["oracle"] = llm
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        _shared[key] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].token_ids
    return _shared[key]


class PrefixCacheMachine(RuleBasedStateMachine):
    backend = "baseline"
    mode = "all"

    def __init__(self) -> None:
        super().__init__()
        # 17 blocks of 4 hold one or two requests of these sizes: blocks are evicted and requests
        # preempted; 3 boundary slots churn.
        self.llm: LLM = _llm(_model_dir(), self.backend, self.mode, max_num_seqs=3, num_kv_blocks=17,
                             max_model_len=64, max_num_batched_tokens=16, num_mamba_cache_slots=3)
        self.engine = self.llm.engine
        self.requests: list[Request] = []
        self.oracle_states: dict = _shared.setdefault(("states", self.backend), {})

    def _add(self, prompt: list[int], max_tokens: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.requests.append(self.engine.add_request(prompt[:48], params))

    @rule(base=st.integers(0, len(BASES) - 1), keep=st.integers(1, 14), suffix=st.integers(0, 6),
          max_tokens=st.integers(1, 24), seed=st.integers(0, 50))
    def arrive(self, base: int, keep: int, suffix: int, max_tokens: int, seed: int) -> None:
        tail = torch.randint(3, 500, (suffix,), generator=torch.Generator().manual_seed(seed)).tolist()
        self._add(BASES[base][:keep] + tail, max_tokens)

    @precondition(lambda self: any(r.finish_reason == "length" for r in self.requests))
    @rule(pick=st.integers(0, 99), extra=st.integers(1, 5), max_tokens=st.integers(1, 12))
    def second_turn(self, pick: int, extra: int, max_tokens: int) -> None:
        done = [r for r in self.requests if r.finish_reason == "length"]
        first = done[pick % len(done)]
        self._add(first.prompt_token_ids + first.output_token_ids + [5] * extra, max_tokens)

    @precondition(lambda self: any(r.status is not Status.FINISHED for r in self.requests))
    @rule(pick=st.integers(0, 99))
    def abort(self, pick: int) -> None:
        live = [r for r in self.requests if r.status is not Status.FINISHED]
        self.engine.abort(live[pick % len(live)])

    @precondition(lambda self: self.engine.has_unfinished())
    @rule(steps=st.integers(1, 4))
    def step(self, steps: int) -> None:
        for _ in range(steps):
            if self.engine.has_unfinished():
                self.engine.step()

    @invariant()
    def pools_agree_and_states_are_exact(self) -> None:
        self.engine.cache.check()
        check_boundary_states(self.llm, _model_dir(), self.oracle_states)

    def teardown(self) -> None:
        while self.engine.has_unfinished():
            self.engine.step()
        self.pools_agree_and_states_are_exact()
        assert_pools_full(self.llm)
        for r in self.requests:
            if r.finish_reason == "length":
                assert r.output_token_ids == _expected(r.prompt_token_ids, r.params.max_tokens)


class ReplayAlignMachine(PrefixCacheMachine):
    backend = "replay"
    mode = "align"


SETTINGS = settings(max_examples=8, stateful_step_count=20, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@pytest.mark.parametrize("machine", [PrefixCacheMachine, ReplayAlignMachine], ids=["baseline-all", "replay-align"])
def test_prefix_cache_state_machine(machine: type[PrefixCacheMachine]) -> None:
    machine.TestCase.settings = SETTINGS
    machine.TestCase().runTest()
