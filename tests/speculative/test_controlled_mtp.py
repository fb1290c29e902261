"""`ControlledMTPProposer`: the MTP layers run every step, the drafts follow the greedy path at the
set per-draft acceptance, and outputs stay spec-off's greedy tokens."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from replayserve import LLM, SamplingParams
from replayserve.builtin.tiny import make_tiny
from replayserve.speculative.controlled import ControlledMTPProposer
from replayserve.speculative.mtp import MTPProposer
from replayserve.speculative.proposers import DraftRequest

GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
K = 3


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (9, 30, 5, 17, 12, 21, 8, 14)]


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("mtp"), seed=0, layers="M*-ME", num_nextn_predict_layers=1,
                     mtp_layer_types=("full_attention", "moe"))


def _llm(mtp_dir: Path, dtype: str, spec: bool, backend: str = "baseline") -> LLM:
    return LLM(model=str(mtp_dir), dtype=dtype, device="cpu", max_num_seqs=8, ssm_backend=backend, replay_window=8,
               speculative={"method": "mtp", "num_speculative_tokens": K} if spec else None)


@pytest.fixture(scope="module")
def greedy_paths(mtp_dir: Path) -> dict[str, dict[tuple[int, ...], list[int]]]:
    """Spec-off greedy outputs per dtype: the proposer's knowledge and the reference."""
    paths = {}
    for dtype in ("float32", "float64"):
        outs = _llm(mtp_dir, dtype, spec=False).generate([{"prompt_token_ids": p} for p in _prompts()], GREEDY,
                                                         use_tqdm=False)
        paths[dtype] = {tuple(p): o.token_ids for p, o in zip(_prompts(), outs, strict=True)}
    return paths


class _CountingMTP(MTPProposer):
    """The engine's MTP proposer, counting the drafts its layers compute."""

    def __init__(self, mtp: MTPProposer) -> None:
        super().__init__(mtp.model, mtp.store, mtp.window)
        self.computed = 0

    def propose_batch(self, requests: Sequence[DraftRequest]) -> dict[str, tuple[int, ...]]:
        out = super().propose_batch(requests)
        self.computed += sum(map(len, out.values()))
        return out


class _Recorder(ControlledMTPProposer):
    """Notes each row's prompt, output position and drafts."""

    rows: list[tuple[tuple[int, ...], int, tuple[int, ...]]]

    def propose_batch(self, requests: Sequence[DraftRequest]) -> dict[str, tuple[int, ...]]:
        out = super().propose_batch(requests)
        for r in requests:
            prompt = self._prompt(r)
            assert prompt is not None
            self.rows.append((prompt, len(r.token_ids) - len(prompt), out[r.request_id]))
        return out


@pytest.mark.parametrize(("dtype", "backend"), [("float64", "baseline"), ("float32", "replay")])
@pytest.mark.parametrize("acceptance", [0.5, 0.9])
def test_acceptance_follows_the_set_value_and_outputs_stay_greedy(mtp_dir: Path, greedy_paths: dict, dtype: str,
                                                                  backend: str, acceptance: float) -> None:
    llm = _llm(mtp_dir, dtype, spec=True, backend=backend)
    mtp = llm.engine.proposer
    assert isinstance(mtp, MTPProposer)
    paths = greedy_paths[dtype]
    counting = _CountingMTP(mtp)
    llm.engine.proposer = proposer = _Recorder(counting, paths, acceptance, seed=3)
    proposer.rows = []
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == list(paths.values())  # lossless
    # The MTP layers ran on the rows: their drafts were computed (then replaced).
    assert counting.computed >= len(proposer.rows)
    # Each row accepts the drafts up to its first corrupted one: the engine's counters equal that.
    accepted = [next((j for j in range(len(d)) if proposer.is_corrupted(p, pos + j)), len(d))
                for p, pos, d in proposer.rows]
    m = llm.get_metrics()
    assert m["spec_num_accepted_tokens"] == sum(accepted)
    assert m["spec_num_draft_tokens"] == sum(len(d) for _, _, d in proposer.rows)
    for p, pos, d in proposer.rows:
        assert list(d) == [t if not proposer.is_corrupted(p, pos + j) else d[j]
                           for j, t in enumerate(paths[p][pos : pos + len(d)])]
    # Per draft reached, the share accepted is the set acceptance (a reached draft is one after
    # accepted ones: a row rejects at most once).
    rejected = sum(a < len(d) for a, (_, _, d) in zip(accepted, proposer.rows, strict=True))
    measured = sum(accepted) / (sum(accepted) + rejected)
    assert sum(accepted) + rejected > 200
    assert abs(measured - acceptance) < 0.07, measured


def test_rows_off_the_known_paths_keep_the_mtp_drafts(mtp_dir: Path, greedy_paths: dict) -> None:
    """A prompt with no known path: the MTP layers' own drafts, and greedy outputs still."""
    plain = _llm(mtp_dir, "float64", spec=True)
    want = plain.generate([{"prompt_token_ids": p} for p in _prompts()[:3]], GREEDY, use_tqdm=False)
    llm = _llm(mtp_dir, "float64", spec=True)
    llm.engine.proposer = ControlledMTPProposer(llm.engine.proposer, {}, 0.9)
    got = llm.generate([{"prompt_token_ids": p} for p in _prompts()[:3]], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.token_ids for o in got] == list(greedy_paths["float64"].values())[:3]
    ours, theirs = llm.get_metrics(), plain.get_metrics()
    assert ours["spec_num_draft_tokens"] == theirs["spec_num_draft_tokens"] > 0
    assert ours["spec_num_accepted_tokens"] == theirs["spec_num_accepted_tokens"]


def test_corruption_is_deterministic_and_always_another_token(mtp_dir: Path, greedy_paths: dict) -> None:
    mtp = _llm(mtp_dir, "float64", spec=True).engine.proposer
    paths = greedy_paths["float64"]
    a, b = (ControlledMTPProposer(mtp, paths, 0.5, seed=1) for _ in range(2))
    other = ControlledMTPProposer(mtp, paths, 0.5, seed=2)
    assert a.drafts == b.drafts != other.drafts
    for p, path in paths.items():
        assert all((d != t) == a.is_corrupted(p, i) for i, (d, t) in enumerate(zip(a.drafts[p], path, strict=True)))
    assert ControlledMTPProposer(mtp, paths, 1.0).drafts == paths
    assert all(d != t for p, path in paths.items()
               for d, t in zip(ControlledMTPProposer(mtp, paths, 0.0).drafts[p], path, strict=True))
    with pytest.raises(ValueError, match="acceptance"):
        ControlledMTPProposer(mtp, paths, 1.5)
