"""A pytest plugin for running the suite on one GPU with pytest-xdist workers (`-n N`).

`SPLIT_GPU=N` makes each worker see an N-th of the card (``torch.cuda.mem_get_info``), so that
engines sized by `gpu_memory_utilization` do not each plan most of the card and then fail to
allocate beside the others. Each test phase that fails or takes over half a second is appended to
`$OUT/durations.tsv` (`$DUR_FILE` names another file) as it finishes, so a run cut short still
says where its time went.

    SPLIT_GPU=8 PYTHONPATH=$PWD:$PWD/scripts python -m pytest -q tests --run-slow -n 8 \\
        --dist loadfile -p pytest_gpu_split -p no:cacheprovider

On an H100 (2026-12-07) the whole suite takes about four minutes this way.
"""

from __future__ import annotations

import os

import pytest
import torch

_SPLIT = int(os.environ.get("SPLIT_GPU", "1"))
if _SPLIT > 1 and torch.cuda.is_available():
    _whole_card = torch.cuda.mem_get_info

    def _share(device: torch.device | int | None = None) -> tuple[int, int]:
        free, total = _whole_card(device)
        return min(free, total // _SPLIT), total // _SPLIT

    torch.cuda.mem_get_info = _share

_LOG = open(os.path.join(os.environ.get("OUT", "."), os.environ.get("DUR_FILE", "durations.tsv")), "a",  # noqa: SIM115
            buffering=1)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.outcome != "passed" or report.duration > 0.5:
        _LOG.write(f"{report.nodeid}\t{report.when}\t{report.outcome}\t{report.duration:.2f}\n")
