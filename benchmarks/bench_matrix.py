"""The reference system's benchmark table on a named shape: prefix-cache mode x speculation x SSM
backend, end-to-end and decode throughput of a batch of unique prompts, two waves per engine.

For every SSM backend (`--backends`), cache mode (`--modes`: `off` is prefix caching disabled,
`none` / `align` / `all` are `mamba_cache_mode` with caching on) and speculation (`--spec`: `none`
single-token decode; `mtp` the model's MTP layer drafting `--k` tokens, one row per
`--acceptance`), one engine is built, warmed up (`Engine.warm_up`, on CUDA unless
`--no-engine-warmup`) and serves two waves of `--batch` prompts of `--prompt-len` random tokens,
`--max-tokens` greedy tokens each, every prompt unique (no prefix hits: the hit rate is printed).
Both waves are reported: the first shows what the warm-up left cold.

The model is a random-weight one of the shape (`shapes.random_model`) with one MTP step added
(`--mtp-layers`, in the `hybrid_override_pattern` alphabet), made confident
(`bench_spec_decode.confident_`: no rounding flips its greedy path). Random MTP weights draft
tokens nobody accepts, so MTP rows put `ControlledMTPProposer` in place of the engine's MTP
proposer: the MTP layers run every step on the same rows (their cost is real) and the drafts are
the greedy path's (from the `--spec none` rows of the first backend and mode), each one corrupted
with probability 1 - acceptance. "acc/draft" is accepted / reached drafts (what `--acceptance`
sets: a row reaches its accepted drafts and the one it rejects), "acc rate" accepted / proposed
drafts (lower: drafts after a rejected one are never reached).

Columns: e2e tok/s is generated tokens over the wave's wall time (submit to last token, prefill
included); decode tok/s counts the tokens after every request has its first one over that
phase's time; "vs no-spec" compares with the same backend, mode and wave without speculation.
MTP ms/step is the proposer's time per step (the device synchronised before it; it ends with its
own host read) against its floor (`roofline.mtp_ops`: the MTP layers' weights and the LM head
read once per draft, the window's keys and values, the hidden states of the positions new since
a row's last call (the tokens a row-step keeps: the MTP cache holds the rest), at the copy bandwidth measured
at the start; "ops" also takes each part's matmul FLOPs at the measured rate). No-spec rows use
async scheduling unless `--no-async` (speculation refuses it). Every row's outputs are compared
with the greedy path ("same").

    python benchmarks/bench_matrix.py --device cuda --size nemotron-3-nano-30b-a3b --k 3 \
        --acceptance 0.9 0.6 --out nano.json         # the issue's table: batch 64, 2048 + 256 tokens
    python benchmarks/bench_matrix.py --device cpu --size tiny --batch 2 --prompt-len 32 --max-tokens 8

`--mtp-graphs` replays the MTP draft loop from CUDA graphs (`speculative/mtp_graphs.py`, off by default).
`--modes`, `--backends` and `--spec` split the matrix over several runs; `--out` is rewritten
after every configuration, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_spec_decode import confident_  # noqa: E402
from roofline import floors, measure_rates, mtp_ops  # noqa: E402
from shapes import SIZES, model_config, random_model  # noqa: E402

from replayserve.build import assemble_engine  # noqa: E402
from replayserve.config import PATTERN_CHARS, EngineConfig, SpeculativeConfig  # noqa: E402
from replayserve.engine.engine import Engine  # noqa: E402
from replayserve.models.nemotron_h import NemotronHForCausalLM  # noqa: E402
from replayserve.sampling_params import SamplingParams  # noqa: E402
from replayserve.speculative.controlled import ControlledMTPProposer  # noqa: E402
from replayserve.speculative.metrics import SpecMetrics  # noqa: E402
from replayserve.speculative.mtp import MTPProposer  # noqa: E402
from replayserve.speculative.proposers import DraftRequest, Proposer  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}
MODES = ("off", "none", "align", "all")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--mtp-layers", help="the MTP step's blocks, e.g. '*E' (default: '*E' with MoE layers, else '*-')")
    p.add_argument("--batch", type=int, default=64, help="prompts per wave (and max_num_seqs)")
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--backends", nargs="+", choices=["baseline", "replay"], default=["baseline", "replay"])
    p.add_argument("--spec", nargs="+", choices=["none", "mtp"], default=["none", "mtp"])
    p.add_argument("--k", type=int, default=3, help="MTP drafts per step")
    p.add_argument("--acceptance", type=float, nargs="+", default=[0.9, 0.6], help="per-draft acceptance of MTP rows")
    p.add_argument("--mtp-window", type=int, default=256, help="positions the MTP attention sees")
    p.add_argument("--mtp-graphs", action="store_true",
                   help="MTP rows replay the draft loop from CUDA graphs (speculative/mtp_graphs.py; off by default)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--budget", type=int, default=2048,
                   help="max_num_batched_tokens (the engine default; the warm-up runs every MoE token count up to it)")
    p.add_argument("--state-slots", type=int, default=1,
                   help="boundary-state slots per request with align / all (num_mamba_cache_slots / batch)")
    p.add_argument("--window", type=int, help="replay_window (default: the engine's)")
    p.add_argument("--no-async", action="store_true", help="no-spec rows without async scheduling")
    p.add_argument("--no-engine-warmup", action="store_true", help="skip Engine.warm_up (CUDA runs it by default)")
    p.add_argument("--threads", type=int, default=1, help="CPU intra-op threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="JSON of every row, rewritten after each configuration")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device")
    if args.mtp_graphs and not args.device.startswith("cuda"):
        p.error("--mtp-graphs: CUDA graphs need --device cuda")
    return args


def matrix_model(args: argparse.Namespace) -> NemotronHForCausalLM:
    """The shape's random model with one MTP step, made confident."""
    cfg = model_config(args.size)
    layers = args.mtp_layers or ("*E" if "moe" in cfg.layer_types else "*-")
    cfg = dataclasses.replace(cfg, num_nextn_predict_layers=1, mtp_layer_types=tuple(PATTERN_CHARS[c] for c in layers))
    return confident_(random_model(cfg, DTYPES[args.dtype], args.device, seed=args.seed))


