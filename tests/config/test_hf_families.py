"""config.json of the families beside Nemotron-H: read as transformers reads it, written back to the
same config, and every value the engine cannot run refused naming its key."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from replayserve.builtin.tiny import tiny_config
from replayserve.config import ConfigError, ModelConfig, tensor_parallel_error
from replayserve.config.hf_families import GRANITE

GRANITE_TINY = tiny_config("M*MM*M", family="granite")


def _granite(**edits: object) -> ModelConfig:
    return ModelConfig.from_hf_dict({**GRANITE_TINY.to_hf_dict(), **edits})


def test_granite_config_round_trips_through_its_config_json() -> None:
    assert _granite() == GRANITE_TINY
    raw = GRANITE_TINY.to_hf_dict()
    assert raw["model_type"] == GRANITE and raw["layer_types"][:2] == ["linear_attention", "full_attention"]
    assert raw["mamba_expand"] * raw["hidden_size"] == raw["mamba_n_heads"] * raw["mamba_d_head"]


def test_granite_reads_legacy_layer_names_defaults_and_nope() -> None:
    raw = GRANITE_TINY.to_hf_dict()
    for key in ("mamba_d_head", "num_key_value_heads", "time_step_limit", "rope_parameters"):
        del raw[key]
    raw.update(layer_types=["mamba", "attention"], num_hidden_layers=2, position_embedding_type=None,
               mamba_d_head="auto")
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg.layer_types == ("linear_attention", "full_attention")
    assert cfg.mamba_head_dim == 2 * cfg.hidden_size // cfg.mamba_num_heads
    assert cfg.num_key_value_heads == cfg.num_attention_heads and cfg.rope_theta is None
    assert cfg.dt_limit == (0.0, math.inf)


@pytest.mark.parametrize(("edits", "key"), [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_parameters.rope_type"),
    ({"position_embedding_type": "alibi"}, "position_embedding_type"),
    ({"mamba_d_head": 7}, "mamba_d_head"),
    ({"num_hidden_layers": 3}, "num_hidden_layers"),
    ({"layer_types": ["mamba", "moe"]}, "layer_types"),
    ({"time_step_limit": [0.5, 0.1]}, "time_step_limit"),
    ({"logits_scaling": 0}, "logits_scaling"),
    ({"some_new_key": 1}, r"unsupported keys \['some_new_key'\]"),
])
def test_granite_values_it_cannot_run_fail_naming_the_key(edits: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        _granite(**edits)


def test_nemotron_h_refuses_the_other_families_keys() -> None:
    with pytest.raises(ConfigError, match=r"unsupported keys \['embedding_multiplier'\]"):
        ModelConfig.from_hf_dict({**tiny_config().to_hf_dict(), "embedding_multiplier": 2.0})


def test_tensor_parallelism_checks_granites_feed_forward_sizes() -> None:
    """Granite's MLPs are no layer kind: their sizes are checked for every layer all the same."""
    assert tensor_parallel_error(GRANITE_TINY, 2) is None
    odd_shared = dataclasses.replace(GRANITE_TINY, moe_shared_expert_intermediate_size=33)
    assert tensor_parallel_error(odd_shared, 2) == ("2 ranks must divide the model's "
                                                    "moe_shared_expert_intermediate_size=33")


def test_make_tiny_writes_a_granite_checkpoint(tmp_path: Path) -> None:
    from replayserve.cli import main

    main(["make-tiny", str(tmp_path), "--family", "granite", "--layers", "M*M"])
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == GRANITE and raw["layer_types"] == ["linear_attention", "full_attention",
                                                                    "linear_attention"]
    with pytest.raises(SystemExit):
        main(["make-tiny", str(tmp_path / "x"), "--family", "granite", "--layers", "M-E"])


BAMBA_TINY = tiny_config("M*MM*M", family="bamba")


def test_bamba_config_round_trips_and_reads_its_layers_from_attn_layer_indices() -> None:
    raw = BAMBA_TINY.to_hf_dict()
    assert raw["attn_layer_indices"] == [1, 4] and raw["num_hidden_layers"] == 6
    assert ModelConfig.from_hf_dict(raw) == BAMBA_TINY
    del raw["rope_parameters"]  # transformers' default: RoPE on half of each head
    assert ModelConfig.from_hf_dict(raw).partial_rotary_factor == 0.5


@pytest.mark.parametrize(("edits", "key"), [
    ({"attn_layer_indices": [6]}, "attn_layer_indices"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_parameters.rope_type"),
    ({"hidden_act": "relu"}, "hidden_act"),
    ({"mamba_expand": 3}, "mamba_d_head"),
])
def test_bamba_values_it_cannot_run_fail_naming_the_key(edits: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        ModelConfig.from_hf_dict({**BAMBA_TINY.to_hf_dict(), **edits})


def test_granite_refuses_a_partial_rotary_factor_its_reference_ignores() -> None:
    with pytest.raises(ConfigError, match="rope_parameters.partial_rotary_factor"):
        _granite(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})


FALCON_TINY = tiny_config("MM", family="falcon_h1")


def test_falcon_h1_config_round_trips_with_one_layer_pair_per_layer() -> None:
    raw = FALCON_TINY.to_hf_dict()
    assert raw["num_hidden_layers"] == 2 and raw["lm_head_multiplier"] == pytest.approx(0.8)
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg == FALCON_TINY
    assert cfg.layer_types == ("linear_attention", "full_attention") * 2


@pytest.mark.parametrize(("edits", "key"), [
    ({"projectors_bias": True}, "projectors_bias"),
    ({"attn_layer_indices": [0]}, "attn_layer_indices"),
    ({"ssm_multipliers": [1.0, 1.0]}, "ssm_multipliers"),
    ({"lm_head_multiplier": 0}, "lm_head_multiplier"),
    ({"mamba_d_ssm": 100}, "mamba_d_head"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "rope_parameters.partial_rotary_factor"),
])
def test_falcon_h1_values_it_cannot_run_fail_naming_the_key(edits: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        ModelConfig.from_hf_dict({**FALCON_TINY.to_hf_dict(), **edits})
