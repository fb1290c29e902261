"""One Mamba2 layer decode step, Nemotron-H-8B geometry (H=128, P=64, N=128, G=8), on CUDA.

Variants: our baseline ``selective_state_update_triton``; ReplaySSM (window W, T = 1) timed as the
mean over full flush cycles of prepare + step + commit with staggered slots (1/W of rows flush per
step); mamba-ssm's ``selective_state_update`` when importable (put its sources on PYTHONPATH).
State fp32, activations bf16, a pool of exactly ``batch`` slots with permuted indices. Small pools
are rotated across several copies so the state does not sit in L2. Each variant is first checked
against our float64 reference on a small batch.

    python benchmarks/bench_ssm_decode.py [--batch 1 8 32 128 256 512] [--window 16] [--out r.json]
        [--candidate scratch/variant.py ...]   # kernels under development, checked then timed alongside
        [--flush-shares]                       # the step with no, all and 1/W of the rows flushing
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import sys
import types
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from replayserve.ops import replay_ssm as rref  # noqa: E402
from replayserve.ops import replay_ssm_triton as rtk  # noqa: E402
from replayserve.ops import ssu_triton  # noqa: E402
from replayserve.ops.ssu import selective_state_update_ref  # noqa: E402

H, P, N, G = 128, 64, 128, 8
ACT, STATE = torch.bfloat16, torch.float32
ROTATE_BYTES = 512 << 20  # state bytes touched per timed cycle, well past the 60 MB L2
STATE_BYTES = H * P * N * 4
INPUT_BYTES = 2 * (2 * H * P + H + 2 * G * N)  # x, dt, B, C in and y out, bf16
Step = Callable[[], object]


def import_mamba_ssu() -> Callable[..., torch.Tensor] | None:
    """mamba-ssm's ``selective_state_update``, importing only its Triton module, or None."""
    try:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
        return selective_state_update
    except Exception:  # noqa: BLE001 - CUDA extensions or transformers missing: try the bare module
        pass
    try:
        spec = importlib.util.find_spec("mamba_ssm")
        if spec is None or not spec.submodule_search_locations:
            print("mamba-ssm not found: put its sources on PYTHONPATH to compare against it", file=sys.stderr)
            return None
        root = spec.submodule_search_locations[0]
        # Skip mamba_ssm/__init__, which imports CUDA extensions; the Triton kernel needs none of them.
        for name, sub in (("mamba_ssm", ""), ("mamba_ssm.ops", "ops"), ("mamba_ssm.ops.triton", "ops/triton")):
            package = types.ModuleType(name)
            package.__path__ = [os.path.join(root, sub)]
            sys.modules[name] = package
        if importlib.util.find_spec("einops") is None:  # used only by mamba-ssm's reference
            sys.modules["einops"] = types.SimpleNamespace(rearrange=None, repeat=None)  # type: ignore[assignment]
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
        return selective_state_update
    except Exception as e:  # noqa: BLE001
        print(f"mamba-ssm not usable: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def params(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {"A": -torch.exp(torch.rand(H, generator=gen) * 2.0).cuda(), "D": torch.randn(H, generator=gen).cuda(),
            "dt_bias": (torch.rand(H, generator=gen) - 4.0).cuda()}


def inputs(batch: int, tokens: int | None, gen: torch.Generator) -> dict[str, torch.Tensor]:
    lead = (batch,) if tokens is None else (batch, tokens)
    return {"x": torch.randn(*lead, H, P, generator=gen).to(ACT).cuda(),
            "dt": torch.randn(*lead, H, generator=gen).to(ACT).cuda(),
            "B": torch.randn(*lead, G, N, generator=gen).to(ACT).cuda(),
            "C": torch.randn(*lead, G, N, generator=gen).to(ACT).cuda()}


