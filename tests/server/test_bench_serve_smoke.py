"""`benchmarks/bench_serve.py` against the test server: every request is measured and generates
exactly its sampled output length, with shared prefixes and a concurrency cap."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_serve  # noqa: E402

from tests.server.conftest import RunningServer  # noqa: E402


def test_bench_serve_smoke(server: RunningServer) -> None:
    args = bench_serve.build_parser().parse_args([
        "--base-url", server.base_url, "--num-requests", "12", "--concurrency", "4", "--request-rate", "50",
        "--input-len", "12", "--output-len", "6", "--prefix-len", "16", "--num-prefixes", "2", "--warmup", "1"])
    results, duration = asyncio.run(bench_serve.run(args))
    workload = bench_serve.make_workload(args)
    assert [r.output_tokens for r in results] == [n for _, n in workload]
    assert [r.prompt_tokens for r in results] == [len(p) for p, _ in workload]
    assert all(0 < r.ttft <= r.latency for r in results)
    summary = bench_serve.summarize(results, duration)
    assert summary["failed"] == 0 and summary["output_tok_s"] > 0
    assert summary["ttft_p50_ms"] <= summary["ttft_p99_ms"]
    assert bench_serve.markdown_row(args, summary).count("|") == 9
