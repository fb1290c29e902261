"""A request that stops on an accepted draft inside a verify (stop token, stop string, length)
with prefix caching on: only the tokens it emitted count as computed, nothing is published past
them, and the pools end full (issue: IndexError in CacheManager.publish)."""

from __future__ import annotations

from pathlib import Path

import pytest

from replayserve import LLM, SamplingParams
from replayserve.speculative.proposers import OracleProposer
from tests.conftest import assert_pools_full
from tests.engine.test_prefix_cache import _tokens

PROMPTS = [_tokens(n, seed) for n, seed in ((6, 11), (9, 12), (13, 13))]


def _llm(model_dir: Path, backend: str, mode: str, spec: dict | None = None) -> LLM:
    return LLM(model=str(model_dir), dtype="float64", device="cpu", block_size=4, mamba_block_size=4,
               max_num_seqs=4, max_model_len=96, num_mamba_cache_slots=16, ssm_backend=backend, replay_window=8,
               enable_prefix_caching=True, mamba_cache_mode=mode, speculative=spec)


@pytest.mark.parametrize(("k", "stop_at"), [(2, 1), (3, 2), (4, 5)])
@pytest.mark.parametrize(("backend", "mode"), [("baseline", "align"), ("baseline", "all"), ("replay", "all")])
def test_stop_token_on_an_accepted_draft(tiny_model_dir: Path, backend: str, mode: str, k: int,
                                         stop_at: int) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = _llm(tiny_model_dir, backend, mode)
    paths = [o.token_ids for o in plain.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)]
    # Perfect drafts: every stop falls inside a verify, on an accepted draft whenever it can.
    proposer = OracleProposer({tuple(p): o for p, o in zip(PROMPTS, paths, strict=True)}, 0.0, 512)
    llm = _llm(tiny_model_dir, backend, mode, {"method": "custom", "num_speculative_tokens": k, "proposer": proposer})
    for prompt, path in zip(PROMPTS, paths, strict=True):
        stop = path[stop_at]
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop])
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        want = path[: path.index(stop) + 1]
        assert out.token_ids == want and out.finish_reason == "stop"
        # A second turn on top reads what the first published: still the greedy continuation.
        again = llm.generate([{"prompt_token_ids": prompt + want}], greedy, use_tqdm=False)[0]
        ref = plain.generate([{"prompt_token_ids": prompt + want}], greedy, use_tqdm=False)[0]
        assert again.token_ids == ref.token_ids
        assert_pools_full(llm)
    assert llm.get_metrics()["spec_num_accepted_tokens"] > 0
