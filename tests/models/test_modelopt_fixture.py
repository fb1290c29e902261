"""The checkpoint NVIDIA ModelOpt 0.47.0 itself exported (scripts/make_modelopt_fp8_fixture.py:
FP8 weights and activations, FP8 KV cache, tiny Nemotron-H, on the CPU) reads as this package
expects: its config, its tensor layout against our model's modules, and its numbers against our
FP8 references and the bf16 model it was made from (fixtures/modelopt_fp8/bf16)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from replayserve.config import ModelConfig
from replayserve.models.nemotron_h import NemotronHForCausalLM
from replayserve.models.quantization import check_quantized_tensors, quantizable_modules, read_quant_config
from replayserve.ops.fp8 import FP8_DTYPE, quantize_fp8_per_tensor

FIXTURE = Path(__file__).parent / "fixtures" / "modelopt_fp8"


@pytest.fixture(scope="module")
def tensors() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURE / "model.safetensors"))


@pytest.fixture(scope="module")
def model() -> NemotronHForCausalLM:
    """Our model for the fixture's config, on the meta device (its quantization_config set aside:
    ModelConfig does not read it)."""
    raw = json.loads((FIXTURE / "config.json").read_text())
    raw.pop("quantization_config")
    with torch.device("meta"):
        return NemotronHForCausalLM(ModelConfig.from_hf_dict(raw))


def test_the_config_is_fp8_with_an_fp8_kv_cache_and_modelopts_default_exclusions() -> None:
    quant = read_quant_config(FIXTURE)
    assert quant is not None and (quant.quant_algo, quant.kv_cache_quant_algo) == ("FP8", "FP8")
    assert set(quant.exclude_modules) == {"lm_head", "backbone.embeddings", "backbone.layers.0.mixer.conv1d",
                                          "backbone.layers.3.mixer.conv1d", "backbone.layers.4.mixer.gate"}


def test_every_projection_but_the_lm_head_is_fp8_and_the_rest_is_our_models_parameters(
        tensors: dict[str, torch.Tensor], model: NemotronHForCausalLM) -> None:
    quant = read_quant_config(FIXTURE)
    assert quant is not None
    linears, attentions = quantizable_modules(model)
    found = check_quantized_tensors(tensors, quant, linears, attentions)
    assert sorted(found.linears) == sorted(m for m in linears if m != "lm_head") and len(found.linears) == 20
    assert found.static_activations and list(found.kv_cache) == ["backbone.layers.1.mixer"]
    # What a loader must place: every tensor that is not a scale is one of our parameters, by name.
    assert set(tensors) - found.scale_names == set(model.state_dict())
    assert tensors["lm_head.weight"].dtype == tensors["backbone.layers.4.mixer.gate.weight"].dtype == torch.bfloat16


def test_the_scales_are_modelopts_amax_over_448(tensors: dict[str, torch.Tensor]) -> None:
    """Each weight's largest code is 448 (weight_scale = amax / 448), and the projections that read
    the same input share one input_scale: ModelOpt unifies q/k/v's, and the fused experts have one
    input quantizer per projection kind."""
    for name, t in tensors.items():
        if t.dtype == FP8_DTYPE:
            assert t.float().abs().max() == 448.0, name
    attn = "backbone.layers.1.mixer"
    assert tensors[f"{attn}.q_proj.input_scale"] == tensors[f"{attn}.k_proj.input_scale"] == \
        tensors[f"{attn}.v_proj.input_scale"]
    for kind in ("up_proj", "down_proj"):
        scales = {float(tensors[f"backbone.layers.4.mixer.experts.{e}.{kind}.input_scale"]) for e in range(4)}
        assert len(scales) == 1
    for name in (f"{attn}.k_proj.k_scale", f"{attn}.v_proj.v_scale"):
        assert tensors[name].shape == () and tensors[name].dtype == torch.float32 and 0 < float(tensors[name]) < 1


def test_our_quantizer_gives_modelopts_scales_and_codes_up_to_its_double_rounding(
        tensors: dict[str, torch.Tensor]) -> None:
    """``quantize_fp8_per_tensor`` of the bf16 source reproduces every weight_scale bit for bit.
    The codes differ only where ModelOpt's quotient, which it rounds to bf16 before FP8, lands
    exactly on the midpoint of two FP8 values (ties then go to even; we round the exact quotient):
    one FP8 step, on a few percent of the weights."""
    source = load_file(str(FIXTURE / "bf16" / "model.safetensors"))
    differing = total = 0
    for name, stored in tensors.items():
        if stored.dtype != FP8_DTYPE:
            continue
        codes, scale = quantize_fp8_per_tensor(source[name])
        assert torch.equal(scale, tensors[f"{name}_scale"]), name
        apart = codes.view(torch.uint8) != stored.view(torch.uint8)
        modelopt_quotient = (source[name] / scale).float()[apart]  # bf16 / 0-dim float32 stays bf16
        lower, upper = torch.minimum(codes.float(), stored.float())[apart], torch.maximum(codes.float(),
                                                                                          stored.float())[apart]
        assert torch.equal(modelopt_quotient, (lower + upper) / 2), name  # exactly on a midpoint
        neighbours = lower.to(FP8_DTYPE).view(torch.uint8).int() - upper.to(FP8_DTYPE).view(torch.uint8).int()
        assert (neighbours.abs() == 1).all(), name  # adjacent codes: one FP8 step apart
        differing += int(apart.sum())
        total += stored.numel()
    assert 0 < differing < 0.06 * total
