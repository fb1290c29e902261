"""The server over an engine core in its own process (what `replayserve serve` runs): outputs equal
offline generation, a fault that one request causes fails only that request, the core dying
mid-stream ends every stream cleanly and marks the server unhealthy, 64 streaming clients of which
a quarter hang up leave every pool free, and the API key guards /v1."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from replayserve import LLM, SamplingParams
from replayserve.engine.runner import Runner
from replayserve.server import create_app
from replayserve.server.core_messages import Abort
from replayserve.server.core_process import ProcessCore, run_engine_core
from replayserve.structured import StructuredOutputsParams
from tests.server.conftest import run_uvicorn

MODEL_NAME = "tiny"
OPTIONS: dict[str, Any] = {"dtype": "float64", "device": "cpu", "max_num_seqs": 8}
GUILTY_SEED = 4242  # the request whose rows make a step fail (faulty_engine_core)
API_KEY = "sesame"


def faulty_engine_core(*args: Any) -> None:
    """The engine core's main with a runner that raises whenever a request seeded GUILTY_SEED samples."""
    execute = Runner.execute

    def guilty_fails(self: Runner, plan: Any, params: list[SamplingParams], *rest: Any, **kwargs: Any) -> Any:
        if any(p.seed == GUILTY_SEED for p in params):
            raise RuntimeError("injected fault")
        return execute(self, plan, params, *rest, **kwargs)

    Runner.execute = guilty_fails  # type: ignore[method-assign]
    run_engine_core(*args)


@dataclass
class ProcessServer:
    core: ProcessCore
    app: FastAPI
    server: uvicorn.Server
    thread: threading.Thread
    base_url: str
    fatal: threading.Event

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(20)
        self.core.stop()
        assert not self.thread.is_alive(), "the server did not stop"


def start(model_dir: Path, target: Any = run_engine_core, **app_options: Any) -> ProcessServer:
    core = ProcessCore(str(model_dir), OPTIONS, target=target)
    core.launch(timeout=120)
    app = create_app(core, MODEL_NAME, **app_options)
    fatal = threading.Event()
    app.state.on_fatal = fatal.set
    return ProcessServer(core, app, *run_uvicorn(app), fatal)


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[ProcessServer]:
    running = start(tiny_model_dir, faulty_engine_core, api_key=API_KEY)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def offline(tiny_model_dir: Path) -> LLM:
    return LLM(model=str(tiny_model_dir), **OPTIONS)


AUTH = {"authorization": f"Bearer {API_KEY}"}


def _usage(base_url: str) -> dict[str, float]:
    """The pools' use as /metrics reports it (the core's snapshot once it is idle)."""
    text = httpx.get(f"{base_url}/metrics").text
    return {pool: float(v) for pool, v in re.findall(r'^replayserve_cache_usage\{.*pool="(\w+)"\} (\S+)$', text, re.M)}


def _wait_idle(base_url: str, timeout: float = 30) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"{base_url}/metrics").text
        running = re.search(r"^replayserve_num_requests_running\{.*\} (\S+)$", text, re.M)
        waiting = re.search(r"^replayserve_num_requests_waiting\{.*\} (\S+)$", text, re.M)
        if running and waiting and float(running.group(1)) == 0 and float(waiting.group(1)) == 0:
            usage = _usage(base_url)
            if all(v == 0 for v in usage.values()):
                return usage
        assert time.monotonic() < deadline, f"the engine did not go idle: {_usage(base_url)}"
        time.sleep(0.1)


def test_outputs_equal_offline_generation(served: ProcessServer, offline: LLM) -> None:
    prompts = ["def add(a, b", "import os", "class Stack"]
    params = SamplingParams(temperature=0, max_tokens=12, stop=["\n\n"], logprobs=2)
    expected = offline.generate(prompts, params, use_tqdm=False)
    response = httpx.post(f"{served.base_url}/v1/completions", headers=AUTH, timeout=60, json={
        "model": MODEL_NAME, "prompt": prompts, "max_tokens": 12, "temperature": 0, "stop": ["\n\n"], "logprobs": 2})
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    for choice, want in zip(choices, expected, strict=True):
        assert choice["text"] == want.outputs[0].text
        assert choice["finish_reason"] == want.outputs[0].finish_reason
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(
            [lp[t].logprob for lp, t in zip(want.outputs[0].logprobs, want.outputs[0].token_ids, strict=True)])


def test_a_constraint_crosses_to_the_core_and_equals_offline(served: ProcessServer, offline: LLM) -> None:
    """The front end checks the constraint, the core compiles it (`params_from_dict`)."""
    pytest.importorskip("xgrammar")
    pattern = r"[a-z]{1,6}(, [a-z]{1,6}){0,3}\."
    params = SamplingParams(temperature=0, max_tokens=30, structured_outputs=StructuredOutputsParams(regex=pattern))
    expected = offline.generate(["def f(x", "import"], params, use_tqdm=False)
    response = httpx.post(f"{served.base_url}/v1/completions", headers=AUTH, timeout=60, json={
        "model": MODEL_NAME, "prompt": ["def f(x", "import"], "max_tokens": 30, "temperature": 0,
        "guided_regex": pattern})
    assert response.status_code == 200, response.text
    texts = [c["text"] for c in response.json()["choices"]]
    assert texts == [o.outputs[0].text for o in expected]
    assert all(re.fullmatch(pattern, t) for t in texts)
    _wait_idle(served.base_url)


