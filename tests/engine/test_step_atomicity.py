"""A step either completes or changes nothing a request can see: a fault at any stage (drafting,
the forward, the SSM step's end, stop-string decoding, publishing, the update, finishing) takes
back the tokens it appended and every block and slot it held, and the requests go on to the
same tokens as without the fault."""

from __future__ import annotations

from pathlib import Path

import pytest

from replayserve.engine.request import Status
from tests.engine import fuzz_engine


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[fuzz_engine.Models, fuzz_engine.Reference]:
    models = fuzz_engine.make_models(Path(tmp_path_factory.mktemp("atomic")))
    return models, fuzz_engine.Reference(models)


def _workload(reference: fuzz_engine.Reference, stage: str, error: type[BaseException]) -> fuzz_engine.Workload:
    """Three requests with shared prefixes, one stopping on a stop string and one on a stop token,
    replay backend, align caching and perfect drafts (verifies cross boundaries and stop inside)."""
    pool = reference.pool[:3]
    paths = {tuple(p): reference.path(p) for p in pool}
    stop_text = reference.tokenizer.decode(paths[tuple(pool[0])][:6])[-2:]
    params = [
        fuzz_engine.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop_text]),
        fuzz_engine.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                   stop_token_ids=[paths[tuple(pool[1])][4]]),
        fuzz_engine.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
    ]
    arrivals = [fuzz_engine.Arrival(p, sp, step, None) for p, sp, step in zip(pool, params, (0, 0, 2), strict=True)]
    options = {"block_size": 4, "mamba_block_size": 4, "max_num_seqs": 3, "max_num_batched_tokens": 16,
               "ssm_backend": "replay", "replay_window": 6, "enable_prefix_caching": True, "mamba_cache_mode": "align",
               "num_mamba_cache_slots": 6,
               "speculative": {"method": "custom", "num_speculative_tokens": 3,
                               "proposer": fuzz_engine.OracleProposer(paths, 0.0, fuzz_engine.VOCAB)}}
    return fuzz_engine.Workload(0, options, arrivals, {step: (stage, error) for step in (1, 3, 4, 6)})


@pytest.mark.parametrize(("stage", "error"), [(stage, (fuzz_engine.InjectedFault, KeyboardInterrupt)[i % 2])
                                              for i, stage in enumerate(fuzz_engine.STAGES)])
def test_a_fault_at_any_stage_changes_nothing(setup, stage: str, error: type[BaseException]) -> None:  # noqa: ANN001
    models, reference = setup
    workload = _workload(reference, stage, error)
    # run_workload checks tokens against the solo runs and that every pool ends full.
    assert fuzz_engine.run_workload(workload, reference, models)["faults"] > 0


def test_a_failed_step_leaves_outputs_and_books_as_before(setup) -> None:  # noqa: ANN001
    models, reference = setup
    workload = _workload(reference, "publish_after", fuzz_engine.InjectedFault)
    llm = fuzz_engine.LLM(model=str(models.target), dtype="float64", device="cpu",
                          max_model_len=fuzz_engine.MAX_MODEL_LEN, **workload.options)
    engine = llm.engine
    injector = fuzz_engine.FaultInjector(llm)
    requests = [engine.add_request(a.prompt, a.params) for a in workload.arrivals]
    for _ in range(3):
        engine.step()
    before = [list(r.output_token_ids) for r in requests]
    injector.armed = ("publish_after", fuzz_engine.InjectedFault)
    with pytest.raises(fuzz_engine.InjectedFault):
        engine.step()
    assert [r.output_token_ids for r in requests] == before
    unfinished = [r for r in requests if r.status is not Status.FINISHED]
    assert unfinished and all(r.status is Status.WAITING and r.num_computed_tokens == 0 for r in unfinished)
    engine.cache.check()  # no step still holds a boundary slot; books agree with the tables
    assert engine.cache.live.num_free == engine.cache.live.size
