"""A step's prefill through the packed kernels equals one `prefill` call per sequence: outputs, every
slot's conv and SSM state, and prefix-caching captures on the chunk grid, off it, inside the first
K-1 tokens (a conv window partly from the stored state) and at a sequence's end. fp32, on CPU through
the Triton interpreter; on CUDA also bf16."""

from __future__ import annotations

import math

import pytest
import torch

from replayserve.ssm.backend import MambaParams
from replayserve.ssm.baseline import BaselineBackend
from replayserve.ssm.layout import MambaLayout
from replayserve.ssm.packed_prefill import build_prefill_plan
from replayserve.ssm.replay import ReplayBackend

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
Q = 8  # SSD chunk size
DECODES = 3  # decode tokens ahead of the prefill segments in the step
# (length, first position, captures (offset, boundary slot)); live slots 0, 1, 2, boundary slots 5..11
SEQUENCES = [
    (19, 0, ((8, 5), (13, 6), (19, 7))),  # on the grid, off it, at the end
    (4, 21, ((2, 8),)),  # shorter than a chunk, mid-grid, a capture inside the first K-1 tokens
    (30, 5, ((3, 9), (11, 10), (20, 11))),  # mid-grid; 3 and 11 on its grid (5 + 3 = 8, 5 + 11 = 16)
]
DTYPES = [torch.float32] + ([torch.bfloat16] if CUDA else [])
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # relative L2 error against the per-sequence path


def layout(dtype: torch.dtype) -> MambaLayout:
    return MambaLayout(num_layers=1, num_slots=12, num_heads=4, head_dim=8, state_size=16, n_groups=2,
                       conv_kernel=4, act_dtype=dtype, state_dtype=torch.float32, window=4)


def params(gen: torch.Generator, lay: MambaLayout) -> MambaParams:
    def randn(*size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*size, generator=gen).to(DEVICE, dtype)

    h = lay.num_heads
    return MambaParams(conv_weight=randn(lay.conv_dim, lay.conv_kernel, dtype=lay.act_dtype),
                       conv_bias=randn(lay.conv_dim, dtype=lay.act_dtype), A=-torch.exp(randn(h)), D=randn(h),
                       dt_bias=randn(h) * 0.5, dt_limit=(1e-3, math.inf), chunk_size=Q)


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


@pytest.mark.parametrize("backend_cls", [BaselineBackend, ReplayBackend])
@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_prefill_equals_per_sequence_prefill(backend_cls: type, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    lay = layout(dtype)
    p = params(gen, lay)
    segments, start = [], DECODES
    for slot, (length, first, captures) in enumerate(SEQUENCES):
        segments.append((start, start + length, slot, captures, first))
        start += length
    xbc = torch.randn(start, lay.conv_dim, generator=gen).to(DEVICE, dtype)
    dt = torch.randn(start, lay.num_heads, generator=gen).to(DEVICE, dtype)
    backends = [backend_cls(lay, DEVICE) for _ in range(2)]
    conv0 = torch.randn(lay.conv_state_shape, generator=gen).to(DEVICE, dtype)
    ssm0 = torch.randn(lay.ssm_state_shape, generator=gen).to(DEVICE)
    for b in backends:  # nonzero initial states in every slot
        b.conv_state[0].copy_(conv0)
        b.ssm_state[0].copy_(ssm0)
    y_loop = backends[0].prefill_batch(0, segments, xbc, dt, p, packed=False)
    y = backends[1].prefill_batch(0, segments, xbc, dt, p, packed=True)
    assert y.shape == (start - DECODES, lay.num_heads, lay.head_dim) and y.dtype == dtype
    assert rel(y, y_loop) < TOL[dtype]
    for slot in range(lay.num_slots):
        loop, packed = backends[0], backends[1]
        assert rel(packed.ssm_state[0][slot], loop.ssm_state[0][slot]) < TOL[dtype], f"SSM state of slot {slot}"
        assert rel(packed.conv_state[0][slot], loop.conv_state[0][slot]) < TOL[dtype], f"conv state of slot {slot}"
    assert torch.equal(backends[1].conv_state[0][[3, 4]], conv0[[3, 4]]), "slots outside the step are untouched"
    # The step's plan, as the runner builds it once for every layer, runs the same kernels.
    again = backend_cls(lay, DEVICE)
    again.conv_state[0].copy_(conv0)
    again.ssm_state[0].copy_(ssm0)
    plan = build_prefill_plan(segments, p.chunk_size, DEVICE)
    assert torch.equal(again.prefill_batch(0, segments, xbc, dt, p, plan=plan), y)
    assert torch.equal(again.ssm_state[0], backends[1].ssm_state[0])


@pytest.mark.skipif(DEVICE != "cuda", reason="the runner plans packed prefill on CUDA; exercised on the H200")
def test_the_runner_plans_prefill_once_for_every_layer(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """Every Mamba layer of a prefill step runs the one plan the runner built for the step."""
    from replayserve import LLM, SamplingParams
    from replayserve.builtin.tiny import make_tiny
    from replayserve.ssm.backend import SSMBackend

    seen: list[object] = []
    original = SSMBackend.prefill_batch

    def recording(self, layer, segments, xbc, dt, params, plan=None, packed=None):  # noqa: ANN001, ANN202
        seen.append(plan)
        return original(self, layer, segments, xbc, dt, params, plan=plan, packed=packed)

    monkeypatch.setattr(SSMBackend, "prefill_batch", recording)
    llm = LLM(model=str(make_tiny(tmp_path, seed=0, layers="M*-M*-")), dtype="float32", device="cuda",
              max_num_seqs=2, max_model_len=64, enforce_eager=True)
    seen.clear()
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9] * 7}], SamplingParams(temperature=0.0, max_tokens=2),
                 use_tqdm=False)
    assert len(seen) == 2 and seen[0] is not None and seen[0] is seen[1]
