"""The randomized differential fuzzer (tests/engine/fuzz_engine.py) on a few dozen seeded
workloads: backends x cache modes x speculation, stops, aborts, faults at every stage of a step,
small pools. Tokens equal the solo run's and every pool ends full. A few workloads on each of the
other families' tiny models too (Gated DeltaNet's included, on both of its backends)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine import fuzz_engine

WORKLOADS = 24
# Workloads per family beside Nemotron-H (the model is the one thing that differs).
FAMILY_WORKLOADS = 12


@pytest.fixture(scope="module")
def fuzz_setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[fuzz_engine.Models, fuzz_engine.Reference]:
    models = fuzz_engine.make_models(Path(tmp_path_factory.mktemp("fuzz")))
    return models, fuzz_engine.Reference(models)


def test_fuzzed_workloads_equal_the_solo_runs_and_free_everything(fuzz_setup) -> None:  # noqa: ANN001
    models, reference = fuzz_setup
    workloads = [fuzz_engine.make_workload(seed, reference, models) for seed in range(WORKLOADS)]
    fired = 0
    for workload in workloads:
        fired += fuzz_engine.run_workload(workload, reference, models)["faults"]
    # The seeds cover what the fuzzer exists for: every spec method, caching mode and stage.
    options = [w.options for w in workloads]
    assert {o.get("speculative", {}).get("method") for o in options} >= {None, "ngram", "draft", "mtp", "custom"}
    assert {o["mamba_cache_mode"] for o in options if o["enable_prefix_caching"]} == {"none", "align", "all"}
    assert {stage for w in workloads for stage, _ in w.faults.values()} == set(fuzz_engine.STAGES)
    assert fired >= WORKLOADS // 2


@pytest.mark.parametrize("family", ["granite", "bamba", "falcon_h1", "qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_fuzzed_workloads_of_every_family(family: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    models = fuzz_engine.make_models_of(Path(tmp_path_factory.mktemp(f"fuzz_{family}")), family)
    reference = fuzz_engine.Reference(models)
    methods = tuple(m for m in fuzz_engine.SPEC_METHODS if m != "mtp")
    workloads = [fuzz_engine.make_workload(seed, reference, models, methods) for seed in range(FAMILY_WORKLOADS)]
    for workload in workloads:
        fuzz_engine.run_workload(workload, reference, models)
    assert len({w.options.get("speculative", {}).get("method") for w in workloads}) >= 2
    assert {w.options["ssm_backend"] for w in workloads} == {"baseline", "replay"}
    assert any(w.options["async_scheduling"] for w in workloads)
