"""`Grammars`' host work between steps: every step's masks fill one buffer, and a masked row's
token reaches its matcher at the next fill (its mask decided the step), never later than anything
that reads the matcher."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from replayserve import LLM, SamplingParams
from replayserve.engine.grammars import Grammars
from replayserve.speculative.proposers import DraftRequest, Proposer
from replayserve.structured import StructuredOutputsParams
from tests.structured.examples import SCHEMA

pytest.importorskip("xgrammar")


def test_the_mask_buffer_is_reused_and_every_row_starts_all_allowed() -> None:
    grammars = Grammars(None, vocab_size=100, stop_token_ids=())
    first = grammars._bitmask_rows(3)
    assert first.shape == (3, 4) and (first == -1).all()
    first.zero_()  # a step's fill: most tokens refused
    again = grammars._bitmask_rows(2)
    assert again.data_ptr() == first.data_ptr(), "no new buffer for a step of fewer positions"
    assert again.shape == (2, 4) and (again == -1).all()
    grammars._bitmask_rows(1).zero_()
    grown = grammars._bitmask_rows(5)
    assert grown.shape == (5, 4) and (grown == -1).all()


def test_a_step_s_tokens_reach_the_matchers_before_they_are_read_again(tiny_model_dir: Path) -> None:
    import xgrammar as xgr

    llm = LLM(model=str(tiny_model_dir), dtype="float64", device="cpu", max_num_seqs=2)
    engine, grammars = llm.engine, llm.engine.grammars
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=24, structured_outputs=StructuredOutputsParams(
        json=SCHEMA))
    requests = [engine.add_request(llm.tokenizer.encode(p), params) for p in ("a", "b")]
    while not all(len(r.output_token_ids) >= 4 for r in requests):
        engine.step()
    assert len(grammars._pending) == 2, "the last step's masked tokens wait for the next fill"
    grammars.cut_drafts({})  # no row reads its matcher: the tokens stay for the fill
    assert len(grammars._pending) == 2
    grammars.cut_drafts({r.request_id: (0,) for r in requests})  # rows with drafts read it: handed over first
    assert not grammars._pending
    for request in requests:
        grammar = grammars._grammars[request.request_id]
        fresh = xgr.GrammarMatcher(grammar.compiled.result())
        assert all(fresh.accept_token(t) for t in request.output_token_ids)
        assert grammar.consumed == len(request.output_token_ids)
        vocab = llm.config.model.vocab_size
        ours, theirs = xgr.allocate_token_bitmask(1, vocab), xgr.allocate_token_bitmask(1, vocab)
        grammar.matcher.fill_next_token_bitmask(ours)
        fresh.fill_next_token_bitmask(theirs)
        assert (ours == theirs).all(), "the matcher has taken exactly the output"


class _SomeRowsDraft(Proposer):
    """Drafts for the requests in `continuations` only: the greedy continuation they will write,
    its first draft made wrong every other call (so some of their steps keep one token)."""

    def __init__(self) -> None:
        self.continuations: dict[str, tuple[int, list[int]]] = {}  # request id -> (prompt length, tokens)
        self.calls = 0

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        return []

    def propose_batch(self, requests: Sequence[DraftRequest]) -> dict[str, tuple[int, ...]]:
        self.calls += 1
        out: dict[str, tuple[int, ...]] = {}
        for r in requests:
            if r.request_id in self.continuations:
                prompt, tokens = self.continuations[r.request_id]
                drafts = list(tokens[len(r.token_ids) - prompt : len(r.token_ids) - prompt + r.room])
                if drafts and self.calls % 2:
                    drafts[0] = (drafts[0] + 1) % 64
                out[r.request_id] = tuple(drafts)
        return out


def test_with_drafts_for_some_rows_only_theirs_are_handed_over_before_the_launch(tiny_model_dir: Path) -> None:
    """Speculation beside constrained rows: a row without drafts keeps its last token pending
    until the next fill (off the exposed path), a row with drafts hands its token over before
    its drafts are cut, and the greedy outputs are those without speculation."""
    prompts = ["a", "b", "c"]
    params = SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    base = LLM(model=str(tiny_model_dir), dtype="float64", device="cpu", max_num_seqs=3)
    expected = [o.outputs[0].token_ids for o in base.generate(prompts, params, use_tqdm=False)]
    proposer = _SomeRowsDraft()
    llm = LLM(model=str(tiny_model_dir), dtype="float64", device="cpu", max_num_seqs=3,
              speculative={"method": "custom", "num_speculative_tokens": 3, "proposer": proposer})
    engine, grammars = llm.engine, llm.engine.grammars
    requests = [engine.add_request(llm.tokenizer.encode(p), params) for p in prompts]
    proposer.continuations[requests[0].request_id] = (len(requests[0].prompt_token_ids), list(expected[0]))
    cut = grammars.cut_drafts
    kept_for_the_fill: set[str] = set()

    def checked_cut(drafts: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        before = {g for g, _ in grammars._pending}
        out = cut(drafts)
        after = {g for g, _ in grammars._pending}
        drafting = {grammars._grammars[i] for i, d in drafts.items() if d}
        assert after == before - drafting, "exactly the drafting rows' tokens are handed over"
        kept_for_the_fill.update(i for i, g in grammars._grammars.items() if g in after)
        return out

    grammars.cut_drafts = checked_cut  # type: ignore[method-assign]
    while engine.has_unfinished():
        engine.step()
    assert [r.output_token_ids for r in requests] == expected
    assert kept_for_the_fill == {requests[1].request_id, requests[2].request_id}
    assert llm.get_metrics()["spec_num_accepted_tokens"] > 0
