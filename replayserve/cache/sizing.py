"""`gpu_memory_utilization`: on CUDA, the KV blocks and cached Mamba states that are not given are
sized from the memory left once the weights are loaded, as vLLM (V1) sizes its KV cache.

    budget = total * gpu_memory_utilization - held by this process (weights) - activation reserve

The fraction is this engine's share of the card, as in vLLM: other processes on the same GPU do
not shrink it, but what it plans must be free now (else a ConfigError says how much others hold).
Without prefix caching no more KV blocks are made than `max_num_seqs` sequences of `max_model_len`
can use (the CPU default); with it, the whole budget is spent, since more blocks keep more prefixes.

The live Mamba slots (one per running sequence, `max_num_seqs`), the pad block and the pad slot
must exist whatever the budget, so they come off first. The rest buys whole *units*: the KV blocks
of one `max_model_len` sequence plus the boundary states a cached prompt of that length keeps:
one (`align` keeps a prompt's last grid point) or one per `mamba_block_size` tokens (`all`). This
is the CPU defaults' ratio (`max_num_seqs` sequences' blocks and `max_num_seqs` states, for
`align`). Bytes left over after the last whole unit become KV blocks. A size that is given is kept
and the other one takes the rest. On the CPU nothing is measured: the defaults of `EngineConfig`
stay (enough KV blocks for `max_num_seqs` full sequences, `max_num_seqs` cached states) and
`gpu_memory_utilization` is not used.

Byte counts come from `memory.py` (what the runner allocates); the activation reserve is an
estimate from the shapes, not a profile: if a step runs out of memory, lower
`gpu_memory_utilization` or `max_num_batched_tokens`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

import torch

from replayserve.cache.memory import cache_bytes_for, check_cache_fit, mtp_cache_bytes
from replayserve.config import SCORE_ROWS, ConfigError, EngineConfig
from replayserve.ops.attention_limits import prefill_kernel_head_dim
from replayserve.ops.dtypes import compute_dtype

logger = logging.getLogger(__name__)

GiB = 1024**3


@dataclass(frozen=True)
class CachePlan:
    """What `plan_cache_sizes` chose and why, in blocks, slots and bytes."""

    num_kv_blocks: int
    num_mamba_cache_slots: int  # boundary-state slots (0 when Mamba states are not cached)
    kv_bytes: int  # as `cache_memory.cache_bytes` counts them: pad block and pad slot included
    mamba_bytes: int
    budget: int  # bytes the caches may take
    held: int  # bytes this process held when measured (weights)
    activation_reserve: int

    def apply(self, config: EngineConfig) -> EngineConfig:
        """`config` with the planned sizes, validated and checked against free memory like given ones."""
        slots = self.num_mamba_cache_slots if config.mamba_cache_mode != "none" else config.num_mamba_cache_slots
        sized = dataclasses.replace(config, num_kv_blocks=self.num_kv_blocks, num_mamba_cache_slots=slots)
        check_cache_fit(sized)
        return sized

    def describe(self, config: EngineConfig) -> str:
        return (f"gpu_memory_utilization={config.gpu_memory_utilization}: {self.budget / GiB:.2f} GiB for caches "
                f"({self.held / GiB:.2f} GiB held after loading weights, {self.activation_reserve / GiB:.2f} GiB "
                f"kept for activations): {self.num_kv_blocks} KV blocks of {config.block_size} tokens "
                f"({self.kv_bytes / GiB:.2f} GiB), {config.max_num_seqs} live + {self.num_mamba_cache_slots} cached "
                f"Mamba state slots ({self.mamba_bytes / GiB:.2f} GiB)")


def activation_reserve(config: EngineConfig) -> int:
    """Bytes a step of `max_num_batched_tokens` tokens may hold besides the weights and caches (an
    estimate): a few hidden-size tensors per token and the widest mixer's intermediates, the SSD
    scan's per-chunk matrices, the prefill attention's scores over `max_model_len` keys where the
    reference op runs it (it materializes them; the Triton kernel, for fp32/bf16/fp16 and
    power-of-two head_dim, keeps them on chip), and the logits of the sampled rows and of prompt
    scoring."""
    m, t, length = config.model, config.max_num_batched_tokens, config.resolved_max_model_len
    size = getattr(torch, config.dtype).itemsize
    wide = compute_dtype(getattr(torch, config.dtype)).itemsize
    mixers = [2 * m.intermediate_size]
    if m.num_mamba_layers:
        in_proj = 2 * m.mamba_intermediate_size + 2 * m.n_groups * m.ssm_state_size + m.mamba_num_heads
        mixers.append(in_proj + m.conv_dim)
    if m.num_gated_delta_layers:  # in_proj's q k v, z, b and a, and the conv's output
        v_dim = m.linear_num_value_heads * m.linear_value_head_dim
        mixers.append(2 * m.gated_delta_conv_dim + v_dim + 2 * m.linear_num_value_heads)
    if "moe" in m.layer_types:
        mixers.append(2 * m.num_experts_per_tok * m.moe_intermediate_size + m.moe_shared_expert_intermediate_size)
    if m.num_attention_layers:
        mixers.append(2 * (m.num_attention_heads + 2 * m.num_key_value_heads) * m.head_dim)
    reserve = t * (4 * m.hidden_size + max(mixers)) * size
    if m.num_mamba_layers:
        chunks = math.ceil(t / m.chunk_size)
        reserve += 2 * chunks * m.mamba_num_heads * (m.chunk_size**2 + m.mamba_head_dim * m.ssm_state_size) * wide
    attention_kernel = config.dtype in ("float32", "bfloat16", "float16") and prefill_kernel_head_dim(m.head_dim)
    if m.num_attention_layers and not attention_kernel:
        queries = min(t, length)
        reserve += 2 * m.num_attention_heads * (queries * length + 2 * length * m.head_dim) * wide
    rows = min(t, config.max_num_seqs * config.tokens_per_step) + SCORE_ROWS
    return reserve + 3 * rows * m.vocab_size * wide  # logits, log-softmax and a filtered copy


def plan_cache_sizes(config: EngineConfig, free: int, total: int, own: int) -> CachePlan:
    """Sizes the KV blocks and cached Mamba states `config` leaves unset (module docstring) from
    the device's `free` and `total` bytes and the `own` bytes this process holds, measured after
    the weights are loaded. A pure function.

    Raises:
        ConfigError naming gpu_memory_utilization when the budget cannot hold one sequence, or
        when what it plans is not free on the device.
    """
    dtype = getattr(torch, config.dtype)
    reserve = activation_reserve(config)
    # The MTP proposer's cache is allocated after the pools: it comes off first.
    budget = int(total * config.gpu_memory_utilization) - own - reserve - mtp_cache_bytes(config, dtype, per_rank=True)

    def cost(blocks: int, slots: int) -> int:
        return sum(cache_bytes_for(config, dtype, blocks, slots, per_rank=True))  # each rank has its own GPU

    fixed = cost(0, 0)
    per_block, per_slot = cost(1, 0) - fixed, cost(0, 1) - fixed
    cached = config.mamba_cache_mode != "none"
    states_per_seq = (0 if not cached else math.ceil(config.resolved_max_model_len / config.resolved_mamba_block_size)
                      if config.mamba_cache_mode == "all" else 1)
    blocks, slots = config.num_kv_blocks, config.num_mamba_cache_slots if cached else 0
    room = budget - fixed
    if blocks is None and slots is None:
        units = room // (config.blocks_per_seq * per_block + states_per_seq * per_slot)
        slots = units * states_per_seq
        blocks = (room - slots * per_slot) // per_block
    elif blocks is None:
        blocks = (room - slots * per_slot) // per_block
    elif slots is None:
        slots = (room - blocks * per_block) // per_slot if per_slot else config.max_num_seqs
    if not config.enable_prefix_caching and config.num_kv_blocks is None:
        blocks = min(blocks, config.max_num_seqs * config.blocks_per_seq)  # more could never be used
    if blocks < config.blocks_per_seq or slots < (1 if cached else 0):
        need = fixed + config.blocks_per_seq * per_block + states_per_seq * per_slot
        raise ConfigError(
            f"engine option gpu_memory_utilization: {config.gpu_memory_utilization} of {total / GiB:.2f} GiB leaves "
            f"{max(budget, 0) / GiB:.2f} GiB for caches ({own / GiB:.2f} GiB held by this process, "
            f"{reserve / GiB:.2f} GiB kept for activations of max_num_batched_tokens="
            f"{config.max_num_batched_tokens}); one sequence of "
            f"max_model_len={config.resolved_max_model_len} needs {need / GiB:.2f} GiB: raise gpu_memory_utilization "
            "or lower max_model_len, max_num_batched_tokens or max_num_seqs")
    kv, mamba = cache_bytes_for(config, dtype, blocks, slots, per_rank=True)
    if kv + mamba + reserve > free:
        raise ConfigError(
            f"engine option gpu_memory_utilization: {config.gpu_memory_utilization} of {total / GiB:.2f} GiB plans "
            f"{(kv + mamba) / GiB:.2f} GiB of caches and {reserve / GiB:.2f} GiB for activations, but only "
            f"{free / GiB:.2f} GiB are free ({max(total - free - own, 0) / GiB:.2f} GiB held by other processes): "
            "lower gpu_memory_utilization or give num_kv_blocks")
    return CachePlan(blocks, slots, kv, mamba, budget, own, reserve)


def size_caches(config: EngineConfig, pending: int = 0) -> EngineConfig:
    """`config` with its unset cache sizes planned from the CUDA device's memory now (after the
    weights are loaded) and logged; any other config unchanged. pending: bytes this engine will
    still allocate besides its caches (a draft model), counted as held and not free."""
    if not config.sized_by_memory:
        return config
    device = torch.device(config.device)
    torch.cuda.empty_cache()  # loading may leave freed blocks in torch's cache, which mem_get_info counts as used
    free, total = torch.cuda.mem_get_info(device)
    plan = plan_cache_sizes(config, free - pending, total, own=torch.cuda.memory_reserved(device) + pending)
    logger.info(plan.describe(config))
    return plan.apply(config)
