"""One request's grammar as the engine steps it: the xgrammar matcher over its output, and where
in the output the grammar starts (after a reasoning block, `StructuredOutputsParams.reasoning_markers`).

The matcher's state is a function of the output's length: it has consumed output[start:consumed]
(a step's last token may reach it later, `accepted(later=True)`: `Grammars` hands it over before
the matcher is used again).
A step accepts the tokens the engine keeps; a failed step's take-back rolls the matcher back to
the output length the engine restores (xgrammar rolls back any number of tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import xgrammar

# Tokens of the output before a new token that the reasoning-end check decodes with it, per
# character of the end marker: a marker split over tokens lies within this window.
_WINDOW_PER_CHAR = 4


class GrammarViolation(RuntimeError):
    """A sampled token the grammar refuses (its mask should have made that impossible)."""


class RequestGrammar:
    def __init__(self, compiled: Future[xgrammar.CompiledGrammar], markers: tuple[str, str] | None,
                 prompt_text: str) -> None:
        """compiled: the grammar, compiling; markers: (start, end) of a reasoning block the grammar
        waits out; prompt_text: the prompt, special tokens included (a template that closed the
        block there starts the grammar at once)."""
        self.compiled = compiled
        self.matcher: xgrammar.GrammarMatcher | None = None  # set by `start_matching` once compiled
        self.stop_token_ids: frozenset[int] = frozenset()
        self.end_marker = None if markers is None else markers[1]
        # The output index the grammar starts at; None while the reasoning block is open.
        self.start: int | None = 0 if markers is None or reasoning_state(prompt_text, *markers) == "closed" else None
        self.consumed = self.start or 0  # the matcher has consumed output[start:consumed]

    def start_matching(self) -> None:
        import xgrammar as xgr

        compiled = self.compiled.result()
        self.matcher = xgr.GrammarMatcher(compiled)
        # Only accepting one of these ends the grammar (xgrammar terminates on a stop token).
        self.stop_token_ids = frozenset(compiled.tokenizer_info.stop_token_ids)

    @property
    def active(self) -> bool:
        """Masks the next token: the reasoning is over and the grammar has not ended."""
        return self.start is not None and self.matcher is not None and not self.matcher.is_terminated()

    def valid_drafts(self, drafts: Sequence[int]) -> int:
        """How many leading drafts the grammar allows (up to and with one that ends it); the
        matcher is left as it was. While reasoning: none (a verify must not run across the
        token that ends the block, after which the positions would need masks)."""
        if not self.active:
            return 0
        assert self.matcher is not None
        n = 0
        try:
            for token in drafts:
                if not self.matcher.accept_token(token):
                    break
                n += 1
                if self.matcher.is_terminated():
                    break
        finally:
            if n:
                self.matcher.rollback(n)
        return n

    def accept(self, output: Sequence[int], new: Sequence[int], decode: Callable[[list[int]], str]) -> int | None:
        """Advances over ``new``, the tokens a step appends to ``output``. Returns how many of them
        to keep when the grammar ended (its stop token is the last kept), else None. Raises
        GrammarViolation for a token the grammar refuses."""
        assert self.matcher is not None
        i = 0
        if self.start is None:
            while i < len(new) and self.start is None:
                i += 1
                if self._closes_reasoning(output, new[:i], decode):
                    self.start = self.consumed = len(output) + i
            if self.start is None:
                return None
        for j in range(i, len(new)):
            if not self.matcher.accept_token(new[j]):
                raise GrammarViolation(f"token {new[j]} is not allowed by the request's grammar at output position "
                                       f"{len(output) + j}")
            self.consumed = len(output) + j + 1
            if self.matcher.is_terminated():
                return j + 1
        return None

    def takes_one(self, new: Sequence[int]) -> bool:
        """``new`` is one token past the reasoning block: a batched accept can hand it to the matcher
        (then ``accepted`` follows), with no reasoning-end check to run."""
        return len(new) == 1 and self.start is not None and self.matcher is not None

    def accepted(self, took: bool, output: Sequence[int], token: int, later: bool = False) -> int | None:
        """The matcher was handed ``token`` after ``output`` by a batched accept and ``took`` it or
        not: as ``accept(output, [token], ...)`` from there on. later: ``took`` is what the step's
        mask said of the token, and the matcher is handed it afterwards (`Grammars` does, before
        the matcher is next used); only for a token not in `stop_token_ids`, which cannot end the
        grammar."""
        assert self.matcher is not None
        if not took:
            raise GrammarViolation(f"token {token} is not allowed by the request's grammar at output position "
                                   f"{len(output)}")
        self.consumed = len(output) + 1
        return None if later else 1 if self.matcher.is_terminated() else None

    def take_back(self, length: int) -> None:
        """The output is cut back to ``length`` tokens (a failed step): the matcher follows."""
        if self.start is None or self.consumed <= length:
            return
        assert self.matcher is not None
        keep = max(length, self.start)
        if self.consumed > keep:
            self.matcher.rollback(self.consumed - keep)
        self.consumed = keep
        if length < self.start:  # the token that closed the reasoning block is gone too
            self.start = None

    def _closes_reasoning(self, output: Sequence[int], new: Sequence[int], decode: Callable[[list[int]], str]) -> bool:
        """The end marker completes with new[-1] (it was not in the output before it)."""
        assert self.end_marker is not None
        window = _WINDOW_PER_CHAR * len(self.end_marker)
        tail = list(output[-window:]) + list(new)
        return self.end_marker in decode(tail) and self.end_marker not in decode(tail[:-1])


def reasoning_state(prompt_text: str, start: str, end: str) -> str:
    """Where a prompt leaves a reasoning block: "closed" (its end marker follows the last start
    marker, or appears at all with no start marker: a template that closed it), "open" (a start
    marker with no end after it: the template opened it, the output begins inside it) or "none"."""
    last = prompt_text.rfind(start)
    if end in prompt_text[max(last, 0) :]:
        return "closed"
    return "open" if last >= 0 else "none"
