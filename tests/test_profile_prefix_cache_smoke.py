"""`benchmarks/profile_prefix_cache.py` on the CPU: a profiled unique wave per mode, tiny shape."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import profile_prefix_cache  # noqa: E402


@pytest.mark.slow
def test_profile_prefix_cache_cpu_smoke() -> None:
    out = profile_prefix_cache.main(["--backends", "replay", "--requests", "2", "--prefix", "48", "--rows", "3"])
    modes = out["replay"]
    assert set(modes) == {"none", "align", "all"}
    for r in modes.values():
        assert r["prefill_steps"] >= 1 and r["wall_ms"] > 0
        assert r["total_ms"] > 0 and any(name.startswith("aten::") for name in r["by_name"])
