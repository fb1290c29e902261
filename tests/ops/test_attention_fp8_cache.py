"""An FP8 KV cache in the attention entry points: the step's K and V are stored as ``x / scale``
rounded to FP8, and attention over that cache equals the float64 reference over a cache holding
the values the FP8 entries stand for (``k_q * k_scale``, ``v_q * v_scale``), for a prefill step
(write_kv_and_attend) and a uniform decode step (write_kv_and_attend_decode)."""

from __future__ import annotations

import pytest
import torch

from replayserve.ops.attention import (
    paged_attention_ref,
    to_fp8_cache,
    write_kv_and_attend,
    write_kv_and_attend_decode,
    write_kv_cache_ref,
)
from replayserve.ops.fp8 import FP8_DTYPE

BLOCK, HQ, HKV, DH, BLOCKS = 4, 4, 2, 8, 8
F64 = torch.float64


def step(lens: list[int], q_lens: list[int], seed: int) -> dict[str, torch.Tensor]:
    """One step of len(lens) sequences (sequence s: blocks 3s, 3s+1, 3s+2; its last q_lens[s] positions new)."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(q_lens)
    pairs = enumerate(zip(lens, q_lens, strict=True))
    slots = torch.cat([3 * s * BLOCK + torch.arange(n - q, n) for s, (n, q) in pairs])
    return {"q": torch.randn(t, HQ, DH, generator=gen, dtype=F64),
            "k": 3 * torch.randn(t, HKV, DH, generator=gen, dtype=F64),
            "v": torch.randn(t, HKV, DH, generator=gen, dtype=F64), "slot_mapping": slots,
            "block_tables": torch.arange(3 * len(lens)).view(len(lens), 3),
            "query_start_loc": torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()]),
            "seq_lens": torch.tensor(lens)}


def dequantized_reference(s: dict[str, torch.Tensor], k_scale: float, v_scale: float) -> torch.Tensor:
    caches = [torch.zeros(BLOCKS, BLOCK, HKV, DH, dtype=F64) for _ in range(2)]
    k = to_fp8_cache(s["k"], k_scale).to(F64) * k_scale
    v = to_fp8_cache(s["v"], v_scale).to(F64) * v_scale
    write_kv_cache_ref(k, v, *caches, s["slot_mapping"])
    return paged_attention_ref(s["q"], *caches, s["block_tables"], s["query_start_loc"], s["seq_lens"], DH**-0.5)


@pytest.mark.parametrize(("k_scale", "v_scale"), [(1.0, 1.0), (0.01, 0.004)])
def test_a_prefill_step_over_an_fp8_cache_is_the_dequantized_reference(k_scale: float, v_scale: float) -> None:
    s = step([7, 3], [7, 3], seed=1)
    caches = [torch.zeros(BLOCKS, BLOCK, HKV, DH, dtype=FP8_DTYPE) for _ in range(2)]
    got = write_kv_and_attend(s["q"], s["k"], s["v"], *caches, s["slot_mapping"], s["block_tables"],
                              s["query_start_loc"], s["seq_lens"], DH**-0.5, k_scale, v_scale)
    torch.testing.assert_close(got, dequantized_reference(s, k_scale, v_scale), rtol=1e-12, atol=1e-12)
    assert caches[0].dtype == FP8_DTYPE and caches[0].to(F64).abs().max() > 0


@pytest.mark.parametrize(("k_scale", "v_scale"), [(1.0, 1.0), (0.02, 0.005)])
def test_a_decode_step_over_an_fp8_cache_is_the_dequantized_reference(k_scale: float, v_scale: float) -> None:
    """Two rows of one token; the context before it was written by an FP8 prefill (here: the same op)."""
    lens = [6, 9]
    prefill = step(lens, lens, seed=2)
    caches = [torch.zeros(BLOCKS, BLOCK, HKV, DH, dtype=FP8_DTYPE) for _ in range(2)]
    write_kv_and_attend(prefill["q"], prefill["k"], prefill["v"], *caches, prefill["slot_mapping"],
                        prefill["block_tables"], prefill["query_start_loc"], prefill["seq_lens"], DH**-0.5,
                        k_scale, v_scale)
    decode = {key: t.clone() for key, t in prefill.items()}
    rows = [5, 14]  # the last token of each sequence: rewrite it as the decode step's token
    for key in ("q", "k", "v", "slot_mapping"):
        decode[key] = prefill[key][rows]
    decode["query_start_loc"] = torch.tensor([0, 1, 2])
    got = write_kv_and_attend_decode(decode["q"], decode["k"], decode["v"], *caches, decode["slot_mapping"],
                                     decode["block_tables"], decode["query_start_loc"], decode["seq_lens"],
                                     DH**-0.5, 1, k_scale, v_scale)
    want = dequantized_reference(prefill, k_scale, v_scale)[rows]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_values_past_the_fp8_range_saturate_instead_of_turning_into_nan() -> None:
    stored = to_fp8_cache(torch.tensor([1e6, -1e6, 3.0], dtype=F64), 1.0)
    assert stored.to(F64).tolist() == [448.0, -448.0, 3.0]
