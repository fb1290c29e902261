"""Varlen paged prefill attention (``paged_prefill_attention_triton``) against the reference the engine
ran before it (``paged_attention_ref``: a per-sequence loop, fp32 scores) and against PyTorch's
``scaled_dot_product_attention`` on the same keys and values laid out dense, on CUDA.

Shapes: Nemotron-H-8B attention (32 query heads, 8 KV heads, head_dim 128), bf16, block_size 16,
shuffled block tables. Cases: one 4096-token prompt, 16 prompts of 1024, and a mixed step (a 2048-token
chunk after a 2048-token cached prefix, a fresh 1024-token prompt, 64 decode rows and 16 verify rows of 4
with contexts up to 4096). Each kernel is first checked against the float64 reference (relative L2
error), then timed (median of ``do_bench``). FLOPs count the causal part only: 4 * Hq * Dh per
(query, visible key) pair. SDPA gets the KV heads repeated to 32 (its dense layout, outside the timing)
and runs only where the step is one batch of equal fresh prompts. "x4 layers" is the kernel's time in
the 8B's four attention layers, the part of a step's time it accounts for.

    PYTHONPATH=$PWD python3 benchmarks/bench_prefill_attention.py [--variants] [--out r.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from replayserve.ops import prefill_attention_triton as kernel_module  # noqa: E402
from replayserve.ops.attention import paged_attention_ref  # noqa: E402

HQ, HKV, DH, BLOCK, ACT = 32, 8, 128, 16, torch.bfloat16
ATTENTION_LAYERS = 4  # in Nemotron-H-8B
# Tile overrides tried with --variants (the defaults first).
VARIANTS = [
    {},
    {"BLOCK_N": 32},
    {"BLOCK_N": 128, "num_stages": 2},
    {"BLOCK_M": 64, "num_warps": 4},
    {"num_stages": 2},
    {"num_stages": 4},
    {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 2},
]


def cases() -> dict[str, list[tuple[int, int]]]:
    """Per case, (seq_len, query tokens) of each sequence."""
    gen = torch.Generator().manual_seed(0)
    contexts = torch.randint(256, 4097, (80,), generator=gen).tolist()
    mixed = [(n, 1) for n in contexts[:64]] + [(n, 4) for n in contexts[64:]] + [(4096, 2048), (1024, 1024)]
    return {"1x4096": [(4096, 4096)], "16x1024": [(1024, 1024)] * 16, "mixed": mixed}


def inputs(rows: list[tuple[int, int]], seed: int) -> dict[str, torch.Tensor]:
    """A paged batch: every sequence's context written through a shuffled block table."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks = [math.ceil(n / BLOCK) for n, _ in rows]
    perm = torch.randperm(sum(blocks), generator=gen, device="cuda")
    tables = torch.full((len(rows), max(blocks)), -1, dtype=torch.int64, device="cuda")
    at = 0
    for s, b in enumerate(blocks):
        tables[s, :b] = perm[at : at + b]
        at += b
    k_cache = torch.randn(sum(blocks), BLOCK, HKV, DH, generator=gen, device="cuda").to(ACT)
    v_cache = torch.randn(sum(blocks), BLOCK, HKV, DH, generator=gen, device="cuda").to(ACT)
    q_lens = torch.tensor([q for _, q in rows])
    return {
        "q": torch.randn(int(q_lens.sum()), HQ, DH, generator=gen, device="cuda").to(ACT),
        "k_cache": k_cache, "v_cache": v_cache, "block_tables": tables,
        "query_start_loc": torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]).cuda(),
        "seq_lens": torch.tensor([n for n, _ in rows], device="cuda"),
    }


