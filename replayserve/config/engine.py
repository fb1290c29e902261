"""Typed, frozen configuration of the engine and of speculative decoding; the model's is in
`model.py` (the package re-exports all three).

Every combination is validated at construction, from the values alone (no memory is probed); an
error names the option that is wrong and what is allowed.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass
from typing import Any

from replayserve.config.checks import check_field_types, check_minimums
from replayserve.config.model import (
    DEVICES,
    DTYPES,
    MAMBA_CACHE_MODES,
    MAX_REPLAY_WINDOW,
    SSM_BACKENDS,
    ConfigError,
    ModelConfig,
    tensor_parallel_error,
)

logger = logging.getLogger(__name__)

SPEC_METHODS = ("ngram", "draft", "mtp", "custom")
# Set to 1, max_model_len may exceed the model's max_position_embeddings (with a warning), as
# vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN allows: Nemotron-H has no position embeddings to run out
# of, but the model was not trained on longer sequences.
ALLOW_LONG_MAX_MODEL_LEN = "REPLAYSERVE_ALLOW_LONG_MAX_MODEL_LEN"
# Prompt positions scored at once (engine/prompt_logprobs.py): bounds the (rows, vocab) logits a
# long chunk materializes (256 rows of a 131k vocabulary are 128 MiB in float32) and is the
# activation reserve's share for them (cache/sizing.py).
SCORE_ROWS = 256


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: `method` proposes up to `num_speculative_tokens` (k) drafts per decode
    row, verified in one step of 1 + k tokens. "ngram": prompt lookup; "draft": a smaller model
    (`model`); "mtp": the checkpoint's MTP layers; "custom": a `Proposer` object (tests)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1  # ngram: shortest suffix to match
    prompt_lookup_max: int = 3  # ngram: longest suffix to match
    model: str | None = None  # draft: the draft checkpoint's directory (same vocabulary)
    mtp_window: int = 256  # mtp: the last recorded positions the MTP attention sees (fewer: cheaper drafts)
    proposer: Any = None  # custom: a replayserve.speculative.proposers.Proposer

    def __post_init__(self) -> None:
        def fail(option: str, why: str) -> None:
            raise ConfigError(f"speculative option {option}: {why}")

        check_field_types(self, fail)
        if self.method not in SPEC_METHODS:
            fail("method", f"{self.method!r} is not one of {SPEC_METHODS}")
        if self.method == "draft" and not self.model:
            fail("model", "method 'draft' needs the draft checkpoint's directory")
        if self.method == "custom" and self.proposer is None:
            fail("proposer", "method 'custom' needs a Proposer object")
        if self.num_speculative_tokens < 1:
            fail("num_speculative_tokens", f"must be >= 1, got {self.num_speculative_tokens!r}")
        if self.mtp_window < 1:
            fail("mtp_window", f"must be >= 1 position, got {self.mtp_window!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            fail("prompt_lookup_min", f"need 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= "
                 f"prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SpeculativeConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - names)
        if unknown:
            raise ConfigError(f"speculative: unknown keys {unknown}; known: {sorted(names)}")
        if "method" not in raw or "num_speculative_tokens" not in raw:
            raise ConfigError("speculative needs 'method' and 'num_speculative_tokens'")
        return cls(**raw)

    @property
    def tokens_per_step(self) -> int:
        return 1 + self.num_speculative_tokens


def check_replay_window(window: int, tokens_per_step: int) -> None:
    """Raises ConfigError naming replay_window unless ReplaySSM's window W holds a decode row's
    `tokens_per_step` and fits the Triton step's ring. EngineConfig checks its own; a backend built
    from a hand-made layout (tests) checks through here."""
    if not tokens_per_step <= window <= MAX_REPLAY_WINDOW:
        raise ConfigError(f"engine option replay_window: {window} must be in [{tokens_per_step} (tokens per step), "
                          f"{MAX_REPLAY_WINDOW} (the kernel's limit)]")


def check_mamba_cache_mode(mode: str) -> None:
    """Raises ConfigError naming mamba_cache_mode unless it is one of MAMBA_CACHE_MODES. EngineConfig
    checks its own; a scheduler built directly (tests) checks through here."""
    if mode not in MAMBA_CACHE_MODES:
        raise ConfigError(f"engine option mamba_cache_mode: {mode!r} is not one of {MAMBA_CACHE_MODES}")


_ENGINE_MINIMUMS = dict.fromkeys(("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size",
                                  "num_kv_blocks", "replay_window", "num_mamba_cache_slots", "mamba_block_size",
                                  "tensor_parallel_size", "cpu_threads"), 1)


KV_CACHE_DTYPES = ("auto", "fp8")  # auto: the model dtype; fp8: float8_e4m3fn (cache/memory.py: kv_cache_torch_dtype)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs besides the weights; validated against the model at construction.
    A pure value: whether its caches fit in the device's memory is checked where the engine is built
    (`cache.memory.check_cache_fit`, called by `build.py`).

    Every field but `model` is the engine option of its name (`options.py` says what it does and
    holds LLM's default, which `resolve_options` turns into these)."""

    model: ModelConfig
    dtype: str = "bfloat16"
    device: str = "cpu"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    num_kv_blocks: int | None = None
    # CUDA: the share of the GPU's memory the engine may use; sizes the caches not given (cache/sizing.py).
    gpu_memory_utilization: float = 0.9
    ssm_backend: str = "baseline"
    # ReplaySSM's window W (ring entries a checkpoint is replayed over); None: resolved_replay_window.
    replay_window: int | None = None
    enable_prefix_caching: bool = False
    mamba_cache_mode: str = "none"
    num_mamba_cache_slots: int | None = None  # boundary-state slots; default max_num_seqs
    # Grid of cached Mamba states, a multiple of block_size; default lcm(block_size, chunk_size).
    mamba_block_size: int | None = None
    speculative: SpeculativeConfig | None = None
    # CUDA only: run every step eagerly instead of replaying CUDA graphs of decode steps.
    enforce_eager: bool = False
    # Plan and launch plain decode step N + 1 while the device runs step N (engine/engine.py).
    async_scheduling: bool = False
    # Ranks (processes) the model is split over; rank 0 runs the engine (distributed/).
    tensor_parallel_size: int = 1
    # CPU only: torch intra-op threads of each rank's process; LLM fills it in (cpu_threads.py).
    cpu_threads: int | None = None

    def __post_init__(self) -> None:
        def fail(option: str, why: str) -> None:
            raise ConfigError(f"engine option {option}: {why}")

        check_field_types(self, fail)
        # Optional sizes are None for their default, never 0 (which `or` would also turn into it).
        check_minimums(self, _ENGINE_MINIMUMS, fail)
        if self.dtype not in DTYPES:
            fail("dtype", f"{self.dtype!r} is not one of {DTYPES}")
        if not 0 < self.gpu_memory_utilization <= 1:
            fail("gpu_memory_utilization", f"must be a number in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.device.split(":")[0] not in DEVICES:
            fail("device", f"{self.device!r} is not one of {DEVICES}")
        if self.cpu_threads is not None and not self.device.startswith("cpu"):
            fail("cpu_threads", f"sets torch's CPU threads and applies only with device='cpu', not {self.device!r}; "
                 "leave it out")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            fail("kv_cache_dtype", f"{self.kv_cache_dtype!r} is not one of {KV_CACHE_DTYPES}")
        if self.ssm_backend not in SSM_BACKENDS:
            fail("ssm_backend", f"{self.ssm_backend!r} is not one of {SSM_BACKENDS}")
        if self.ssm_backend == "replay":
            check_replay_window(self.resolved_replay_window, self.tokens_per_step)
            if self.dtype == "float64" and self.device.startswith("cuda"):
                fail("dtype", "float64 with ssm_backend='replay' runs only on the CPU reference ops; "
                     "use float32, bfloat16 or float16 on CUDA")
        if (self.speculative is not None and self.speculative.method == "mtp"
                and not self.model.num_nextn_predict_layers):
            fail("speculative", "method 'mtp' needs a checkpoint with MTP layers (num_nextn_predict_layers = 1)")
        if self.async_scheduling and self.speculative is not None:
            fail("async_scheduling", "cannot be combined with speculative decoding: every decode step then "
                 "verifies drafts proposed on the host from the previous step's tokens, so no step could overlap; "
                 "turn one of them off")
        if self.tensor_parallel_size > 1:
            why = tensor_parallel_error(self.model, self.tensor_parallel_size)
            if why is None and self.async_scheduling:
                why = ("async_scheduling is not supported with tensor parallelism: the workers would have to "
                       "follow launched steps; turn one of them off")
            if why is not None:
                fail("tensor_parallel_size", why)
        check_mamba_cache_mode(self.mamba_cache_mode)
        if self.mamba_cache_mode != "none" and not self.enable_prefix_caching:
            fail("mamba_cache_mode", f"{self.mamba_cache_mode!r} keeps Mamba states for prefix hits and needs "
                 "enable_prefix_caching=True")
        if self.mamba_block_size is not None and self.mamba_block_size % self.block_size:
            fail("mamba_block_size", f"{self.mamba_block_size} must be a positive multiple of "
                 f"block_size={self.block_size}")
        if self.resolved_max_model_len < 2:
            fail("max_model_len", f"must be >= 2, got {self.resolved_max_model_len}")
        positions = self.model.max_position_embeddings
        if self.resolved_max_model_len > positions:
            if os.environ.get(ALLOW_LONG_MAX_MODEL_LEN) != "1":
                fail("max_model_len", f"{self.resolved_max_model_len} is above the model's max_position_embeddings="
                     f"{positions} (config.json), the longest sequence it was trained for; lower max_model_len, "
                     f"or set {ALLOW_LONG_MAX_MODEL_LEN}=1 to run longer sequences anyway")
            logger.warning("max_model_len=%d is above the model's max_position_embeddings=%d (allowed by %s=1): "
                           "outputs past %d tokens may be wrong", self.resolved_max_model_len, positions,
                           ALLOW_LONG_MAX_MODEL_LEN, positions)
        if self.resolved_num_kv_blocks < self.blocks_per_seq:
            fail("num_kv_blocks", f"{self.resolved_num_kv_blocks} blocks of {self.block_size} tokens cannot "
                 f"hold one sequence of max_model_len={self.resolved_max_model_len}; "
                 f"need at least {self.blocks_per_seq}")

    @property
    def sized_by_memory(self) -> bool:
        """On CUDA, the composition root (`build.py`) sizes the KV blocks and cached Mamba states not
        given from the memory free once the weights are loaded (`cache/sizing.py`). An engine
        assembled from such a config directly (`build.assemble_engine`: benchmarks) takes the
        defaults."""
        return self.device.startswith("cuda") and (
            self.num_kv_blocks is None or (self.mamba_cache_mode != "none" and self.num_mamba_cache_slots is None))

    @property
    def tokens_per_step(self) -> int:
        """T: tokens a decode row runs per step (1 + k with k speculative tokens)."""
        return self.speculative.tokens_per_step if self.speculative else 1

    @property
    def resolved_replay_window(self) -> int:
        """W: replay_window, else (Mamba2) 32 for plain decode and 16 with speculative decoding.

        A flush rewrites the checkpoint once every W tokens; with the flush in its own kernel, W = 32
        and W = 16 (the fold fused into the step kernel) ran plain decode equally fast within 0.5% at
        batch 128-256 on the H100 (Nemotron-H-8B shape; an earlier 2-4% gain for 32 was a timing
        artefact: docs/perf-log/2026-12-06-replayssm-window-and-flush.md), and 32 stayed. Verify
        steps keep the window they were measured with.

        Gated DeltaNet's kernels hold the ring's entries in tiles of R = W + T rounded up to a power
        of two (docs/replayssm.md, Gated DeltaNet): its default keeps R at 32, or 16 with
        speculation (doubled until W >= T), so no entry is padding. Not yet measured on a GPU.
        """
        if self.replay_window is not None:
            return self.replay_window
        if self.model.num_gated_delta_layers:
            ring = 16 if self.speculative else 32
            while ring - self.tokens_per_step < self.tokens_per_step:
                ring *= 2
            return ring - self.tokens_per_step
        return 16 if self.speculative else 32

    @property
    def resolved_num_mamba_cache_slots(self) -> int:
        """Boundary-state slots beside the live ones: 0 unless Mamba states are cached."""
        if self.mamba_cache_mode == "none":
            return 0
        return self.num_mamba_cache_slots or self.max_num_seqs

    @property
    def resolved_mamba_block_size(self) -> int:
        """Tokens between cached Mamba states: on the SSD chunk grid, so prefill emits them for free."""
        return self.mamba_block_size or math.lcm(self.block_size, self.model.chunk_size)

    @property
    def resolved_max_model_len(self) -> int:
        return self.max_model_len or self.model.max_position_embeddings

    @property
    def blocks_per_seq(self) -> int:
        return math.ceil(self.resolved_max_model_len / self.block_size)

    @property
    def resolved_num_kv_blocks(self) -> int:
        return self.num_kv_blocks or self.blocks_per_seq * self.max_num_seqs
