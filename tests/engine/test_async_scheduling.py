"""Async scheduling (`async_scheduling=True`): plain decode step N + 1 is planned and launched
before step N's tokens reach the host, its input ids fed from step N's on the device.

The engine with it must be indistinguishable from the engine without it (float64, CPU, both SSM
backends, the same fixed-shape decode path): the same tokens, stop reasons, texts, log-probabilities
and ranks, under arrivals and aborts mid-stream, max_tokens, stop tokens and strings, seeded
sampling, penalties (which run synchronously), prefix caching and small pools (preemption). A
launched step's rows keep their blocks and state slot until it lands: a request that stopped in
step N runs once more in step N + 1, and no request admitted meanwhile may get that memory.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from replayserve import LLM, SamplingParams
from replayserve.config import ConfigError
from replayserve.engine.engine import Engine
from replayserve.engine.request import Request, Status
from tests.conftest import assert_pools_full
from tests.engine import fuzz_engine

MAX_MODEL_LEN = fuzz_engine.MAX_MODEL_LEN
PATH_LEN = fuzz_engine.PATH_LEN

# (prompt, params, call before which it arrives, call before which it is aborted or None)
Arrival = tuple[list[int], SamplingParams, int, int | None]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[fuzz_engine.Models, fuzz_engine.Reference]:
    models = fuzz_engine.make_models(Path(tmp_path_factory.mktemp("async")))
    return models, fuzz_engine.Reference(models)


def _llm(model: Path, async_scheduling: bool, **options: object) -> LLM:
    llm = LLM(model=str(model), dtype="float64", device="cpu", max_model_len=MAX_MODEL_LEN,
              async_scheduling=async_scheduling, **options)
    if not async_scheduling:  # the fixed-shape decode path that async steps take, run synchronously
        llm.engine.runner.graphs = llm.engine.runner.make_decode_graphs(capture=False)
    return llm


def assert_launched_memory_held(engine: Engine) -> None:
    """Every block and state slot a launched step writes is held: no pool can hand it out."""
    launched = engine._launched
    if launched is None:
        return
    free_slots = set(engine.cache.live._free)
    for seq in launched.plan.seqs:
        assert seq.state_slot not in free_slots, f"slot {seq.state_slot} is free while a launched step writes it"
        assert all(engine.cache.kv.ref_count(b) > 0 for b in seq.block_table), "a launched step writes a free block"


def _drive(llm: LLM, arrivals: list[Arrival]) -> list[Request]:
    """Steps the engine as a server does: requests arrive and are aborted between calls."""
    engine = llm.engine
    order = sorted(range(len(arrivals)), key=lambda i: arrivals[i][2])
    requests: dict[int, Request] = {}
    call = 0
    while order or engine.has_unfinished():
        assert call < 2000, "no progress"
        while order and (arrivals[order[0]][2] <= call or not engine.has_unfinished()):
            i = order.pop(0)
            requests[i] = engine.add_request(arrivals[i][0], arrivals[i][1])
        for i, request in requests.items():
            if arrivals[i][3] == call:
                engine.abort(request)
        if engine.has_unfinished():
            engine.step()
            assert_launched_memory_held(engine)
        call += 1
    return [requests[i] for i in range(len(arrivals))]


def assert_same_outputs(sync: list[Request], overlapped: list[Request]) -> None:
    for a, b in zip(sync, overlapped, strict=True):
        assert a.status is Status.FINISHED and b.status is Status.FINISHED
        if "abort" in (a.finish_reason, b.finish_reason):  # aborted after a different number of steps
            n = min(len(a.output_token_ids), len(b.output_token_ids))
            assert a.output_token_ids[:n] == b.output_token_ids[:n]
            continue
        assert (b.output_token_ids, b.finish_reason, b.stop_reason, b.text, b.output_ranks) == \
               (a.output_token_ids, a.finish_reason, a.stop_reason, a.text, a.output_ranks), b.request_id
        for la, lb in zip(a.output_logprobs, b.output_logprobs, strict=True):
            assert la.keys() == lb.keys()
            assert all(abs(la[t] - lb[t]) <= 1e-12 for t in la)


def _run_both(model: Path, arrivals: list[Arrival], **options: object) -> tuple[LLM, list[Request], list[Request]]:
    outputs = []
    for async_scheduling in (False, True):
        llm = _llm(model, async_scheduling, **options)
        outputs.append(_drive(llm, arrivals))
        assert_pools_full(llm)
    assert_same_outputs(*outputs)
    return llm, outputs[0], outputs[1]


# An arrival as drawn: (prompt index, kind, stop kind, stop position, max_tokens, seed, arrival call,
# abort call or None); `_arrivals` turns it into an `Arrival` with the reference's prompts and paths.
Drawn = tuple[int, str, str, int, int, int, int, int | None]


@st.composite
def _workloads(draw: st.DrawFn) -> tuple[dict, list[Drawn]]:
    bs = draw(st.sampled_from((4, 8)))
    grid = bs * draw(st.sampled_from((1, 2)))
    mode = draw(st.sampled_from((None, None, "align", "all")))
    options = {
        "block_size": bs, "max_num_seqs": draw(st.sampled_from((1, 2, 3, 4, 4))),
        "replay_window": draw(st.integers(1, 6)),
        "max_num_batched_tokens": draw(st.integers(4, 32)),
        # From one sequence's blocks and a few (preemptions) to plenty.
        "num_kv_blocks": MAX_MODEL_LEN // bs + draw(st.sampled_from((1, 2, 3, 6, 32))),
        "enable_prefix_caching": mode is not None, "mamba_cache_mode": mode or "none", "mamba_block_size": grid,
        "num_mamba_cache_slots": draw(st.integers(1, 6)),
    }
    arrivals = []
    for _ in range(draw(st.integers(2, 6))):
        start = draw(st.integers(0, 8))
        arrivals.append((
            draw(st.integers(0, 15)), draw(st.sampled_from(("greedy", "greedy", "logprobs", "seeded", "penalty"))),
            draw(st.sampled_from(("none", "none", "token", "string"))), draw(st.integers(0, 9)),
            draw(st.integers(1, PATH_LEN - 2)), draw(st.integers(0, 99)), start,
            draw(st.one_of(st.none(), st.none(), st.none(), st.integers(start, start + 12)))))
    return options, arrivals


def _arrivals(reference: fuzz_engine.Reference, drawn: list[Drawn]) -> list[Arrival]:
    arrivals = []
    for index, kind, stop, at, max_tokens, seed, start, abort in drawn:
        prompt = reference.pool[index]
        path = reference.path(prompt)
        params = SamplingParams(
            temperature=0.8 if kind == "seeded" else 0.0, top_p=0.9, seed=seed, max_tokens=max_tokens,
            ignore_eos=True, logprobs=2 if kind == "logprobs" else None,
            presence_penalty=0.5 if kind == "penalty" else 0.0, stop_token_ids=[path[at]] if stop == "token" else [],
            stop=[reference.tokenizer.decode(path[: at + 2])[-2:] or "x"] if stop == "string" else [])
        arrivals.append((prompt, params, start, abort))
    return arrivals


@pytest.mark.parametrize("backend", ["baseline", "replay"])
@given(workload=_workloads())
@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_async_equals_sync_on_random_workloads(setup, backend: str, workload: tuple[dict, list[Drawn]]) -> None:  # noqa: ANN001
    models, reference = setup
    options, drawn = workload
    llm, _, requests = _run_both(models.target, _arrivals(reference, drawn), ssm_backend=backend, **options)
    metrics = llm.get_metrics()  # what the examples cover: --hypothesis-show-statistics
    event(f"overlapped steps: {metrics['num_overlapped_steps'] > 0}")
    event(f"preemptions: {metrics['num_preemptions'] > 0}")
    event(f"stopped by a stop token or string: {any(r.finish_reason == 'stop' for r in requests)}")
    event(f"aborted: {any(r.finish_reason == 'abort' for r in requests)}")


def _stop_at(reference: fuzz_engine.Reference, prompt: list[int], n: int) -> SamplingParams:
    """Greedy, stopping on the n-th token of the prompt's greedy path (its first occurrence)."""
    path = reference.path(prompt)
    assert path.index(path[n - 1]) == n - 1, "pick a prompt whose path does not repeat that token"
    return SamplingParams(temperature=0.0, max_tokens=PATH_LEN, ignore_eos=True, stop_token_ids=[path[n - 1]])


