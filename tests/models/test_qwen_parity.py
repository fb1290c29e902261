"""The Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) against their Hugging Face
implementation, on tiny random checkpoints that transformers' own classes write: greedy tokens equal
HF ``generate`` and the chosen tokens' log-probabilities are within 1e-4 of HF's teacher-forced ones,
in float32, over 32 tokens (HF's torch fallbacks of the delta rule, chunked and recurrent, are the
reference), on the references and (the MoE families) on the kernels. Also: a multimodal Qwen3.5
checkpoint loads its language model, and make-tiny's checkpoints are ones transformers runs the same."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

from replayserve.builtin.tiny import init_random_weights, make_tiny
from replayserve.ops.dispatch import force_triton

from .hf_reference import hf_greedy
from .test_hf_parity import F32_TOL, NUM_NEW, PROMPT_LENS, _check_teacher_forced, _engine_generate

_BASE = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
             max_position_embeddings=256, rms_norm_eps=1e-6)
_L, _F = "linear_attention", "full_attention"
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
# (config class, model class, kwargs): GQA value heads (Hv = 2 Hk), partial RoPE, MoE and dense layers.
QWEN_CONFIGS: dict[str, tuple[type, type, dict]] = {
    # Qwen3-Next: fused in_proj_qkvz / in_proj_ba, MoE with a dense layer (mlp_only_layers), RoPE on half.
    "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM, {
        **_BASE, **_MOE, "layer_types": [_L, _F, _L, _L, _F], "intermediate_size": 96, "mlp_only_layers": [2],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}),
    # Qwen3.5 dense: four projections, Hv = Hk, a quarter of each head rotated, MRoPE keys (text: plain RoPE).
    "qwen3_5": (Qwen3_5TextConfig, Qwen3_5ForCausalLM, {
        **_BASE, "layer_types": [_L, _L, _F, _L], "intermediate_size": 96, "linear_num_value_heads": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [1, 1, 0], "mrope_interleaved": True}}),
    # Qwen3.5-MoE: every layer MoE, attention first, top 1 of 4.
    "qwen3_5_moe": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM, {
        **_BASE, **_MOE, "layer_types": [_F, _L, _L, _L], "num_experts_per_tok": 1}),
}


def make_qwen_checkpoint(out_dir: Path, name: str, seed: int = 0) -> Path:
    """HF's model of `name` with this project's tiny-model weights, saved by transformers."""
    config_class, model_class, kwargs = QWEN_CONFIGS[name]
    torch.manual_seed(seed)
    model = model_class(config_class(**kwargs, num_hidden_layers=len(kwargs["layer_types"]))).eval()
    init_random_weights(model, seed)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def qwen_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = make_qwen_checkpoint(tmp_path_factory.mktemp(name), name)
        return built[name]

    return get


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _check_greedy(model_dir: Path, prompts: list[list[int]], outs: list) -> None:
    for j, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        assert len(set(out.token_ids)) > 4, f"prompt {j}: degenerate continuation {out.token_ids}"
        want = hf_greedy(model_dir, prompt, NUM_NEW, torch.float32)
        first = next((i for i, (a, b) in enumerate(zip(out.token_ids, want, strict=True)) if a != b), None)
        assert out.token_ids == want, f"prompt {j}: greedy diverges from HF generate at step {first}"


@pytest.mark.parametrize("name", list(QWEN_CONFIGS))
def test_qwen_parity_float32(name: str, qwen_checkpoint: Callable[[str], Path]) -> None:
    model_dir = qwen_checkpoint(name)
    prompts = _prompts(QWEN_CONFIGS[name][2]["vocab_size"])
    outs = _engine_generate(model_dir, "float32", prompts)
    max_diff, _ = _check_teacher_forced(model_dir, prompts, outs, torch.float32, F32_TOL)
    _check_greedy(model_dir, prompts, outs)
    print(f"\n[{name}] float32: max |dlogprob| = {max_diff:.2e}, greedy == HF generate for {len(prompts)}x{NUM_NEW}")


@pytest.mark.slow  # about 1.5 min each on 2 CPU cores: every kernel in Triton's interpreter
@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_moe"])
def test_qwen_moe_parity_float32_on_the_kernels(name: str, qwen_checkpoint: Callable[[str], Path]) -> None:
    """The test above with every op on its Triton kernel (the CUDA path; interpreted on the CPU): the
    MoE's routing and grouped-GEMM experts with the gated shared expert in their sum (measured: max
    |dlogprob| 7.1e-5 Qwen3-Next, 4.3e-5 Qwen3.5-MoE)."""
    model_dir = qwen_checkpoint(name)
    prompts = _prompts(QWEN_CONFIGS[name][2]["vocab_size"])
    with force_triton():
        outs = _engine_generate(model_dir, "float32", prompts)
    _check_teacher_forced(model_dir, prompts, outs, torch.float32, F32_TOL)
    _check_greedy(model_dir, prompts, outs)


def test_multimodal_qwen3_5_runs_its_language_model(qwen_checkpoint: Callable[[str], Path], tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """The text checkpoint rewritten as Qwen3_5ForConditionalGeneration writes it (text_config beside
    a vision_config, `model.language_model.*`, a vision tower and MTP weights): the same tokens."""
    text_dir = qwen_checkpoint("qwen3_5")
    text_config = json.loads((text_dir / "config.json").read_text())
    config = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
              "text_config": {**text_config, "model_type": "qwen3_5_text"}, "tie_word_embeddings": False,
              "vision_config": {"model_type": "qwen3_5_vision", "depth": 1}, "image_token_id": 248056}
    (tmp_path / "config.json").write_text(json.dumps(config))
    weights = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in load_file(text_dir / "model.safetensors").items()}
    weights["model.visual.patch_embed.proj.weight"] = torch.ones(4, 3)
    weights["mtp.fc.weight"] = torch.ones(4, 4)
    save_file(weights, tmp_path / "model.safetensors")
    prompts = _prompts(QWEN_CONFIGS["qwen3_5"][2]["vocab_size"])[:1]
    with caplog.at_level(logging.INFO, logger="replayserve.config.hf_qwen"):
        outs = _engine_generate(tmp_path, "float32", prompts)
    assert "vision tower" in caplog.text and "ignored" in caplog.text
    assert [o.token_ids for o in outs] == [o.token_ids for o in _engine_generate(text_dir, "float32", prompts)]


def test_fused_expert_tensors_load_as_the_per_expert_ones(qwen_checkpoint: Callable[[str], Path],
                                                          tmp_path: Path) -> None:
    """A checkpoint storing each layer's experts stacked, as transformers 5 holds them in memory
    (`experts.gate_up_proj` (E, 2 I, H), `experts.down_proj` (E, H, I)), runs the same."""
    source = qwen_checkpoint("qwen3_5_moe")
    weights = load_file(source / "model.safetensors")
    for prefix in sorted({k.split(".experts.")[0] for k in weights if ".experts." in k}):
        count = sum(1 for k in weights if k.startswith(f"{prefix}.experts.") and k.endswith("down_proj.weight"))
        experts = [{p: weights.pop(f"{prefix}.experts.{e}.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj")}
                   for e in range(count)]
        weights[f"{prefix}.experts.gate_up_proj"] = torch.stack([torch.cat([x["gate_proj"], x["up_proj"]])
                                                                 for x in experts])
        weights[f"{prefix}.experts.down_proj"] = torch.stack([x["down_proj"] for x in experts])
    save_file(weights, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((source / "config.json").read_text())
    prompts = _prompts(QWEN_CONFIGS["qwen3_5_moe"][2]["vocab_size"])[:1]
    assert [o.token_ids for o in _engine_generate(tmp_path, "float32", prompts)] == [
        o.token_ids for o in _engine_generate(source, "float32", prompts)]


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_make_tiny_checkpoint_runs_the_same_in_transformers(family: str, tmp_path: Path) -> None:
    model_dir = make_tiny(tmp_path, family=family)
    prompt = torch.randint(3, 500, (21,), generator=torch.Generator().manual_seed(1)).tolist()
    out = _engine_generate(model_dir, "float32", [prompt])
    _check_teacher_forced(model_dir, [prompt], out, torch.float32, F32_TOL)
    _check_greedy(model_dir, [prompt], out)
