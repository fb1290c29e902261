"""gpu_memory_utilization: the plan spends total * utilization - held by this process - activation
reserve on whole units of (one max_model_len sequence's KV blocks + its cached states), the rest on
KV blocks; without prefix caching no more blocks than max_num_seqs sequences use; the engine
allocates exactly what was planned; bad values, too small budgets and plans that are not free name
the option."""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path

import pytest
import torch

from replayserve import LLM
from replayserve.cache import sizing as cache_sizing
from replayserve.cache.memory import cache_bytes
from replayserve.cache.sizing import CachePlan, activation_reserve, plan_cache_sizes, size_caches
from replayserve.config import ConfigError, EngineConfig, ModelConfig
from replayserve.engine.engine import Engine
from replayserve.models.loader import load_model

GiB = 1024**3


def _config(model: ModelConfig, mode: str = "none", **kwargs: object) -> EngineConfig:
    fields = {"dtype": "float32", "max_model_len": 64, **kwargs}
    return EngineConfig(model=model, device="cpu", max_num_seqs=3, block_size=8, enable_prefix_caching=mode != "none",
                        mamba_cache_mode=mode, mamba_block_size=16, max_num_batched_tokens=32,
                        gpu_memory_utilization=0.5, **fields)  # type: ignore[arg-type]


def _prices(config: EngineConfig) -> tuple[int, int, int]:
    """(fixed bytes, bytes per KV block, bytes per cached state) from the byte counts of configs with
    explicit sizes (mode 'none' ignores num_mamba_cache_slots, so its state price is 0)."""
    def cost(blocks: int, slots: int) -> int:
        return sum(cache_bytes(dataclasses.replace(config, num_kv_blocks=blocks, num_mamba_cache_slots=slots),
                               torch.float32))

    bps = config.blocks_per_seq
    per_block, per_slot = cost(bps + 1, 1) - cost(bps, 1), cost(bps, 2) - cost(bps, 1)
    return cost(bps, 1) - bps * per_block - per_slot, per_block, per_slot


def _own_for(config: EngineConfig, budget: int, total: int = GiB) -> int:
    """The bytes this process holds that leave `budget` for the caches at this utilization."""
    return int(total * config.gpu_memory_utilization) - activation_reserve(config) - budget


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> ModelConfig:
    return ModelConfig.from_dir(tiny_model_dir)