def time_cycle(cycle: list[Step], graph: bool, reps: int = 15) -> float:
    """Median over reps of the mean time per step (us) of passes over ``cycle`` (>= 16 steps a rep)."""
    cycle = cycle * math.ceil(16 / len(cycle))
    for _ in range(2):
        for f in cycle:
            f()
    run: Step
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for f in cycle:
                f()
        run = g.replay
    else:
        def run() -> None:
            for f in cycle:
                f()
    run()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(cycle))
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Device-to-device copy of 2 GiB, bytes read + written per second (GB/s)."""
    x = torch.empty(1 << 29, dtype=torch.float32, device="cuda").normal_()
    y = torch.empty_like(x)
    us = time_cycle([lambda: y.copy_(x)], graph=False, reps=10)
    return 2 * x.numel() * 4 / us / 1e3


def ssu_call(fn: Callable[..., torch.Tensor], mamba: bool, state: torch.Tensor, idx: torch.Tensor,
             inp: dict[str, torch.Tensor], p: dict[str, torch.Tensor]) -> Step:
    """One step of our baseline or of mamba-ssm (tied per-head scalars, as its Mamba2 decode passes them)."""
    if not mamba:
        return lambda: fn(state, inp["x"], inp["dt"], p["A"], inp["B"], inp["C"], p["D"], p["dt_bias"],
                          state_indices=idx)
    batch = idx.shape[0]
    dt, A = inp["dt"][..., None].expand(batch, H, P), p["A"][:, None, None].expand(H, P, N)
    D, bias = p["D"][:, None].expand(H, P), p["dt_bias"][:, None].expand(H, P)
    return lambda: fn(state, inp["x"], dt, A, inp["B"], inp["C"], D, dt_bias=bias, dt_softplus=True,
                      state_batch_indices=idx)


def ssu_steps(batch: int, fn: Callable[..., torch.Tensor], mamba: bool, gen: torch.Generator) -> list[Step]:
    """One step per rotated pool of ``batch`` slots, permuted indices, shared inputs."""
    sets = max(1, math.ceil(ROTATE_BYTES / (batch * STATE_BYTES)))
    p, inp = params(gen), inputs(batch, None, gen)
    return [ssu_call(fn, mamba, torch.randn(batch, H, P, N, device="cuda", dtype=STATE) * 0.1,
                     torch.randperm(batch, generator=gen).cuda(), inp, p) for _ in range(sets)]


def replay_pool(batch: int, window: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A pool in the T = 1 steady state: history 1..W staggered over slots, random ring origins."""
    R = window + 1
    pool = {"state": torch.randn(batch, H, P, N, device="cuda", dtype=STATE) * 0.1,
            "x_ring": torch.randn(batch, H, R, P, device="cuda").to(ACT),
            "dt_ring": torch.rand(batch, H, R, device="cuda", dtype=STATE) * 0.1,
            "B_ring": torch.randn(batch, G, R, N, device="cuda").to(ACT),
            "ring_start": torch.randint(0, R, (batch,), generator=gen, dtype=torch.int32).cuda(),
            "history": (torch.randperm(batch, generator=gen) % window + 1).to(torch.int32).cuda(),
            "is_flush": torch.zeros(batch, dtype=torch.bool, device="cuda")}
    pool["slots"] = torch.randperm(batch, generator=gen).cuda()
    return pool


