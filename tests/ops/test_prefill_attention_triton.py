"""Triton varlen paged prefill attention against ``paged_attention_ref`` computed in float64.

Batches come from the decode kernel's ``make_batch``: caches NaN outside every context, shuffled
block tables with a spare -1 column, so a read past a context or through a -1 entry shows up as
NaN. In the interpreter (fp32) the tiles are small (16 query rows x 16 keys unless a case sets
others), so short sequences cross many query and key tiles; on CUDA the default tiles run at
Nemotron-H-8B's shapes in bf16, fp16 and fp32.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor

from replayserve.builtin.tiny import tiny_config
from replayserve.config import ModelConfig
from replayserve.layers.attention import Attention
from replayserve.layers.step_context import StepContext
from replayserve.ops.attention import paged_attention_ref
from replayserve.ops.dispatch import force_triton
from replayserve.ops.prefill_attention_triton import paged_prefill_attention_triton
from tests.ops.test_paged_attention_triton import make_batch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
cuda_only = pytest.mark.skipif(not CUDA, reason="needs CUDA")
TOL = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (5e-3, 5e-3)}  # (rtol, atol)


def reference(batch: dict[str, Tensor], scale: float) -> Tensor:
    """``paged_attention_ref`` in float64 on the batch's device, one sequence at a time."""
    return paged_attention_ref(batch["q"].double(), batch["k_cache"].double(), batch["v_cache"].double(),
                               batch["block_tables"], batch["query_start_loc"], batch["seq_lens"], scale,
                               batch_decodes=False)


def run_case(rows: list[tuple[int, int]], hq: int, hkv: int, dh: int, block_size: int, dtype: torch.dtype,
             tiles: dict[str, int] | None = None, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    batch = {k: t.to(DEVICE) for k, t in make_batch(gen, rows, hq, hkv, dh, block_size, dtype).items()}
    scale = dh**-0.5
    out = paged_prefill_attention_triton(**batch, scale=scale, tiles=tiles)
    assert out.dtype == dtype
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.double(), reference(batch, scale), rtol=rtol, atol=atol)


# (name, rows as (seq_len, query tokens), Hq, Hkv, Dh, block_size, tiles). A seq_len above the query
# count is a cached prefix (a prefix-cache hit or a later chunk of a chunked prefill); rows of 1..6
# queries with long contexts are decode and verify rows.
SMALL = [
    ("shorter-than-a-tile", [(3, 3), (2, 2), (1, 1)], 4, 1, 16, 4, None),
    ("long-many-key-tiles", [(150, 150)], 2, 2, 16, 16, None),
    ("cached-prefix", [(120, 30), (64, 1), (40, 39), (17, 16)], 4, 2, 32, 4, None),
    ("decode-mixed-with-prefill", [(37, 1), (70, 4), (9, 6), (45, 45), (100, 2), (33, 20)], 8, 2, 16, 16, None),
    ("gqa1-block4", [(50, 50), (31, 7), (19, 1)], 2, 2, 32, 4, None),
    ("gqa3-non-pow2-group", [(90, 87), (60, 5), (8, 1)], 6, 2, 16, 16, None),
    ("block1-wide-tiles", [(70, 70), (35, 9)], 4, 2, 16, 1, {"BLOCK_M": 32, "BLOCK_N": 32}),
    ("head-dim-64", [(48, 48), (80, 17)], 2, 1, 64, 16, None),
    ("empty-rows", [(5, 0), (30, 30), (12, 0), (9, 2)], 4, 2, 16, 4, None),
    ("key-tile-wider-than-block", [(130, 64), (66, 66), (3, 1)], 4, 1, 16, 4, {"BLOCK_M": 32, "BLOCK_N": 64}),
]
CASES = [pytest.param(*case[1:], torch.float32, id=f"{case[0]}-f32") for case in SMALL]
if CUDA:
    rng = torch.Generator().manual_seed(13)
    decodes = [(int(n), w) for n, w in zip(torch.randint(1, 4097, (24,), generator=rng), [1, 4, 1, 6] * 6,
                                           strict=True)]
    NEMOTRON = [
        ("1x4096", [(4096, 4096)]),
        ("16x1024", [(1024, 1024)] * 16),
        ("mixed", decodes + [(4096, 2048), (1500, 1500), (3000, 77), (200, 200)]),
    ]
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        name = str(dt)[6:]
        CASES += [pytest.param(*SMALL[3][1:6], None, dt, id=f"decode-mixed-with-prefill-{name}")]
        CASES += [pytest.param(rows, 32, 8, 128, 16, None, dt, id=f"nemotron-{label}-{name}")
                  for label, rows in NEMOTRON]


