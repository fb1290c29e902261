"""End-to-end engine throughput on a random-weight model of a named shape, built in memory.

Decode: for each batch size and SSM backend, `batch` prompts of `--prompt-len` tokens are
prefilled, `--warmup` decode steps run, then `--repeats` windows of `--steps` decode steps are
timed (each window ends with a device sync; medians reported; `--steps` must be a multiple of the
ReplaySSM window, so every window holds whole flush cycles: shorter windows can miss the rare
flush steps and overstate ReplaySSM), then `--profile-steps` more run
under `torch.profiler` (CUDA only) for the GPU columns: kernel time per step and its share of the
profiled steps' wall time ("profiled") and of the timed steps' median ("timed": without the
profiler's host overhead), blocking calls per step (cudaStreamSynchronize, cudaEventSynchronize,
cudaMemcpy),
kernel launch calls (cudaLaunchKernel*, cuLaunchKernel*) beside the kernels the GPU ran, and
cudaGraphLaunch calls. The roofline is the step's floor (`roofline.py`) at the device copy
bandwidth and bf16 matmul rate measured at the start of the same run: "bytes" counts every byte
at copy bandwidth, "+FLOPs" takes each projection at max(bytes, FLOPs) time.
Prefill: `--prefill-prompts` prompts of `--prefill-len` tokens served to their first token (tokens/s,
MFU against the measured matmul rate), and the time to first token of one `--ttft-len` prompt.
`--hf` adds Hugging Face transformers' NemotronH on the same weights (decode steps timed inside
`generate`). `--quantization none fp8` runs every row twice in one run: on the 16-bit weights, then
with the Linears quantized to FP8 in memory as `replayserve quantize` and loading would
(`default_excludes`: NVIDIA's recipe on Nemotron-H, ModelOpt's default elsewhere; the MoE experts,
routed and shared, FP8 with one scale per expert, read by the fused MoE kernel as FP8; dense
activations scaled per call, the experts' kept 16-bit; backends named `+fp8`). Each MoE layer's
16-bit expert stack is freed once its experts are quantized, so the peak is the 16-bit model plus
one layer. `--kv-cache-dtype auto fp8` likewise runs every row with the model dtype's KV cache and
with an FP8 one (backends named `+kv8`; the roofline counts the cache's bytes).
Rows that do not fit in device memory are skipped. Each engine's KV blocks and Mamba
slots are sized for its batch and lengths, and freed before the next row.

    python benchmarks/bench_e2e.py --device cuda --size nemotron-h-8b --hf --out DIR   # H200: ~2 min
        [--batch 1 16 64 256 512 --repeats 5]                                         # ~3.5 min
    python benchmarks/bench_e2e.py --device cpu --size small     # float32, under a minute
    python benchmarks/bench_e2e.py --device cuda --size nemotron-h-8b --quantization none fp8   # bf16 vs FP8
    python benchmarks/bench_e2e.py --device cuda --size nemotron-h-8b --kv-cache-dtype auto fp8  # bf16 vs FP8 KV
    python benchmarks/bench_e2e.py --device cuda --size nemotron-3-nano-30b-a3b --batch 1 64 --skip-prefill \
        --backends replay-async --steps 32 --repeats 3 --quantization none fp8   # FP8 experts: issue 40's bar
    python benchmarks/bench_e2e.py --device cuda --size qwen3.5-9b --batch 1 256 --prompt-len 4 --skip-prefill
        # Gated DeltaNet (benchmarks/run_gdn_gpu.sh); a backend the engine refuses for a model (ReplaySSM
        # for GDN layers, for now) gets a row that says so

Backend names: `baseline` or `replay` (the SSM backend), `-eager` runs decode without CUDA
graphs, `-async` with async scheduling (the host plans and launches step N + 1 while the GPU
runs step N); e.g. sync against async in one run, on the H200:

    python benchmarks/bench_e2e.py --device cuda --size nemotron-h-8b --batch 64 256 --skip-prefill \
        --backends baseline replay baseline-async replay-async
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e_common import free_memory, gc_off, random_prompts, sync_fn  # noqa: E402,F401 - the others import them from here
from e2e_hf import hf_rows  # noqa: E402
from e2e_profile import profile_steps  # noqa: E402
from e2e_report import plot, print_tables  # noqa: E402
from roofline import STATE_PARTS, decode_ops, floors, measure_rates, prefill_flops  # noqa: E402
from shapes import FAMILY, SIZES, model_config, random_model  # noqa: E402

from replayserve.build import assemble_engine  # noqa: E402
from replayserve.config import ConfigError, EngineConfig  # noqa: E402
from replayserve.engine.engine import Engine  # noqa: E402
from replayserve.engine.request import Status  # noqa: E402
from replayserve.models.fp8_loading import quantize_model_fp8  # noqa: E402
from replayserve.models.nemotron_h import NemotronHForCausalLM  # noqa: E402
from replayserve.models.quantization import QuantConfig  # noqa: E402
from replayserve.quantize import LOADS_16_BIT_ONLY, default_excludes  # noqa: E402
from replayserve.sampling_params import SamplingParams  # noqa: E402
from replayserve.ssm.layout import GatedDeltaLayout, MambaLayout  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZATIONS = ("none", "fp8")
KV_TAGS = {"auto": "", "fp8": "+kv8"}  # --kv-cache-dtype -> the suffix of its rows' backend names
BACKENDS = ("baseline", "replay", "baseline-eager", "replay-eager", "baseline-async", "replay-async")
GiB = 1 << 30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--batch", type=int, nargs="+", help="decode batch sizes (default 1 16 64 256; CPU 1 16)")
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=["baseline", "replay"],
                   help="SSM backends; '-eager' runs decode without CUDA graphs, '-async' with async scheduling "
                        "(compare in one run)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=32,
                   help="decode steps per timed window; for ReplaySSM a multiple of its window, so every timed "
                        "window holds each row's flush once (the benchmark's rows flush on the same steps)")
    p.add_argument("--warmup", type=int, default=4, help="decode steps before timing")
    p.add_argument("--repeats", type=int, default=3, help="timed windows (and prefill runs); medians reported")
    p.add_argument("--profile-steps", type=int, default=32,
                   help="decode steps under torch.profiler (CUDA); the default covers a ReplaySSM flush cycle "
                        "of the default window (32)")
    p.add_argument("--window", type=int, help="replay_window of the replay backend (default: the engine's)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--budget", type=int, default=16384, help="max_num_batched_tokens")
    p.add_argument("--prefill-prompts", type=int, help="default 16 (CPU 4)")
    p.add_argument("--prefill-len", type=int, help="default 1024 (CPU 256)")
    p.add_argument("--ttft-len", type=int, help="default 4096 (CPU 1024)")
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--skip-prefill", action="store_true")
    p.add_argument("--hf", action="store_true", help="also time transformers' NemotronH decode")
    p.add_argument("--hf-batch", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="CPU intra-op threads: the CPU path's small ops run fastest on one, and spinning "
                        "OpenMP threads on a busy machine make steps several times slower")
    p.add_argument("--quantization", nargs="+", choices=QUANTIZATIONS, default=["none"],
                   help="weights to time, in this order: none (the dtype's) and/or fp8 (quantized in memory)")
    p.add_argument("--kv-cache-dtype", dest="kv_cache_dtypes", nargs="+", choices=tuple(KV_TAGS), default=["auto"],
                   help="KV caches to time, in this order: auto (the dtype's) and/or fp8 (float8_e4m3fn, scale 1.0)")
    p.add_argument("--out", type=Path, help="directory for bench_e2e.json and bench_e2e.png")
    args = p.parse_args(argv)
    args.kv_cache_dtype = "auto"  # the rows being timed: set per pass by main
    cuda = args.device.startswith("cuda")
    # The CPU runs the plain-PyTorch reference ops: its defaults keep a run to seconds.
    for name, gpu, cpu in (("batch", [1, 16, 64, 256], [1, 16]), ("prefill_prompts", 16, 4),
                           ("prefill_len", 1024, 256), ("ttft_len", 4096, 1024),
                           ("dtype", "bfloat16", "float32")):
        if getattr(args, name) is None:
            setattr(args, name, gpu if cuda else cpu)
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device")
    if args.hf and args.size in FAMILY:
        p.error(f"--hf times transformers' NemotronH: {args.size} is a {FAMILY[args.size]} shape")
    # The FP8 rows quantize the model in place, so the 16-bit rows go first whatever the order given.
    args.quantization = [q for q in QUANTIZATIONS if q in args.quantization]
    args.kv_cache_dtypes = [d for d in KV_TAGS if d in args.kv_cache_dtypes]
    return args


def engine_config(model: NemotronHForCausalLM, args: argparse.Namespace, backend: str, seqs: int,
                  max_len: int) -> EngineConfig:
    """KV blocks and Mamba slots for exactly `seqs` sequences of `max_len` tokens; a token budget that
    leaves prefill room beside `seqs` decoding rows."""
    return EngineConfig(model=model.config, dtype=args.dtype, device=args.device, max_num_seqs=seqs,
                        max_num_batched_tokens=max(args.budget, 2 * seqs), max_model_len=max_len,
                        block_size=args.block_size, ssm_backend=ssm_backend(backend),
                        replay_window=args.window, enforce_eager=backend.endswith("-eager"),
                        async_scheduling=backend.endswith("-async"), kv_cache_dtype=args.kv_cache_dtype)


def ssm_backend(backend: str) -> str:
    """The SSM backend of a benchmark backend name ('replay-async' -> 'replay')."""
    return backend.split("-")[0]


def resident_bytes(model: NemotronHForCausalLM, config: EngineConfig) -> int:
    """Device memory an engine allocates beside the weights: Mamba2 and Gated DeltaNet slots and the KV cache."""
    m, dtype = config.model, model.backbone.embeddings.weight.dtype
    window = config.resolved_replay_window if config.ssm_backend == "replay" else 0
    layout = MambaLayout.from_config(m, config.max_num_seqs, dtype, window=window)
    shapes = [(layout.conv_state_shape, layout.act_dtype), (layout.ssm_state_shape, layout.state_dtype)]
    if window:
        shapes += [(layout.x_ring_shape, layout.act_dtype), (layout.dt_ring_shape, layout.state_dtype),
                   (layout.b_ring_shape, layout.act_dtype)]
    mamba = layout.num_layers * sum(math.prod(s) * d.itemsize for s, d in shapes)
    gdn = GatedDeltaLayout.from_config(m, config.max_num_seqs, dtype)
    gdn_shapes = [(gdn.conv_state_shape, gdn.act_dtype), (gdn.ssm_state_shape, gdn.state_dtype)]
    if window:  # ops/replay_gdn.py's rings: k per key head, the correction delta and g per value head
        slots, ring = config.max_num_seqs, window + 1
        gdn_shapes += [((slots, gdn.num_key_heads, ring, gdn.key_dim), gdn.act_dtype),
                       ((slots, gdn.num_value_heads, ring, gdn.value_dim), gdn.state_dtype),
                       ((slots, gdn.num_value_heads, ring), gdn.state_dtype)]
    mamba += gdn.num_layers * sum(math.prod(s) * d.itemsize for s, d in gdn_shapes)
    kv = (2 * m.num_attention_layers * config.resolved_num_kv_blocks * config.block_size * m.num_key_value_heads
          * m.head_dim * kv_itemsize(config, dtype))
    return mamba + kv


def kv_itemsize(config: EngineConfig, dtype: torch.dtype) -> int:
    """Bytes per KV cache entry: 1 for an FP8 cache, else the model dtype's."""
    return 1 if config.kv_cache_dtype == "fp8" else dtype.itemsize


