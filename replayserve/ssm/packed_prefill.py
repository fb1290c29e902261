"""All prefill sequences of a step in one pass per op: the packed varlen conv1d and SSD scan kernels.

A ``PrefillPlan`` is the step's metadata for them, built once on the host from the step's prefill
segments and shared by every Mamba layer: packed sequence offsets, state slots, chunk phases, the
SSD chunk table (cut also at every prefix-caching capture, so each captured state is the state
entering some chunk) and the boundary slot of each capture, which the conv and scan kernels write
as they go.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from replayserve.ops.conv1d_varlen_triton import causal_conv1d_varlen_triton
from replayserve.ops.ssd_triton import VarlenChunks, ssd_varlen_scan_triton, varlen_chunks
from replayserve.ssm.params import MambaParams, Segment


@dataclass(frozen=True)
class PrefillPlan:
    """One step's packed prefill metadata; tensors on the device, token offsets relative to `lo`.

    lo, hi: the step's token range of the prefill sequences (they are contiguous).
    cu_seqlens: (S+1,); slots: (S,); phases: (S,) first position mod chunk size (all int64).
    token_seq: (hi - lo,) int64 the sequence of each token (the conv kernel's lookup).
    captures: prefix caching's inner captures (a boundary before a sequence's last token), (M,)
        int64 each: the sequence, the packed token the boundary precedes, the boundary slot; or None.
    chunk_capture: (num_chunks,) int64 the boundary slot that receives the state entering each
        chunk of the scan, -1 for none; end_capture: (S,) int64 the boundary slot that receives a
        sequence's final state, -1 for none. None when the step captures nothing.
    """

    lo: int
    hi: int
    cu_seqlens: torch.Tensor
    slots: torch.Tensor
    phases: torch.Tensor
    token_seq: torch.Tensor
    chunks: VarlenChunks
    captures: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    chunk_capture: torch.Tensor | None
    end_capture: torch.Tensor | None


def build_prefill_plan(segments: Sequence[Segment], chunk_size: int, device: torch.device) -> PrefillPlan:
    """The plan of `segments` (``StepContext.prefill_segments()``, each with at least one token)."""
    lo = segments[0][0]
    starts = [start - lo for start, *_ in segments]
    lens = [end - start for start, end, *_ in segments]
    if any(start != prev + n for start, prev, n in zip(starts[1:], starts, lens, strict=False)):
        raise ValueError("prefill segments must be contiguous, in token order")
    phases = [first % chunk_size for *_, first in segments]
    inner = [[(o, dst) for o, dst in caps if o < n] for (_, _, _, caps, _), n in zip(segments, lens, strict=True)]
    chunks = varlen_chunks(lens, phases, chunk_size, device, cuts=[[o for o, _ in c] for c in inner])
    chunk_of = {start: k for k, start in enumerate(chunks.chunk_starts)}
    rows = [(s, starts[s] + o, dst) for s, caps in enumerate(inner) for o, dst in caps]
    chunk_capture = [-1] * chunks.num_chunks
    for _, token, dst in rows:
        chunk_capture[chunk_of[token]] = dst
    end_capture = [next((dst for o, dst in caps if o == n), -1)
                   for (_, _, _, caps, _), n in zip(segments, lens, strict=True)]
    any_capture = bool(rows) or any(d >= 0 for d in end_capture)

    # Every index list in one host-to-device copy, then views of it, each padded to whole 16 bytes:
    # Triton compiles a kernel variant per alignment of a pointer, and every view is then as aligned
    # as a tensor of its own, whatever the step's list lengths.
    fields = {
        "cu_seqlens": [0, *[start + n for start, n in zip(starts, lens, strict=True)]],
        "slots": [seg[2] for seg in segments], "phases": phases,
        "capture_seq": [r[0] for r in rows], "capture_end": [r[1] for r in rows], "capture_dst": [r[2] for r in rows],
        "chunk_capture": chunk_capture if any_capture else [], "end_capture": end_capture if any_capture else [],
    }
    padded = [values + [0] * (-len(values) % 2) for values in fields.values()]  # 2 int64 in 16 bytes
    flat = torch.tensor([v for values in padded for v in values], dtype=torch.int64).to(device, non_blocking=True)
    views: dict[str, torch.Tensor | None] = {}
    at = 0
    for (name, values), stored in zip(fields.items(), padded, strict=True):
        views[name] = flat[at : at + len(values)] if values else None
        at += len(stored)
    captures = (views.pop("capture_seq"), views.pop("capture_end"), views.pop("capture_dst"))
    tokens = torch.arange(sum(lens), device=device)
    views["token_seq"] = torch.searchsorted(views["cu_seqlens"], tokens, right=True) - 1
    return PrefillPlan(lo=lo, hi=lo + sum(lens), chunks=chunks, captures=captures if rows else None,
                       **views)  # type: ignore[arg-type]


def packed_prefill(
    plan: PrefillPlan, conv_state: torch.Tensor, ssm_state: torch.Tensor, xbc: torch.Tensor, dt: torch.Tensor,
    params: MambaParams,
    split_xbc: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """Runs the plan's sequences from their slots and stores their states (and captures) back.

    conv_state: (slots, conv_dim, K-1) and ssm_state: (slots, H, P, N), one layer's pools.
    xbc: (hi - lo, conv_dim) pre-conv inputs; dt: (hi - lo, H) raw time steps.
    Returns y (hi - lo, H, P). The captures ride along in the conv and scan kernels: the conv
    windows in one extra launch, the SSM states as extra stores of the scan's state passing.
    """
    xbc = causal_conv1d_varlen_triton(xbc, params.conv_weight, params.conv_bias, conv_state, plan.slots,
                                      plan.cu_seqlens, token_seq=plan.token_seq, captures=plan.captures,
                                      end_slots=plan.end_capture)
    x, b, c = split_xbc(xbc)
    return ssd_varlen_scan_triton(
        x, dt, params.A, b, c, params.chunk_size, plan.cu_seqlens, plan.phases, ssm_state, plan.slots, D=params.D,
        dt_bias=params.dt_bias, dt_limit=params.dt_limit, chunks=plan.chunks, capture_slots=plan.chunk_capture,
        end_slots=plan.end_capture,
    )
