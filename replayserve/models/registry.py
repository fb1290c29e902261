"""The model families this engine runs, by what a checkpoint's `config.json` says it is.

A family is one module (its model class, built from a `ModelConfig`) plus one line in `FAMILIES`:
its `model_type` and the `architectures` its checkpoints declare (which tell apart families that
share a `model_type`). The loader and the
composition root (`build.py`) ask `family_of` which class to build; nothing else names a model
class. `docs/architecture.md` ("Adding a model family") lists the files a new family adds.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from replayserve.config import ConfigError, ModelConfig
from replayserve.models.bamba import BambaForCausalLM
from replayserve.models.falcon_h1 import FalconH1ForCausalLM
from replayserve.models.granite_hybrid import GraniteMoeHybridForCausalLM
from replayserve.models.nemotron_h import NemotronHForCausalLM
from replayserve.models.qwen3_next import Qwen3NextForCausalLM


@dataclass(frozen=True)
class ModelFamily:
    """One family: config.json's `model_type`, the `architectures` its checkpoints name, and the
    model class (constructed as `model_class(config)`, on the meta device by the loader)."""

    model_type: str
    architectures: tuple[str, ...]
    model_class: type[nn.Module]


FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily("nemotron_h", ("NemotronHForCausalLM",), NemotronHForCausalLM),
    ModelFamily("granitemoehybrid", ("GraniteMoeHybridForCausalLM",), GraniteMoeHybridForCausalLM),
    ModelFamily("bamba", ("BambaForCausalLM",), BambaForCausalLM),
    ModelFamily("falcon_h1", ("FalconH1ForCausalLM",), FalconH1ForCausalLM),
    ModelFamily("qwen3_next", ("Qwen3NextForCausalLM",), Qwen3NextForCausalLM),
    ModelFamily("qwen3_5", ("Qwen3_5ForConditionalGeneration",), Qwen3NextForCausalLM),
    ModelFamily("qwen3_5_text", ("Qwen3_5ForCausalLM",), Qwen3NextForCausalLM),
    ModelFamily("qwen3_5_moe", ("Qwen3_5MoeForConditionalGeneration",), Qwen3NextForCausalLM),
    ModelFamily("qwen3_5_moe_text", ("Qwen3_5MoeForCausalLM",), Qwen3NextForCausalLM),
)


def family_of(config: ModelConfig) -> ModelFamily:
    """The family of `config`, by its `model_type`; where families share one, by the first of their
    `architectures` that the config names.

    Raises:
        ConfigError naming model_type and the supported ones when no family matches.
    """
    candidates = [f for f in FAMILIES if f.model_type == config.model_type]
    if len(candidates) > 1:
        candidates = [f for f in candidates if set(f.architectures) & set(config.architectures)]
    if len(candidates) == 1:
        return candidates[0]
    supported = ", ".join(f"{f.model_type!r} ({', '.join(f.architectures)})" for f in FAMILIES)
    raise ConfigError(f"model_type {config.model_type!r} with architectures {list(config.architectures)} is not "
                      f"supported; only {supported}")
