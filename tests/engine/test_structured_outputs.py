"""Structured outputs in the engine: outputs follow their grammar (JSON schema, regex, choice) in
every sample where the model alone would not, with and without speculation, on both SSM
backends, with async scheduling; a failed step rolls the matchers back; a request waits for its
grammar beside the queue while the others step; a bad constraint is refused before anything is
queued; a reasoning block is left free."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest

from replayserve import LLM, SamplingParams
from replayserve.engine.request import Request, Status
from replayserve.structured import StructuredOutputsParams
from replayserve.structured.compiler import GrammarCompiler
from tests.conftest import assert_pools_full
from tests.structured.examples import CHOICES, EMAIL, SCHEMA, valid_json

pytest.importorskip("xgrammar")




@pytest.fixture(scope="module")
def code_llm() -> LLM:
    return LLM(model="replayserve/tiny-code", dtype="float32", device="cpu", max_num_seqs=50)


def test_a_nested_schema_holds_in_every_sample_where_the_model_alone_writes_no_json(code_llm: LLM) -> None:
    params = SamplingParams(n=24, temperature=1.0, seed=0, max_tokens=300,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    completions = code_llm.generate("def area(r):", params, use_tqdm=False)[0].outputs
    assert all(valid_json(c.text) for c in completions), [c.text for c in completions if not valid_json(c.text)]
    assert all(c.finish_reason == "stop" for c in completions)
    assert len({c.text for c in completions}) > 19, "samples differ: the grammar masks, it does not dictate"
    alone = code_llm.generate("def area(r):", SamplingParams(n=24, temperature=1.0, seed=0, max_tokens=120),
                              use_tqdm=False)[0].outputs
    assert sum(valid_json(c.text) for c in alone) == 0
    assert_pools_full(code_llm)


@pytest.mark.parametrize(("constraint", "check"), [
    (StructuredOutputsParams(regex=EMAIL), lambda text: re.fullmatch(EMAIL, text) is not None),
    (StructuredOutputsParams(choice=CHOICES), lambda text: text in CHOICES),
])
def test_regex_and_choice_hold_in_every_sample(code_llm: LLM, constraint: StructuredOutputsParams, check) -> None:  # noqa: ANN001
    params = SamplingParams(n=50, temperature=1.0, seed=1, max_tokens=40, ignore_eos=True,
                            structured_outputs=constraint)
    completions = code_llm.generate("def f(x):", params, use_tqdm=False)[0].outputs
    assert all(check(c.text) for c in completions), [c.text for c in completions]
    # ignore_eos: the grammar's end still ends the request, with "stop"
    assert all(c.finish_reason == "stop" for c in completions)
    assert len({c.text for c in completions}) > 1


@pytest.mark.parametrize("options", [
    {"speculative": {"method": "ngram", "num_speculative_tokens": 3}},
    {"ssm_backend": "replay"},
    {"ssm_backend": "replay", "speculative": {"method": "ngram", "num_speculative_tokens": 2},
     "enable_prefix_caching": True},
    {"async_scheduling": True},
])
def test_greedy_constrained_outputs_do_not_depend_on_the_engine_options(tiny_model_dir: Path, options: dict) -> None:
    prompts = ["def f(x):", "The quick brown fox", "def f(x):\n    return"]
    params = [SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
              SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(regex=EMAIL)),
              SamplingParams(temperature=0, max_tokens=24)]  # unconstrained beside them
    base = LLM(model=str(tiny_model_dir), dtype="float64", device="cpu", max_num_seqs=4)
    other = LLM(model=str(tiny_model_dir), dtype="float64", device="cpu", max_num_seqs=4, **options)
    expected = [o.outputs[0].token_ids for o in base.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in other.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    if "speculative" in options:
        assert other.get_metrics()["spec_num_draft_tokens"] > 0
    assert_pools_full(other)


def test_seeded_constrained_samples_follow_the_grammar_with_drafts(tiny_model_dir: Path) -> None:
    llm = LLM(model=str(tiny_model_dir), dtype="float64", device="cpu", max_num_seqs=8,
              speculative={"method": "ngram", "num_speculative_tokens": 3})
    params = SamplingParams(n=8, temperature=1.0, seed=5, max_tokens=30, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(regex=r"(ab|cd){2,20}!"))
    completions = llm.generate("abababab cdcdcd", params, use_tqdm=False)[0].outputs
    assert all(re.fullmatch(r"(ab|cd){2,20}!", c.text) for c in completions), [c.text for c in completions]
    metrics = llm.get_metrics()
    assert metrics["spec_num_accepted_tokens"] > 0, "drafts verified under the grammar's masks"


def _constrained_pair(model: Path) -> tuple[LLM, LLM]:
    """An engine with async scheduling and one without it on the same fixed-shape decode path."""
    sync = LLM(model=str(model), dtype="float64", device="cpu", max_num_seqs=4)
    sync.engine.runner.graphs = sync.engine.runner.make_decode_graphs(capture=False)
    return sync, LLM(model=str(model), dtype="float64", device="cpu", max_num_seqs=4, async_scheduling=True)


def test_async_scheduling_overlaps_constrained_steps_and_samples_the_same(tiny_model_dir: Path) -> None:
    """Every row constrained, seeded sampling: each decode step after the first of a run is launched
    before the previous one's tokens are read (its masks filled once they are), and the samples equal
    the synchronous engine's, draw for draw."""
    prompts = ["def f(x):", "The quick brown fox", "x = [1, 2"]
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=40, structured_outputs=constraint)
              for seed, constraint in enumerate([StructuredOutputsParams(json=SCHEMA),
                                                 StructuredOutputsParams(regex=r"(ab|cd){2,20}!"),
                                                 StructuredOutputsParams(json=SCHEMA)])]
    sync, overlapped = _constrained_pair(tiny_model_dir)
    expected = [o.outputs[0] for o in sync.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0] for o in overlapped.generate(prompts, params, use_tqdm=False)]
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]  # the masks: at temperature 1
    steps = overlapped.get_metrics()
    assert steps["num_overlapped_steps"] > steps["num_steps"] // 2, steps
    assert_pools_full(overlapped)


