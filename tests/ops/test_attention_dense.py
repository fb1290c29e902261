"""The fixed-shape (CUDA-graph) decode attention and KV write equal their references (float64),
with pad rows pointing at a pad block holding NaN that no real row reads."""

from __future__ import annotations

import pytest
import torch

from replayserve.ops.attention import (
    decode_attention_dense,
    paged_attention_ref,
    write_kv_cache_dense,
    write_kv_cache_ref,
)

F64 = torch.float64
HQ, HKV, DH, BLOCK, NUM_BLOCKS, WIDTH = 8, 2, 8, 4, 40, 5  # WIDTH: blocks per table


@pytest.mark.parametrize("queries", [1, 4])
def test_decode_attention_dense_equals_the_reference(queries: int) -> None:
    gen = torch.Generator().manual_seed(queries)
    pad = NUM_BLOCKS  # one block more than the pool: the pad block
    k_cache = torch.randn(NUM_BLOCKS + 1, BLOCK, HKV, DH, generator=gen, dtype=F64)
    v_cache = torch.randn(NUM_BLOCKS + 1, BLOCK, HKV, DH, generator=gen, dtype=F64)
    k_cache[pad] = v_cache[pad] = float("nan")
    seq_lens = [queries, 7, 20, 13, queries]  # the last row is padding
    perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables = torch.full((len(seq_lens), WIDTH), pad, dtype=torch.int64)
    for row, length in enumerate(seq_lens[:-1]):
        n = -(-length // BLOCK)
        tables[row, :n] = torch.tensor([perm.pop() for _ in range(n)])
    # Beyond each row's length the blocks hold anything, NaN included.
    k_cache[tables[0, 1:]] = float("nan")
    q = torch.randn(len(seq_lens) * queries, HQ, DH, generator=gen, dtype=F64)
    lens = torch.tensor(seq_lens)
    got = decode_attention_dense(q, k_cache, v_cache, tables, lens, 0.3)
    real = len(seq_lens) - 1
    ref_tables = tables[:real].masked_fill(tables[:real] == pad, -1)
    starts = torch.arange(real + 1) * queries
    want = paged_attention_ref(q[: real * queries], k_cache, v_cache, ref_tables, starts, lens[:real], 0.3,
                               batch_decodes=False)
    torch.testing.assert_close(got[: real * queries], want, rtol=1e-12, atol=1e-12)


def test_write_kv_cache_dense_equals_the_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    cache = [torch.zeros(NUM_BLOCKS, BLOCK, HKV, DH, dtype=F64) for _ in range(4)]
    slots = torch.randperm(NUM_BLOCKS * BLOCK, generator=gen)[:9]
    k, v = (torch.randn(9, HKV, DH, generator=gen, dtype=F64) for _ in range(2))
    write_kv_cache_dense(k, v, cache[0], cache[1], slots)
    write_kv_cache_ref(k, v, cache[2], cache[3], slots)
    assert torch.equal(cache[0], cache[2]) and torch.equal(cache[1], cache[3])
    assert cache[0].abs().sum() > 0


@pytest.mark.parametrize("width", [1, 4])
def test_triton_decode_attention_equals_dense_on_the_graph_buffers(width: int) -> None:
    """The Triton kernel with the inputs the decode graphs build (query_start_loc = arange * W,
    block tables padded with the pad block, seq_len = start + W, pad rows on the pad block) gives
    the dense op's output on every real token (fp32: the interpreter's bf16 is broken)."""
    from replayserve.ops.paged_attention_triton import paged_decode_attention_triton, write_kv_cache_triton

    gen = torch.Generator().manual_seed(width)
    pad, rows = NUM_BLOCKS, 4
    caches = [torch.randn(NUM_BLOCKS + 1, BLOCK, HKV, DH, generator=gen) for _ in range(2)]
    dense = [c.clone() for c in caches]
    perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    starts = [3, 9, 0, 0]  # the last row is padding
    tables = torch.full((rows, WIDTH), pad, dtype=torch.int64)
    for row, start in enumerate(starts[:-1]):
        n = -(-(start + width) // BLOCK)
        tables[row, :n] = torch.tensor([perm.pop() for _ in range(n)])
    seq_lens = torch.tensor([s + width for s in starts[:-1]] + [width])
    slots = torch.tensor([int(tables[r, p // BLOCK]) * BLOCK + p % BLOCK if r < rows - 1 else pad * BLOCK
                          for r in range(rows) for p in range(starts[r], starts[r] + width)])
    k, v = (torch.randn(rows * width, HKV, DH, generator=gen) for _ in range(2))
    q = torch.randn(rows * width, HQ, DH, generator=gen)
    write_kv_cache_dense(k, v, dense[0], dense[1], slots)
    want = decode_attention_dense(q, dense[0], dense[1], tables, seq_lens, 0.3)
    # On CUDA when there is one, else in the interpreter (tests/ops/conftest.py).
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    caches = [c.to(dev) for c in caches]
    write_kv_cache_triton(k.to(dev), v.to(dev), caches[0], caches[1], slots.to(dev))
    real = (rows - 1) * width
    torch.testing.assert_close(caches[0][:pad].cpu(), dense[0][:pad])
    got = paged_decode_attention_triton(q.to(dev), caches[0], caches[1], tables.to(dev),
                                        (torch.arange(rows + 1) * width).to(dev), seq_lens.to(dev), 0.3,
                                        max_query_len=width)
    torch.testing.assert_close(got[:real].cpu(), want[:real], rtol=1e-4, atol=1e-4)
