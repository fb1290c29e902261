"""``python -m replayserve.quantize``: a bf16 checkpoint becomes ModelOpt's FP8 layout, as the real
ModelOpt export of the same bf16 model has it (tests/models/fixtures/modelopt_fp8); a tiny
checkpoint of every other family becomes FP8 in its own names, with ModelOpt's default exclusions,
and loads back FP8 where expected, its logits those of its dequantized weights (the greedy agreement
with the 32-bit source is printed: run with -s)."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from replayserve import LLM, SamplingParams
from replayserve.builtin.tiny import make_tiny, tiny_config
from replayserve.config import ModelConfig
from replayserve.layers.fp8_linear import FP8Linear
from replayserve.layers.qwen_moe import SparseMoeBlock
from replayserve.models.loader import load_model
from replayserve.models.nemotron_h import NemotronHForCausalLM
from replayserve.models.quantization import (
    QuantizationError,
    check_quantized_tensors,
    quantizable_modules,
    read_quant_config,
)
from replayserve.models.writer import save_model
from replayserve.ops.fp8 import FP8_DTYPE, dequantize_fp8, quantize_fp8_per_tensor, requantize_to_max_scale
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


# Each family's modules kept 16-bit by default, in the checkpoint's names (layer index N): ModelOpt's
# default recipe (LM head, routers, Qwen's shared-expert gate), the non-Linears that hold weights
# (embeddings, conv1d, Granite's 3-D expert stacks), and Falcon-H1's in_proj (per-row multipliers).
KEPT = {
    "granite": {"model.layers.N.block_sparse_moe.input_linear", "model.layers.N.block_sparse_moe.output_linear",
                "model.layers.N.block_sparse_moe.router.layer", "model.layers.N.mamba.conv1d"},
    "bamba": {"model.layers.N.mamba.conv1d"},
    "falcon_h1": {"model.layers.N.mamba.conv1d", "model.layers.N.mamba.in_proj"},
    "qwen3_next": {"model.layers.N.linear_attn.conv1d", "model.layers.N.mlp.gate",
                   "model.layers.N.mlp.shared_expert_gate"},
    "qwen3_5": {"model.layers.N.linear_attn.conv1d"},
    "qwen3_5_moe": {"model.layers.N.linear_attn.conv1d", "model.layers.N.mlp.gate",
                    "model.layers.N.mlp.shared_expert_gate"},
}
PROMPTS = 24


def hf_name(module: str) -> str:
    """A module's name in these families' checkpoints (transformers' `model.` prefix)."""
    return "model." + module.removeprefix("backbone.") if module.startswith("backbone.") else module


def by_layer(names: Iterable[str]) -> set[str]:
    return {re.sub(r"\.\d+\.", ".N.", n) for n in names}


def prompts(vocab: int) -> list[dict[str, list[int]]]:
    gen = torch.Generator().manual_seed(0)
    return [{"prompt_token_ids": torch.randint(3, vocab, (int(n),), generator=gen).tolist()}
            for n in torch.randint(4, 20, (PROMPTS,), generator=gen)]


def dequantized(fp8_dir: Path, out: Path) -> Path:
    """The FP8 checkpoint as a float32 one without quantization_config: every FP8 weight times its
    scale, each Qwen expert's gate and up first requantized to their larger scale, as the loader
    stacks them (`ops.fp8.requantize_to_max_scale`)."""
    tensors = stored(fp8_dir)
    plain = {n: t for n, t in tensors.items() if not n.endswith("_scale")}
    for name, t in tensors.items():
        if t.dtype == FP8_DTYPE:
            plain[name] = dequantize_fp8(t, tensors[name.removesuffix("weight") + "weight_scale"])
    for gate in [n.removesuffix(".weight") for n in tensors if ".experts." in n and n.endswith("gate_proj.weight")]:
        up = gate.replace("gate_proj", "up_proj")
        codes, scale = requantize_to_max_scale([tensors[f"{gate}.weight"], tensors[f"{up}.weight"]],
                                               [tensors[f"{gate}.weight_scale"], tensors[f"{up}.weight_scale"]])
        plain[f"{gate}.weight"], plain[f"{up}.weight"] = dequantize_fp8(codes, scale).chunk(2)
    out.mkdir()
    save_file(plain, str(out / "model.safetensors"))
    config = json.loads((fp8_dir / "config.json").read_text())
    config.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(config))
    shutil.copy(fp8_dir / "tokenizer.json", out)
    return out