def test_a_fault_in_an_overlapped_constrained_step_changes_nothing(tiny_model_dir: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The masks of the step launched behind the running one fail to fill: both steps are abandoned,
    the matchers go back, and the request ends as without the fault."""
    params = SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=EMAIL))
    sync, llm = _constrained_pair(tiny_model_dir)
    expected = sync.generate("def f(x):", params, use_tqdm=False)[0].outputs[0].token_ids
    engine = llm.engine
    request = engine.add_request(llm.tokenizer.encode("def f(x):"), params)
    for _ in range(6):
        engine.step()
    assert engine.num_overlapped_steps >= 2 and engine.has_unfinished()
    _fail_one_step_then_finish(llm, request, engine.grammars, "_fill", expected, monkeypatch)
    assert_pools_full(llm)


def _fail_one_step_then_finish(llm: LLM, request: Request, owner: object, name: str, expected: list[int],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    """With `owner.name` raising, a step fails and leaves the request's tokens and its matcher where
    they were; put back, the request ends with `expected`."""
    engine = llm.engine
    original = getattr(owner, name)

    def fail(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
        raise RuntimeError("injected")

    monkeypatch.setattr(owner, name, fail)
    before = list(request.output_token_ids)
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    assert request.output_token_ids == before
    assert engine.grammars._grammars[request.request_id].consumed == len(before)
    monkeypatch.setattr(owner, name, original)
    while engine.has_unfinished():
        engine.step()
    assert request.output_token_ids == expected


def test_a_failed_step_rolls_the_matchers_back(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    params = SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=EMAIL))
    llm = LLM(model=str(tiny_model_dir), dtype="float64", device="cpu", max_num_seqs=2)
    expected = llm.generate("def f(x):", params, use_tqdm=False)[0].outputs[0].token_ids
    engine = llm.engine
    request = engine.add_request(llm.tokenizer.encode("def f(x):"), params)
    for _ in range(4):
        engine.step()
    _fail_one_step_then_finish(llm, request, engine.scheduler, "update", expected, monkeypatch)  # after the accepts


def test_a_request_waits_for_its_grammar_while_the_others_step(tiny_model_dir: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(model=str(tiny_model_dir), dtype="float64", device="cpu", max_num_seqs=4)
    release = threading.Event()
    compile_grammar = GrammarCompiler._compile

    def slow(self: GrammarCompiler, params: StructuredOutputsParams) -> object:
        assert release.wait(60)
        return compile_grammar(self, params)

    monkeypatch.setattr(GrammarCompiler, "_compile", slow)
    engine = llm.engine
    ids = llm.tokenizer.encode("def f(x):")
    constrained = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=8, structured_outputs=(
        StructuredOutputsParams(choice=["yes", "no"]))))
    plain = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert len(plain.output_token_ids) == 3 and not constrained.output_token_ids
    assert constrained.status is Status.WAITING and constrained.request_id in engine.scheduler.unready
    release.set()
    while engine.has_unfinished():
        engine.step()  # with nothing else to run, the engine waits for the grammar
    assert constrained.text in ("yes", "no") and plain.finish_reason == "length"
    assert_pools_full(llm)


def test_a_request_aborted_or_failed_while_compiling_frees_everything(tiny_model_dir: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(model=str(tiny_model_dir), dtype="float64", device="cpu", max_num_seqs=2)
    engine = llm.engine
    params = SamplingParams(temperature=0, structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    aborted = engine.add_request([5, 6, 7], params)
    engine.abort(aborted)
    assert aborted.finish_reason == "abort" and not engine.has_unfinished()

    def broken(self: GrammarCompiler, params: StructuredOutputsParams) -> object:
        raise MemoryError("no room for the token masks")

    monkeypatch.setattr(GrammarCompiler, "_compile", broken)
    failed = engine.add_request([5, 6, 7], SamplingParams(structured_outputs=StructuredOutputsParams(choice=["c"])))
    assert engine.step() == [failed] and failed.finish_reason == "abort"
    assert not engine.has_unfinished()
    assert_pools_full(llm)


def test_a_constraint_the_engine_cannot_honour_is_refused_before_anything_is_queued(tiny_model_dir: Path) -> None:
    llm = LLM(model=str(tiny_model_dir), dtype="float64", device="cpu", max_num_seqs=2)
    good = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a"]))
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "array", "uniqueItems": True}))
    with pytest.raises(ValueError, match="keyword 'uniqueItems' at # is not supported"):
        llm.generate(["x", "y"], [good, bad], use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_the_grammar_waits_for_the_reasoning_block_to_close(code_llm: LLM) -> None:
    """End marker ")": the built-in model closes the call it is in, then the grammar applies."""
    params = SamplingParams(n=8, temperature=1.0, seed=2, max_tokens=60, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=CHOICES,
                                                                       reasoning_markers=("<think>", ")")))
    tokenizer = code_llm.tokenizer
    for completion in code_llm.generate("    return sum(len(x", params, use_tqdm=False)[0].outputs:
        ids = completion.token_ids
        closing = next(i for i in range(len(ids)) if ")" in tokenizer.decode(ids[: i + 1]))
        free = tokenizer.decode(ids[: closing + 1])
        assert not any(choice.startswith(free) for choice in CHOICES), "free text comes first"
        assert tokenizer.decode(ids[closing + 1 :]) in CHOICES
        assert completion.finish_reason == "stop"
    closed = SamplingParams(temperature=1.0, seed=2, max_tokens=20, structured_outputs=StructuredOutputsParams(
        choice=CHOICES, reasoning_markers=("<think>", "</think>")))
    reply = code_llm.generate("<think>\n\n</think>\n\n", closed, use_tqdm=False)[0].outputs[0]
    assert reply.text in CHOICES, "a prompt that closed the block starts the grammar at once"


def test_a_refused_token_fails_the_step_and_every_matcher_goes_back(tiny_model_dir: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's one-token rows reach their matchers together (`Grammars.accept_all`): when one
    token is refused, the others have been taken; the step fails and the take-back returns every
    matcher to its output, after which the requests finish as they would have."""
    from replayserve.structured.request_grammar import GrammarViolation

    params = SamplingParams(temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(regex=EMAIL))
    llm = LLM(model=str(tiny_model_dir), dtype="float64", device="cpu", max_num_seqs=3)
    prompts = ["def f(x):", "import os", "class A:"]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    engine = llm.engine
    requests = [engine.add_request(llm.tokenizer.encode(p), params) for p in prompts]
    while not all(len(r.output_token_ids) >= 3 for r in requests):
        engine.step()
    grammar = engine.grammars._grammars[requests[1].request_id]
    refused = next(t for t in range(llm.config.model.vocab_size)
                   if not grammar.matcher.accept_token(t) or grammar.matcher.rollback(1))
    outcome = engine._outcome

    def refuse_on_the_middle_row(request, result):  # noqa: ANN001, ANN202
        new, logprobs, ranks, stop = outcome(request, result)
        return ([refused], logprobs, ranks, None) if request is requests[1] else (new, logprobs, ranks, stop)

    monkeypatch.setattr(engine, "_outcome", refuse_on_the_middle_row)
    before = [list(r.output_token_ids) for r in requests]
    with pytest.raises(GrammarViolation, match=f"token {refused} is not allowed"):
        engine.step()
    assert [r.output_token_ids for r in requests] == before
    for request in requests:
        assert engine.grammars._grammars[request.request_id].consumed == len(request.output_token_ids)
    monkeypatch.setattr(engine, "_outcome", outcome)
    while engine.has_unfinished():
        engine.step()
    assert [r.output_token_ids for r in requests] == expected
