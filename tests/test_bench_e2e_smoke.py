"""`benchmarks/bench_e2e.py` end to end on the CPU: the small shape, one batch, a few steps."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_e2e  # noqa: E402


def test_bench_e2e_cpu_smoke(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    try:  # one thread, as the benchmark runs by default: several times faster on a busy machine
        result = bench_e2e.main(["--device", "cpu", "--size", "small", "--batch", "2", "--steps", "2", "--warmup",
                                 "1", "--repeats", "1", "--prompt-len", "8", "--prefill-prompts", "2",
                                 "--prefill-len", "16", "--ttft-len", "32", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    saved = json.loads((tmp_path / "bench_e2e.json").read_text())
    assert [(r["backend"], r["batch"]) for r in saved["decode"]] == [("baseline", 2), ("replay", 2)]
    for row in result["decode"]:
        assert row["tok_s"] > 0 and 0 < row["of_roofline"] <= row["of_roofline_bytes"] * 1.0001
        assert "gpu_busy" not in row  # no CUDA: the profiler columns are absent, printed as '-'
        # baseline: 2 x the fp32 state per Mamba layer per row; replay reads it once (+ 1/W writes) plus rings
        assert row["bytes_by_part"]["mamba state"] > 0
    baseline, replay = result["decode"]
    assert replay["bytes_by_part"]["mamba state"] < baseline["bytes_by_part"]["mamba state"]
    assert replay["bytes_by_part"]["replay rings"] > 0 == baseline["bytes_by_part"]["replay rings"]
    assert {r["backend"] for r in result["prefill"]} == {"baseline", "replay"}
    assert all(r["prefill_tok_s"] > 0 and r["ttft_tok_s"] > 0 for r in result["prefill"])


def test_bench_e2e_async_rows_overlap() -> None:
    threads = torch.get_num_threads()
    try:
        result = bench_e2e.main(["--device", "cpu", "--size", "small", "--batch", "2", "--steps", "2", "--warmup",
                                 "1", "--repeats", "1", "--prompt-len", "8", "--skip-prefill",
                                 "--backends", "baseline-async", "replay-async"])
    finally:
        torch.set_num_threads(threads)
    assert [r["backend"] for r in result["decode"]] == ["baseline-async", "replay-async"]
    # Every timed step was launched before the previous one was read back.
    assert all(r["tok_s"] > 0 and r["overlapped_share"] == 1 for r in result["decode"])
