"""`replayserve serve` as a process: SIGTERM (or SIGINT) in the middle of a load stops admitting, lets the
requests in flight finish (none loses its end), and exits 0 within a few seconds; an idle connection
stays open longer than clients keep one."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from replayserve.cli import main

MAX_TOKENS = 256  # long enough that requests are still running when all 8 are admitted


def _start(model_dir: Path, shutdown_timeout: float = 20) -> tuple[subprocess.Popen, str]:
    # The checkout first, then whatever the caller's PYTHONPATH holds (packages installed there).
    path = [str(Path(__file__).resolve().parents[2]), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    proc = subprocess.Popen([sys.executable, "-m", "replayserve.cli", "serve", "--model", str(model_dir), "--port",
                             "0", "--served-model-name", "tiny", "--dtype", "float32", "--shutdown-timeout",
                             str(shutdown_timeout)],
                            stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stderr is not None
    deadline = time.monotonic() + 60
    for line in proc.stderr:  # uvicorn logs the port it bound
        match = re.search(r"running on (http://127\.0\.0\.1:\d+)", line)
        if match:
            # Keep reading its log, or a full pipe would block the server.
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return proc, match.group(1)
        assert time.monotonic() < deadline, "the server did not start"
    raise AssertionError(f"the server exited with {proc.wait()} before listening")


def _stream(base_url: str) -> tuple[int, bool]:
    """Completion tokens received and whether the stream ended with [DONE]."""
    body = {"prompt": "The quick brown fox", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    usage, done = 0, False
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: ") and json.loads(line[6:]).get("usage"):
                usage = json.loads(line[6:])["usage"]["completion_tokens"]
    return usage, done


def _running_and_finished(base_url: str) -> tuple[float, float]:
    """Requests in the running batch, and completions ended so far (any finish reason)."""
    text = httpx.get(f"{base_url}/metrics").text
    running = float(re.search(r'^replayserve_num_requests_running\{model_name="tiny"\} (\S+)$', text, re.M).group(1))
    finished = sum(float(v) for v in re.findall(r"^replayserve_request_finished_total\{.*\} (\S+)$", text, re.M))
    return running, finished


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)],
                         ids=["SIGTERM", "SIGINT"])
def test_a_signal_mid_load_finishes_in_flight_requests_and_exits_0(tiny_model_dir: Path, sig: int) -> None:
    proc, base_url = _start(tiny_model_dir)
    try:
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(_stream, base_url) for _ in range(8)]
            deadline = time.monotonic() + 30
            while True:  # all 8 admitted and some still running: SIGTERM lands mid-load, not before it
                running, finished = _running_and_finished(base_url)
                if running >= 1 and running + finished >= 8:
                    break
                assert time.monotonic() < deadline, f"the load never started ({running} running, {finished} done)"
                time.sleep(0.02)
            signal_at = time.monotonic()
            proc.send_signal(sig)
            results = [f.result() for f in futures]
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - signal_at < 15
        assert results == [(MAX_TOKENS, True)] * 8, "every request in flight at SIGTERM completed"
        try:
            refused = httpx.get(f"{base_url}/health", timeout=2).status_code != 200
        except httpx.TransportError:
            refused = True
        assert refused, "the server stopped listening"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_requests_past_the_shutdown_timeout_end_with_an_error_not_a_cut(tiny_model_dir: Path) -> None:
    """A stream gets an error event and [DONE]; a whole response gets OpenAI's error body; exit 0."""
    # 0.2 s: a GPU runs the tiny model's 1000 tokens in about a second, all of it past the signal.
    proc, base_url = _start(tiny_model_dir, shutdown_timeout=0.2)
    body = {"prompt": "The quick brown fox", "max_tokens": 1000, "ignore_eos": True}
    try:
        with ThreadPoolExecutor(2) as pool:
            def stream() -> list[str]:
                with httpx.stream("POST", f"{base_url}/v1/completions", json={**body, "stream": True},
                                  timeout=60) as response:
                    return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]

            events = pool.submit(stream)
            whole = pool.submit(httpx.post, f"{base_url}/v1/completions", json=body, timeout=60)
            deadline = time.monotonic() + 30
            while _running_and_finished(base_url)[0] < 2:
                assert time.monotonic() < deadline, "the two requests never ran"
                time.sleep(0.02)
            proc.send_signal(signal.SIGTERM)
            streamed, response = events.result(), whole.result()
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
    assert streamed[-1] == "[DONE]" and "did not finish within 0.2 s" in json.loads(streamed[-2])["error"]["message"]
    assert response.status_code == 500 and "did not finish within 0.2 s" in response.json()["error"]["message"]


@pytest.mark.slow
def test_an_idle_connection_stays_open_past_httpx_s_keep_alive_expiry(tiny_model_dir: Path) -> None:
    """Issue 38's cut streams: uvicorn closes an idle connection after 5 s, which is also how long an
    httpx pool keeps one, so a client could send its next request just as the server closed the
    connection; the request met a reset (httpx.ReadError). Once the server outlasts the client's
    expiry, a connection the client may still reuse is one the server still reads. A raw
    http.client connection, because an httpx pool would quietly replace a connection the server closed."""
    proc, base_url = _start(tiny_model_dir)
    host, port = base_url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    body = json.dumps({"prompt": "The quick brown fox", "max_tokens": 2, "stream": True})

    def complete() -> tuple[int, bytes]:
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()

    try:
        assert complete()[0] == 200
        sock = connection.sock
        time.sleep(httpx.Limits().keepalive_expiry + 0.5)
        try:
            status, events = complete()
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as e:
            raise AssertionError(f"the server closed a connection an httpx client could still reuse: {e!r}") from e
        assert connection.sock is sock, "the second request went on the same connection"
        assert status == 200 and events.endswith(b"data: [DONE]\n\n")
    finally:
        connection.close()
        proc.kill()
        proc.wait()


@pytest.mark.parametrize(("argv", "says"), [
    (["--model", "/no/such/model"], "does not exist"),
    (["--port", "70000"], "--port"),
    (["--max-waiting-requests", "-1"], "--max-waiting-requests"),
    (["--keep-alive-timeout", "0"], "--keep-alive-timeout"),
    (["--speculative", "{"], "--speculative"),
])
def test_a_bad_serve_invocation_exits_2_with_one_line(tiny_model_dir: Path, argv: list[str], says: str,
                                                       capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--model", str(tiny_model_dir), *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and says in err and err.count("\n") == 1
