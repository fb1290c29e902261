"""The Mamba2 hybrids beside Nemotron-H against their Hugging Face implementation, on tiny random
checkpoints that transformers' own class writes (`save_pretrained`: the family's layout and
config.json as published checkpoints have them). Greedy tokens equal HF ``generate`` and the chosen
tokens' log-probabilities are within 1e-4 of HF's teacher-forced ones, in float32, over 32 tokens."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import (
    BambaConfig,
    BambaForCausalLM,
    FalconH1Config,
    FalconH1ForCausalLM,
    GraniteMoeHybridConfig,
    GraniteMoeHybridForCausalLM,
)

from replayserve.builtin.tiny import init_random_weights

from .hf_reference import hf_greedy
from .test_hf_parity import F32_TOL, NUM_NEW, PROMPT_LENS, _check_teacher_forced, _engine_generate

_GRANITE_BASE = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=32, shared_intermediate_size=48, mamba_n_heads=8, mamba_d_state=16,
                     mamba_chunk_size=8, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                     embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=1.5, attention_multiplier=0.2)
_BAMBA_BASE = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                   mamba_n_heads=8, mamba_d_state=16, mamba_chunk_size=8, max_position_embeddings=256)
_FALCON_MUP = dict(embedding_multiplier=1.5, lm_head_multiplier=0.7, mlp_multipliers=[0.8, 1.2], key_multiplier=0.9,
                   attention_in_multiplier=1.1, attention_out_multiplier=0.6, ssm_in_multiplier=0.9,
                   ssm_multipliers=[1.2, 0.9, 1.1, 0.8, 1.3], ssm_out_multiplier=1.2)
_FALCON_BASE = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    intermediate_size=96, mamba_n_heads=8, mamba_d_state=16, mamba_chunk_size=8,
                    max_position_embeddings=256, **_FALCON_MUP)
_M, _A = "mamba", "attention"
# (config class, model class, kwargs): several layer mixes, MoE and dense, NoPE and RoPE, group counts.
FAMILY_CONFIGS: dict[str, tuple[type, type, dict]] = {
    # MoE (4 experts, top 2) + shared MLP, RoPE, 2 groups.
    "granite_moe_rope_g2": (GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM, {
        **_GRANITE_BASE, "layer_types": [_M, _A, _M, _M, _A], "num_local_experts": 4, "num_experts_per_tok": 2,
        "mamba_n_groups": 2, "position_embedding_type": "rope"}),
    # Dense (num_local_experts 0: the shared MLP alone), NoPE, 1 group, MHA.
    "granite_dense_nope_g1": (GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM, {
        **_GRANITE_BASE, "layer_types": [_M, _M, _A, _M], "num_local_experts": 0, "num_key_value_heads": 4,
        "mamba_n_groups": 1, "position_embedding_type": None}),
    # MoE with top 1 of 3, NoPE, 4 groups, a time step limit that clamps, tied embeddings.
    "granite_moe_nope_g4": (GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM, {
        **_GRANITE_BASE, "layer_types": [_A, _M, _M, _A, _M], "num_local_experts": 3, "num_experts_per_tok": 1,
        "mamba_n_groups": 4, "mamba_d_head": 8, "mamba_expand": 1, "position_embedding_type": None,
        "time_step_limit": [0.002, 0.05], "tie_word_embeddings": True,
        # With tied embeddings a dominant embedding makes the token itself the argmax: a repeated token.
        "embedding_multiplier": 0.1, "residual_multiplier": 1.5}),
    # Bamba: RoPE on half of each head (transformers' default), 2 groups, GQA.
    "bamba_half_rope_g2": (BambaConfig, BambaForCausalLM, {
        **_BAMBA_BASE, "attn_layer_indices": [1, 3], "num_hidden_layers": 5, "mamba_n_groups": 2}),
    # Bamba: full RoPE, 1 group, MHA, an MLP bias, attention first.
    "bamba_full_rope_g1": (BambaConfig, BambaForCausalLM, {
        **_BAMBA_BASE, "attn_layer_indices": [0], "num_hidden_layers": 3, "mamba_n_groups": 1,
        "num_key_value_heads": 4, "mlp_bias": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 1.0}}),
    # Falcon-H1: muP multipliers everywhere, the gated RMS norm before the gate, 2 groups,
    # mamba_d_ssm (128) apart from mamba_expand * hidden_size, head_dim apart from hidden / heads.
    "falcon_h1_norm_before_gate_g2": (FalconH1Config, FalconH1ForCausalLM, {
        **_FALCON_BASE, "num_hidden_layers": 3, "mamba_d_ssm": 128, "mamba_n_groups": 2, "mamba_rms_norm": True,
        "mamba_norm_before_gate": True}),
    # Falcon-H1: no SSM norm (y * silu(z)), 4 groups, neutral multipliers in the MLP, MLP bias.
    "falcon_h1_gate_only_g4": (FalconH1Config, FalconH1ForCausalLM, {
        **_FALCON_BASE, "num_hidden_layers": 2, "mamba_d_ssm": 64, "mamba_n_groups": 4, "mamba_rms_norm": False,
        "mlp_multipliers": [1.0, 1.0], "mlp_bias": True}),
    # Falcon-H1: the norm after the gate (Nemotron-H's order), one group.
    "falcon_h1_norm_after_gate_g1": (FalconH1Config, FalconH1ForCausalLM, {
        **_FALCON_BASE, "num_hidden_layers": 2, "mamba_d_ssm": 128, "mamba_n_groups": 1, "mamba_rms_norm": True,
        "mamba_norm_before_gate": False}),
}


def make_family_checkpoint(out_dir: Path, name: str, seed: int = 0, **overrides: object) -> Path:
    """HF's model of `name` (its config changed by `overrides`), with this project's tiny-model
    weights (greedy text that does not repeat one token), saved by transformers."""
    config_class, model_class, kwargs = FAMILY_CONFIGS[name]
    kwargs = {**kwargs, **overrides}
    torch.manual_seed(seed)
    if "layer_types" in kwargs:
        kwargs = {**kwargs, "num_hidden_layers": len(kwargs["layer_types"])}
    model = model_class(config_class(**kwargs)).eval()
    init_random_weights(model, seed)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def family_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = make_family_checkpoint(tmp_path_factory.mktemp(name), name)
        return built[name]

    return get


@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_family_parity_float32(name: str, family_checkpoint: Callable[[str], Path]) -> None:
    model_dir = family_checkpoint(name)
    gen = torch.Generator().manual_seed(0)
    vocab = FAMILY_CONFIGS[name][2]["vocab_size"]
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    outs = _engine_generate(model_dir, "float32", prompts)
    max_diff, _ = _check_teacher_forced(model_dir, prompts, outs, torch.float32, F32_TOL)
    for j, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        assert len(set(out.token_ids)) > 4, f"prompt {j}: degenerate continuation {out.token_ids}"
        # HF's cached decode (selective_state_update) skips time_step_limit's clamp, which its prefill
        # and this engine apply: with a limit that clamps, HF re-runs the full forward for each token.
        clamps = "time_step_limit" in FAMILY_CONFIGS[name][2]
        want = hf_greedy(model_dir, prompt, NUM_NEW, torch.float32, use_cache=not clamps)
        first = next((i for i, (a, b) in enumerate(zip(out.token_ids, want, strict=True)) if a != b), None)
        assert out.token_ids == want, f"prompt {j}: greedy diverges from HF generate at step {first}"
    print(f"\n[{name}] float32: max |dlogprob| = {max_diff:.2e}, greedy == HF generate for {len(prompts)}x{NUM_NEW}")
