from __future__ import annotations

from pathlib import Path

import pytest
import torch

from replayserve.tiny import make_tiny

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Nemotron-H (Mamba, attention, MLP and MoE layers) written by `make-tiny`."""
    return make_tiny(tmp_path_factory.mktemp("tiny"), seed=0, layers="M*-ME")


def assert_pools_full(llm) -> None:  # noqa: ANN001 - LLM, kept import-free for fixtures
    engine = llm.engine
    assert engine.kv.pool.num_free == engine.kv.pool.size, "KV blocks leaked"
    assert engine.slots.num_free == engine.slots.size, "Mamba state slots leaked"
    assert not engine.scheduler.has_unfinished()