def fits(model: NemotronHForCausalLM, config: EngineConfig, device: torch.device) -> str | None:
    """None, or why the engine would not fit in free device memory (with room for a prefill step)."""
    if device.type != "cuda":
        return None
    m = config.model
    widths = max(m.intermediate_size, 2 * m.mamba_intermediate_size + 2 * m.n_groups * m.ssm_state_size,
                 2 * m.gated_delta_conv_dim + m.linear_num_value_heads * m.linear_value_head_dim)
    activations = 6 * config.max_num_batched_tokens * widths * model.backbone.embeddings.weight.element_size()
    need, free = resident_bytes(model, config) + activations, torch.cuda.mem_get_info(device)[0]
    return None if need < 0.95 * free else f"needs ~{need / GiB:.1f} GiB, {free / GiB:.1f} GiB free"


def decode_row(model: NemotronHForCausalLM, args: argparse.Namespace, backend: str, batch: int,
               rates: dict[str, float]) -> dict:
    """One (backend, batch) row: timed decode windows, the profile, and the roofline."""
    device, sync = model.lm_head.weight.device, sync_fn(model.lm_head.weight.device)
    row: dict = {"backend": backend, "batch": batch}
    total = args.warmup + args.repeats * args.steps + args.profile_steps
    # Rows admitted in an earlier prefill step decode while later ones prefill, a token ahead per step;
    # the decoding rows take their share of the budget, so a prefill step has at least budget - batch.
    budget = max(args.budget, 2 * batch)  # as engine_config sets it
    ahead = math.ceil(batch * args.prompt_len / (budget - batch)) + 2
    config = engine_config(model, args, backend, batch, args.prompt_len + total + ahead + 8)
    window = config.resolved_replay_window if config.ssm_backend == "replay" else 0
    if window and args.steps % window:  # a window without the flush steps would time ReplaySSM too fast
        raise SystemExit(f"--steps {args.steps} must be a multiple of the ReplaySSM window {window}")
    row["skipped"] = fits(model, config, device)
    if row["skipped"]:
        return row
    engine = assemble_engine(config, model, tokenizer=None)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=total + ahead, ignore_eos=True)
        prompts = random_prompts(batch, args.prompt_len, model.config.vocab_size, seed=args.seed + batch)
        requests = [engine.add_request(p, params) for p in prompts]
        sync()
        t0 = time.perf_counter()
        while not all(r.decoding for r in requests):
            engine.step()
        sync()
        row["prefill_s"] = time.perf_counter() - t0
        for _ in range(args.warmup):
            engine.step()
        cached = [r.num_tokens - 1 + (args.repeats * args.steps - 1) / 2 for r in requests]  # mean over timed steps
        steps, overlapped = engine.num_steps, engine.num_overlapped_steps
        walls = timed_windows(engine, args.repeats, args.steps, sync)
        # Async scheduling: the share of timed steps launched before the previous step was read back.
        row["overlapped_share"] = (engine.num_overlapped_steps - overlapped) / (engine.num_steps - steps)
        if device.type == "cuda" and args.profile_steps:
            row.update(profile_steps(engine, args.profile_steps, sync))
        if engine.scheduler.num_preemptions or any(r.status is not Status.RUNNING for r in requests):
            raise RuntimeError(f"{backend} batch {batch}: a request was preempted or finished while timed")
    finally:
        del engine
        free_memory(device)
        if device.type == "cuda":  # the weights alone, unless an engine leaks
            row["allocated_gb_after"] = torch.cuda.memory_allocated(device) / GiB
    wall = statistics.median(walls)
    ops = decode_ops(model, ssm_backend(backend), config.resolved_replay_window, cached,
                     kv_itemsize(config, model.backbone.embeddings.weight.dtype))
    floor = floors(ops, rates)
    row.update({"tok_s": batch * args.steps / wall, "step_ms": 1e3 * wall / args.steps, "walls_s": walls,
                "mean_context": statistics.mean(cached) + 1, "gb_per_step": sum(op.bytes for op in ops) / 1e9,
                "bytes_by_part": {"weights": sum(op.bytes for op in ops if op.name not in STATE_PARTS)}
                | {op.name: op.bytes for op in ops if op.name in STATE_PARTS},
                "roofline_bytes_tok_s": batch / floor["bytes_s"], "roofline_tok_s": batch / floor["ops_s"]})
    row["of_roofline_bytes"] = row["tok_s"] / row["roofline_bytes_tok_s"]
    row["of_roofline"] = row["tok_s"] / row["roofline_tok_s"]
    if "gpu_ms_per_step" in row:  # the profiler slows the host: the same GPU time over the timed steps' wall
        row["gpu_busy_timed"] = row["gpu_ms_per_step"] / row["step_ms"]
    return row


