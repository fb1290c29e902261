"""Config values are checked at construction with the option named: types from the field annotations
(bools are real bools, ints are not bools, floats accept ints), then ranges, then relations."""

from __future__ import annotations

import dataclasses
import logging
import typing

import pytest

from replayserve.builtin.tiny import tiny_config
from replayserve.config import ALLOW_LONG_MAX_MODEL_LEN, ConfigError, EngineConfig, ModelConfig, SpeculativeConfig

BASE = tiny_config()  # M*-ME: 4 attention heads over 2 KV heads, 8 Mamba heads in 2 groups, 4 experts
# config.json keys of the fields whose name differs.
HF_KEY = {"layer_types": "layers_block_type", "mtp_layer_types": "mtp_layers_block_type",
          "eos_token_ids": "eos_token_id", "dt_limit": "time_step_limit"}


def _from_json(**edits: object) -> ModelConfig:
    return ModelConfig.from_hf_dict({**BASE.to_hf_dict(), **edits})


def _wrong_value(cls: type, field: str) -> object:
    """A value of the wrong type for `field`: a string where a number is due, else a float."""
    hint = typing.get_type_hints(cls)[field]
    return "0.5" if hint is float or float in typing.get_args(hint) else 1.5


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(ModelConfig)])
def test_every_model_field_checks_its_type(field: str) -> None:
    with pytest.raises(ConfigError, match=f"model config option {HF_KEY.get(field, field)}: must be"):
        dataclasses.replace(BASE, **{field: _wrong_value(ModelConfig, field)})


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(EngineConfig) if f.name != "model"])
def test_every_engine_field_checks_its_type(field: str) -> None:
    with pytest.raises(ConfigError, match=f"engine option {field}: must be"):
        EngineConfig(model=BASE, **{field: _wrong_value(EngineConfig, field)})


def test_engine_model_must_be_a_model_config() -> None:
    with pytest.raises(ConfigError, match="engine option model: must be ModelConfig"):
        EngineConfig(model=BASE.to_hf_dict())  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                                   "model", "mtp_window"])
def test_speculative_fields_check_their_type(field: str) -> None:
    kwargs = {"method": "ngram", "num_speculative_tokens": 2, field: _wrong_value(SpeculativeConfig, field)}
    with pytest.raises(ConfigError, match=f"speculative option {field}: must be"):
        SpeculativeConfig(**kwargs)


@pytest.mark.parametrize(
    ("edits", "key", "why"),
    [
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings", "must be bool"),
        ({"tie_word_embeddings": 0}, "tie_word_embeddings", "must be bool"),
        ({"mlp_bias": "no"}, "mlp_bias", "must be bool"),
        ({"hidden_size": "128"}, "hidden_size", "must be int"),
        ({"hidden_size": 128.0}, "hidden_size", "must be int"),
        ({"hidden_size": True}, "hidden_size", "must be int"),
        ({"eos_token_id": "2"}, "eos_token_id", "must be list of int"),
        ({"eos_token_id": [2, True]}, "eos_token_id", "must be list of int"),
        ({"eos_token_id": -1}, "eos_token_id", ">= 0"),
        ({"pad_token_id": -1}, "pad_token_id", ">= 0"),
        ({"eos_token_id": [2, -3]}, "eos_token_id", ">= 0"),
        # Token ids the model cannot emit: EOS never ends a request, and min_tokens' ban indexes past the logits.
        ({"eos_token_id": 512}, "eos_token_id", r"\[512\]; token ids must be < vocab_size=512"),
        ({"eos_token_id": [2, 9999]}, "eos_token_id", r"\[2, 9999\]; token ids must be < vocab_size=512"),
        ({"max_position_embeddings": 1}, "max_position_embeddings", ">= 2, got 1"),
        ({"layers_block_type": "M*-ME"}, "layers_block_type", "list of strings"),
        ({"num_experts_per_tok": 0}, "num_experts_per_tok", ">= 1"),
        ({"n_groups": 0}, "n_groups", ">= 1"),
        ({"num_key_value_heads": 0}, "num_key_value_heads", ">= 1"),
        ({"moe_latent_size": 0}, "moe_latent_size", ">= 1"),
        ({"conv_kernel": 1}, "conv_kernel", ">= 2"),
        ({"layer_norm_epsilon": -1}, "layer_norm_epsilon", "> 0"),
        ({"layer_norm_epsilon": float("nan")}, "layer_norm_epsilon", "> 0"),
        ({"routed_scaling_factor": float("inf")}, "routed_scaling_factor", "finite"),
        ({"time_step_min": -0.001}, "time_step_min", ">= 0"),
        ({"residual_in_fp32": "true"}, "residual_in_fp32", "must be bool"),
        # Relations.
        ({"num_key_value_heads": 3}, "num_key_value_heads", "must divide num_attention_heads=4"),
        ({"n_groups": 3}, "n_groups", "must divide mamba_num_heads=8"),
        ({"n_routed_experts": 4, "n_group": 3}, "n_group", "must divide n_routed_experts=4"),
        ({"n_routed_experts": 4, "n_group": 4, "topk_group": 2}, "n_group", "at least 2"),
        ({"n_routed_experts": 8, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 5}, "num_experts_per_tok",
         "5 > the 4 experts"),
    ],
)
def test_bad_model_value_names_the_key(edits: dict, key: str, why: str) -> None:
    with pytest.raises(ConfigError, match=f"model config option {key}: .*{why}"):
        _from_json(**edits)


