"""How many intra-op threads torch runs on the CPU: one policy for `LLM`, and so for `generate`,
`serve` and `demo`.

Why a policy: torch starts one OpenMP thread per core, and every parallel op waits at a barrier
for all of them. When other processes keep the cores busy, the OS deschedules one of those threads
and each op of a step waits for it. The engine's CPU ops are small (a few decode rows), so a
thread too many costs far more than a thread too few: on a 2-core machine with two busy processes,
greedy decode of the built-in model ran at 6-146 tok/s on torch's default of 2 threads against
180-356 tok/s on one thread (10-50x slower in the runs of issue 37), while on the idle machine
2 threads gave about 720 tok/s against about 580 on one.

The count, the first rule that applies:
1. `LLM(cpu_threads=N)` / `--threads N`;
2. `OMP_NUM_THREADS`, when the user set it (its first number, as OpenMP reads it);
3. the idle cores: the CPUs this process may run on (its affinity, at most torch's default count
   and a container's cgroup quota), less what other processes use now, measured as the idle share
   of those CPUs over 0.25 s (`/proc/stat`; where there is none, the 1-minute load average),
   rounded down with a tenth of a core of slack, at least 1, divided among tensor-parallel ranks.
   It is measured once per process, before the first engine loads, so every engine of a process
   (the demo's rows) gets the same count.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# How long the idle share is sampled: long enough to see a busy loop, short for a start-up.
SAMPLE_SECONDS = 0.25
# A core counts as free when at least 90% of it is idle (background noise of an idle machine).
IDLE_SLACK = 0.1


@dataclass(frozen=True)
class ThreadChoice:
    """A thread count and why it was chosen (logged, and printed by the demo)."""

    count: int
    why: str


def choose_cpu_threads(requested: int | None, ranks: int = 1) -> ThreadChoice:
    """The intra-op thread count of each rank's process on the CPU (see the module docstring).
    `requested` is returned as it is; `EngineConfig` checks it."""
    if requested is not None:
        return ThreadChoice(requested, "set by cpu_threads / --threads")
    from_env = omp_num_threads()
    if from_env is not None:
        return ThreadChoice(from_env, f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}")
    usable, idle = _machine_load()
    count = threads_for_idle(usable, idle, ranks)
    split = f", split over {ranks} ranks" if ranks > 1 else ""
    busy = ": other processes are busy" if math.floor(idle + IDLE_SLACK) < usable else ""
    return ThreadChoice(count, f"{idle:.1f} of {usable} usable CPUs idle at start-up{busy}{split}")


def threads_for_idle(usable: int, idle: float, ranks: int) -> int:
    """Threads per rank from `usable` CPUs of which `idle` (a float, in cores) are idle."""
    free = min(usable, math.floor(idle + IDLE_SLACK))
    return max(1, free // ranks)


def omp_num_threads() -> int | None:
    """The first number of `OMP_NUM_THREADS` ("4" or "4,2"), or None when unset or not a positive int."""
    raw = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        logger.warning("OMP_NUM_THREADS=%r is not a positive integer; choosing the CPU threads from the idle "
                       "cores instead", os.environ["OMP_NUM_THREADS"])
        return None
    return int(raw)


def apply_cpu_threads(choice: ThreadChoice) -> None:
    """Sets torch's intra-op threads for this process (torch's setting is process-wide)."""
    torch.set_num_threads(choice.count)
    logger.info("CPU: %d intra-op thread%s (%s); --threads N, LLM(cpu_threads=N) or OMP_NUM_THREADS=N sets it",
                choice.count, "" if choice.count == 1 else "s", choice.why)


@functools.cache
def _machine_load() -> tuple[int, float]:
    """(usable CPUs, idle CPUs among them now), measured on the first call only."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    usable = max(1, min(len(cpus), torch.get_num_threads(), cgroup_cpu_limit() or len(cpus)))
    idle = _idle_cpus_from_proc_stat(cpus)
    if idle is None:
        idle = _idle_cpus_from_load_average()
    return usable, usable if idle is None else min(idle, usable)


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The CPUs a cgroup quota allows (a container's --cpus), rounded up; None when unlimited or
    unknown. cgroup v2 (`cpu.max`: "200000 100000" or "max 100000") or v1 (`cpu/cpu.cfs_quota_us`)."""
    try:
        try:
            quota, period = (root / "cpu.max").read_text().split()
        except FileNotFoundError:
            quota = (root / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (root / "cpu" / "cpu.cfs_period_us").read_text().strip()
        if quota in ("max", "-1"):
            return None
        return max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        return None


def idle_ticks(proc_stat: str, cpus: Sequence[int]) -> tuple[int, int, int]:
    """(CPUs found, idle + iowait ticks, all ticks) summed over the `cpuN` lines of /proc/stat's
    text for N in `cpus`."""
    wanted = {f"cpu{n}" for n in cpus}
    found = idle = total = 0
    for line in proc_stat.splitlines():
        name, *values = line.split()
        if name in wanted:
            # user nice system idle iowait irq softirq steal (guest time is already in user)
            ticks = [int(v) for v in values[:8]]
            found, idle, total = found + 1, idle + ticks[3] + ticks[4], total + sum(ticks)
    return found, idle, total


def _idle_cpus_from_proc_stat(cpus: Sequence[int]) -> float | None:
    """Idle cores among `cpus` over SAMPLE_SECONDS (Linux), None where /proc/stat is absent."""
    stat = Path("/proc/stat")
    try:
        found, idle0, total0 = idle_ticks(stat.read_text(), cpus)
        time.sleep(SAMPLE_SECONDS)
        _, idle1, total1 = idle_ticks(stat.read_text(), cpus)
    except (OSError, ValueError, IndexError):
        return None
    if found == 0:
        return None
    if total1 <= total0:
        return float(found)
    return found * (idle1 - idle0) / (total1 - total0)


def _idle_cpus_from_load_average() -> float | None:
    if not hasattr(os, "getloadavg"):
        return None
    return max(0.0, (os.cpu_count() or 1) - os.getloadavg()[0])
