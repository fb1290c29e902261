"""ModelOpt quantization configs (hf_quant_config.json, config.json quantization_config) and the
checks of a quantized checkpoint's tensors, each error naming the key or the tensor."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from replayserve.models.quantization import (
    QuantConfig,
    QuantizationError,
    check_quantized_tensors,
    parse_quant_config,
    read_quant_config,
)
from replayserve.models.quantization import logger as quantization_logger
from replayserve.ops.fp8 import FP8_DTYPE

FP8_FILE = {"producer": {"name": "modelopt", "version": "0.47.0"},
            "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
                             "exclude_modules": ["lm_head", "backbone.layers.1*", "*.conv1d"]}}
CONFIG_SECTION = {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["lm_head"],
                  "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"},
                  "config_groups": {"group_0": {"targets": ["Linear"]}}}


def write(model_dir: Path, quant: dict | None = None, section: dict | None = None) -> Path:
    model_dir.mkdir(parents=True, exist_ok=True)
    config: dict = {"model_type": "nemotron_h"}
    if section is not None:
        config["quantization_config"] = section
    (model_dir / "config.json").write_text(json.dumps(config))
    if quant is not None:
        (model_dir / "hf_quant_config.json").write_text(json.dumps(quant))
    return model_dir


def test_hf_quant_config_json_is_read(tmp_path: Path) -> None:
    quant = read_quant_config(write(tmp_path, FP8_FILE))
    assert quant is not None and quant.quant_algo == "FP8" and quant.kv_cache_quant_algo == "FP8"
    assert quant.exclude_modules == ("lm_head", "backbone.layers.1*", "*.conv1d")
    assert quant.source.endswith("hf_quant_config.json")


def test_config_json_quantization_config_is_read_in_both_forms(tmp_path: Path) -> None:
    flat = read_quant_config(write(tmp_path / "flat", section=CONFIG_SECTION))
    assert flat == QuantConfig("FP8", "FP8", ("lm_head",), flat.source) and "quantization_config" in flat.source
    nested = read_quant_config(write(tmp_path / "nested", section={"quant_method": "modelopt", **FP8_FILE}))
    assert nested is not None and nested.exclude_modules == tuple(FP8_FILE["quantization"]["exclude_modules"])
    no_kv = read_quant_config(write(tmp_path / "no_kv", section={**CONFIG_SECTION, "kv_cache_scheme": None}))
    assert no_kv is not None and no_kv.kv_cache_quant_algo is None
    lower = parse_quant_config({"quantization": {"quant_algo": "fp8", "kv_cache_quant_algo": None}}, "x")
    assert lower.quant_algo == "FP8" and lower.kv_cache_quant_algo is None and lower.exclude_modules == ()


def test_an_unquantized_checkpoint_has_no_config(tmp_path: Path) -> None:
    assert read_quant_config(write(tmp_path)) is None


@pytest.mark.parametrize(("quant", "section", "match"), [
    ({"quantization": {"quant_algo": "NVFP4"}}, None,
     r"hf_quant_config.json: quantization.quant_algo is 'NVFP4' \(a ModelOpt format .* not load yet\); supported"),
    ({"quantization": {"quant_algo": "INT3"}}, None, r"quantization.quant_algo is 'INT3'; supported: \['FP8'\]"),
    ({"quantization": {}}, None, r"quantization.quant_algo must be one of \['FP8'\], got None"),
    ({"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "INT8"}}, None,
     "quantization.kv_cache_quant_algo is 'INT8'"),
    ({"quantization": {"quant_algo": "FP8", "exclude_modules": "lm_head"}}, None,
     "exclude_modules must be a list of module-name patterns"),
    ({"quantization": ["FP8"]}, None, "quantization must be an object"),
    (None, {"quant_method": "fp8", "activation_scheme": "dynamic"}, "quant_method is 'fp8'; .* ModelOpt"),
    (None, {"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4"}, "quantization_config: quant_algo is"),
    (None, {**CONFIG_SECTION, "kv_cache_scheme": {"type": "int", "num_bits": 8}}, "kv_cache_scheme .* not supported"),
    (None, ["modelopt"], "quantization_config must be an object"),
    ({"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None}}, CONFIG_SECTION,
     "kv_cache_quant_algo None.*kv_cache_quant_algo FP8.*disagree"),
])
def test_bad_configs_fail_naming_the_key(tmp_path: Path, quant: dict | None, section: dict | None, match: str) -> None:
    with pytest.raises(QuantizationError, match=match):
        read_quant_config(write(tmp_path, quant, section))


def test_bad_json_fails_naming_the_file(tmp_path: Path) -> None:
    write(tmp_path)
    (tmp_path / "hf_quant_config.json").write_text("{not json")
    with pytest.raises(QuantizationError, match="hf_quant_config.json is not valid JSON"):
        read_quant_config(tmp_path)


def test_exclude_patterns_follow_modelopt_and_vllm() -> None:
    quant = parse_quant_config(FP8_FILE, "x")
    assert quant.excluding_pattern("lm_head") == "lm_head"
    assert quant.is_excluded("backbone.layers.0.mixer.conv1d")  # *.conv1d
    assert quant.excluding_pattern("backbone.layers.1") == "backbone.layers.1*"  # the module itself
    assert quant.is_excluded("backbone.layers.1.mixer.q_proj")  # and its subtree
    assert not quant.is_excluded("backbone.layers.10.mixer.q_proj")  # "path*" is a subtree, not a prefix
    assert not quant.is_excluded("backbone.layers.0.mixer.in_proj")
    assert not quant.is_excluded("lm_head_extra")
    in_memory = parse_quant_config({"quantization": {"quant_algo": "FP8", "exclude_modules": ["model.layers.2.*"]}},
                                   "x")
    assert in_memory.is_excluded("backbone.layers.2.mixer.up_proj")  # transformers' `model.` spelling
    assert not in_memory.is_excluded("backbone.layers.3.mixer.up_proj")


def test_modelopts_mangled_sentinel_is_cut_off(caplog: pytest.LogCaptureFixture,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # The module's own level and switch, so that what earlier tests did to the root logger (in the
    # full suite something raised its level) cannot hide the warning.
    caplog.set_level(logging.WARNING, logger=quantization_logger.name)
    monkeypatch.setattr(quantization_logger, "disabled", False)
    raw = {"quantization": {"quant_algo": "FP8", "exclude_modules": [
        "lm_head.\x00backbone.pt_name_sentinel", "backbone.layers.4.mixer.gate.\x00backbone.pt_name_sentinel",
        "backbone.layers.1.mixer*"]}}
    quant = parse_quant_config(raw, "hf_quant_config.json")
    assert quant.exclude_modules == ("lm_head", "backbone.layers.4.mixer.gate", "backbone.layers.1.mixer*")
    assert "mangled name sentinel" in caplog.text


# Tensors of a model with one Mamba projection pair, one attention layer and an LM head.
LINEARS = ["backbone.layers.0.mixer.in_proj", "backbone.layers.0.mixer.out_proj", "backbone.layers.1.mixer.q_proj",
           "backbone.layers.1.mixer.k_proj", "lm_head"]
ATTENTIONS = ["backbone.layers.1.mixer"]
QUANT = QuantConfig("FP8", "FP8", ("lm_head",), "hf_quant_config.json")


def quantized_state(input_scales: bool = True) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {"lm_head.weight": torch.zeros(8, 4, dtype=torch.bfloat16)}
    for i, module in enumerate(LINEARS[:-1]):
        state[f"{module}.weight"] = torch.zeros(8, 4, dtype=FP8_DTYPE)
        state[f"{module}.weight_scale"] = torch.tensor(0.5 + i)
        if input_scales:
            state[f"{module}.input_scale"] = torch.tensor(0.25)
    state["backbone.layers.1.mixer.k_proj.k_scale"] = torch.tensor(0.125)
    state["backbone.layers.1.mixer.v_proj.v_scale"] = torch.tensor(0.0625)
    return state


def test_a_well_formed_checkpoint_gives_its_scales() -> None:
    found = check_quantized_tensors(quantized_state(), QUANT, LINEARS, ATTENTIONS)
    assert sorted(found.linears) == sorted(LINEARS[:-1]) and found.static_activations
    assert found.linears["backbone.layers.0.mixer.out_proj"].weight_scale == 1.5
    assert all(s.weight_scale.dim() == 0 and s.weight_scale.dtype == torch.float32 for s in found.linears.values())
    kv = found.kv_cache["backbone.layers.1.mixer"]
    assert (kv.k_scale, kv.v_scale) == (0.125, 0.0625)
    assert "backbone.layers.1.mixer.k_proj.k_scale" in found.scale_names and len(found.scale_names) == 10


def test_without_input_scales_activations_are_dynamic_and_one_element_scales_pass() -> None:
    state = quantized_state(input_scales=False)
    state["backbone.layers.0.mixer.in_proj.weight_scale"] = torch.tensor([0.5])
    found = check_quantized_tensors(state, QUANT, LINEARS, ATTENTIONS)
    assert not found.static_activations and all(s.input_scale is None for s in found.linears.values())
    assert found.linears["backbone.layers.0.mixer.in_proj"].weight_scale.shape == ()


def test_kv_scales_are_optional_without_kv_quantization_and_read_in_every_spelling() -> None:
    no_kv = QuantConfig("FP8", None, ("lm_head",), "x")
    state = quantized_state()
    del state["backbone.layers.1.mixer.k_proj.k_scale"], state["backbone.layers.1.mixer.v_proj.v_scale"]
    assert check_quantized_tensors(state, no_kv, LINEARS, ATTENTIONS).kv_cache == {}
    state["backbone.layers.1.mixer.k_scale"] = torch.tensor(2.0)
    state["backbone.layers.1.mixer.v_scale"] = torch.tensor(3.0)
    kv = check_quantized_tensors(state, no_kv, LINEARS, ATTENTIONS).kv_cache["backbone.layers.1.mixer"]
    assert (kv.k_scale, kv.v_scale) == (2.0, 3.0)
    del state["backbone.layers.1.mixer.k_scale"], state["backbone.layers.1.mixer.v_scale"]
    state["backbone.layers.1.mixer.kv_scale"] = torch.tensor(4.0)  # deprecated: one scale for both
    kv = check_quantized_tensors(state, QUANT, LINEARS, ATTENTIONS).kv_cache["backbone.layers.1.mixer"]
    assert (kv.k_scale, kv.v_scale) == (4.0, 4.0)


def _set(name: str, value: torch.Tensor | None):  # noqa: ANN202 - a test-table helper
    def edit(state: dict[str, torch.Tensor]) -> None:
        if value is None:
            del state[name]
        else:
            state[name] = value
    return edit


IN_PROJ = "backbone.layers.0.mixer.in_proj"


@pytest.mark.parametrize(("edit", "match"), [
    (_set(f"{IN_PROJ}.weight_scale", None), f"missing tensor {IN_PROJ}.weight_scale"),
    (_set(f"{IN_PROJ}.weight_scale", torch.ones(2)), rf"tensor {IN_PROJ}.weight_scale has shape \(2,\)"),
    (_set(f"{IN_PROJ}.weight_scale", torch.ones(1, 1)), rf"{IN_PROJ}.weight_scale has shape \(1, 1\)"),
    (_set(f"{IN_PROJ}.weight_scale", torch.tensor(-1.0)), f"{IN_PROJ}.weight_scale is -1.0; .* finite and positive"),
    (_set(f"{IN_PROJ}.weight_scale", torch.tensor(float("nan"))), f"{IN_PROJ}.weight_scale is nan"),
    (_set(f"{IN_PROJ}.weight_scale", torch.tensor(1, dtype=torch.int32)), f"{IN_PROJ}.weight_scale has dtype"),
    (_set(f"{IN_PROJ}.input_scale", None), f"missing tensor {IN_PROJ}.input_scale: other FP8 Linears"),
    (_set(f"{IN_PROJ}.input_scale", torch.ones(3)), rf"{IN_PROJ}.input_scale has shape \(3,\)"),
    (_set(f"{IN_PROJ}.weight", torch.zeros(8, 4, dtype=torch.bfloat16)), f"{IN_PROJ}.weight has dtype torch.bfloat16"),
    (_set("lm_head.weight_scale", torch.tensor(1.0)), r"lm_head.weight_scale quantizes module lm_head.*'lm_head'"),
    (_set("lm_head.weight", torch.zeros(8, 4, dtype=FP8_DTYPE)), "tensor lm_head.weight quantizes module lm_head"),
    (_set("backbone.layers.1.mixer.v_proj.v_scale", None), "missing tensor backbone.layers.1.mixer.v_proj.v_scale"),
    (_set("backbone.layers.1.mixer.k_proj.k_scale", torch.ones(4)), r"k_proj.k_scale has shape \(4,\)"),
    (_set("backbone.layers.1.mixer.k_scale", torch.tensor(1.0)), "k scale more than once"),
    (_set("backbone.layers.2.mixer.up_proj.weight_scale", torch.tensor(1.0)),
     r"\['backbone.layers.2.mixer.up_proj.weight_scale'\] are scales of modules"),
])
def test_bad_tensors_fail_naming_the_tensor(edit, match: str) -> None:  # noqa: ANN001
    state = quantized_state()
    edit(state)
    with pytest.raises(QuantizationError, match=match):
        check_quantized_tensors(state, QUANT, LINEARS, ATTENTIONS)


def test_a_kv_scale_alone_needs_its_partner_even_without_kv_quantization() -> None:
    state = quantized_state()
    del state["backbone.layers.1.mixer.v_proj.v_scale"]
    with pytest.raises(QuantizationError, match="v_proj.v_scale .*its k scale is stored"):
        check_quantized_tensors(state, QuantConfig("FP8", None, ("lm_head",), "x"), LINEARS, ATTENTIONS)


def test_meta_tensors_are_enough_for_the_layout() -> None:
    state = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in quantized_state().items()}
    found = check_quantized_tensors(state, QUANT, LINEARS, ATTENTIONS)
    assert len(found.linears) == 4 and found.static_activations
