"""The tables and the plot of `bench_e2e`'s result (its JSON layout: meta, decode rows, prefill rows)."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path


def fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def print_tables(result: dict) -> None:
    meta = result["meta"]
    print(f"\n{meta['size']} ({meta['params_b']:.2f}B parameters, {meta['weights_gb']:.1f} GB), {meta['dtype']} "
          f"on {meta['device_name']}; copy {meta['copy_gb_s']:.0f} GB/s, matmul {meta['matmul_tflop_s']:.1f} TFLOP/s "
          f"measured; {meta['prompt_len']}-token prompts, medians of {meta['repeats']} x {meta['steps']} steps")
    if result["decode"]:
        print("| batch | backend | tok/s | step ms | GPU ms/step | GPU busy (profiled / timed) | syncs/step | "
              "launches / kernels per step | graph launches/step | GB/step | roofline tok/s (bytes / +FLOPs) | "
              "of roofline (bytes / +FLOPs) |")
        print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in sorted(result["decode"], key=lambda r: r["backend"] == "transformers"):  # stable: engines first
        if r.get("skipped"):
            print(f"| {r['batch']} | {r['backend']} | skipped: {r['skipped']} |" + " |" * 9)
            continue
        g = r.get
        print(f"| {r['batch']} | {r['backend']} | {r['tok_s']:.0f} | {r['step_ms']:.2f} | "
              f"{fmt(g('gpu_ms_per_step'), '.2f')} | {fmt(g('gpu_busy'), '.0%')} / {fmt(g('gpu_busy_timed'), '.0%')} | "
              f"{fmt(g('syncs_per_step'), '.0f')} | "
              f"{fmt(g('launches_per_step'), '.0f')} / {fmt(g('kernels_per_step'), '.0f')} | "
              f"{fmt(g('graph_launches_per_step'), '.0f')} | {fmt(g('gb_per_step'), '.2f')} | "
              f"{fmt(g('roofline_bytes_tok_s'), '.0f')} / {fmt(g('roofline_tok_s'), '.0f')} | "
              f"{fmt(g('of_roofline_bytes'), '.0%')} / {fmt(g('of_roofline'), '.0%')} |")
    for r in result["decode"]:
        if r["backend"].endswith("-async") and "overlapped_share" in r:
            print(f"{r['backend']} batch {r['batch']}: {r['overlapped_share']:.0%} of the timed steps overlapped")
    for r in result["decode"]:
        if r.get("gpu_ms_by_step"):  # ReplaySSM's flush steps stand out here
            by_step = " ".join(f"{ms:.2f}" for ms in r["gpu_ms_by_step"])
            print(f"GPU ms by step, {r['backend']} batch {r['batch']}: {by_step}")
    for r in result["decode"]:
        if r.get("top_kernels_ms"):
            top = ", ".join(f"{name} {ms:.3f}" for name, ms in r["top_kernels_ms"].items())
            print(f"top kernels, {r['backend']} batch {r['batch']} (ms/step): {top}")
    if result["prefill"]:
        print("\n| backend | prefill | tokens/s | MFU | TTFT ms | TTFT tokens/s | TTFT MFU |")
        print("|---|---|---:|---:|---:|---:|---:|")
    for r in result["prefill"]:
        if r.get("prefill_skipped", "").startswith("refused"):  # the engine refused the backend: no TTFT row either
            print(f"| {r['backend']} | {r['prompts']} x {r['prompt_len']} | {r['prefill_skipped']} |" + " |" * 4)
            continue
        ttft = statistics.median(r["ttft_s"]) if "ttft_s" in r else None
        print(f"| {r['backend']} | {r['prompts']} x {r['prompt_len']} | {fmt(r.get('prefill_tok_s'), '.0f')} | "
              f"{fmt(r.get('prefill_mfu'), '.1%')} | {fmt(ttft, '.1f', 1e3)} ({r['ttft_len']} tokens) | "
              f"{fmt(r.get('ttft_tok_s'), '.0f')} | {fmt(r.get('ttft_mfu'), '.1%')} |")


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: {path.name} not written (pip install matplotlib)", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    rows = [r for r in result["decode"] if "tok_s" in r]
    for backend in dict.fromkeys(r["backend"] for r in rows):
        mine = [r for r in rows if r["backend"] == backend]
        line = ax.plot([r["batch"] for r in mine], [r["tok_s"] for r in mine], marker="o", label=backend)[0]
        if "roofline_tok_s" in mine[0]:
            ax.plot([r["batch"] for r in mine], [r["roofline_tok_s"] for r in mine], linestyle="--",
                    color=line.get_color(), label=f"{backend} roofline")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch (decode rows)")
    ax.set_ylabel("decode tokens/s")
    meta = result["meta"]
    ax.set_title(f"{meta['size']}, {meta['dtype']}, {meta['device_name']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
