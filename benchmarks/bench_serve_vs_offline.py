"""`replayserve serve` against the offline engine on one workload, in one run: output tok/s, time to
first token (TTFT) and inter-token latency (ITL) of each, side by side (issue 38: the server at engine speed).

Workload: `--input-len` random prompt token ids and `--output-len` output tokens per request (exact
with `--range-ratio` 0, the default), greedy, EOS ignored: `bench_serve.make_workload`, a fresh draw
per wave. Each wave runs on the server and then offline with the same prompts, arrival times and cap:
- closed loop at each of `--concurrency-levels` C: max(8, 2C) requests (or `--num-requests`), at most
  C in flight: a client sends its next request when one of its responses ends;
- Poisson arrivals at each `--poisson-fractions` share of the server's peak request throughput (its
  best closed-loop level's requests/s), as many requests as that level, no cap.
`--runs N` runs the highest level N times on the server (the first is the table's row) and counts
failures over all of them. Before the timed waves each side runs one untimed warm-up wave per level
(C requests, C in flight), so compiles and CUDA graph captures fall outside both (`--skip-warmup`: none).

Server: `python -m replayserve serve` in a child process with this command's engine options (one set
for both sides; `--max-num-seqs` defaults to the highest level, not 64), on a free port; loaded by
`bench_serve.drive` once /health answers 200, then stopped with SIGTERM (its exit status is reported:
0 is a clean stop). Offline: `LLM` in this process once the server has exited (the device holds one
engine at a time), each wave stepped by `offline_waves.offline_wave`, whose docstring defines the
offline times: TTFT runs from the send to the end of the `step()` that read the first token back.
A closed-loop follow-up reaches a server while the next step runs, so it waits for that step;
offline queues it before that step unless `--offline-follow-up-steps 1` holds it back one step()
call (`0 1` runs both and prints the second beside the table).
`--size SHAPE` (instead of `--model`) writes a random-weight checkpoint of a benchmark shape
(`shapes.write_checkpoint`, drawn on the device) to `--checkpoint-dir` (default: a temporary directory
under /tmp, removed at the end) that both sides load: nemotron-h-8b is 16 GB of bfloat16 safetensors
(the host needs that much RAM twice over while writing, and the disk once); a directory already holding
the shape is reused.

    python benchmarks/bench_serve_vs_offline.py --size nemotron-h-8b --device cuda --ssm-backend replay \\
        --async-scheduling --input-len 1024 --output-len 128 --runs 10 --offline-follow-up-steps 0 1 \\
        --out serve_vs_offline.json
    python benchmarks/bench_serve_vs_offline.py --device cpu --concurrency-levels 1 2 --input-len 8 --output-len 4
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_serve import arrival_times, drive, make_workload, summarize  # noqa: E402
from offline_waves import offline_wave  # noqa: E402
from shapes import SIZES, write_checkpoint  # noqa: E402

from replayserve.cli import add_engine_options, engine_options  # noqa: E402
from replayserve.config import ModelConfig  # noqa: E402
from replayserve.config.builtin_models import TINY_CODE, resolve_model  # noqa: E402
from replayserve.llm import LLM  # noqa: E402


@dataclass
class Wave:
    name: str
    workload: list[tuple[list[int], int]]  # (prompt ids, output tokens) per request
    in_flight: int | None  # at most this many requests in flight; None: no cap
    rate: float  # Poisson arrivals per second; inf: all at once
    seed: int  # draws the arrival times

    @property
    def arrivals(self) -> list[float]:
        return arrival_times(len(self.workload), self.rate, self.seed)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = p.add_mutually_exclusive_group()
    model.add_argument("--model", default=TINY_CODE, help="a model directory or %(default)s (default)")
    model.add_argument("--size", choices=sorted(SIZES), help="a random-weight model of this benchmark shape")
    p.add_argument("--checkpoint-dir", type=Path, help="where --size writes its checkpoint (default: a temporary one)")
    p.add_argument("--concurrency-levels", type=int, nargs="+", default=[1, 16, 64, 256],
                   help="requests in flight of the closed-loop waves (default %(default)s)")
    p.add_argument("--num-requests", type=int, help="requests per closed-loop wave (default max(8, 2 x level))")
    p.add_argument("--poisson-fractions", type=float, nargs="*", default=[0.5, 0.9],
                   help="Poisson waves at these shares of the peak request throughput (default %(default)s)")
    p.add_argument("--runs", type=int, default=1, help="server runs of the highest level (default %(default)s)")
    p.add_argument("--input-len", type=int, default=1024, help="prompt tokens (default %(default)s)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens (default %(default)s)")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths are uniform in [len*(1-r), len*(1+r)] (default %(default)s)")
    p.add_argument("--offline-follow-up-steps", type=int, nargs="+", default=[0],
                   help="offline, a closed-loop follow-up is queued this many step() calls after the response "
                        "that freed its slot (offline_waves.offline_wave); several values run the offline waves "
                        "once each, the first fills the table (default %(default)s; 1 is when a server sees it)")
    p.add_argument("--skip-warmup", action="store_true", help="no untimed warm-up waves")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default %(default)s)")
    p.add_argument("--startup-timeout", type=float, default=900, help="seconds to /health 200 (default %(default)s)")
    p.add_argument("--request-timeout", type=float, default=600, help="seconds per request (default %(default)s)")
    p.add_argument("--server-log", type=Path, help="the server's output (default: a temporary file, kept)")
    p.add_argument("--out", type=Path, help="also write the results as JSON here")
    add_engine_options(p)
    p.set_defaults(max_num_seqs=None)
    args = p.parse_args(argv)
    for name in ("num_requests", "runs", "input_len", "output_len"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if min(args.concurrency_levels) < 1 or any(f <= 0 for f in args.poisson_fractions):
        p.error("--concurrency-levels must be >= 1 and --poisson-fractions > 0")
    if not 0 <= args.range_ratio < 1:
        p.error(f"--range-ratio must be in [0, 1), got {args.range_ratio}")
    return args


def engine_flags(options: dict[str, Any]) -> list[str]:
    """`replayserve serve` flags for the `LLM` keyword arguments `options` (`cli.engine_options`'s)."""
    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    option_of = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}  # dest -> its flag
    flags: list[str] = []
    for name, value in options.items():
        flag = option_of[name]
        if value is True:
            flags.append(flag)
        elif value is not None and value is not False:
            flags += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return flags


