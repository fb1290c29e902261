"""The prefill entry point by flash-linear-attention: its cuts for captures (on the CPU, with the
reference as the runner) and fla's kernels against the float64 reference (CUDA with fla-core only)."""

from __future__ import annotations

import sys

import pytest
import torch

from replayserve.ops.gated_delta import chunk_gated_delta, gated_delta_chunk_ref
from replayserve.ops.gated_delta_fla import chunk_by_segments


def _packed(lengths, hk=2, hv=4, dk=8, dv=8, dtype=torch.float64, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k = (torch.randn(total, hk, dk, generator=gen) for _ in range(2))
    v = torch.randn(total, hv, dv, generator=gen)
    g, beta = -torch.rand(total, hv, generator=gen), torch.rand(total, hv, generator=gen)
    s0 = torch.randn(len(lengths), hv, dk, dv, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return [x.to(device, dtype) for x in (q, k, v, g, beta, s0)] + [cu.to(device)]


def _captures(lengths, count, seed=1):
    gen = torch.Generator().manual_seed(seed)
    seqs = torch.randint(0, len(lengths), (count,), generator=gen)
    lens = torch.stack([torch.randint(0, lengths[s] + 1, (1,), generator=gen)[0] for s in seqs.tolist()])
    return seqs, lens


def test_cuts_give_the_captures_of_one_pass():
    """A runner that returns only final states, cut at the captures, equals the one-pass reference."""
    lengths = [1, 9, 4, 13, 1, 30]
    q, k, v, g, beta, s0, cu = _packed(lengths)
    seqs, lens = _captures(lengths, 9)

    def run(q, k, v, g, beta, bounds, initial):
        o, final, _ = gated_delta_chunk_ref(q, k, v, g, beta, torch.tensor(bounds), initial, use_qk_l2norm=True)
        return o, final

    wanted = list(zip(seqs.tolist(), lens.tolist(), strict=True))
    o, final, captured = chunk_by_segments(run, q, k, v, g, beta, cu.tolist(), s0, wanted)
    o_ref, final_ref, captured_ref = gated_delta_chunk_ref(q, k, v, g, beta, cu, s0, use_qk_l2norm=True,
                                                           capture_seqs=seqs, capture_lens=lens)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(final, final_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(captured, captured_ref, rtol=0, atol=1e-12)


class _RefuseFla:
    """A meta path finder that fails any import of fla, installed or not."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "fla":
            raise AssertionError(f"the CPU path imported {name}")
        return None


def test_the_cpu_path_never_asks_for_fla(monkeypatch):
    monkeypatch.setattr(sys, "meta_path", [_RefuseFla(), *sys.meta_path])
    q, k, v, g, beta, s0, cu = _packed([3, 5], dtype=torch.float32)
    o, final, _ = chunk_gated_delta(q, k, v, g, beta, cu, s0)
    o_ref, final_ref, _ = gated_delta_chunk_ref(q, k, v, g, beta, cu, s0)
    assert torch.equal(o, o_ref) and torch.equal(final, final_ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's autotuned kernels need a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_prefill_matches_the_reference(dtype):
    pytest.importorskip("fla")
    lengths = [1, 63, 64, 65, 200, 7]
    q, k, v, g, beta, s0, cu = _packed(lengths, hk=2, hv=4, dk=128, dv=128, dtype=dtype, device="cuda")
    s0 = s0.float()
    seqs, lens = _captures(lengths, 8)
    o, final, captured = chunk_gated_delta(q, k, v, g, beta, cu, s0, use_qk_l2norm=True, capture_seqs=seqs,
                                           capture_lens=lens)
    o_ref, final_ref, captured_ref = gated_delta_chunk_ref(*(x.double() for x in (q, k, v, g, beta)), cu, s0.double(),
                                                           use_qk_l2norm=True, capture_seqs=seqs, capture_lens=lens)
    tol = 2e-3 if dtype == torch.float32 else 3e-2
    assert o.dtype == dtype and final.dtype == torch.float32
    torch.testing.assert_close(o.double(), o_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(final.double(), final_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(captured.double(), captured_ref, rtol=tol, atol=tol)
