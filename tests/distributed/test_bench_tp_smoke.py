"""`benchmarks/bench_tp.py` on the CPU: the tiny shape at 1 and 2 ranks (gloo), a few steps."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_tp  # noqa: E402


@pytest.mark.slow
def test_bench_tp_cpu_smoke(tmp_path: Path) -> None:
    rows = bench_tp.main(["--device", "cpu", "--size", "tiny", "--tp", "1", "2", "--batch", "1", "3",
                          "--prompt-len", "8", "--steps", "2", "--warmup", "1", "--repeats", "1",
                          "--profile-steps", "2", "--model-dir", str(tmp_path / "model"), "--out", str(tmp_path)])
    assert [(r["tp"], r["batch"]) for r in rows] == [(1, 1), (1, 3), (2, 1), (2, 3)]
    assert all(r["tok_s"] > 0 for r in rows)
    # One rank calls no collective; two all-reduce every row-parallel output and gather the logits.
    assert all(r["collectives_per_step"] == 0 for r in rows if r["tp"] == 1)
    assert all(r["collectives_per_step"] > 0 and r["collective_ms_per_step"] > 0 for r in rows if r["tp"] == 2)
    assert json.loads((tmp_path / "bench_tp.json").read_text())["rows"] == rows
    assert (tmp_path / "model" / "config.json").is_file()  # --model-dir keeps the checkpoint for the next run
