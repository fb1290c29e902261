"""The offline half of `benchmarks/bench_serve_vs_offline.py` and its plumbing, on the CPU: waves stepped
on the engine with per-request times, the engine flags handed to `replayserve serve`, and the
random-weight checkpoint `--size` writes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from bench_serve_vs_offline import engine_flags  # noqa: E402
from offline_waves import offline_wave  # noqa: E402
from shapes import write_checkpoint  # noqa: E402

from replayserve.cli import build_parser, engine_options  # noqa: E402
from replayserve.llm import LLM  # noqa: E402
from tests.conftest import assert_pools_full  # noqa: E402

WORKLOAD = [([3, 4, 5, 6, 7], 4), ([8, 9, 10], 3), ([11, 12, 13, 14], 5)]


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(tiny_model_dir: Path, request: pytest.FixtureRequest) -> LLM:
    return LLM(model=str(tiny_model_dir), device="cpu", dtype="float32", max_num_seqs=4,
               async_scheduling=request.param)


def test_a_closed_loop_wave_sends_each_request_when_a_slot_frees(llm: LLM) -> None:
    """One in flight: each request is sent when the one before it ends, so latencies add up to the wave."""
    results, duration, most = offline_wave(llm.engine, WORKLOAD, [0.0] * 3, in_flight=1)
    assert most == 1
    assert [(r.ok, r.prompt_tokens, r.output_tokens) for r in results] == [(True, len(p), n) for p, n in WORKLOAD]
    assert all(0 < r.ttft < r.latency and len(r.itl) >= 1 for r in results)
    assert sum(r.latency for r in results) == pytest.approx(duration, rel=1e-9)
    assert_pools_full(llm)


def test_a_follow_up_can_be_held_back_one_step_as_a_server_receives_it(llm: LLM) -> None:
    """Two in flight; the third request is sent when the first ends and outlives the second, so the
    wave ends with it: queued one step() later, it ends one step later."""
    workload = [(WORKLOAD[0][0], 2), (WORKLOAD[1][0], 4), (WORKLOAD[2][0], 10)]
    steps = []
    for delay in (0, 1):
        before = llm.engine.num_steps
        results, _, most = offline_wave(llm.engine, workload, [0.0] * 3, in_flight=2, follow_up_steps=delay)
        assert most == 2 and all(r.ok for r in results)
        steps.append(llm.engine.num_steps - before)
    assert steps[1] == steps[0] + 1
    # with one in flight the engine is idle when a response ends: nothing to wait for
    counts = [offline_wave(llm.engine, WORKLOAD, [0.0] * 3, in_flight=1, follow_up_steps=d)[0] for d in (0, 1)]
    assert [r.output_tokens for r in counts[0]] == [r.output_tokens for r in counts[1]]
    with pytest.raises(ValueError, match="follow_up_steps must be >= 0"):
        offline_wave(llm.engine, workload, [0.0] * 3, follow_up_steps=-1)
    assert_pools_full(llm)


def test_a_poisson_wave_times_each_request_from_its_arrival(llm: LLM) -> None:
    results, duration, most = offline_wave(llm.engine, WORKLOAD[:2], [0.0, 1.5])
    assert most == 1  # the first had finished before the second arrived
    assert duration >= 1.5
    assert results[1].latency == pytest.approx(duration - 1.5)  # from its arrival, not the wave's start
    assert all(r.ok for r in results)
    assert_pools_full(llm)


def test_engine_flags_give_serve_the_same_engine_options() -> None:
    options = engine_options(build_parser().parse_args(["serve"]))
    options |= {"dtype": "float32", "device": "cpu", "max_num_seqs": 7, "max_model_len": 300, "ssm_backend": "replay",
                "gpu_memory_utilization": 0.75, "async_scheduling": True, "enforce_eager": True,
                "speculative": {"method": "ngram", "num_speculative_tokens": 2}}
    parsed = build_parser().parse_args(["serve", *engine_flags(options)])
    assert engine_options(parsed) == options


def test_a_written_shape_checkpoint_loads_and_every_sampled_token_has_text(tmp_path: Path) -> None:
    import torch

    out = write_checkpoint("tiny", tmp_path / "ckpt", torch.float32, "cpu", seed=1)
    llm = LLM(model=str(out), device="cpu", dtype="float32", max_num_seqs=2)
    assert llm.tokenizer is not None and llm.tokenizer.vocab_size == llm.config.model.vocab_size
    results, _, _ = offline_wave(llm.engine, WORKLOAD[:2], [0.0, 0.0])
    assert all(r.ok for r in results)
    weights = out / "model.safetensors"
    written = weights.stat().st_mtime_ns
    assert write_checkpoint("tiny", out, torch.float32, "cpu", seed=1) == out
    assert weights.stat().st_mtime_ns == written  # the shape was already there: kept, not rewritten
    # the server streams a chunk only when it has text: no token the model can sample decodes to none
    assert all(llm.tokenizer.decode([t]) == f"t{t}" for t in range(3, llm.config.model.vocab_size))
