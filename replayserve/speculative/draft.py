"""A draft model as proposer: any checkpoint this engine loads (e.g. a smaller Nemotron-H), run by an
engine of its own, which the composition root (`build.py`) builds like the target's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from replayserve.cache.memory import cache_bytes
from replayserve.config import ConfigError, EngineConfig, ModelConfig
from replayserve.models.registry import family_of
from replayserve.sampling_params import SamplingParams
from replayserve.speculative.proposers import Proposer


class DraftEngine(Protocol):
    """What the proposer uses of the draft model's engine (an `engine.Engine`)."""

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams) -> Any: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> Any: ...

    def abort(self, request: Any) -> None: ...


class DraftModelProposer(Proposer):
    """Greedy drafts from a second model in an engine of its own.

    Each call runs the request's known tokens through the draft engine, which caches prefixes
    (`mamba_cache_mode="all"` on a grid of one KV block), so only the tokens after its last cached
    boundary are prefilled before k decode steps. The draft's state therefore never rolls back: a
    rejection only means the next call starts from an earlier cached boundary. Drafts do not
    affect the output, which verification keeps lossless.

    Calls for the target's running requests interleave, so the draft engine keeps boundary states
    for all of them: ``STATES_PER_REQUEST`` slots per target sequence (a call publishes about one
    per block it crosses; LRU keeps each request's newest until its next call).
    """

    STATES_PER_REQUEST = 4

    def __init__(self, engine: DraftEngine, max_model_len: int) -> None:
        """engine: the draft model's, configured by `draft_engine_config`; max_model_len: the
        target's, which no draft may run past."""
        self.engine, self.max_model_len = engine, max_model_len

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        k = min(k, self.max_model_len - len(token_ids) - 1)
        if k <= 0:
            return []
        request = self.engine.add_request(list(token_ids), SamplingParams(temperature=0.0, max_tokens=k,
                                                                          ignore_eos=True))
        try:
            while self.engine.has_unfinished():
                self.engine.step()
        finally:  # an interrupted call keeps no block or slot
            self.engine.abort(request)
        return list(request.output_token_ids[:k])


def draft_engine_config(draft: ModelConfig, target: EngineConfig) -> EngineConfig:
    """The draft engine's config, from the target's: one sequence at a time, KV blocks for all of
    the target's sequences, boundary states on a grid of one KV block (`DraftModelProposer`), the
    target's dtype, device and CPU threads.

    Raises:
        ConfigError naming the speculative option model when the vocabularies differ.
    """
    if draft.vocab_size != target.model.vocab_size:
        raise ConfigError(f"speculative option model: the draft's vocab_size {draft.vocab_size} differs "
                          f"from the target's {target.model.vocab_size}")
    max_model_len = target.resolved_max_model_len
    return EngineConfig(
        model=draft, dtype=target.dtype, device=target.device, max_num_seqs=1, max_model_len=max_model_len,
        block_size=target.block_size, num_kv_blocks=target.max_num_seqs * target.blocks_per_seq,
        max_num_batched_tokens=max(target.max_num_batched_tokens, max_model_len), enable_prefix_caching=True,
        mamba_cache_mode="all", mamba_block_size=target.block_size, cpu_threads=target.cpu_threads,
        num_mamba_cache_slots=DraftModelProposer.STATES_PER_REQUEST * target.max_num_seqs)


def draft_memory_bytes(config: EngineConfig) -> int:
    """What the draft engine of `config` (`draft_engine_config`) will hold on the device: its
    weights (in its dtype) and its caches. The target's cache sizing leaves it room, since the draft
    loads after the target's caches are allocated."""
    dtype = getattr(torch, config.dtype)
    with torch.device("meta"):
        weights = sum(p.numel() for p in family_of(config.model).model_class(config.model).parameters())
    return weights * dtype.itemsize + sum(cache_bytes(config, dtype))
