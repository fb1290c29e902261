"""Triton Mamba2 chunked SSD scan over packed variable-length sequences: matches
``replayserve.ops.ssd.ssd_varlen_scan_ref``.

Every sequence is cut into chunks on its own absolute grid: a sequence whose first position is
``phase`` past a multiple of the chunk size starts with a chunk of ``chunk_size - phase`` tokens
(or fewer), so the states between chunks are exactly the grid states that prefix caching
publishes. The chunk table (``VarlenChunks``) is built once per step on the host, where the
lengths are known, and shared by every layer. A scan is four launches:

1. ``_chunk_cumsum_kernel``, per (chunk, head block): the processed time step delta and its
   running sum of delta * A inside the chunk, in fp32, stored head-major (H, T).
2. ``_chunk_state_kernel``, per (chunk, head, P/N block): the chunk's own contribution to the
   state at its last token, sum_j exp(cum_end - cum_j) delta_j x_j B_j^T, one ``tl.dot`` per
   token block (tensor cores for bf16/fp16), into an fp32 (chunks, H, P, N) buffer.
3. ``_state_passing_kernel``, per (sequence, head, state block): walks the sequence's chunks in
   order from the state in its slot, replacing each chunk's contribution in the buffer by the
   state entering the chunk (the grid state), and writes the final state back to the slot; grid
   and final states that prefix caching captures are also stored into their boundary slots.
4. ``_chunk_scan_kernel``, per (chunk, head, row block, P block): y = exp(cum_i) C_i S_in^T (the
   carried state) + sum_{j <= i} exp(cum_i - cum_j) (C_i . B_j) delta_j x_j (the intra-chunk
   quadratic form) + D x_i.

Exponents are always differences inside one chunk (<= 0), so nothing overflows; the long-range
decay is applied chunk by chunk in step 3. fp32 inputs use full-precision products
(``input_precision="ieee"``); bf16/fp16 inputs round the decay-weighted operands and the carried
state to the input dtype before each product, as tensor cores need.

On an H200 (Triton 3.6, bf16, fp32 state, Nemotron-H-8B's H=128 P=64 N=128 G=8, chunk 128,
2026-12-04; ``benchmarks/bench_prefill_kernels.py``), 16 sequences of 1024 tokens took 2.56 ms
(the per-sequence reference 47.0 ms): 13 us cumsum, 389 us chunk states, 1016 us state passing,
1131 us chunk scan; 1.2 TB/s by the byte count (four passes over the fp32 chunk states dominate),
against a floor near 0.7 ms. One 4096-token sequence: 0.65 ms (reference 6.3 ms). Relative L2 error
against float64: 2.3e-3 on y, 1.6e-3 on the states. Eight warps, or 32-wide P tiles, were slower
(3.4 ms); 128-row scan tiles 2.8 ms. The state passing is a chain of dependent loads per chunk and
the scan kernel's 235 registers leave two programs per SM: the places to look next.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from replayserve.ops.time_step_triton import process_dt


@dataclass(frozen=True)
class VarlenChunks:
    """A step's chunk table: where each chunk of each packed sequence lies. Built by ``varlen_chunks``.

    table: (3, num_chunks) int32 on the device: row 0 the chunk's sequence, row 1 its first packed
        token, row 2 its token count (1..chunk_size).
    seq_chunks: (S+1,) int32 on the device: sequence s owns chunks seq_chunks[s]:seq_chunks[s+1].
        Without cuts, its c-th chunk (from 0) starts at its token max(0, c * chunk_size - phase_s).
    chunk_starts: the chunks' first packed tokens on the host (the table's row 1).
    """

    table: Tensor
    seq_chunks: Tensor
    num_chunks: int
    num_tokens: int
    chunk_size: int
    chunk_starts: tuple[int, ...]


def varlen_chunks(seq_lens: Sequence[int], phases: Sequence[int], chunk_size: int, device: torch.device | str,
                  cuts: Sequence[Sequence[int]] | None = None) -> VarlenChunks:
    """The chunk table of packed sequences of `seq_lens` tokens (each >= 1) whose first positions are
    `phases` (each in [0, chunk_size)) past the chunk grid. One host-to-device copy.

    cuts: per sequence, offsets 0 < o < length where a chunk must also start (a state the scan must
    return that lies off the grid, e.g. a prefix-caching boundary); None: the grid alone.
    """
    if len(seq_lens) != len(phases) or (cuts is not None and len(cuts) != len(seq_lens)):
        raise ValueError(f"{len(seq_lens)} sequence lengths but {len(phases)} phases"
                         + ("" if cuts is None else f" and {len(cuts)} cut lists"))
    seqs: list[int] = []
    starts: list[int] = []
    lens: list[int] = []
    offsets, token = [0], 0
    for s, (length, phase) in enumerate(zip(seq_lens, phases, strict=True)):
        if length < 1:
            raise ValueError(f"sequence {s} has {length} tokens; every packed sequence needs at least one")
        if not 0 <= phase < chunk_size:
            raise ValueError(f"sequence {s} has chunk phase {phase}, outside [0, {chunk_size})")
        extra = sorted(set(cuts[s])) if cuts is not None else []
        if extra and not 0 < extra[0] <= extra[-1] < length:
            raise ValueError(f"sequence {s} of {length} tokens has cuts {extra}; each must be in (0, {length})")
        bounds = sorted(set(range(chunk_size - phase, length, chunk_size)).union(extra))
        for lo, hi in zip([0, *bounds], [*bounds, length], strict=True):
            seqs.append(s)
            starts.append(token + lo)
            lens.append(hi - lo)
        token += length
        offsets.append(len(seqs))
    count = len(seqs)
    # seq_chunks starts on 16 bytes (4 int32), as a tensor of its own would: Triton compiles a
    # kernel variant per alignment of a pointer.
    pad = [0] * (-3 * count % 4)
    flat = torch.tensor(seqs + starts + lens + pad + offsets, dtype=torch.int32).to(device, non_blocking=True)
    return VarlenChunks(flat[: 3 * count].view(3, count), flat[3 * count + len(pad) :], count, token, chunk_size,
                        tuple(starts))


# Sizes that change every step. Triton would compile a variant of each kernel per combination of
# their "== 1" and "divisible by 16" properties, mid-serving; they only offset scalar table loads and
# head rows of tokens at data-dependent starts, so specialising on them buys nothing.
_STEP_SIZES = ["num_chunks", "num_tokens"]


@triton.jit(do_not_specialize=_STEP_SIZES)
def _chunk_cumsum_kernel(
    dt_ptr, A_ptr, dt_bias_ptr, table_ptr, delta_ptr, cum_ptr,
    num_chunks, num_tokens, nheads, dt_min, dt_max, s_dt_t, s_dt_h,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr,
):
    c = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    start = tl.load(table_ptr + num_chunks + c).to(tl.int64)
    length = tl.load(table_ptr + 2 * num_chunks + c)
    offs_q = tl.arange(0, BLOCK_Q)
    mask_h = offs_h < nheads
    mask = (offs_q < length)[:, None] & mask_h[None, :]
    tok = start + offs_q
    dt = tl.load(dt_ptr + tok[:, None] * s_dt_t + offs_h[None, :] * s_dt_h, mask=mask, other=0.0).to(tl.float32)
    bias = tl.zeros([BLOCK_H], dtype=tl.float32)
    if HAS_DT_BIAS:
        bias = tl.load(dt_bias_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    delta = tl.where(mask, process_dt(dt, bias[None, :], dt_min, dt_max, DT_SOFTPLUS), 0.0)
    a = tl.load(A_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    cum = tl.cumsum(delta * a[None, :], axis=0)
    out = offs_h[None, :].to(tl.int64) * num_tokens + tok[:, None]
    tl.store(delta_ptr + out, delta, mask=mask)
    tl.store(cum_ptr + out, cum, mask=mask)


@triton.jit(do_not_specialize=_STEP_SIZES)
def _chunk_state_kernel(
    x_ptr, B_ptr, delta_ptr, cum_ptr, table_ptr, states_ptr,
    num_chunks, num_tokens, dim, dstate, heads_per_group,
    s_x_t, s_x_h, s_x_p, s_B_t, s_B_g, s_B_n, s_st_c, s_st_h, s_st_p,
    DOT_PRECISION: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    c = tl.program_id(0)
    h = tl.program_id(1)
    num_n = tl.cdiv(dstate, BLOCK_N)
    offs_p = (tl.program_id(2) // num_n) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = (tl.program_id(2) % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    start = tl.load(table_ptr + num_chunks + c).to(tl.int64)
    length = tl.load(table_ptr + 2 * num_chunks + c)
    mask_p, mask_n = offs_p < dim, offs_n < dstate
    g = h // heads_per_group
    head_row = h.to(tl.int64) * num_tokens
    cum_end = tl.load(cum_ptr + head_row + start + length - 1)
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, length, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < length
        tok = start + offs_k
        x = tl.load(x_ptr + tok[:, None] * s_x_t + h * s_x_h + offs_p[None, :] * s_x_p,
                    mask=mask_k[:, None] & mask_p[None, :], other=0.0)
        b = tl.load(B_ptr + tok[:, None] * s_B_t + g * s_B_g + offs_n[None, :] * s_B_n,
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        delta = tl.load(delta_ptr + head_row + tok, mask=mask_k, other=0.0)
        cum = tl.load(cum_ptr + head_row + tok, mask=mask_k, other=0.0)
        weight = tl.where(mask_k, tl.exp(cum_end - cum) * delta, 0.0)
        bw = (b.to(tl.float32) * weight[:, None]).to(x.dtype)
        acc += tl.dot(tl.trans(x), bw, input_precision=DOT_PRECISION)
    out = states_ptr + c.to(tl.int64) * s_st_c + h * s_st_h + offs_p[:, None] * s_st_p + offs_n[None, :]
    tl.store(out, acc, mask=mask_p[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=_STEP_SIZES)
def _state_passing_kernel(
    states_ptr, cum_ptr, table_ptr, seq_chunks_ptr, pool_ptr, slots_ptr, capture_ptr, end_ptr,
    num_chunks, num_tokens, dim, dstate, s_st_c, s_st_h,
    s_pool_slot, s_pool_h, s_pool_p, s_pool_n,
    HAS_CAPTURES: tl.constexpr, BLOCK: tl.constexpr,
):
    s = tl.program_id(0)
    h = tl.program_id(1)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < dim * dstate
    slot = tl.load(slots_ptr + s).to(tl.int64)
    in_row = h * s_pool_h + (offs // dstate) * s_pool_p + (offs % dstate) * s_pool_n
    pool = pool_ptr + slot * s_pool_slot + in_row
    state = tl.load(pool, mask=mask, other=0.0).to(tl.float32)
    first = tl.load(seq_chunks_ptr + s)
    last = tl.load(seq_chunks_ptr + s + 1)
    head_row = h.to(tl.int64) * num_tokens
    ptrs = states_ptr + first.to(tl.int64) * s_st_c + h * s_st_h + offs
    for c in range(first, last):
        # Each element is read, then overwritten, by the same thread: no barrier needed.
        contribution = tl.load(ptrs, mask=mask, other=0.0)
        tl.store(ptrs, state, mask=mask)
        if HAS_CAPTURES:  # the state entering chunk c is also a boundary slot's (prefix caching)
            dst = tl.load(capture_ptr + c).to(tl.int64)
            if dst >= 0:
                tl.store(pool_ptr + dst * s_pool_slot + in_row, state.to(pool_ptr.dtype.element_ty), mask=mask)
        ptrs += s_st_c
        end = tl.load(table_ptr + num_chunks + c).to(tl.int64) + tl.load(table_ptr + 2 * num_chunks + c) - 1
        state = tl.exp(tl.load(cum_ptr + head_row + end)) * state + contribution
    tl.store(pool, state.to(pool_ptr.dtype.element_ty), mask=mask)
    if HAS_CAPTURES:
        dst = tl.load(end_ptr + s).to(tl.int64)
        if dst >= 0:
            tl.store(pool_ptr + dst * s_pool_slot + in_row, state.to(pool_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=_STEP_SIZES)
def _chunk_scan_kernel(
    x_ptr, B_ptr, C_ptr, D_ptr, delta_ptr, cum_ptr, states_ptr, table_ptr, y_ptr,
    num_chunks, num_tokens, dim, dstate, heads_per_group,
    s_x_t, s_x_h, s_x_p, s_B_t, s_B_g, s_B_n, s_C_t, s_C_g, s_C_n, s_st_c, s_st_h, s_st_p,
    s_y_t, s_y_h, s_y_p,
    HAS_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    c = tl.program_id(0)
    h = tl.program_id(1)
    num_p = tl.cdiv(dim, BLOCK_P)
    m0 = (tl.program_id(2) // num_p) * BLOCK_M
    offs_p = (tl.program_id(2) % num_p) * BLOCK_P + tl.arange(0, BLOCK_P)
    start = tl.load(table_ptr + num_chunks + c).to(tl.int64)
    length = tl.load(table_ptr + 2 * num_chunks + c)
    if m0 >= length:  # the chunk is shorter than this row block
        return
    g = h // heads_per_group
    head_row = h.to(tl.int64) * num_tokens
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    mask_m, mask_p, mask_n = offs_m < length, offs_p < dim, offs_n < dstate
    tok_m = start + offs_m
    cm = tl.load(C_ptr + tok_m[:, None] * s_C_t + g * s_C_g + offs_n[None, :] * s_C_n,
                 mask=mask_m[:, None] & mask_n[None, :], other=0.0)
    cum_m = tl.load(cum_ptr + head_row + tok_m, mask=mask_m, other=0.0)

    # The state entering the chunk, decayed to each row and read out by its C.
    carried = tl.load(states_ptr + c.to(tl.int64) * s_st_c + h * s_st_h + offs_p[:, None] * s_st_p
                      + offs_n[None, :], mask=mask_p[:, None] & mask_n[None, :], other=0.0)
    acc = tl.dot(cm, tl.trans(carried.to(cm.dtype)), input_precision=DOT_PRECISION)
    acc = acc * tl.exp(cum_m)[:, None]

    # Intra-chunk: column blocks up to the diagonal; above it the exponent is masked to -inf.
    for j0 in range(0, tl.minimum(m0 + BLOCK_M, length), BLOCK_M):
        offs_j = j0 + tl.arange(0, BLOCK_M)
        mask_j = offs_j < length
        tok_j = start + offs_j
        bj = tl.load(B_ptr + tok_j[:, None] * s_B_t + g * s_B_g + offs_n[None, :] * s_B_n,
                     mask=mask_j[:, None] & mask_n[None, :], other=0.0)
        xj = tl.load(x_ptr + tok_j[:, None] * s_x_t + h * s_x_h + offs_p[None, :] * s_x_p,
                     mask=mask_j[:, None] & mask_p[None, :], other=0.0)
        cum_j = tl.load(cum_ptr + head_row + tok_j, mask=mask_j, other=0.0)
        delta_j = tl.load(delta_ptr + head_row + tok_j, mask=mask_j, other=0.0)
        scores = tl.dot(cm, tl.trans(bj), input_precision=DOT_PRECISION)
        causal = (offs_m[:, None] >= offs_j[None, :]) & mask_j[None, :]
        decay = tl.exp(tl.where(causal, cum_m[:, None] - cum_j[None, :], float("-inf")))
        scores = scores * decay * delta_j[None, :]
        acc += tl.dot(scores.to(xj.dtype), xj, input_precision=DOT_PRECISION)

    mask_mp = mask_m[:, None] & mask_p[None, :]
    if HAS_D:
        xm = tl.load(x_ptr + tok_m[:, None] * s_x_t + h * s_x_h + offs_p[None, :] * s_x_p, mask=mask_mp, other=0.0)
        acc += tl.load(D_ptr + h).to(tl.float32) * xm.to(tl.float32)
    tl.store(y_ptr + tok_m[:, None] * s_y_t + h * s_y_h + offs_p[None, :] * s_y_p,
             acc.to(y_ptr.dtype.element_ty), mask=mask_mp)


def _tiles(dtype: torch.dtype, dim: int, dstate: int, chunk_size: int) -> dict[str, int]:
    """Tile sizes (all >= 16, the smallest ``tl.dot`` operand) and warps of the two matmul kernels.

    fp32 takes half-size tiles: its full-precision products run on the FMA units, and 64-wide tiles
    spill to the stack there (sm_90, Triton 3.7: 7 KB of stack per thread in the scan kernel).
    """
    cap = 64 if dtype != torch.float32 else 32
    return {
        "state_p": max(16, min(cap, triton.next_power_of_2(dim))),
        "state_n": max(16, min(cap, triton.next_power_of_2(dstate))),
        "state_k": max(16, min(cap, triton.next_power_of_2(chunk_size))),
        "scan_m": max(16, min(cap, triton.next_power_of_2(chunk_size))),
        "scan_p": max(16, min(cap, triton.next_power_of_2(dim))),
        "warps": 4,
    }


def _check(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, ssm_state: Tensor, state_slots: Tensor,
           chunks: VarlenChunks) -> None:
    total, nheads, dim = x.shape
    ngroups, dstate = B.shape[1], B.shape[2]
    if nheads % ngroups != 0:
        raise ValueError(f"H={nheads} is not a multiple of G={ngroups}")
    if dt.shape != (total, nheads) or A.shape != (nheads,):
        raise ValueError(f"dt {tuple(dt.shape)} and A {tuple(A.shape)} must be ({total}, {nheads}) and ({nheads},)")
    if B.shape != (total, ngroups, dstate) or C.shape != B.shape:
        raise ValueError(f"B {tuple(B.shape)} and C {tuple(C.shape)} must be ({total}, {ngroups}, {dstate})")
    if B.dtype != x.dtype or C.dtype != x.dtype or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x, B and C must share one of fp32/bf16/fp16, got {x.dtype}, {B.dtype}, {C.dtype}")
    if ssm_state.shape[1:] != (nheads, dim, dstate):
        raise ValueError(f"ssm_state must be (slots, {nheads}, {dim}, {dstate}), got {tuple(ssm_state.shape)}")
    if state_slots.shape != (chunks.seq_chunks.shape[0] - 1,):
        raise ValueError(f"state_slots must be ({chunks.seq_chunks.shape[0] - 1},), got {tuple(state_slots.shape)}")
    if chunks.num_tokens != total:
        raise ValueError(f"the chunk table covers {chunks.num_tokens} tokens, x has {total}")
    if dstate > 256:
        raise ValueError(f"d_state {dstate} > 256 is not supported (one tile of C per program)")


def ssd_varlen_scan_triton(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    cu_seqlens: Tensor,
    chunk_phase: Tensor,
    ssm_state: Tensor,
    state_slots: Tensor,
    D: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    return_grid_states: bool = False,
    chunks: VarlenChunks | None = None,
    capture_slots: Tensor | None = None,
    end_slots: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """``ssd_varlen_scan_ref`` on the GPU (or the Triton interpreter): four launches for all sequences.

    Arguments:
        x: (T, H, P) fp32, bf16 or fp16, any strides; B, C: (T, G, N) in x's dtype, any strides.
        dt: (T, H) raw time step, any float dtype and strides.
        A: (H,); D, dt_bias: (H,) or None; dt_softplus, dt_limit: as in ``ssd_chunk_scan_ref``.
        chunk_size: tokens per chunk; cu_seqlens (S+1,), chunk_phase (S,): as in the reference,
            read (with a host sync) only when `chunks` is None.
        ssm_state: (slots, H, P, N) state pool, any float dtype and strides; rows state_slots are
            read as initial states and overwritten IN PLACE with the final ones.
        state_slots: (S,) int32/int64 distinct slots.
        return_grid_states: also return the grid states.
        chunks: the step's chunk table from ``varlen_chunks`` (the same for every layer).
        capture_slots: (num_chunks,) int64 or None: a slot of ssm_state that also receives the state
            entering each chunk (grid entry k), -1 for none. end_slots: (S,) int64 or None: a slot
            that also receives sequence s's final state, -1 for none. Both or neither; the slots
            must differ from state_slots and from each other. This is how prefix-caching captures
            reach their boundary slots without a second pass over the states.

    Returns:
        y: (T, H, P) in x.dtype.
        grid_states (if asked): (num_chunks, H, P, N) fp32, entry k the state entering chunk k
            (``chunks.seq_chunks`` says which belong to which sequence), as the reference's.
    """
    if chunks is None:
        chunks = varlen_chunks(torch.diff(cu_seqlens).tolist(), chunk_phase.tolist(), chunk_size, x.device)
    elif chunks.chunk_size != chunk_size:
        raise ValueError(f"the chunk table was cut for chunk size {chunks.chunk_size}, not {chunk_size}")
    _check(x, dt, A, B, C, ssm_state, state_slots, chunks)
    if (capture_slots is None) != (end_slots is None):
        raise ValueError("capture_slots and end_slots go together")
    if capture_slots is not None and (capture_slots.shape != (chunks.num_chunks,)
                                      or end_slots.shape != state_slots.shape):
        raise ValueError(f"capture_slots {tuple(capture_slots.shape)} / end_slots {tuple(end_slots.shape)} must be "
                         f"({chunks.num_chunks},) / {tuple(state_slots.shape)}")
    total, nheads, dim = x.shape
    ngroups, dstate = B.shape[1], B.shape[2]
    nc, nseq = chunks.num_chunks, state_slots.shape[0]
    f32 = torch.float32
    delta = torch.empty((nheads, total), dtype=f32, device=x.device)
    cum = torch.empty_like(delta)
    states = torch.empty((nc, nheads, dim, dstate), dtype=f32, device=x.device)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if nseq == 0:
        return (y, states) if return_grid_states else y
    tiles = _tiles(x.dtype, dim, dstate, chunk_size)
    precision = "ieee" if x.dtype == f32 else "tf32"  # tf32 is ignored for 16-bit operands
    block_q = max(16, triton.next_power_of_2(chunk_size))
    block_h = max(1, min(triton.next_power_of_2(nheads), 4096 // block_q))
    _chunk_cumsum_kernel[(nc, triton.cdiv(nheads, block_h))](
        dt, A, dt_bias, chunks.table, delta, cum, nc, total, nheads, float(dt_limit[0]), float(dt_limit[1]),
        *dt.stride(), HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=dt_softplus, BLOCK_Q=block_q, BLOCK_H=block_h,
    )
    block_p, block_n = tiles["state_p"], tiles["state_n"]
    _chunk_state_kernel[(nc, nheads, triton.cdiv(dim, block_p) * triton.cdiv(dstate, block_n))](
        x, B, delta, cum, chunks.table, states, nc, total, dim, dstate, nheads // ngroups,
        *x.stride(), *B.stride(), *states.stride()[:3],
        DOT_PRECISION=precision, BLOCK_P=block_p, BLOCK_N=block_n, BLOCK_K=tiles["state_k"],
        num_warps=tiles["warps"],
    )
    block = min(1024, triton.next_power_of_2(dim * dstate))
    _state_passing_kernel[(nseq, nheads, triton.cdiv(dim * dstate, block))](
        states, cum, chunks.table, chunks.seq_chunks, ssm_state, state_slots, capture_slots, end_slots,
        nc, total, dim, dstate, *states.stride()[:2], *ssm_state.stride(),
        HAS_CAPTURES=capture_slots is not None, BLOCK=block, num_warps=4,
    )
    block_m, block_p = tiles["scan_m"], tiles["scan_p"]
    _chunk_scan_kernel[(nc, nheads, triton.cdiv(chunk_size, block_m) * triton.cdiv(dim, block_p))](
        x, B, C, D, delta, cum, states, chunks.table, y, nc, total, dim, dstate, nheads // ngroups,
        *x.stride(), *B.stride(), *C.stride(), *states.stride()[:3], *y.stride(),
        HAS_D=D is not None, DOT_PRECISION=precision, BLOCK_M=block_m, BLOCK_P=block_p,
        BLOCK_N=max(16, triton.next_power_of_2(dstate)), num_warps=tiles["warps"],
    )
    return (y, states) if return_grid_states else y
