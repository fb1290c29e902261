"""The Gated DeltaNet families (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) give the same float64 greedy tokens
whatever the engine does around the model, on the baseline and the ReplaySSM GDN backends: prefix caching
none / align / all (hits included), n-gram and draft-model speculation, and speculation with chunked prefill
and preemption (an oracle proposer whose drafts are partly wrong, so rollback commits mid-row). The
reference is the baseline without caching or speculation: ReplaySSM (window 5, so flushes come every few
steps and inside verifies) must give its tokens too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from replayserve import LLM, SamplingParams
from replayserve.builtin.tiny import make_tiny
from replayserve.speculative.proposers import OracleProposer
from tests.conftest import assert_pools_full
from tests.engine.test_prefix_cache import _llm, _speculative, _workload

FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
GREEDY = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module", params=FAMILIES)
def gdn_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list]:
    """A tiny checkpoint of the family, a draft model of the family (other weights), and the
    reference outputs (no caching, no speculation)."""
    model_dir = make_tiny(tmp_path_factory.mktemp(request.param), family=request.param)
    draft_dir = make_tiny(tmp_path_factory.mktemp(f"{request.param}_draft"), seed=1, family=request.param)
    return model_dir, draft_dir, _workload(_llm(model_dir).engine)


@pytest.mark.parametrize("backend", ["baseline", "replay"])
@pytest.mark.parametrize(("mode", "spec"), [("none", None), ("align", None), ("all", None), (None, "ngram"),
                                            ("all", "ngram"), ("align", "draft")])
def test_greedy_tokens_equal_across_caching_and_speculation(gdn_model: tuple[Path, Path, list], mode: str | None,
                                                            spec: str | None, backend: str) -> None:
    model_dir, draft_dir, reference = gdn_model
    assert len({t for _, out in reference for t in out}) > 8  # not one repeated token
    llm = _llm(model_dir, backend, mode, **_speculative(spec, draft_dir))
    assert _workload(llm.engine) == reference
    metrics = llm.get_metrics()
    if mode is not None:  # mode none keeps no recurrent state, so a hybrid model never hits
        assert (metrics["prefix_cache_hits"] > 0) == (mode != "none")
    if spec:
        assert metrics["spec_num_draft_tokens"] > 0
    assert_pools_full(llm)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 500, (12,), generator=gen).tolist()
    return [shared + torch.randint(3, 500, (n,), generator=gen).tolist() for n in (1, 18, 5)] + [shared[:7]]


@pytest.mark.parametrize("backend", ["baseline", "replay"])
@pytest.mark.parametrize("mode", [None, "all"])
def test_spec_with_chunking_preemption_and_rollback(gdn_model: tuple[Path, Path, list], mode: str | None,
                                                    backend: str) -> None:
    model_dir, _, _ = gdn_model
    plain = LLM(model=str(model_dir), dtype="float64", device="cpu", max_num_seqs=4)
    want = [o.token_ids for o in plain.generate([{"prompt_token_ids": p} for p in _prompts()], GREEDY,
                                                use_tqdm=False)]
    proposer = OracleProposer({tuple(p): w for p, w in zip(_prompts(), want, strict=True)}, corrupt_prob=0.4,
                              vocab_size=512, seed=1)
    # A 10-token budget chunks prefills and squeezes drafts; 20 blocks of 4 force preemptions.
    llm = LLM(model=str(model_dir), dtype="float64", device="cpu", max_num_seqs=4, block_size=4, num_kv_blocks=20,
              max_model_len=72, max_num_batched_tokens=10, enable_prefix_caching=mode is not None,
              mamba_cache_mode=mode or "none", mamba_block_size=4, ssm_backend=backend,
              speculative={"method": "custom", "num_speculative_tokens": 3, "proposer": proposer})
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    m = llm.get_metrics()
    assert m["num_preemptions"] > 0 and 0 < m["spec_num_accepted_tokens"] < m["spec_num_draft_tokens"]
    if mode is not None:
        assert m["prefix_cache_hits"] > 0
    assert_pools_full(llm)
