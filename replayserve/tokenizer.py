"""The model directory's `tokenizer.json`, through the `tokenizers` library."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer


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
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token's text, special tokens included (a logprob's `decoded_token`)."""
        return self._tok.decode([token_id], skip_special_tokens=False)
