"""Triton paged decode/verify attention and KV write against ``paged_attention_ref`` / ``write_kv_cache_ref``.

Caches start as NaN and only the positions below each row's seq_len are filled, so a kernel that
reads past a context, a -1 table entry or a padding row's table shows up as NaN. Block tables are
shuffled; padding rows (seq_len 0) own query tokens, which must come out zero.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from replayserve.ops.attention import paged_attention_ref, write_kv_cache_ref
from replayserve.ops.paged_attention_triton import paged_decode_attention_triton, write_kv_cache_triton

F64 = torch.float64
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
cuda_only = pytest.mark.skipif(not CUDA, reason="needs CUDA")
TOL = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (5e-3, 5e-3)}  # (rtol, atol)


def make_batch(gen: torch.Generator, rows: list[tuple[int, int]], hq: int, hkv: int, dh: int, block_size: int,
               dtype: torch.dtype, num_blocks: int = 0, table_width: int = 0) -> dict[str, Tensor]:
    """rows: (seq_len, query tokens) per row; seq_len 0 is a padding row. Caches NaN outside contexts;
    num_blocks and table_width default to what the rows need, plus spare blocks and a -1 column."""
    needed = [math.ceil(seq_len / block_size) for seq_len, _ in rows]
    num_blocks = num_blocks or sum(needed) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(rows), table_width or max(needed) + 1), -1, dtype=torch.int32)
    k_cache = torch.full((num_blocks, block_size, hkv, dh), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    for s, (seq_len, _) in enumerate(rows):
        tables[s, : needed[s]] = torch.tensor([perm.pop() for _ in range(needed[s])], dtype=torch.int32)
        pos = torch.arange(seq_len)
        blocks, offsets = tables[s].long()[pos // block_size], pos % block_size
        k_cache[blocks, offsets] = torch.randn(seq_len, hkv, dh, generator=gen).to(dtype)
        v_cache[blocks, offsets] = torch.randn(seq_len, hkv, dh, generator=gen).to(dtype)
    n_q = torch.tensor([n for _, n in rows])
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), n_q.cumsum(0)])
    q = torch.randn(int(starts[-1]), hq, dh, generator=gen).to(dtype)
    seq_lens = torch.tensor([seq_len for seq_len, _ in rows], dtype=torch.int32)
    return {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": tables,
            "query_start_loc": starts.to(torch.int32), "seq_lens": seq_lens}


def reference(batch: dict[str, Tensor], scale: float) -> tuple[Tensor, Tensor]:
    """float64 ``paged_attention_ref`` over the real rows; returns (their token indices, output)."""
    starts, lens = batch["query_start_loc"].long().cpu(), batch["seq_lens"].cpu()
    real = [s for s in range(len(lens)) if lens[s] > 0]
    tokens = torch.cat([torch.arange(int(starts[s]), int(starts[s + 1])) for s in real])
    n_q = torch.tensor([int(starts[s + 1] - starts[s]) for s in real])
    ref = paged_attention_ref(
        batch["q"].cpu()[tokens].double(), batch["k_cache"].cpu().double(), batch["v_cache"].cpu().double(),
        batch["block_tables"].cpu()[real], torch.cat([torch.zeros(1, dtype=torch.int64), n_q.cumsum(0)]),
        lens[real], scale, batch_decodes=False)
    return tokens, ref


def check(batch: dict[str, Tensor], out: Tensor, scale: float, dtype: torch.dtype) -> None:
    tokens, ref = reference(batch, scale)
    assert out.dtype == dtype
    out = out.cpu()
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out[tokens].double(), ref, rtol=rtol, atol=atol)
    padding = torch.ones(out.shape[0], dtype=torch.bool)
    padding[tokens] = False
    assert not out[padding].any(), "padding rows output zeros"


# (name, rows, Hq, Hkv, Dh, block_size, max_query_len, num_splits): contexts below, at and above a
# block and a K/V tile (64), rows of 1 and 4 query tokens, one padding row.
SMALL = [
    ("gqa4-mixed", [(37, 4), (1, 1), (0, 4), (16, 1), (100, 4), (5, 4)], 4, 1, 24, 4, 4, None),
    ("gqa1-decode", [(70, 1), (0, 1), (16, 1), (3, 1)], 2, 2, 16, 16, 1, 1),
    ("gqa4-uniform", [(50, 3), (0, 3), (129, 3)], 8, 2, 32, 16, 3, 3),
]
CASES = [pytest.param(*case[1:], torch.float32, id=f"{case[0]}-f32") for case in SMALL]
if CUDA:
    rng = torch.Generator().manual_seed(7)
    long_rows = [(int(n), w) for n, w in zip(torch.randint(1, 4097, (24,), generator=rng), [1, 4] * 12, strict=True)]
    long_rows[5] = (0, 4)
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        name = str(dt)[6:]
        CASES += [
            pytest.param(*SMALL[0][1:], dt, id=f"gqa4-mixed-{name}"),
            pytest.param(long_rows, 32, 8, 128, 16, 4, None, dt, id=f"nemotron-verify-{name}"),
            pytest.param([(n, 1) for n, _ in long_rows], 32, 8, 128, 16, 1, None, dt, id=f"nemotron-decode-{name}"),
            pytest.param([(n, 1) for n, _ in long_rows[:2]], 32, 8, 128, 16, 1, None, dt, id=f"nemotron-b2-{name}"),
        ]


@pytest.mark.parametrize(("rows", "hq", "hkv", "dh", "block_size", "width", "splits", "dtype"), CASES)
def test_paged_decode_attention_matches_reference(rows: list[tuple[int, int]], hq: int, hkv: int, dh: int,
                                                  block_size: int, width: int, splits: int | None,
                                                  dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(len(rows) * 31 + hq)
    batch = {k: t.to(DEVICE) for k, t in make_batch(gen, rows, hq, hkv, dh, block_size, dtype).items()}
    scale = dh**-0.5
    out = paged_decode_attention_triton(**batch, scale=scale, max_query_len=width, num_splits=splits)
    check(batch, out, scale, dtype)


def test_paged_decode_attention_split_counts_agree() -> None:
    """Any split count, more splits than a context has tiles too, gives the same output."""
    gen = torch.Generator().manual_seed(3)
    rows = [(130, 2), (9, 1), (0, 2)]
    batch = {k: t.to(DEVICE) for k, t in make_batch(gen, rows, 4, 2, 16, 8, torch.float32).items()}
    outs = [paged_decode_attention_triton(**batch, scale=0.3, max_query_len=2, num_splits=n) for n in (1, 2, 5)]
    check(batch, outs[0], 0.3, torch.float32)
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=1e-5, atol=1e-6)


def kv_writes(gen: torch.Generator, tokens: int, hkv: int, dh: int, num_blocks: int, block_size: int,
              dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """k and v as strided views of one fused projection, and distinct slots with -1 padding."""
    kv = torch.randn(tokens, 3, hkv, dh, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[torch.randperm(tokens, generator=gen)[: tokens // 3]] = -1
    return kv[:, 0], kv[:, 2], slots


@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if CUDA else []))
def test_write_kv_cache_matches_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    num_blocks, block_size, hkv, dh = 5, 4, 3, 20
    k, v, slots = kv_writes(gen, 13, hkv, dh, num_blocks, block_size, dtype)
    caches = [torch.randn(num_blocks, block_size, hkv, dh, generator=gen).to(dtype) for _ in range(2)]
    expected = [c.clone() for c in caches]
    write_kv_cache_ref(k, v, *expected, slots)
    caches = [c.to(DEVICE) for c in caches]
    write_kv_cache_triton(k.to(DEVICE), v.to(DEVICE), *caches, slots.to(DEVICE))
    for got, want in zip(caches, expected, strict=True):
        assert torch.equal(got.cpu(), want)


@cuda_only
def test_graph_replay_follows_new_inputs() -> None:
    """One graph of KV write + attention for 4 rows of width 2, replayed with new seq_lens, block
    tables, query_start_loc, slots and tokens, matches the references on each replay's inputs."""
    gen = torch.Generator().manual_seed(5)
    hq, hkv, dh, block_size, width, rows, num_blocks = 32, 8, 128, 16, 2, 4, 160
    dt = torch.bfloat16

    def inputs(lens: list[int]) -> dict[str, Tensor]:
        batch = make_batch(gen, [(n, width) for n in lens], hq, hkv, dh, block_size, dt, num_blocks, 80)
        # This step's K/V, the last `width` positions of each real row, are written by the graph.
        tables, slots = batch["block_tables"].long(), []
        for s, n in enumerate(lens):
            slots += [int(tables[s, p // block_size]) * block_size + p % block_size if n else -1
                      for p in range(n - width, n)]
        batch["slots"] = torch.tensor(slots)
        batch["k_new"] = torch.randn(rows * width, hkv, dh, generator=gen).to(dt)
        batch["v_new"] = torch.randn(rows * width, hkv, dh, generator=gen).to(dt)
        return batch

    first = inputs([40, 0, 17, 300])
    static = {k: t.cuda() for k, t in first.items()}
    scale = dh**-0.5

    def step() -> Tensor:
        write_kv_cache_triton(static["k_new"], static["v_new"], static["k_cache"], static["v_cache"], static["slots"])
        return paged_decode_attention_triton(static["q"], static["k_cache"], static["v_cache"], static["block_tables"],
                                             static["query_start_loc"], static["seq_lens"], scale, width)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for lens in ([40, 0, 17, 300], [3, 900, 0, 64], [0, 0, 1000, 2]):
        new = inputs(lens)
        for k, t in new.items():
            static[k].copy_(t)
        graph.replay()
        torch.cuda.synchronize()
        write_kv_cache_ref(new["k_new"], new["v_new"], new["k_cache"], new["v_cache"], new["slots"])
        for name in ("k_cache", "v_cache"):
            torch.testing.assert_close(static[name].cpu(), new[name], rtol=0, atol=0, equal_nan=True)
        check(new, out, scale, dt)