def test_a_stopped_rows_extra_step_leaves_its_slot_to_no_one(setup) -> None:  # noqa: ANN001
    """Request a stops on a stop token in step N; it has a row in the already launched step N + 1,
    which runs on its slot and blocks (ReplaySSM: appends to its ring and flushes, window 2).
    Request c waits for a's slot: it gets it only after N + 1 has landed, and its tokens are its
    solo run's."""
    models, reference = setup
    prompts = reference.pool[:3]
    a_params = _stop_at(reference, prompts[0], 4)
    long = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = _llm(models.target, True, max_num_seqs=2, block_size=4, ssm_backend="replay", replay_window=2)
    engine = llm.engine
    a, b, c = (engine.add_request(p, params) for p, params in zip(prompts, (a_params, long, long), strict=True))
    slot_of_a = None
    while engine.has_unfinished():
        if a.status is Status.RUNNING:
            slot_of_a = a.state_slot
        finished = engine.step()
        assert_launched_memory_held(engine)
        if a in finished:
            launched = engine._launched
            assert launched is not None and a.request_id in [s.request_id for s in launched.plan.seqs]
            assert slot_of_a not in engine.cache.live._free and c.status is Status.WAITING
        if c.status is Status.RUNNING:
            assert c.state_slot == slot_of_a  # the only slot that came free
    assert a.finish_reason == "stop" and len(a.output_token_ids) == 4
    for request, prompt in zip((b, c), prompts[1:], strict=True):
        assert request.output_token_ids == reference.path(prompt)[:12]
    assert engine.num_overlapped_steps > 0
    assert_pools_full(llm)


