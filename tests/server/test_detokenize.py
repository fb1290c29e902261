"""Incremental detokenization: token by token, the pieces join to the whole decode, never show a
half character, and hold back the tail where a stop string may be forming."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from replayserve.server.detokenize import IncrementalDetokenizer
from replayserve.tokenizer import Tokenizer

TEXTS = ["The quick brown fox jumps over the lazy dog.", "héllo wörld — naïve café 👋🏽 日本語 ok",
         "def fibonacci(n):\n    a, b = 0, 1\n", "   spaces   and\ttabs\n\n"]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    tok = Tokenizer.from_dir(tiny_model_dir)
    assert tok is not None
    return tok


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_pieces_join_to_the_whole_decode(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = []
    for token in ids:
        detok.add([token])
        pieces.append(detok.new_text())
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces), "a piece never ends inside a multi-byte character"
    assert sum(1 for p in pieces if p) > len(text.split()) // 2, "text comes out as it is produced"


def test_random_steps_of_several_tokens_join_to_the_decode(tokenizer: Tokenizer) -> None:
    rng = random.Random(0)
    ids = tokenizer.encode(" ".join(TEXTS * 3), add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    out, i = "", 0
    while i < len(ids):
        k = rng.randint(1, 4)  # a speculative step emits several tokens at once
        detok.add(ids[i : i + k])
        out, i = out + detok.new_text(), i + k
    assert out == tokenizer.decode(ids)


def test_holdback_keeps_a_forming_stop_string_back_and_rest_completes_the_final_text(tokenizer: Tokenizer) -> None:
    text, stop = "Numbers: 0 1 2 3 4 5", " 3 4"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, holdback=len(stop) - 1)
    sent = ""
    for token in ids:  # as the engine does: tokens until the text holds the stop string
        detok.add([token])
        if stop in detok.text:
            break
        sent += detok.new_text()
    final = detok.text[: detok.text.index(stop)]  # the engine's text, cut before the stop string
    assert final.startswith(sent), "nothing of the stop string went out before it was recognized"
    assert sent + detok.rest(final) == final == "Numbers: 0 1 2"
