"""The proposer an engine's `speculative` config asks for, from the parts the composition root
(`build.py`) hands it; it builds no engine and changes no runner."""

from __future__ import annotations

from torch import nn

from replayserve.config import EngineConfig
from replayserve.speculative.draft import DraftEngine, DraftModelProposer
from replayserve.speculative.mtp import HiddenStore, MTPProposer
from replayserve.speculative.proposers import NgramProposer, Proposer


def hidden_store_for(engine: EngineConfig) -> HiddenStore | None:
    """Where the runner records final hidden states, when the proposer reads them (MTP); else None."""
    spec = engine.speculative
    if spec is None or spec.method != "mtp":
        return None
    # The window and what a step may take back (its drafts and one token): all the proposer reads.
    return HiddenStore(keep=spec.mtp_window + spec.num_speculative_tokens + 1)


def make_proposer(engine: EngineConfig, model: nn.Module, hidden_store: HiddenStore | None = None,
                  draft_engine: DraftEngine | None = None) -> Proposer | None:
    """The proposer `engine.speculative` asks for: MTP drafts from `model` (the target's) and the
    hidden states its runner records in `hidden_store` (`hidden_store_for`); a draft model from
    `draft_engine`, the draft model's own engine."""
    config = engine.speculative
    if config is None:
        return None
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "draft":
        if draft_engine is None:
            raise ValueError("speculative method 'draft' needs the draft model's engine (build.py builds it)")
        return DraftModelProposer(draft_engine, engine.resolved_max_model_len)
    if config.method == "mtp":
        if hidden_store is None:
            raise ValueError("speculative method 'mtp' needs the store its runner records hidden states in "
                             "(hidden_store_for)")
        return MTPProposer(model, hidden_store, config.mtp_window, max_rows=engine.max_num_seqs,
                           max_drafts=config.num_speculative_tokens)
    if config.method == "custom":
        return config.proposer
    raise ValueError(f"speculative method {config.method!r} has no proposer")  # rejected by the config