@pytest.mark.parametrize(("rows", "hq", "hkv", "dh", "block_size", "tiles", "dtype"), CASES)
def test_prefill_attention_matches_reference(rows: list[tuple[int, int]], hq: int, hkv: int, dh: int,
                                             block_size: int, tiles: dict[str, int] | None,
                                             dtype: torch.dtype) -> None:
    run_case(rows, hq, hkv, dh, block_size, dtype, tiles, seed=len(rows) * 31 + hq + dh)


def test_prefill_attention_takes_int64_metadata_and_strided_tensors() -> None:
    """The runner's int64 metadata; q a view of a fused projection, caches with a padded head stride,
    the output of q's layout."""
    gen = torch.Generator().manual_seed(4)
    rows, hq, hkv, dh, block_size = [(40, 25), (23, 1), (9, 9)], 4, 2, 16, 8
    batch = make_batch(gen, rows, hq, hkv, dh, block_size, torch.float32)
    fused = torch.randn(batch["q"].shape[0], hq + 2, dh, generator=gen)
    fused[:, 1 : hq + 1] = batch["q"]
    wide = [torch.full((*c.shape[:3], dh + 8), float("nan")) for c in (batch["k_cache"], batch["v_cache"])]
    for w, c in zip(wide, (batch["k_cache"], batch["v_cache"]), strict=True):
        w[..., :dh] = c
    # Moved before slicing: copying a view with gaps to another device makes it contiguous.
    fused, wide = fused.to(DEVICE), [w.to(DEVICE) for w in wide]
    strided = {"q": fused[:, 1 : hq + 1], "k_cache": wide[0][..., :dh], "v_cache": wide[1][..., :dh],
               **{k: batch[k].long().to(DEVICE) for k in ("block_tables", "query_start_loc", "seq_lens")}}
    assert not strided["q"].is_contiguous() and not strided["k_cache"].is_contiguous()
    out = paged_prefill_attention_triton(**strided, scale=0.3)
    torch.testing.assert_close(out.double().cpu(), reference(batch, 0.3), rtol=1e-4, atol=1e-5)


def test_prefill_attention_tile_sizes_agree() -> None:
    """Query and key tiles smaller, equal and larger than a block and a sequence give one answer."""
    gen = torch.Generator().manual_seed(8)
    batch = {k: t.to(DEVICE) for k, t in make_batch(gen, [(90, 60), (7, 1), (33, 33)], 4, 2, 16, 8,
                                                     torch.float32).items()}
    want = reference(batch, 0.25)
    for tiles in ({"BLOCK_M": 16, "BLOCK_N": 16}, {"BLOCK_M": 64, "BLOCK_N": 16}, {"BLOCK_M": 16, "BLOCK_N": 128}):
        out = paged_prefill_attention_triton(**batch, scale=0.25, tiles=tiles)
        torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-5, msg=lambda m, t=tiles: f"{t}: {m}")


@pytest.mark.parametrize("head_dim", [24, 8, 512])
def test_prefill_attention_rejects_unsupported_head_dim(head_dim: int) -> None:
    q = torch.zeros(2, 2, head_dim)
    cache = torch.zeros(1, 4, 1, head_dim)
    with pytest.raises(ValueError, match="head_dim"):
        paged_prefill_attention_triton(q, cache, cache, torch.zeros(1, 1, dtype=torch.int64), torch.tensor([0, 2]),
                                       torch.tensor([2]), 1.0)


