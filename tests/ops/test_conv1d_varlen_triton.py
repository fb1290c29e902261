"""Triton packed varlen conv1d against ``causal_conv1d_varlen_ref``.

Sequences come in shuffled slot order with random stored inputs in every slot; lengths include
empty sequences, sequences shorter than K-1 (their final state keeps some stored columns) and ones
spanning several token blocks. Slots outside the batch must stay bitwise unchanged.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from replayserve.ops.conv1d import causal_conv1d_varlen_ref
from replayserve.ops.conv1d_varlen_triton import causal_conv1d_varlen_triton

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
cuda_only = pytest.mark.skipif(not CUDA, reason="needs CUDA")
# (rtol, atol) against float64: the kernel's outputs are rounded to its dtype.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3)}
POOL = 8
LENS = [1, 0, 70, 2, 5, 33]
# (D, K, bias, activation)
SHAPES = [(40, 4, True, "silu"), (200, 3, False, "silu"), (24, 2, True, None)]
CASES = [pytest.param(*s, torch.float32, id=f"D{s[0]}-K{s[1]}-f32") for s in SHAPES]
if CUDA:
    CASES += [pytest.param(*s, dt, id=f"D{s[0]}-K{s[1]}-{str(dt)[6:]}")
              for s in SHAPES[:1] + [(10240, 4, True, "silu")] for dt in (torch.bfloat16, torch.float16)]


@pytest.mark.parametrize(("dim", "width", "with_bias", "activation", "dtype"), CASES)
def test_varlen_conv_matches_reference(dim: int, width: int, with_bias: bool, activation: str | None,
                                       dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(dim + width)

    def randn(*size: int) -> Tensor:
        return torch.randn(*size, generator=gen).to(DEVICE, dtype)

    total = sum(LENS)
    x = randn(total, dim + 5)[:, 2 : dim + 2]  # a strided view, as the conv inputs of in_proj are
    weight, bias = randn(dim, width), randn(dim) if with_bias else None
    state = randn(POOL, dim, width - 1)
    slots = torch.randperm(POOL, generator=gen)[: len(LENS)].to(DEVICE)
    cu_seqlens = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], device=DEVICE, dtype=torch.int32)
    unused = [s for s in range(POOL) if s not in slots.tolist()]
    before = state[unused].clone()
    ref_state = state.double()  # the reference in float64 on the kernel's (rounded) inputs

    y = causal_conv1d_varlen_triton(x, weight, bias, state, slots, cu_seqlens, activation)
    y_ref = causal_conv1d_varlen_ref(x.double(), weight.double(), None if bias is None else bias.double(), ref_state,
                                     slots, cu_seqlens, activation)
    rtol, atol = TOL[dtype]
    assert y.dtype == dtype and y.shape == (total, dim)
    torch.testing.assert_close(y.double().cpu(), y_ref.double().cpu(), rtol=rtol, atol=atol)
    assert torch.equal(state.cpu(), ref_state.to(dtype).cpu()), "final states are the inputs as stored"
    assert torch.equal(state[unused], before), "slots outside the batch are untouched"


def test_shared_token_index_and_argument_checks() -> None:
    """A precomputed token -> sequence index gives the same result; bad shapes are refused."""
    gen = torch.Generator().manual_seed(1)
    lens, dim, width = [3, 9], 16, 4
    x = torch.randn(sum(lens), dim, generator=gen).to(DEVICE)
    weight = torch.randn(dim, width, generator=gen).to(DEVICE)
    state = torch.randn(3, dim, width - 1, generator=gen).to(DEVICE)
    slots, cu_seqlens = torch.tensor([2, 0], device=DEVICE), torch.tensor([0, 3, 12], device=DEVICE)
    token_seq = torch.tensor([0] * 3 + [1] * 9, device=DEVICE)
    copy = state.clone()
    y = causal_conv1d_varlen_triton(x, weight, None, state, slots, cu_seqlens)
    y_shared = causal_conv1d_varlen_triton(x, weight, None, copy, slots, cu_seqlens, token_seq=token_seq)
    assert torch.equal(y, y_shared) and torch.equal(state, copy)
    with pytest.raises(ValueError, match="cu_seqlens"):
        causal_conv1d_varlen_triton(x, weight, None, state, slots, cu_seqlens[:2])
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d_varlen_triton(x, weight, None, state[..., :2], slots, cu_seqlens)
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_varlen_triton(x, weight, None, state, slots, cu_seqlens, activation="relu")


@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if CUDA else []))
def test_captures_and_end_slots(dtype: torch.dtype) -> None:
    """The conv state before a packed token (prefix caching's boundary inside a sequence, also
    within its first K-1 tokens, where it is partly the stored state) and a sequence's final state
    land in other slots: as the reference computes them, and as the conv of that prefix alone
    leaves its state."""
    from replayserve.ops.conv1d import causal_conv1d_ref

    gen = torch.Generator().manual_seed(7)
    lens, dim, width, pool = [9, 2, 6], 24, 4, 10
    total = sum(lens)
    x = torch.randn(total, dim, generator=gen).to(DEVICE, dtype)
    weight = torch.randn(dim, width, generator=gen).to(DEVICE, dtype)
    state = torch.randn(pool, dim, width - 1, generator=gen).to(DEVICE, dtype)
    slots = torch.tensor([4, 0, 7], device=DEVICE)
    cu = torch.tensor([0, 9, 11, 17], device=DEVICE)
    # (sequence, packed end token, slot): after 5 and 1 tokens of sequence 0, 1 token of sequence 2
    rows = [(0, 5, 1), (0, 1, 2), (2, 12, 3)]
    captures = tuple(torch.tensor(c, device=DEVICE) for c in zip(*rows, strict=True))
    end_slots = torch.tensor([5, 8, -1], device=DEVICE)
    start = state.clone()
    ref_state = state.double()
    y = causal_conv1d_varlen_triton(x, weight, None, state, slots, cu, captures=captures, end_slots=end_slots)
    y_ref = causal_conv1d_varlen_ref(x.double(), weight.double(), None, ref_state, slots, cu, captures=captures,
                                     end_slots=end_slots)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(y.double().cpu(), y_ref.double().cpu(), rtol=rtol, atol=atol)
    assert torch.equal(state.cpu(), ref_state.to(dtype).cpu()), "every slot as the reference leaves it"
    for s, end, dst in rows:  # independently: the conv of the sequence's first tokens alone
        lo = int(cu[s])
        _, after = causal_conv1d_ref(x[lo:end], weight, None, start[int(slots[s])])
        assert torch.equal(state[dst], after), f"capture into slot {dst}"
    assert torch.equal(state[5], state[4]) and torch.equal(state[8], state[0]), "end slots hold the final states"
    assert torch.equal(state[[6, 9]], start[[6, 9]]), "slots outside the step are untouched"
    with pytest.raises(ValueError, match="end_slots"):
        causal_conv1d_varlen_triton(x, weight, None, state, slots, cu, end_slots=end_slots[:2])
