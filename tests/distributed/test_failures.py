"""What tensor parallelism refuses, a worker that dies (clear errors on rank 0, no hang), and the
command line."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from replayserve import LLM, SamplingParams
from replayserve.config import ConfigError


@pytest.mark.parametrize(("options", "why"), [
    ({"tensor_parallel_size": 3}, "3 ranks must divide the model's num_attention_heads=4"),
    ({"tensor_parallel_size": 2, "async_scheduling": True}, "async_scheduling is not supported"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
])
def test_unsupported_options_are_refused_before_any_worker_starts(tiny_model_dir: Path, options: dict,
                                                                  why: str) -> None:
    with pytest.raises(ConfigError, match=why) as error:
        LLM(str(tiny_model_dir), dtype="float64", device="cpu", **options)
    assert "tensor_parallel_size" in str(error.value)


def test_a_dead_worker_fails_the_step_with_its_rank_named(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), dtype="float64", device="cpu", max_num_seqs=2, max_model_len=64,
              tensor_parallel_size=2)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4)
        assert len(llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)[0].outputs[0].token_ids) == 4
        worker = llm.workers.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
        with pytest.raises(RuntimeError, match=r"worker rank 1 .* exited with status -9"):
            llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)
        with pytest.raises(RuntimeError, match="worker rank 1"):  # and stays failed
            llm.generate({"prompt_token_ids": [8]}, params, use_tqdm=False)
    finally:
        llm.close()
    assert not llm.workers.procs


def test_generate_command_runs_tensor_parallel(tiny_model_dir: Path, capsys: pytest.CaptureFixture) -> None:
    from replayserve.cli import main

    argv = ["generate", "--model", str(tiny_model_dir), "--prompt", "The quick", "--max-tokens", "4", "--dtype",
            "float64", "--device", "cpu", "--tensor-parallel-size", "2"]
    main(argv)
    tp = capsys.readouterr().out
    main(argv[:-2])  # the command closed its workers: the process can start another engine
    assert tp == capsys.readouterr().out and "completion 0" in tp
