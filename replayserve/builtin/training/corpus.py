"""The built-in model's corpus: the Python standard library's own source, which every machine has.

Files are the `*.py` under `sysconfig.get_paths()["stdlib"]` (third-party `site-packages` /
`dist-packages` and caches left out, and files that are not UTF-8), sorted by relative path, so
the list is the same on every machine with the same Python. Every `heldout_every`-th file is held
out; the tokenizer and the model see only the rest. Another Python version has other files: the
held-out text the tests score is therefore shipped with the weights (`write_heldout_sample`).
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer

_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path) -> list[str]:
    """Relative POSIX paths of the UTF-8 `*.py` files under `root`, sorted."""
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if _SKIPPED_DIRS & set(rel.parts) or not path.is_file():
            continue
        try:
            path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:  # a few tests ship deliberately mis-encoded sources
            continue
        files.append(rel.as_posix())
    return sorted(files)


def split_files(files: Sequence[str], heldout_every: int) -> tuple[list[str], list[str]]:
    """(training, held-out): file i is held out when i % heldout_every == heldout_every - 1."""
    train = [f for i, f in enumerate(files) if i % heldout_every != heldout_every - 1]
    heldout = [f for i, f in enumerate(files) if i % heldout_every == heldout_every - 1]
    return train, heldout


def read_texts(root: Path, files: Sequence[str]) -> list[str]:
    return [(root / f).read_bytes().decode("utf-8") for f in files]


def token_stream(tokenizer: Tokenizer, texts: Sequence[str], eos_id: int) -> torch.Tensor:
    """(N,) int32: each text's tokens followed by `eos_id`, the texts in order. A window that
    crosses a file boundary sees the end-of-sequence token, as a generation that ends a file does."""
    encoded = tokenizer.encode_batch(list(texts), add_special_tokens=False)
    ids: list[int] = []
    for enc in encoded:
        ids += enc.ids
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.int32)


def write_heldout_sample(path: Path, files: Sequence[str], texts: Sequence[str], max_chars_per_file: int,
                         max_chars: int) -> int:
    """Writes the head of each held-out file (cut at a line end, at most `max_chars_per_file`
    characters) as JSON `{"python": version, "files": [{"path", "text"}]}`, files in order until
    `max_chars` in all. Returns the number of files written."""
    entries, total = [], 0
    for name, text in zip(files, texts, strict=True):
        head = text[:max_chars_per_file]
        if len(text) > max_chars_per_file:
            head = head[: head.rfind("\n") + 1]
        if not head.strip():
            continue
        if total + len(head) > max_chars:
            break
        entries.append({"path": name, "text": head})
        total += len(head)
    python = sysconfig.get_python_version()
    path.write_text(json.dumps({"python": python, "files": entries}, indent=1) + "\n")
    return len(entries)