def run(model_dir: Path, max_tokens: int) -> tuple[torch.Tensor, list[list[int]]]:
    """((PROMPTS, vocab) log-probabilities of each prompt's next token, the greedy tokens), float32 on the CPU."""
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    llm = LLM(str(model_dir), dtype="float32", device="cpu", warmup=False)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=vocab, ignore_eos=True)
    outs = llm.generate(prompts(vocab), params, use_tqdm=False)
    rows = torch.empty(len(outs), vocab)
    for i, out in enumerate(outs):
        for token, lp in out.outputs[0].logprobs[0].items():
            rows[i, token] = lp.logprob
    return rows, [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("family", sorted(KEPT))
def test_every_family_quantizes_in_its_own_names_and_loads_back_as_fp8(family: str, tmp_path: Path) -> None:
    src = make_tiny(tmp_path / "src", seed=1, family=family)
    quant = quantize_checkpoint(src, tmp_path / "fp8")
    assert by_layer(quant.exclude_modules) == {"lm_head", "model.embed_tokens", *KEPT[family]}
    source, tensors = stored(src), stored(tmp_path / "fp8")
    fp8 = {n.removesuffix(".weight") for n, t in tensors.items() if t.dtype == FP8_DTYPE}
    assert set(tensors) == set(source) | {f"{m}.weight_scale" for m in fp8}  # the family's names, kept
    for name, tensor in source.items():
        if name.removesuffix(".weight") in fp8:
            codes, scale = quantize_fp8_per_tensor(tensor)
            assert torch.equal(tensors[name].view(torch.uint8), codes.view(torch.uint8)), name
            assert torch.equal(tensors[name.removesuffix("weight") + "weight_scale"], scale), name
        else:
            assert torch.equal(tensors[name], tensor), name

    model = load_model(tmp_path / "fp8", torch.float32, torch.device("cpu"))
    linears = {hf_name(n): m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear | FP8Linear)}
    assert {n for n, m in linears.items() if isinstance(m, FP8Linear) and m.weight.dtype == FP8_DTYPE} == fp8
    kept = {n: m for n, m in linears.items() if n not in fp8}
    assert by_layer(kept) <= {"lm_head", *KEPT[family]} and all(m.weight.dtype == torch.float32 for m in kept.values())
    for block in (m for m in model.modules() if isinstance(m, SparseMoeBlock)):  # every expert FP8: one stack
        assert block.expert_stacks() is not None and block.expert_stacks()[0].dtype == FP8_DTYPE

    ours, ours_tokens = run(tmp_path / "fp8", max_tokens=8)
    ref, _ = run(dequantized(tmp_path / "fp8", tmp_path / "ref"), max_tokens=1)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    wide, wide_tokens = run(src, max_tokens=8)
    first = sum(a[0] == b[0] for a, b in zip(ours_tokens, wide_tokens, strict=True)) / PROMPTS
    same = sum(x == y for a, b in zip(ours_tokens, wide_tokens, strict=True) for x, y in zip(a, b, strict=True))
    print(f"\n{family}: greedy agreement FP8 vs float32 source over {PROMPTS} prompts x 8 tokens: first token "
          f"{first:.0%}, tokens {same / (8 * PROMPTS):.0%}; max |log-prob| gap {(ours - wide).abs().max():.3f}")
    assert first >= 0.3  # deterministic on the CPU; a tiny random model's logits are nearly flat


def test_other_families_take_exclude_in_their_own_names(tmp_path: Path) -> None:
    """`model.` patterns name Granite's layers; Falcon-H1's in_proj stays 16-bit whatever --exclude says."""
    src = make_tiny(tmp_path / "granite", family="granite", layers="M*")
    quant = quantize_checkpoint(src, tmp_path / "out", exclude=["lm_head", "model.layers.1.self_attn*"])
    assert {"model.layers.1.self_attn.q_proj", "model.layers.0.mamba.conv1d"} <= set(quant.exclude_modules)
    assert "model.layers.0.mamba.in_proj" not in quant.exclude_modules
    with pytest.raises(QuantizationError, match=r"\['model.layers.7\*'\] name no module.*'model.layers.0.mamba"):
        quantize_checkpoint(src, tmp_path / "none", exclude=["model.layers.7*"])
    falcon = make_tiny(tmp_path / "falcon", family="falcon_h1", layers="M")
    quant = quantize_checkpoint(falcon, tmp_path / "falcon_fp8", exclude=["lm_head"])
    assert "model.layers.0.mamba.in_proj" in quant.exclude_modules
    assert stored(tmp_path / "falcon_fp8")["model.layers.0.mamba.in_proj.weight"].dtype == torch.float32


def test_a_qwen_blocks_experts_are_quantized_all_or_none(tmp_path: Path) -> None:
    src = make_tiny(tmp_path / "src", family="qwen3_5_moe")
    with pytest.raises(QuantizationError, match=r"quantizes model\.layers\.1\.mlp\.experts\.0\.gate_proj but "
                                                r"not model\.layers\.1\.mlp\.experts\.2\.gate_proj"):
        quantize_checkpoint(src, tmp_path / "half", exclude=["lm_head", "model.layers.1.mlp.experts.2.gate_proj"])
    quant = quantize_checkpoint(src, tmp_path / "none", exclude=["lm_head", "model.layers.1.mlp.experts*"])
    assert "model.layers.1.mlp.experts.3.down_proj" in quant.exclude_modules
    block = load_model(tmp_path / "none", torch.float32, torch.device("cpu")).backbone.layers[1].mlp
    assert block.expert_stacks()[0].dtype == torch.float32 and isinstance(block.shared_expert.up_proj, FP8Linear)


