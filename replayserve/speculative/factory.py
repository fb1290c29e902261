"""Builds the proposer an engine's `speculative` config asks for."""

from __future__ import annotations

from typing import TYPE_CHECKING

from replayserve.config import EngineConfig
from replayserve.speculative.proposers import NgramProposer, Proposer

if TYPE_CHECKING:
    from replayserve.engine.runner import Runner


def make_proposer(engine: EngineConfig, runner: Runner) -> Proposer | None:
    """The proposer `engine.speculative` asks for; MTP drafts from the runner's model and the
    hidden states it records."""
    config = engine.speculative
    if config is None:
        return None
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "draft":
        from replayserve.speculative.draft import DraftModelProposer

        assert config.model is not None
        return DraftModelProposer(config.model, engine)
    if config.method == "mtp":
        from replayserve.speculative.mtp import HiddenStore, MTPProposer

        runner.hidden_store = HiddenStore()
        return runner.mirror(MTPProposer(runner.model, runner.hidden_store, config.mtp_window))
    if config.method == "custom":
        return config.proposer
    raise ValueError(f"speculative method {config.method!r} has no proposer")  # rejected by the config
