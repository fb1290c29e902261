"""The MTP draft loop on the device (`greedy_drafts`, against the MTP cache) at fixed shapes: the
same drafts as the loop over the most new positions any row has and as the per-request reference,
in float32 and float64, over batches of every kind of row; no host read inside it; shapes fixed by
rows and drafts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from replayserve.builtin.tiny import make_tiny
from replayserve.models.loader import load_model
from replayserve.models.mtp_kv import MTPKV, MTPCall
from replayserve.models.nemotron_h import NemotronHForCausalLM
from replayserve.speculative import mtp as mtp_module
from replayserve.speculative.mtp import HiddenStore, MTPProposer
from replayserve.speculative.mtp_drafts import greedy_drafts
from replayserve.speculative.proposers import DraftRequest

STACKS = [("full_attention", "moe"), ("mlp", "full_attention"), ("full_attention", "full_attention")]


def _model(path: Path, mtp_layers: tuple[str, ...], dtype: torch.dtype, device: str = "cpu") -> NemotronHForCausalLM:
    make_tiny(path, seed=11, layers="M*", num_nextn_predict_layers=1, mtp_layer_types=mtp_layers)
    return load_model(path, dtype, torch.device(device))


def _batches(model: NemotronHForCausalLM, store: HiddenStore, dtype: torch.dtype) -> list[list[DraftRequest]]:
    """Three batches: mixed lengths (shorter and longer than the window, a late-starting run) and
    rooms 1 to 4, one row alone, and the same requests a few tokens on."""
    gen = torch.Generator().manual_seed(2)
    vocab, width = model.config.vocab_size, model.config.hidden_size
    rows = {}
    for rid, length, start, room in [("a", 40, 0, 3), ("b", 7, 0, 1), ("c", 25, 18, 4), ("d", 19, 0, 2),
                                     ("e", 33, 5, 3)]:
        tokens = torch.randint(3, vocab, (length + 4,), generator=gen).tolist()
        # Hidden states of every computed position up to the end of `tokens`, recorded once.
        store.record(rid, start, torch.randn(length + 3 - start, width, generator=gen, dtype=torch.float64).to(dtype))
        rows[rid] = (tokens, length, room)
    first = [DraftRequest(rid, t[:n], room) for rid, (t, n, room) in rows.items()]
    later = [DraftRequest(rid, t[: n + 4], room) for rid, (t, n, room) in rows.items() if rid != "b"]
    return [first, [first[2]], later]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mtp_layers", STACKS)
def test_fixed_shape_drafts_equal_the_eager_paths(tmp_path: Path, mtp_layers: tuple[str, ...],
                                                  dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(tmp_path, mtp_layers, dtype)
    store = HiddenStore()
    # Two attention blocks: a cached position's keys in the second saw the window of the call that
    # ran it, so the cache equals the windowed recompute only while the window covers the rows.
    window = 16 if mtp_layers.count("full_attention") == 1 else 64
    fixed = MTPProposer(model, store, window=window, fixed_shapes=True)
    longest = MTPProposer(model, store, window=window, fixed_shapes=False)
    widths: list[tuple[int, ...]] = []
    loop = mtp_module.greedy_drafts

    def record_width(m: NemotronHForCausalLM, kv: MTPKV, hidden: torch.Tensor, *rest: object) -> torch.Tensor:
        widths.append(tuple(hidden.shape[:2]))
        return loop(m, kv, hidden, *rest)

    monkeypatch.setattr(mtp_module, "greedy_drafts", record_width)
    seen: dict[str, int] = {}  # request id -> the last position a call ran
    for batch in _batches(model, store, dtype):
        want = {r.request_id: tuple(fixed.propose_request(*r)) for r in batch}
        assert all(want.values())
        widths.clear()
        assert fixed.propose_batch(batch) == want
        assert widths == [(len(batch), 5)]  # max_drafts + 1, whatever the rows' lengths
        widths.clear()
        assert longest.propose_batch(batch) == want
        # The new positions alone (the window on a row's first call, at least the last position).
        new = [len(r.token_ids) - 2 - max(seen.get(r.request_id, -1), store.runs[r.request_id][0] - 1,
                                          len(r.token_ids) - 2 - window) for r in batch]
        assert widths == [(len(batch), max(max(new), 1))]
        seen.update((r.request_id, len(r.token_ids) - 2) for r in batch)


def test_the_draft_loop_reads_nothing_back_to_the_host(tmp_path: Path) -> None:
    """On the meta device any read of a value (.item(), .tolist(), a data-dependent shape) raises:
    the loop runs there, so it has no host sync to stall a device stream or break a graph capture.
    (Dense MTP blocks: the reference MoE expert loop reads its routing on the host; on CUDA the
    Triton MoE does not.)"""
    model = _model(tmp_path, ("full_attention", "mlp"), torch.float32).to("meta")
    b, w, k = 3, 8, 4
    hidden = torch.empty(b, w, model.config.hidden_size, device="meta")
    ids = torch.empty(b, w, dtype=torch.int64, device="meta")
    kv = MTPKV.empty(model.config, 4, 20, torch.float32, torch.device("meta"))
    call = MTPCall(*torch.empty(4, b, dtype=torch.int64, device="meta"))
    drafts = greedy_drafts(model, kv, hidden, ids, call, k)
    assert drafts.shape == (b, k) and drafts.dtype == torch.int64
    with pytest.raises(Exception):  # noqa: B017 - the check itself: a host read on meta raises
        drafts.tolist()


@pytest.mark.parametrize("mtp_layers", STACKS)
def test_padding_rows_change_no_real_row(tmp_path: Path, mtp_layers: tuple[str, ...]) -> None:
    """What a CUDA graph's bucket does with rows past the call's (`DraftGraphs`): rows with no real
    position in the scratch row compute finite drafts, and leave the real rows' drafts and every
    real cache row as they would be without them."""
    model = _model(tmp_path, mtp_layers, torch.float64)
    gen = torch.Generator().manual_seed(4)
    b, t, k, width = 2, 5, 3, model.config.hidden_size
    hidden = torch.randn(b + 2, t, width, generator=gen, dtype=torch.float64)
    ids = torch.randint(3, model.config.vocab_size, (b + 2, t), generator=gen)
    alone, padded = (MTPKV.empty(model.config, 3, 12, torch.float64, torch.device("cpu")) for _ in range(2))
    for kv in (alone, padded):  # earlier positions of the real rows, cached before
        for tensor in kv.keys + kv.values:
            tensor.copy_(torch.randn(tensor.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64))
    real = torch.tensor([[20, 4, 12, 1], [7, 5, 0, 2]])  # end, count, lo, cache row
    pad = torch.tensor([[0, 0, 0, alone.scratch]] * 2)
    want = greedy_drafts(model, alone, hidden[:b], ids[:b], MTPCall(*real.T), k)
    logits: list[torch.Tensor] = []
    compute_logits = model.compute_logits

    def recorded(out: torch.Tensor) -> torch.Tensor:
        logits.append(compute_logits(out))
        return logits[-1]

    model.compute_logits = recorded  # type: ignore[method-assign]
    got = greedy_drafts(model, padded, hidden, ids, MTPCall(*torch.cat([real, pad]).T), k)
    assert torch.equal(got[:b], want)
    # The padding rows' drafts come from finite logits (argmax would pick a NaN too), and are tokens.
    assert len(logits) == k and all(step[b:].isfinite().all() for step in logits)
    assert ((got[b:] >= 0) & (got[b:] < model.config.vocab_size)).all()
    for a, p in zip(alone.keys + alone.values, padded.keys + padded.values, strict=True):
        # The scratch row aside; a batch of other rows rounds the projections differently.
        torch.testing.assert_close(a[:-1], p[:-1], rtol=0, atol=1e-12)


def test_pack_makes_one_host_to_device_copy_of_ids_and_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`pack` hands ids and the call table to the device in one `to_device` (pinned, asynchronous
    on CUDA); their values are each row's left-padded tokens and (end, count, lo, cache row)."""
    model = _model(tmp_path, ("full_attention", "mlp"), torch.float32)
    proposer = MTPProposer(model, HiddenStore())
    copies: list[torch.Tensor] = []

    def counted(host: torch.Tensor, device: torch.device) -> torch.Tensor:
        copies.append(host)
        return host.to(device)

    monkeypatch.setattr(mtp_module, "to_device", counted)
    run = (3, torch.randn(10, model.config.hidden_size))
    tokens = list(range(20, 40))
    # Positions 5..8 (4 of them) and 11..12 (2, left-padded); lo 2 and 0, cache rows 1 and 3.
    hidden, ids, call = proposer.pack([(tokens, run, 5, 8, 2, 1), (tokens, run, 11, 12, 0, 3)], width=4)
    assert len(copies) == 1
    assert ids.tolist() == [[26, 27, 28, 29], [0, 0, 32, 33]]
    assert call.tolist() == [[8, 12], [4, 2], [2, 0], [1, 3]]
    torch.testing.assert_close(hidden[0], run[1][2:6], rtol=0, atol=0)
    torch.testing.assert_close(hidden[1, 2:], run[1][8:10], rtol=0, atol=0)
    assert not hidden[1, :2].any()
    batch = _batches(model, proposer.store, torch.float32)[0]
    copies.clear()
    proposer.propose_batch(batch)
    assert 1 <= len(copies) <= 2  # the draft call, and a cache-only call for rows with more positions
