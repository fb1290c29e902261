"""`replayserve demo` prints as it goes (a line per timed run before the next run starts, the
continuations after the first round), reports each row's median and range over the rounds, and
says when drafts are slower, faster or within the noise."""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterator

import pytest
import torch

from replayserve.config.builtin_models import TINY_CODE, resolve_model
from replayserve.demo import SpecRun, cpu_note, run_demo, verdict
from replayserve.llm import LLM
from replayserve.sampling_params import SamplingParams


@pytest.fixture(autouse=True)
def torch_threads_kept() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_demo_prints_a_line_per_run_as_it_goes(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture) -> None:
    printed_before_run: list[str] = []  # what was printed since the timed run before it
    generate = LLM.generate

    def generate_seeing_stdout(self: LLM, prompts: object, params: SamplingParams, **kwargs: object) -> object:
        if params.max_tokens == 4:  # a timed run (the warm-up's is longer)
            printed_before_run.append(capsys.readouterr().out)
        return generate(self, prompts, params, **kwargs)

    monkeypatch.setattr(LLM, "generate", generate_seeing_stdout)
    run_demo(resolve_model(TINY_CODE), max_tokens=4, repeats=2, num_drafts=2,
             engine={"device": "cpu", "cpu_threads": 1})
    out = "".join(printed_before_run) + capsys.readouterr().out

    assert len(printed_before_run) == 6  # 2 rounds of none, n-gram, MTP
    assert "1 CPU thread: set by cpu_threads / --threads" in printed_before_run[0]
    order = ["[none] run 1/2", "[n-gram] run 1/2", "[MTP] run 1/2", "[none] run 2/2", "[n-gram] run 2/2"]
    for since_last, line in zip(printed_before_run[1:], order, strict=True):
        assert re.findall(r"^\[.*\] run \d/2", since_last, re.MULTILINE) == [line]
    assert "def fibonacci(n):" in printed_before_run[3]  # the continuations, after the first round
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in out.splitlines() if line.startswith("| ")}
    rates = {name: [float(r) for r in re.findall(rf"^\[{name}\] run \d/2: (\d+) tok/s", out, re.MULTILINE)]
             for name in ("none", "n-gram", "MTP")}
    for name, measured in rates.items():
        median, spread = float(rows[name][1]), rows[name][2]
        assert spread == f"{min(measured):.0f}-{max(measured):.0f}"
        assert abs(median - statistics.median(measured)) <= 1  # the run lines are rounded
    assert rows["none"][3:5] == ["1.00x", "-"]
    assert sum(line.startswith(("n-gram: ", "MTP: ")) for line in out.splitlines()) == 2  # a verdict per row
    assert "CPU figures are noisy" in out


def _run(name: str, rates: list[float], tokens_per_step: float) -> SpecRun:
    spec = None if name == "none" else {"method": "ngram", "num_speculative_tokens": 3}
    counters = {"num_generated_tokens": tokens_per_step * 100, "num_steps": 100, "spec_num_draft_tokens": 10,
                "spec_num_accepted_tokens": 4}
    return SpecRun(name, spec, rates, counters=counters)


def test_a_row_slower_in_every_round_says_so_and_why() -> None:
    base = _run("none", [300, 320, 310], 6.0)
    slower = _run("MTP", [150, 160, 155], 10.2)
    line = verdict(slower, base, num_drafts=3, on_cpu=True)
    assert line.startswith("MTP: 0.50x: slower than no drafts; drafts cost more than they save here")
    assert "a step took 3.4x as long" in line and "advanced 1.70x as many tokens" in line and "on a CPU" in line
    assert "on a CPU" not in verdict(slower, base, num_drafts=3, on_cpu=False)


def test_rounds_that_disagree_are_no_clear_difference_and_a_faster_row_says_faster() -> None:
    base = _run("none", [300, 320, 310], 6.0)
    assert "the rounds disagree (0.97-1.06x): no clear difference" in verdict(
        _run("n-gram", [290, 340, 305], 6.2), base, 3, on_cpu=True)
    assert verdict(_run("n-gram", [400, 420, 410], 9.0), base, 3, on_cpu=True).startswith(
        "n-gram: 1.32x faster than no drafts")


def test_the_cpu_note_says_how_much_of_its_threads_time_the_demo_got() -> None:
    contended = [SpecRun("none", None, cpu_busy=[0.3, 0.35, 0.4], cpu_threads=1),
                 SpecRun("n-gram", {}, cpu_busy=[0.3, 0.2, 0.3], cpu_threads=1)]
    assert cpu_note(contended).startswith("CPU figures are noisy")
    assert "the demo's 1 thread ran 30% of the time" in cpu_note(contended)
    idle = [SpecRun("none", None, cpu_busy=[1.9, 2.0, 1.95], cpu_threads=2)]
    assert "of the time" not in cpu_note(idle)


def test_the_demo_shows_a_json_schema_answer_or_how_to_get_one(capsys: pytest.CaptureFixture,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    import jsonschema

    from replayserve import demo
    from replayserve.structured import grammar

    pytest.importorskip("xgrammar")
    llm = LLM(model=TINY_CODE, device="cpu", cpu_threads=1)
    demo._print_json_answer(llm)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"structured outputs: {demo.JSON_PROMPT!r} answered under the JSON schema")
    jsonschema.validate(json.loads(lines[1]), demo.JSON_SCHEMA)

    def missing(*args: object) -> None:
        raise grammar.StructuredOutputError(f"structured outputs need xgrammar: {grammar.INSTALL_HINT}")

    monkeypatch.setattr(grammar, "_grammar", missing)
    demo._print_json_answer(llm)
    assert "(not shown: structured outputs need xgrammar: install the grammar engine" in capsys.readouterr().out
