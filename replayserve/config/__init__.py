"""Typed, frozen configuration: the model's (`model.py`, from `config.json`), the engine's and
speculative decoding's (`engine.py`), the table of engine options that `LLM` and the command line
follow (`options.py`), and the annotation-driven field checks they share (`checks.py`). Callers
import all of them from here."""

from replayserve.config.engine import (
    ALLOW_LONG_MAX_MODEL_LEN,
    SCORE_ROWS,
    SPEC_METHODS,
    EngineConfig,
    SpeculativeConfig,
    check_mamba_cache_mode,
    check_replay_window,
)
from replayserve.config.model import (
    ATTENTION,
    DEVICES,
    DTYPES,
    GATED_DELTA,
    LAYER_TYPES,
    MAMBA,
    MAMBA_CACHE_MODES,
    MAX_REPLAY_WINDOW,
    MLP,
    MOE,
    PATTERN_CHARS,
    SSM_BACKENDS,
    ConfigError,
    ModelConfig,
    tensor_parallel_error,
)
from replayserve.config.options import DERIVED_FIELDS, ENGINE_OPTIONS, EngineOption, resolve_options

__all__ = ["ALLOW_LONG_MAX_MODEL_LEN", "ATTENTION", "DERIVED_FIELDS", "DEVICES", "DTYPES", "ENGINE_OPTIONS",
           "GATED_DELTA", "LAYER_TYPES", "MAMBA", "MAMBA_CACHE_MODES", "MAX_REPLAY_WINDOW", "MLP", "MOE",
           "PATTERN_CHARS",
           "SCORE_ROWS", "SPEC_METHODS", "SSM_BACKENDS", "ConfigError", "EngineConfig", "EngineOption", "ModelConfig",
           "SpeculativeConfig", "check_mamba_cache_mode", "check_replay_window", "resolve_options",
           "tensor_parallel_error"]
