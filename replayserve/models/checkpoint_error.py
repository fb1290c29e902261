"""The loader's error type, in a module of its own so that both the loader and the quantization
checks (which the loader calls) raise it without importing each other."""

from __future__ import annotations


class CheckpointError(ValueError):
    """The checkpoint directory is missing files or holds tensors the model does not expect."""
