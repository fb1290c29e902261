"""ReplaySSM with mamba_cache_mode='all': decode boundaries are materialized from the checkpoint
plus the committed ring, with replay lengths pinned to the design doc's worked examples
(``docs/prefix-cache.md``, Canonical state: block 16, window 16, T = 1)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from replayserve import LLM, SamplingParams
from tests.conftest import assert_pools_full
from tests.engine.test_prefix_cache import check_boundary_states


def _recorded_materializations(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Wraps the backend's materialize op to record (dst slot, n) of every row it folds."""
    import replayserve.ssm.replay as replay

    ssm = llm.engine.runner.ssm
    calls: list[tuple[int, int]] = []
    inner = replay.replay_materialize

    def recording(state, x_ring, dt_ring, b_ring, A, src, dst, start, n):  # noqa: ANN001, ANN202
        if state is ssm.ssm_state[0]:  # once per row, not once per layer
            calls.extend(zip(dst.tolist(), n.tolist(), strict=True))
        return inner(state, x_ring, dt_ring, b_ring, A, src, dst, start, n)

    monkeypatch.setattr(replay, "replay_materialize", recording)
    return calls


@pytest.mark.parametrize(("prompt_len", "decodes", "expected"), [
    # Prefill ends at 100; 12 steps commit 100..111, none flushes: boundary 112 replays n = 12.
    (100, 13, [12]),
    # Prefill ends at 95: boundary 96 after one step (n = 1); 16 steps commit 95..110, the step for
    # 111 flushes them into the checkpoint (ckpt = 111), so boundary 112 replays only n = 1.
    (95, 18, [1, 1]),
])
def test_replay_lengths_mid_ring_and_right_after_a_flush(tiny_model_dir: Path, prompt_len: int, decodes: int,
                                                          expected: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(model=str(tiny_model_dir), dtype="float64", device="cpu", block_size=16, max_num_seqs=2,
              max_model_len=160, max_num_batched_tokens=128, ssm_backend="replay", replay_window=16,
              enable_prefix_caching=True, mamba_cache_mode="all", num_mamba_cache_slots=16)
    calls = _recorded_materializations(llm, monkeypatch)
    prompt = torch.randint(3, 500, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len)).tolist()
    # `decodes` sampled tokens: the first from the prefill, then one per decode step.
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=decodes,
                                                                      ignore_eos=True), use_tqdm=False)[0]
    assert [n for _, n in calls] == expected
    assert check_boundary_states(llm, tiny_model_dir) == (prompt_len + decodes - 1) // 16
    # The published decode boundary is hit by a request that extends the finished sequence.
    longer = prompt + out.token_ids + [7, 8, 9]
    llm.generate([{"prompt_token_ids": longer}], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    assert llm.get_metrics()["prefix_cache_hits"] == (len(longer) - 1) // 16 * 16
    assert_pools_full(llm)
