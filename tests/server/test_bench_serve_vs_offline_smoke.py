"""`benchmarks/bench_serve_vs_offline.py` end to end on the CPU: the built-in model served by a real
`replayserve serve` process and run offline on the same tiny waves, the table printed, the server
stopped cleanly."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_serve_vs_offline  # noqa: E402


@pytest.mark.slow
def test_bench_serve_vs_offline_cpu_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    try:
        result = bench_serve_vs_offline.main([
            "--model", "replayserve/tiny-code", "--device", "cpu", "--concurrency-levels", "1", "2",
            "--num-requests", "4", "--input-len", "8", "--output-len", "4", "--runs", "2",
            "--offline-follow-up-steps", "0", "1", "--server-log", str(tmp_path / "server.log"),
            "--out", str(tmp_path / "result.json")])
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    assert result["meta"]["server_exit_code"] == 0, (tmp_path / "server.log").read_text()[-3000:]
    assert json.loads((tmp_path / "result.json").read_text()) == json.loads(json.dumps(result))
    names = [row["name"] for row in result["rows"]]
    assert names[:2] == ["1 in flight", "2 in flight"]
    assert [n.split(" (")[0] for n in names[2:]] == ["Poisson 0.5 x peak", "Poisson 0.9 x peak"]
    peak = max(row["server"]["request_throughput"] for row in result["rows"][:2])
    assert [row["rate"] for row in result["rows"][2:]] == pytest.approx([0.5 * peak, 0.9 * peak])
    for row in result["rows"]:
        assert f"| {row['name']} | 4 |" in printed
        for side in ("server", "offline"):
            summary = row[side]
            assert summary["failed"] == 0 and summary["errors"] == [], (side, summary["errors"])
            # every request generated exactly its 4 tokens, counted over the wave's duration
            assert summary["output_tok_s"] * summary["duration_s"] == pytest.approx(16)
            assert 0 < summary["ttft_p50_ms"] <= summary["latency_p50_ms"]
        # the server measures a request's TTFT from its arrival: within what the client saw
        assert 0 < row["server"]["server_side_ttft_mean_ms"] <= row["server"]["ttft_mean_ms"]
    assert [row["offline"]["most_in_flight"] for row in result["rows"][:2]] == [1, 2]
    for row in result["rows"]:  # the offline waves again with follow-ups held one step, reported beside
        (other,) = row["offline_other_follow_ups"]
        assert other["follow_up_steps"] == 1 and row["offline"]["follow_up_steps"] == 0
        assert other["failed"] == 0 and other["output_tok_s"] * other["duration_s"] == pytest.approx(16)
        assert f"  {row['name']}, offline follow-ups queued 1 step(s) later: TTFT p50" in printed
    runs = result["runs"]
    assert (runs["in_flight"], runs["requests"], len(runs["server"])) == (2, 4, 2)
    assert runs["server"][0] == result["rows"][1]["server"]
    assert "2 server run(s) of 4 requests at 2 in flight: 0 failed" in printed
