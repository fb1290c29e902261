"""Admission control (429 with Retry-After past max_num_seqs + max_waiting_requests), clients that
hang up (aborted, blocks and slots freed), and engine faults (one every step fails its requests
with a 500 and the server then serves again; a transient one is retried); with and without async
scheduling. `test_fault_isolation.py` has the fault that one request among several causes."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from replayserve.engine.runner import Runner
from tests.server.conftest import MODEL_NAME, RunningServer, start_server, stop_server

LONG = {"model": MODEL_NAME, "prompt": "Hybrid language models mix", "max_tokens": 1000, "ignore_eos": True,
        "temperature": 0}


@pytest.fixture(scope="module", params=[{}, {"async_scheduling": True, "speculative": None}], ids=["sync", "async"])
def small(tiny_model_dir: Path, request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    """Two requests run at once and none may wait; with async scheduling, a hang-up aborts a
    request while a launched step still runs it."""
    running = start_server(tiny_model_dir, engine={"max_num_seqs": 2, **request.param}, max_waiting_requests=0)
    yield running
    stop_server(running)


def _aborted(server: RunningServer) -> float:
    return server.app.state.metrics.registry.get_sample_value(
        "replayserve_request_finished_total", {"model_name": MODEL_NAME, "finish_reason": "abort"}) or 0.0


@contextlib.contextmanager
def _open_streams(server: RunningServer, count: int) -> Iterator[list[httpx.Response]]:
    """``count`` long streams, each past its first token; closed (the client hangs up) on exit."""
    with httpx.Client(timeout=30) as client, contextlib.ExitStack() as stack:
        streams = [stack.enter_context(client.stream("POST", f"{server.base_url}/v1/completions",
                                                     json={**LONG, "stream": True})) for _ in range(count)]
        lines = [s.iter_lines() for s in streams]  # kept: a dropped line iterator closes its connection
        for s, it in zip(streams, lines, strict=True):
            assert s.status_code == 200
            next(line for line in it if line.startswith("data: "))
        yield streams


def test_a_full_server_answers_429_with_retry_after(small: RunningServer) -> None:
    aborted = _aborted(small)
    with _open_streams(small, 2):
        response = httpx.post(f"{small.base_url}/v1/completions", json={**LONG, "max_tokens": 2}, timeout=30)
        assert response.status_code == 429
        assert int(response.headers["retry-after"]) >= 1
        assert response.json()["error"]["type"] == "rate_limit_error"
    # The hung-up streams were aborted well before their 1000 tokens; then there is room again.
    small.assert_pools_full()
    assert _aborted(small) == aborted + 2
    ok = httpx.post(f"{small.base_url}/v1/completions", json={**LONG, "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200


def test_more_completions_than_the_server_admits_is_a_400_not_a_429(small: RunningServer) -> None:
    response = httpx.post(f"{small.base_url}/v1/completions", json={**LONG, "max_tokens": 2, "n": 3}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"


def test_a_client_that_hangs_up_on_a_whole_response_is_aborted(small: RunningServer) -> None:
    aborted = _aborted(small)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{small.base_url}/v1/completions", json=LONG, timeout=0.5)
    small.assert_pools_full()
    assert _aborted(small) == aborted + 1, "aborted, not run to its 1000 tokens"


def test_an_engine_fault_fails_the_requests_in_flight_and_the_server_goes_on(
        small: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault in every step, whichever request runs, is the engine's: the request fails (500, or
    an error event in a stream) and, once the fault is gone, the server serves again."""
    runner = small.llm.engine.runner
    broken = {"on": True}

    def fail(method: str) -> object:
        def call(*args: object, **kwargs: object) -> object:
            if broken["on"]:
                raise RuntimeError("injected fault")
            return getattr(Runner, method)(runner, *args, **kwargs)
        return call

    monkeypatch.setattr(runner, "execute", fail("execute"))
    monkeypatch.setattr(runner, "launch_decode", fail("launch_decode"))
    response = httpx.post(f"{small.base_url}/v1/completions", json={**LONG, "max_tokens": 4}, timeout=30)
    assert response.status_code == 500
    assert "injected fault" in response.json()["error"]["message"]
    small.assert_pools_full()

    # in a stream the status line is sent, so the error comes as an event
    with httpx.stream("POST", f"{small.base_url}/v1/completions", json={**LONG, "max_tokens": 4, "stream": True},
                      timeout=30) as stream:
        events = [line.removeprefix("data: ") for line in stream.iter_lines() if line.startswith("data: ")]
    assert "injected fault" in json.loads(events[-2])["error"]["message"] and events[-1] == "[DONE]"
    small.assert_pools_full()

    broken["on"] = False
    ok = httpx.post(f"{small.base_url}/v1/completions", json={**LONG, "max_tokens": 4}, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    assert httpx.get(f"{small.base_url}/health").status_code == 200


def test_a_transient_fault_is_retried_and_the_request_completes(
        small: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = small.llm.engine.runner
    expected = httpx.post(f"{small.base_url}/v1/completions", json={**LONG, "max_tokens": 6}, timeout=30).json()
    faults = {"left": 1}

    def execute(*args: object, **kwargs: object) -> object:
        if faults["left"]:
            faults["left"] -= 1
            raise RuntimeError("injected fault")
        return Runner.execute(runner, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(runner, "execute", execute)
    response = httpx.post(f"{small.base_url}/v1/completions", json={**LONG, "max_tokens": 6}, timeout=30)
    assert faults["left"] == 0
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"] == expected["choices"][0]["text"]
    small.assert_pools_full()
