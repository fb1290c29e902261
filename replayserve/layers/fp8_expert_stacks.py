"""FP8 experts made ready for the grouped GEMM's stacks: one weight scale per expert and projection.

The grouped GEMM (``ops.moe_triton``) scales each expert's block of a stack by one float32. A
ModelOpt checkpoint stores every Linear with its own per-tensor ``weight_scale``, so an expert whose
gate_proj and up_proj are separate Linears (the Qwen MoEs') has two scales for the one (2I, W) block
of the SwiGLU layout. ``share_scale_`` requantizes such shards to the larger of their scales
(``ops.fp8.requantize_to_max_scale``, the rule for a fused projection whose shards were quantized
apart, as vLLM applies to its merged Linears): the shard that had it keeps its codes bit for bit,
the other loses the low bits its finer scale held. ``stack_scales_`` then gathers the scales into
one (E,) tensor, each Linear's ``weight_scale`` a view of its entry, as ``layers.stacked`` does for
the weights. Both run once, when the weights are final (``prepare_weights_`` after a load).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from replayserve.layers.fp8_linear import FP8Linear
from replayserve.ops.fp8 import requantize_to_max_scale


def fp8_stackable(linears: Sequence[nn.Module]) -> bool:
    """Whether these are FP8 Linears the grouped GEMM can run as one stack: all `FP8Linear`s,
    materialized, on one device, of one input width, without bias and without a static input scale
    (the kernel keeps the activations 16-bit: an expert's input scale is checked at load, not applied)."""
    if not linears or not all(type(m) is FP8Linear for m in linears):
        return False
    weights = [m.weight for m in linears]
    return (len({(w.device, w.shape[1]) for w in weights}) == 1 and not weights[0].is_meta
            and all(m.bias is None and m.input_scale is None for m in linears))


def share_scale_(linears: Sequence[FP8Linear]) -> None:
    """Requantizes the FP8 Linears of one fused projection (an expert's gate and up), in place, to
    the largest of their weight scales: each one's codes and `weight_scale` change, so it computes
    what the fused block computes, alone or stacked."""
    weight, scale = requantize_to_max_scale([m.weight for m in linears], [m.weight_scale for m in linears])
    with torch.no_grad():
        for m, codes in zip(linears, weight.split([m.out_features for m in linears]), strict=True):
            m.weight.copy_(codes)
            m.weight_scale.copy_(scale.reshape(m.weight_scale.shape))
            if m.weight_scale_rows is not None:  # made from the old scale
                m.keep_row_scale_()


def stack_scales_(groups: Sequence[Sequence[FP8Linear]]) -> Tensor:
    """The (G,) float32 stack of one weight scale per group (an expert's Linears that share it,
    ``share_scale_``; a group whose scales differ is an error); every Linear's `weight_scale` buffer
    becomes a 0-dim view of its group's entry, so the state dict keeps the checkpoint's names and values."""
    for group in groups:
        if any(not torch.equal(m.weight_scale, group[0].weight_scale) for m in group[1:]):
            raise ValueError(f"FP8 Linears stacked under one scale hold different scales "
                             f"{[float(m.weight_scale) for m in group]}: requantize them first (share_scale_)")
    stack = torch.stack([group[0].weight_scale.detach().reshape(()).to(torch.float32) for group in groups])
    for i, group in enumerate(groups):
        for m in group:
            m.weight_scale = stack[i]
    return stack
