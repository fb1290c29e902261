"""FP8Linear: a model cast to a 16-bit dtype keeps its FP8 codes and float32 scales (nn.Module.to
would cast float8 too), moves them with the model, and computes fp8_linear_ref."""

from __future__ import annotations

import torch
from torch import nn

from replayserve.layers.fp8_linear import FP8Linear
from replayserve.ops.fp8 import FP8_DTYPE, fp8_linear_ref, quantize_fp8_per_tensor


def filled(static: bool) -> FP8Linear:
    layer = FP8Linear(12, 6, bias=True, static_input_scale=static)
    gen = torch.Generator().manual_seed(3)
    weight, scale = quantize_fp8_per_tensor(torch.randn(6, 12, generator=gen))
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.weight_scale.copy_(scale)
        layer.bias.copy_(torch.randn(6, generator=gen))
        if static:
            layer.input_scale.fill_(0.0123456789)
    return layer


def test_a_dtype_cast_changes_the_bias_only() -> None:
    layer = filled(static=True)
    codes, scale, input_scale = layer.weight.clone(), layer.weight_scale.clone(), layer.input_scale.clone()
    nn.Sequential(layer).to(torch.bfloat16)
    assert layer.weight.dtype == FP8_DTYPE and torch.equal(layer.weight.view(torch.uint8), codes.view(torch.uint8))
    assert layer.weight_scale.dtype == layer.input_scale.dtype == torch.float32
    assert torch.equal(layer.weight_scale, scale) and torch.equal(layer.input_scale, input_scale)
    assert layer.bias.dtype == torch.bfloat16


def test_an_allocation_on_a_device_keeps_every_dtype() -> None:
    with torch.device("meta"):
        layer = FP8Linear(12, 6, bias=False, static_input_scale=False)
    layer.to_empty(device="cpu")
    assert layer.weight.device.type == "cpu" and layer.weight.dtype == FP8_DTYPE
    assert layer.input_scale is None and layer.weight_scale.dtype == torch.float32


def test_the_forward_is_the_reference_with_the_static_input_scale() -> None:
    layer = filled(static=True)
    x = torch.randn(4, 12, dtype=torch.float64)
    want = fp8_linear_ref(x, layer.weight, layer.weight_scale, layer.input_scale, layer.bias)
    torch.testing.assert_close(layer(x), want, rtol=0, atol=0)
    assert "static_input_scale=True" in repr(layer)


def test_the_kept_row_scale_is_the_weight_scale_and_survives_a_dtype_cast() -> None:
    layer = filled(static=False)
    assert layer.weight_scale_rows is None and "weight_scale_rows" not in layer.state_dict()
    layer.keep_row_scale_()
    nn.Sequential(layer).to(torch.bfloat16)
    rows = layer.weight_scale_rows
    assert rows is not None and rows.dtype == torch.float32 and rows.shape == (1, 6) and rows.is_contiguous()
    assert torch.equal(rows, layer.weight_scale.expand(1, 6))
    assert "weight_scale_rows" not in layer.state_dict()  # not a checkpoint tensor
