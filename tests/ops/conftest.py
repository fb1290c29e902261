"""Kernel tests run on CUDA when it is there, else in the Triton interpreter on CPU.

``TRITON_INTERPRET`` is read when ``@triton.jit`` decorates a kernel, so it is set here, before
any test module imports one. Triton is a hard requirement (CI installs it): a missing triton
fails the kernel tests at import instead of skipping them.
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    _kernels = ("replayserve.ops.ssu_triton", "replayserve.ops.replay_ssm_triton")
    _early = [name for name in _kernels if name in sys.modules]
    if _early and os.environ["TRITON_INTERPRET"] == "1":
        from triton.runtime.interpreter import InterpretedFunction

        from replayserve.ops import ssu_triton

        if not isinstance(ssu_triton._ssu_kernel, InterpretedFunction):
            raise RuntimeError(
                f"{_early} were imported (and their kernels compiled for a GPU) before tests/ops/conftest.py "
                "set TRITON_INTERPRET=1; export TRITON_INTERPRET=1 or set it in tests/conftest.py"
            )
