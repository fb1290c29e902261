"""bench_e2e's GPU columns: decode steps under torch.profiler, their kernel time per step (each
step found by the kernel every recurrent layer launches once), CUDA API calls per step."""

from __future__ import annotations

import time
import warnings
from collections import Counter
from collections.abc import Callable

from e2e_common import gc_off

from replayserve.config import EngineConfig
from replayserve.engine.engine import Engine


def gpu_ms_by_step(kernels: list, marker: str, per_step: int) -> list[float]:
    """Kernel ms of each whole step in a profile: a step starts at every `per_step`-th launch of `marker`
    (the SSM step kernel, one per Mamba layer), so ReplaySSM's flush steps show as their own entries.
    kernels: profiler events with `.name` and `.time_range`, in any order."""
    ordered = sorted(kernels, key=lambda e: e.time_range.start)
    starts = [i for i, e in enumerate(ordered) if e.name == marker][::per_step]
    spans = zip(starts[:-1], starts[1:], strict=True)  # the last step has no next start: left out
    return [sum(e.time_range.elapsed_us() for e in ordered[a:b]) / 1e3 for a, b in spans]


def step_marker(config: EngineConfig) -> tuple[str, int]:
    """(the kernel each recurrent layer launches once per decode step, recurrent layers): Mamba2's state
    update, else the Gated DeltaNet step (the baseline's Triton kernel; where the backend runs the
    reference ops there is none, and the profile has no per-step split)."""
    m, replay = config.model, config.ssm_backend == "replay"
    if m.num_mamba_layers:
        return ("_replay_step_kernel" if replay else "_ssu_kernel"), m.num_mamba_layers
    return ("_replay_gdn_read_kernel" if replay else "_gated_delta_kernel"), m.num_gated_delta_layers


def profile_steps(engine: Engine, steps: int, sync: Callable[[], None]) -> dict:
    """Per-step GPU time and CUDA API calls of `steps` decode steps under torch.profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    warnings.filterwarnings("ignore", message=".*Profiler clears events at the end of each cycle")
    with gc_off(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        wall = time.perf_counter() - t0
    events = prof.events()
    gpu = [e for e in events if e.device_type == DeviceType.CUDA]
    copies = [e for e in gpu if e.name.startswith(("Memcpy", "Memset"))]
    kernels = [e for e in gpu if not e.name.startswith(("Memcpy", "Memset"))]
    # Runtime (cuda*) and driver (cu*) calls are CPU-side events; aten ops are named aten::*.
    calls = Counter(e.name for e in events if e.device_type == DeviceType.CPU and e.name.startswith("cu"))
    per_step = {k: v / steps for k, v in sorted(calls.items())}
    gpu_s = sum(e.time_range.elapsed_us() for e in kernels) / 1e6
    by_kernel: Counter = Counter()
    count_by_kernel: Counter = Counter()
    for e in kernels:
        by_kernel[e.name[:90]] += e.time_range.elapsed_us() / 1e3 / steps
        count_by_kernel[e.name[:90]] += 1 / steps
    return {"gpu_ms_by_step": gpu_ms_by_step(kernels, *step_marker(engine.config)),
            "top_kernels_ms": dict(by_kernel.most_common(40)),
            "top_kernel_counts": dict(count_by_kernel.most_common(40)),
            "profiled_step_ms": 1e3 * wall / steps, "gpu_ms_per_step": 1e3 * gpu_s / steps, "gpu_busy": gpu_s / wall,
            "kernels_per_step": len(kernels) / steps,
            "copy_ms_per_step": sum(e.time_range.elapsed_us() for e in copies) / 1e3 / steps,
            "d2h_copies_per_step": sum("DtoH" in e.name for e in copies) / steps,
            "syncs_per_step": sum(per_step.get(k, 0) for k in ("cudaStreamSynchronize", "cudaEventSynchronize",
                                                                 "cudaMemcpy")),
            "launches_per_step": sum(v for k, v in per_step.items()
                                     if k.startswith(("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchCooperative"))),
            "graph_launches_per_step": per_step.get("cudaGraphLaunch", 0), "api_calls_per_step": per_step}
