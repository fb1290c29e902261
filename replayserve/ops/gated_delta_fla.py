"""The packed varlen prefill by flash-linear-attention's ``chunk_gated_delta_rule`` (the optional extra
``replayserve[gdn]``, pinned ``fla-core==0.6.0``), with boundary captures.

fla is imported lazily, on the first call that can use it: the CPU path runs where it is absent.
Importing it costs about 3.1 s on top of torch on the 2-core CPU of the development machine (three
runs: 3.45, 3.08, 3.08 s; ``fla.ops`` imports every op of the package, whichever is asked for).
Its kernels are autotuned, so they do not run in Triton's CPU interpreter (the autotuner asks for
a GPU driver): tests/ops/test_gated_delta_fla.py runs them on CUDA only.

fla returns the final state of each sequence, not states inside one. A capture (the state after
the first j tokens of sequence n) is therefore a cut: each sequence is cut at its captures, and
segment r of every sequence runs in round r, from the state segment r - 1 ended with. A batch with
no captures is one call; each capture adds at most one round (one call of fla for the batch).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

# run(q, k, v, g, beta, cu_seqlens (host list), initial_states) -> (o, final states): packed (T, H, ...)
# inputs of one round, (N, Hv, K, V) initial states; o (T, Hv, V), finals (N, Hv, K, V).
Runner = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, list[int], Tensor], tuple[Tensor, Tensor]]


@functools.cache
def fla_chunk_rule() -> Callable | None:
    """fla's ``chunk_gated_delta_rule``, or None where fla-core is not installed (imported once)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def fla_runner(scale: float | None, use_qk_l2norm: bool, chunk_size: int) -> Runner:
    """A `Runner` by fla (CUDA): fp32 initial and final states, o in v's dtype; chunk_size 16, 32 or 64."""
    rule = fla_chunk_rule()
    if rule is None:
        raise RuntimeError("flash-linear-attention is not installed: pip install 'replayserve[gdn]'")

    def run(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, bounds: list[int],
            initial: Tensor) -> tuple[Tensor, Tensor]:
        cu_cpu = torch.tensor(bounds, dtype=torch.int64)  # the host copy spares fla a device sync
        o, final = rule(q[None], k[None], v[None], g[None], beta[None], scale=scale,
                        initial_state=initial.float().contiguous(), output_final_state=True,
                        use_qk_l2norm_in_kernel=use_qk_l2norm, cu_seqlens=cu_cpu.to(v.device, non_blocking=True),
                        cu_seqlens_cpu=cu_cpu, chunk_size=chunk_size)
        return o[0], final

    return run


def chunk_by_segments(run: Runner, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, bounds: list[int],
                      initial: Tensor, captures: list[tuple[int, int]]) -> tuple[Tensor, Tensor, Tensor]:
    """Packed varlen prefill with captures, by a runner that gives only final states.

    Arguments:
        run: the prefill of one round (`Runner`).
        q, k: (T, Hk, K); v: (T, Hv, V); g, beta: (T, Hv); bounds: cu_seqlens as a host list (N+1).
        initial: (N, Hv, K, V) initial states (fp32 or wider).
        captures: (sequence, tokens) pairs, 0 <= tokens <= the sequence's length.

    Returns:
        o (T, Hv, V), final states (N, Hv, K, V) and captures (C, Hv, K, V), the states in
        initial's dtype.
    """
    num_seqs = len(bounds) - 1
    cuts = [sorted({0, bounds[n + 1] - bounds[n], *(at for seq, at in captures if seq == n)})
            for n in range(num_seqs)]
    states = initial.clone()
    at_cut = {(n, 0): initial[n] for n in range(num_seqs)}
    o = torch.empty_like(v)
    for r in range(max(len(c) for c in cuts) - 1):
        seqs = [n for n in range(num_seqs) if len(cuts[n]) > r + 1]
        pieces = [(bounds[n] + cuts[n][r], bounds[n] + cuts[n][r + 1]) for n in seqs]
        rows = torch.cat([torch.arange(lo, hi, device=v.device) for lo, hi in pieces])
        round_bounds = [0, *torch.tensor([hi - lo for lo, hi in pieces]).cumsum(0).tolist()]
        idx = torch.tensor(seqs, device=v.device)
        o_round, finals = run(q[rows], k[rows], v[rows], g[rows], beta[rows], round_bounds, states[idx])
        o[rows] = o_round.to(o.dtype)
        states[idx] = finals.to(states.dtype)
        for n, final in zip(seqs, states[idx], strict=True):
            at_cut[n, cuts[n][r + 1]] = final
    captured = (torch.stack([at_cut[key] for key in captures]) if captures
                else initial.new_empty(0, *initial.shape[1:]))
    return o, states, captured
