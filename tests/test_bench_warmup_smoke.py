"""`benchmarks/bench_warmup.py` end to end on the CPU: the tiny shape, two short waves."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_warmup  # noqa: E402


def test_bench_warmup_cpu_smoke(tmp_path: Path) -> None:
    out = tmp_path / "warmup.json"
    bench_warmup.main(["--device", "cpu", "--size", "tiny", "--prompts", "2", "--prompt-len", "8",
                       "--output-len", "4", "--budget", "16", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["warmup"].startswith("no decode graphs, prefill steps of 1..16 tokens, 1..2 decoding requests")
    assert [w["wave"] for w in saved["waves"]] == [1, 2]
    assert all(w["output_tok_s"] > 0 and w["compiles"] == 0 for w in saved["waves"])
    assert saved["first_over_second"] > 0
