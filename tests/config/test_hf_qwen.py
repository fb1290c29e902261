"""config.json of the Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5, Qwen3.5-MoE): read as transformers
reads it (its config classes write the files, defaults included), written back to the same config,
the multimodal wrappers' language model taken, and every value the engine cannot run refused naming
its key."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from transformers import (
    AutoConfig,
    Qwen3_5Config,
    Qwen3_5MoeConfig,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3NextConfig,
)

from replayserve.config import (
    ATTENTION,
    GATED_DELTA,
    MLP,
    MOE,
    ConfigError,
    EngineConfig,
    ModelConfig,
    SpeculativeConfig,
)

_SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
              linear_value_head_dim=8)
_MOE = dict(num_experts=4, num_experts_per_tok=2)
CONFIGS = {
    "qwen3_next": lambda: Qwen3NextConfig(**_SMALL, **_MOE, mlp_only_layers=[1]),
    "qwen3_next_sparse_step": lambda: Qwen3NextConfig(**_SMALL, **_MOE, decoder_sparse_step=2),
    "qwen3_next_defaults": lambda: Qwen3NextConfig(),
    "qwen3_5_text": lambda: Qwen3_5TextConfig(**_SMALL),
    "qwen3_5_moe_text": lambda: Qwen3_5MoeTextConfig(**_SMALL, **_MOE),
    "qwen3_5": lambda: Qwen3_5Config(text_config=_SMALL),
    "qwen3_5_moe": lambda: Qwen3_5MoeConfig(text_config={**_SMALL, **_MOE}),
}


def _read(hf_config: object, tmp_path: Path) -> ModelConfig:
    hf_config.save_pretrained(tmp_path)  # type: ignore[attr-defined]
    return ModelConfig.from_dir(tmp_path)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_config_reads_as_transformers_and_round_trips(name: str, tmp_path: Path) -> None:
    hf = CONFIGS[name]()
    cfg = _read(hf, tmp_path)
    text = getattr(hf, "text_config", hf)
    assert cfg.model_type == hf.model_type and len(cfg.layer_types) == 2 * text.num_hidden_layers
    mixers, ffns = cfg.layer_types[::2], cfg.layer_types[1::2]
    assert [GATED_DELTA if t == "linear_attention" else ATTENTION for t in text.layer_types] == list(mixers)
    assert cfg.num_gated_delta_layers == text.layer_types.count("linear_attention") == cfg.num_recurrent_layers
    assert cfg.num_mamba_layers == 0 and cfg.partial_rotary_factor == text.rope_parameters["partial_rotary_factor"]
    assert (cfg.linear_num_value_heads, cfg.linear_key_head_dim) == (text.linear_num_value_heads,
                                                                     text.linear_key_head_dim)
    assert cfg.attention_output_gate and cfg.qk_norm
    if name == "qwen3_next":
        assert ffns == (MOE, MLP, MOE, MOE)
    elif name == "qwen3_next_sparse_step":
        assert ffns == (MLP, MOE, MLP, MOE)
    elif "moe" in name or name == "qwen3_next_defaults":
        assert set(ffns) == {MOE} and cfg.n_routed_experts == text.num_experts and cfg.moe_shared_expert_gate
    else:
        assert set(ffns) == {MLP} and cfg.intermediate_size == text.intermediate_size
    # Written back: our reader and transformers' read it to the same config.
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    assert ModelConfig.from_dir(tmp_path) == cfg
    assert ModelConfig.from_hf_dict(AutoConfig.from_pretrained(tmp_path).to_dict()) == cfg


def test_wrapper_logs_that_the_vision_tower_is_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="replayserve.config.hf_qwen"):
        cfg = _read(CONFIGS["qwen3_5"](), tmp_path)
    assert cfg.architectures == ("Qwen3_5ForConditionalGeneration",)
    assert "vision tower" in caplog.text


def _next(**edits: object) -> ModelConfig:
    raw = {"model_type": "qwen3_next", **_SMALL, **_MOE, "layer_types": ["linear_attention"] * 3 + ["full_attention"]}
    return ModelConfig.from_hf_dict({**raw, **edits})


@pytest.mark.parametrize(("edits", "key"), [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"attn_output_gate": False}, "attn_output_gate"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"rope_scaling": {"type": "yarn"}}, "rope_scaling"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_parameters.rope_type"),
    ({"rope_parameters": {"rope_type": "default", "mrope_section": [1, 1]}}, "rope_parameters"),
    ({"layer_types": ["mamba"] * 4}, "layer_types"),
    ({"layer_types": ["linear_attention"] * 3}, "layer_types"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
    ({"linear_conv_kernel_dim": 1}, "linear_conv_kernel_dim"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"some_new_key": 1}, r"unsupported keys \['some_new_key'\]"),
])
def test_values_it_cannot_run_fail_naming_the_key(edits: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        _next(**edits)


def test_wrapper_without_text_config_fails_naming_it() -> None:
    with pytest.raises(ConfigError, match="text_config"):
        ModelConfig.from_hf_dict({"model_type": "qwen3_5", "vision_config": {}})


def test_nemotron_h_refuses_the_gdn_keys() -> None:
    with pytest.raises(ConfigError, match="linear_num_key_heads"):
        ModelConfig.from_hf_dict({"model_type": "nemotron_h", "hybrid_override_pattern": "M*",
                                  "linear_num_key_heads": 2})


@pytest.mark.parametrize(("edits", "ranks", "why"), [
    ({"linear_num_key_heads": 2, "linear_num_value_heads": 4}, 4, "4 ranks must divide the model's "
     "linear_num_key_heads=2"),
    ({"num_attention_heads": 6, "num_key_value_heads": 2}, 4, "4 ranks must divide the model's num_attention_heads=6"),
    ({"num_attention_heads": 12, "num_key_value_heads": 3}, 4, "4 ranks must divide num_key_value_heads=3 or be a "
     "multiple of it"),
    ({"moe_intermediate_size": 6}, 4, "4 ranks must divide the model's moe_intermediate_size=6"),
    ({"shared_expert_intermediate_size": 10}, 4, "4 ranks must divide the model's moe_shared_expert_intermediate_size"),
])
def test_tensor_parallelism_refuses_sizes_the_ranks_do_not_split(edits: dict, ranks: int, why: str) -> None:
    """Each rank keeps whole heads (GDN key heads and their value heads, attention heads, KV heads
    or copies of them) and an equal part of every feed-forward inner dimension."""
    splittable = {"linear_num_key_heads": 4, "linear_num_value_heads": 8, "num_attention_heads": 8,
                  "num_key_value_heads": 4, "intermediate_size": 64, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 32}
    EngineConfig(model=_next(**splittable), device="cpu", dtype="float32", tensor_parallel_size=4)
    model = _next(**{**splittable, **edits})
    with pytest.raises(ConfigError, match=f"engine option tensor_parallel_size: {why}"):
        EngineConfig(model=model, device="cpu", dtype="float32", tensor_parallel_size=ranks)


def test_replay_backend_on_gdn_models_defaults_to_a_power_of_two_ring() -> None:
    """R = W + T of 32 (plain decode) or 16 (speculation, doubled while W < T); an explicit window stays."""
    def window(**kw: object) -> int:
        return EngineConfig(model=_next(), ssm_backend="replay", device="cpu", dtype="float32",
                            **kw).resolved_replay_window  # type: ignore[arg-type]

    assert window() == 31 and window(replay_window=8) == 8
    assert window(speculative=SpeculativeConfig("ngram", 3)) == 12
    assert window(speculative=SpeculativeConfig("ngram", 9)) == 22
    with pytest.raises(ConfigError, match="dtype"):
        EngineConfig(model=_next(), ssm_backend="replay", device="cuda", dtype="float64")
