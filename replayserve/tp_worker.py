"""A tensor-parallel worker process: `python -m replayserve.tp_worker RANK WORLD PORT`, started by
rank 0 (`distributed.group.Workers.start`). It loads its slice of the model, builds its runner (and
the MTP proposer) through the composition root (`build.build_worker`), joins the process group,
then replays rank 0's calls until told to stop or until rank 0's pipe closes. A process's main
program, like `cli.py`: it sits above the root it builds with."""

from __future__ import annotations

import dataclasses
import pickle
import sys

import torch

from replayserve.build import build_worker
from replayserve.distributed.group import READY, init_group
from replayserve.models.loader import load_model


def main(rank: int, world: int, port: int) -> None:
    inbox, outbox = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # stdout carries the ready line alone; rank 0 stops reading it after that
    kind, (model_dir, dtype, device) = pickle.load(inbox)
    assert kind == "load"
    if device.startswith("cuda"):  # one GPU per rank
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    torch.set_num_threads(max(1, torch.get_num_threads() // world))
    model = load_model(model_dir, getattr(torch, dtype), torch.device(device), rank, world)
    kind, config = pickle.load(inbox)  # sent once rank 0 has sized the caches
    if kind == "shutdown":  # rank 0 failed to start
        return
    assert kind == "runner"
    config = dataclasses.replace(config, device=device)
    if config.cpu_threads is not None:  # rank 0's choice for each rank (cpu_threads.py)
        torch.set_num_threads(config.cpu_threads)
    runner, proposer = build_worker(config, model, inbox)
    outbox.write(READY)
    outbox.flush()
    init_group(rank, world, port, device)
    while True:
        kind, (payload, forgotten) = runner.receive()
        for request_id in forgotten:
            runner.forget(request_id)
        if kind == "execute":
            runner.execute(payload, [], [])
        elif kind == "prepare_for_serving":
            runner.prepare_for_serving()
        elif kind == "propose":
            assert proposer is not None
            proposer.propose_batch(payload)
        elif kind == "shutdown":
            return
        else:
            raise RuntimeError(f"unknown message {kind!r} from rank 0")


if __name__ == "__main__":
    try:
        main(*(int(a) for a in sys.argv[1:4]))
    except EOFError:  # rank 0 has gone: nothing is left to serve
        pass
