from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from replayserve.ops.attention import paged_attention_ref, write_kv_cache_ref

F64 = torch.float64
TOL = 1e-10
HQ, HKV, DH, BLOCK, NUM_BLOCKS = 4, 2, 8, 4, 24
# (seq_len, q_len): full prefill, chunked prefills, decodes, block-aligned lengths.
SEQS = [(7, 7), (13, 5), (1, 1), (9, 1), (16, 3), (8, 1)]


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def build_batch(gen: torch.Generator, index_dtype: torch.dtype) -> dict[str, object]:
    """Random per-sequence K/V/Q plus a shuffled, non-contiguous block assignment."""
    perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    max_blocks = max(math.ceil(L / BLOCK) for L, _ in SEQS) + 1  # +1 so every row has -1 padding
    tables = torch.full((len(SEQS), max_blocks), -1, dtype=index_dtype)
    ks, vs, qs = [], [], []
    for s, (seq_len, q_len) in enumerate(SEQS):
        n = math.ceil(seq_len / BLOCK)
        tables[s, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=index_dtype)
        ks.append(torch.randn(seq_len, HKV, DH, generator=gen, dtype=F64))
        vs.append(torch.randn(seq_len, HKV, DH, generator=gen, dtype=F64))
        qs.append(torch.randn(q_len, HQ, DH, generator=gen, dtype=F64))
    return {"tables": tables, "k": ks, "v": vs, "q": qs}


def slot_of(tables: torch.Tensor, s: int, pos: int) -> int:
    return int(tables[s, pos // BLOCK]) * BLOCK + pos % BLOCK


def flat_writes(gen: torch.Generator, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All tokens of all sequences in random order, interleaved with -1 padding rows."""
    rows = [(s, p) for s, (L, _) in enumerate(SEQS) for p in range(L)] + [None] * 9
    order = torch.randperm(len(rows), generator=gen).tolist()
    k, v, slots = [], [], []
    for i in order:
        if rows[i] is None:
            k.append(torch.full((HKV, DH), 1e6, dtype=F64))
            v.append(torch.full((HKV, DH), -1e6, dtype=F64))
            slots.append(-1)
        else:
            s, p = rows[i]
            k.append(batch["k"][s][p])
            v.append(batch["v"][s][p])
            slots.append(slot_of(batch["tables"], s, p))
    return torch.stack(k), torch.stack(v), torch.tensor(slots, dtype=torch.int64)


def test_write_kv_cache_scatters_and_skips_padding() -> None:
    gen = torch.Generator().manual_seed(0)
    batch = build_batch(gen, torch.int64)
    k, v, slots = flat_writes(gen, batch)
    assert (slots == -1).any()
    k_cache = torch.randn(NUM_BLOCKS, BLOCK, HKV, DH, generator=gen, dtype=F64)
    v_cache = torch.randn(NUM_BLOCKS, BLOCK, HKV, DH, generator=gen, dtype=F64)
    k_exp, v_exp = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_exp[slot // BLOCK, slot % BLOCK] = k[t]
            v_exp[slot // BLOCK, slot % BLOCK] = v[t]
    write_kv_cache_ref(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_exp) and torch.equal(v_cache, v_exp)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Contiguous causal GQA via SDPA; the queries are the last q_len positions."""
    q_len, seq_len = q.shape[0], k.shape[0]
    k = k.repeat_interleave(HQ // HKV, dim=1)
    v = v.repeat_interleave(HQ // HKV, dim=1)
    q_pos = torch.arange(seq_len - q_len, seq_len)
    mask = torch.arange(seq_len)[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("batch_decodes", [False, True], ids=["loop", "batched-decodes"])
def test_paged_attention_matches_dense(index_dtype: torch.dtype, batch_decodes: bool) -> None:
    gen = torch.Generator().manual_seed(1 if index_dtype == torch.int32 else 2)
    batch = build_batch(gen, index_dtype)
    k, v, slots = flat_writes(gen, batch)
    # Unwritten slots hold NaN, so reading past a sequence's length would show.
    k_cache = torch.full((NUM_BLOCKS, BLOCK, HKV, DH), math.nan, dtype=F64)
    v_cache = torch.full_like(k_cache, math.nan)
    write_kv_cache_ref(k, v, k_cache, v_cache, slots)

    q = torch.cat(batch["q"])
    q_lens = [ql for _, ql in SEQS]
    query_start_loc = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=index_dtype)
    seq_lens = torch.tensor([L for L, _ in SEQS], dtype=index_dtype)
    scale = DH**-0.5
    out = paged_attention_ref(q, k_cache, v_cache, batch["tables"], query_start_loc, seq_lens, scale,
                              batch_decodes=batch_decodes)
    assert out.shape == q.shape and out.dtype == F64
    expected = torch.cat(
        [dense_attention(batch["q"][s], batch["k"][s], batch["v"][s], scale) for s in range(len(SEQS))]
    )
    assert rel_err(out, expected) < TOL


def test_paged_attention_low_precision_dtype() -> None:
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, HQ, DH, generator=gen).bfloat16()
    k_cache = torch.randn(2, BLOCK, HKV, DH, generator=gen).bfloat16()
    v_cache = torch.randn(2, BLOCK, HKV, DH, generator=gen).bfloat16()
    tables = torch.tensor([[1, 0]])
    out = paged_attention_ref(q, k_cache, v_cache, tables, torch.tensor([0, 2]), torch.tensor([6]), 0.3)
    assert out.dtype == torch.bfloat16
    k = torch.cat([k_cache[1], k_cache[0]])[:6].double()
    v = torch.cat([v_cache[1], v_cache[0]])[:6].double()
    expected = dense_attention(q.double(), k, v, 0.3)
    assert rel_err(out.double(), expected) < 2e-2