def _layer_step(seed: int, dtype: torch.dtype) -> tuple[Attention, Tensor, StepContext, tuple[Tensor, Tensor]]:
    """A tiny attention layer and a mixed step: two decode rows, then a chunk with a cached prefix
    and a fresh prompt; the caches hold the earlier positions, NaN elsewhere."""
    cfg: ModelConfig = dataclasses.replace(tiny_config(), num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                           hidden_size=32)
    gen = torch.Generator().manual_seed(seed)
    layer = Attention(cfg)
    for p in layer.parameters():
        p.data = torch.randn(p.shape, generator=gen) * 0.3
    layer = layer.to(dtype)
    block_size, num_blocks = 4, 40
    seqs = [(20, 1), (9, 1), (30, 11), (13, 13)]  # (seq_len after the step, query tokens)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[perm.pop() for _ in range(-(-n // block_size))] for n, _ in seqs]
    width = max(len(t) for t in tables) + 1
    caches = tuple(torch.full((num_blocks, block_size, 2, 16), float("nan"), dtype=dtype) for _ in range(2))
    slots, starts = [], [0]
    for (n, q_len), table in zip(seqs, tables, strict=True):
        for p in range(n):
            slot = (table[p // block_size], p % block_size)
            if p < n - q_len:
                caches[0][slot] = torch.randn(2, 16, generator=gen).to(dtype)
                caches[1][slot] = torch.randn(2, 16, generator=gen).to(dtype)
            else:
                slots.append(slot[0] * block_size + slot[1])
        starts.append(starts[-1] + q_len)
    ctx = StepContext(
        positions=torch.tensor([p for n, q_len in seqs for p in range(n - q_len, n)]),
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts),
        seq_lens=torch.tensor([n for n, _ in seqs]),
        block_tables=torch.tensor([t + [-1] * (width - len(t)) for t in tables]),
        state_slots=torch.arange(len(seqs)), num_decodes=2, query_lens=tuple(q for _, q in seqs),
        state_slot_list=tuple(range(len(seqs))))
    hidden = torch.randn(starts[-1], cfg.hidden_size, generator=gen).to(dtype)
    return layer, hidden, ctx, caches


def test_attention_layer_prefill_path_matches_reference() -> None:
    """Attention.forward on a mixed step: the Triton path (KV write + this kernel; on CPU in the
    interpreter) gives the float64 reference path's output and caches."""
    layer, hidden, ctx, caches = _layer_step(3, torch.float64)
    want = layer(hidden, ctx, caches)
    layer32, hidden32, ctx32, caches32 = _layer_step(3, torch.float32)
    dev_ctx = StepContext(**{f.name: (v.to(DEVICE) if isinstance(v := getattr(ctx32, f.name), Tensor) else v)
                             for f in dataclasses.fields(ctx32)})
    dev_caches = tuple(c.to(DEVICE) for c in caches32)
    with force_triton():
        got = layer32.to(DEVICE)(hidden32.to(DEVICE), dev_ctx, dev_caches)
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-4, atol=1e-5)
    for c32, c64 in zip(dev_caches, caches, strict=True):
        torch.testing.assert_close(c32.double().cpu(), c64, rtol=1e-6, atol=1e-6, equal_nan=True)


@cuda_only
def test_prefill_attention_graph_replay_follows_new_inputs() -> None:
    """The grid and arguments depend on shapes only: a graph captured for one step's shapes replays
    correctly for other query lengths, contexts and block tables of the same shapes."""
    gen = torch.Generator().manual_seed(21)
    hq, hkv, dh, block_size, dt = 32, 8, 128, 16, torch.bfloat16

    def inputs(rows: list[tuple[int, int]]) -> dict[str, Tensor]:
        return make_batch(gen, rows, hq, hkv, dh, block_size, dt, num_blocks=200, table_width=100)

    # (seq_len, query tokens): 300 query tokens in every step, as a graph's fixed shapes need.
    steps = [[(300, 200), (50, 1), (700, 99)], [(1000, 2), (1, 1), (297, 297)], [(100, 100), (900, 100), (105, 100)]]
    static = {k: t.cuda() for k, t in inputs(steps[0]).items()}
    scale = dh**-0.5
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        paged_prefill_attention_triton(**static, scale=scale)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_prefill_attention_triton(**static, scale=scale)
    for rows in steps:
        new = inputs(rows)
        for k, t in new.items():
            static[k].copy_(t)
        graph.replay()
        torch.testing.assert_close(out.double(), reference(static, scale), rtol=TOL[dt][0], atol=TOL[dt][1])
