"""The composition root: the one place an engine is built, from options to running parts.

    options -> EngineConfig               resolved (`config/options.py`), frozen, validated from its
                                          values alone; the model's family from the registry
            -> caches that are given      checked against free memory, before anything loads
            -> tensor-parallel workers    started: they load their slices while this rank loads its own
            -> the model                  the family's class, loaded (rank 0's slice with workers)
            -> caches that are not given  sized from the memory left (CUDA, `cache/sizing.py`)
            -> runner                     rank 0's mirroring runner with workers (`distributed/`)
            -> proposer                   a draft model gets an engine of its own, built here alike
            -> Engine(config, runner, proposer, tokenizer)

`LLM`, the server's engine-core process (`build_engine`) and each tensor-parallel worker
(`build_worker`, from `tp_worker.py`) build through it; nothing below it builds an engine, starts a
process or probes memory for a config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch
from torch import nn

from replayserve.cache.memory import check_cache_fit
from replayserve.cache.sizing import size_caches
from replayserve.config import ENGINE_OPTIONS, EngineConfig, ModelConfig, resolve_options
from replayserve.config.builtin_models import resolve_model
from replayserve.cpu_threads import ThreadChoice, apply_cpu_threads, choose_cpu_threads
from replayserve.distributed.group import Workers
from replayserve.distributed.runner_proxy import DriverRunner, WorkerRunner
from replayserve.engine.engine import Engine
from replayserve.engine.runner import Runner
from replayserve.models.loader import load_model
from replayserve.models.registry import family_of
from replayserve.speculative.draft import draft_engine_config, draft_memory_bytes
from replayserve.speculative.factory import hidden_store_for, make_proposer
from replayserve.speculative.proposers import Proposer
from replayserve.tokenizer import Tokenizer


@dataclass
class BuiltEngine:
    """An engine and what it was built from; `close` stops its tensor-parallel workers."""

    model_dir: str  # the model directory (a built-in name resolved)
    config: EngineConfig  # final: the cache sizes planned from memory, the CPU threads chosen
    engine: Engine
    tokenizer: Tokenizer | None
    workers: Workers | None  # ranks 1.. with tensor parallelism
    cpu_threads: ThreadChoice | None  # on the CPU: the intra-op threads chosen and why

    def close(self) -> None:
        """Stops the tensor-parallel workers (also done at exit); the engine cannot step after it."""
        if self.workers is not None:
            self.workers.close()


def build_engine(model: str, options: Mapping[str, Any]) -> BuiltEngine:
    """Builds the engine of `model` (a model directory or a built-in name) with `LLM`'s engine
    options (`config/options.py`; those not given take their defaults), in the order of the module
    docstring. On failure nothing is left running.

    Raises:
        ConfigError naming the option at fault, or the model_type no family in the registry runs.
    """
    model_dir = resolve_model(model)
    model_config = ModelConfig.from_dir(model_dir)
    family_of(model_config)  # a checkpoint no family runs is refused before anything loads
    config = EngineConfig(model=model_config, **resolve_options(options, model_config, torch.cuda.is_available()))
    if not config.sized_by_memory:
        check_cache_fit(config)
    cpu_threads = None
    if config.device.startswith("cpu"):  # chosen once the options it reads are known to be valid
        cpu_threads = choose_cpu_threads(config.cpu_threads, config.tensor_parallel_size)
        config = dataclasses.replace(config, cpu_threads=cpu_threads.count)
        apply_cpu_threads(cpu_threads)
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("engine option device: 'cuda' was asked for but torch sees no CUDA device")
    tokenizer = Tokenizer.from_dir(model_dir)
    workers = None
    if config.tensor_parallel_size > 1:
        workers = Workers.start(config, model_dir)  # they load their slices while this rank loads its own
    warmup = options.get("warmup", ENGINE_OPTIONS["warmup"].default)
    try:
        net = load_model(model_dir, getattr(torch, config.dtype), torch.device(config.device), 0,
                         config.tensor_parallel_size)
        spec = config.speculative
        draft = (draft_memory_bytes(_draft_config(config))
                 if spec is not None and spec.method == "draft" and config.sized_by_memory else 0)
        # CUDA: what the weights (and the draft model, loaded later) leave, before any cache is allocated
        config = size_caches(config, pending=draft)
        engine = assemble_engine(config, net, tokenizer, workers, warmup, fit_checked=True)
        if workers is not None:
            workers.connect(config)
        if warmup and config.device.startswith("cuda"):
            engine.warm_up()
    except BaseException:
        if workers is not None:
            workers.close()
        raise
    return BuiltEngine(model_dir, config, engine, tokenizer, workers, cpu_threads)


def assemble_engine(config: EngineConfig, model: nn.Module, tokenizer: Tokenizer | None,
                    workers: Workers | None = None, warmup: bool = False, fit_checked: bool = False) -> Engine:
    """The engine's parts for `config` (its cache sizes final) and `model`, loaded (rank 0's slice
    with `workers`): the runner, which allocates the caches, then the proposer (a draft model
    loaded after them, in an engine of its own, warmed up on CUDA with `warmup`), then the Engine.
    Benchmarks call it with a model of their own; a config whose sizes were left to memory then
    takes the defaults. The caches must fit in free memory: checked first unless `fit_checked`
    (`build_engine` checked them before loading the model, or when it planned them)."""
    if not fit_checked:
        check_cache_fit(config)
    hidden_store = hidden_store_for(config)
    runner = (Runner(config, model, hidden_store) if workers is None
              else DriverRunner(config, model, workers, hidden_store))
    spec = config.speculative
    draft_engine = _draft_engine(config, warmup) if spec is not None and spec.method == "draft" else None
    proposer = make_proposer(config, model, hidden_store, draft_engine)
    if proposer is not None and hidden_store is not None:  # MTP runs the target's model: on every rank
        proposer = runner.mirror(proposer)
    return Engine(config, runner, proposer, tokenizer)


def build_worker(config: EngineConfig, model: nn.Module, inbox: BinaryIO) -> tuple[WorkerRunner, Proposer | None]:
    """A tensor-parallel worker's parts (`tp_worker.py`) for rank 0's `config` (its device this
    rank's) and this rank's slice `model`: the runner that replays rank 0's calls from `inbox`, and
    the proposer when it runs the sharded model (MTP; others arrive as n-gram, `worker_config`)."""
    check_cache_fit(config)
    hidden_store = hidden_store_for(config)
    return WorkerRunner(config, model, inbox, hidden_store), make_proposer(config, model, hidden_store)


def _draft_config(target: EngineConfig) -> EngineConfig:
    assert target.speculative is not None and target.speculative.model is not None
    config = draft_engine_config(ModelConfig.from_dir(resolve_model(target.speculative.model)), target)
    family_of(config.model)
    return config


def _draft_engine(target: EngineConfig, warmup: bool) -> Engine:
    """The draft model's engine (speculative method "draft"): its sizes given by the target's
    (`draft_engine_config`), checked against free memory before it loads."""
    assert target.speculative is not None and target.speculative.model is not None
    config = _draft_config(target)
    check_cache_fit(config)
    model = load_model(resolve_model(target.speculative.model), getattr(torch, config.dtype),
                       torch.device(config.device))
    engine = assemble_engine(config, model, tokenizer=None, fit_checked=True)
    if warmup and config.device.startswith("cuda"):
        engine.warm_up()
    return engine
