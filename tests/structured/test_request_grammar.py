"""One request's matcher over its output: it starts after a reasoning block closes (in the
output, or already in the prompt), ends with its stop token, and follows a take-back."""

from __future__ import annotations

import pytest

from replayserve.config.builtin_models import TINY_CODE_DIR
from replayserve.structured import StructuredOutputsParams
from replayserve.structured.compiler import GrammarCompiler
from replayserve.structured.request_grammar import GrammarViolation, RequestGrammar
from replayserve.tokenizer import Tokenizer

pytest.importorskip("xgrammar")
MARKERS = ("<think>", "</think>")
EOS = 2


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tokenizer = Tokenizer.from_dir(TINY_CODE_DIR)
    assert tokenizer is not None
    return tokenizer


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, 8192, [EOS])


def _grammar(compiler: GrammarCompiler, prompt: str, markers: tuple[str, str] | None = MARKERS) -> RequestGrammar:
    grammar = RequestGrammar(compiler.submit(StructuredOutputsParams(regex="[0-9]+ ok")), markers, prompt)
    grammar.start_matching()
    return grammar


def _feed(grammar: RequestGrammar, tokenizer: Tokenizer, output: list[int], new: list[int]) -> int | None:
    kept = grammar.accept(output, new, lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
    output += new if kept is None else new[:kept]
    return kept


def test_the_grammar_starts_after_the_reasoning_block_closes(tokenizer: Tokenizer, compiler: GrammarCompiler) -> None:
    grammar = _grammar(compiler, "User: count\n<think>\n")
    assert grammar.start is None and not grammar.active
    output: list[int] = []
    reasoning = tokenizer.encode("<think>anything at all, even </thi")
    for token in reasoning:  # one token a step: free text, the matcher untouched
        assert _feed(grammar, tokenizer, output, [token]) is None and grammar.start is None
    closing = tokenizer.encode("nk>")
    for token in closing:
        _feed(grammar, tokenizer, output, [token])
    assert grammar.start == len(output) and grammar.active
    answer = tokenizer.encode("42 ok")
    for token in answer:
        assert _feed(grammar, tokenizer, output, [token]) is None
    assert _feed(grammar, tokenizer, output, [EOS, 7]) == 1, "the stop token ends it; what follows is cut"
    assert not grammar.active and output[-1] == EOS


def test_a_prompt_that_closed_the_block_starts_the_grammar_at_once(tokenizer: Tokenizer,
                                                                    compiler: GrammarCompiler) -> None:
    assert _grammar(compiler, "<think>\n\n</think>\n\n").active  # Qwen3's enable_thinking=False
    assert _grammar(compiler, "<think>\n\n</think> old turn <think>\n").start is None  # reopened after
    assert _grammar(compiler, "no markers at all", markers=None).active


def test_a_refused_token_raises_and_a_take_back_rolls_the_matcher_back(tokenizer: Tokenizer,
                                                                        compiler: GrammarCompiler) -> None:
    grammar = _grammar(compiler, "", markers=None)
    output: list[int] = []
    _feed(grammar, tokenizer, output, tokenizer.encode("12"))
    with pytest.raises(GrammarViolation, match="not allowed by the request's grammar"):
        _feed(grammar, tokenizer, list(output), tokenizer.encode("x"))
    grammar.take_back(len(output))  # the failed step's token is rolled back
    assert grammar.consumed == len(output)
    assert _feed(grammar, tokenizer, output, tokenizer.encode(" ok")) is None


def test_taking_back_the_closing_token_reopens_the_block(tokenizer: Tokenizer, compiler: GrammarCompiler) -> None:
    grammar = _grammar(compiler, "<think>")
    output = tokenizer.encode("why</think>")
    grammar.accept(output[:-1], output[-1:], lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
    assert grammar.start == len(output)
    grammar.accept(output, tokenizer.encode("7"), lambda ids: tokenizer.decode(ids))
    grammar.take_back(len(output) - 1)
    assert grammar.start is None and grammar.consumed == len(output)  # consumed is unused until it reopens
    assert grammar.valid_drafts(tokenizer.encode("7 ok")) == 0, "no drafts while reasoning"
