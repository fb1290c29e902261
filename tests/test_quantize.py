"""``python -m replayserve.quantize``: a bf16 checkpoint becomes ModelOpt's FP8 layout, as the real
ModelOpt export of the same bf16 model has it (tests/models/fixtures/modelopt_fp8)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from replayserve.builtin.tiny import make_tiny, tiny_config
from replayserve.config import ModelConfig
from replayserve.models.loader import load_model
from replayserve.models.nemotron_h import NemotronHForCausalLM
from replayserve.models.quantization import (
    QuantizationError,
    check_quantized_tensors,
    quantizable_modules,
    read_quant_config,
)
from replayserve.models.writer import save_model
from replayserve.ops.fp8 import FP8_DTYPE, quantize_fp8_per_tensor
from replayserve.quantize import main, nemotron_h_default_excludes, quantize_checkpoint

FIXTURE = Path(__file__).parent / "models" / "fixtures" / "modelopt_fp8"


def stored(model_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Mamba / attention / MLP / Mamba / MoE model in bf16, in three shards, with a tokenizer."""
    tiny = make_tiny(tmp_path_factory.mktemp("tiny"), seed=3, layers="M*-ME")
    out = tmp_path_factory.mktemp("bf16")
    save_model(load_model(tiny, torch.float32, torch.device("cpu")), out, torch.bfloat16, max_shard_bytes=60_000)
    (out / "tokenizer.json").write_bytes((tiny / "tokenizer.json").read_bytes())
    return out


def meta_model(model_dir: Path) -> NemotronHForCausalLM:
    raw = json.loads((model_dir / "config.json").read_text())
    raw.pop("quantization_config", None)
    with torch.device("meta"):
        return NemotronHForCausalLM(ModelConfig.from_hf_dict(raw))


def test_default_excludes_keep_attention_and_the_mamba_layer_before_it() -> None:
    cfg = tiny_config("*M*-M*E")
    patterns = nemotron_h_default_excludes(cfg)
    layers = {p for p in patterns if p.startswith("backbone.layers.")}
    # attention at 0 (nothing before it), 2 (after Mamba 1), 5 (after Mamba 4); the MLP at 3 is no Mamba
    assert layers == {f"backbone.layers.{i}.mixer*" for i in (0, 1, 2, 4, 5)}
    assert {"lm_head", "mtp.*"} <= set(patterns)


def test_a_bf16_checkpoint_becomes_fp8_with_the_recipes_exclusions(bf16_dir: Path, tmp_path: Path) -> None:
    main([str(bf16_dir), str(tmp_path / "fp8")])
    out = tmp_path / "fp8"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "hf_quant_config.json", "model.safetensors",
                                                      "tokenizer.json"]
    quant = read_quant_config(out)
    assert quant is not None and (quant.quant_algo, quant.kv_cache_quant_algo) == ("FP8", None)
    attention, mamba_before = "backbone.layers.1.mixer", "backbone.layers.0.mixer"
    assert set(quant.exclude_modules) == {
        "lm_head", "backbone.embeddings", f"{mamba_before}.conv1d", "backbone.layers.3.mixer.conv1d",
        "backbone.layers.4.mixer.gate", f"{mamba_before}.in_proj", f"{mamba_before}.out_proj",
        *(f"{attention}.{p}_proj" for p in "qkvo")}
    model = meta_model(out)
    linears, attentions = quantizable_modules(model)
    tensors = stored(out)
    found = check_quantized_tensors(tensors, quant, linears, attentions)
    assert sorted(found.linears) == sorted(
        ["backbone.layers.2.mixer.up_proj", "backbone.layers.2.mixer.down_proj", "backbone.layers.3.mixer.in_proj",
         "backbone.layers.3.mixer.out_proj", "backbone.layers.4.mixer.shared_experts.up_proj",
         "backbone.layers.4.mixer.shared_experts.down_proj",
         *(f"backbone.layers.4.mixer.experts.{e}.{p}" for e in range(4) for p in ("up_proj", "down_proj"))])
    assert not found.static_activations and found.kv_cache == {}
    assert set(tensors) - found.scale_names == set(model.state_dict())
    source = stored(bf16_dir)
    for name, tensor in tensors.items():
        if name in found.scale_names:
            continue
        if tensor.dtype == FP8_DTYPE:
            codes, scale = quantize_fp8_per_tensor(source[name])
            assert torch.equal(tensor.view(torch.uint8), codes.view(torch.uint8)), name
            assert torch.equal(tensors[name + "_scale"], scale)
        else:
            assert tensor.dtype == source[name].dtype and torch.equal(tensor, source[name]), name
    section = json.loads((out / "config.json").read_text())["quantization_config"]
    assert section["config_groups"]["group_0"]["input_activations"]["dynamic"] is True
    assert section["quant_method"] == "modelopt" and sorted(section["ignore"]) == sorted(quant.exclude_modules)