def replay_steps(batch: int, window: int, gen: torch.Generator, layers: int = 1,
                 kernels: types.ModuleType = rtk) -> list[Step]:
    """W steps on each rotated pool (a whole flush cycle of every slot), each step one prepare, the
    step of ``layers`` Mamba layers sharing the cursors, and one commit; one list entry per layer step."""
    sets = max(1, math.ceil(ROTATE_BYTES / (batch * layers * STATE_BYTES)))
    p, inp = params(gen), inputs(batch, 1, gen)
    ones = torch.ones(batch, dtype=torch.int32, device="cuda")
    fresh = torch.zeros(batch, dtype=torch.bool, device="cuda")
    pools = [[replay_pool(batch, window, gen) for _ in range(layers)] for _ in range(sets)]
    for stack in pools:  # one cache group: every layer sees the first layer's cursors
        for q in stack[1:]:
            q.update({k: stack[0][k] for k in ("ring_start", "history", "is_flush", "slots")})

    def step(stack: list[dict[str, torch.Tensor]]) -> None:
        cursors = tuple(stack[0][k] for k in ("ring_start", "history", "is_flush", "slots"))
        kernels.replay_prepare_triton(*cursors, ones, fresh, window)
        for q in stack:
            kernels.replay_step_triton(q["state"], q["x_ring"], q["dt_ring"], q["B_ring"], *cursors, ones,
                                       inp["x"], inp["dt"], p["A"], inp["B"], inp["C"], p["D"], p["dt_bias"])
        kernels.replay_commit_triton(*cursors, ones, window + 1)

    noop: Step = lambda: None  # noqa: E731 - pads the cycle so that its length counts layer steps
    return [f for _ in range(window) for stack in pools for f in [lambda st=stack: step(st)] + [noop] * (layers - 1)]


def check_ssu(fn: Callable[..., torch.Tensor], mamba: bool, gen: torch.Generator) -> float:
    """Max relative error of y and state after one step of 4 rows in a pool of 8 (bf16 inputs, fp32 state)."""
    p, inp = params(gen), inputs(4, None, gen)
    state = torch.randn(8, H, P, N, device="cuda", dtype=STATE) * 0.1
    idx = torch.randperm(8, generator=gen)[:4].cuda()
    ref_state = state.double()
    y_ref = selective_state_update_ref(ref_state, *(inp[k].double() for k in ("x", "dt")), p["A"].double(),
                                       inp["B"].double(), inp["C"].double(), p["D"].double(), p["dt_bias"].double(),
                                       True, (0.0, math.inf), idx)
    y = ssu_call(fn, mamba, state, idx, inp, p)()
    return max(((y.double() - y_ref).abs().max() / y_ref.abs().max()).item(),
               ((state.double() - ref_state).abs().max() / ref_state.abs().max()).item())


def check_replay(window: int, gen: torch.Generator, kernels: types.ModuleType = rtk) -> float:
    """Max relative error of outputs and checkpoints over 2W + 3 steps at batch 4 against the float64 refs."""
    pool = replay_pool(4, window, gen)
    mirror = {k: (v.double() if v.is_floating_point() else v.clone()) for k, v in pool.items()}
    p = params(gen)
    ones = torch.ones(4, dtype=torch.int32, device="cuda")
    fresh = torch.zeros(4, dtype=torch.bool, device="cuda")
    err = 0.0
    names = ("state", "x_ring", "dt_ring", "B_ring", "ring_start", "history", "is_flush", "slots")
    for _ in range(2 * window + 3):
        inp = inputs(4, 1, gen)
        ours, ref = [pool[k] for k in names], [mirror[k] for k in names]
        kernels.replay_prepare_triton(*ours[4:], ones, fresh, window)
        rref.replay_prepare_ref(*ref[4:], ones, fresh, window)
        y = kernels.replay_step_triton(*ours, ones, inp["x"], inp["dt"], p["A"], inp["B"], inp["C"], p["D"],
                                       p["dt_bias"])
        y_ref = rref.replay_step_ref(*ref, ones, *(inp[k].double() for k in ("x", "dt")), p["A"].double(),
                                     inp["B"].double(), inp["C"].double(), p["D"].double(), p["dt_bias"].double())
        kernels.replay_commit_triton(*ours[4:], ones, window + 1)
        rref.replay_commit_ref(*ref[4:], ones, window + 1)
        if not all(torch.equal(pool[k], mirror[k]) for k in names[4:]):
            return math.inf
        err = max(err, ((y.double() - y_ref).abs().max() / y_ref.abs().max()).item(),
                  ((pool["state"].double() - mirror["state"]).abs().max() / mirror["state"].abs().max()).item())
    return err


