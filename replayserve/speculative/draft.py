"""A draft model as proposer: any checkpoint this engine loads (e.g. a smaller Nemotron-H)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from replayserve.config import ConfigError, EngineConfig, ModelConfig
from replayserve.sampling_params import SamplingParams
from replayserve.speculative.proposers import Proposer


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


    def __init__(self, model_dir: str, target: EngineConfig) -> None:
        from replayserve.llm import LLM  # the engine builds its proposer: import at use

        draft_cfg = ModelConfig.from_dir(model_dir)
        if draft_cfg.vocab_size != target.model.vocab_size:
            raise ConfigError(f"speculative option model: the draft's vocab_size {draft_cfg.vocab_size} differs "
                              f"from the target's {target.model.vocab_size}")
        self.max_model_len = target.resolved_max_model_len
        self.llm = LLM(model_dir, **draft_engine_options(target))

    @classmethod
    def memory_bytes(cls, model_dir: str, target: EngineConfig) -> int:
        """What the draft will hold on the device: its weights (in the target's dtype) and its
        caches. The target's cache sizing leaves it room, since the draft loads after it."""
        from replayserve.cache.memory import cache_bytes
        from replayserve.models.nemotron_h import NemotronHForCausalLM

        draft_cfg = ModelConfig.from_dir(model_dir)
        dtype = getattr(torch, target.dtype)
        with torch.device("meta"):
            weights = sum(p.numel() for p in NemotronHForCausalLM(draft_cfg).parameters()) * dtype.itemsize
        return weights + sum(cache_bytes(EngineConfig(model=draft_cfg, **draft_engine_options(target)), dtype))

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        k = min(k, self.max_model_len - len(token_ids) - 1)
        if k <= 0:
            return []
        params = SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True)
        return self.llm.generate([{"prompt_token_ids": list(token_ids)}], params, use_tqdm=False)[0].token_ids[:k]


def draft_engine_options(target: EngineConfig) -> dict:
    """The draft engine's options, from the target's: one sequence at a time, KV blocks for all of
    the target's sequences, boundary states on a grid of one KV block (class docstring)."""
    max_model_len = target.resolved_max_model_len
    return dict(dtype=target.dtype, device=target.device, max_num_seqs=1, max_model_len=max_model_len,
                block_size=target.block_size, num_kv_blocks=target.max_num_seqs * target.blocks_per_seq,
                max_num_batched_tokens=max(target.max_num_batched_tokens, max_model_len),
                enable_prefix_caching=True, mamba_cache_mode="all", mamba_block_size=target.block_size,
                num_mamba_cache_slots=DraftModelProposer.STATES_PER_REQUEST * target.max_num_seqs)
