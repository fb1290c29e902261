"""MTP speculation on a Qwen3-Next checkpoint (`mtp.*`, models/qwen3_next_mtp.py): float64 greedy
tokens equal speculation off on both Gated DeltaNet backends, with and without prefix caching
`all` (the prefix-cache workload: shared prompts, second turns, hits while decoding, chunked
prefills, small pools), and the device-side draft loop drafts what the per-request path does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from replayserve.models.loader import load_model
from replayserve.speculative.mtp import HiddenStore, MTPProposer
from replayserve.speculative.proposers import DraftRequest
from tests.conftest import assert_pools_full
from tests.engine.test_prefix_cache import _llm, _workload
from tests.models.test_qwen_mtp import make_qwen_mtp

SMALL = {"num_kv_blocks": 24, "max_model_len": 96, "num_mamba_cache_slots": 2}


@pytest.fixture(scope="module")
def qwen_mtp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_qwen_mtp(tmp_path_factory.mktemp("qwen_mtp"))


@pytest.fixture(scope="module")
def reference(qwen_mtp_dir: Path) -> list[tuple[list[int], list[int]]]:
    return _workload(_llm(qwen_mtp_dir, **SMALL).engine)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize(("backend", "mode"), [("baseline", None), ("replay", None), ("baseline", "all"),
                                               ("replay", "all")])
def test_mtp_speculation_is_lossless(qwen_mtp_dir: Path, reference: list, backend: str, mode: str | None,
                                     k: int) -> None:
    llm = _llm(qwen_mtp_dir, backend, mode, replay_window=8,
               speculative={"method": "mtp", "num_speculative_tokens": k}, **SMALL)
    assert _workload(llm.engine) == reference
    assert llm.get_metrics()["spec_num_draft_tokens"] > 0
    assert_pools_full(llm)


@pytest.mark.parametrize(("family", "dtype"), [("qwen3_next", torch.float32), ("qwen3_next", torch.float64),
                                               ("qwen3_5", torch.float64), ("qwen3_5_moe", torch.float64)])
def test_device_draft_loop_equals_the_per_request_path(tmp_path: Path, family: str, dtype: torch.dtype) -> None:
    """Rows shorter and longer than the window, a late-starting run, rooms 1 to 4: `propose_batch`
    (left-padded windows, the MTP attention's keys and values kept between drafts) at fixed and at
    the longest row's width equals `propose_request` (each row alone, no cache)."""
    model = load_model(make_qwen_mtp(tmp_path, family), dtype, torch.device("cpu"))
    store = HiddenStore()
    gen = torch.Generator().manual_seed(2)
    batch = []
    for rid, length, start, room in [("a", 40, 0, 3), ("b", 7, 0, 1), ("c", 25, 18, 4), ("d", 19, 0, 2)]:
        tokens = torch.randint(3, model.config.vocab_size, (length,), generator=gen).tolist()
        hidden = torch.randn(length - 1 - start, model.config.hidden_size, generator=gen, dtype=torch.float64)
        store.record(rid, start, hidden.to(dtype))
        batch.append(DraftRequest(rid, tokens, room))
    fixed = MTPProposer(model, store, window=16, fixed_shapes=True)
    want = {r.request_id: tuple(fixed.propose_request(*r)) for r in batch}
    assert all(len(want[r.request_id]) == r.room for r in batch)
    assert fixed.propose_batch(batch) == want
    assert MTPProposer(model, store, window=16, fixed_shapes=False).propose_batch(batch) == want


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_mtp_speculation_is_lossless(tmp_path: Path, family: str) -> None:
    """Qwen3.5's MTP layer (a dense MLP, or the MoE) on the replay backend with prefix caching `all`."""
    path = make_qwen_mtp(tmp_path, family)
    want = _workload(_llm(path, **SMALL).engine)
    llm = _llm(path, "replay", "all", replay_window=8, speculative={"method": "mtp", "num_speculative_tokens": 3},
               **SMALL)
    assert _workload(llm.engine) == want
    assert llm.get_metrics()["spec_num_draft_tokens"] > 0
    assert_pools_full(llm)