def timed_windows(engine: Engine, repeats: int, steps: int, sync: Callable[[], None]) -> list[float]:
    """Wall seconds of `repeats` windows of `steps` engine steps, each ended by a device sync."""
    walls = []
    with gc_off():
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step()
            sync()
            walls.append(time.perf_counter() - t0)
    return walls


def serve_to_first_token(engine: Engine, prompts: list[list[int]], sync: Callable[[], None]) -> float:
    """Seconds until every prompt has its first token (max_tokens = 1)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    # The collection that gc_off starts with runs before the clock does: it took 40-100 ms on
    # the H200 box, more than half of a 4096-token prefill's GPU time.
    with gc_off():
        sync()
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        sync()
        return time.perf_counter() - t0


def prefill_row(model: NemotronHForCausalLM, args: argparse.Namespace, backend: str, rates: dict[str, float]) -> dict:
    device, sync = model.lm_head.weight.device, sync_fn(model.lm_head.weight.device)
    row: dict = {"backend": backend, "prompts": args.prefill_prompts, "prompt_len": args.prefill_len,
                 "ttft_len": args.ttft_len}
    for key, n, length in (("prefill", args.prefill_prompts, args.prefill_len), ("ttft", 1, args.ttft_len)):
        config = engine_config(model, args, backend, n, length + 8)
        skipped = fits(model, config, device)
        if skipped:
            row[f"{key}_skipped"] = skipped
            continue
        engine = assemble_engine(config, model, tokenizer=None)
        try:
            prompts = random_prompts(n, length, model.config.vocab_size, seed=args.seed + length)
            serve_to_first_token(engine, prompts, sync)  # warm-up: kernels compiled, allocator primed
            times = [serve_to_first_token(engine, prompts, sync) for _ in range(args.repeats)]
        finally:
            del engine
            free_memory(device)
        seconds = statistics.median(times)
        mfu = prefill_flops(model, [length] * n) / seconds / rates["matmul_flop_per_s"]
        row.update({f"{key}_s": times, f"{key}_tok_s": n * length / seconds, f"{key}_mfu": mfu})
    return row


def weights_gb(model: NemotronHForCausalLM) -> float:
    return sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9


def timed_rows(model: NemotronHForCausalLM, args: argparse.Namespace, rates: dict[str, float], result: dict,
               tag: str, save: Callable[[], None]) -> None:
    """Every decode row (batch x backend) and prefill row of one set of weights, their backends named
    with `tag` appended ('+fp8'), into result's lists."""
    device = model.lm_head.weight.device
    for batch in [] if args.skip_decode else args.batch:
        for backend in args.backends:
            try:
                row = decode_row(model, args, backend, batch, rates)
            except torch.OutOfMemoryError:
                free_memory(device)
                row = {"backend": backend, "batch": batch, "skipped": "out of device memory"}
            except ConfigError as e:  # e.g. ReplaySSM on a model whose layers it does not serve yet
                row = {"backend": backend, "batch": batch, "skipped": f"refused: {e}"}
            except RuntimeError as e:  # a broken row must not lose the others
                traceback.print_exc()
                print(f"decode {backend}{tag} batch {batch} FAILED: {e}", file=sys.stderr)
                row = {"backend": backend, "batch": batch, "skipped": f"FAILED: {e}"}
            result["decode"].append({**row, "backend": backend + tag})
            print(f"done decode {backend}{tag} batch {batch}", file=sys.stderr, flush=True)
            save()
    for backend in [] if args.skip_prefill else args.backends:
        try:
            row = prefill_row(model, args, backend, rates)
        except torch.OutOfMemoryError:
            free_memory(device)
            row = {"backend": backend, "prompts": args.prefill_prompts, "prompt_len": args.prefill_len,
                   "ttft_len": args.ttft_len, "prefill_skipped": "out of device memory"}
        except ConfigError as e:
            row = {"backend": backend, "prompts": args.prefill_prompts, "prompt_len": args.prefill_len,
                   "ttft_len": args.ttft_len, "prefill_skipped": f"refused: {e}"}
        result["prefill"].append({**row, "backend": backend + tag})
        print(f"done prefill {backend}{tag}", file=sys.stderr, flush=True)
        save()


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = random_model(model_config(args.size), DTYPES[args.dtype], device, seed=args.seed)
    rates = measure_rates(device, DTYPES[args.dtype])
    params = sum(p.numel() for p in model.parameters())
    options = {k: v for k, v in vars(args).items() if k != "kv_cache_dtype"}  # the pass's, not an option
    result: dict = {"meta": {**{k: str(v) if isinstance(v, Path) else v for k, v in options.items()},
                             "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
                             "torch": torch.__version__, "params_b": params / 1e9,
                             "weights_gb": weights_gb(model),
                             "copy_gb_s": rates["copy_bytes_per_s"] / 1e9,
                             "matmul_tflop_s": rates["matmul_flop_per_s"] / 1e12},
                    "decode": [], "prefill": []}

    def save() -> None:  # after every section, so a run cut short keeps what it measured
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "bench_e2e.json").write_text(json.dumps(result, indent=2))

    if args.hf:  # first: on the H200 its batch-64 prefill fits beside the weights alone, not after the engines' rows
        result["decode"] += hf_rows(model, args)
        save()
    for quantization in args.quantization:
        tag = "" if quantization == "none" else f"+{quantization}"
        if quantization == "fp8":
            cfg = model.config  # what `replayserve quantize` keeps in 16-bit for this family
            keep = (*default_excludes(cfg), *LOADS_16_BIT_ONLY.get(cfg.model_type, ()))
            rule = QuantConfig("FP8", None, keep, "--quantization fp8")
            names = quantize_model_fp8(model, rule)
            result["meta"]["fp8_modules"] = len(names)
            result["meta"]["fp8_expert_modules"] = sum("experts." in n for n in names)  # routed and shared
            result["meta"]["fp8_weights_gb"] = weights_gb(model)
            free_memory(device)
        for kv_cache_dtype in args.kv_cache_dtypes:
            args.kv_cache_dtype = kv_cache_dtype
            timed_rows(model, args, rates, result, tag + KV_TAGS[kv_cache_dtype], save)
    print_tables(result)
    if args.out:
        plot(result, args.out / "bench_e2e.png")
    return result


if __name__ == "__main__":
    main()
