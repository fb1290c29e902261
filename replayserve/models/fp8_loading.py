"""What the loader does differently for a ModelOpt FP8 checkpoint (``models/quantization.py``
reads its config and checks its tensors).

Before any weight is allocated, every quantized Linear of the meta model becomes an ``FP8Linear``
(float8_e4m3fn weight, its scales as buffers under the checkpoint's names), so the weights load as
stored, never cast. Excluded modules stay 16-bit Linears. The MoE experts (routed and shared) are
``FP8Linear``s too: ``MoE.stacked_experts`` (Nemotron-H) and ``SparseMoeBlock.stack_projections_``
(the Qwen MoEs) stack their codes and their per-expert weight scales, which the fused MoE kernel
reads as they are (FP8 weights widened in registers). The routed experts, and Nemotron-H's shared
expert (folded into the grouped GEMM up to 32 tokens, its own FP8 MLP above that, as an FP8 Linear
without input_scale runs: ``ops.fp8_linear``), run FP8 weights on 16-bit activations: their static
``input_scale`` tensors are checked and not applied (rounding the activations through FP8 would
only lose precision in a kernel that reads weights). The one fused projection
whose shards a checkpoint quantizes apart is a Qwen expert's gate|up block of the grouped GEMM: its
two scales become one at stacking (``layers/fp8_expert_stacks.py``: ``ops.fp8.requantize_to_max_scale``);
q, k and v are separate Linears and ``in_proj`` is one stored tensor.

Under tensor parallelism the swap happens on a rank's model (``models/sharding.py``): each
``FP8Linear`` has the rank's shape, takes the slice of the codes the loader cuts, keeps the whole
per-tensor scales, and inherits the Linear's forward hooks (the row-parallel all-reduce).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch
from torch import Tensor, nn

from replayserve.layers.fp8_linear import FP8Linear
from replayserve.layers.mlp import MoE
from replayserve.layers.qwen_moe import SparseMoeBlock
from replayserve.layers.tensor_parallel import ParallelLMHead, VocabParallelEmbedding
from replayserve.models.quantization import (
    QuantConfig,
    QuantizationError,
    QuantizedTensors,
    check_quantized_tensors,
    quantizable_modules,
)
from replayserve.ops.fp8 import FP8_DTYPE, quantize_fp8_per_tensor


@dataclasses.dataclass(frozen=True)
class FP8Plan:
    """How a checkpoint's FP8 tensors load into the model ``prepare_fp8_model`` changed.

    found: the checked scales (``check_quantized_tensors``).
    """

    found: QuantizedTensors

    def takes_as_scale(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` is a scale read here rather than a model parameter
        (the KV cache's, and the MoE experts' input scales)."""
        return name in self.found.scale_names

    @staticmethod
    def loaded(tensor: Tensor, target: Tensor) -> Tensor:
        """The tensor to copy into ``target``: a one-element scale stored as (1,) becomes 0-dim;
        everything else is returned as it is."""
        if target.dim() == 0 and tensor.numel() == 1:
            return tensor.reshape(())
        return tensor


def _moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def _under(name: str) -> str:
    """The prefix of the modules under module ``name`` ("" for the root)."""
    return f"{name}." if name else ""


def _expert_modules(name: str, moe: MoE) -> tuple[list[str], list[str]]:
    """(the routed experts' Linears, the shared expert's) of MoE layer ``name``, as module names."""
    routed = [f"{_under(name)}experts.{e}.{p}" for e in range(len(moe.experts)) for p in ("up_proj", "down_proj")]
    return routed, [f"{_under(name)}shared_experts.{p}" for p in ("up_proj", "down_proj")]


def _routed_experts(model: nn.Module) -> dict[str, list[str]]:
    """MoE layer name -> its routed experts' Linears (module names), for the layers whose routed
    experts run as one stack in the grouped GEMM: Nemotron-H's (up, down) and the Qwen MoEs'
    (gate, up, down)."""
    routed = {name: _expert_modules(name, moe)[0] for name, moe in _moe_layers(model)}
    for name, block in model.named_modules():
        if isinstance(block, SparseMoeBlock):
            routed[name] = [f"{_under(name)}experts.{e}.{p}" for e in range(len(block.experts))
                            for p in ("gate_proj", "up_proj", "down_proj")]
    return routed


def check_expert_kinds(model: nn.Module, quantized: set[str] | frozenset[str], source: str,
                       spell: Callable[[str], str] = str) -> None:
    """The routed experts of a MoE layer are one stack, so all FP8 or all 16-bit (else an error
    naming a module of each kind, as ``spell`` writes the engine's module names)."""
    for routed in _routed_experts(model).values():
        fp8 = [m for m in routed if m in quantized]
        if fp8 and len(fp8) != len(routed):
            other = next(m for m in routed if m not in quantized)
            raise QuantizationError(f"{source} quantizes {spell(fp8[0])} but not {spell(other)}: a MoE layer's routed "
                                    "experts run as one stack, so they must be all FP8 or all 16-bit")


def _shared_expert_apart(name: str, moe: MoE, quantized: set[str] | frozenset[str]) -> bool:
    """Whether MoE layer ``name``'s shared expert is of another kind than its routed experts (or
    half quantized): it cannot then join their stack."""
    routed, shared = _expert_modules(name, moe)
    return {m in quantized for m in shared} != {routed[0] in quantized}


