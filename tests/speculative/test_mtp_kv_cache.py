"""The MTP cache across proposer calls: in float64, `propose_batch` (the MTP layers run only on
the positions new since a request's last call, against cached keys and values) drafts what
`propose_request` (the whole window recomputed, no cache) does, call after call, with varying
acceptance, recomputes after preemption (other hidden states recorded again), requests finished
and restarted under the same id, more requests than cache rows, and window slides; inside an
engine with small pools too, where greedy outputs stay those of speculation off."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from replayserve.builtin.tiny import make_tiny
from replayserve.cache import memory as cache_memory
from replayserve.cache.memory import mtp_cache_bytes
from replayserve.config import ConfigError
from replayserve.llm import LLM
from replayserve.models.loader import load_model
from replayserve.speculative.controlled import ControlledMTPProposer
from replayserve.speculative.mtp import HiddenStore, MTPProposer
from replayserve.speculative.mtp_cache import CacheRows
from replayserve.speculative.proposers import DraftRequest
from tests.engine.test_prefix_cache import _llm, _workload
from tests.models.test_qwen_mtp import make_qwen_mtp

# (family, MTP blocks, window): one attention block, so a window of 8 slides over every request
# (the cache equals the windowed recompute exactly); two, with a window that covers every request.
MODELS = [("nemotron_h", ("full_attention", "moe"), 8), ("nemotron_h", ("mlp", "full_attention"), 8),
          ("nemotron_h", ("full_attention", "full_attention"), 200), ("nemotron_h", ("moe", "mlp"), 8),
          ("qwen3_next", None, 8), ("qwen3_5", None, 8)]


def _model(path: Path, family: str, blocks: tuple[str, ...] | None) -> torch.nn.Module:
    if family == "nemotron_h":
        make_tiny(path, seed=7, layers="M*", num_nextn_predict_layers=1, mtp_layer_types=blocks)
    else:
        make_qwen_mtp(path, family, seed=7)
    return load_model(path, torch.float64, torch.device("cpu"))


class _Stream:
    """Requests as an engine drives a store: a prompt recorded (from 0 or a prefix hit's start),
    then steps that keep 1..k + 1 tokens and record their hidden states; a preemption records
    every position again with other hidden states (a recompute whose states the cache must not
    keep); a finish forgets the request, which restarts under the same id with another prompt."""

    def __init__(self, store: HiddenStore, vocab: int, width: int, seed: int) -> None:
        self.store, self.vocab, self.width = store, vocab, width
        self.gen = torch.Generator().manual_seed(seed)
        self.tokens: dict[str, list[int]] = {}

    def _int(self, low: int, high: int) -> int:
        return int(torch.randint(low, high, (1,), generator=self.gen))

    def _hidden(self, n: int) -> torch.Tensor:
        return torch.randn(n, self.width, generator=self.gen, dtype=torch.float64)

    def start(self, rid: str) -> None:
        self.store.forget(rid)
        prompt = torch.randint(3, self.vocab, (self._int(2, 30),), generator=self.gen).tolist()
        hit = self._int(0, len(prompt) - 1) if self._int(0, 3) == 0 else 0
        self.store.record(rid, hit, self._hidden(len(prompt) - hit))
        self.tokens[rid] = prompt + [self._int(3, self.vocab)]  # the token sampled after the prompt

    def step(self, rid: str, k: int) -> None:
        event = self._int(0, 20)
        tokens = self.tokens[rid]
        if event == 0:
            self.start(rid)
        elif event == 1:  # preempted, then recomputed from 0 or a prefix hit: states recorded again
            start = self._int(0, len(tokens) - 1)
            self.store.record(rid, start, self._hidden(len(tokens) - 1 - start))
        else:  # a verify step kept `kept` tokens: the last one's state and the accepted drafts'
            kept = self._int(1, k + 2)
            self.store.record(rid, len(tokens) - 1, self._hidden(kept))
            tokens += torch.randint(3, self.vocab, (kept,), generator=self.gen).tolist()

    def requests(self, rids: Sequence[str], k: int) -> list[DraftRequest]:
        return [DraftRequest(rid, list(self.tokens[rid]), self._int(1, k + 1)) for rid in rids]


@pytest.mark.parametrize(("fixed", "trimmed"), [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize(("family", "blocks", "window"), MODELS)
def test_cached_drafts_equal_the_recompute_over_many_steps(tmp_path: Path, family: str,
                                                            blocks: tuple[str, ...] | None, window: int,
                                                            fixed: bool, trimmed: bool) -> None:
    """trimmed: the store keeps what the engine's does (`hidden_store_for`), the last window + k + 1
    positions of each request."""
    model = _model(tmp_path, family, blocks)
    k = 3
    store = HiddenStore(keep=window + k + 1 if trimmed else None)
    # Three cache rows for five requests: rows move between requests that take turns.
    proposer = MTPProposer(model, store, window=window, fixed_shapes=fixed, max_rows=3, max_drafts=k)
    stream = _Stream(store, model.config.vocab_size, model.config.hidden_size, seed=len(family) + window)
    rids = [str(i) for i in range(5)]
    for rid in rids:
        stream.start(rid)
    drafted = 0
    for step in range(60):
        turn = rids[step % 3 : step % 3 + 3]  # three of the five each step
        batch = stream.requests(turn, k)
        want = {r.request_id: tuple(proposer.propose_request(*r)) for r in batch}
        got = proposer.propose_batch(batch)
        assert got == want, f"step {step}"
        drafted += sum(map(len, got.values()))
        for rid in turn:
            stream.step(rid, k)
    assert drafted > 60 * 3  # most rows drafted: runs reach their last position, rows were free


def test_a_call_runs_only_the_new_positions(tmp_path: Path) -> None:
    """After a request's first call (its window), a call runs the positions kept since (the
    cache holds the rest); a re-recorded position and everything after it runs again."""
    model = _model(tmp_path, "nemotron_h", ("full_attention", "moe"))
    store = HiddenStore()
    proposer = MTPProposer(model, store, window=16, fixed_shapes=False, max_drafts=3)
    widths: list[int] = []
    forward = model.mtp.forward_cached
    model.mtp.forward_cached = lambda e, *rest, **kw: (widths.append(e.shape[1]), forward(e, *rest, **kw))[1]
    stream = _Stream(store, model.config.vocab_size, model.config.hidden_size, seed=1)
    tokens = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    store.record("a", 0, stream._hidden(31))
    proposer.propose_batch([DraftRequest("a", tokens[:32], 3)])  # positions 15..30: the window
    store.record("a", 31, stream._hidden(3))  # the next step kept 3 tokens
    proposer.propose_batch([DraftRequest("a", tokens[:35], 3)])
    store.record("a", 20, stream._hidden(15))  # a recompute from position 20
    proposer.propose_batch([DraftRequest("a", tokens[:35], 2)])
    # Each call: its first forward over the new positions, then one position per later draft.
    assert widths == [16, 1, 1, 3, 1, 1, 14, 1]


def test_cache_rows_follow_rewrites_windows_and_rollbacks() -> None:
    rows = CacheRows(rows=2, ring=12, window=8)
    assert rows.plan("a", 0, 5, 0) == (0, 0, 0)  # a fresh run: everything from its start
    rows.commit("a", 5, 3)
    assert rows.plan("a", 0, 6, None) == (0, 6, 0)  # one position kept since
    rows.commit("a", 6, 3)
    assert rows.plan("a", 0, 6, None) == (0, 6, 0)  # nothing new: the last position runs again
    rows.commit("a", 6, 3)
    assert rows.plan("a", 0, 12, 4) == (0, 5, 5)  # re-recorded from 4, but the window starts at 5
    rows.commit("a", 12, 3)
    assert rows.plan("a", 0, 30, None) == (0, 23, 23)  # the window moved past everything held
    assert rows.plan("b", 0, 3, 0) == (1, 0, 0)
    assert rows.plan("c", 0, 3, 0) is None  # no free row
    rows.release_except({"b"})
    assert rows.plan("c", 0, 3, 0) == (0, 0, 0)


@pytest.mark.parametrize("backend", ["baseline", "replay"])
def test_engine_drafts_equal_the_recompute_with_preemption_and_hits(tmp_path: Path, backend: str) -> None:
    """The prefix-cache workload on small pools (preemptions, hits, chunked prefills, second
    turns), drafts on the greedy path at acceptance 0.6 (`ControlledMTPProposer`, which still
    runs the MTP layers every step): every call's cached drafts equal the recompute's, and outputs
    equal speculation off."""
    path = make_tiny(tmp_path, seed=0, layers="M*-ME", num_nextn_predict_layers=1,
                     mtp_layer_types=("full_attention", "moe"))
    small = {"num_kv_blocks": 24, "max_model_len": 96, "num_mamba_cache_slots": 2}
    reference = _workload(_llm(path, **small).engine)
    llm = _llm(path, backend, "all", replay_window=8, **small,
               speculative={"method": "mtp", "num_speculative_tokens": 3, "mtp_window": 12})
    mtp = llm.engine.proposer
    assert isinstance(mtp, MTPProposer)
    calls = []
    cached = mtp.propose_batch

    def checked(requests: Sequence[DraftRequest]) -> dict[str, tuple[int, ...]]:
        want = {r.request_id: tuple(mtp.propose_request(*r)) for r in requests}
        got = cached(requests)
        assert got == want
        calls.append(len(requests))
        return got

    mtp.propose_batch = checked  # type: ignore[method-assign]
    llm.engine.proposer = ControlledMTPProposer(mtp, {tuple(p): out for p, out in reference}, 0.6)
    assert _workload(llm.engine) == reference
    metrics = llm.get_metrics()
    assert len(calls) > 10 and metrics["num_preemptions"] > 0
    assert 0 < metrics["spec_num_accepted_tokens"] < metrics["spec_num_draft_tokens"]


def test_llm_builds_the_cache_that_sizing_counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The proposer's cache: a ring of mtp_window + k positions for each of max_num_seqs rows (and
    the scratch row), the bytes `cache/memory.mtp_cache_bytes` takes off the pools' budget."""
    path = make_tiny(tmp_path, seed=0, layers="M*", num_nextn_predict_layers=1,
                     mtp_layer_types=("full_attention", "moe"))
    llm = LLM(model=str(path), dtype="float64", device="cpu", max_num_seqs=3,
              speculative={"method": "mtp", "num_speculative_tokens": 2, "mtp_window": 10})
    proposer, config = llm.engine.proposer, llm.engine.config
    assert isinstance(proposer, MTPProposer)
    assert proposer.kv.keys[0].shape == (3 + 1, 10 + 2, config.model.num_key_value_heads, config.model.head_dim)
    held = sum(t.numel() * t.element_size() for t in proposer.kv.keys + proposer.kv.values)
    assert held == mtp_cache_bytes(config, torch.float64) > 0
    assert mtp_cache_bytes(dataclasses.replace(config, speculative=None), torch.float64) == 0
    # the fit check of explicit sizes counts it too: exactly enough fits, a byte less does not
    needed = sum(cache_memory.cache_bytes(config, torch.float64)) + held
    monkeypatch.setattr(cache_memory, "available_bytes", lambda device: needed)
    cache_memory.check_cache_fit(config)
    monkeypatch.setattr(cache_memory, "available_bytes", lambda device: needed - 1)
    with pytest.raises(ConfigError, match=rf"the MTP proposer's cache {held:,} more, {needed:,} bytes in all"):
        cache_memory.check_cache_fit(config)
    with pytest.raises(ValueError, match="max_drafts = 2"):  # the ring holds k = 2 drafts' positions
        proposer.propose_batch([DraftRequest("x", [5, 6, 7], 3)])


def test_hidden_store_keeps_the_last_positions_and_marks_rewrites() -> None:
    states = torch.arange(20, dtype=torch.float64)[:, None]
    store = HiddenStore(keep=4)
    store.record("a", 0, states[:10])
    assert store.take_rewrite("a") == 0  # a fresh run: nothing cached for it holds
    assert store.runs["a"][0] == 6 and store.runs["a"][1].flatten().tolist() == [6, 7, 8, 9]
    store.record("a", 10, states[10:12])
    assert store.take_rewrite("a") is None  # new positions only
    assert store.runs["a"][0] == 8 and store.runs["a"][1].flatten().tolist() == [8, 9, 10, 11]
    store.record("a", 9, states[9:11] + 100)  # a recompute from 9, say after a rejected step's rollback
    store.record("a", 3, states[3:5] + 100)  # before the run: it starts again there
    assert store.take_rewrite("a") == 3
    assert store.runs["a"][0] == 3 and store.runs["a"][1].flatten().tolist() == [103, 104]
    store.forget("a")
    assert "a" not in store.runs and store.take_rewrite("a") is None
