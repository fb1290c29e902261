"""What the attention kernels serve, which their callers ask before choosing a path: the widest
row the batched short-row path takes, and the head dims of the prefill kernel. A module of its
own, without Triton, so that the reference module (`attention.py`), which runs the kernels where
they serve, and the kernels (`paged_attention_triton.py`, `prefill_attention_triton.py`) share it
without importing each other."""

from __future__ import annotations

SHORT_ROW = 6  # at most this many query tokens (decode, verify of up to 5 drafts): batched on CUDA


def prefill_kernel_head_dim(head_dim: int) -> bool:
    """Whether ``paged_prefill_attention_triton`` takes `head_dim`: a power of two from 16 (the smallest
    tensor-core product) to 256."""
    return 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0