def measure(batch: int, window: int, layers: int, graph: bool, mamba: Callable[..., torch.Tensor] | None,
            copy_gbs: float, gen: torch.Generator,
            candidates: dict[str, types.ModuleType] | None = None) -> list[dict[str, float | int | str]]:
    replay = f"replay W={window}" + (f" ({layers} layers)" if layers > 1 else "")
    entry = H * P * 2 + G * N * 2 + H * 4  # one ring entry: x, B (bf16) and delta (fp32)
    mean_history = (window + 1) / 2  # T = 1 steady state: history cycles through 1..W
    model = {"ours": 2 * STATE_BYTES + INPUT_BYTES, "mamba-ssm": 2 * STATE_BYTES + INPUT_BYTES,
             replay: STATE_BYTES * (1 + 1 / window) + entry * (mean_history + 1) + INPUT_BYTES}
    variants: dict[str, list[Step]] = {"ours": ssu_steps(batch, ssu_triton.selective_state_update_triton, False, gen),
                                       replay: replay_steps(batch, window, gen, layers)}
    if mamba is not None:
        variants["mamba-ssm"] = ssu_steps(batch, mamba, True, gen)
    for name, module in (candidates or {}).items():  # kernels under development, same bytes as replay
        variants[name] = replay_steps(batch, window, gen, layers, module)
        model[name] = model[replay]
    records = []
    for name, cycle in variants.items():
        us = time_cycle(cycle, graph)
        gbs = model[name] * batch / us / 1e3
        records.append({"batch": batch, "variant": name, "us": us, "mb": model[name] * batch / 1e6,
                        "gbs": gbs, "copy_frac": gbs / copy_gbs})
    torch.cuda.empty_cache()
    base = {r["variant"]: r["us"] for r in records}
    for r in records:
        r["speedup_vs_ours"] = base["ours"] / r["us"]
        if "mamba-ssm" in base:
            r["speedup_vs_mamba"] = base["mamba-ssm"] / r["us"]
    return records


def sweep(batch: int, window: int, gen: torch.Generator) -> None:
    """Time (BLOCK_P, num_warps) launch configs of both kernels at one batch (for retuning the defaults)."""
    ssu_default, step_default = ssu_triton._launch_config, rtk._step_config
    print(f"\nsweep at batch {batch}: us/step")
    for bp, nw in [(4, 4), (8, 4), (16, 4), (16, 8), (32, 4), (32, 8), (64, 4), (64, 8)]:
        ssu_triton._launch_config = lambda *_, bp=bp, nw=nw: (bp, nw)
        rtk._step_config = lambda *_, bp=bp, nw=nw: {"BLOCK_P": bp, "num_warps": nw}
        ours = time_cycle(ssu_steps(batch, ssu_triton.selective_state_update_triton, False, gen), False)
        rep = time_cycle(replay_steps(batch, window, gen), False)
        print(f"BLOCK_P={bp:3d} warps={nw}: ours {ours:8.1f}  replay {rep:8.1f}")
        torch.cuda.empty_cache()
    ssu_triton._launch_config, rtk._step_config = ssu_default, step_default


