"""Counts the kernels one batch-1 decode step's forward launches, per layer, for each hybrid family's
tiny model on the CPU: the aten ops it dispatches that launch a kernel (not views or allocations), and with
--kernels the Triton launches too, the ops' kernels run in Triton's interpreter as the CUDA path
runs them (`dispatch.force_triton`): a proxy for a CUDA step's kernel count (the batch-1 GEMV
kernels and CUDA graphs aside, which take the same path on every family).

    PYTHONPATH=$PWD python benchmarks/count_step_ops.py [--kernels] [--family granite qwen3_next ...]

The tiny models are make-tiny's (float32, the engine's eager decode path). `tests/models/test_step_ops.py`
pins an upper bound per family in both modes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from replayserve import LLM, SamplingParams
from replayserve.builtin.tiny import make_tiny

# Aten ops that launch no kernel: allocations and dtype queries.
NOT_KERNELS = frozenset({"aten::empty.memory_format", "aten::empty_like", "aten::new_empty", "aten::empty_strided",
                         "aten::promote_types", "aten::result_type.Tensor"})
# Each family's tiny layer mix (make-tiny's patterns; Falcon-H1 counts layers, each with both mixers).
PATTERNS = {"nemotron_h": "M*-ME", "granite": "M*MM*M", "bamba": "M*MM*M", "falcon_h1": "MMM", "qwen3_next": "GG*G",
            "qwen3_5_moe": "GG*G"}


class OpCounter(TorchDispatchMode):
    """Counts the non-view aten ops dispatched inside it, by name, and the Triton launches that
    `count_launch` reports while it is active (`triton:<kernel>`)."""

    active: OpCounter | None = None

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __enter__(self) -> OpCounter:
        OpCounter.active = self
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        OpCounter.active = None
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not func.is_view and func.name() not in NOT_KERNELS:
            self.ops[func.name()] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting_triton_launches() -> Any:
    """Runs the ops' Triton kernels in the interpreter (force_triton), each launch counted by the
    active OpCounter."""
    from triton.runtime.interpreter import InterpretedFunction

    from replayserve.ops.dispatch import force_triton

    run = InterpretedFunction.run

    def counted(kernel: Any, *args: Any, **kwargs: Any) -> Any:
        counter = OpCounter.active
        if counter is None:
            return run(kernel, *args, **kwargs)
        OpCounter.active = None  # the kernel's interpreted body dispatches tensor ops of its own
        try:
            with torch.utils._python_dispatch._disable_current_modes():
                return run(kernel, *args, **kwargs)
        finally:
            OpCounter.active = counter
            counter.ops[f"triton:{kernel.fn.__name__}"] += 1

    InterpretedFunction.run = counted
    try:
        with force_triton():
            yield
    finally:
        InterpretedFunction.run = run


def decode_step_ops(model_dir: Path, kernels: bool = False) -> tuple[Counter[str], int]:
    """(ops of one batch-1 decode step's model forward, the model's layer count); with `kernels`,
    the ops' Triton kernels run (interpreted) and count, as on CUDA."""
    with counting_triton_launches() if kernels else contextlib.nullcontext():
        return _decode_step_ops(model_dir)


def _decode_step_ops(model_dir: Path) -> tuple[Counter[str], int]:
    llm = LLM(model=str(model_dir), dtype="float32", device="cpu", max_num_seqs=1, max_model_len=64,
              max_num_batched_tokens=64)
    model = llm.engine.runner.model
    counted: list[Counter[str]] = []
    forward = model.forward

    def counting_forward(input_ids: torch.Tensor, ctx: Any, *args: Any) -> torch.Tensor:
        if ctx.num_decodes != 1 or input_ids.shape[0] != 1:
            return forward(input_ids, ctx, *args)
        with OpCounter() as counter:
            out = forward(input_ids, ctx, *args)
        counted.append(counter.ops)
        return out

    model.forward = counting_forward
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    if not counted:
        raise RuntimeError("no batch-1 decode step ran")
    return counted[-1], len(model.backbone.layers)


def ops_per_layer(family: str, out_dir: Path, kernels: bool = False) -> tuple[float, Counter[str]]:
    """(kernels per layer of one decode step, the step's ops by name) of the family's tiny model."""
    ops, layers = decode_step_ops(make_tiny(out_dir, family=family, layers=PATTERNS[family]), kernels)
    return sum(ops.values()) / layers, ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", nargs="+", default=list(PATTERNS), choices=list(PATTERNS))
    parser.add_argument("--top", type=int, default=8, help="the most frequent ops to list per family")
    parser.add_argument("--kernels", action="store_true", help="the ops' Triton kernels too (interpreted)")
    args = parser.parse_args()
    if args.kernels and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--kernels runs the Triton kernels in the interpreter: set TRITON_INTERPRET=1")
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.family:
            per_layer, ops = ops_per_layer(family, Path(tmp) / family, args.kernels)
            top = ", ".join(f"{name} {n}" for name, n in ops.most_common(args.top))
            print(f"{family:<11} {per_layer:6.1f} ops/layer ({sum(ops.values())} a step): {top}")


if __name__ == "__main__":
    main()