def causal_flops(rows: list[tuple[int, int]]) -> int:
    pairs = sum(q * (n - q) + q * (q + 1) // 2 for n, q in rows)
    return 4 * HQ * DH * pairs


def dense_kv(inp: dict, rows: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, Hq, L, Dh) q, k, v of a batch of B equal fresh prompts, KV heads repeated for SDPA."""
    b, length = len(rows), rows[0][0]
    pos = torch.arange(length, device="cuda")
    blocks = inp["block_tables"][:, pos // BLOCK]  # (B, L)
    group = HQ // HKV

    def gather(cache: torch.Tensor) -> torch.Tensor:
        return cache[blocks, pos % BLOCK].permute(0, 2, 1, 3).repeat_interleave(group, dim=1).contiguous()

    q = inp["q"].view(b, length, HQ, DH).permute(0, 2, 1, 3).contiguous()
    return q, gather(inp["k_cache"]), gather(inp["v_cache"])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def bench(fn, reps: int = 100) -> float:  # noqa: ANN001
    return triton.testing.do_bench(fn, warmup=25, rep=reps, return_mode="median")


def peak_mib(fn) -> float:  # noqa: ANN001
    """Memory a call allocates beyond what is live before it, in MiB."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def run(name: str, rows: list[tuple[int, int]], variants: bool) -> dict:
    inp = inputs(rows, seed=len(rows))
    scale = DH**-0.5
    args = (inp["q"], inp["k_cache"], inp["v_cache"], inp["block_tables"], inp["query_start_loc"], inp["seq_lens"],
            scale)
    want = paged_attention_ref(*(t.double() if t.is_floating_point() else t for t in args[:6]), scale,
                               batch_decodes=False)
    flops = causal_flops(rows)
    out: dict = {"case": name, "tokens": int(inp["q"].shape[0]), "seqs": len(rows),
                 "error": {"kernel": rel(kernel_module.paged_prefill_attention_triton(*args), want),
                           "ref": rel(paged_attention_ref(*args), want)}}
    times = {"kernel": bench(lambda: kernel_module.paged_prefill_attention_triton(*args)),
             "ref": bench(lambda: paged_attention_ref(*args), reps=300)}
    out["peak_MiB"] = {"kernel": round(peak_mib(lambda: kernel_module.paged_prefill_attention_triton(*args)), 1),
                       "ref": round(peak_mib(lambda: paged_attention_ref(*args)), 1)}
    if len(set(rows)) == 1 and rows[0][0] == rows[0][1]:  # equal fresh prompts: one dense batch
        q, k, v = dense_kv(inp, rows)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        dense_out = sdpa(q, k, v, is_causal=True, scale=scale)
        out["error"]["sdpa"] = rel(dense_out.permute(0, 2, 1, 3).reshape(-1, HQ, DH), want)
        times["sdpa"] = bench(lambda: sdpa(q, k, v, is_causal=True, scale=scale))
        del q, k, v, dense_out
    del want
    out["ms"] = {k: round(v, 4) for k, v in times.items()}
    out["TFLOP_s"] = {k: round(flops / v / 1e9, 1) for k, v in times.items()}
    if variants:
        out["variants_ms"] = {}
        for v in VARIANTS:
            try:
                out["variants_ms"][json.dumps(v)] = round(
                    bench(lambda v=v: kernel_module.paged_prefill_attention_triton(*args, tiles=v)), 4)
            except Exception as e:  # a tile that does not fit (shared memory, registers): report, go on
                out["variants_ms"][json.dumps(v)] = f"failed: {type(e).__name__}: {str(e)[:120]}"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", action="store_true", help="also time the tile overrides in VARIANTS")
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_prefill_attention needs CUDA")
    results = [run(name, rows, args.variants) for name, rows in cases().items()]
    head = (f"{'case':>8} {'tokens':>6} {'kernel ms':>9} {'TFLOP/s':>7} {'x4 layers':>9} {'ref ms':>8} "
            f"{'vs ref':>6} {'sdpa ms':>7} {'TFLOP/s':>7} {'kernel MiB':>10} {'ref MiB':>8} {'err':>8}")
    print(f"{torch.cuda.get_device_name()}, Hq {HQ}, Hkv {HKV}, Dh {DH}, {ACT}, block {BLOCK}")
    print(head)
    for r in results:
        ms, tf = r["ms"], r["TFLOP_s"]
        sdpa = f"{ms['sdpa']:>7.3f} {tf['sdpa']:>7.1f}" if "sdpa" in ms else f"{'-':>7} {'-':>7}"
        print(f"{r['case']:>8} {r['tokens']:>6} {ms['kernel']:>9.3f} {tf['kernel']:>7.1f} "
              f"{ATTENTION_LAYERS * ms['kernel']:>9.3f} {ms['ref']:>8.3f} {ms['ref'] / ms['kernel']:>5.1f}x {sdpa} "
              f"{r['peak_MiB']['kernel']:>10.1f} {r['peak_MiB']['ref']:>8.1f} {r['error']['kernel']:>8.1e}")
        if "variants_ms" in r:
            for v, t in r["variants_ms"].items():
                print(f"{'':>8} tiles {v}: {t} ms")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