def prepare_fp8_model(model: nn.Module, quant: QuantConfig, header: Mapping[str, Tensor]) -> FP8Plan:
    """Checks the checkpoint's tensors against ``quant`` and the model (errors name the tensor)
    and swaps an ``FP8Linear`` in for every quantized Linear, MoE experts included (those without
    an input_scale: weight-only).

    model: built on the meta device, not yet allocated. header: checkpoint name -> tensor, with
    meta tensors for weights (dtype and shape) and the scales' values.
    """
    for name, module in model.named_modules():
        weight = header.get(f"{name}.weight")  # the vocab-parallel modules: no FP8 form (nor vLLM's)
        if isinstance(module, VocabParallelEmbedding | ParallelLMHead) and getattr(weight, "dtype", None) == FP8_DTYPE:
            raise QuantizationError(f"checkpoint tensor {name}.weight is {FP8_DTYPE}: under tensor parallelism {name} "
                                    "is split by vocabulary rows in 16-bit only; load this checkpoint with "
                                    f"tensor_parallel_size 1, or keep {name} out of FP8 (exclude_modules)")
    linears, attentions = quantizable_modules(model)
    found = check_quantized_tensors(header, quant, linears, attentions)
    quantized = set(found.linears)
    check_expert_kinds(model, quantized, quant.source)
    for name, moe in _moe_layers(model):
        if _shared_expert_apart(name, moe, quantized):
            moe.num_folded = 0  # not folded into the grouped GEMM: it runs as its own MLP
    experts = {m for routed in _routed_experts(model).values() for m in routed}
    experts |= {m for name, moe in _moe_layers(model) for m in _expert_modules(name, moe)[1]}
    for module in found.linears:
        _swap_in(model, module, found.static_activations and module not in experts)
    for attention, scales in found.kv_cache.items():  # read once here: the kernels take them as numbers
        model.get_submodule(attention).kv_scales = (float(scales.k_scale), float(scales.v_scale))
    return FP8Plan(found)


def keep_row_scales_(model: nn.Module) -> None:
    """Once every ``weight_scale`` is final (loaded, and folded by ``prepare_weights_``): each
    ``FP8Linear`` that scales its activations per call keeps its row-wise weight scale
    (``FP8Linear.keep_row_scale_``), so the GEMM path does not rebuild it per call. The routed
    experts are left out: the fused MoE kernel reads their stacked scales instead."""
    routed = {id(model.get_submodule(m)) for names in _routed_experts(model).values() for m in names}
    for module in model.modules():
        if isinstance(module, FP8Linear) and module.input_scale is None and id(module) not in routed:
            module.keep_row_scale_()


def _swap_in(model: nn.Module, module: str, static_input_scale: bool) -> tuple[nn.Linear, FP8Linear]:
    """Puts an FP8Linear of the Linear ``module``'s shape in its place, with the Linear's forward
    hooks (tensor parallelism's all-reduce after a row-parallel projection such as an attention's
    o_proj: ``models/sharding.py`` registers it on the Linear before this swap); returns (the
    Linear, the FP8Linear)."""
    parent_name, _, child = module.rpartition(".")
    parent = model.get_submodule(parent_name)
    linear = getattr(parent, child)
    fp8 = FP8Linear.replacing(linear, static_input_scale)
    for hook_id, hook in linear._forward_hooks.items():
        fp8.register_forward_hook(hook, with_kwargs=hook_id in linear._forward_hooks_with_kwargs,
                                  always_call=hook_id in linear._forward_hooks_always_called)
    setattr(parent, child, fp8)
    return linear, fp8


@torch.no_grad()
def quantize_model_fp8(model: nn.Module, quant: QuantConfig) -> list[str]:
    """In memory, what ``replayserve quantize`` and loading its output do to a loaded 16/32-bit
    model: every Linear ``quant`` does not exclude, MoE experts included, becomes an FP8Linear
    holding ``quantize_fp8_per_tensor`` of its weight, with no input_scale (activations scaled per
    call; the experts' kernel keeps them 16-bit). Each 16-bit weight is freed as its FP8 copy is
    made, a Nemotron-H MoE layer's expert stack once its last expert is done (the layer is then
    restacked in FP8), so the peak is the 16-bit model plus one layer; the Qwen MoEs' 16-bit stacks
    go at the end, when their FP8 experts are stacked. For benchmarks on random weights.
    Returns the names of the modules quantized."""
    linears, _ = quantizable_modules(model)
    chosen = [m for m in linears if not quant.is_excluded(m)]
    layers, chosen_set = _moe_layers(model), set(chosen)
    for name, moe in layers:
        routed, shared = _expert_modules(name, moe)
        kinds = {m in chosen_set for m in routed + shared}
        if len(kinds) != 1:
            raise QuantizationError(f"{quant.source} quantizes some of {name}'s experts and not others; in memory "
                                    "a MoE layer's routed and shared experts are quantized together or not at all")
    check_expert_kinds(model, chosen_set, quant.source)
    last_expert = {max(i for i, m in enumerate(chosen) if m.startswith(_under(name))): moe for name, moe in layers
                   if any(m.startswith(_under(name)) for m in chosen)}
    for i, module in enumerate(chosen):
        linear, fp8 = _swap_in(model, module, static_input_scale=False)
        weight, scale = quantize_fp8_per_tensor(linear.weight)
        fp8.weight.copy_(weight)
        fp8.weight_scale.copy_(scale)
        if linear.bias is not None:
            fp8.bias.data = linear.bias.data
        del linear  # an expert's weight is a view of the 16-bit stack: drop it before restacking
        if i in last_expert:  # the FP8 experts become views of FP8 stacks; the 16-bit stack goes
            last_expert[i].stacked_experts()
    for block in model.modules():
        if isinstance(block, SparseMoeBlock):  # restacked in FP8: gate and up requantized to one scale
            block.stack_projections_()
    keep_row_scales_(model)
    return chosen
