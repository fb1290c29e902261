"""Compiles constraints into xgrammar `CompiledGrammar`s for one tokenizer, on a thread of its
own, off the engine's step loop; keeps the last `COMPILED_CACHE_SIZE` by key.

Compiling computes a grammar's token masks over the whole vocabulary (tens of milliseconds for a
nested schema on an 8k vocabulary, more for 100k+): a request with a constraint waits for it
(`Scheduler.add(ready=False)`) while the engine steps the others. Requests with the same
constraint share one compilation, finished or under way.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from replayserve.structured.grammar import grammar_of
from replayserve.structured.params import StructuredOutputsParams
from replayserve.tokenizer import Tokenizer

if TYPE_CHECKING:
    import xgrammar

# Compiled grammars kept, by key: each holds token masks of up to a few MB for a 100k+ vocabulary.
COMPILED_CACHE_SIZE = 64
# xgrammar's own threads per compilation.
COMPILE_THREADS = 4


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> xgrammar.TokenizerInfo:
    """xgrammar's view of our `tokenizers` tokenizer. `TokenizerInfo.from_huggingface` reads the
    vocabulary's encoding (byte-level BPE, byte fallback, raw) and prefix-space rule from the
    tokenizer's serialized form; transformers' `PreTrainedTokenizerFast` wraps the raw tokenizer
    for it without copying (xgrammar depends on transformers). vocab_size: the model's (the width
    of its logits, which may pad the tokenizer's); stop_token_ids: the model's EOS ids, which end
    a grammar (none: xgrammar looks for one such as "</s>" in the vocabulary)."""
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    return xgr.TokenizerInfo.from_huggingface(wrapped, vocab_size=vocab_size,
                                              stop_token_ids=list(stop_token_ids) or None)


class GrammarCompiler:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        """Starts building the tokenizer's xgrammar compiler on the worker thread (importing
        xgrammar and reading the vocabulary take seconds the step loop should not wait)."""
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="replayserve-grammar")
        self._compiler = self._executor.submit(self._make, tokenizer, vocab_size, tuple(stop_token_ids))
        self._compiled: OrderedDict[tuple, Future[xgrammar.CompiledGrammar]] = OrderedDict()

    @staticmethod
    def _make(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]) -> xgrammar.GrammarCompiler:
        import xgrammar as xgr

        # Caching is ours (by key, bounded); xgrammar's would keep a second copy.
        return xgr.GrammarCompiler(tokenizer_info(tokenizer, vocab_size, stop_token_ids), max_threads=COMPILE_THREADS,
                                   cache_enabled=False)

    def submit(self, params: StructuredOutputsParams) -> Future[xgrammar.CompiledGrammar]:
        """The compiled grammar of ``params``, compiled on the worker thread unless cached."""
        key = params.key
        future = self._compiled.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._compiled.move_to_end(key)
            return future
        future = self._executor.submit(self._compile, params)
        self._compiled[key] = future
        while len(self._compiled) > COMPILED_CACHE_SIZE:
            self._compiled.popitem(last=False)
        return future

    def _compile(self, params: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        return self._compiler.result().compile_grammar(grammar_of(params))
