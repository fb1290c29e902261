"""The engine options, declared once: each is an `LLM` keyword argument, the `EngineConfig` field of
the same name and a flag of `replayserve demo | generate | serve`, unless it is LLM-only (`warmup`).

`cli.py` builds its flags and their help from this table. Tests hold the rest equal to it:
`LLM.__init__`'s signature (kept explicit for IDEs) and docstring, `EngineConfig`'s fields and
defaults, README's list of flags.

Three user-facing defaults are not the frozen config's: dtype "auto", device None and
mamba_cache_mode None are resolved from the machine and the model by `resolve_options`, as is
speculative's dict into a `SpeculativeConfig`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from replayserve.config.engine import KV_CACHE_DTYPES, SpeculativeConfig
from replayserve.config.model import (
    DEVICES,
    DTYPES,
    MAMBA_CACHE_MODES,
    MAX_REPLAY_WINDOW,
    SSM_BACKENDS,
    ConfigError,
    ModelConfig,
)

logger = logging.getLogger(__name__)

_LIKE_LLM = object()  # an EngineConfig default or type that is the LLM's


@dataclass(frozen=True)
class EngineOption:
    """One engine option. `help` is its user-facing description, the same for `LLM`'s docstring
    and the command line's --help (which adds a default that is not None)."""

    name: str
    type: Any  # LLM's annotation
    default: Any  # LLM's and the command line's
    help: str
    choices: tuple[str, ...] | None = None  # the command line's; EngineConfig checks the values it takes
    flag: str | None = None  # the command line's; default: --name with dashes
    metavar: str | None = None
    llm_only: bool = False  # no EngineConfig field and no flag
    # EngineConfig's, where `resolve_options` turns the user-facing value into another.
    config_default: Any = _LIKE_LLM
    config_type: Any = _LIKE_LLM

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    @property
    def field_default(self) -> Any:
        """EngineConfig's default for this option."""
        return self.default if self.config_default is _LIKE_LLM else self.config_default

    @property
    def field_type(self) -> Any:
        """EngineConfig's annotation for this option."""
        return self.type if self.config_type is _LIKE_LLM else self.config_type


ENGINE_OPTIONS: dict[str, EngineOption] = {o.name: o for o in (
    EngineOption("dtype", str, "auto", "weights and activations; auto: bfloat16 on CUDA, float32 on CPU",
                 choices=("auto", *DTYPES), config_default="bfloat16"),
    EngineOption("device", str | None, None, "where the model runs (default: cuda when torch sees a GPU, else cpu)",
                 choices=DEVICES, config_default="cpu", config_type=str),
    EngineOption("max_num_seqs", int, 64, "requests decoded together"),
    EngineOption("max_num_batched_tokens", int, 2048, "tokens per step: prefill chunks plus decode rows"),
    EngineOption("max_model_len", int | None, None,
                 "prompt plus output tokens (default: the model's limit, max_position_embeddings in config.json)"),
    EngineOption("block_size", int, 16, "tokens per KV block"),
    EngineOption("kv_cache_dtype", str, "auto",
                 "the KV cache's dtype: auto (the model's) or fp8 (float8_e4m3fn, half the bytes of a 16-bit cache; "
                 "keys and values are divided by the checkpoint's k_scale and v_scale, else 1.0, before rounding; "
                 "the Triton attention kernels widen it in registers, the scales folded into the softmax scale and "
                 "the output)",
                 choices=KV_CACHE_DTYPES),
    EngineOption("num_kv_blocks", int | None, None,
                 "KV blocks (default: on CUDA sized by gpu_memory_utilization, on CPU enough for max_num_seqs "
                 "full sequences)"),
    EngineOption("gpu_memory_utilization", float, 0.9,
                 "on CUDA, the share of the GPU's memory, in (0, 1], this engine may use: KV blocks and cached Mamba "
                 "states that are not given fill what the weights and an activation reserve leave (the numbers "
                 "are logged); on CPU the defaults stay"),
    EngineOption("ssm_backend", str, "baseline",
                 "Mamba2 and Gated DeltaNet decode: baseline (the state read and written every step) or replay "
                 "(ReplaySSM: a checkpoint plus rings of the last replay_window tokens' inputs, the state written "
                 "on a flush)",
                 choices=SSM_BACKENDS),
    EngineOption("replay_window", int | None, None,
                 f"ReplaySSM's window: tokens between flushes, from tokens per step (1 + speculative tokens) to "
                 f"{MAX_REPLAY_WINDOW} (default for Mamba2 32, or 16 with speculative decoding; for Gated DeltaNet "
                 f"32 or 16 minus tokens per step)"),
    EngineOption("enable_prefix_caching", bool, False,
                 "reuse the KV blocks and Mamba states of cached prompt prefixes"),
    EngineOption("mamba_cache_mode", str | None, None,
                 "which Mamba states prefix caching keeps: none (so a hybrid model never hits), align (where a step "
                 "ends on a block boundary; prefill chunks end on them) or all (at every block boundary); needs "
                 "enable_prefix_caching (default: align when prefix caching is on and the model has Mamba layers, "
                 "logged, else none)",
                 choices=MAMBA_CACHE_MODES, config_default="none", config_type=str),
    EngineOption("num_mamba_cache_slots", int | None, None,
                 "state slots for cached Mamba states (default: max_num_seqs)"),
    EngineOption("mamba_block_size", int | None, None,
                 "tokens between cached Mamba states, a multiple of block_size; prefix hits are multiples of it "
                 "(default: lcm(block_size, the model's SSD chunk size))"),
    EngineOption("speculative", dict | None, None,
                 'speculative decoding, e.g. {"method": "ngram", "num_speculative_tokens": 3}; methods ngram, draft '
                 '(with "model": a draft checkpoint) and mtp, further keys those of SpeculativeConfig: decode rows '
                 "verify up to num_speculative_tokens proposed tokens per step, losslessly",
                 metavar="JSON", config_type=SpeculativeConfig | None),
    EngineOption("enforce_eager", bool, False,
                 "on CUDA, run decode steps eagerly instead of replaying a CUDA graph per padded batch size (1, 2, "
                 "4, 8, multiples of 16 up to max_num_seqs; captured at start by the warm-up)"),
    EngineOption("async_scheduling", bool, False,
                 "plan and launch the next plain decode step while the device runs this one, its input tokens "
                 "taken from this step's on the device; outputs are the same. Steps with prefill chunks, Mamba "
                 "boundary states (prefix caching) or penalties / min_tokens run synchronously; not with "
                 "speculative decoding or tensor parallelism"),
    EngineOption("tensor_parallel_size", int, 1,
                 "processes (GPUs on CUDA) the model is split over (heads, inner dimensions, vocabulary): this one "
                 "(rank 0) runs the engine and starts the others, which run their slices of each step; gloo on the "
                 "CPU, NCCL on CUDA (one GPU per rank)"),
    EngineOption("cpu_threads", int | None, None,
                 "on the CPU, torch's intra-op threads per rank (torch's setting is process-wide); default: "
                 "OMP_NUM_THREADS when set, else the cores idle at the first engine's start-up, at least 1 (torch's "
                 "one per core collapses on a busy machine; cpu_threads.py says why); the choice is logged; refused "
                 "on CUDA",
                 flag="--threads"),
    EngineOption("warmup", bool, True,
                 "on CUDA, before returning, compile the Triton kernels and capture the CUDA graphs that serving will "
                 "run, with dummy requests that leave no trace (Engine.warm_up; what it ran and its time are "
                 "logged), instead of during the first requests; the CPU compiles nothing and skips it",
                 llm_only=True),
)}