@pytest.mark.parametrize(("mode", "states_per_seq"), [("none", 0), ("align", 1), ("all", 4)])  # 64 / 16 = 4
def test_the_budget_buys_whole_units_then_kv_blocks(model: ModelConfig, mode: str, states_per_seq: int) -> None:
    config = dataclasses.replace(_config(model, mode), enable_prefix_caching=True)  # "none": KV-only caching
    fixed, per_block, per_slot = _prices(config)
    unit = config.blocks_per_seq * per_block + states_per_seq * per_slot
    budget = fixed + 3 * unit + unit // 2
    plan = plan_cache_sizes(config, free=GiB, total=GiB, own=_own_for(config, budget))
    assert plan.budget == budget and plan.activation_reserve == activation_reserve(config)
    assert plan.num_mamba_cache_slots == 3 * states_per_seq
    assert plan.num_kv_blocks == 3 * config.blocks_per_seq + (unit // 2) // per_block
    spent = fixed + plan.num_kv_blocks * per_block + plan.num_mamba_cache_slots * per_slot
    assert spent == plan.kv_bytes + plan.mamba_bytes and budget - per_block < spent <= budget


def test_without_prefix_caching_no_more_blocks_than_max_num_seqs_use(model: ModelConfig) -> None:
    config = _config(model)
    assert not config.enable_prefix_caching
    fixed, per_block, _ = _prices(config)
    roomy = plan_cache_sizes(config, free=GiB, total=GiB, own=_own_for(config, fixed + 100 * per_block))
    assert roomy.num_kv_blocks == config.max_num_seqs * config.blocks_per_seq == 24
    tight = plan_cache_sizes(config, free=GiB, total=GiB, own=_own_for(config, fixed + 11 * per_block))
    assert tight.num_kv_blocks == 11


def test_a_plan_that_is_not_free_names_the_option_and_others_do_not_shrink_it(model: ModelConfig) -> None:
    """The fraction is this engine's share (vLLM V1): memory other processes hold does not enter
    the budget, but the planned caches and the activation reserve must be free."""
    config = _config(model, "align")
    fixed, per_block, per_slot = _prices(config)
    own = _own_for(config, fixed + 40 * per_block + 10 * per_slot)
    plan = plan_cache_sizes(config, free=GiB // 2, total=GiB, own=own)
    needed = plan.kv_bytes + plan.mamba_bytes + plan.activation_reserve
    assert plan_cache_sizes(config, free=needed, total=GiB, own=own) == plan
    with pytest.raises(ConfigError, match=r"engine option gpu_memory_utilization: 0.5 of 1.00 GiB plans .* only "
                                          r".* GiB are free .* held by other processes.*lower gpu_memory_utilization"):
        plan_cache_sizes(config, free=needed - 1, total=GiB, own=own)


def test_a_given_size_is_kept_and_the_other_takes_the_rest(model: ModelConfig) -> None:
    config = _config(model, "align")
    fixed, per_block, per_slot = _prices(config)
    budget = fixed + 40 * per_block + 10 * per_slot
    own = _own_for(config, budget)
    blocks_given = plan_cache_sizes(dataclasses.replace(config, num_kv_blocks=30), GiB, GiB, own)
    assert blocks_given.num_kv_blocks == 30 and blocks_given.num_mamba_cache_slots == (10 * per_block) // per_slot + 10
    slots_given = plan_cache_sizes(dataclasses.replace(config, num_mamba_cache_slots=2), GiB, GiB, own)
    assert slots_given.num_mamba_cache_slots == 2 and slots_given.num_kv_blocks == 40 + (8 * per_slot) // per_block


@pytest.mark.parametrize("mode", ["none", "all"])
def test_the_engine_allocates_what_was_planned(tiny_model_dir: Path, model: ModelConfig, mode: str) -> None:
    config = _config(model, mode)
    fixed, per_block, per_slot = _prices(config)
    plan = plan_cache_sizes(config, GiB, GiB, _own_for(config, fixed + 21 * per_block + 5 * per_slot))
    sized = plan.apply(config)
    engine = Engine(sized, load_model(str(tiny_model_dir), torch.float32, torch.device("cpu")), None)
    runner = engine.runner
    kv = sum(t.numel() * t.element_size() for pair in runner.kv_caches for t in pair)
    mamba = sum(t.numel() * t.element_size() for t in runner.ssm.state_tensors())
    assert (kv, mamba) == (plan.kv_bytes, plan.mamba_bytes)
    assert engine.cache.kv.size == plan.num_kv_blocks
    states = engine.cache.states
    assert (0 if states is None else states.size) == plan.num_mamba_cache_slots == (0 if mode == "none" else 4)


def test_the_reserve_holds_attention_scores_only_where_the_reference_runs(model: ModelConfig) -> None:
    """The Triton prefill attention (fp32/bf16/fp16, power-of-two head_dim) keeps its scores on chip,
    so the reserve does not grow with max_model_len; float64 runs the reference, whose (Hq, queries,
    max_model_len) scores it must hold."""
    def reserve(dtype: str, length: int) -> int:
        return activation_reserve(_config(model, dtype=dtype, max_model_len=length))

    assert reserve("bfloat16", 64) == reserve("bfloat16", 512)
    assert reserve("float32", 64) == reserve("float32", 512)
    def scores(length: int) -> int:  # 32 queries (max_num_batched_tokens), 8-byte scores, K and V gathered
        return 2 * model.num_attention_heads * (32 * length + 2 * length * model.head_dim) * 8

    assert reserve("float64", 512) - reserve("float64", 64) == scores(512) - scores(64)


def test_too_small_a_budget_names_the_option(model: ModelConfig) -> None:
    config = _config(model, "align")
    fixed, per_block, per_slot = _prices(config)
    one_seq = fixed + config.blocks_per_seq * per_block + per_slot
    plan_cache_sizes(config, GiB, GiB, _own_for(config, one_seq))
    with pytest.raises(ConfigError, match=r"engine option gpu_memory_utilization: 0.5 of 1.00 GiB leaves .* "
                                          r"raise gpu_memory_utilization"):
        plan_cache_sizes(config, GiB, GiB, _own_for(config, one_seq - 1))


@pytest.mark.parametrize("value", [0, 0.0, -0.1, 1.01, math.nan, math.inf, True, "0.9", None])
def test_bad_gpu_memory_utilization_is_refused(model: ModelConfig, value: object) -> None:
    with pytest.raises(ConfigError, match="engine option gpu_memory_utilization"):
        EngineConfig(model=model, gpu_memory_utilization=value)  # type: ignore[arg-type]


def test_cuda_sizes_from_mem_get_info_and_logs_it(model: ModelConfig, monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """No GPU here: torch's memory query is replaced by fixed figures."""
    config = dataclasses.replace(_config(model, "align"), device="cuda")
    assert config.sized_by_memory
    fixed, per_block, per_slot = _prices(_config(model, "align"))
    own = _own_for(config, fixed + 20 * per_block + 4 * per_slot)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (GiB - own, GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: own)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    with caplog.at_level(logging.INFO, logger=cache_sizing.__name__):
        sized = size_caches(config)
    plan = plan_cache_sizes(config, GiB - own, GiB, own)
    assert isinstance(plan, CachePlan) and not sized.sized_by_memory
    assert (sized.num_kv_blocks, sized.num_mamba_cache_slots) == (plan.num_kv_blocks, plan.num_mamba_cache_slots)
    assert f"{plan.num_kv_blocks} KV blocks of 8 tokens" in caplog.text and "GiB" in caplog.text
    assert f"3 live + {plan.num_mamba_cache_slots} cached Mamba state slots" in caplog.text


def test_on_cpu_the_defaults_stay(tiny_model_dir: Path) -> None:
    llm = LLM(model=str(tiny_model_dir), dtype="float32", device="cpu", max_num_seqs=2, max_model_len=64,
              gpu_memory_utilization=0.1)
    assert llm.config.num_kv_blocks is None and llm.engine.cache.kv.size == 2 * llm.config.blocks_per_seq


def test_an_engine_built_directly_checks_the_default_sizes(model: ModelConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    """Benchmarks build an Engine from a CUDA config without LLM's sizing: the defaults apply and
    must fit (checked before anything is allocated)."""
    from replayserve.cache import memory as cache_memory

    config = dataclasses.replace(_config(model), device="cuda")
    needed = sum(cache_bytes(config, torch.float32))
    monkeypatch.setattr(cache_memory, "available_bytes", lambda device: needed - 1)
    with pytest.raises(ConfigError, match="engine option num_kv_blocks: 24 .unset: max_num_seqs"):
        Engine(config, None, None)  # type: ignore[arg-type]