def test_an_abort_while_the_step_runs_keeps_the_memory_until_it_lands(setup) -> None:  # noqa: ANN001
    models, reference = setup
    prompts = reference.pool[3:5]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = _llm(models.target, True, max_num_seqs=2, block_size=4, ssm_backend="replay", replay_window=3)
    engine = llm.engine
    a, b = (engine.add_request(p, params) for p in prompts)
    while len(a.output_token_ids) < 5:
        engine.step()
    assert engine._launched is not None
    slot, table = a.state_slot, engine.cache.table(a.request_id)
    engine.abort(a)
    assert a.finish_reason == "abort" and len(a.output_token_ids) == 5
    assert slot not in engine.cache.live._free and all(engine.cache.kv.ref_count(t) > 0 for t in table)
    engine.step()  # lands the step that ran a: its result is dropped, its memory returned
    assert slot in engine.cache.live._free and len(a.output_token_ids) == 5
    while engine.has_unfinished():
        engine.step()
    assert b.output_token_ids == reference.path(prompts[1])[:12]
    assert_pools_full(llm)


def _record_calls(runner: object) -> list[str]:
    """Logs the runner's launches and read-backs of async steps, in order."""
    events: list[str] = []
    launch, collect = runner.launch_decode, runner.collect

    def launch_decode(*args: object, **kwargs: object) -> object:
        events.append("launch")
        return launch(*args, **kwargs)

    def collect_logged(pending: object) -> object:
        events.append("collect")
        return collect(pending)

    runner.launch_decode, runner.collect = launch_decode, collect_logged
    return events