def test_the_layout_is_modelopts_own(tmp_path: Path) -> None:
    """The ModelOpt export's bf16 source, quantized here with ModelOpt's exclusions, gives the same
    tensors (names, dtypes, shapes, weight scales bit for bit) minus the calibrated scales, and the
    same configs but for the producer and the activations' dynamic flag."""
    modelopt = read_quant_config(FIXTURE)
    assert modelopt is not None
    ours_dir = tmp_path / "ours"
    quantize_checkpoint(FIXTURE / "bf16", ours_dir, exclude=modelopt.exclude_modules)
    ours, theirs = stored(ours_dir), stored(FIXTURE)
    calibrated = {n for n in theirs if n.endswith((".input_scale", ".k_scale", ".v_scale"))}
    assert set(ours) == set(theirs) - calibrated
    for name, tensor in ours.items():
        assert (tensor.dtype, tensor.shape) == (theirs[name].dtype, theirs[name].shape), name
        if name.endswith("weight_scale"):
            assert torch.equal(tensor, theirs[name]), name
    ours_quant = json.loads((ours_dir / "hf_quant_config.json").read_text())
    theirs_quant = json.loads((FIXTURE / "hf_quant_config.json").read_text())
    assert ours_quant.keys() == theirs_quant.keys() and ours_quant["quantization"].keys() == \
        theirs_quant["quantization"].keys()
    assert set(read_quant_config(ours_dir).exclude_modules) == set(modelopt.exclude_modules)
    ours_section = json.loads((ours_dir / "config.json").read_text())["quantization_config"]
    theirs_section = json.loads((FIXTURE / "config.json").read_text())["quantization_config"]
    assert ours_section.keys() == theirs_section.keys() - {"kv_cache_scheme"}
    ours_section["config_groups"]["group_0"]["input_activations"]["dynamic"] = False
    assert ours_section["config_groups"] == theirs_section["config_groups"]


def test_refusals_name_what_to_change(bf16_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(QuantizationError, match=r"--exclude \['backbone.layers.9.\*'\] name no module"):
        quantize_checkpoint(bf16_dir, tmp_path / "a", exclude=["lm_head", "backbone.layers.9.*"])
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("")
    with pytest.raises(FileExistsError, match="not empty"):
        quantize_checkpoint(bf16_dir, busy)
    with pytest.raises(QuantizationError, match="already a quantized checkpoint"):
        quantize_checkpoint(FIXTURE, tmp_path / "b")
    with pytest.raises(SystemExit, match="error: .*already a quantized"):
        main([str(FIXTURE), str(tmp_path / "c")])


def test_the_written_checkpoint_loads_as_fp8_with_dynamic_activations(bf16_dir: Path, tmp_path: Path) -> None:
    from replayserve.layers.fp8_linear import FP8Linear

    quantize_checkpoint(bf16_dir, tmp_path / "fp8")
    model = load_model(tmp_path / "fp8", torch.float32, torch.device("cpu"))
    fp8 = [m for m in model.modules() if isinstance(m, FP8Linear)]
    assert fp8 and all(m.weight.dtype == FP8_DTYPE and m.input_scale is None for m in fp8)
    source = load_model(bf16_dir, torch.float32, torch.device("cpu"))
    x = torch.randn(3, model.config.hidden_size)
    mlp = model.backbone.layers[2].mixer.up_proj  # M*-ME: layer 2 is the MLP, quantized by the recipe
    assert isinstance(mlp, FP8Linear)
    want = source.backbone.layers[2].mixer.up_proj(x)
    assert ((mlp(x) - want).abs().max() / want.abs().max()).item() < 0.07  # e4m3's 3 mantissa bits
    moe = model.backbone.layers[4].mixer  # the MoE's experts load FP8: one FP8 stack, per-expert scales
    assert all(isinstance(m.up_proj, FP8Linear) for m in moe.experts) and moe.stacked_experts()[0].dtype == FP8_DTYPE
    want = source.backbone.layers[4].mixer(x)
    assert ((moe(x) - want).abs().max() / want.abs().max()).item() < 0.1


def test_other_families_are_refused_naming_theirs(tmp_path: Path) -> None:
    src = make_tiny(tmp_path / "granite", family="granite", layers="M*")
    with pytest.raises(QuantizationError, match="granitemoehybrid checkpoint; quantize writes Nemotron-H"):
        quantize_checkpoint(src, tmp_path / "out")
