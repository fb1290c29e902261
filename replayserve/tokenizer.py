"""The model directory's `tokenizer.json`, through the `tokenizers` library."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

# Characters above which `encode` releases the GIL while it runs (about 25 ms of tokenizing).
LONG_TEXT = 1 << 16


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer) -> None:
        self._tok = tokenizer

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer | None:
        """The directory's tokenizer, or None when it has no `tokenizer.json`."""
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            return None
        try:
            return cls(HFTokenizer.from_file(str(path)))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise ValueError(f"{path} is not a valid tokenizer.json: {e}") from e

    @property
    def backend(self) -> HFTokenizer:
        """The `tokenizers` tokenizer itself (the grammar engine reads its vocabulary)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        check_unicode(text, "the text to tokenize")  # callers that know the field check it first
        if len(text) > LONG_TEXT:
            # `encode` holds the GIL for its whole run (2.5 s for 2.7 MB); `encode_batch` releases it,
            # so a server tokenizing a long prompt on a worker thread keeps its event loop going.
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text, special tokens included (a logprob's `decoded_token`)."""
        return self._tok.decode([token_id], skip_special_tokens=False)


def check_unicode(text: str, field: str) -> None:
    """Raises ValueError naming `field` when `text` holds a lone surrogate (such as "\\ud800", which
    a JSON escape or a Python literal can make): it is half of a UTF-16 pair, not a character, so
    UTF-8 cannot encode it and the tokenizer would fail with a bare TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{field} is not valid Unicode: {text[e.start]!r} at index {e.start} is a lone "
                         "surrogate (half of a UTF-16 pair); send text that is valid UTF-8") from None
