"""Triton paged KV cache write and decode/verify attention: match ``write_kv_cache_ref`` and, for rows
of at most ``max_query_len`` query tokens, ``paged_attention_ref`` in ``replayserve.ops.attention``.

Both are CUDA-graph safe: grids come from tensor shapes and host integers only, every per-row
quantity (query range, context length, block table, slot) is read on the device, and scratch
sizes depend on shapes alone. A graph captured for a bucket of S rows of up to W query tokens
replays for any seq_lens, block tables, query_start_loc and slot mapping of those shapes.

Attention runs one program per (row, KV head, split). The program packs the G = Hq / Hkv query
heads of its KV head times the row's W query tokens into one (BLOCK_M >= 16, Dh) tile, so every
K/V tile it gathers through the block table serves all of them (one tensor-core product per
tile, fp32 accumulation), and runs an online softmax over its share of the context. With a single
split it writes the output; with several (few rows: splits fill the card) each writes a
normalised partial and its log-sum-exp, and ``_combine_kernel`` merges them. The split count is
a host choice from the row count and the block-table width, never from the data: a split whose
share of a short context is empty writes a zero-weight partial.

FP8 KV caches (float8_e4m3fn, per-tensor k_scale and v_scale): the write kernel stores
``to_fp8_cache``'s codes of the step's K/V, and attention loads FP8 tiles (half the bytes), widens
them to q's dtype in registers and folds the scales: k_scale into the softmax scale, v_scale into
the output.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from replayserve.ops.attention_limits import SHORT_ROW
from replayserve.ops.fp8 import FP8_DTYPE, FP8_MAX


@triton.jit
def _round_to_e4m3(x):
    """x (fp32, |x| <= 448) rounded to the nearest float8_e4m3fn value, ties to even, still in fp32.
    The interpreter's fp32 -> FP8 cast rounds wrongly (fp8_gemv_triton.py), but casts a value FP8
    holds exactly; rounding first gives the interpreter and the GPU the same codes. Adding and then
    subtracting 1.5 * 2^23 * quantum rounds |x| to a multiple of the quantum, the spacing of e4m3 in
    x's binade: 2^(e - 3) for 2^e <= |x|, and 2^-9 below 2^-6 (the subnormals)."""
    mag = tl.abs(x)
    mag_bits = mag.to(tl.int32, bitcast=True)
    exponent = tl.maximum((mag_bits >> 23) - 127, -6)
    shifter = (((exponent + 147) << 23) | 0x400000).to(tl.float32, bitcast=True)  # 1.5 * 2^(exponent - 3 + 23)
    rounded = (mag + shifter) - shifter
    # x's sign bit put back as a bit (negation is 0 - x): a value that rounds to zero stays -0.0 if
    # it was negative, as torch's cast keeps it.
    sign = x.to(tl.int32, bitcast=True) ^ mag_bits
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, k_inv_scale, v_inv_scale, block_size, num_heads, head_dim,
    s_k_t, s_k_h, s_k_d, s_v_t, s_v_h, s_v_d,
    s_kc_b, s_kc_s, s_kc_h, s_kc_d, s_vc_b, s_vc_s, s_vc_h, s_vc_d,
    FP8: tl.constexpr, FP8_LIMIT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token: writes nothing
        return
    block = slot // block_size
    offset = slot % block_size
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < num_heads)[:, None] & (offs_d < head_dim)[None, :]
    k = tl.load(k_ptr + t * s_k_t + offs_h[:, None] * s_k_h + offs_d[None, :] * s_k_d, mask=mask)
    v = tl.load(v_ptr + t * s_v_t + offs_h[:, None] * s_v_h + offs_d[None, :] * s_v_d, mask=mask)
    if FP8:  # to_fp8_cache: x * (1 / scale) in fp32, saturated (a plain cast of a larger value gives NaN); NaN stays
        k = _round_to_e4m3(tl.clamp(k.to(tl.float32) * k_inv_scale, -FP8_LIMIT, FP8_LIMIT, tl.PropagateNan.ALL))
        v = _round_to_e4m3(tl.clamp(v.to(tl.float32) * v_inv_scale, -FP8_LIMIT, FP8_LIMIT, tl.PropagateNan.ALL))
    kc = kc_ptr + block * s_kc_b + offset * s_kc_s + offs_h[:, None] * s_kc_h + offs_d[None, :] * s_kc_d
    vc = vc_ptr + block * s_vc_b + offset * s_vc_s + offs_h[:, None] * s_vc_h + offs_d[None, :] * s_vc_d
    tl.store(kc, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=mask)