def test_each_step_is_read_back_after_its_successor_is_launched(setup) -> None:  # noqa: ANN001
    """The one host sync of a step (waiting for its tokens) comes after the next step is queued;
    requests ended by max_tokens or max_model_len get no row in the step after (no step is wasted)."""
    models, reference = setup
    prompts = reference.pool[:4]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (9, 3, 14, 6)]
    prompts.append(reference.pool[5][:1] * (MAX_MODEL_LEN - 4))  # ends by max_model_len
    params.append(SamplingParams(temperature=0.0, max_tokens=PATH_LEN, ignore_eos=True))
    steps = {}
    for async_scheduling in (False, True):
        llm = _llm(models.target, async_scheduling, max_num_seqs=5, block_size=4)
        events = _record_calls(llm.engine.runner)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].finish_reason for o in outputs] == ["length"] * 5
        assert [len(o.outputs[0].token_ids) for o in outputs] == [9, 3, 14, 6, 4]
        steps[async_scheduling] = llm.engine.num_steps
        assert_pools_full(llm)
    assert steps[True] == steps[False]
    # After the first launch, every read-back follows the launch of the next step but the last.
    assert events[:3] == ["launch", "launch", "collect"] and events[-2:] == ["collect", "collect"]
    assert all(events[i : i + 2] == ["launch", "collect"] for i in range(1, len(events) - 2, 2))
    assert llm.engine.num_overlapped_steps == events.count("launch") - 1


def test_eos_ends_a_request_as_without_async(setup) -> None:  # noqa: ANN001
    """The model's EOS (here a token of a greedy path) ends a request one step before its row in
    the launched step; the other requests go on with their solo runs' tokens."""
    models, reference = setup
    prompts = reference.pool[6:9]
    eos = reference.path(prompts[0])[3]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    outputs = []
    for async_scheduling in (False, True):
        llm = _llm(models.target, async_scheduling, max_num_seqs=3, block_size=4, ssm_backend="replay")
        config = llm.engine.config
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, eos_token_ids=(eos,)))
        llm.engine.config = llm.engine.runner.config = config
        outputs.append(_drive(llm, [(p, params, 0, None) for p in prompts]))
        assert_pools_full(llm)
    assert_same_outputs(*outputs)
    first = outputs[1][0]
    assert first.finish_reason == "stop" and first.stop_reason is None and first.output_token_ids[-1] == eos
    assert llm.engine.num_overlapped_steps > 0


def test_seeded_sampling_and_logprobs_are_the_same(setup) -> None:  # noqa: ANN001
    models, reference = setup
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=7, n=3, max_tokens=10, logprobs=3,
                            ignore_eos=True)
    arrivals = [(p, c, i, None) for i, p in enumerate(reference.pool[:3]) for c in
                (params.for_completion(k) for k in range(3))]
    llm, _, _ = _run_both(models.target, arrivals, max_num_seqs=4, block_size=4, ssm_backend="replay")
    assert llm.engine.num_overlapped_steps > 0


@pytest.mark.parametrize("mode", ["align", "all"])
def test_prefix_caching_with_mamba_states_falls_back_on_boundary_steps(setup, mode: str) -> None:  # noqa: ANN001
    """Decode steps that write a Mamba boundary state run synchronously; the others overlap, and
    a second turn hits the states the first published."""
    models, reference = setup
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    first = [(p, params, 0, None) for p in reference.pool[:3]]
    second = [(p + reference.path(p)[:12], params, 30, None) for p in reference.pool[:3]]
    llm, _, _ = _run_both(models.target, first + second, max_num_seqs=3, block_size=4, mamba_block_size=4,
                          enable_prefix_caching=True, mamba_cache_mode=mode, ssm_backend="replay",
                          num_mamba_cache_slots=16)
    metrics = llm.get_metrics()
    assert metrics["prefix_cache_published_states"] > 0 and metrics["prefix_cache_mamba_hits"] > 0
    assert 0 < metrics["num_overlapped_steps"] < metrics["num_steps"]


def test_blocks_running_out_preempt_as_without_async(setup) -> None:  # noqa: ANN001
    """A decode row that needs a KV block the pool lacks: the next step is not planned early, and
    the synchronous step preempts the newest request, which recomputes to the same tokens."""
    models, reference = setup
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    arrivals = [(p, params, 0, None) for p in reference.pool[:3]]
    llm, _, _ = _run_both(models.target, arrivals, max_num_seqs=3, block_size=4,
                          num_kv_blocks=MAX_MODEL_LEN // 4 + 1, ssm_backend="replay", replay_window=4)
    metrics = llm.get_metrics()
    assert metrics["num_preemptions"] > 0 and metrics["num_overlapped_steps"] > 0


def test_penalties_run_synchronously(setup) -> None:  # noqa: ANN001
    models, reference = setup
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, repetition_penalty=1.3)
    llm, _, _ = _run_both(models.target, [(p, params, 0, None) for p in reference.pool[:2]], max_num_seqs=2)
    assert llm.engine.num_overlapped_steps == 0


