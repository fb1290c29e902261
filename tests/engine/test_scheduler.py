"""Scheduling policy on plain data: no model, no tensors."""

from __future__ import annotations

import pytest

from replayserve.builtin.tiny import tiny_config
from replayserve.cache.manager import CacheManager
from replayserve.config import ConfigError, EngineConfig
from replayserve.engine.request import Request
from replayserve.engine.scheduler import Scheduler, StepPlan
from replayserve.sampling_params import SamplingParams


def _scheduler(num_blocks: int = 64, block_size: int = 4, budget: int = 8, max_seqs: int = 4) -> Scheduler:
    return Scheduler(max_seqs, budget, CacheManager(num_blocks, block_size, max_seqs))


def _request(i: int, n: int) -> Request:
    return Request(str(i), list(range(3, 3 + n)), SamplingParams(max_tokens=100), arrival=i)


def _run(s: Scheduler, plan: StepPlan, token: int = 7) -> None:
    """What the engine does after a step: mark computed, append a token to sampling rows."""
    s.update(plan)
    for seq in plan.seqs:
        if seq.sample:
            s.unfinished[seq.request_id].output_token_ids.append(token)


def test_chunked_prefill_shares_steps_with_decodes_under_the_budget() -> None:
    s = _scheduler(budget=8)
    s.add(_request(0, 3))
    s.add(_request(1, 19))
    plan = s.schedule()
    assert [(q.request_id, len(q.token_ids), q.sample) for q in plan.seqs] == [("0", 3, True), ("1", 5, False)]
    assert plan.reset_slots == (0, 1)
    _run(s, plan)
    plan = s.schedule()
    # Request 0 decodes (first), request 1 continues its prefill with the rest of the budget.
    assert [(q.request_id, q.is_decode, len(q.token_ids), q.start_pos) for q in plan.seqs] == [
        ("0", True, 1, 3), ("1", False, 7, 5)
    ]
    assert plan.num_tokens <= 8 and plan.reset_slots == ()
    _run(s, plan)
    plan = s.schedule()
    assert [(q.request_id, len(q.token_ids), q.sample) for q in plan.seqs] == [("0", 1, True), ("1", 7, True)]
    # The block table covers exactly the positions computed so far.
    assert len(plan.seqs[1].block_table) == 5


def test_decode_rows_get_their_token_before_an_earlier_prompt_continues_its_prefill() -> None:
    """A prompt admitted before a decoding request, still prefilling, takes only what the decode
    rows leave: decoding never stalls behind a prompt, whatever the admission order."""
    s = _scheduler(budget=8)
    s.add(_request(0, 3))
    _run(s, s.schedule())  # request 0 decodes from now on
    long_prompt, late = _request(1, 30), _request(2, 2)
    s.add(long_prompt)
    s.add(late)
    plan = s.schedule()  # 0 decodes; the long prompt takes the remaining 7 tokens, 2 waits
    assert [(q.request_id, len(q.token_ids)) for q in plan.seqs] == [("0", 1), ("1", 7)]
    _run(s, plan)
    s.running.remove(long_prompt)  # the long prompt runs ahead of the decode rows from here on
    s.running.insert(0, long_prompt)
    plan = s.schedule()
    assert [(q.request_id, q.is_decode, len(q.token_ids)) for q in plan.seqs] == [("0", True, 1), ("1", False, 7)]


def test_max_num_seqs_and_slots_bound_admission() -> None:
    s = _scheduler(budget=100, max_seqs=2)
    for i in range(3):
        s.add(_request(i, 4))
    plan = s.schedule()
    assert [q.request_id for q in plan.seqs] == ["0", "1"]
    assert len(s.waiting) == 1


def test_preemption_frees_the_newest_and_readmits_with_its_outputs() -> None:
    # 6 blocks of 4 tokens: two 8-token prompts fill 4 blocks; growth runs out at 12 tokens each.
    s = _scheduler(num_blocks=6, block_size=4, budget=100)
    s.add(_request(0, 8))
    s.add(_request(1, 8))
    preempted = []
    for _ in range(8):
        plan = s.schedule()
        preempted += plan.preempted
        _run(s, plan)
    assert preempted == ["1"]
    assert s.cache.kv.num_free + sum(len(o.table) for o in s.cache.owned.values()) == 6
    s.cache.check()
    victim = s.unfinished["1"]
    assert victim.output_token_ids and victim.num_computed_tokens == 0 and victim in s.waiting
    s.finish(s.unfinished["0"], "length")
    # Readmitted: it prefills its prompt plus the tokens it had generated, from position 0, in a fresh slot.
    plan = s.schedule()
    (seq,) = plan.seqs
    assert (seq.request_id, seq.start_pos, seq.token_ids) == ("1", 0, tuple(victim.all_token_ids))
    assert seq.state_slot in plan.reset_slots and not seq.is_decode


def test_finish_releases_blocks_and_slot() -> None:
    s = _scheduler()
    s.add(_request(0, 9))
    _run(s, s.schedule())
    s.finish(s.unfinished["0"], "stop")
    assert s.cache.kv.num_free == 64 and s.cache.live.num_free == 4 and not s.has_unfinished()
    s.cache.check()


def test_an_unknown_mamba_cache_mode_is_refused_as_engine_config_refuses_it() -> None:
    with pytest.raises(ConfigError, match="engine option mamba_cache_mode: 'some'") as from_config:
        EngineConfig(model=tiny_config(), enable_prefix_caching=True, mamba_cache_mode="some")
    with pytest.raises(ConfigError) as from_scheduler:
        Scheduler(4, 8, CacheManager(64, 4, 4), mamba_cache_mode="some")
    assert str(from_scheduler.value) == str(from_config.value)
