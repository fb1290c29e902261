"""Every model family gives the same float64 greedy tokens whatever the engine does around the
model: both SSM backends, prefix caching none / align / all (hits included), n-gram and draft-model
speculation. Nemotron-H's own tests (test_prefix_cache.py, test_spec_decode.py) cover it; here the others, on
the prefix-cache workload (a shared system prompt, hits while the donor decodes, a second turn)."""

from __future__ import annotations

from pathlib import Path

import pytest

from replayserve.builtin.tiny import make_tiny
from tests.conftest import assert_pools_full
from tests.engine.test_prefix_cache import _llm, _speculative, _workload

# (family, ModelConfig overrides): Granite with MoE and RoPE (make-tiny's), and dense with NoPE; Bamba; Falcon-H1.
VARIANTS = {
    "granite_moe_rope": ("granite", {}),
    "granite_dense_nope": ("granite", {"n_routed_experts": 0, "rope_theta": None, "n_groups": 1}),
    "bamba": ("bamba", {}),
    "falcon_h1": ("falcon_h1", {}),
}
SETTINGS = [
    ("replay", None, None), ("baseline", "align", None), ("baseline", "all", None), ("replay", "align", None),
    ("replay", "all", None), ("baseline", None, "ngram"), ("replay", "all", "ngram"), ("baseline", None, "draft"),
    ("replay", "align", "draft"),
]


@pytest.fixture(scope="module", params=list(VARIANTS))
def family_model(request: pytest.FixtureRequest,
                 tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list]:
    """A tiny checkpoint of the variant, a draft model of its family (other weights), and the
    variant's reference outputs (baseline backend, no caching)."""
    family, sizes = VARIANTS[request.param]
    model_dir = make_tiny(tmp_path_factory.mktemp(request.param), family=family, **sizes)
    draft_dir = make_tiny(tmp_path_factory.mktemp(f"{request.param}_draft"), seed=1, family=family, **sizes)
    return model_dir, draft_dir, _workload(_llm(model_dir).engine)


@pytest.mark.parametrize(("backend", "mode", "spec"), SETTINGS)
def test_greedy_tokens_equal_across_backends_caching_and_speculation(family_model: tuple[Path, Path, list],
                                                                     backend: str, mode: str | None,
                                                                     spec: str | None) -> None:
    model_dir, draft_dir, reference = family_model
    assert len({t for _, out in reference for t in out}) > 8  # not one repeated token
    llm = _llm(model_dir, backend, mode, **_speculative(spec, draft_dir))
    assert _workload(llm.engine) == reference
    metrics = llm.get_metrics()
    if mode is not None:
        assert metrics["prefix_cache_hits"] > 0
    if spec:  # drafts were verified
        assert metrics["spec_num_draft_tokens"] > 0
    assert_pools_full(llm)
