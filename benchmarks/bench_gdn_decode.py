"""One Gated DeltaNet layer's decode step, Qwen3.5-9B geometry (16 key heads, 32 value heads, K = V = 128),
bf16 activations and fp32 state, side by side at each batch:

- ours: ``gated_delta_step`` (the Triton kernel on CUDA, the reference elsewhere) on a pool of exactly
  `batch` slots with permuted indices, in place;
- fla: flash-linear-attention's ``fused_recurrent_gated_delta_rule`` (fla-core 0.6.0, CUDA only), the
  rows' states in, their final states out (a new tensor each call: the same bytes as in place);
- replay read: ``replay_gdn_step`` (T = 1, window W) with a typical ring fill, the rows' histories spread
  over 1..W as in the steady state (a row's history cycles through 1..W and it flushes at W), none
  flushing here: the checkpoint read once (with the new token's q and k), the history's stored
  corrections (delta) summed, the token's (k, delta, g) appended; it includes the launch of the flush
  kernel, whose programs all leave at once here;
- flush: the fold of W ring entries into every row's checkpoint (``replay_gdn_materialize`` with
  src = dst, what a flush step runs for its rows);
- replay: read + flush / W, the steady state per step estimated (each row flushes once every W steps;
  on its flush step the read replays the same W + 1 entries, so the fold is the only extra work);
- replay step: the steady state measured: ``replay_gdn_step`` as the engine runs it, with the rows
  whose history is W (one in W) flushing in the step's flush kernel. This is the row to hold
  against ours.

us per call (CUDA events; ``--graph`` times CUDA-graph replays, as the engine runs decode), GB/s of a
bytes model (below) against the device-to-device copy bandwidth measured as ``bench_e2e`` does
(``roofline.measure_rates``), and the speed-up over fla. Small pools are rotated over several copies
so the state does not sit in L2. Before timing, every variant runs on the same rows (batch 4) and
its outputs are compared with a float64 reference and with ours: the max abs differences are printed
and a variant that disagrees stops the run.

Bytes per row (state S = Hv K V fp32, entry = k (Hk K) bf16 + delta (Hv V) and g (Hv) fp32; inputs are
q, k, v, g, beta in and o out): ours and fla 2 S + inputs; replay read S + (mean history + 1) entries +
inputs; flush 2 S + W entries (the mean history is (W + 1) / 2, as ``roofline`` counts it). The bytes
per row and step of each path, and their ratio to ours, are printed before the table.

    python benchmarks/bench_gdn_decode.py --graph [--batch 1 8 64 256 512] [--window 31] [--out r.json]
    python benchmarks/bench_gdn_decode.py --device cpu --batch 1 2 --iters 2   # the references, seconds
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from roofline import measure_rates  # noqa: E402

from replayserve.ops.gated_delta import (  # noqa: E402
    expand_key_heads,
    gated_delta_recurrent_ref,
    gated_delta_step,
    gated_delta_step_ref,
    l2norm_ref,
)
from replayserve.ops.replay_gdn import replay_gdn_materialize, replay_gdn_step  # noqa: E402
from replayserve.ops.replay_gdn_triton import replay_gdn_step_triton  # noqa: E402

HK, HV, DK, DV = 16, 32, 128, 128  # Qwen3.5-9B's GDN layer (and Qwen3.5-35B-A3B's, Qwen3-Next's)
ACT, STATE = torch.bfloat16, torch.float32
STATE_BYTES = HV * DK * DV * 4
ENTRY_BYTES = HK * DK * 2 + HV * DV * 4 + HV * 4  # k bf16, delta and g fp32
INPUT_BYTES = (2 * HK * DK + 2 * HV * DV) * 2 + 2 * HV * 4
ROTATE_BYTES = 512 << 20  # state bytes a timed pass touches on CUDA, well past the 50 MB L2
Call = Callable[[], object]


def import_fla() -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    except ImportError as e:
        print(f"fla not importable ({e}): its column is left out (pip install fla-core==0.6.0)", file=sys.stderr)
        return None
    return fused_recurrent_gated_delta_rule


def token(batch: int, device: str, gen: torch.Generator, tokens: int | None = None) -> dict[str, torch.Tensor]:
    """One decode token per row as the layer feeds it: q, k raw (the step L2-normalizes them), v, and
    g (log decay, <= 0) and beta in (0, 1) in fp32. Shapes (B, H, D), or (B, T, H, D) with `tokens`."""
    lead = (batch,) if tokens is None else (batch, tokens)
    x = {"q": torch.randn(*lead, HK, DK, generator=gen), "k": torch.randn(*lead, HK, DK, generator=gen),
         "v": torch.randn(*lead, HV, DV, generator=gen), "g": -torch.rand(*lead, HV, generator=gen) * 0.3,
         "beta": torch.rand(*lead, HV, generator=gen)}
    return {n: t.to(device, ACT if n in "qkv" else STATE) for n, t in x.items()}


def replay_pool(batch: int, window: int, device: str, gen: torch.Generator,
                history: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """A ReplaySSM-GDN pool of `batch` slots with random rings and origins; histories spread over
    1..W (the steady state) unless given; nothing flushing; rows on permuted slots. The large tensors
    are drawn on the device (torch's seeded generator there: a GiB of state drawn on the host takes
    seconds), the cursors with `gen`. The random corrections are not a recurrence's: enough for
    timing; ``consistent_history`` makes them one for the check."""
    ring = window + 1
    pool = {"state": torch.randn(batch, HV, DK, DV, device=device) * 0.1,
            "k_ring": torch.randn(batch, HK, ring, DK, device=device).to(ACT),
            "delta_ring": torch.randn(batch, HV, ring, DV, device=device) * 0.1,
            "g_ring": -torch.rand(batch, HV, ring, device=device) * 0.3,
            "ring_start": torch.randint(0, ring, (batch,), generator=gen, dtype=torch.int32),
            "history": (torch.randperm(batch, generator=gen) % window + 1).to(torch.int32) if history is None
            else history,
            "is_flush": torch.zeros(batch, dtype=torch.bool), "slots": torch.randperm(batch, generator=gen)}
    return {n: t.to(device) for n, t in pool.items()}


RINGS = ("state", "k_ring", "delta_ring", "g_ring")


def consistent_history(pool: dict[str, torch.Tensor], gen: torch.Generator) -> list[torch.Tensor]:
    """Rewrites each slot's ring history as `history` random tokens (k, v, g, beta) run from its
    checkpoint, their corrections delta computed token by token in float64; returns the float64
    state each slot reaches, by ``gated_delta_recurrent_ref`` (independent of the rings' delta form)."""
    ring = pool["g_ring"].shape[2]
    reached = []
    for s in range(pool["state"].shape[0]):
        m, start = int(pool["history"][s]), int(pool["ring_start"][s])
        x = token(m, "cpu", gen)
        k = x["k"].to(pool["k_ring"].device)
        state = pool["state"][s].double()
        for j in range(m):  # delta_j = beta_j (v_j - (exp(g_j) S)^T k_j), then S += k_j delta_j^T
            kj = l2norm_ref(expand_key_heads(k[j].double(), HV))
            state = torch.exp(x["g"][j].double().to(state.device))[:, None, None] * state
            delta = x["beta"][j].double().to(state.device)[:, None] * (
                x["v"][j].double().to(state.device) - torch.einsum("hkv,hk->hv", state, kj))
            p = (start + j) % ring
            pool["k_ring"][s, :, p], pool["g_ring"][s, :, p] = k[j], x["g"][j].to(state.device)
            pool["delta_ring"][s, :, p] = delta.to(pool["delta_ring"].dtype)
            state = state + kj[:, :, None] * pool["delta_ring"][s, :, p].double()[:, None, :]
        ref = pool["state"][s : s + 1].double()
        if m:
            inputs = [t[None].double().to(ref.device) for t in (x["k"], k, x["v"], x["g"], x["beta"])]
            ref = gated_delta_recurrent_ref(*inputs, ref, use_qk_l2norm=True)[1]
        reached.append(ref[0])
    return reached


def read_call(pool: dict[str, torch.Tensor], x: dict[str, torch.Tensor], block_v: int | None = None,
              split_decode: bool = True) -> Call:
    """The engine's entry point, or with `block_v` the Triton step at that many state columns per program
    (split_decode False: the fused one-kernel read instead of the coefficients + tiles pair)."""
    rows = pool["slots"].shape[0]
    ones = torch.ones(rows, dtype=torch.int32, device=pool["slots"].device)
    args = (*(pool[n] for n in RINGS), pool["ring_start"], pool["history"], pool["is_flush"], pool["slots"], ones,
            x["q"][:, None], x["k"][:, None], x["v"][:, None], x["g"][:, None], x["beta"][:, None])
    if block_v is None and split_decode:
        return lambda: replay_gdn_step(*args, use_qk_l2norm=True)
    return lambda: replay_gdn_step_triton(*args, use_qk_l2norm=True, block_v=block_v, split_decode=split_decode)


def flush_call(pool: dict[str, torch.Tensor]) -> Call:
    slots = pool["slots"]
    start, n = pool["ring_start"][slots], pool["history"][slots]
    return lambda: replay_gdn_materialize(*(pool[n] for n in RINGS), slots, slots, start, n, use_qk_l2norm=True)


def fla_call(fla: Callable, state: torch.Tensor, x: dict[str, torch.Tensor]) -> Call:
    q, k, v, g, beta = (x[n][:, None] for n in ("q", "k", "v", "g", "beta"))  # (B, T=1, ...)
    # By keyword: fla's positional arguments after g are the per-channel decays gk and gv.
    return lambda: fla(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                       use_qk_l2norm_in_kernel=True)


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).abs().max() / ref.abs().max()).item()