def wave_prompts(args: argparse.Namespace, vocab: int, wave: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(args.seed * 1000 + wave)
    return torch.randint(3, vocab, (args.batch, args.prompt_len), generator=gen).tolist()


class TimedProposer(Proposer):
    """A proposer whose `propose_batch` calls are timed from an idle device to their drafts."""

    def __init__(self, inner: Proposer, device: torch.device) -> None:
        self.inner, self.device = inner, device
        self.seconds, self.calls, self.rows = 0.0, 0, 0

    def propose(self, token_ids: list[int], k: int) -> list[int]:  # type: ignore[override]
        return self.inner.propose(token_ids, k)

    def propose_batch(self, requests: list[DraftRequest]) -> dict[str, tuple[int, ...]]:  # type: ignore[override]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        out = self.inner.propose_batch(requests)  # ends with its own host read of the drafts
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        self.rows += len(requests)
        return out


class RejectionCounter(SpecMetrics):
    """The engine's speculative counters, plus the verify rows that rejected a draft: a row
    reaches its accepted drafts and, when it rejects, one more, so accepted / (accepted +
    rejections) is the per-draft acceptance."""

    rejections: int = 0

    def record(self, drafted: dict[str, int], kept: dict[str, int]) -> None:
        super().record(drafted, kept)
        self.rejections += sum(kept[r] - 1 < k for r, k in drafted.items())


def engine_config(model: NemotronHForCausalLM, args: argparse.Namespace, backend: str, mode: str,
                  spec: bool) -> EngineConfig:
    caching = mode != "off"
    return EngineConfig(
        model=model.config, dtype=args.dtype, device=args.device, max_num_seqs=args.batch,
        max_num_batched_tokens=max(args.budget, args.batch * (1 + args.k)), block_size=args.block_size,
        max_model_len=args.prompt_len + args.max_tokens + args.k + 8, ssm_backend=backend,
        replay_window=args.window, enable_prefix_caching=caching, mamba_cache_mode=mode if caching else "none",
        num_mamba_cache_slots=args.state_slots * args.batch if mode in ("align", "all") else None,
        async_scheduling=not spec and not args.no_async,
        speculative=SpeculativeConfig(method="mtp", num_speculative_tokens=args.k, mtp_window=args.mtp_window)
        if spec else None)


def serve_wave(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """One wave submitted at once: outputs, e2e and decode-phase seconds and tokens, steps and the
    speculative and prefix-cache counters it added. The collector is off meanwhile."""
    sync = torch.cuda.synchronize if engine.runner.device.type == "cuda" else (lambda: None)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before = engine.get_metrics()
    gc.collect()
    gc.disable()
    try:
        sync()
        t0 = time.perf_counter()
        requests = [engine.add_request(p, params) for p in prompts]
        while not all(r.output_token_ids for r in requests):
            engine.step()
        sync()
        t1, first, steps = time.perf_counter(), sum(len(r.output_token_ids) for r in requests), engine.num_steps
        while engine.has_unfinished():
            engine.step()
        sync()
        t2 = time.perf_counter()
    finally:
        gc.enable()
    after = engine.get_metrics()
    generated = sum(len(r.output_token_ids) for r in requests)
    counters = {k: after[k] - before[k] for k in ("spec_num_drafts", "spec_num_draft_tokens",
                                                  "spec_num_accepted_tokens", "prefix_cache_queries",
                                                  "prefix_cache_hits")}
    per_position = after["spec_accepted_per_position"]
    old = before["spec_accepted_per_position"]
    counters["accepted_per_position"] = [a - (old[i] if i < len(old) else 0) for i, a in enumerate(per_position)]
    return {"outputs": [list(r.output_token_ids) for r in requests], "e2e_s": t2 - t0, "generated": generated,
            "decode_s": t2 - t1, "decode_tokens": generated - first, "decode_steps": engine.num_steps - steps,
            **counters}


def run_config(model: NemotronHForCausalLM, args: argparse.Namespace, backend: str, mode: str,
               acceptance: float | None, waves: list[list[list[int]]], paths: dict | None,
               rates: dict[str, float]) -> dict:
    """One engine: built, warmed up, two waves served. A row of the table for each wave."""
    spec = acceptance is not None
    config = engine_config(model, args, backend, mode, spec)
    engine = assemble_engine(config, model, tokenizer=None)
    timed = controlled = None
    try:
        if not args.no_engine_warmup and args.device.startswith("cuda"):
            engine.warm_up()
        counter = engine.spec_metrics = RejectionCounter()  # after the warm-up, which puts back its own
        if spec:  # after the warm-up, which drafts with proposers of its own
            assert isinstance(engine.proposer, MTPProposer) and paths is not None and acceptance is not None
            if args.mtp_graphs:
                engine.proposer.enable_draft_graphs().capture_all(args.k)
            controlled = ControlledMTPProposer(engine.proposer, paths, acceptance, seed=args.seed + 1)
            engine.proposer = timed = TimedProposer(controlled, engine.runner.device)
        rows = []
        for w, prompts in enumerate(waves, start=1):
            calls, seconds, rows_drafted = (timed.calls, timed.seconds, timed.rows) if timed else (0, 0.0, 0)
            rejections = counter.rejections
            result = serve_wave(engine, prompts, args.max_tokens)
            rejections = counter.rejections - rejections
            row = {"backend": backend, "mode": mode, "spec": "mtp" if spec else "none", "acceptance": acceptance,
                   "wave": w, **{k: v for k, v in result.items() if k != "outputs"},
                   "e2e_tok_s": result["generated"] / result["e2e_s"],
                   "decode_tok_s": result["decode_tokens"] / result["decode_s"],
                   # A verify row emits its accepted drafts and one more token; a plain decode row one.
                   "tokens_per_row_step": 1 + result["spec_num_accepted_tokens"] / max(1, result["spec_num_drafts"])}
            if timed is not None and timed.calls > calls:
                n = timed.calls - calls
                row["mtp_ms_per_step"] = 1e3 * (timed.seconds - seconds) / n
                row["mtp_rows_per_step"] = (timed.rows - rows_drafted) / n
                row.update(mtp_floor_ms(model, args, row["mtp_rows_per_step"], row["tokens_per_row_step"], rates))
            accepted = result["spec_num_accepted_tokens"]
            row["acceptance_per_draft"] = accepted / (accepted + rejections) if accepted + rejections else None
            row["outputs"] = result["outputs"]
            rows.append(row)
        return {"rows": rows}
    finally:
        del engine, timed, controlled  # the graphs' memory pools go with the proposer
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()


def mtp_floor_ms(model: NemotronHForCausalLM, args: argparse.Namespace, rows: float, new: float,
                 rates: dict[str, float]) -> dict[str, float]:
    """The proposer call's floors at the mean rows per step, each row's window full (`mtp_window`
    positions, or the prompt when shorter) and `new` positions per row new since its last call
    (the tokens a row-step keeps: what the MTP cache does not hold)."""
    n = max(1, round(rows))
    ops = mtp_ops(model, n, args.k, [float(min(args.mtp_window, args.prompt_len))] * n, [new] * n)
    f = floors(ops, rates)
    return {"mtp_floor_bytes_ms": 1e3 * f["bytes_s"], "mtp_floor_ops_ms": 1e3 * f["ops_s"]}


def print_table(records: list[dict], meta: dict) -> None:
    print(f"\n{meta['batch']} unique prompts x {meta['prompt_len']} tokens, {meta['max_tokens']} generated each, "
          f"two waves per engine; k = {meta['k']}; model {meta['size']} (MTP {meta['mtp_layers']}), "
          f"{meta['dtype']} on {meta['device_name']}; copy {meta['copy_gb_s']:.0f} GB/s, "
          f"matmul {meta['matmul_tflop_s']:.1f} TFLOP/s; no-spec rows "
          f"{'synchronous' if meta['no_async'] else 'with async scheduling'}, MTP rows synchronous, "
          f"MTP window {meta['mtp_window']}{', graphed' if meta['mtp_graphs'] else ''}")
    print("| backend | cache | spec | wave | e2e tok/s | decode tok/s | vs no-spec (e2e) | acc/draft (set) | "
          "acc rate | tokens/row-step | MTP ms/step | floor ms bytes / ops | of floor | hit rate | same |")
    print("|---|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in records:
        if "skipped" in r:
            print(f"| {r['backend']} | {r['mode']} | {r['spec']} | | skipped: {r['skipped'][:120]} |"
                  " | | | | | | | | | |")
            continue
        base = next((b for b in records if "skipped" not in b and b["spec"] == "none" and b["backend"] == r["backend"]
                     and b["mode"] == r["mode"] and b["wave"] == r["wave"]), None)
        vs = f"{r['e2e_tok_s'] / base['e2e_tok_s']:.2f}x" if base else "-"
        if r["spec"] == "none":
            spec, acc, rate, mtp, floor, of = "none", "-", "-", "-", "-", "-"
        else:
            spec = f"MTP k={meta['k']}"
            apd = r["acceptance_per_draft"]
            acc = f"{apd:.3f} ({r['acceptance']})" if apd is not None else f"- ({r['acceptance']})"
            rate = f"{r['spec_num_accepted_tokens'] / max(1, r['spec_num_draft_tokens']):.3f}"
            mtp = f"{r['mtp_ms_per_step']:.2f}" if "mtp_ms_per_step" in r else "-"
            floor = (f"{r['mtp_floor_bytes_ms']:.2f} / {r['mtp_floor_ops_ms']:.2f}"
                     if "mtp_floor_bytes_ms" in r else "-")
            of = f"{r['mtp_ms_per_step'] / r['mtp_floor_bytes_ms']:.2f}x" if "mtp_floor_bytes_ms" in r else "-"
        hits = r["prefix_cache_hits"] / r["prefix_cache_queries"] if r["prefix_cache_queries"] else 0.0
        print(f"| {r['backend']} | {r['mode']} | {spec} | {r['wave']} | {r['e2e_tok_s']:.0f} | "
              f"{r['decode_tok_s']:.0f} | {vs} | {acc} | {rate} | {r['tokens_per_row_step']:.2f} | {mtp} | {floor} | "
              f"{of} | {hits:.0%} | {r['same']:.0%} |")
    lines = []
    for r in records:
        if r.get("backend") == "replay" and r.get("wave") == 2 and "skipped" not in r:
            twin = next((b for b in records if b.get("backend") == "baseline" and "skipped" not in b
                         and (b["mode"], b["spec"], b["acceptance"], b["wave"]) ==
                         (r["mode"], r["spec"], r["acceptance"], 2)), None)
            if twin:
                label = "no spec" if r["spec"] == "none" else f"MTP acc {r['acceptance']}"
                lines.append(f"  {r['mode']:5} {label:12} {r['e2e_tok_s'] / twin['e2e_tok_s'] - 1:+.1%}")
    if lines:
        print("\nReplaySSM against baseline (e2e tok/s, wave 2):", *lines, sep="\n")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    model = matrix_model(args)
    rates = measure_rates(device, DTYPES[args.dtype])
    vocab = model.config.vocab_size
    waves = [wave_prompts(args, vocab, w) for w in (1, 2)]
    meta = {**{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "mtp_layers": ",".join(model.config.mtp_layer_types),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
            "torch": torch.__version__, "copy_gb_s": rates["copy_bytes_per_s"] / 1e9,
            "matmul_tflop_s": rates["matmul_flop_per_s"] / 1e12}
    records: list[dict] = []
    paths: dict[tuple[int, ...], list[int]] | None = None
    reference: list[list[int]] | None = None

    def save() -> None:
        if args.out:
            args.out.write_text(json.dumps({"meta": meta, "rows": [{k: v for k, v in r.items() if k != "outputs"}
                                                                   for r in records]}, indent=2))

    # (backend, mode, acceptance (None: no spec), reported)
    configs: list[tuple[str, str, float | None, bool]] = []
    if "none" in args.spec:
        configs += [(b, m, None, True) for b in args.backends for m in args.modes]
    elif "mtp" in args.spec:  # MTP rows alone: an unreported no-spec engine first, for the greedy path
        configs.append((args.backends[0], "off", None, False))
    if "mtp" in args.spec:
        configs += [(b, m, a, True) for b in args.backends for m in args.modes for a in args.acceptance]
    for backend, mode, acceptance, reported in configs:
        rows = None
        try:
            rows = run_config(model, args, backend, mode, acceptance, waves, paths, rates)["rows"]
        except (RuntimeError, ValueError) as e:  # out of memory or a broken row: the others still run
            traceback.print_exc()
            if not reported:
                raise
            records.append({"backend": backend, "mode": mode, "spec": "none" if acceptance is None else "mtp",
                            "acceptance": acceptance, "skipped": f"{type(e).__name__}: {e}"})
        if rows is None:
            # The half-built engine lived in the exception's frames, gone only now: free its memory.
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            save()
            continue
        if reference is None:  # the first no-spec engine's outputs: the greedy path of every prompt
            reference = rows[0]["outputs"] + rows[1]["outputs"]
            paths = {tuple(p): o for p, o in zip(waves[0] + waves[1], reference, strict=True)}
        for row in rows:
            want = reference[(row["wave"] - 1) * args.batch: row["wave"] * args.batch]
            row["same"] = sum(a == b for a, b in zip(row["outputs"], want, strict=True)) / args.batch
        if reported:
            records += rows
        label = "reference (not reported)" if not reported else "no spec" if acceptance is None else f"MTP {acceptance}"
        print(f"done {backend} {mode} {label}", file=sys.stderr, flush=True)
        save()
    print_table(records, meta)
    return {"meta": meta, "rows": records}


if __name__ == "__main__":
    main()