# EngineConfig fields that are no option, and where they come from.
DERIVED_FIELDS = {"model": "ModelConfig.from_dir(LLM's model directory)"}


def resolve_options(options: Mapping[str, Any], model: ModelConfig, cuda_available: bool) -> dict[str, Any]:
    """`EngineConfig`'s keyword arguments but `model`, from `LLM`'s keyword arguments but `model`.

    Options not given take their default; dtype "auto", device None and mamba_cache_mode None are
    resolved for this machine (`cuda_available`) and `model`; speculative's dict becomes a
    `SpeculativeConfig`; LLM-only options are left out. Values are checked by `EngineConfig`.
    Pure but for a log line. Raises ConfigError naming an option that does not exist.
    """
    unknown = sorted(set(options) - set(ENGINE_OPTIONS))
    if unknown:
        raise ConfigError(f"unknown engine options {unknown}; known: {sorted(ENGINE_OPTIONS)}")
    resolved = {o.name: options.get(o.name, o.default) for o in ENGINE_OPTIONS.values() if not o.llm_only}
    if resolved["device"] is None:
        resolved["device"] = "cuda" if cuda_available else "cpu"
    if resolved["dtype"] == "auto":  # a device of the wrong type is EngineConfig's to name
        cuda = isinstance(resolved["device"], str) and resolved["device"].startswith("cuda")
        resolved["dtype"] = "bfloat16" if cuda else "float32"
    if resolved["mamba_cache_mode"] is None:
        hybrid = resolved["enable_prefix_caching"] and model.num_recurrent_layers > 0
        resolved["mamba_cache_mode"] = "align" if hybrid else "none"
        if hybrid:
            logger.info("prefix caching: mamba_cache_mode='align' (the model has recurrent layers, Mamba2 or Gated "
                        "DeltaNet; 'none' would never hit)")
    if resolved["speculative"] is not None:
        if not isinstance(resolved["speculative"], dict):
            raise ConfigError(f"engine option speculative: must be a dict of SpeculativeConfig's keys, got "
                              f"{resolved['speculative']!r:.80}")
        resolved["speculative"] = SpeculativeConfig.from_dict(resolved["speculative"])
    return resolved
