"""Triton routed experts: match ``topk_route_ref`` and ``fused_moe_ref`` in ``replayserve.ops.moe``.

Nothing here reads a device value on the host, and every buffer and grid is sized from the shapes
alone (T tokens, top_k, E experts), so one MoE layer can be captured in a CUDA graph:

1. The routing (``replayserve.ops.moe_route_triton``) gives each token's expert ids and weights and
   the (token, k) pairs sorted by expert in blocks of BLOCK_M rows (``moe_align_triton.align_by_expert``).
2. Two launches of one grouped GEMM over those blocks, a block's expert read from the device: the
   up projection with relu^2 in its epilogue (kept in x's dtype, as the reference keeps it), then
   the down projection times the routing weight, one row per pair in x's dtype (the reference
   rounds each expert's output to x's dtype too, before weighting).
   FP8 experts (float8_e4m3fn stacks, one float32 scale per expert; ``fused_moe_ref`` with scales): each
   weight tile is loaded as bytes and widened to x's dtype in registers (exact: every e4m3 value is
   a bf16, fp16 and fp32 value), the tensor-core product accumulates in fp32, and the block's
   expert scale multiplies the sums once, before the epilogue (every row of a block has the same
   expert). At decode sizes the kernel streams weights, so its time should follow their bytes
   (half of bf16's; not yet measured on a GPU: ``benchmarks/bench_moe.py --fp8``).
3. ``_sum_topk_kernel`` sums each token's top_k rows in fp32 in a fixed order and adds the shared
   expert's output. Writing (T * top_k, W) and reducing costs a pass over that buffer (2 bytes an
   element in bf16) but, unlike fp32 atomics into the output, gives the same bits on every run.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from replayserve.ops.moe import check_expert_scales
from replayserve.ops.moe_align_triton import align_by_expert


# The step's pair count only masks gathered rows: not specialised on (== 1, divisible by 16), which
# would compile variants mid-serving; nor the last scale's index (E or E - 1 by the step's folding).
@triton.jit(do_not_specialize=["num_pairs", "last_scale"])
def _grouped_gemm_kernel(
    a_ptr, w_ptr, w_scale_ptr, out_ptr, weights_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, n_out, k_in, pairs_per_row, last_scale,
    s_a_r, s_a_k, s_w_e, s_w_n, s_w_k, s_o_p, s_o_n,
    ACT: tl.constexpr, WEIGHTED: tl.constexpr, W_SCALED: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr,
):
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):  # past the last expert's blocks
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    live = pair < num_pairs
    row = (pair // pairs_per_row).to(tl.int64)  # x is read once per token, the intermediate per pair
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    if SWAP_AB:  # out^T = W x^T: the weight tile is the dot's left operand, (N, K) as stored (K-major)
        acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        up_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        a_ptrs = a_ptr + row[None, :] * s_a_r + offs_k[:, None] * s_a_k
        w_ptrs = w_ptr + expert * s_w_e + offs_n[:, None].to(tl.int64) * s_w_n + offs_k[None, :] * s_w_k
        for k0 in range(0, k_in, BLOCK_K):
            in_k = offs_k < k_in - k0
            a = tl.load(a_ptrs, mask=in_k[:, None] & live[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=(offs_n[:, None] < n_out) & in_k[None, :], other=0.0)
            acc_t = tl.dot(w.to(a.dtype), a, acc_t, input_precision=PRECISION)
            if ACT == 2:
                w_up = tl.load(w_ptrs + n_out * s_w_n, mask=(offs_n[:, None] < n_out) & in_k[None, :], other=0.0)
                up_t = tl.dot(w_up.to(a.dtype), a, up_t, input_precision=PRECISION)
            a_ptrs += BLOCK_K * s_a_k
            w_ptrs += BLOCK_K * s_w_k
        acc = tl.trans(acc_t)
        up = tl.trans(up_t)
    else:
        a_ptrs = a_ptr + row[:, None] * s_a_r + offs_k[None, :] * s_a_k
        w_ptrs = w_ptr + expert * s_w_e + offs_n[None, :].to(tl.int64) * s_w_n + offs_k[:, None] * s_w_k
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # SwiGLU's up half: rows n_out + n of the weight
        for k0 in range(0, k_in, BLOCK_K):
            in_k = offs_k < k_in - k0
            a = tl.load(a_ptrs, mask=live[:, None] & in_k[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=in_k[:, None] & (offs_n[None, :] < n_out), other=0.0)
            acc = tl.dot(a, w.to(a.dtype), acc, input_precision=PRECISION)  # FP8 widened exactly; else a no-op
            if ACT == 2:
                w_up = tl.load(w_ptrs + n_out * s_w_n, mask=in_k[:, None] & (offs_n[None, :] < n_out), other=0.0)
                up = tl.dot(a, w_up.to(a.dtype), up, input_precision=PRECISION)
            a_ptrs += BLOCK_K * s_a_k
            w_ptrs += BLOCK_K * s_w_k
    if W_SCALED:  # experts past the last scale are the folded shared expert's pieces: one stored scale
        w_scale = tl.load(w_scale_ptr + tl.minimum(expert, last_scale)).to(tl.float32)
        acc = acc * w_scale
        up = up * w_scale
    if ACT == 1:  # relu^2
        acc = tl.maximum(acc, 0.0)
        acc = acc * acc
    if ACT == 2:  # silu(gate) * up, each half rounded to x's dtype first as the reference's linear rounds it
        gate = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        up = up.to(out_ptr.dtype.element_ty).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
        acc = silu * up
    if WEIGHTED:
        acc = acc * tl.load(weights_ptr + pair, mask=live, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * s_o_p + offs_n[None, :] * s_o_n
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=live[:, None] & (offs_n[None, :] < n_out))


@triton.jit
def _sum_topk_kernel(
    pairs_ptr, add_ptr, out_ptr, width, s_p_p, s_add_t, s_o_t,
    TOP_K: tl.constexpr, HAS_ADD: tl.constexpr, BLOCK_W: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    mask = offs < width
    acc = tl.zeros([BLOCK_W], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(pairs_ptr + (t * TOP_K + k) * s_p_p + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_ADD:  # the reference rounds the routed sum to x's dtype, then adds in that dtype
        acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        acc += tl.load(add_ptr + t * s_add_t + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * s_o_t + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class GemmConfig:
    """Tiles and launch settings of the two grouped GEMMs (powers of two; tl.dot needs 16 and up)."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    # Decode tiles computed as out^T = W x^T: the (N, K) weight tile, K-major as stored, is the dot's left
    # operand (sm_90: a 64 x 16 wgmma) instead of a (K, N) right operand. Built for sm_90, a 16 x 64 x 256
    # FP8 tile of the plain form moves its weights through shared memory a byte at a time (128 byte
    # stores and loads per thread and K step); the swapped form loads them with cp.async. Untimed.
    swap_ab: bool = False


