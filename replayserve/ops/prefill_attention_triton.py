"""Triton varlen causal attention over the paged KV cache, for prefill and mixed steps: matches
``paged_attention_ref`` in ``replayserve.ops.attention`` for any mix of sequences (prefill chunks of
any length, with or without a cached prefix, and decode/verify rows) in one launch.

Flash-attention style. One program per (query tile, KV head): the tile is TQ consecutive query tokens
of one sequence times the G = Hq / Hkv query heads of the KV head, packed into BLOCK_M = TQ * G rows
(as the decode kernel packs them), so every K/V tile gathered through the block table serves all G
heads (a decode row fills G rows of a tile instead of one). The program walks the keys in tiles of
BLOCK_N positions up to its last query's position only, with an online softmax in fp32 and tensor-
core products (fp32 accumulation): first the tiles every query of the tile sees in full, unmasked,
then the few tiles across the causal diagonal (and the end of the context), masked.

The grid needs no host sync and no per-step table. Sequence s is given the programs
``first(s) = query_start_loc[s] // TQ + s`` .. ``first(s + 1) - 1``: that is at least
ceil(q_len / TQ) of them (floor((a + n) / TQ) - floor(a / TQ) + 1 >= ceil(n / TQ)), so the grid
``T // TQ + S`` (host ints from the shapes) covers every tile, and a program finds its sequence by
a binary search of query_start_loc (log2 S scalar loads). Programs past a sequence's tiles, at most
one per sequence, exit at once. A table built by the runner would save those few programs and the
search but would tie the runner to TQ, which depends on the dtype, head_dim and GQA group chosen
here; this way the op takes exactly ``paged_attention_ref``'s arguments, and because the grid and
scratch follow from shapes alone a CUDA graph could capture it too.

Within a sequence the tiles run last first: the last sees the most keys, so the longest programs
start first and the short ones fill in behind them.

An FP8 KV cache's tiles are loaded as FP8 and widened to q's dtype for the tensor-core products;
its k_scale multiplies the softmax scale and its v_scale the output.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from replayserve.ops.attention_limits import prefill_kernel_head_dim

LOG2_E = math.log2(math.e)


@triton.jit
def _program_tile(qsl_ptr, num_seqs, TQ: tl.constexpr):
    """(sequence, tile index within it) of this program: the last s with first(s) <= program id."""
    pid = tl.program_id(0)
    lo = pid * 0  # int32 tensors from the start: num_seqs may arrive as a constant
    hi = lo + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(qsl_ptr + mid) // TQ + mid <= pid:
            lo = mid
        else:
            hi = mid - 1
    return lo, pid - (tl.load(qsl_ptr + lo) // TQ + lo)


@triton.jit
def _attend_key_tile(
    q, m_i, l_i, acc, key_tile, k_ptr, v_ptr, bt_row, s_bt_b, block_size, seq_len, q_pos, hk, qk_scale,
    s_k_b, s_k_s, s_k_h, s_k_d, s_v_b, s_v_s, s_v_h, s_v_d,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One step of the online softmax (log2 domain) over context positions key_tile * BLOCK_N + [0, BLOCK_N).
    MASKED: the tile may cross a query's causal limit or the context's end; positions past the context
    or behind a -1 table entry are never read (the cache there may hold anything, even NaN)."""
    pos = key_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    if MASKED:
        block = tl.load(bt_row + (pos // block_size) * s_bt_b, mask=pos < seq_len, other=-1).to(tl.int64)
        live = block >= 0
        block = tl.where(live, block, 0)
    else:
        block = tl.load(bt_row + (pos // block_size) * s_bt_b).to(tl.int64)
    offset = pos % block_size
    k_rows = k_ptr + (block * s_k_b + offset * s_k_s + hk * s_k_h)[:, None] + offs_d[None, :] * s_k_d
    v_rows = v_ptr + (block * s_v_b + offset * s_v_s + hk * s_v_h)[:, None] + offs_d[None, :] * s_v_d
    if MASKED:
        k = tl.load(k_rows, mask=live[:, None], other=0.0)
        v = tl.load(v_rows, mask=live[:, None], other=0.0)
    else:
        k = tl.load(k_rows)
        v = tl.load(v_rows)
    # To q's dtype for the products: an FP8 cache is widened exactly (its scales are folded into
    # qk_scale and the output's v_scale).
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        scores = tl.where(live[None, :] & (pos[None, :] <= q_pos[:, None]), scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# The sequence count and the block table's row stride (its width: the step's longest table) change
# every step; specialising on them (== 1, divisible by 16) would compile variants mid-serving.
@triton.jit(do_not_specialize=["num_seqs", "s_bt_s"])
def _paged_prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, qsl_ptr, sl_ptr, out_ptr,
    qk_scale, v_scale, num_seqs, group, block_size,
    s_q_t, s_q_h, s_q_d,
    s_k_b, s_k_s, s_k_h, s_k_d,
    s_v_b, s_v_s, s_v_h, s_v_d,
    s_bt_s, s_bt_b,
    s_o_t, s_o_h, s_o_d,
    TQ: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    hk = tl.program_id(1)
    seq, tile = _program_tile(qsl_ptr, num_seqs, TQ)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    n_tiles = tl.cdiv(q_len, TQ)
    if tile >= n_tiles:  # a spare program of this sequence (module docstring)
        return
    q_off = (n_tiles - 1 - tile) * TQ  # last tile first
    seq_len = tl.load(sl_ptr + seq)
    cached = seq_len - q_len  # positions before this step's queries

    # Row m: query token q_off + m // group, head m % group of KV head hk.
    offs_m = tl.arange(0, BLOCK_M)
    tok = q_off + offs_m // group
    head = hk * group + offs_m % group
    real = (offs_m < TQ * group) & (tok < q_len)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (q_start + tok)[:, None] * s_q_t + head[:, None] * s_q_h + offs_d[None, :] * s_q_d,
                mask=real[:, None], other=0.0)
    q_pos = cached + tok  # each query's position: it sees positions 0 .. q_pos

    # A finite floor keeps exp2(m_old - m_new) a number while every score seen so far is masked.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * s_bt_s
    # Positions up to the tile's first query are seen by all its queries (and lie inside the context):
    # whole key tiles of them need no mask. The rest, up to the tile's last query, are masked.
    unmasked = (cached + q_off + 1) // BLOCK_N
    end = tl.cdiv(cached + tl.minimum(q_off + TQ, q_len), BLOCK_N)
    for key_tile in range(0, unmasked):
        m_i, l_i, acc = _attend_key_tile(
            q, m_i, l_i, acc, key_tile, k_ptr, v_ptr, bt_row, s_bt_b, block_size, seq_len, q_pos, hk, qk_scale,
            s_k_b, s_k_s, s_k_h, s_k_d, s_v_b, s_v_s, s_v_h, s_v_d,
            BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, MASKED=False, DOT_PRECISION=DOT_PRECISION)
    for key_tile in range(unmasked, end):
        m_i, l_i, acc = _attend_key_tile(
            q, m_i, l_i, acc, key_tile, k_ptr, v_ptr, bt_row, s_bt_b, block_size, seq_len, q_pos, hk, qk_scale,
            s_k_b, s_k_s, s_k_h, s_k_d, s_v_b, s_v_s, s_v_h, s_v_d,
            BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, MASKED=True, DOT_PRECISION=DOT_PRECISION)

    seen = l_i > 0.0
    o = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None] * v_scale, 0.0)  # sum p v_q v_scale
    out = out_ptr + (q_start + tok)[:, None] * s_o_t + head[:, None] * s_o_h + offs_d[None, :] * s_o_d
    tl.store(out, o.to(out_ptr.dtype.element_ty), mask=real[:, None])


def _tiles(dtype: torch.dtype, head_dim: int, on_gpu: bool) -> dict[str, int]:
    """BLOCK_M (query rows: tokens x GQA heads), BLOCK_N (key positions), num_warps, num_stages.

    Not yet timed on the H200 (``benchmarks/bench_prefill_attention.py --variants`` tries others): the
    half-precision sizes are the usual flash-attention forward ones for sm_90, checked for fit by
    compiling for sm_90 without a GPU (Triton 3.7, ``benchmarks/kernel_resources.py``'s method): bf16
    Dh 128 takes 246 registers per thread and 97 KiB of shared memory, Dh 64 183 registers, none
    spilled (4 warps spill at Dh 64). fp32 (an exact ``ieee`` product, no tensor cores) needs small
    tiles: 64 x 32 spilled 1.8 KiB per thread at Dh 128, 32 x 32 none. In the interpreter the tiles
    are small, so that short test sequences still cross many query and key tiles.
    """
    if not on_gpu:
        return {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    if dtype == torch.float32:
        if head_dim <= 128:
            return {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
        return {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 8, "num_stages": 2}
    if head_dim <= 128:
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
    return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2}


def paged_prefill_attention_triton(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    scale: float,
    tiles: dict[str, int] | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> Tensor:
    """``paged_attention_ref`` on the GPU for any step: causal GQA attention of packed sequences of any
    number of query tokens (prefill chunks, with or without a cached prefix, and decode rows alike).

    Arguments:
        q: (T, Hq, Dh) the query tokens of all sequences concatenated; fp32, bf16 or fp16; Dh a power
            of two in [16, 256].
        k_cache, v_cache: (num_blocks, block_size, Hkv, Dh), any strides, any block_size >= 1,
            Hq % Hkv == 0; query head h reads KV head h // (Hq // Hkv). Read in q's dtype: 16/32-bit, or
            float8_e4m3fn holding k / k_scale and v / v_scale (widened exactly).
        block_tables: (S, max_blocks) int32/int64 on the device, padded with -1.
        query_start_loc: (S+1,) int32/int64 on the device, non-decreasing from 0, at most T at the end;
            sequence s owns q tokens [query_start_loc[s], query_start_loc[s+1]) (q_len of them, may be 0).
        seq_lens: (S,) int32/int64 on the device: each sequence's context INCLUDING this step's q_len
            query tokens (seq_len >= q_len), whose K/V are already in the cache; query i sees
            positions 0 .. seq_len - q_len + i.
        scale: multiplier applied to q.k scores.
        tiles: overrides of ``_tiles`` (BLOCK_M, BLOCK_N, num_warps, num_stages), for tests and tuning.
        k_scale, v_scale: an FP8 cache's per-tensor scales (1.0 for other caches): the scores are
            (q . k_q) * scale * k_scale and the output v_scale * sum p v_q. Host floats, fixed per model.

    Returns:
        (T, Hq, Dh) in q.dtype; fp32 scores, softmax and accumulation (the probabilities are rounded to
        q's dtype for the P.V product, as in flash attention). Tokens that belong to no sequence
        (index >= query_start_loc[S]) are not written. Nothing is checked on the device: a -1 table
        entry inside seq_len is skipped, where the reference raises.
    """
    tokens, num_q_heads, head_dim = q.shape
    rows = block_tables.shape[0]
    num_kv_heads = k_cache.shape[2]
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    if not prefill_kernel_head_dim(head_dim):
        raise ValueError(f"head_dim {head_dim} is not supported: it must be a power of two in [16, 256] "
                         "(paged_attention_ref takes any)")
    if k_cache.shape != v_cache.shape or k_cache.shape[3] != head_dim:
        raise ValueError(f"caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} must be "
                         f"(num_blocks, block_size, Hkv, {head_dim})")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype} and v_cache {v_cache.dtype}: they must be one dtype")
    if query_start_loc.shape != (rows + 1,) or seq_lens.shape != (rows,):
        raise ValueError(f"query_start_loc {tuple(query_start_loc.shape)} and seq_lens {tuple(seq_lens.shape)} "
                         f"must be ({rows + 1},) and ({rows},) for {rows} block-table rows")
    out = torch.empty_like(q)
    if rows == 0 or tokens == 0:
        return out
    group = num_q_heads // num_kv_heads
    config = {**_tiles(q.dtype, head_dim, q.is_cuda), **(tiles or {})}
    block_m = max(config.pop("BLOCK_M"), triton.next_power_of_2(group))
    tq = block_m // group  # query tokens per tile
    _paged_prefill_kernel[(tokens // tq + rows, num_kv_heads)](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        float(scale) * k_scale * LOG2_E, float(v_scale), rows, group, k_cache.shape[1],
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        TQ=tq, BLOCK_M=block_m, HEAD_DIM=head_dim,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", **config,
    )
    return out
