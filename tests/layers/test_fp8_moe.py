"""A MoE layer quantized in memory (``quantize_model_fp8``, as bench_e2e's ``--quantization fp8``)
keeps its experts FP8: FP8 stacks with per-expert scales, the 16-bit stack freed. Its output equals
a float64 twin holding the dequantized weights, on the reference path and on the kernels' path (the
Triton interpreter on the CPU, fp32 activations), with the shared expert folded (up to 32 tokens),
unfolded (more) and behind latent projections."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import weakref

import pytest
import torch
from torch import nn

from replayserve.builtin.tiny import tiny_config
from replayserve.layers.fp8_linear import FP8Linear
from replayserve.layers.mlp import MoE
from replayserve.models.fp8_loading import quantize_model_fp8
from replayserve.models.quantization import QuantConfig, QuantizationError
from replayserve.ops.dispatch import force_triton
from replayserve.ops.fp8 import FP8_DTYPE, dequantize_fp8
from tests.graph_capture import capture

ALL = QuantConfig("FP8", None, (), "test")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class Holder(nn.Module):
    """A MoE layer under a module name, as in a model (quantize_model_fp8 names modules from the root)."""

    def __init__(self, latent: bool, shared: int, seed: int) -> None:
        super().__init__()
        cfg = dataclasses.replace(tiny_config("E"), hidden_size=64, n_routed_experts=16, num_experts_per_tok=4,
                                  moe_intermediate_size=48, moe_shared_expert_intermediate_size=shared, n_group=4,
                                  topk_group=2, routed_scaling_factor=2.5, moe_latent_size=32 if latent else None)
        torch.manual_seed(seed)
        self.mixer = MoE(cfg)
        with torch.no_grad():
            for p in self.mixer.parameters():
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
            self.mixer.gate.e_score_correction_bias.copy_(torch.randn(16) * 0.1)
        self.mixer.stacked_experts()


def dequantized_twin(quantized: Holder, latent: bool, shared: int) -> Holder:
    """The same layer in float64 with every FP8Linear's weight replaced by its dequantized values."""
    twin = Holder(latent, shared, seed=0).double()
    twin.mixer.stacked_experts()
    fp8 = {n: m for n, m in quantized.named_modules() if isinstance(m, FP8Linear)}
    with torch.no_grad():
        for name, module in fp8.items():
            twin.get_submodule(name).weight.copy_(dequantize_fp8(module.weight, module.weight_scale, torch.float64))
    return twin


@pytest.mark.parametrize("kernels", [False, True], ids=["reference", "kernels"])
@pytest.mark.parametrize(("latent", "shared", "num_tokens"), [
    (False, 96, 3),    # the shared expert folded: 2 pieces with its one scale
    (False, 96, 40),   # past 32 tokens: the shared expert runs as its own FP8 MLP
    (False, 32, 5),    # not foldable: added in the sum kernel
    (True, 32, 5),     # latent projections (FP8 too here)
])
def test_an_fp8_moe_layer_equals_its_dequantized_twin(kernels: bool, latent: bool, shared: int,
                                                      num_tokens: int) -> None:
    device = DEVICE if kernels else "cpu"  # the kernels' path: CUDA where there is one, else the interpreter
    holder = Holder(latent, shared, seed=0).to(device)
    moe = holder.mixer
    old_stack = weakref.ref(moe.stacked_experts()[0])
    names = quantize_model_fp8(holder, ALL)
    assert "mixer.experts.15.down_proj" in names and "mixer.shared_experts.up_proj" in names
    gc.collect()
    assert old_stack() is None  # the 16-bit stack went with its last expert
    w_up, w_down = moe.stacked_experts()
    assert w_up.dtype == w_down.dtype == FP8_DTYPE and w_up.shape[0] == 16 + moe.num_folded
    assert moe.experts[7].up_proj.weight.data_ptr() == w_up[7].data_ptr()
    up_scale, _ = moe.expert_scales(17)
    assert up_scale.shape == ((17,) if moe.num_folded else (16,))
    assert moe.experts[7].up_proj.weight_scale.data_ptr() == up_scale[7].data_ptr()

    x = torch.randn(num_tokens, 64, generator=torch.Generator().manual_seed(num_tokens))
    want = dequantized_twin(holder, latent, shared).mixer(x.double())
    with force_triton() if kernels else contextlib.nullcontext():
        got = moe(x.to(device))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double().cpu(), want, atol=1e-4 * want.abs().max().item(), rtol=1e-4)


def test_in_memory_a_moe_layer_is_quantized_whole_or_not_at_all() -> None:
    holder = Holder(latent=False, shared=96, seed=0)
    with pytest.raises(QuantizationError, match="mixer's experts"):
        quantize_model_fp8(holder, QuantConfig("FP8", None, ("*shared_experts*",), "test"))
    kept = quantize_model_fp8(holder, QuantConfig("FP8", None, ("mixer.*",), "test"))
    assert kept == [] and holder.mixer.stacked_experts()[0].dtype == torch.float32
    root = holder.mixer  # a MoE quantized as the root module (bench_moe --fp8)
    assert "experts.0.up_proj" in quantize_model_fp8(root, ALL) and root.stacked_experts()[0].dtype == FP8_DTYPE


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
def test_an_fp8_moe_layer_replays_in_a_cuda_graph() -> None:
    """bf16 activations, the shared expert folded: the graph's replays equal eager calls, and the
    layer stays near its dequantized twin."""
    holder = Holder(latent=False, shared=96, seed=0).to(torch.bfloat16).cuda()
    holder.mixer.gate.float()
    quantize_model_fp8(holder, ALL)
    moe = holder.mixer
    assert moe.stacked_experts()[0].dtype == FP8_DTYPE
    static_x = torch.randn(4, 64, dtype=torch.bfloat16, device="cuda")
    graph, static_out = capture(moe, static_x)
    twin = dequantized_twin(holder, latent=False, shared=96)  # reads the CUDA codes in place
    for seed in range(3):
        static_x.copy_(torch.randn(4, 64, generator=torch.Generator().manual_seed(seed)).to(static_x))
        graph.replay()
        assert torch.equal(static_out, moe(static_x))
        want = twin.mixer(static_x.cpu().double())
        torch.testing.assert_close(static_out.cpu().double(), want, atol=3e-2 * want.abs().max().item(), rtol=3e-2)
