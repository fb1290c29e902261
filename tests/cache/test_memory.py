"""The KV cache and Mamba state bytes are known before allocation, and an engine config whose caches
would not fit in free memory is refused with num_kv_blocks named."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from replayserve import LLM
from replayserve.builtin.tiny import make_tiny, tiny_config
from replayserve.cache import memory as cache_memory
from replayserve.cache.memory import available_bytes, cache_bytes, check_cache_fit
from replayserve.config import ConfigError, EngineConfig, ModelConfig
from replayserve.engine.engine import Engine
from replayserve.speculative.draft import draft_engine_config, draft_memory_bytes

SPEC = {"method": "ngram", "num_speculative_tokens": 2}


def _allocated(engine: Engine) -> tuple[int, int]:
    runner = engine.runner
    kv = sum(t.numel() * t.element_size() for pair in runner.kv_caches for t in pair)
    return kv, sum(t.numel() * t.element_size() for t in runner.ssm.state_tensors())


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"num_kv_blocks": 11},
        {"speculative": SPEC},
        {"ssm_backend": "replay", "replay_window": 8},
        {"ssm_backend": "replay", "speculative": SPEC},
        {"enable_prefix_caching": True, "mamba_cache_mode": "all", "num_mamba_cache_slots": 5},
    ],
)
def test_cache_bytes_are_what_the_runner_allocates(tiny_model_dir: Path, kwargs: dict) -> None:
    # bfloat16: the Mamba state (float32) and the activations' rings (bfloat16) differ in dtype.
    llm = LLM(model=str(tiny_model_dir), dtype="bfloat16", device="cpu", max_num_seqs=3, max_model_len=64,
              block_size=8, **kwargs)
    kv, mamba = _allocated(llm.engine)
    assert kv > 0 and mamba > 0
    assert cache_bytes(llm.config, torch.bfloat16) == (kv, mamba)


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"speculative": SPEC}, {"ssm_backend": "replay"}, {"ssm_backend": "replay", "speculative": SPEC},
     {"ssm_backend": "replay", "enable_prefix_caching": True, "mamba_cache_mode": "all"},
     {"speculative": SPEC, "enable_prefix_caching": True, "mamba_cache_mode": "all"}],
)
def test_gated_delta_cache_bytes_are_what_the_runner_allocates(tmp_path: Path, kwargs: dict) -> None:
    """The Gated DeltaNet backends: per-position verify states (baseline), rings and cursors (ReplaySSM)."""
    llm = LLM(model=str(make_tiny(tmp_path, family="qwen3_5")), dtype="bfloat16", device="cpu", max_num_seqs=3,
              max_model_len=64, block_size=8, **kwargs)
    kv, states = _allocated(llm.engine)
    assert kv > 0 and states > 0
    assert cache_bytes(llm.config, torch.bfloat16) == (kv, states)
    for spec in llm.engine.runner.ssm.spec_states:  # one per step row (max_num_seqs), not per slot
        assert spec.shape[:2] == (3, 3)


def test_oversized_kv_cache_is_refused_before_allocating(tiny_model_dir: Path) -> None:
    """Before the fix the block pool alone (a deque of 10**9 ids) got the process killed."""
    # 10**9 blocks of this model's one attention layer: 8 TB, more than any host has.
    with pytest.raises(ConfigError, match=r"engine option num_kv_blocks: 1000000000 KV blocks .* bytes available"):
        LLM(model=str(tiny_model_dir), dtype="float32", device="cpu", num_kv_blocks=10**9)


def test_the_limit_is_the_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fits with exactly the bytes it needs, fails one byte short; an unset size names its source."""
    config = EngineConfig(model=tiny_config(), dtype="float32", device="cpu", max_num_seqs=2, max_model_len=64)
    needed = sum(cache_bytes(config, torch.float32))
    monkeypatch.setattr(cache_memory, "available_bytes", lambda device: needed)
    check_cache_fit(config)
    monkeypatch.setattr(cache_memory, "available_bytes", lambda device: needed - 1)
    with pytest.raises(ConfigError, match=rf"num_kv_blocks: 8 \(unset: max_num_seqs .* {needed:,} bytes in all"):
        check_cache_fit(config)


def test_an_engine_config_probes_no_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """An `EngineConfig` is a value, validated from its fields alone: caches that do not fit are
    refused where the engine is built (`check_cache_fit`, called by build.py), not at construction."""
    monkeypatch.setattr(cache_memory, "available_bytes", lambda device: 0)
    config = EngineConfig(model=tiny_config(), dtype="float32", device="cpu", num_kv_blocks=10**9)
    with pytest.raises(ConfigError, match="engine option num_kv_blocks: 1000000000 KV blocks"):
        check_cache_fit(config)


def test_host_available_bytes_is_at_most_physical_memory() -> None:
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < available_bytes(torch.device("cpu")) <= physical


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draft_memory_is_what_the_draft_model_holds(tiny_model_dir: Path, dtype: torch.dtype) -> None:
    """GPU cache sizing leaves room for a draft model, which loads after the target's caches are
    planned: its estimate is the draft's weights and caches as allocated. The MoE router is kept
    in float32, so the estimate (every weight in the model's dtype) is low by the router's
    rounding in bfloat16 at most."""
    spec = {"method": "draft", "model": str(tiny_model_dir), "num_speculative_tokens": 2}
    llm = LLM(model=str(tiny_model_dir), dtype=str(dtype).split(".")[1], device="cpu", max_num_seqs=3,
              max_model_len=64, block_size=8, speculative=spec)
    draft = llm.engine.proposer.engine
    weights = sum(p.numel() * p.element_size() for p in draft.runner.model.parameters())
    held = weights + sum(_allocated(draft))
    estimate = draft_memory_bytes(draft_engine_config(ModelConfig.from_dir(tiny_model_dir), llm.config))
    router = sum(p.numel() for n, p in draft.runner.model.named_parameters() if ".gate." in n)
    assert held - router * (4 - dtype.itemsize) <= estimate <= held
