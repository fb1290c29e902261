"""Counts the aten ops one batch-1 decode step's forward dispatches, per layer, for each Mamba2 family's
tiny model on the CPU: a proxy for the kernels a CUDA step launches (each non-view aten op is one
kernel or more there; the ops' Triton kernels replace several at once, so the GPU counts are lower).

    PYTHONPATH=$PWD python benchmarks/count_step_ops.py [--family granite bamba falcon_h1 nemotron_h]

The tiny models are make-tiny's (float32 on the CPU, the engine's eager decode path); the count
excludes views (free on any device). `tests/models/test_step_ops.py` pins an upper bound per family.
"""

from __future__ import annotations

import argparse
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from replayserve import LLM, SamplingParams
from replayserve.builtin.tiny import make_tiny

# Each family's tiny layer mix (make-tiny's patterns; Falcon-H1 counts layers, each with both mixers).
PATTERNS = {"nemotron_h": "M*-ME", "granite": "M*MM*M", "bamba": "M*MM*M", "falcon_h1": "MMM"}


class OpCounter(TorchDispatchMode):
    """Counts the non-view aten ops dispatched inside it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not func.is_view:
            self.ops[func.name()] += 1
        return func(*args, **(kwargs or {}))


def decode_step_ops(model_dir: Path) -> tuple[Counter[str], int]:
    """(ops of one batch-1 decode step's model forward, the model's layer count)."""
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


def ops_per_layer(family: str, out_dir: Path) -> tuple[float, Counter[str]]:
    """(non-view aten ops per layer of one decode step, the step's ops by name) of the family's tiny model."""
    ops, layers = decode_step_ops(make_tiny(out_dir, family=family, layers=PATTERNS[family]))
    return sum(ops.values()) / layers, ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", nargs="+", default=list(PATTERNS), choices=list(PATTERNS))
    parser.add_argument("--top", type=int, default=8, help="the most frequent ops to list per family")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.family:
            per_layer, ops = ops_per_layer(family, Path(tmp) / family)
            top = ", ".join(f"{name} {n}" for name, n in ops.most_common(args.top))
            print(f"{family:<11} {per_layer:6.1f} ops/layer ({sum(ops.values())} a step): {top}")


if __name__ == "__main__":
    main()
