"""Compiling for our `tokenizers` tokenizer: xgrammar reads its vocabulary right (the tokens of a
text the grammar allows are accepted one by one), compilations are shared by key and bounded."""

from __future__ import annotations

import pytest

from replayserve.config.builtin_models import TINY_CODE_DIR
from replayserve.structured import StructuredOutputsParams
from replayserve.structured import compiler as compiler_module
from replayserve.structured.compiler import GrammarCompiler, tokenizer_info
from replayserve.tokenizer import Tokenizer

xgr = pytest.importorskip("xgrammar")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tokenizer = Tokenizer.from_dir(TINY_CODE_DIR)
    assert tokenizer is not None
    return tokenizer


def test_the_byte_level_vocabulary_is_read_as_such(tokenizer: Tokenizer) -> None:
    info = tokenizer_info(tokenizer, vocab_size=8192, stop_token_ids=[2])
    assert info.vocab_type == xgr.VocabType.BYTE_LEVEL and not info.add_prefix_space
    assert info.vocab_size == 8192 and info.stop_token_ids == [2]


@pytest.mark.parametrize(("params", "text"), [
    (StructuredOutputsParams(json={"type": "object", "properties": {"name": {"type": "string"}},
                                   "required": ["name"]}), '{"name": "Ünïcode \\"quoted\\" 😀"}'),
    (StructuredOutputsParams(choice=['a"b', "new\nline", "tab\t", "x]y"]), "new\nline"),
    (StructuredOutputsParams(regex=r"def [a-z_]+\(\):"), "def read_lines():"),
])
def test_the_tokens_of_an_allowed_text_are_accepted_then_the_stop_token(tokenizer: Tokenizer,
                                                                        params: StructuredOutputsParams,
                                                                        text: str) -> None:
    compiled = GrammarCompiler(tokenizer, 8192, [2]).submit(params).result(timeout=120)
    matcher = xgr.GrammarMatcher(compiled)
    for token in tokenizer.encode(text):
        assert matcher.accept_token(token), tokenizer.token_text(token)
    assert matcher.accept_token(2) and matcher.is_terminated()


def test_compilations_are_shared_by_key_and_bounded(tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiler_module, "COMPILED_CACHE_SIZE", 2)
    compiler = GrammarCompiler(tokenizer, 8192, [2])
    first = compiler.submit(StructuredOutputsParams(choice=["a", "b"]))
    assert compiler.submit(StructuredOutputsParams(choice=["a", "b"])) is first
    assert compiler.submit(StructuredOutputsParams(choice=["a", "b"], disable_any_whitespace=True)) is not first
    compiler.submit(StructuredOutputsParams(choice=["c"]))
    assert compiler.submit(StructuredOutputsParams(choice=["a", "b"])) is not first  # evicted: the oldest of 3
    assert first.result(timeout=120) is not None