def start_server(model_dir: str, flags: list[str], log_path: Path, timeout: float,
                 env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """`replayserve serve` on a free port, once its /health answers 200; (process, base URL). `env`:
    variables set for it beside this process's."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, **env,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with open(log_path, "w") as log:
        command = [sys.executable, "-m", "replayserve", "serve", "--model", model_dir, "--port", str(port), *flags]
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return proc, url
        except OSError:  # not listening yet (urllib's errors are OSErrors)
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            why = (f"exited with status {proc.returncode}" if proc.poll() is not None
                   else f"did not answer /health 200 within --startup-timeout {timeout:g} s")
            stop_server(proc, 10)
            raise RuntimeError(f"the server {why}; its log {log_path} ends:\n{_tail(log_path)}")
        time.sleep(0.25)


def stop_server(proc: subprocess.Popen, timeout: float) -> int:
    """SIGTERM, then its exit status (killed after `timeout` seconds: -9)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def server_wave(url: str, wave: Wave, timeout: float) -> dict[str, Any]:
    """The wave's summary, with the mean TTFT as the client saw it, as the front end measured it (its
    histogram: from a request's arrival there to its first token there) and as the engine core measured
    it (queued in the core to the step that produced it), and the engine steps the wave took: these
    tell the core's part of a TTFT from the transport's and from the load generator's own lag."""
    before = _server_counters(url)
    results, duration = asyncio.run(drive(url, wave.workload, wave.rate, wave.in_flight, timeout=timeout,
                                          seed=wave.seed))
    after = _server_counters(url)
    delta = {k: after[k] - before[k] for k in after}
    ok = [r.ttft for r in results if r.ok]
    return {**summarize(results, duration), "errors": sorted({r.error for r in results if not r.ok}),
            "ttft_mean_ms": 1000 * sum(ok) / len(ok) if ok else math.nan,
            "server_side_ttft_mean_ms": _mean_ms(delta["ttft_sum"], delta["ttft_count"]),
            "core_ttft_mean_ms": _mean_ms(delta["core_ttft_sum"], delta["core_ttft_count"]),
            "engine_steps": delta["steps"]}


def _mean_ms(total_s: float, count: float) -> float:
    return 1000 * total_s / count if count else math.nan


# The /metrics samples a wave's diagnostics are drawn from (differences before and after it).
_COUNTERS = {"ttft_sum": "replayserve_time_to_first_token_seconds_sum",
             "ttft_count": "replayserve_time_to_first_token_seconds_count",
             "core_ttft_sum": "replayserve_core_time_to_first_token_seconds_total",
             "core_ttft_count": "replayserve_core_time_to_first_token_requests_total",
             "steps": "replayserve_engine_steps_total"}


def _server_counters(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    values = {}
    for key, name in _COUNTERS.items():
        found = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M)
        values[key] = float(found.group(1)) if found else math.nan
    return values


def run_offline(model_dir: str, options: dict[str, Any], warmups: list[Wave], waves: list[Wave],
                follow_up_steps: list[int]) -> list[list[dict]]:
    """Each wave on `LLM(model_dir, **options)` after the warm-ups, once per `follow_up_steps` value;
    its summaries, a list per value."""
    llm = LLM(model=model_dir, **options)
    try:
        for wave in warmups:
            offline_wave(llm.engine, wave.workload, wave.arrivals, wave.in_flight)
        return [_offline_rows(llm, waves, delay) for delay in follow_up_steps]
    finally:
        llm.close()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _offline_rows(llm: LLM, waves: list[Wave], follow_up_steps: int) -> list[dict]:
    rows = []
    for wave in waves:
        steps = llm.engine.num_steps
        results, duration, most = offline_wave(llm.engine, wave.workload, wave.arrivals, wave.in_flight,
                                               follow_up_steps)
        ok = [r.ttft for r in results if r.ok]
        rows.append({**summarize(results, duration), "most_in_flight": most,
                     "errors": sorted({r.error for r in results if not r.ok}),
                     "ttft_mean_ms": 1000 * sum(ok) / len(ok) if ok else math.nan,
                     "engine_steps": llm.engine.num_steps - steps, "follow_up_steps": follow_up_steps})
    return rows


def git_commit() -> str:
    try:
        def git(*a: str) -> str:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        return git("rev-parse", "HEAD") + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git checkout)"


