"""What the loader does differently for a ModelOpt FP8 checkpoint (``models/quantization.py``
reads its config and checks its tensors).

Before any weight is allocated, every quantized Linear of the meta model becomes an ``FP8Linear``
(float8_e4m3fn weight, its scales as buffers under the checkpoint's names), so the weights load as
stored, never cast. Excluded modules stay 16-bit Linears. The MoE experts (routed and shared)
are the one exception: their FP8 weights are dequantized to the model's dtype as they load,
because the fused MoE kernel reads them as one 16-bit stack (``MoE.stacked_experts``; an FP8
grouped GEMM with per-expert scales is not written yet). Our layers fuse no projections the checkpoint stores apart
(q, k and v are separate Linears; ``in_proj`` is one stored tensor), so no shards need a common
scale here; ``ops.fp8.requantize_to_max_scale`` is the tool for a family that does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from replayserve.layers.fp8_linear import FP8Linear
from replayserve.layers.mlp import MoE
from replayserve.models.quantization import QuantConfig, QuantizedTensors, check_quantized_tensors, quantizable_modules
from replayserve.ops.fp8 import FP8_DTYPE, dequantize_fp8, quantize_fp8_per_tensor


@dataclasses.dataclass(frozen=True)
class FP8Plan:
    """How a checkpoint's FP8 tensors load into the model ``prepare_fp8_model`` changed.

    found: the checked scales (``check_quantized_tensors``).
    dequantized: quantized Linear module names that load as 16-bit weights (the MoE experts).
    """

    found: QuantizedTensors
    dequantized: frozenset[str]

    def takes_as_scale(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` is a scale read here rather than a model parameter."""
        return name in self.found.scale_names

    def loaded(self, name: str, tensor: Tensor, target: Tensor) -> Tensor:
        """The tensor to copy into ``target`` for checkpoint tensor ``name``: an FP8 weight of a
        dequantized module becomes ``weight * weight_scale`` in target's dtype; a one-element
        scale stored as (1,) becomes 0-dim; everything else is returned as it is."""
        module = name.removesuffix(".weight")
        if module in self.dequantized and name != module and tensor.dtype == FP8_DTYPE:
            return dequantize_fp8(tensor, self.found.linears[module].weight_scale, target.dtype)
        if target.dim() == 0 and tensor.numel() == 1:
            return tensor.reshape(())
        return tensor


def _moe_expert_prefixes(model: nn.Module) -> tuple[str, ...]:
    return tuple(p for name, m in model.named_modules() if isinstance(m, MoE)
                 for p in (f"{name}.experts.", f"{name}.shared_experts."))


def prepare_fp8_model(model: nn.Module, quant: QuantConfig, header: Mapping[str, Tensor]) -> FP8Plan:
    """Checks the checkpoint's tensors against ``quant`` and the model (errors name the tensor)
    and swaps an ``FP8Linear`` in for every quantized Linear that is no MoE expert.

    model: built on the meta device, not yet allocated. header: checkpoint name -> tensor, with
    meta tensors for weights (dtype and shape) and the scales' values.
    """
    linears, attentions = quantizable_modules(model)
    found = check_quantized_tensors(header, quant, linears, attentions)
    experts = _moe_expert_prefixes(model)
    dequantized = frozenset(m for m in found.linears if m.startswith(experts))
    for module in found.linears:
        if module not in dequantized:
            _swap_in(model, module, found.static_activations)
    for attention, scales in found.kv_cache.items():  # read once here: the kernels take them as numbers
        model.get_submodule(attention).kv_scales = (float(scales.k_scale), float(scales.v_scale))
    return FP8Plan(found, dequantized)


def _swap_in(model: nn.Module, module: str, static_input_scale: bool) -> tuple[nn.Linear, FP8Linear]:
    """Puts an FP8Linear of the Linear ``module``'s shape in its place; returns (the Linear, the FP8Linear)."""
    parent_name, _, child = module.rpartition(".")
    parent = model.get_submodule(parent_name)
    linear = getattr(parent, child)
    fp8 = FP8Linear.replacing(linear, static_input_scale)
    setattr(parent, child, fp8)
    return linear, fp8


@torch.no_grad()
def quantize_model_fp8(model: nn.Module, quant: QuantConfig) -> list[str]:
    """In memory, what ``replayserve quantize`` and loading its output do to a loaded 16/32-bit
    model: every Linear ``quant`` does not exclude, MoE experts aside, becomes an FP8Linear holding
    ``quantize_fp8_per_tensor`` of its weight, with no input_scale (activations scaled per call).
    Each 16-bit weight is freed as its FP8 copy is made. For benchmarks on random weights.
    Returns the names of the modules quantized."""
    linears, _ = quantizable_modules(model)
    experts = _moe_expert_prefixes(model)
    chosen = [m for m in linears if not quant.is_excluded(m) and not m.startswith(experts)]
    for module in chosen:
        linear, fp8 = _swap_in(model, module, static_input_scale=False)
        weight, scale = quantize_fp8_per_tensor(linear.weight)
        fp8.weight.copy_(weight)
        fp8.weight_scale.copy_(scale)
        if linear.bias is not None:
            fp8.bias.data = linear.bias.data
    return chosen