@pytest.mark.parametrize(("stage", "error"), [(stage, (fuzz_engine.InjectedFault, KeyboardInterrupt)[i % 2])
                                              for i, stage in enumerate(fuzz_engine.STAGES) if stage != "propose"])
def test_a_fault_at_any_stage_changes_nothing(setup, stage: str, error: type[BaseException]) -> None:  # noqa: ANN001
    """As tests/engine/test_step_atomicity.py, with a step launched behind the failing one: both are
    abandoned, and every request ends with its solo run's tokens and every pool full."""
    models, reference = setup
    pool = reference.pool[:3]
    paths = {tuple(p): reference.path(p) for p in pool}
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                       stop=[reference.tokenizer.decode(paths[tuple(pool[0])][:6])[-2:]]),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[paths[tuple(pool[1])][4]]),
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
    ]
    arrivals = [fuzz_engine.Arrival(p, sp, step, None) for p, sp, step in zip(pool, params, (0, 0, 2), strict=True)]
    options = {"block_size": 4, "mamba_block_size": 8, "max_num_seqs": 3, "max_num_batched_tokens": 16,
               "ssm_backend": "replay", "replay_window": 3, "enable_prefix_caching": True, "mamba_cache_mode": "align",
               "num_mamba_cache_slots": 6, "async_scheduling": True}
    workload = fuzz_engine.Workload(0, options, arrivals, {step: (stage, error) for step in (3, 5, 6, 9)})
    assert fuzz_engine.run_workload(workload, reference, models)["faults"] > 0


def test_speculative_decoding_is_refused(setup) -> None:  # noqa: ANN001
    models, _ = setup
    with pytest.raises(ConfigError, match="engine option async_scheduling: cannot be combined with speculative"):
        LLM(model=str(models.target), dtype="float64", device="cpu", async_scheduling=True,
            speculative={"method": "ngram", "num_speculative_tokens": 2})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU; exercised on the H200")
@pytest.mark.parametrize("backend", ["baseline", "replay"])
def test_graphed_async_decode_equals_sync(setup, backend: str) -> None:  # noqa: ANN001
    models, reference = setup
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=0) for m in (40, 7, 25, 3, 33)]
    params[2] = SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True, logprobs=0,
                               stop_token_ids=[reference.path(reference.pool[2])[5]])
    prompts = [{"prompt_token_ids": p} for p in reference.pool[:5]]
    outs = []
    for async_scheduling in (False, True):
        llm = LLM(model=str(models.target), dtype="float32", device="cuda", max_num_seqs=8,
                  max_model_len=MAX_MODEL_LEN, ssm_backend=backend, async_scheduling=async_scheduling)
        outs.append(llm.generate(prompts, params, use_tqdm=False))
        assert llm.engine.runner.graphs._graphs, "no decode step ran through a graph"
        assert_pools_full(llm)
    assert llm.engine.num_overlapped_steps > 0
    for a, b in zip(*outs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert abs(next(iter(la.values())).logprob - next(iter(lb.values())).logprob) < 1e-4


def test_replay_with_several_padded_rows_equals_sync(setup) -> None:  # noqa: ANN001
    """5 rows in a bucket of 8: three padded rows share the pad slot, which the ReplaySSM references
    used to refuse as repeated slots. Past a flush window, the tokens of the baseline backend's
    variable-shape path."""
    models, _ = setup
    prompts = [{"prompt_token_ids": [5 + i, 6, 7, 8]} for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outputs = []
    for async_scheduling in (False, True):
        llm = _llm(models.target, async_scheduling, max_num_seqs=8, ssm_backend="replay", replay_window=8)
        outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        assert_pools_full(llm)
    plain = LLM(model=str(models.target), dtype="float64", device="cpu", max_model_len=MAX_MODEL_LEN)
    assert outputs[0] == outputs[1] == [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert llm.get_metrics()["num_overlapped_steps"] > 0