def test_accepted_model_values() -> None:
    """Ints where floats are due, token-id lists and nulls, and the relations at their limits."""
    cfg = _from_json(layer_norm_epsilon=1, routed_scaling_factor=2, time_step_min=0, eos_token_id=[2, 3],
                     pad_token_id=None, n_routed_experts=8, n_group=2, topk_group=2, num_experts_per_tok=8)
    assert (cfg.layer_norm_epsilon, cfg.routed_scaling_factor, cfg.time_step_min) == (1, 2, 0)
    assert cfg.eos_token_ids == (2, 3) and cfg.pad_token_id is None and cfg.num_experts_per_tok == 8
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


def test_a_config_without_model_type_is_refused() -> None:
    """It used to default to nemotron_h: any config.json with the right keys loaded as one."""
    raw = BASE.to_hf_dict()
    del raw["model_type"]
    with pytest.raises(ConfigError, match="config.json has no model_type; .*\"model_type\": \"nemotron_h\""):
        ModelConfig.from_hf_dict(raw)


def test_max_model_len_is_bounded_by_max_position_embeddings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALLOW_LONG_MAX_MODEL_LEN, raising=False)
    small = dataclasses.replace(BASE, max_position_embeddings=64)
    assert EngineConfig(model=small, max_model_len=64).resolved_max_model_len == 64
    assert EngineConfig(model=small).resolved_max_model_len == 64
    with pytest.raises(ConfigError, match="engine option max_model_len: 65 is above the model's "
                       "max_position_embeddings=64"):
        EngineConfig(model=small, max_model_len=65)
    for refused in ("0", "true", ""):  # only "1" allows it, as vLLM reads its variable
        monkeypatch.setenv(ALLOW_LONG_MAX_MODEL_LEN, refused)
        with pytest.raises(ConfigError, match="max_model_len"):
            EngineConfig(model=small, max_model_len=65)
    monkeypatch.setenv(ALLOW_LONG_MAX_MODEL_LEN, "1")
    assert EngineConfig(model=small, max_model_len=65).resolved_max_model_len == 65


def test_residual_in_fp32_true_is_read_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """transformers does not apply it either (tests/models/test_hf_parity.py checks both engines)."""
    with caplog.at_level(logging.WARNING, logger="replayserve.config.model"):
        assert _from_json(residual_in_fp32=True) == _from_json(residual_in_fp32=False) == BASE
    assert [r.name for r in caplog.records] == ["replayserve.config.model"]
    assert "residual_in_fp32: true, which is not applied" in caplog.records[0].getMessage()


@pytest.mark.parametrize(
    ("kwargs", "option", "why"),
    [
        ({"max_num_batched_tokens": 2.5}, "max_num_batched_tokens", "must be int"),
        ({"max_num_seqs": "4"}, "max_num_seqs", "must be int"),
        ({"block_size": True}, "block_size", "must be int"),
        ({"max_model_len": 64.0}, "max_model_len", "must be int or null"),
        ({"num_kv_blocks": 1.5}, "num_kv_blocks", "must be int or null"),
        ({"replay_window": 2.0}, "replay_window", "must be int"),
        ({"num_mamba_cache_slots": "1"}, "num_mamba_cache_slots", "must be int or null"),
        ({"mamba_block_size": 16.0}, "mamba_block_size", "must be int or null"),
        ({"enable_prefix_caching": 1}, "enable_prefix_caching", "must be bool"),
        ({"device": None}, "device", "must be str"),
        # 0 used to mean the default (`num_kv_blocks or ...`): it is out of range instead.
        ({"num_kv_blocks": 0}, "num_kv_blocks", ">= 1"),
        ({"max_model_len": 0}, "max_model_len", ">= 1"),
        ({"replay_window": -1}, "replay_window", ">= 1"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens", ">= 1"),
    ],
)
def test_bad_engine_option_is_named(kwargs: dict, option: str, why: str) -> None:
    with pytest.raises(ConfigError, match=f"engine option {option}: .*{why}"):
        EngineConfig(model=BASE, **kwargs)