def flush_shares(batch: int, window: int, gen: torch.Generator,
                 candidates: dict[str, types.ModuleType] | None = None) -> list[dict[str, float | int | str]]:
    """The step kernel alone (scores + step, no cursor kernels) by the share of rows that flush: none
    (history W/2), all (history W) and the steady state (history 1..W over the rows, 1/W flushing).
    Cursors are not committed, so every replay of the graph runs the same case. Candidates run on the
    same tensors right after the committed kernel, case by case."""
    p, inp, pool = params(gen), inputs(batch, 1, gen), replay_pool(batch, window, gen)
    ones = torch.ones(batch, dtype=torch.int32, device="cuda")
    spread = pool["history"]  # replay_pool's steady state: 1..W over the slots
    cases = {f"none (history {window // 2})": torch.full_like(spread, window // 2),
             f"all (history {window})": torch.full_like(spread, window), f"1/{window} (history 1..{window})": spread}
    modules, records = {"replay": rtk, **(candidates or {})}, []
    print(f"\nstep kernel by flushing rows, batch {batch}, W={window} (us, CUDA graph): {', '.join(modules)}")
    for name, history in cases.items():
        pool["history"], pool["is_flush"] = history, history + 1 > window  # the prepare's rule at T = 1
        times = []
        for variant, module in modules.items():
            def step(q: dict[str, torch.Tensor] = pool, kernels: types.ModuleType = module) -> None:
                # time_cycle captures this case's tensors
                kernels.replay_step_triton(q["state"], q["x_ring"], q["dt_ring"], q["B_ring"], q["ring_start"],
                                           q["history"], q["is_flush"], q["slots"], ones, inp["x"], inp["dt"], p["A"],
                                           inp["B"], inp["C"], p["D"], p["dt_bias"])

            times.append(time_cycle([step], graph=True))
            records.append({"batch": batch, "window": window, "flushing": name, "variant": variant, "us": times[-1]})
        print(f"  {name}: {' / '.join(f'{us:.1f}' for us in times)}")
    torch.cuda.empty_cache()
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128, 256, 512])
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--graph", action="store_true", help="time CUDA-graph replays instead of eager launches")
    parser.add_argument("--layers", type=int, default=1,
                        help="replay: Mamba layers sharing one prepare + commit per step (times are per layer)")
    parser.add_argument("--sweep", type=int, metavar="BATCH", help="also time launch configs at this batch")
    parser.add_argument("--flush-shares", action="store_true",
                        help="also time the replay step with no, all and 1/W of the rows flushing at each batch")
    parser.add_argument("--candidate", type=Path, nargs="+", default=[],
                        help="Python files with the replay_*_triton API: timed beside the committed kernels")
    parser.add_argument("--out", type=Path, help="write the records as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_ssm_decode.py needs a CUDA GPU")
    gen = torch.Generator().manual_seed(0)
    mamba = import_mamba_ssu()
    checks = {"ours": check_ssu(ssu_triton.selective_state_update_triton, False, gen),
              f"replay W={args.window}": check_replay(args.window, gen)}
    if mamba is not None:
        checks["mamba-ssm"] = check_ssu(mamba, True, gen)
    candidates = {}
    for path in args.candidate:
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        spec.loader.exec_module(module)
        candidates[f"candidate {path.stem}"] = module
        checks[f"candidate {path.stem}"] = check_replay(args.window, gen, module)
    for name, err in checks.items():
        print(f"check {name}: max relative error {err:.2e} against the float64 reference")
        if not err < 2e-2:
            sys.exit(f"{name} disagrees with the reference (relative error {err:.2e})")
    copy_gbs = copy_bandwidth()
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write); {torch.cuda.get_device_name()}")
    records = [r for batch in args.batch for r in measure(batch, args.window, args.layers, args.graph, mamba,
                                                                copy_gbs, gen, candidates)]
    mode = "CUDA graph" if args.graph else "eager"
    print(f"\n| batch | variant | us/step ({mode}) | MB/step (model) | GB/s | of copy BW | vs ours | vs mamba-ssm |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in records:
        vs_mamba = f"{r['speedup_vs_mamba']:.2f}x" if "speedup_vs_mamba" in r else "-"
        print(f"| {r['batch']} | {r['variant']} | {r['us']:.1f} | {r['mb']:.1f} | {r['gbs']:.0f} | "
              f"{r['copy_frac']:.0%} | {r['speedup_vs_ours']:.2f}x | {vs_mamba} |")
    shares = [r for batch in args.batch for r in flush_shares(batch, args.window, gen, candidates)] \
        if args.flush_shares else []
    if args.sweep:
        sweep(args.sweep, args.window, gen)
    if args.out:
        meta = {"device": torch.cuda.get_device_name(), "copy_gbs": copy_gbs, "mode": mode, "window": args.window,
                "layers": args.layers,
                "geometry": {"H": H, "P": P, "N": N, "G": G}, "checks": checks}
        args.out.write_text(json.dumps({"meta": meta, "records": records, "flush_shares": shares}, indent=2))


if __name__ == "__main__":
    main()
