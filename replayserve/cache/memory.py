"""What the KV cache and the Mamba state slots cost, checked against free memory when the engine is
built (`build.py`), before any pool or tensor is sized by it: an oversized `num_kv_blocks` must be
an error, not an allocation the OS kills."""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from replayserve.config import ConfigError, EngineConfig
from replayserve.models.mtp_kv import mtp_attention_blocks, mtp_kv_shape
from replayserve.models.sharding import local_model_config
from replayserve.ssm.layout import GatedDeltaLayout, MambaLayout


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def kv_cache_torch_dtype(config: EngineConfig, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype for a model in `dtype`: float8_e4m3fn with kv_cache_dtype "fp8", else `dtype`."""
    return torch.float8_e4m3fn if config.kv_cache_dtype == "fp8" else dtype


def mtp_cache_bytes(config: EngineConfig, dtype: torch.dtype, per_rank: bool = False) -> int:
    """The MTP proposer's cache (`models/mtp_kv.py`): keys and values of `mtp_window + k` positions
    per running sequence for each attention block of the MTP stack; 0 without MTP speculation.
    per_rank: one tensor-parallel rank's (its slice of the KV heads), as `cache_bytes_for`'s."""
    spec = config.speculative
    if spec is None or spec.method != "mtp":
        return 0
    m = config.model
    if per_rank and config.tensor_parallel_size > 1:
        m = local_model_config(m, 0, config.tensor_parallel_size)
    shape = mtp_kv_shape(m, config.max_num_seqs, spec.mtp_window + spec.num_speculative_tokens)
    return 2 * mtp_attention_blocks(config.model) * _nbytes(shape, dtype)


def cache_bytes(config: EngineConfig, dtype: torch.dtype) -> tuple[int, int]:
    """(KV cache bytes, recurrent (Mamba2 or Gated DeltaNet) state bytes) that the runner allocates for
    `config` in `dtype`."""
    return cache_bytes_for(config, dtype, config.resolved_num_kv_blocks, config.resolved_num_mamba_cache_slots)


def cache_bytes_for(config: EngineConfig, dtype: torch.dtype, num_kv_blocks: int,
                    num_cached_states: int, per_rank: bool = False) -> tuple[int, int]:
    """`cache_bytes` with `num_kv_blocks` KV blocks and `num_cached_states` boundary-state slots
    instead of the config's (`sizing.py` prices candidate sizes with it). per_rank: the caches
    of one tensor-parallel rank, which holds its slice's KV heads and Mamba heads (every rank's
    slice has the same shapes) on its own GPU; else the whole model's, which the ranks of one
    host hold between them."""
    m = config.model
    if per_rank and config.tensor_parallel_size > 1:
        m = local_model_config(m, 0, config.tensor_parallel_size)
    # One KV block and one state slot more than the pools hand out: the runner's pad block and pad
    # slot of padded decode rows (the allocation test keeps this in step with the runner).
    kv_shape = (num_kv_blocks + 1, config.block_size, m.num_key_value_heads, m.head_dim)
    kv = 2 * m.num_attention_layers * _nbytes(kv_shape, kv_cache_torch_dtype(config, dtype))
    num_slots = config.max_num_seqs + num_cached_states + 1
    replay = config.ssm_backend == "replay"
    if m.num_gated_delta_layers:  # ssm/gated_delta_baseline.py, ssm/gated_delta_replay.py
        gdn = GatedDeltaLayout.from_config(m, num_slots, dtype, tokens_per_step=config.tokens_per_step,
                                           window=config.resolved_replay_window if replay else 0,
                                           max_rows=config.max_num_seqs)
        per_layer = _nbytes(gdn.conv_state_shape, gdn.act_dtype) + _nbytes(gdn.ssm_state_shape, gdn.state_dtype)
        cursors = 0
        if replay:  # rings of the recent k, delta and g; three cursors per slot shared by all layers
            per_layer += (_nbytes(gdn.k_ring_shape, gdn.act_dtype) + _nbytes(gdn.delta_ring_shape, gdn.state_dtype)
                          + _nbytes(gdn.gate_ring_shape, gdn.state_dtype))
            cursors = _nbytes(gdn.cursor_shape, torch.int32) * 2 + _nbytes(gdn.cursor_shape, torch.bool)
        elif gdn.tokens_per_step > 1:  # the baseline keeps one state per verified position of each row
            per_layer += _nbytes(gdn.spec_states_shape, gdn.state_dtype)
        return kv, per_layer * gdn.num_layers + cursors
    layout = MambaLayout.from_config(m, num_slots, dtype,
                                     window=config.resolved_replay_window if replay else 0,
                                     tokens_per_step=config.tokens_per_step)
    act, state = layout.act_dtype, layout.state_dtype
    per_layer = _nbytes(layout.conv_state_shape, act) + _nbytes(layout.ssm_state_shape, state)
    cursors = 0
    if replay:  # rings of the recent x, dt and B; three cursors per slot shared by all layers
        per_layer += (_nbytes(layout.x_ring_shape, act) + _nbytes(layout.dt_ring_shape, state)
                      + _nbytes(layout.b_ring_shape, act))
        cursors = _nbytes(layout.cursor_shape, torch.int32) * 2 + _nbytes(layout.cursor_shape, torch.bool)
    elif layout.tokens_per_step > 1:  # the baseline keeps one state per verified position
        per_layer += _nbytes(layout.ssm_state_shape, state) * layout.tokens_per_step
    return kv, per_layer * layout.num_layers + cursors


def _host_available_bytes() -> int:
    """MemAvailable, capped by a cgroup v2 limit (containers); physical memory where neither is readable."""
    available = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    cgroup = Path("/sys/fs/cgroup")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            available = min(available, int(limit) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return available


def available_bytes(device: torch.device) -> int | None:
    """Bytes that can still be allocated on `device`; None for CUDA where torch sees no GPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] if torch.cuda.is_available() else None
    return _host_available_bytes()


def cache_fit_error(config: EngineConfig) -> str | None:
    """Why the KV cache and the Mamba states of `config` do not fit in free memory, or None."""
    device = torch.device(config.device)
    dtype = getattr(torch, config.dtype)
    kv, mamba = cache_bytes(config, dtype)
    mtp = mtp_cache_bytes(config, dtype)  # allocated after the pools, on the same device
    free = available_bytes(device)
    if free is None or kv + mamba + mtp <= free:
        return None
    default = "" if config.num_kv_blocks else " (unset: max_num_seqs x the blocks of one max_model_len sequence)"
    return (f"{config.resolved_num_kv_blocks}{default} KV blocks of {config.block_size} tokens need {kv:,} bytes "
            f"and the Mamba state slots {mamba:,} more" + (f", the MTP proposer's cache {mtp:,} more" if mtp else "")
            + f", {kv + mamba + mtp:,} bytes in all, but {device} has {free:,} "
            "bytes available; lower num_kv_blocks (or max_num_seqs, max_model_len)")


def check_cache_fit(config: EngineConfig) -> None:
    """Raises ConfigError naming num_kv_blocks when the caches of `config`'s sizes (defaults for the
    unset ones) would not fit in the device's free memory."""
    if (why := cache_fit_error(config)) is not None:
        raise ConfigError(f"engine option num_kv_blocks: {why}")
