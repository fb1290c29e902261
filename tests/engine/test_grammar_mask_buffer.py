"""`Grammars` fills every step's masks into one buffer: a step sees only its own rows, each
starting with every token allowed, whatever an earlier step left there."""

from __future__ import annotations

import pytest

from replayserve.engine.grammars import Grammars

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
