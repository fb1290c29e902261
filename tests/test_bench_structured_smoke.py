"""`benchmarks/bench_structured.py` on the CPU: the tiny shape, two batch sizes, a few steps; the
JSON tokenizer it builds spells JSON and is read by xgrammar as byte-level."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_structured  # noqa: E402

pytest.importorskip("xgrammar")


def test_the_json_tokenizer_has_the_vocabulary_size_and_decodes_bytes() -> None:
    tokenizer = bench_structured.json_tokenizer(2048)
    assert tokenizer.get_vocab_size() == 2048
    text = '{"records": [{"id": 7, "name": "Ünï"}]}'
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_bench_structured_cpu_smoke(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    out = tmp_path / "bench_structured.json"
    try:
        result = bench_structured.main(["--device", "cpu", "--size", "tiny", "--batch", "1", "3", "--steps", "3",
                                        "--warmup", "1", "--repeats", "1", "--prompt-len", "8", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert [row["batch"] for row in result["rows"]] == [1, 3]
    for row in result["rows"]:
        assert row["unconstrained"]["tok_s"] > 0 and row["json_schema"]["tok_s"] > 0 and row["ratio"] > 0
        assert row["json_schema"]["mask_ms_per_step"] > 0 and "mask_ms_per_step" not in row["unconstrained"]
    assert result["meta"]["first_compile_s"] > 0


def test_bench_structured_host_times_each_phase_and_only_constrained_steps_fill_and_accept() -> None:
    import bench_structured_host

    threads = torch.get_num_threads()
    try:
        result = bench_structured_host.main(["--size", "tiny", "--batch", "3", "--steps", "3", "--warmup", "1",
                                             "--prompt-len", "8"])
    finally:
        torch.set_num_threads(threads)
    free, constrained = result["3/free"], result["3/json"]
    assert free["fill"] == free["accept"] == 0 < constrained["fill"] and constrained["accept"] > 0
    for ms in (free, constrained):
        assert all(ms[phase] >= 0 for phase in ("plan", "rows", "fill", "bitmask", "sampling", "accept", "outputs"))
        assert ms["forward"] > 0 and ms["step"] >= ms["forward"]