class WaveMaker:
    """Waves of this command's lengths over a model's vocabulary; each wave's prompts are drawn from a
    seed of its own name, so no two waves share a prompt (or a prefix-cache hit)."""

    def __init__(self, args: argparse.Namespace, vocab_size: int) -> None:
        self.args, self.vocab_size = args, vocab_size

    def __call__(self, name: str, num_requests: int, in_flight: int | None, rate: float = math.inf,
                 arrival_seed: int = 0) -> Wave:
        a = self.args
        workload = make_workload(argparse.Namespace(
            seed=f"{a.seed}/{name}", vocab_size=self.vocab_size, prefix_len=0, num_prefixes=1, input_len=a.input_len,
            output_len=a.output_len, range_ratio=a.range_ratio, num_requests=num_requests))
        return Wave(name, workload, in_flight, rate, arrival_seed)


def run_server(url: str, args: argparse.Namespace, make: WaveMaker, warmups: list[Wave],
               closed: list[Wave]) -> tuple[list[dict], list[Wave], list[dict]]:
    """On the server at `url`: the warm-ups, the closed-loop waves, Poisson waves at shares of their peak
    request throughput, and `--runs` - 1 more runs of the last (highest) level. Returns the summaries
    of the closed-loop and Poisson waves, the Poisson waves, and the summaries of the highest level's runs."""
    for wave in warmups:
        server_wave(url, wave, args.request_timeout)
    served = [server_wave(url, wave, args.request_timeout) for wave in closed]
    peak = max(s["request_throughput"] for s in served)
    poisson = [make(f"Poisson {f:g} x peak ({f * peak:.3g} req/s)", len(closed[-1].workload), None, f * peak,
                    args.seed + i) for i, f in enumerate(args.poisson_fractions, start=1)]
    served += [server_wave(url, wave, args.request_timeout) for wave in poisson]
    more = [server_wave(url, closed[-1], args.request_timeout) for _ in range(args.runs - 1)]
    return served, poisson, [served[len(closed) - 1], *more]


