"""`benchmarks/bench_gdn_decode.py` and `bench_gdn_prefill.py` on the CPU (the reference ops), small sizes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_gdn_decode  # noqa: E402
import bench_gdn_prefill  # noqa: E402

# Qwen3.5-9B's GDN layer: (Hv, K, V) = (32, 128, 128) fp32 state, 16 key heads.
STATE = 32 * 128 * 128 * 4
ENTRY = 16 * 128 * 2 + 32 * 128 * 4 + 32 * 4  # a ring entry: k bf16 per key head, delta and g fp32 per value head


@pytest.mark.slow
def test_bench_gdn_decode_cpu_smoke(tmp_path: Path) -> None:
    result = bench_gdn_decode.main(["--device", "cpu", "--batch", "1", "2", "--iters", "2", "--window", "8",
                                    "--out", str(tmp_path / "r.json")])
    assert json.loads((tmp_path / "r.json").read_text())["records"] == result["records"]
    # fla runs on CUDA only: the variants of the reference ops, each checked before timing
    assert set(result["meta"]["checks"]) == {"ours", "replay read", "flush"}
    for r in result["meta"]["checks"].values():
        assert all(v < 1e-2 for k, v in r.items() if "rel" in k)
    rows = {(r["batch"], r["variant"]): r for r in result["records"]}
    assert set(rows) == {(b, v) for b in (1, 2) for v in ("ours", "replay read", "flush", "replay", "replay step")}
    assert all(r["us"] > 0 and r["vs_fla"] is None for r in rows.values())
    # the bytes model: baseline reads and writes the state; a flush also reads W = 8 entries
    assert rows[2, "flush"]["mb"] == pytest.approx(2 * (2 * STATE + 8 * ENTRY) / 1e6)
    assert rows[2, "replay read"]["mb"] < rows[2, "ours"]["mb"] < rows[2, "flush"]["mb"]
    assert rows[1, "replay"]["us"] == pytest.approx(rows[1, "replay read"]["us"] + rows[1, "flush"]["us"] / 8)


def test_bench_gdn_decode_check_stops_a_wrong_flush(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check compares each variant's state with the float64 one: a flush that folds nothing is caught."""
    monkeypatch.setattr(bench_gdn_decode, "replay_gdn_materialize", lambda *args, **kwargs: None)
    with pytest.raises(SystemExit, match="flush disagree"):
        bench_gdn_decode.main(["--device", "cpu", "--batch", "1", "--iters", "1", "--window", "8"])


@pytest.mark.slow
def test_bench_gdn_prefill_cpu_smoke() -> None:
    threads = torch.get_num_threads()
    try:
        result = bench_gdn_prefill.main(["--device", "cpu", "--prompts", "2", "--len", "48", "--iters", "1"])
    finally:
        torch.set_num_threads(threads)
    assert result["meta"]["rule"] == "chunked reference" and result["meta"]["check"]["o_rel_vs_ref64"] < 1e-4
    assert result["tok_s"] > 0 and 0 < result["rule_share"] < 1 and result["layer_mfu"] > 0
