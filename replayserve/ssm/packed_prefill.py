"""All prefill sequences of a step in one pass per op: the packed varlen conv1d and SSD scan kernels.

A ``PrefillPlan`` is the step's metadata for them, built once on the host from the step's prefill
segments and shared by every Mamba layer: packed sequence offsets, state slots, chunk phases, the
SSD chunk table (cut also at every prefix-caching capture, so each captured state is the state
entering some chunk) and the gather indices that write captures into their boundary slots.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from replayserve.ops.conv1d_varlen_triton import causal_conv1d_varlen_triton
from replayserve.ops.copy_rows import copy_rows
from replayserve.ops.ssd_triton import VarlenChunks, ssd_varlen_scan_triton, varlen_chunks
from replayserve.ssm.backend import MambaParams, Segment


@dataclass(frozen=True)
class PrefillPlan:
    """One step's packed prefill metadata; tensors on the device, token offsets relative to `lo`.

    lo, hi: the step's token range of the prefill sequences (they are contiguous).
    cu_seqlens: (S+1,); slots: (S,); phases: (S,) first position mod chunk size (all int64).
    token_seq: (hi - lo,) int64 the sequence of each token (the conv kernel's lookup).
    capture_dst, conv_index: (M,) and (M, K-1) int64: the inner captures' boundary slots and, per
        column, the row of [slot states' columns (S*(K-1) rows) ; packed inputs] that fills it.
    grid_entry: (M,) int64 the scan's chunk whose entering state is the capture.
    end_src, end_dst: (E,) int64 live and boundary slots of captures at a sequence's end.
    """

    lo: int
    hi: int
    cu_seqlens: torch.Tensor
    slots: torch.Tensor
    phases: torch.Tensor
    token_seq: torch.Tensor
    chunks: VarlenChunks
    capture_dst: torch.Tensor | None
    conv_index: torch.Tensor | None
    grid_entry: torch.Tensor | None
    end_src: torch.Tensor | None
    end_dst: torch.Tensor | None


def build_prefill_plan(segments: Sequence[Segment], chunk_size: int, conv_kernel: int,
                       device: torch.device) -> PrefillPlan:
    """The plan of `segments` (``StepContext.prefill_segments()``, each with at least one token)."""
    lo, width, nseq = segments[0][0], conv_kernel - 1, len(segments)
    starts = [start - lo for start, *_ in segments]
    lens = [end - start for start, end, *_ in segments]
    if any(start != prev + n for start, prev, n in zip(starts[1:], starts, lens, strict=False)):
        raise ValueError("prefill segments must be contiguous, in token order")
    phases = [first % chunk_size for *_, first in segments]
    inner = [[(o, dst) for o, dst in caps if o < n] for (_, _, _, caps, _), n in zip(segments, lens, strict=True)]
    chunks = varlen_chunks(lens, phases, chunk_size, device, cuts=[[o for o, _ in c] for c in inner])
    chunk_of = {start: k for k, start in enumerate(chunks.chunk_starts)}
    capture_dst, conv_index, grid_entry = [], [], []
    for s, caps in enumerate(inner):
        for o, dst in caps:
            capture_dst.append(dst)
            grid_entry.append(chunk_of[starts[s] + o])
            # Column j of the conv state after o tokens is input o + j of [slot state ; tokens].
            conv_index.append([s * width + o + j if o + j < width else nseq * width + starts[s] + o + j - width
                               for j in range(width)])
    ends = [(slot, dst) for (_, _, slot, caps, _), n in zip(segments, lens, strict=True) for o, dst in caps if o == n]

    # Every index list in one host-to-device copy, then views of it.
    fields = {
        "cu_seqlens": [0, *[start + n for start, n in zip(starts, lens, strict=True)]],
        "slots": [seg[2] for seg in segments], "phases": phases,
        "capture_dst": capture_dst, "conv_index": [i for row in conv_index for i in row], "grid_entry": grid_entry,
        "end_src": [src for src, _ in ends], "end_dst": [dst for _, dst in ends],
    }
    flat = torch.tensor([v for values in fields.values() for v in values], dtype=torch.int64).to(device,
                                                                                                non_blocking=True)
    views: dict[str, torch.Tensor | None] = {}
    at = 0
    for name, values in fields.items():
        views[name] = flat[at : at + len(values)] if values else None
        at += len(values)
    if views["conv_index"] is not None:
        views["conv_index"] = views["conv_index"].view(-1, width)
    tokens = torch.arange(sum(lens), device=device)
    views["token_seq"] = torch.searchsorted(views["cu_seqlens"], tokens, right=True) - 1
    return PrefillPlan(lo=lo, hi=lo + sum(lens), chunks=chunks, **views)  # type: ignore[arg-type]


def packed_prefill(
    plan: PrefillPlan, conv_state: torch.Tensor, ssm_state: torch.Tensor, xbc: torch.Tensor, dt: torch.Tensor,
    params: MambaParams,
    split_xbc: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """Runs the plan's sequences from their slots and stores their states (and captures) back.

    conv_state: (slots, conv_dim, K-1) and ssm_state: (slots, H, P, N), one layer's pools.
    xbc: (hi - lo, conv_dim) pre-conv inputs; dt: (hi - lo, H) raw time steps.
    Returns y (hi - lo, H, P).
    """
    if plan.capture_dst is not None:  # conv windows of inner captures, before the slots are overwritten
        conv_state.index_copy_(0, plan.capture_dst, capture_windows(plan, conv_state, xbc))
    xbc = causal_conv1d_varlen_triton(xbc, params.conv_weight, params.conv_bias, conv_state, plan.slots,
                                      plan.cu_seqlens, token_seq=plan.token_seq)
    x, b, c = split_xbc(xbc)
    y, grid = ssd_varlen_scan_triton(
        x, dt, params.A, b, c, params.chunk_size, plan.cu_seqlens, plan.phases, ssm_state, plan.slots, D=params.D,
        dt_bias=params.dt_bias, dt_limit=params.dt_limit, return_grid_states=True, chunks=plan.chunks,
    )
    if plan.grid_entry is not None:
        copy_rows(grid, plan.grid_entry, ssm_state, plan.capture_dst)
    if plan.end_src is not None:
        copy_rows(conv_state, plan.end_src, conv_state, plan.end_dst)
        copy_rows(ssm_state, plan.end_src, ssm_state, plan.end_dst)
    return y


def capture_windows(plan: PrefillPlan, conv_state: torch.Tensor, xbc: torch.Tensor) -> torch.Tensor:
    """(M, conv_dim, K-1) the conv state after each inner capture's offset: column j is row
    ``conv_index[m, j]`` of [the sequences' slot columns (S*(K-1) rows) ; the packed inputs].
    Two small gathers and a select, not that concatenation: it would copy the step's whole
    input (42 MB per layer for 2048 tokens at Nemotron-H-8B's shape) to read a few rows."""
    assert plan.conv_index is not None
    held = plan.slots.numel() * conv_state.shape[2]
    from_state = plan.conv_index < held
    state_columns = conv_state.index_select(0, plan.slots).transpose(1, 2).flatten(0, 1)
    stored = state_columns[plan.conv_index.clamp(max=held - 1)]
    fresh = xbc[(plan.conv_index - held).clamp(min=0)].to(conv_state.dtype)
    return torch.where(from_state[..., None], stored, fresh).transpose(1, 2)
