"""The CPU thread policy: `cpu_threads` / `--threads` wins, then OMP_NUM_THREADS, then the idle cores
(at least 1, at most the usable CPUs, split over tensor-parallel ranks); LLM applies and logs it on
the CPU only."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from replayserve import LLM
from replayserve.builtin.tiny import tiny_config
from replayserve.cli import main
from replayserve.config import ConfigError, EngineConfig
from replayserve.cpu_threads import cgroup_cpu_limit, choose_cpu_threads, idle_ticks, threads_for_idle


@pytest.fixture(autouse=True)
def torch_threads_kept() -> Iterator[None]:
    """LLM sets torch's process-wide thread count: later tests get back the count they had."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_cpu_threads_wins_over_omp_num_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    choice = choose_cpu_threads(1)
    assert choice.count == 1 and "--threads" in choice.why


@pytest.mark.parametrize(("value", "count"), [("1", 1), ("3", 3), ("3,2", 3), (" 2 ", 2)])
def test_omp_num_threads_wins_over_the_idle_cores(monkeypatch: pytest.MonkeyPatch, value: str, count: int) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    choice = choose_cpu_threads(None, ranks=2)  # the user's count is per process: not split
    assert choice.count == count and "OMP_NUM_THREADS" in choice.why


def test_a_bad_omp_num_threads_falls_back_to_the_idle_cores(monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "many")
    with caplog.at_level(logging.WARNING, logger="replayserve.cpu_threads"):
        choice = choose_cpu_threads(None)
    assert "idle" in choice.why and "OMP_NUM_THREADS='many'" in caplog.text


def test_the_idle_cores_count_is_at_least_1_and_at_most_the_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    choice = choose_cpu_threads(None)
    assert 1 <= choice.count <= len(os.sched_getaffinity(0)) <= (os.cpu_count() or 1)
    assert "idle" in choice.why


@pytest.mark.parametrize(("usable", "idle", "ranks", "threads"), [
    (2, 0.0, 1, 1),  # both cores busy: one thread, never zero
    (2, 0.05, 1, 1),
    (2, 1.5, 1, 1),  # half a core taken: a second thread would wait on it
    (2, 1.95, 1, 2),  # an idle machine's background noise
    (2, 2.0, 2, 1),
    (16, 12.3, 1, 12),
    (16, 16.0, 4, 4),
    (4, 7.0, 1, 4),  # never more than the usable CPUs
])
def test_threads_for_idle(usable: int, idle: float, ranks: int, threads: int) -> None:
    assert threads_for_idle(usable, idle, ranks) == threads


@pytest.mark.parametrize(("files", "limit"), [
    ({"cpu.max": "200000 100000\n"}, 2),
    ({"cpu.max": "150000 100000\n"}, 2),  # 1.5 CPUs: a second thread still gets half a core
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "50000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({}, None),
])
def test_a_container_cpu_quota_caps_the_usable_cpus(tmp_path: Path, files: dict[str, str], limit: int | None) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_cpu_limit(tmp_path) == limit


def test_idle_ticks_count_only_the_cpus_this_process_may_use() -> None:
    stat = ("cpu  100 0 100 800 0 0 0 0 0 0\n"
            "cpu0 50 0 50 0 0 0 0 0 0 0\n"  # busy
            "cpu1 50 0 50 400 0 0 0 0 0 0\n"
            "cpu2 0 0 0 400 10 0 0 0 0 0\n"
            "intr 12345 0 0\n")
    assert idle_ticks(stat, [0]) == (1, 0, 100)
    assert idle_ticks(stat, [1, 2]) == (2, 810, 910)
    assert idle_ticks(stat, [7]) == (0, 0, 0)


def test_llm_applies_and_logs_the_choice_on_the_cpu(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    torch.set_num_threads(2)
    with caplog.at_level(logging.INFO, logger="replayserve.cpu_threads"):
        llm = LLM(model=str(tiny_model_dir), dtype="float64", device="cpu", cpu_threads=1)
    assert torch.get_num_threads() == 1 and llm.config.cpu_threads == 1
    assert llm.cpu_threads is not None and llm.cpu_threads.count == 1
    assert "CPU: 1 intra-op thread (set by cpu_threads / --threads)" in caplog.text
    llm = LLM(model=str(tiny_model_dir), dtype="float64", device="cpu")
    assert torch.get_num_threads() == 2 and llm.config.cpu_threads == 2  # OMP_NUM_THREADS


def test_threads_option_reaches_the_engine(tiny_model_dir: Path, capsys: pytest.CaptureFixture) -> None:
    torch.set_num_threads(2)
    main(["generate", "--model", str(tiny_model_dir), "--prompt", "x", "--max-tokens", "1", "--device", "cpu",
          "--threads", "1"])
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("bad", [0, -1])
def test_threads_must_be_positive(tiny_model_dir: Path, capsys: pytest.CaptureFixture, bad: int) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", str(tiny_model_dir), "--prompt", "x", "--device", "cpu", "--threads", str(bad)])
    assert exit_info.value.code == 2
    assert f"engine option cpu_threads: must be >= 1, got {bad}" in capsys.readouterr().err


def test_cpu_threads_is_refused_on_cuda() -> None:
    with pytest.raises(ConfigError, match="engine option cpu_threads: .* only with device='cpu'"):
        EngineConfig(model=tiny_config(), device="cuda", cpu_threads=2)
