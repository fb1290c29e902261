from __future__ import annotations

import os

import torch

# TRITON_INTERPRET is read when a kernel is decorated, so it must be set before any test imports
# one; without a GPU the Triton kernels run in the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import functools  # noqa: E402
import importlib.util  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from replayserve.builtin.tiny import make_tiny  # noqa: E402

torch.set_num_threads(2)

# The server extra is part of the test extra, so CI runs tests/server; a machine without it (the
# offline H200 box) leaves that directory out, reported in the header, instead of failing imports.
_SERVER_DEPS = ("fastapi", "uvicorn", "openai", "httpx", "prometheus_client", "zmq", "msgspec")
collect_ignore = [] if all(importlib.util.find_spec(m) for m in _SERVER_DEPS) else ["server"]


def pytest_report_header() -> str | None:
    return "tests/server left out: the server extra is not installed" if collect_ignore else None


# Tests marked `slow` (the longest on 2 CPU cores: 4-rank tensor parallelism, benchmark smoke runs,
# server shutdown timings, interpreter drives of long kernel sequences, distribution checks) are
# deselected by default so that a developer's run stays under 8 minutes; CI and GPU runs pass
# --run-slow and run everything.
def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="also run the tests marked slow (CI does)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


@pytest.fixture(autouse=True)
def _llm_warms_up_only_where_tested(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA every `LLM` warms up (every decode graph, every kernel variant: seconds each) and
    the suite builds hundreds; only tests marked `warmup` (the warm-up's own) keep it."""
    if not torch.cuda.is_available() or request.node.get_closest_marker("warmup"):
        return
    from replayserve import LLM

    build = LLM.__init__

    # wraps keeps LLM.__init__'s signature, defaults and hints for the tests that read them (on CUDA
    # test_options saw this wrapper's instead and failed).
    @functools.wraps(build)
    def without_warm_up(self, *args, warmup: bool = False, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
        build(self, *args, warmup=warmup, **kwargs)

    monkeypatch.setattr(LLM, "__init__", without_warm_up)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Nemotron-H (Mamba, attention, MLP and MoE layers) written by `make-tiny`."""
    return make_tiny(tmp_path_factory.mktemp("tiny"), seed=0, layers="M*-ME")


def assert_pools_full(llm) -> None:  # noqa: ANN001 - LLM, kept import-free for fixtures
    engine = llm.engine
    cache = engine.cache
    assert cache.kv.num_free == cache.kv.size, "KV blocks leaked"
    assert cache.live.num_free == cache.live.size, "Mamba state slots leaked"
    if cache.states is not None:
        assert cache.states.num_free == cache.states.size, "Mamba boundary-state slots leaked"
    cache.check()
    assert not engine.scheduler.has_unfinished()
