"""Paged KV cache writes and causal GQA attention over a flattened batch: the references, the
fixed-shape decode ops, and the two entry points a step's attention calls, which run the kernels
of ``paged_attention_triton`` and ``prefill_attention_triton`` where they serve
(``dispatch.use_triton``).

An FP8 KV cache (float8_e4m3fn K and V caches) holds ``k / k_scale`` and ``v / v_scale`` rounded to
FP8, with per-tensor scales (a checkpoint's ``k_scale``/``v_scale``, or 1.0). The entry points
quantize the step's K and V on the way in (``to_fp8_cache``; on the kernels' path inside the KV
write kernel) and fold the scales into the math: q . (k_q k_scale) is (q . k_q) times
``scale * k_scale``, and sum p (v_q v_scale) is v_scale times sum p v_q, so the attention itself
reads the FP8 cache widened to the compute dtype. FP8 caches take the same path as 16-bit ones:
the kernels where they serve (they widen the FP8 tiles in registers and take the scales as host
floats, fixed per model, so graphs keep them), else the dense decode op and the references.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from replayserve.ops.attention_limits import SHORT_ROW, prefill_kernel_head_dim
from replayserve.ops.dispatch import use_triton
from replayserve.ops.dtypes import compute_dtype
from replayserve.ops.fp8 import FP8_DTYPE, FP8_MAX


def write_kv_cache_ref(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Scatter new K/V tokens into a paged cache, IN PLACE.

    Arguments:
        k, v: (T, Hkv, Dh).
        k_cache, v_cache: (num_blocks, block_size, Hkv, Dh); values are cast to
            the cache dtype.
        slot_mapping: (T,) int64 flat slot = block * block_size + offset; tokens
            with slot -1 (padding) are skipped. Valid slots must be distinct.
    """
    if k.shape != v.shape:
        raise ValueError(f"k shape {tuple(k.shape)} != v shape {tuple(v.shape)}")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping must be ({k.shape[0]},), got {tuple(slot_mapping.shape)}")
    block_size = k_cache.shape[1]
    # A -1 slot would otherwise index from the end and silently overwrite the
    # last block, so padding has to be dropped before indexing.
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks = slots // block_size
    offsets = slots % block_size
    k_cache[blocks, offsets] = k[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = v[keep].to(v_cache.dtype)


def paged_attention_ref(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    scale: float,
    batch_decodes: bool | None = None,
) -> Tensor:
    """Causal GQA attention of a flattened batch of sequences against a paged KV cache.

    Arguments:
        q: (T, Hq, Dh) the query tokens of all sequences concatenated.
        k_cache, v_cache: (num_blocks, block_size, Hkv, Dh), Hq % Hkv == 0; query
            head h reads kv head h // (Hq // Hkv).
        block_tables: (S, max_blocks) int32/int64, padded with -1; position p of
            sequence s lives at block block_tables[s, p // block_size], offset
            p % block_size.
        query_start_loc: (S+1,) int; sequence s owns q rows
            [query_start_loc[s], query_start_loc[s+1]).
        seq_lens: (S,) int, total context length of each sequence INCLUDING this
            step's query tokens, whose K/V must already be in the cache. The
            q_len query rows are positions seq_len - q_len .. seq_len - 1 and each
            attends to cache positions 0 .. its own position.
        scale: multiplier applied to q.k scores.
        batch_decodes: attend all sequences of at most ``SHORT_ROW`` query tokens (decode and verify
            rows) in one padded batch (None: on CUDA, where a per-sequence loop costs a launch per op;
            on CPU the loop is faster).

    Returns:
        (T, Hq, Dh) in q.dtype; scores, softmax and the weighted sum of V are in
        compute_dtype(q.dtype).
    """
    num_q_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    group = num_q_heads // num_kv_heads
    block_size = k_cache.shape[1]
    cdt = compute_dtype(q.dtype)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    if len(starts) != len(lens) + 1:
        raise ValueError("query_start_loc must have one more entry than seq_lens")
    out = torch.zeros_like(q)
    if batch_decodes is None:
        batch_decodes = q.is_cuda
    short = [s for s in range(len(lens)) if 1 <= starts[s + 1] - starts[s] <= SHORT_ROW] if batch_decodes else []
    if short:  # decode and verify rows: one batched gather instead of a loop
        _attend_short_rows(q, k_cache, v_cache, block_tables, starts, lens, short, scale, out)
    for s, seq_len in enumerate(lens):
        q_start, q_end = starts[s], starts[s + 1]
        q_len = q_end - q_start
        if q_len == 0 or (q_len <= SHORT_ROW and batch_decodes):
            continue
        if q_len > seq_len:
            raise ValueError(f"sequence {s}: {q_len} query tokens but seq_len {seq_len}")
        pos = torch.arange(seq_len, device=q.device)
        blocks = block_tables[s].long()[pos // block_size]
        if bool((blocks < 0).any()):
            raise ValueError(f"sequence {s}: block table too short for seq_len {seq_len}")
        offsets = pos % block_size
        k = k_cache[blocks, offsets].to(cdt).repeat_interleave(group, dim=1)  # (seq_len, Hq, Dh)
        v = v_cache[blocks, offsets].to(cdt).repeat_interleave(group, dim=1)
        qs = q[q_start:q_end].to(cdt)
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        q_pos = pos[seq_len - q_len :]
        allowed = pos[None, :] <= q_pos[:, None]  # (q_len, seq_len)
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


def _attend_short_rows(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, starts: list[int],
                       lens: list[int], rows: list[int], scale: float, out: Tensor) -> None:
    """``paged_attention_ref`` for the sequences `rows` (each 1..SHORT_ROW query tokens), padded to
    the longest context and the most queries, and masked; writes their rows of `out`."""
    group = q.shape[1] // k_cache.shape[2]
    block_size = k_cache.shape[1]
    cdt = compute_dtype(q.dtype)
    dev = q.device
    q_lens = [starts[s + 1] - starts[s] for s in rows]
    if any(q_len > lens[s] for q_len, s in zip(q_lens, rows, strict=True)):
        raise ValueError("a sequence has more query tokens than its seq_len")
    qmax = max(q_lens)
    index = torch.tensor(rows, device=dev)
    seq_lens = torch.tensor([lens[s] for s in rows], device=dev)
    n_q = torch.tensor(q_lens, device=dev)
    pos = torch.arange(int(seq_lens.max()), device=dev)
    blocks = block_tables[index].long()[:, pos // block_size]  # (n, L)
    valid = pos[None, :] < seq_lens[:, None]
    if bool((blocks[valid] < 0).any()):
        raise ValueError("a decode row's block table is too short for its seq_len")
    blocks = blocks.clamp(min=0)
    n, hkv, dh = len(rows), k_cache.shape[2], k_cache.shape[3]
    # (n, Hkv, L, Dh) with the query heads of a KV head grouped: matmuls, no head repeat.
    k = k_cache[blocks, pos % block_size].to(cdt).permute(0, 2, 1, 3)
    v = v_cache[blocks, pos % block_size].to(cdt).permute(0, 2, 1, 3)
    v = v.masked_fill(~valid[:, None, :, None], 0.0)  # padding may hold anything, even NaN: 0 * NaN = NaN
    i = torch.arange(qmax, device=dev)
    real = i[None, :] < n_q[:, None]  # (n, Qmax)
    q_rows = torch.tensor([starts[s] for s in rows], device=dev)[:, None] + torch.where(real, i[None, :], 0)
    q_pos = seq_lens[:, None] - n_q[:, None] + i[None, :]  # (n, Qmax): position of each query
    allowed = (pos[None, None, :] <= q_pos[:, :, None]) & valid[:, None, :]  # (n, Qmax, L)
    qg = q[q_rows].to(cdt).view(n, qmax, hkv, group, dh).permute(0, 2, 1, 3, 4).reshape(n, hkv, qmax * group, dh)
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale  # (n, Hkv, Qmax * group, L)
    mask = allowed[:, None, :, None, :].expand(n, hkv, qmax, group, allowed.shape[-1]).reshape(scores.shape)
    att = torch.matmul(torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1), v)
    att = att.view(n, hkv, qmax, group, dh).permute(0, 2, 1, 3, 4).reshape(n, qmax, hkv * group, dh)
    out[q_rows[real]] = att[real].to(q.dtype)


def write_kv_cache_dense(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """``write_kv_cache_ref`` without padding: every slot is valid (padded rows point at a pad
    block that no sequence reads), so it needs no mask and no host sync (CUDA-graph safe).

    Arguments: as ``write_kv_cache_ref``; slot_mapping (T,) int64, all >= 0.
    """
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def decode_attention_dense(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                           scale: float) -> Tensor:
    """``paged_attention_ref`` for rows of the same number of query tokens W (decode: W = 1, a
    speculative verify: 1 + k), with every shape fixed by the inputs' shapes: no host sync, so
    a CUDA graph can capture it. It reads each row's whole block table (padded rows: a table
    of pad blocks and seq_len >= W), so it costs the table's width, not the context.

    Arguments:
        q: (B * W, Hq, Dh), row b's queries at b * W .. b * W + W - 1.
        k_cache, v_cache: (num_blocks, block_size, Hkv, Dh).
        block_tables: (B, M) int64 with valid block ids (no -1) in every entry.
        seq_lens: (B,) int64 context length of each row after this step, >= W.

    Returns:
        (B * W, Hq, Dh) in q.dtype, math in compute_dtype(q.dtype).
    """
    rows, width = block_tables.shape[0], q.shape[0] // block_tables.shape[0]
    hq, dh = q.shape[1:]
    hkv, block_size = k_cache.shape[2], k_cache.shape[1]
    group = hq // hkv
    cdt = compute_dtype(q.dtype)
    length = block_tables.shape[1] * block_size
    k = k_cache[block_tables].reshape(rows, length, hkv, dh).to(cdt).permute(0, 2, 1, 3)  # (B, Hkv, L, Dh)
    v = v_cache[block_tables].reshape(rows, length, hkv, dh).to(cdt).permute(0, 2, 1, 3)
    pos = torch.arange(length, device=q.device)
    q_pos = seq_lens[:, None] - width + torch.arange(width, device=q.device)[None, :]  # (B, W)
    allowed = pos[None, None, :] <= q_pos[:, :, None]  # (B, W, L)
    qg = q.to(cdt).view(rows, width, hkv, group, dh).permute(0, 2, 1, 3, 4).reshape(rows, hkv, width * group, dh)
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale  # (B, Hkv, W * group, L)
    mask = allowed[:, None, :, None, :].expand(rows, hkv, width, group, length).reshape(scores.shape)
    # Beyond seq_len the blocks may hold anything, even NaN: zero V there (0 * NaN = NaN).
    v = v.masked_fill((pos[None, :] >= seq_lens[:, None])[:, None, :, None], 0.0)
    att = torch.matmul(torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1), v)
    att = att.view(rows, hkv, width, group, dh).permute(0, 2, 1, 3, 4).reshape(rows * width, hq, dh)
    return att.to(q.dtype)


def to_fp8_cache(x: Tensor, cache_scale: float) -> Tensor:
    """``x / cache_scale`` rounded to float8_e4m3fn, saturating at +-448 (a plain cast would give NaN)."""
    return (x.to(torch.float32) * (1.0 / cache_scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _write_fp8_kv(write: Callable[..., None], k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                  slot_mapping: Tensor, k_scale: float, v_scale: float) -> None:
    """``write`` (a KV-cache write op) of the step's K and V rounded into FP8 caches, moved as bytes:
    float8 has no index_copy_ kernel."""
    write(to_fp8_cache(k, k_scale).view(torch.uint8), to_fp8_cache(v, v_scale).view(torch.uint8),
          k_cache.view(torch.uint8), v_cache.view(torch.uint8), slot_mapping)


def _cache_scales(k_cache: Tensor, k_scale: float, v_scale: float) -> tuple[float, float]:
    """The scales the cache's entries are to be multiplied by: an FP8 cache's, else 1.0 (a 16-bit
    cache holds K and V themselves; a checkpoint's scales are read whatever the KV cache dtype)."""
    return (k_scale, v_scale) if k_cache.dtype == FP8_DTYPE else (1.0, 1.0)


def _times(out: Tensor, v_scale: float) -> Tensor:
    """Attention over ``v / v_scale`` brought back to the values' scale."""
    return out if v_scale == 1.0 else (out.to(compute_dtype(out.dtype)) * v_scale).to(out.dtype)


def write_kv_and_attend_decode(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                               slot_mapping: Tensor, block_tables: Tensor, query_start_loc: Tensor,
                               seq_lens: Tensor, scale: float, width: int, k_scale: float = 1.0,
                               v_scale: float = 1.0) -> Tensor:
    """A step of uniform decode rows (the CUDA-graph path: fixed shapes, no host sync): writes the
    step's K/V into the cache, then attends. Rows of `width` query tokens each; arguments as in
    ``paged_attention_ref``, slot_mapping and block_tables without -1 (padded rows name the pad
    block); k_scale, v_scale: an FP8 cache's scales. The Triton write and decode kernels on CUDA
    (any dtype, FP8 caches too; it reads each row's context only, not its whole block table);
    elsewhere the dense ops. Returns (T, Hq, Dh) in q.dtype."""
    k_scale, v_scale = _cache_scales(k_cache, k_scale, v_scale)
    if use_triton(q, None):
        from replayserve.ops.paged_attention_triton import paged_decode_attention_triton, write_kv_cache_triton

        write_kv_cache_triton(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                                             max_query_len=width, k_scale=k_scale, v_scale=v_scale)
    if k_cache.dtype == FP8_DTYPE:
        _write_fp8_kv(write_kv_cache_dense, k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return _times(decode_attention_dense(q, k_cache, v_cache, block_tables, seq_lens, scale * k_scale), v_scale)
    write_kv_cache_dense(k, v, k_cache, v_cache, slot_mapping)
    return decode_attention_dense(q, k_cache, v_cache, block_tables, seq_lens, scale)


def write_kv_and_attend(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
                        block_tables: Tensor, query_start_loc: Tensor, seq_lens: Tensor, scale: float,
                        k_scale: float = 1.0, v_scale: float = 1.0) -> Tensor:
    """Any other step (prefill chunks, mixed prefill and decode): writes the step's K/V into the
    cache (``write_kv_cache_ref``'s arguments), then ``paged_attention_ref``; k_scale, v_scale: an
    FP8 cache's scales. The Triton write and varlen kernels, one launch each for the whole batch
    with no host sync and no scores in memory, where they serve and take the head size
    (``prefill_kernel_head_dim``), FP8 caches too; elsewhere (the CPU, float64) the references.
    Returns (T, Hq, Dh) in q.dtype."""
    k_scale, v_scale = _cache_scales(k_cache, k_scale, v_scale)
    if use_triton(q) and prefill_kernel_head_dim(q.shape[-1]):
        from replayserve.ops.paged_attention_triton import write_kv_cache_triton
        from replayserve.ops.prefill_attention_triton import paged_prefill_attention_triton

        write_kv_cache_triton(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return paged_prefill_attention_triton(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                                              k_scale=k_scale, v_scale=v_scale)
    if k_cache.dtype == FP8_DTYPE:
        _write_fp8_kv(write_kv_cache_ref, k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return _times(paged_attention_ref(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                                          scale * k_scale), v_scale)
    write_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping)
    return paged_attention_ref(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale)