def default_config(num_pairs: int, num_experts: int, weight_bytes: int = 2, act_bytes: int = 2,
                   columns: int | None = None, sms: int = 132) -> GemmConfig:
    """Tiles by the mean pairs per expert: decode reads weights (narrow rows, deep K steps), prefill
    is compute bound (wide tiles, more warps). Untuned guesses: `benchmarks/bench_moe.py --sweep`
    measures the alternatives on the card. `weight_bytes`: 1 for FP8 experts, whose decode tiles
    take K steps twice as deep: half the steps of a 16-bit expert, each reading the same 256 bytes
    of a weight column, so the kernel gains whether a decode call is bound by bytes or by its
    chain of steps (not yet swept on a GPU: `bench_moe.py --fp8 --sweep`). `act_bytes`: the
    activations' element size; an activation tile stays at 16 x 256 bf16 (8 KiB), so float32
    activations on FP8 experts step 128 deep (four stages of fp32 A tiles 256 deep and two FP8
    weight tiles, widened for the dot, would crowd an H100's shared memory).

    `columns`: the narrower GEMM's output width (the experts' inner size or the model's width), and
    `sms` the card's multiprocessors: a decode call runs one program per (routed expert, column
    tile), so with few experts a token and narrow experts (Granite 4.0-H-Tiny: 6 of 64, 512 wide:
    48 programs of 64 columns on 132 SMs) the tiles narrow, down to 16 columns, until every SM has
    a program; wide experts keep 64 (Nemotron-3-Nano: 8 x 29)."""
    mean = num_pairs / num_experts
    if mean <= 16:
        block_k = min(256 // weight_bytes, 256 * 2 // act_bytes)
        block_n, live = 64, min(num_pairs, num_experts)
        while columns is not None and block_n > 16 and live * -(-columns // block_n) < sms:
            block_n //= 2
        return GemmConfig(block_m=16, block_n=block_n, block_k=block_k, num_warps=4, num_stages=4)
    if mean <= 64:
        return GemmConfig(block_m=32 if mean <= 32 else 64, block_n=64, block_k=64, num_warps=4, num_stages=4)
    # H200 sweep, Nano's shape at 2048 tokens (96 pairs an expert): 1065 us against 1185 us for
    # the 64-row, 8-warp tiles this replaced.
    return GemmConfig(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=3)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def config_for(x: Tensor, w_up: Tensor, w_down: Tensor, num_pairs: int, num_experts: int) -> GemmConfig:
    """``default_config`` for these operands: their element sizes, the narrower GEMM's columns (w_down
    is (E, W, I)) and, on CUDA, the card's multiprocessors."""
    sms = _sm_count(x.device.index if x.device.index is not None else torch.cuda.current_device()) if x.is_cuda else 132
    return default_config(num_pairs, num_experts, w_up.element_size(), x.element_size(), min(w_down.shape[1:]), sms)


def fused_moe_triton(x: Tensor, w_up: Tensor, w_down: Tensor, ids: Tensor, weights: Tensor,
                     add: Tensor | None = None, config: GemmConfig | None = None,
                     aligned: tuple[Tensor, Tensor, Tensor] | None = None,
                     scales: tuple[Tensor, Tensor] | None = None, swiglu: bool = False) -> Tensor:
    """``fused_moe_ref`` on the GPU, rounded to x's dtype, plus ``add`` (the shared expert); with
    ``scales``, its FP8 form (FP8 weights, dequantized in the kernel).

    Arguments:
        x: (T, W) fp32, bf16 or fp16, rows may be strided.
        w_up: (E, I, W) in x's dtype, or float8_e4m3fn with ``scales``; any strides; (E, 2I, W)
            gate then up with ``swiglu``.
        w_down: (E, W, I) likewise.
        ids: (T, top_k) integer expert ids.
        weights: (T, top_k) routing weights.
        add: optional (T, W) added after the routed sum is rounded to x's dtype, as the reference's
            ``routed.to(x.dtype) + shared`` does.
        config: the GEMMs' tiles; by default ``default_config`` of the shapes.
        aligned: ``align_by_expert(ids, E, config.block_m)`` when the caller has it (the decode
            router makes it in its routing kernel).
        scales: (up, down) per-expert weight scales of FP8 stacks, each (E_s,) float32 on x's
            device with 1 <= E_s <= E: expert e is scaled by scale[min(e, E_s - 1)] (``expert_scale``).
            Read on the device: no host sync.
        swiglu: silu(gate) * up experts (Granite 4.0-H's) instead of relu^2.

    Returns:
        (T, W) contiguous in x.dtype.
    """
    num_tokens, width = x.shape
    num_experts, inner, _ = w_up.shape
    inner //= 2 if swiglu else 1
    top_k = ids.shape[1]
    if w_up.shape[2] != width or w_down.shape != (num_experts, width, inner):
        raise ValueError(f"w_up {tuple(w_up.shape)} / w_down {tuple(w_down.shape)} do not fit x of width {width}")
    check_expert_scales(w_up, w_down, scales)
    out = torch.empty(num_tokens, width, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    num_pairs = num_tokens * top_k
    if aligned is not None and config is None:
        raise ValueError("aligned blocks come with the config whose block_m they were made for")
    cfg = config or config_for(x, w_up, w_down, num_pairs, num_experts)
    sorted_pairs, block_expert, num_padded = aligned or align_by_expert(ids, num_experts, cfg.block_m)
    weights = weights.reshape(-1).contiguous()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 models: no TF32 rounding, as PyTorch's
    common = dict(W_SCALED=scales is not None, PRECISION=precision, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                  BLOCK_K=cfg.block_k, SWAP_AB=cfg.swap_ab, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    up_scale, down_scale = scales or (None, None)
    last_scale = 0 if scales is None else up_scale.numel() - 1
    inter = torch.empty(num_pairs, inner, dtype=x.dtype, device=x.device)
    _grouped_gemm_kernel[(block_expert.numel(), triton.cdiv(inner, cfg.block_n))](
        x, w_up, up_scale, inter, weights, sorted_pairs, block_expert, num_padded, num_pairs, inner, width, top_k,
        last_scale, *x.stride(), *w_up.stride(), *inter.stride(), ACT=2 if swiglu else 1, WEIGHTED=False, **common,
    )
    per_pair = torch.empty(num_pairs, width, dtype=x.dtype, device=x.device)
    _grouped_gemm_kernel[(block_expert.numel(), triton.cdiv(width, cfg.block_n))](
        inter, w_down, down_scale, per_pair, weights, sorted_pairs, block_expert, num_padded, num_pairs, width, inner,
        1, last_scale, *inter.stride(), *w_down.stride(), *per_pair.stride(), ACT=0, WEIGHTED=True, **common,
    )
    if add is not None and (add.shape != out.shape or add.stride(1) != 1):
        raise ValueError(f"add must be ({num_tokens}, {width}) with unit column stride, got {tuple(add.shape)}")
    block_w = min(1024, triton.next_power_of_2(width))
    _sum_topk_kernel[(num_tokens, triton.cdiv(width, block_w))](
        per_pair, add if add is not None else out, out, width, per_pair.stride(0),
        add.stride(0) if add is not None else 0, out.stride(0),
        TOP_K=top_k, HAS_ADD=add is not None, BLOCK_W=block_w, num_warps=4,
    )
    return out
