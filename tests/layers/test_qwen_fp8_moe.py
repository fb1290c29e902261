"""A Qwen MoE block (`layers/qwen_moe.py`) with FP8 routed experts, each projection quantized apart
with its own scale as ModelOpt stores them: stacking requantizes every expert's gate and up to the
larger of their two scales (the shard that had it keeps its codes bit for bit), stacks the codes and
the per-expert scales as views, and the stacked block equals transformers' Qwen3NextSparseMoeBlock
holding those weights dequantized in float64 (on the kernels, fp32 in Triton's interpreter, which
widens FP8 exactly, and on the references), equals the per-expert loop, and stays near the block of
the per-shard weights it was requantized from."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

from replayserve.layers.fp8_expert_stacks import stack_scales_
from replayserve.layers.fp8_linear import FP8Linear
from replayserve.layers.qwen_moe import SparseMoeBlock
from replayserve.ops.dispatch import force_triton
from replayserve.ops.fp8 import FP8_DTYPE, dequantize_fp8, quantize_fp8, quantize_fp8_per_tensor
from tests.layers.test_qwen_moe import DEVICE, NUM_EXPERTS, _pair

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def quantized_pair(seed: int) -> tuple[SparseMoeBlock, Qwen3NextSparseMoeBlock, dict[tuple[int, str], tuple]]:
    """Our block with its routed experts' Linears swapped for FP8Linears (each weight quantized
    alone: ModelOpt's per-tensor scales), unstacked; transformers' block; and the stored (codes,
    scale) of each (expert, projection). Even experts' gate is 4x larger than their up, odd ones' up
    4x larger, so the larger scale is the gate's in half the experts and the up's in the other."""
    ours, theirs = _pair(True, seed=seed)
    stored = {}
    with torch.no_grad():
        for e, mlp in enumerate(ours.experts):
            getattr(mlp, "gate_proj" if e % 2 == 0 else "up_proj").weight.mul_(4.0)
            for name in PROJECTIONS:
                linear = getattr(mlp, name)
                fp8 = FP8Linear.replacing(linear, static_input_scale=False)
                codes, scale = quantize_fp8_per_tensor(linear.weight)
                fp8.weight.copy_(codes)
                fp8.weight_scale.copy_(scale)
                setattr(mlp, name, fp8)
                stored[e, name] = (codes.clone(), scale.clone())
    return ours, theirs.double(), stored


def load_experts_(theirs: Qwen3NextSparseMoeBlock, weights: dict[tuple[int, str], torch.Tensor]) -> None:
    """Puts float64 expert weights (per (expert, projection)) into transformers' fused parameters."""
    with torch.no_grad():
        theirs.experts.gate_up_proj.copy_(torch.stack([torch.cat([weights[e, "gate_proj"], weights[e, "up_proj"]])
                                                       for e in range(NUM_EXPERTS)]))
        theirs.experts.down_proj.copy_(torch.stack([weights[e, "down_proj"] for e in range(NUM_EXPERTS)]))


def test_stacking_requantizes_gate_and_up_to_the_larger_scale_and_stacks_views() -> None:
    ours, _, stored = quantized_pair(seed=0)
    ours.stack_projections_()
    stacks = ours.expert_stacks()
    assert stacks is not None
    w_up, w_down = stacks
    assert w_up.dtype == w_down.dtype == FP8_DTYPE and w_up.shape[0] == NUM_EXPERTS
    up_scales, down_scales = ours._scales
    for e, mlp in enumerate(ours.experts):
        (gate_codes, gate_scale), (up_codes, up_scale) = stored[e, "gate_proj"], stored[e, "up_proj"]
        top = torch.maximum(gate_scale, up_scale)
        assert (gate_scale > up_scale) == (e % 2 == 0)  # the larger scale alternates between the shards
        assert torch.equal(up_scales[e], top) and torch.equal(down_scales[e], stored[e, "down_proj"][1])
        for linear in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):  # each scale a view of its expert's entry
            stack = down_scales if linear is mlp.down_proj else up_scales
            assert linear.weight_scale.data_ptr() == stack[e].data_ptr()
        kept, requantized = ((mlp.gate_proj, gate_codes), (mlp.up_proj, up_codes))[::1 if e % 2 == 0 else -1]
        assert torch.equal(kept[0].weight.view(torch.uint8), kept[1].view(torch.uint8))
        finer_scale = up_scale if e % 2 == 0 else gate_scale
        want = quantize_fp8(dequantize_fp8(requantized[1], finer_scale), top)
        assert torch.equal(requantized[0].weight.view(torch.uint8), want.view(torch.uint8))
        assert not torch.equal(want.view(torch.uint8), requantized[1].view(torch.uint8))  # codes did change
        inner = w_down.shape[2]
        assert mlp.gate_proj.weight.data_ptr() == w_up[e, :inner].data_ptr()
        assert mlp.up_proj.weight.data_ptr() == w_up[e, inner:].data_ptr()
        assert mlp.down_proj.weight.data_ptr() == w_down[e].data_ptr()


@pytest.mark.parametrize("num_tokens", [1, 7, 40])  # 40: past one routing program
@pytest.mark.parametrize("path", ["kernels", "references"])
def test_stacked_fp8_block_equals_transformers_on_the_dequantized_weights(path: str, num_tokens: int) -> None:
    if path == "references" and DEVICE != "cpu":
        pytest.skip("on CUDA the plain call takes the kernels")
    ours, theirs, stored = quantized_pair(seed=num_tokens)
    x = torch.randn(num_tokens, ours.gate.weight.shape[1], generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.no_grad():
        loop = ours(x)  # unstacked: the per-expert loop on the per-shard scales
        ours.stack_projections_()
        assert ours.expert_stacks() is not None
        with force_triton() if path == "kernels" else contextlib.nullcontext():
            got = ours(x)
        load_experts_(theirs, {(e, name): dequantize_fp8(getattr(mlp, name).weight, getattr(mlp, name).weight_scale,
                                                        torch.float64)
                               for e, mlp in enumerate(ours.experts) for name in PROJECTIONS})
        want = theirs(x.double()[None])[0]
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
        ours._experts = None  # the same requantized experts through the per-expert loop
        torch.testing.assert_close(got, ours(x), atol=1e-5, rtol=1e-5)
        # Near the per-shard weights it came from: the finer shard's codes are rounded once more, each
        # by at most half of e4m3's relative step (2^-3), so the output moves by less than that step.
        load_experts_(theirs, {key: dequantize_fp8(codes, scale, torch.float64)
                               for key, (codes, scale) in stored.items()})
        original = theirs(x.double()[None])[0]
        torch.testing.assert_close(loop.double(), original, atol=1e-5, rtol=1e-5)
        error = (got.double() - original).abs().max() / original.abs().max()
        assert 0 < error < 2**-4, error


def test_scales_of_one_group_must_agree() -> None:
    ours, _, _ = quantized_pair(seed=2)
    mlp = ours.experts[0]
    with pytest.raises(ValueError, match="requantize them first"):
        stack_scales_([(mlp.gate_proj, mlp.up_proj)])
