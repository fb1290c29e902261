"""Which implementation serves an op's call: its Triton kernel or its plain-PyTorch reference.

Every op that has both keeps them in a pair of modules, ``X.py`` (the reference ``*_ref`` and the
op's entry point) and ``X_triton.py`` (the kernel). The entry point asks ``use_triton`` and imports
``X_triton`` only when the kernel serves the call, so importing the package never imports Triton,
which the CPU path never needs (tests/test_packaging.py). Layers and SSM backends call the entry
points and choose nothing themselves. Where the kernels' path is a different composition rather
than one op (the MoE's grouped GEMM with aligned routing, the packed prefill, the batch-1 GEMV
with the conv update in its epilogue), the layer asks ``use_triton`` (or the op's own test, such
as ``gemv.gemv_serves``) before taking it.

The kernels run on CUDA. ``force_triton`` runs them on any device: the tests' way onto the kernel
path on a CPU, where Triton's interpreter runs them (``TRITON_INTERPRET=1``, which must be set
before any kernel module is imported: tests/conftest.py does it).
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator
from contextlib import contextmanager

import torch

# The dtypes every kernel takes; float64 (the tests' oracle) and the rest go to the references.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_forced = False  # set only by `force_triton`


def use_triton(x: torch.Tensor, dtypes: Collection[torch.dtype] | None = KERNEL_DTYPES) -> bool:
    """Whether an op on `x` runs its Triton kernel: x on CUDA (any device under ``force_triton``)
    and of one of `dtypes` (None: any dtype, for ops whose kernel is chosen by device alone)."""
    return (_forced or x.is_cuda) and (dtypes is None or x.dtype in dtypes)


@contextmanager
def force_triton() -> Iterator[None]:
    """Within it, every op of this process runs its Triton kernel wherever the kernel takes the
    dtype, on any device. SSM backends and layers choose per call, so build and run the engine
    inside it. Without CUDA the kernels need Triton's interpreter."""
    global _forced
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        raise RuntimeError("force_triton without CUDA runs the kernels in Triton's interpreter: set "
                           "TRITON_INTERPRET=1 before any replayserve.ops kernel module is imported")
    previous, _forced = _forced, True
    try:
        yield
    finally:
        _forced = previous
