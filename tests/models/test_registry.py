"""The model registry: a checkpoint's family by its config.json `model_type` (and `architectures`
where families share one); the loader and the composition root build what it names."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from torch import nn

from replayserve import LLM
from replayserve.builtin.tiny import tiny_config
from replayserve.config import ConfigError, ModelConfig
from replayserve.models import registry
from replayserve.models.nemotron_h import NemotronHForCausalLM
from replayserve.models.registry import FAMILIES, ModelFamily, family_of


def test_nemotron_h_checkpoints_are_the_nemotron_h_family() -> None:
    assert family_of(tiny_config()).model_class is NemotronHForCausalLM


def test_a_model_type_no_family_runs_is_refused_naming_the_supported_ones() -> None:
    config = dataclasses.replace(tiny_config(), model_type="llama", architectures=("LlamaForCausalLM",))
    with pytest.raises(ConfigError, match=r"model_type 'llama' with architectures \['LlamaForCausalLM'\] is not "
                       r"supported; only 'nemotron_h' \(NemotronHForCausalLM\)"):
        family_of(config)


def test_families_that_share_a_model_type_are_told_apart_by_architectures(monkeypatch: pytest.MonkeyPatch) -> None:
    class Variant(nn.Module):
        def __init__(self, config: ModelConfig) -> None:
            super().__init__()

    variant = ModelFamily("nemotron_h", ("NemotronHVariantForCausalLM",), Variant)
    monkeypatch.setattr(registry, "FAMILIES", (*FAMILIES, variant))
    assert family_of(tiny_config()).model_class is NemotronHForCausalLM
    assert family_of(dataclasses.replace(tiny_config(), architectures=("NemotronHVariantForCausalLM",))) is variant
    with pytest.raises(ConfigError, match="is not supported"):
        family_of(dataclasses.replace(tiny_config(), architectures=("SomethingElse",)))


def test_the_loader_builds_the_class_the_registry_names(tiny_model_dir: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A second family of the same config fields is one registry line: LLM then runs its class."""
    class Renamed(NemotronHForCausalLM):
        pass

    model_dir = tmp_path / "renamed"
    model_dir.mkdir()
    for f in tiny_model_dir.iterdir():
        (model_dir / f.name).symlink_to(f)
    raw = json.loads((tiny_model_dir / "config.json").read_text())
    (model_dir / "config.json").unlink()
    (model_dir / "config.json").write_text(json.dumps({**raw, "model_type": "renamed_h",
                                                       "architectures": ["RenamedForCausalLM"]}))
    with pytest.raises(ConfigError, match="model_type 'renamed_h'"):
        LLM(model=str(model_dir), device="cpu")
    monkeypatch.setattr(registry, "FAMILIES", (*FAMILIES, ModelFamily("renamed_h", ("RenamedForCausalLM",), Renamed)))
    llm = LLM(model=str(model_dir), device="cpu")
    assert type(llm.engine.runner.model) is Renamed
    assert llm.config.model.model_type == "renamed_h"


def test_the_family_keys_round_trip_through_config_json() -> None:
    config = dataclasses.replace(tiny_config(), architectures=("A", "B"))
    raw = config.to_hf_dict()
    assert (raw["model_type"], raw["architectures"]) == ("nemotron_h", ["A", "B"])
    assert ModelConfig.from_hf_dict(json.loads(json.dumps(raw))) == config
