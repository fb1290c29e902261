"""The MTP draft loop replayed from CUDA graphs (`DraftGraphs`, off by default) gives the eager
loop's drafts; its row buckets; it refuses what it cannot capture."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from replayserve.speculative.mtp import HiddenStore, MTPProposer
from replayserve.speculative.mtp_graphs import DraftGraphs, row_buckets
from tests.speculative.test_mtp_drafts import _batches, _model

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def test_row_buckets_are_powers_of_two_and_the_maximum() -> None:
    assert row_buckets(1) == (1,)
    assert row_buckets(6) == (1, 2, 4, 6)
    assert row_buckets(64) == (1, 2, 4, 8, 16, 32, 64)


def test_draft_graphs_refuse_a_cpu_model(tmp_path: Path) -> None:
    model = _model(tmp_path, ("full_attention", "mlp"), torch.float32)
    with pytest.raises(ValueError, match="CUDA model"):
        DraftGraphs(model, MTPProposer(model, HiddenStore()).kv, width=5, max_rows=4)
    with pytest.raises(ValueError, match="CUDA model"):
        MTPProposer(model, HiddenStore(), draft_graphs=True)


def test_the_proposer_refuses_draft_graphs_without_fixed_shapes_naming_both_options(tmp_path: Path) -> None:
    """The graphs replay max_drafts + 1 positions per row: refused before anything is captured."""
    model = _model(tmp_path, ("full_attention", "mlp"), torch.float32)
    with pytest.raises(ValueError, match=r"draft_graphs=True.*max_drafts \+ 1 = 3.*fixed_shapes=False"):
        MTPProposer(model, HiddenStore(), fixed_shapes=False, draft_graphs=True, max_drafts=2)


@cuda
@pytest.mark.parametrize("mtp_layers", [("full_attention", "moe"), ("mlp", "full_attention")])
def test_graphed_drafts_equal_eager_drafts(tmp_path: Path, mtp_layers: tuple[str, ...]) -> None:
    model = _model(tmp_path, mtp_layers, torch.float32, "cuda")
    store = HiddenStore()
    batches = _batches(model, store, torch.float32)
    for rid, (start, hidden) in list(store.runs.items()):
        store.runs[rid] = (start, hidden.to("cuda"))
    # Two proposers on one store: the rows' runs are recorded once, before either drafts.
    eager = MTPProposer(model, store, window=16, fixed_shapes=True, max_rows=8)
    graphed = MTPProposer(model, store, window=16, draft_graphs=True, max_rows=8)
    graphs = graphed.draft_graphs
    assert graphs is not None and graphs.width == graphed.max_drafts + 1 == 5 and graphs.kv is graphed.kv
    for _ in range(2):  # the second round replays the graphs the first captured
        for batch in batches:
            want = eager.propose_batch(batch)
            assert all(want.values())
            assert graphed.propose_batch(batch) == want
            assert want == {r.request_id: tuple(eager.propose_request(*r)) for r in batch}
    assert {b for b, _ in graphs.graphs} == {graphs.bucket(len(b)) for b in batches}
    # More rows than the largest bucket run eagerly, with the same drafts.
    # (Graphs smaller than the proposer's cache: only built by hand, so set by hand.)
    small = MTPProposer(model, store, window=16, fixed_shapes=True)
    small.draft_graphs = DraftGraphs(model, small.kv, width=5, max_rows=2)
    assert small.propose_batch(batches[0]) == eager.propose_batch(batches[0])
