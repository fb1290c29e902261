"""The tokenizer wrapper: a long text (tokenized without holding the GIL) gives the ids a short
path would, special tokens included or not."""

from __future__ import annotations

import pytest

from replayserve.builtin.tiny_code import resolve_model
from replayserve.tokenizer import LONG_TEXT, Tokenizer


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_a_long_text_gets_the_same_ids_as_encode(add_special_tokens: bool) -> None:
    tokenizer = Tokenizer.from_dir(resolve_model("replayserve/tiny-code"))
    assert tokenizer is not None
    line = "def f(x):\n    return [x * 2 for x in range(10)]  # é\n"
    text = line * (LONG_TEXT // len(line) + 2)
    assert len(text) > LONG_TEXT
    expected = tokenizer._tok.encode(text, add_special_tokens=add_special_tokens).ids
    assert tokenizer.encode(text, add_special_tokens) == expected
