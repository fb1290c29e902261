"""`Grammars`' host work between steps: every step's masks fill one buffer, and a masked row's
token reaches its matcher at the next fill (its mask decided the step), never later than anything
that reads the matcher."""

from __future__ import annotations

from pathlib import Path

import pytest

from replayserve import LLM, SamplingParams
from replayserve.engine.grammars import Grammars
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
    grammars.cut_drafts({})  # what reads the matchers first hands the tokens over
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