def check(window: int, device: str, fla: Callable | None, gen: torch.Generator) -> dict[str, dict[str, float]]:
    """Every variant on the same 4 rows, whose histories are 0, W/3, 2W/3 and W ring entries: the
    max abs difference of its output o (and of the state it writes) from the float64 reference and
    from ours, and the relative error. The baseline rows start from the state the replay rows'
    checkpoint and history reach (computed token by token in float64)."""
    batch = 4
    history = torch.tensor([0, window // 3, 2 * window // 3, window], dtype=torch.int32)
    pool = replay_pool(batch, window, device, gen, history)
    reached = consistent_history(pool, gen)  # the state after each slot's history, float64
    x = token(batch, device, gen)
    slots = pool["slots"]
    ref_pool = torch.stack(reached)
    o_ref = gated_delta_step_ref(ref_pool, *(x[n].double() for n in ("q", "k", "v", "g", "beta")), slots,
                                 use_qk_l2norm=True)
    after_ref = ref_pool[slots]
    outs: dict[str, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = {}
    ours_pool = torch.stack(reached).float()
    outs["ours"] = (gated_delta_step(ours_pool, *(x[n] for n in ("q", "k", "v", "g", "beta")), slots,
                                     use_qk_l2norm=True), ours_pool[slots], after_ref)
    if fla is not None:
        o, final = fla_call(fla, torch.stack(reached)[slots].float().contiguous(), x)()
        outs["fla"] = (o[:, 0], final, after_ref)
    outs["replay read"] = (read_call(pool, x)()[:, 0], None, None)
    flushed = {n: t.clone() for n, t in pool.items()}
    flush_call(flushed)()
    outs["flush"] = (None, flushed["state"][slots], torch.stack(reached)[slots])
    result = {}
    for name, (o, state, state_ref) in outs.items():
        r: dict[str, float] = {}
        if o is not None:
            r |= {"o_abs_vs_ref64": (o.double() - o_ref).abs().max().item(), "o_rel_vs_ref64": rel(o, o_ref),
                  "o_abs_vs_ours": (o.double() - outs["ours"][0].double()).abs().max().item()}
        if state is not None:
            r |= {"state_abs_vs_ref64": (state.double() - state_ref).abs().max().item(),
                  "state_rel_vs_ref64": rel(state, state_ref)}
        result[name] = r
    return result


def time_calls(calls: list[Call], device: str, graph: bool, iters: int) -> float:
    """Median over `iters` of the mean us per call of one pass over `calls` (each call once); with `graph`
    a CUDA graph of the pass is replayed, or, where capture fails, the pass runs eagerly (said on stderr)."""
    for f in calls:  # compile, warm up
        f()

    def run() -> None:
        for f in calls:
            f()

    if graph and device.startswith("cuda"):
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g):
                run()
            run = g.replay  # type: ignore[assignment]
        except RuntimeError as e:  # one variant that cannot be captured must not lose the others
            print(f"CUDA graph capture failed ({str(e)[:200]}): timed eagerly", file=sys.stderr)
            torch.cuda.synchronize()
    run()
    times = []
    for _ in range(iters):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / len(calls))
        else:
            t0 = time.perf_counter()
            run()
            times.append((time.perf_counter() - t0) * 1e6 / len(calls))
    return statistics.median(times)


def measure(batch: int, args: argparse.Namespace, fla: Callable | None, gen: torch.Generator) -> dict[str, float]:
    """us per call of each variant at `batch`; each variant's pools are freed before the next is built."""
    device = args.device
    sets = max(1, math.ceil(ROTATE_BYTES / (batch * STATE_BYTES))) if device.startswith("cuda") else 1
    x = token(batch, device, gen)
    us: dict[str, float] = {}
    pools = [torch.randn(batch, HV, DK, DV, device=device) * 0.1 for _ in range(sets)]
    idx = torch.randperm(batch, generator=gen).to(device)
    us["ours"] = time_calls([lambda p=p: gated_delta_step(p, x["q"], x["k"], x["v"], x["g"], x["beta"], idx,
                                                          use_qk_l2norm=True) for p in pools],
                            device, args.graph, args.iters)
    if fla is not None:
        us["fla"] = time_calls([fla_call(fla, p, x) for p in pools], device, args.graph, args.iters)
    del pools
    replay = [replay_pool(batch, args.window, device, gen) for _ in range(sets)]
    us["replay read"] = time_calls([read_call(p, x) for p in replay], device, args.graph, args.iters)
    if device.startswith("cuda"):
        us["replay read, fused"] = time_calls([read_call(p, x, split_decode=False) for p in replay], device,
                                              args.graph, args.iters)
    for block_v in args.block_v:  # the read's columns per program, swept (both read paths)
        us[f"replay read, block_v {block_v}"] = time_calls([read_call(p, x, block_v) for p in replay], device,
                                                           args.graph, args.iters)
        if device.startswith("cuda"):
            us[f"replay read, fused, block_v {block_v}"] = time_calls(
                [read_call(p, x, block_v, split_decode=False) for p in replay], device, args.graph, args.iters)
    for p in replay:  # the steady state: the rows at history W (one in W) flush, as replay_prepare sets them
        p["is_flush"].copy_(p["history"] == args.window)
    us["replay step"] = time_calls([read_call(p, x) for p in replay], device, args.graph, args.iters)
    for p in replay:  # every row flushes its full window
        p["is_flush"].zero_()
        p["history"].fill_(args.window)
    us["flush"] = time_calls([flush_call(p) for p in replay], device, args.graph, args.iters)
    del replay
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    us["replay"] = us["replay read"] + us["flush"] / args.window
    return us


def bytes_per_row(window: int) -> dict[str, float]:
    read = STATE_BYTES + ((window + 1) / 2 + 1) * ENTRY_BYTES + INPUT_BYTES  # mean history (W + 1) / 2
    flush = 2 * STATE_BYTES + window * ENTRY_BYTES
    return {"ours": 2 * STATE_BYTES + INPUT_BYTES, "fla": 2 * STATE_BYTES + INPUT_BYTES, "replay read": read,
            "flush": flush, "replay": read + flush / window, "replay step": read + flush / window}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 256, 512])
    p.add_argument("--window", type=int, default=31,
                   help="ReplaySSM window W: the engine's default for GDN plain decode (R = W + 1 = 32)")
    p.add_argument("--iters", type=int, default=20, help="timed passes per variant; the median is reported")
    p.add_argument("--graph", action="store_true", help="time CUDA-graph replays (CUDA only)")
    p.add_argument("--block-v", type=int, nargs="*", default=[],
                   help="also time the ReplaySSM read kernel at these state columns per program (16, 32, 64, 128)")
    p.add_argument("--out", type=Path, help="write the result as JSON here")
    args = p.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    fla = import_fla() if args.device.startswith("cuda") else None
    checks = check(args.window, args.device, fla, gen)
    print("check at batch 4 (histories 0, W/3, 2W/3, W), max abs difference from the float64 reference / ours:")
    for name, r in checks.items():
        parts = [f"o {r['o_abs_vs_ref64']:.2e} / {r['o_abs_vs_ours']:.2e} (rel {r['o_rel_vs_ref64']:.1e})"
                 if "o_abs_vs_ref64" in r else "",
                 f"state {r['state_abs_vs_ref64']:.2e} (rel {r['state_rel_vs_ref64']:.1e})"
                 if "state_abs_vs_ref64" in r else ""]
        print(f"  {name}: {'; '.join(s for s in parts if s)}")
    bad = [n for n, r in checks.items() if not max(v for k, v in r.items() if "rel" in k) < 2e-2]
    if bad:
        raise SystemExit(f"{', '.join(bad)} disagree with the float64 reference: not timed")
    rates = measure_rates(torch.device(args.device), ACT)
    copy_gbs = rates["copy_bytes_per_s"] / 1e9
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"{name}: device-to-device copy {copy_gbs:.0f} GB/s (read + write); window W={args.window}; "
          f"{'CUDA graph' if args.graph and args.device.startswith('cuda') else 'eager'}")
    model = bytes_per_row(args.window)
    print(f"bytes per row and step (model): ours {model['ours'] / 2**20:.3f} MiB; replay {model['replay'] / 2**20:.3f} "
          f"MiB = read {model['replay read'] / 2**20:.3f} + flush {model['flush'] / 2**20:.3f} / W "
          f"({model['ours'] / model['replay']:.2f}x fewer than ours)")
    records = []
    for batch in args.batch:
        us = measure(batch, args, fla, gen)
        for variant, t in us.items():
            bytes_ = model[variant.split(",")[0]]  # a swept read moves the read's bytes
            gbs = bytes_ * batch / t / 1e3
            records.append({"batch": batch, "variant": variant, "us": t, "mb": bytes_ * batch / 1e6,
                            "gbs": gbs, "of_copy": gbs / copy_gbs, "vs_fla": us["fla"] / t if "fla" in us else None,
                            "vs_ours": us["ours"] / t})
        print(f"done batch {batch}", file=sys.stderr, flush=True)
    print("\n| batch | variant | us/call | MB/call (model) | GB/s | of copy BW | speed-up vs ours | speed-up vs fla |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in records:
        vs = "-" if r["vs_fla"] is None else f"{r['vs_fla']:.2f}x"
        print(f"| {r['batch']} | {r['variant']} | {r['us']:.1f} | {r['mb']:.2f} | {r['gbs']:.0f} | "
              f"{r['of_copy']:.0%} | {r['vs_ours']:.2f}x | {vs} |")
    result = {"meta": {"device": name, "copy_gbs": copy_gbs, "window": args.window, "graph": args.graph,
                       "geometry": {"Hk": HK, "Hv": HV, "K": DK, "V": DV}, "checks": checks}, "records": records}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
