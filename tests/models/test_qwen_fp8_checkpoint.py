"""A tiny Qwen3.5-MoE checkpoint in ModelOpt's FP8 layout (every Linear quantized alone, per tensor,
but the LM head and the routers) loads with its routed experts stacked in FP8: each expert's gate
and up requantized to the larger of their scales, weight-only (their input scales checked, not
applied), so the engine keeps CUDA graphs for it. Its logits equal the per-expert loop's on the
same experts and those of a float32 checkpoint holding the requantized weights dequantized, on the
references and on the kernels (Triton's interpreter: fp32, FP8 widened exactly)."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from replayserve import LLM, SamplingParams
from replayserve.builtin.tiny import make_tiny
from replayserve.engine.runner import graphs_off_reason
from replayserve.layers.qwen_moe import SparseMoeBlock
from replayserve.models.fp8_loading import quantize_model_fp8
from replayserve.models.loader import load_model
from replayserve.models.quantization import QuantConfig, QuantizationError, quantizable_modules
from replayserve.ops.dispatch import force_triton
from replayserve.ops.fp8 import FP8_DTYPE, quantize_fp8_per_tensor
from replayserve.quantize import _quantization_config
from tests.test_quantize import dequantized  # the FP8 checkpoint in float32, experts requantized as stacked


def stored(module: str) -> str:
    """A module's name in the checkpoint (transformers' `model.` prefix)."""
    return "model." + module.removeprefix("backbone.") if module.startswith("backbone.") else module


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("qwen") / "bf16", family="qwen3_5_moe")


def fp8_checkpoint(src: Path, out: Path, static: bool, keep: tuple[str, ...] = ()) -> Path:
    """`src` in ModelOpt's FP8 layout; with `static`, an input_scale for every FP8 Linear; the
    modules in `keep` stay 16-bit too."""
    linears, _ = quantizable_modules(load_model(src, torch.float32, torch.device("cpu")))
    excluded = [m for m in linears if m == "lm_head" or m.endswith((".mlp.gate", ".shared_expert_gate")) or m in keep]
    tensors = load_file(str(src / "model.safetensors"))
    for m in (stored(m) for m in linears if m not in excluded):
        tensors[f"{m}.weight"], tensors[f"{m}.weight_scale"] = quantize_fp8_per_tensor(tensors[f"{m}.weight"])
        if static:
            tensors[f"{m}.input_scale"] = torch.tensor(0.02)
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    quant_file, section = _quantization_config(excluded)
    (out / "hf_quant_config.json").write_text(json.dumps(quant_file))
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": section}))
    shutil.copy(src / "tokenizer.json", out)
    return out


def last_logprobs(model_dir: Path, kernels: bool = False, per_expert_loop: bool = False) -> torch.Tensor:
    """(8, vocab) log-probabilities of the token after each of 8 random prompts; with
    `per_expert_loop`, every MoE block's stacks dropped first, so its experts run one by one."""
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, vocab, (int(n),), generator=gen).tolist()}
               for n in torch.randint(4, 20, (8,), generator=gen)]
    with force_triton() if kernels else contextlib.nullcontext():
        llm = LLM(str(model_dir), dtype="float32", device="cpu", warmup=False)
        if per_expert_loop:
            for block in llm.engine.runner.model.modules():
                if isinstance(block, SparseMoeBlock):
                    block._experts = None
        outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, logprobs=vocab), use_tqdm=False)
    rows = torch.empty(len(prompts), vocab)
    for i, out in enumerate(outs):
        for token, lp in out.outputs[0].logprobs[0].items():
            rows[i, token] = lp.logprob
    return rows


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static-input-scales"])
def test_routed_experts_load_stacked_in_fp8_and_keep_cuda_graphs(source: Path, tmp_path: Path, static: bool) -> None:
    fp8_dir = fp8_checkpoint(source, tmp_path / "fp8", static)
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    model = load_model(fp8_dir, torch.float32, torch.device("cpu"))
    blocks = {name: m for name, m in model.named_modules() if isinstance(m, SparseMoeBlock)}
    assert len(blocks) == 4
    for name, block in blocks.items():
        stacks = block.expert_stacks()
        assert stacks is not None and stacks[0].dtype == stacks[1].dtype == FP8_DTYPE
        up_scales, down_scales = block._scales
        for e, mlp in enumerate(block.experts):
            prefix = f"{stored(name)}.experts.{e}"
            gate_scale = tensors[f"{prefix}.gate_proj.weight_scale"]
            up_scale = tensors[f"{prefix}.up_proj.weight_scale"]
            assert not torch.equal(gate_scale, up_scale)  # apart in the checkpoint, one scale once stacked
            assert torch.equal(up_scales[e], torch.maximum(gate_scale, up_scale))
            assert torch.equal(down_scales[e], tensors[f"{prefix}.down_proj.weight_scale"])
            assert all(getattr(mlp, p).input_scale is None for p in ("gate_proj", "up_proj", "down_proj"))
        assert (block.shared_expert.up_proj.input_scale is not None) == static  # not a routed expert: kept
    weight = model.backbone.embed_tokens.weight
    with force_triton():  # the MoE kernels' path, as on CUDA: nothing turns the graphs off
        assert graphs_off_reason(model, weight) is None
    assert "reference expert loop" in graphs_off_reason(model, weight)  # the CPU's own path syncs


@pytest.mark.parametrize("kernels", [False, True], ids=["references", "kernels"])
def test_stacked_logits_equal_the_per_expert_loop_and_the_dequantized_weights(source: Path, tmp_path: Path,
                                                                               kernels: bool) -> None:
    fp8_dir = fp8_checkpoint(source, tmp_path / "fp8", static=False)
    stacked = last_logprobs(fp8_dir, kernels=kernels)
    torch.testing.assert_close(stacked, last_logprobs(fp8_dir, per_expert_loop=True), rtol=1e-5, atol=1e-5)
    ref = last_logprobs(dequantized(fp8_dir, tmp_path / "ref"))
    torch.testing.assert_close(stacked, ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(stacked.argmax(-1), ref.argmax(-1))


def test_routed_experts_half_fp8_are_refused_naming_both_kinds(source: Path, tmp_path: Path) -> None:
    """A block's routed experts are one stack: a 16-bit gate_proj among FP8 experts cannot join it."""
    keep = ("backbone.layers.1.mlp.experts.2.gate_proj",)
    fp8_dir = fp8_checkpoint(source, tmp_path / "fp8", static=False, keep=keep)
    with pytest.raises(QuantizationError, match=r"quantizes backbone\.layers\.1\.mlp\.experts\.0\.gate_proj but not "
                       r"backbone\.layers\.1\.mlp\.experts\.2\.gate_proj"):
        load_model(fp8_dir, torch.float32, torch.device("cpu"))


def test_quantized_in_memory_the_experts_stack_in_fp8(source: Path) -> None:
    """`quantize_model_fp8` (the benchmarks' --quantization fp8) restacks the Qwen experts in FP8,
    each expert's gate and up on one scale, the 16-bit stacks gone."""
    model = load_model(source, torch.float32, torch.device("cpu"))
    names = quantize_model_fp8(model, QuantConfig("FP8", None, ("lm_head",), "test"))
    assert "backbone.layers.3.mlp.experts.3.up_proj" in names
    for block in (m for m in model.modules() if isinstance(m, SparseMoeBlock)):
        w_up, _ = block.expert_stacks()
        assert w_up.dtype == FP8_DTYPE
        assert all(m.gate_proj.weight_scale.data_ptr() == m.up_proj.weight_scale.data_ptr() for m in block.experts)
