"""`replayserve demo` prints as it goes (each configuration's runs before the next configuration
loads), reports each row's median and range over the repeats, and says when drafts are slower."""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterator

import pytest
import torch

import replayserve.demo
from replayserve.demo import SpecRun, run_demo, verdict
from replayserve.tiny_code import TINY_CODE, resolve_model


@pytest.fixture(autouse=True)
def torch_threads_kept() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_demo_prints_each_configuration_before_the_next_loads(monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture) -> None:
    printed_before_load: list[str] = []
    real_llm = replayserve.demo.LLM

    def llm_seeing_stdout(**options: object) -> replayserve.demo.LLM:
        printed_before_load.append(capsys.readouterr().out)
        return real_llm(**options)

    monkeypatch.setattr(replayserve.demo, "LLM", llm_seeing_stdout)
    run_demo(resolve_model(TINY_CODE), max_tokens=4, repeats=2, num_drafts=2,
             engine={"device": "cpu", "cpu_threads": 1})
    out = "".join(printed_before_load) + capsys.readouterr().out

    assert len(printed_before_load) == 3  # none, n-gram, MTP
    assert "[none] run 2/2" in printed_before_load[1] and "def fibonacci(n):" in printed_before_load[1]
    assert "[n-gram] median" in printed_before_load[2] and "[MTP]" not in printed_before_load[2]
    assert "1 CPU thread: set by cpu_threads / --threads" in out and "CPU figures are noisy" in out
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in out.splitlines() if line.startswith("| ")}
    for name in ("none", "n-gram", "MTP"):
        rates = [float(r) for r in re.findall(rf"^\[{name}\] run \d/2: (\d+) tok/s", out, re.MULTILINE)]
        assert len(rates) == 2
        median, spread = float(rows[name][1]), rows[name][2]
        assert spread == f"{min(rates):.0f}-{max(rates):.0f}"
        assert abs(median - statistics.median(rates)) <= 1  # the run lines are rounded
    assert rows["none"][3] == "1.00x"
    assert sum(line.startswith(("n-gram: ", "MTP: ")) for line in out.splitlines()) == 2  # a verdict per row


def _run(name: str, rates: list[float], tokens_per_step: float) -> SpecRun:
    return SpecRun(name, rates, None if name == "none" else 0.4, tokens_per_step, [], "cpu")


def test_a_slower_row_says_so_and_why() -> None:
    base = _run("none", [300, 320, 310], 6.0)
    line = verdict(_run("MTP", [150, 160, 155], 10.2), base, num_drafts=3, on_cpu=True)
    assert line.startswith("MTP: 0.50x: slower than no drafts; drafts cost more than they save here")
    assert "a step took 3.4x as long" in line and "advanced 1.70x as many tokens" in line and "on a CPU" in line
    assert "on a CPU" not in verdict(_run("MTP", [150, 160, 155], 10.2), base, num_drafts=3, on_cpu=False)


def test_overlapping_ranges_are_no_clear_difference_and_a_faster_row_says_faster() -> None:
    base = _run("none", [300, 320, 310], 6.0)
    assert "no clear difference" in verdict(_run("n-gram", [290, 330, 305], 6.2), base, 3, on_cpu=True)
    assert verdict(_run("n-gram", [400, 420, 410], 9.0), base, 3, on_cpu=True).startswith(
        "n-gram: 1.32x faster than no drafts")