def compare(args: argparse.Namespace, model_dir: str, options: dict[str, Any], server_env: dict[str, str],
            meta: dict[str, Any]) -> dict[str, Any]:
    """Every wave on the server, then offline; the results, with the server's startup time and exit
    status added to `meta`."""
    make = WaveMaker(args, ModelConfig.from_dir(model_dir).vocab_size)
    levels = sorted(set(args.concurrency_levels))
    closed = [make(f"{c} in flight", args.num_requests or max(8, 2 * c), c) for c in levels]
    warmups = [] if args.skip_warmup else [make(f"warm-up {c}", c, c) for c in levels]
    start = time.perf_counter()
    proc, url = start_server(model_dir, engine_flags(options), Path(meta["server_log"]), args.startup_timeout,
                             server_env)
    meta["server_startup_s"] = time.perf_counter() - start
    try:
        served, poisson, runs = run_server(url, args, make, warmups, closed)
    finally:
        meta["server_exit_code"] = stop_server(proc, 60)
    offline, *others = run_offline(model_dir, options, warmups, closed + poisson, args.offline_follow_up_steps)
    rows = [{"name": w.name, "requests": len(w.workload), "in_flight": w.in_flight,
             "rate": w.rate if math.isfinite(w.rate) else None, "server": s, "offline": o,
             "offline_other_follow_ups": [other[i] for other in others]}
            for i, (w, s, o) in enumerate(zip(closed + poisson, served, offline, strict=True))]
    return {"meta": meta, "rows": rows,
            "runs": {"in_flight": levels[-1], "requests": len(closed[-1].workload), "server": runs}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    options = engine_options(args)
    options["max_num_seqs"] = options["max_num_seqs"] or max(args.concurrency_levels)
    device = options["device"] or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = options["dtype"] if options["dtype"] != "auto" else "bfloat16" if device == "cuda" else "float32"
    server_env: dict[str, str] = {}
    if device == "cpu" and options.get("cpu_threads") is None:
        # one intra-op thread on both sides unless --threads says otherwise: the server's two processes
        # and this client share the machine, and spinning OpenMP threads make steps several times slower
        options["cpu_threads"] = 1
    meta = {"card": torch.cuda.get_device_name(device) if device == "cuda" else "CPU", "commit": git_commit(),
            "command": shlex.join(["python", "benchmarks/bench_serve_vs_offline.py",
                                   *(sys.argv[1:] if argv is None else argv)]),
            "model": args.size or args.model, "engine_options": options,
            "server_log": str(args.server_log or tempfile.mkstemp(prefix="replayserve-serve-", suffix=".log")[1])}
    temporary = None
    if args.size and args.checkpoint_dir is None:
        args.checkpoint_dir = temporary = Path(tempfile.mkdtemp(prefix=f"replayserve-{args.size}-"))
    try:
        if args.size:
            start = time.perf_counter()
            write_checkpoint(args.size, args.checkpoint_dir, getattr(torch, dtype), device, seed=args.seed)
            meta["checkpoint_s"] = time.perf_counter() - start
        result = compare(args, str(args.checkpoint_dir) if args.size else resolve_model(args.model), options,
                         server_env, meta)
    finally:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)
    print_report(result)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


