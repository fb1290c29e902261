"""The ReplaySSM backend refuses a window it cannot run, with EngineConfig's check and message."""

from __future__ import annotations

import pytest
import torch

from replayserve.builtin.tiny import tiny_config
from replayserve.config import ConfigError, EngineConfig, SpeculativeConfig
from replayserve.ssm.layout import MambaLayout
from replayserve.ssm.replay import ReplayBackend


@pytest.mark.parametrize(("window", "num_speculative_tokens"), [(2, 2), (65, 0)])
def test_a_window_engine_config_refuses_is_refused_by_the_backend_alike(window: int,
                                                                        num_speculative_tokens: int) -> None:
    model = tiny_config()
    spec = SpeculativeConfig("ngram", num_speculative_tokens) if num_speculative_tokens else None
    with pytest.raises(ConfigError, match="engine option replay_window: ") as from_config:
        EngineConfig(model=model, ssm_backend="replay", replay_window=window, speculative=spec)
    layout = MambaLayout.from_config(model, 4, torch.float32, window=window, tokens_per_step=1 + num_speculative_tokens)
    with pytest.raises(ConfigError) as from_backend:
        ReplayBackend(layout, torch.device("cpu"))
    assert str(from_backend.value) == str(from_config.value)