def test_a_multimodal_qwen3_5_keeps_its_names_and_its_vision_tower(tmp_path: Path) -> None:
    """Qwen3_5ForConditionalGeneration's layout (`model.language_model.*`, a vision tower, MTP weights
    its config does not declare): names kept, vision and MTP copied 16-bit and excluded; the language
    model loads FP8, its logits those of the text checkpoint quantized alike."""
    text = make_tiny(tmp_path / "text", family="qwen3_5")
    text_config = json.loads((text / "config.json").read_text())
    src = tmp_path / "multimodal"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({
        "model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text_config,
        "tie_word_embeddings": text_config.get("tie_word_embeddings", False),
        "vision_config": {"model_type": "qwen3_5_vision", "depth": 1}}))
    weights = {("model.language_model." + k.removeprefix("model.") if k.startswith("model.") else k): v
               for k, v in stored(text).items()}
    extra = {"model.visual.blocks.0.attn.qkv.weight": torch.randn(12, 4), "mtp.fc.weight": torch.randn(4, 8)}
    save_file({**weights, **extra}, str(src / "model.safetensors"))
    shutil.copy(text / "tokenizer.json", src)
    quant = quantize_checkpoint(src, tmp_path / "fp8")
    assert {"model.visual*", "mtp.fc", "model.language_model.embed_tokens"} <= set(quant.exclude_modules)
    tensors = stored(tmp_path / "fp8")
    assert all(torch.equal(tensors[n], t) for n, t in extra.items())
    assert tensors["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"].dtype == FP8_DTYPE
    assert read_quant_config(tmp_path / "fp8").is_excluded("backbone.layers.0.linear_attn.conv1d")
    quantize_checkpoint(text, tmp_path / "text_fp8")
    torch.testing.assert_close(run(tmp_path / "fp8", 1)[0], run(tmp_path / "text_fp8", 1)[0], rtol=0, atol=0)


def test_a_tied_lm_head_and_mtp_layers_stay_16_bit(tmp_path: Path) -> None:
    """A tied LM head is the embedding table: 16-bit whatever --exclude says. MTP layers are
    ModelOpt's recipe's exclusion; named otherwise, they quantize and load FP8 too."""
    src = make_tiny(tmp_path / "src", family="qwen3_5_moe", mtp=True, tie_word_embeddings=True)
    assert "mtp.fc" in quantize_checkpoint(src, tmp_path / "default").exclude_modules
    model = load_model(tmp_path / "default", torch.float32, torch.device("cpu"))
    assert not any(isinstance(m, FP8Linear) for m in model.mtp.modules())
    assert isinstance(model.backbone.layers[0].linear_attn.out_proj, FP8Linear)
    assert "lm_head" in quantize_checkpoint(src, tmp_path / "all", exclude=["*.conv1d"]).exclude_modules
    model = load_model(tmp_path / "all", torch.float32, torch.device("cpu"))
    assert isinstance(model.mtp.fc, FP8Linear) and not isinstance(model.lm_head, FP8Linear)


def test_fused_expert_tensors_are_written_one_per_expert(tmp_path: Path) -> None:
    """Experts stored as transformers 5 holds them (`experts.gate_up_proj` (E, 2I, H), `down_proj`
    (E, H, I)) come out one FP8 tensor and scale per expert and projection, as the loader reads them."""
    src = make_tiny(tmp_path / "src", family="qwen3_5_moe", layers="G")
    per_expert = stored(src)
    prefix = "model.layers.0.mlp.experts"
    experts = range(4)
    fused = {n: t for n, t in per_expert.items() if not n.startswith(f"{prefix}.")}
    fused[f"{prefix}.gate_up_proj"] = torch.stack(
        [torch.cat([per_expert[f"{prefix}.{e}.gate_proj.weight"], per_expert[f"{prefix}.{e}.up_proj.weight"]])
         for e in experts])
    fused[f"{prefix}.down_proj"] = torch.stack([per_expert[f"{prefix}.{e}.down_proj.weight"] for e in experts])
    (tmp_path / "fused").mkdir()
    save_file(fused, str(tmp_path / "fused" / "model.safetensors"))
    for extra in ("config.json", "tokenizer.json"):
        shutil.copy(src / extra, tmp_path / "fused")
    quantize_checkpoint(tmp_path / "fused", tmp_path / "a")
    quantize_checkpoint(src, tmp_path / "b")
    ours, theirs = stored(tmp_path / "a"), stored(tmp_path / "b")
    assert ours.keys() == theirs.keys() and f"{prefix}.3.up_proj.weight_scale" in ours
    assert all(torch.equal(t.view(torch.uint8), theirs[n].view(torch.uint8)) if t.dtype == FP8_DTYPE
               else torch.equal(t, theirs[n]) for n, t in ours.items())