def test_one_guilty_request_among_six_fails_alone(served: ProcessServer, offline: LLM) -> None:
    prompts = ["def f(x", "import sys", "for i in range(", "class A", "while True", "return self"]
    expected = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)

    async def one(client: httpx.AsyncClient, i: int, prompt: str) -> httpx.Response:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        if i == 3:
            body["seed"] = GUILTY_SEED
        return await client.post(f"{served.base_url}/v1/completions", json=body, headers=AUTH)

    async def all_at_once() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(one(client, i, p) for i, p in enumerate(prompts)))

    responses = asyncio.run(all_at_once())
    assert responses[3].status_code == 500
    assert "injected fault" in responses[3].json()["error"]["message"]
    for i, (response, want) in enumerate(zip(responses, expected, strict=True)):
        if i != 3:
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == want.outputs[0].text
    _wait_idle(served.base_url)
    assert httpx.get(f"{served.base_url}/health").status_code == 200


def test_64_streams_with_a_quarter_hanging_up_leave_every_pool_free(served: ProcessServer) -> None:
    async def stream(client: httpx.AsyncClient, i: int) -> int:
        body = {"model": MODEL_NAME, "prompt": f"def f{i}(", "max_tokens": 40, "ignore_eos": True, "stream": True}
        chunks = 0
        async with client.stream("POST", f"{served.base_url}/v1/completions", json=body, headers=AUTH) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks += 1
                    if i % 4 == 0 and chunks == 2:
                        return -1  # hangs up mid-stream
        return chunks

    async def run() -> list[int]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(stream(client, i) for i in range(64)))

    results = asyncio.run(run())
    assert results.count(-1) == 16 and all(r > 0 for r in results if r != -1)
    assert set(_wait_idle(served.base_url)) >= {"kv_blocks", "mamba_slots"}


def test_the_api_key_guards_v1_only(served: ProcessServer) -> None:
    url = f"{served.base_url}/v1/completions"
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 1}
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": API_KEY}):
        refused = httpx.post(url, json=body, headers=headers, timeout=30)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{served.base_url}/v1/models").status_code == 401
    assert httpx.post(url, json=body, headers=AUTH, timeout=30).status_code == 200
    assert httpx.get(f"{served.base_url}/v1/models", headers=AUTH).json()["data"][0]["id"] == MODEL_NAME
    assert httpx.get(f"{served.base_url}/health").status_code == 200
    assert httpx.get(f"{served.base_url}/metrics").status_code == 200


def test_a_body_over_the_limit_is_refused_at_once(served: ProcessServer) -> None:
    too_big = json.dumps({"model": MODEL_NAME, "prompt": "x" * (5 * 1024 * 1024)})
    response = httpx.post(f"{served.base_url}/v1/completions", content=too_big, timeout=30,
                          headers={**AUTH, "content-type": "application/json"})
    assert response.status_code == 413 and "limit" in response.json()["error"]["message"]
    assert httpx.get(f"{served.base_url}/health").status_code == 200


def test_the_core_dying_mid_stream_ends_streams_cleanly(tiny_model_dir: Path) -> None:
    running = start(tiny_model_dir)
    try:
        body = {"model": MODEL_NAME, "prompt": "def f(", "max_tokens": 400, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", f"{running.base_url}/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                    if len(events) == 3:
                        running.core.kill()
        assert events[-1] == "[DONE]"
        assert "engine core process died" in json.loads(events[-2])["error"]["message"]
        assert running.fatal.wait(10), "the server was not told to stop"
        assert httpx.get(f"{running.base_url}/health").status_code == 503
        late = httpx.post(f"{running.base_url}/v1/completions", json={**body, "stream": False}, timeout=30)
        assert late.status_code == 503
    finally:
        running.stop()


def test_a_command_to_a_dead_core_is_a_connection_error(tiny_model_dir: Path) -> None:
    """Between the core's death and the front end noticing it, a send must fail cleanly (the
    request then gets a 503), not raise ZeroMQ's error out of a handler."""
    core = ProcessCore(str(tiny_model_dir), OPTIONS)
    core.launch(timeout=120)
    try:
        core.kill()
        deadline = time.monotonic() + 10
        while True:
            try:
                core.send(Abort(["0"]))
            except ConnectionError as e:
                assert "not running" in str(e)
                break
            assert time.monotonic() < deadline, "a send to a dead core kept succeeding"
            time.sleep(0.05)
    finally:
        core.stop(0)


def test_a_long_prompt_is_tokenized_off_the_event_loop(served: ProcessServer) -> None:
    """2.7 MB of text (under the body limit) takes seconds to tokenize; /health answers meanwhile."""
    text = "def f(x):\n    return x + 1\n" * 100_000
    answer: dict[str, Any] = {}

    def send() -> None:
        started = time.monotonic()
        answer["response"] = httpx.post(f"{served.base_url}/v1/completions", headers=AUTH, timeout=120,
                                        json={"model": MODEL_NAME, "prompt": text, "max_tokens": 1})
        answer["seconds"] = time.monotonic() - started

    sender = threading.Thread(target=send)
    sender.start()
    waits = []
    while sender.is_alive():
        started = time.monotonic()
        assert httpx.get(f"{served.base_url}/health", timeout=30).status_code == 200
        waits.append(time.monotonic() - started)
        time.sleep(0.05)
    sender.join()
    assert answer["response"].status_code == 400  # far past the context: refused once tokenized
    assert answer["seconds"] > 1.0, "the prompt was tokenized too fast to tell"
    # Tokenizing holds no lock the event loop needs: /health kept answering all along (one poll
    # in 3 s when the tokenizer held the GIL); parsing the body and listing the ids take the rest.
    assert len(waits) >= 10 and max(waits) < 1.0, f"/health: {len(waits)} answers, slowest {max(waits):.2f} s"
