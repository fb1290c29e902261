"""`MTPProposer.propose_batch` (padded rows, the MTP cache, one host sync) gives each request the
drafts of `propose_request`, the plain per-request reference; the cached forward extends like the
uncached one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from replayserve.builtin.tiny import make_tiny
from replayserve.models.loader import load_model
from replayserve.models.mtp_kv import MTPKV, MTPCall
from replayserve.models.nemotron_h import NemotronHForCausalLM
from replayserve.speculative.mtp import HiddenStore, MTPProposer
from replayserve.speculative.proposers import DraftRequest

STACKS = [("full_attention", "moe"), ("mlp", "full_attention"), ("full_attention", "full_attention"), ("moe", "mlp")]


def _model(path: Path, mtp_layers: tuple[str, ...]) -> NemotronHForCausalLM:
    make_tiny(path, seed=5, layers="M*", num_nextn_predict_layers=1, mtp_layer_types=mtp_layers)
    return load_model(path, torch.float64, torch.device("cpu"))


def _requests(model: NemotronHForCausalLM, store: HiddenStore) -> list[DraftRequest]:
    """Rows of every kind: runs longer and shorter than the window (a prefix hit starts a run
    late), one run that stops before the last computed position, none at all, rooms 0 to 4."""
    gen = torch.Generator().manual_seed(1)
    vocab, width = model.config.vocab_size, model.config.hidden_size
    # (request id, tokens, run start, recorded positions, room)
    shapes = [("long", 40, 0, 39, 3), ("short", 12, 0, 11, 1), ("hit", 30, 24, 6, 4), ("one", 9, 7, 1, 2),
              ("behind", 20, 0, 15, 3), ("none", 15, None, 0, 2), ("no room", 25, 0, 24, 0), ("whole", 17, 0, 16, 4)]
    requests = []
    for rid, length, start, recorded, room in shapes:
        tokens = torch.randint(3, vocab, (length,), generator=gen).tolist()
        if start is not None:
            store.record(rid, start, torch.randn(recorded, width, generator=gen, dtype=torch.float64))
        requests.append(DraftRequest(rid, tokens, room))
    return requests


@pytest.mark.parametrize("window", [16, 256])
@pytest.mark.parametrize("mtp_layers", STACKS)
def test_batched_drafts_equal_the_per_request_reference(tmp_path: Path, mtp_layers: tuple[str, ...],
                                                        window: int) -> None:
    model = _model(tmp_path, mtp_layers)
    store = HiddenStore()
    proposer = MTPProposer(model, store, window=window)
    requests = _requests(model, store)
    want = {r.request_id: tuple(proposer.propose_request(*r)) for r in requests}
    got = proposer.propose_batch(requests)
    assert got == want
    assert {rid for rid, drafts in got.items() if not drafts} == {"behind", "none", "no room"}
    assert [len(got[r.request_id]) for r in requests if got[r.request_id]] == [3, 1, 4, 2, 4]
    # Alone or with others, a request's drafts are the same: padding never leaks into a row.
    for r in requests:
        assert proposer.propose_batch([r]) == {r.request_id: want[r.request_id]}


def test_forward_cached_extends_like_a_forward_over_the_longer_row(tmp_path: Path) -> None:
    """Positions run in two calls against the cache (the second a left-padded batch whose rows
    start at different positions, in cache rows other than 0) give the last row of `forward` over
    the whole row; padding writes never reach a real row."""
    model = _model(tmp_path, ("full_attention", "full_attention"))
    mtp = model.mtp
    gen = torch.Generator().manual_seed(0)
    width = model.config.hidden_size
    embeds, hidden = (torch.randn(2, 10, width, generator=gen, dtype=torch.float64) for _ in range(2))
    kv = MTPKV.empty(model.config, 3, 16, torch.float64, torch.device("cpu"))
    # Row 0 holds positions 3..12, row 1 positions 24..29 (its first 4 columns: left padding).
    start = torch.tensor([3, 20])
    lo = start + torch.tensor([0, 4])
    rows = torch.tensor([2, 0])
    with torch.no_grad():
        mtp.forward_cached(embeds[:, :7], hidden[:, :7], kv, MTPCall(start + 6, torch.tensor([7, 3]), lo, rows),
                           output=False)
        last = mtp.forward_cached(embeds[:, 7:], hidden[:, 7:], kv,
                                  MTPCall(start + 9, torch.tensor([3, 3]), lo, rows))
        full = [mtp(embeds[0], hidden[0], last_only=True), mtp(embeds[1, 4:], hidden[1, 4:], last_only=True)]
    torch.testing.assert_close(last, torch.cat(full), rtol=0, atol=1e-12)