def print_report(result: dict[str, Any]) -> None:
    meta = result["meta"]
    print(f"card: {meta['card']}; commit {meta['commit']}; model {meta['model']}\ncommand: {meta['command']}\n"
          f"engine options (both sides): {json.dumps(meta['engine_options'])}\n"
          f"server: /health 200 after {meta['server_startup_s']:.1f} s; exit status {meta['server_exit_code']} "
          f"after SIGTERM (log: {meta['server_log']})"
          + (f"; checkpoint written in {meta['checkpoint_s']:.0f} s" if "checkpoint_s" in meta else "") + "\n")
    print("| load | requests | server output tok/s | offline output tok/s | server / offline | server TTFT p50 ms "
          "| offline TTFT p50 ms | TTFT server / offline | ITL p50 ms server / offline | failed |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in result["rows"]:
        s, o = row["server"], row["offline"]
        s_ttft, o_ttft = s.get("ttft_p50_ms", math.nan), o.get("ttft_p50_ms", math.nan)
        print(f"| {row['name']} | {row['requests']} | {s['output_tok_s']:.0f} | {o['output_tok_s']:.0f} "
              f"| {_ratio(s['output_tok_s'], o['output_tok_s']):.0%} | {s_ttft:.0f} | {o_ttft:.0f} "
              f"| {_ratio(s_ttft, o_ttft):.2f}x "
              f"| {s.get('itl_p50_ms', math.nan):.1f} / {o.get('itl_p50_ms', math.nan):.1f} | {s['failed']} |")
    print("\nTTFT means, ms (client: as the load generator saw it; front end: the server's histogram, arrival "
          "there to the first token there; core: queued in the engine core to the step that produced it), "
          "and the engine steps each wave took:")
    for row in result["rows"]:
        s, o = row["server"], row["offline"]
        print(f"  {row['name']}: client {s.get('ttft_mean_ms', math.nan):.0f}, front end "
              f"{s.get('server_side_ttft_mean_ms', math.nan):.0f}, core {s.get('core_ttft_mean_ms', math.nan):.0f}, "
              f"offline {o.get('ttft_mean_ms', math.nan):.0f}; steps server {s.get('engine_steps', math.nan):.0f}, "
              f"offline {o.get('engine_steps', math.nan):.0f}")
    for row in result["rows"]:
        for other in row.get("offline_other_follow_ups", []):
            print(f"  {row['name']}, offline follow-ups queued {other['follow_up_steps']} step(s) later: TTFT p50 "
                  f"{other.get('ttft_p50_ms', math.nan):.0f} ms (server / offline "
                  f"{_ratio(row['server'].get('ttft_p50_ms', math.nan), other.get('ttft_p50_ms', math.nan)):.2f}x), "
                  f"output tok/s {other['output_tok_s']:.0f}")
    runs = result["runs"]
    rates = [r["output_tok_s"] for r in runs["server"]]
    print(f"\n{len(rates)} server run(s) of {runs['requests']} requests at {runs['in_flight']} in flight: "
          f"{sum(r['failed'] for r in runs['server'])} failed; output tok/s {min(rates):.0f} to {max(rates):.0f}")
    errors = sorted({e for row in result["rows"] for side in ("server", "offline") for e in row[side]["errors"]}
                    | {e for r in runs["server"] for e in r["errors"]})
    for error in errors[:5]:
        print(f"error: {error}")


def _ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


if __name__ == "__main__":
    sys.exit(0 if main()["meta"]["server_exit_code"] == 0 else 1)
