"""Incremental detokenization: the text a stream has gained since its last chunk, without decoding
the whole output again for every token."""

from __future__ import annotations

from replayserve.tokenizer import Tokenizer

# What a byte-level decoder writes for bytes that do not yet form a whole UTF-8 character.
_INCOMPLETE = "\ufffd"
# Tokens decoded before the new ones, so that a decoder that joins tokens by context (spaces,
# merges) writes the new ones as they read in the whole text.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Appends a stream's text token by token.

    Each update decodes only a short window: a few context tokens plus the tokens not yet turned
    into text. The window's text minus the context's text is the new text. A window that ends in
    part of a multi-byte character waits for the next token. ``holdback`` characters at the end
    are kept back from `new_text` (a stop string may be forming there: the engine cuts the final
    text before it, and a chunk already sent cannot be taken back).
    """

    def __init__(self, tokenizer: Tokenizer, holdback: int = 0) -> None:
        self.tokenizer = tokenizer
        self.holdback = holdback
        self.token_ids: list[int] = []
        self.text = ""  # every whole character decoded so far
        self.sent = 0  # characters of `text` handed out by `new_text`
        self._context = 0  # token_ids[_context:_read] is the window's context
        self._read = 0  # token_ids[:_read] are in `text`

    def add(self, token_ids: list[int]) -> None:
        self.token_ids.extend(token_ids)
        context_text = self.tokenizer.decode(self.token_ids[self._context : self._read])
        window_text = self.tokenizer.decode(self.token_ids[self._context :])
        if window_text.endswith(_INCOMPLETE) or not window_text.startswith(context_text):
            return  # an unfinished character (or a decoder that rewrote the context): wait for more
        self.text += window_text[len(context_text) :]
        self._read = len(self.token_ids)
        self._context = max(0, self._read - _CONTEXT_TOKENS)

    def new_text(self) -> str:
        """The text not handed out yet, less the held-back tail."""
        end = max(self.sent, len(self.text) - self.holdback)
        out, self.sent = self.text[self.sent : end], end
        return out

    def rest(self, final_text: str) -> str:
        """The last chunk's text: what ``final_text`` (the engine's own decode, cut before a stop
        string) adds to what was handed out."""
        out, self.sent = final_text[self.sent :], max(self.sent, len(final_text))
        return out