def write_kv_cache_triton(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
                          k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """``write_kv_cache_ref`` on the GPU: scatter new K/V tokens into a paged cache, IN PLACE; into an
    FP8 cache, ``to_fp8_cache``'s codes of them.

    Arguments:
        k, v: (T, Hkv, Dh), any strides.
        k_cache, v_cache: (num_blocks, block_size, Hkv, Dh), any strides; values are cast to the
            cache dtype, or for float8_e4m3fn caches stored as ``x / scale`` rounded to the nearest
            FP8 value (ties to even), saturating at +-448; NaN stays NaN (on the GPU: the interpreter's
            cast has no FP8 NaN).
        slot_mapping: (T,) int32/int64 flat slot = block * block_size + offset; slot -1 (padding)
            writes nothing. Valid slots must be distinct.
        k_scale, v_scale: an FP8 cache's per-tensor scales (unused for other caches); host floats,
            fixed per model, so a captured graph keeps them.
    """
    if k.shape != v.shape:
        raise ValueError(f"k shape {tuple(k.shape)} != v shape {tuple(v.shape)}")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping must be ({k.shape[0]},), got {tuple(slot_mapping.shape)}")
    if k_cache.shape != v_cache.shape or k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} must be "
                         f"(num_blocks, block_size, {k.shape[1]}, {k.shape[2]})")
    fp8 = k_cache.dtype == FP8_DTYPE
    if fp8 != (v_cache.dtype == FP8_DTYPE):
        raise ValueError(f"k_cache {k_cache.dtype} and v_cache {v_cache.dtype}: both FP8 or neither")
    tokens, num_heads, head_dim = k.shape
    if tokens == 0:
        return
    _write_kv_kernel[(tokens,)](
        k, v, k_cache, v_cache, slot_mapping, 1.0 / k_scale, 1.0 / v_scale, k_cache.shape[1], num_heads, head_dim,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        FP8=fp8, FP8_LIMIT=FP8_MAX, BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


@triton.jit
def _row_queries(qsl_ptr, row, group, W: tl.constexpr, BLOCK_M: tl.constexpr):
    """The packed query vectors of one row: index m is query token m // group, head m % group of the
    KV head. Returns (first token, token and head-in-group of each m, real m: within the row)."""
    q_start = tl.load(qsl_ptr + row)
    n_q = tl.minimum(tl.load(qsl_ptr + row + 1) - q_start, W)
    offs_m = tl.arange(0, BLOCK_M)
    tok = offs_m // group
    real = (offs_m < group * W) & (tok < n_q)
    return q_start, n_q, tok, offs_m % group, real


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, qsl_ptr, sl_ptr, out_ptr, po_ptr, plse_ptr,
    scale, v_scale, group, head_dim, block_size,
    s_q_t, s_q_h, s_q_d,
    s_k_b, s_k_s, s_k_h, s_k_d,
    s_v_b, s_v_s, s_v_h, s_v_d,
    s_bt_s, s_bt_b,
    s_o_t, s_o_h, s_o_d,
    W: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    row = tl.program_id(0)
    hk = tl.program_id(1)
    split = tl.program_id(2)
    q_start, n_q, tok, head, real = _row_queries(qsl_ptr, row, group, W, BLOCK_M)
    head = hk * group + head
    seq_len = tl.load(sl_ptr + row)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    # Query `tok` (position seq_len - n_q + tok) sees positions below `limit`; padded m see none.
    limit = tl.where(real, seq_len - n_q + tok + 1, 0)
    q = tl.load(q_ptr + (q_start + tok)[:, None] * s_q_t + head[:, None] * s_q_h + offs_d[None, :] * s_q_d,
                mask=real[:, None] & mask_d[None, :], other=0.0)

    # This split's tiles of the context (seq_len 0, a padding row: none).
    n_tiles = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(n_tiles, NUM_SPLITS)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, n_tiles)
    # A finite floor keeps exp(m_old - m_new) a number while every score seen so far is masked.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = bt_ptr + row.to(tl.int64) * s_bt_s
    for tile in range(lo, hi):
        pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        block = tl.load(bt_row + (pos // block_size) * s_bt_b, mask=pos < seq_len, other=-1).to(tl.int64)
        # Positions past the context or behind a -1 table entry are never read: the cache there
        # may hold anything, even NaN. An FP8 cache is widened here, exactly (its scales are folded
        # into `scale` and `v_scale`).
        live = block >= 0
        block = tl.where(live, block, 0)
        offset = pos % block_size
        mask_kv = live[:, None] & mask_d[None, :]
        k = tl.load(k_ptr + (block * s_k_b + offset * s_k_s + hk * s_k_h)[:, None] + offs_d[None, :] * s_k_d,
                    mask=mask_kv, other=0.0).to(q_ptr.dtype.element_ty)
        v = tl.load(v_ptr + (block * s_v_b + offset * s_v_s + hk * s_v_h)[:, None] + offs_d[None, :] * s_v_d,
                    mask=mask_kv, other=0.0).to(q_ptr.dtype.element_ty)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        scores = tl.where(live[None, :] & (pos[None, :] < limit[:, None]), scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    seen = l_i > 0.0
    # sum p (v_q v_scale) = v_scale sum p v_q; the splits' merge is a weighted mean, so it keeps the factor.
    o = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None] * v_scale, 0.0)
    if NUM_SPLITS == 1:
        out = out_ptr + (q_start + tok)[:, None] * s_o_t + head[:, None] * s_o_h + offs_d[None, :] * s_o_d
        tl.store(out, o.to(out_ptr.dtype.element_ty), mask=real[:, None] & mask_d[None, :])
    else:  # partial (row, hk, split): padded (BLOCK_M, BLOCK_D) tiles, contiguous
        base = ((row * tl.num_programs(1) + hk) * NUM_SPLITS + split).to(tl.int64) * BLOCK_M
        offs_m = tl.arange(0, BLOCK_M)
        tl.store(po_ptr + (base + offs_m)[:, None] * BLOCK_D + offs_d[None, :], o)
        tl.store(plse_ptr + base + offs_m, tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf")))


@triton.jit
def _combine_kernel(
    qsl_ptr, out_ptr, po_ptr, plse_ptr, group, head_dim, s_o_t, s_o_h, s_o_d,
    W: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """out = sum_j e^{lse_j} o_j / sum_j e^{lse_j} over the splits of one (row, KV head)."""
    row = tl.program_id(0)
    hk = tl.program_id(1)
    q_start, n_q, tok, head, real = _row_queries(qsl_ptr, row, group, W, BLOCK_M)
    head = hk * group + head
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    base = ((row * tl.num_programs(1) + hk) * NUM_SPLITS).to(tl.int64) * BLOCK_M
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    weight = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for split in range(NUM_SPLITS):
        at = base + split * BLOCK_M + offs_m
        lse = tl.load(plse_ptr + at)
        o = tl.load(po_ptr + at[:, None] * BLOCK_D + offs_d[None, :])
        m_new = tl.maximum(m_i, lse)
        alpha = tl.exp(m_i - m_new)
        beta = tl.exp(lse - m_new)  # 0 for an empty split (lse = -inf)
        acc = acc * alpha[:, None] + o * beta[:, None]
        weight = weight * alpha + beta
        m_i = m_new
    seen = weight > 0.0
    o = tl.where(seen[:, None], acc / tl.where(seen, weight, 1.0)[:, None], 0.0)
    out = out_ptr + (q_start + tok)[:, None] * s_o_t + head[:, None] * s_o_h + offs_d[None, :] * s_o_d
    tl.store(out, o.to(out_ptr.dtype.element_ty), mask=real[:, None] & (offs_d < head_dim)[None, :])


MAX_SPLITS = 16


def _attention_config(block_m: int, block_d: int) -> dict[str, int]:
    """BLOCK_N (context positions per K/V tile, gathered token by token: any block_size works),
    num_warps and num_stages of the attention kernel.

    Measured on an H200 (bf16, Hq 32, Hkv 8, Dh 128, block 16, in a CUDA graph, 2026-12-04): 64
    positions, 4 warps, 2 stages was the best of (32, 64, 128) x (4, 8) warps x (2, 3) stages at
    every size tried: 512 rows x 4096 positions 2.08 ms (4.1 TB/s of K/V read, against a 4.3 TB/s
    copy), 64 rows x 4096 with W = 4 273 us (3.9 TB/s), 8 x 4096 with W = 4 49 us, 1 x 4096 21 us.
    """
    return {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few splits, so tests cover the combine
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_num_splits(rows: int, num_kv_heads: int, max_context: int, tile: int, device: torch.device) -> int:
    """Splits of the context per (row, KV head): about four programs per SM in all, at most one per
    K/V tile of the longest context the block table can hold, and 1 once the rows fill the card.
    On an H200, one row of 4096 positions took 135 us unsplit, 41 with 4 splits, 21 with 16 (the
    default) and 26 with 32; 8 rows of W = 4: 160, 60, 57 and 75 us, 49 with the default 9."""
    programs = rows * num_kv_heads
    wanted = triton.cdiv(4 * _num_sms(device), max(programs, 1))
    return max(1, min(wanted, MAX_SPLITS, triton.cdiv(max_context, tile)))


def paged_decode_attention_triton(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    scale: float,
    max_query_len: int = SHORT_ROW,
    num_splits: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> Tensor:
    """``paged_attention_ref`` for decode and speculative-verify rows (1..max_query_len query tokens).

    Arguments:
        q: (T, Hq, Dh) the query tokens of all rows concatenated; fp32, bf16 or fp16.
        k_cache, v_cache: (num_blocks, block_size, Hkv, Dh), any strides, Hq % Hkv == 0; query head
            h reads KV head h // (Hq // Hkv). Read in q's dtype: 16/32-bit, or float8_e4m3fn holding
            k / k_scale and v / v_scale (widened exactly).
        block_tables: (S, max_blocks) int32/int64 on the device, padded with -1.
        query_start_loc: (S+1,) int32/int64 on the device; row s owns q tokens
            [query_start_loc[s], query_start_loc[s+1]), at most ``max_query_len`` of them (a graph
            bucket of uniform width W passes arange(S + 1) * W).
        seq_lens: (S,) int32/int64 on the device: each row's context INCLUDING this step's n query
            tokens, whose K/V are already in the cache; query i (0 <= i < n) sees positions
            < seq_len - n + i + 1. A row with seq_len 0 is padding: it reads nothing and its
            tokens come out zero.
        scale: multiplier applied to q.k scores.
        max_query_len: W, a host constant (the bucket's width); a row with more tokens gets only its
            first W computed. Smaller W packs fewer query vectors per program.
        num_splits: splits of each row's context (None: ``default_num_splits``).
        k_scale, v_scale: an FP8 cache's per-tensor scales (1.0 for other caches): the scores are
            (q . k_q) * scale * k_scale and the output v_scale * sum p v_q. Host floats, fixed per
            model, so a captured graph keeps them.

    Returns:
        (T, Hq, Dh) in q.dtype; fp32 scores, softmax and accumulation (the probabilities are rounded
        to q's dtype for the P.V product, as in flash attention). Tokens that belong to no row
        (index >= query_start_loc[S]) are not written. Nothing is checked on the device: a -1
        table entry inside seq_len is skipped, where the reference raises.
    """
    tokens, num_q_heads, head_dim = q.shape
    rows, max_blocks = block_tables.shape
    block_size, num_kv_heads = k_cache.shape[1:3]
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    if k_cache.shape != v_cache.shape or k_cache.shape[3] != head_dim:
        raise ValueError(f"caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} must be "
                         f"(num_blocks, block_size, Hkv, {head_dim})")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype} and v_cache {v_cache.dtype}: they must be one dtype")
    if query_start_loc.shape != (rows + 1,) or seq_lens.shape != (rows,):
        raise ValueError(f"query_start_loc {tuple(query_start_loc.shape)} and seq_lens {tuple(seq_lens.shape)} "
                         f"must be ({rows + 1},) and ({rows},) for {rows} block-table rows")
    if max_query_len < 1:
        raise ValueError(f"max_query_len must be >= 1, got {max_query_len}")
    out = torch.empty_like(q)
    if rows == 0 or tokens == 0:
        return out
    group = num_q_heads // num_kv_heads
    block_m = max(16, triton.next_power_of_2(group * max_query_len))
    block_d = max(16, triton.next_power_of_2(head_dim))
    config = _attention_config(block_m, block_d)
    splits = num_splits or default_num_splits(rows, num_kv_heads, max_blocks * block_size, config["BLOCK_N"],
                                              q.device)
    if splits > 1:
        partial_o = torch.empty((rows, num_kv_heads, splits, block_m, block_d), dtype=torch.float32, device=q.device)
        partial_lse = torch.empty((rows, num_kv_heads, splits, block_m), dtype=torch.float32, device=q.device)
    else:
        partial_o = partial_lse = out  # unused
    meta = {"W": max_query_len, "NUM_SPLITS": splits, "BLOCK_M": block_m, "BLOCK_D": block_d}
    _paged_decode_kernel[(rows, num_kv_heads, splits)](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, partial_o, partial_lse,
        float(scale) * k_scale, float(v_scale), group, head_dim, block_size,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", **meta, **config,
    )
    if splits > 1:
        _combine_kernel[(rows, num_kv_heads)](
            query_start_loc, out, partial_o, partial_lse, group, head_dim, *out.stride(), **meta,
        )
    return out
