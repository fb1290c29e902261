"""The tensor-parallel process group, seen from rank 0: starting the worker processes, sending
them messages, noticing when one dies, shutting them down.

Ranks 1 .. N-1 run `python -m replayserve.tp_worker`. Messages from rank 0 (the config,
then one per mirrored call) travel pickled over each worker's stdin, not over the process group:
a worker waits for the next call without a timeout (an engine may sit idle for hours) and exits
when the pipe closes, so it never outlives rank 0. The model's collectives run on the default
`torch.distributed` group (gloo on the CPU, NCCL on CUDA) with `COLLECTIVE_TIMEOUT`: a rank that
stops answering makes the others fail instead of waiting forever.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import pickle
import socket
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from replayserve.config import ConfigError, EngineConfig

COLLECTIVE_TIMEOUT = timedelta(minutes=5)
READY = b"replayserve-worker-ready\n"


def worker_config(config: EngineConfig) -> EngineConfig:
    """What a worker needs of rank 0's config: the same, except a proposer that runs on rank 0's
    host alone (n-gram, draft model, custom object, which may not pickle), whose drafts reach the
    workers inside the plans: only its draft count, which sizes the state layouts, is kept."""
    spec = config.speculative
    if spec is None or spec.method == "mtp":
        return config
    return dataclasses.replace(config, speculative=dataclasses.replace(spec, method="ngram", model=None,
                                                                       proposer=None))


def backend_of(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def init_group(rank: int, world: int, port: int, device: str) -> None:
    dist.init_process_group(backend_of(device), init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=COLLECTIVE_TIMEOUT)


class Workers:
    """Ranks 1 .. world-1 as child processes of rank 0 (this process)."""

    def __init__(self, procs: list[subprocess.Popen], port: int, device: str) -> None:
        self.procs, self.port, self.device = procs, port, device
        self.connected = False
        self.broken: str | None = None  # why the ranks may be out of step: no call may follow
        atexit.register(self.close)

    @classmethod
    def start(cls, config: EngineConfig, model_dir: str) -> Workers:
        """Starts the workers and sends each the model to load; they load their slices while rank 0
        loads its own. `connect` then sends the final config and waits for them. One tensor-parallel
        engine per process: the model's collectives use the default process group."""
        if dist.is_available() and dist.is_initialized():
            raise ConfigError("engine option tensor_parallel_size: this process already runs a tensor-parallel "
                              "engine (or another torch.distributed group); close() that LLM first")
        world = config.tensor_parallel_size
        with socket.socket() as s:  # a free port for the group's rendezvous
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [subprocess.Popen([sys.executable, "-m", "replayserve.tp_worker", str(rank), str(world),
                                   str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=os.environ.copy())
                 for rank in range(1, world)]
        workers = cls(procs, port, config.device)
        workers.send(("load", (model_dir, config.dtype, config.device)))
        return workers

    def connect(self, config: EngineConfig) -> None:
        """Sends the workers the engine config (on CUDA with the cache sizes rank 0 derived from
        its free memory: every rank must hold the same blocks and slots), waits until each has
        built its runner, then joins the process group as rank 0."""
        self.send(("runner", worker_config(config)))
        for rank, proc in enumerate(self.procs, 1):
            assert proc.stdout is not None
            while (line := proc.stdout.readline()) != READY:
                if not line:  # the pipe closed: the worker died
                    raise RuntimeError(self._death(rank, proc, "while loading its slice of the model"))
        init_group(0, len(self.procs) + 1, self.port, self.device)
        self.connected = True

    def send(self, message: tuple[str, Any]) -> None:
        """Queues a message to every worker (pickled once)."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self.watch():
            for proc in self.procs:
                assert proc.stdin is not None
                proc.stdin.write(data)
                proc.stdin.flush()

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        """Around a mirrored call: an error that a dead worker caused (a broken pipe, a failed
        collective) becomes one that names the worker. After any error the ranks may be out of
        step (some inside a collective, some not), so every later call is refused."""
        if self.broken is not None:
            raise RuntimeError(self.broken)
        try:
            yield
        except BaseException as e:
            self.broken = (f"the tensor-parallel ranks stopped in step after an error ({type(e).__name__}: {e}); "
                           "this LLM cannot go on: start a new one")
            for rank, proc in enumerate(self.procs, 1):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=2)  # a collective may fail a moment before the peer's exit is seen
                if proc.returncode is not None:
                    self.broken = self._death(rank, proc, "during a step")
                    raise RuntimeError(self.broken) from e
            raise

    @staticmethod
    def _death(rank: int, proc: subprocess.Popen, when: str) -> str:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)  # its pipe may close a moment before it exits
        return (f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with status {proc.poll()} {when} "
                "(its error is on stderr); this LLM cannot go on: start a new one")

    def close(self) -> None:
        """Stops the workers (a shutdown message, then their pipes closed; killed if they linger)
        and leaves the process group. Safe to call twice."""
        atexit.unregister(self.close)
        for proc in self.procs:
            with contextlib.suppress(OSError, ValueError):
                assert proc.stdin is not None
                proc.stdin.write(pickle.dumps(("shutdown", (None, []))))
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        self.procs = []
        if self.connected and dist.is_initialized():
            dist.destroy_process_group()
        self.connected = False
