"""The throughput cost of structured outputs: decode tok/s with a JSON schema on every row against
the same engine unconstrained, by batch size, on a random-weight model of a named shape.

For each batch size, `batch` prompts are prefilled, `--warmup` decode steps run, then `--repeats`
windows of `--steps` steps are timed (medians reported), once with every row constrained by
`SCHEMA` (a list of nested records, objects, arrays, enums, required fields) and once without.
The schema's `minItems` keeps every constrained row inside its grammar for the whole run, so the
batch stays full. Greedy sampling; one grammar, compiled once and shared (the time a first request
waits for it, tokenizer included, is reported).
Reported per batch: both rates, their ratio, and the host's mask-filling time per step (with the
previous step's accepts, which reach the matchers there; it runs while the device runs the
forward: it costs throughput only where it outlasts the forward).

The random model needs a tokenizer that can spell JSON, with the shape's vocabulary: a byte-level
vocabulary of the 256 byte symbols and synthetic tokens (words with and without a leading space,
numbers, JSON punctuation runs), so xgrammar scans a vocabulary of the real size and mix.

    python benchmarks/bench_structured.py --device cuda --size nemotron-h-8b      # the issue's shape
    python benchmarks/bench_structured.py --device cpu --size tiny --batch 1 4    # seconds
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_e2e import DTYPES, engine_config, free_memory, random_prompts, sync_fn, timed_windows  # noqa: E402
from shapes import SIZES, model_config, random_model  # noqa: E402

from replayserve.build import assemble_engine  # noqa: E402
from replayserve.builtin.tiny import SPECIAL_TOKENS  # noqa: E402
from replayserve.engine.grammars import Grammars  # noqa: E402
from replayserve.engine.request import Status  # noqa: E402
from replayserve.models.nemotron_h import NemotronHForCausalLM  # noqa: E402
from replayserve.sampling_params import SamplingParams  # noqa: E402
from replayserve.structured import StructuredOutputsParams  # noqa: E402
from replayserve.structured.compiler import GrammarCompiler  # noqa: E402
from replayserve.tokenizer import Tokenizer as OurTokenizer  # noqa: E402

RECORD = {"type": "object", "properties": {
    "id": {"type": "integer"},
    "name": {"type": "string", "maxLength": 24},
    "kind": {"type": "string", "enum": ["person", "place", "thing"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    "location": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                 "required": ["lat", "lon"]},
}, "required": ["id", "name", "kind", "tags", "location"]}
SCHEMA = {"type": "object", "properties": {"records": {"type": "array", "items": RECORD, "minItems": 100000}},
          "required": ["records"]}
_PUNCTUATION = ['{"', '"}', '":', '",', '": "', '", "', "},", "],", '["', '"]', "{", "}", "[", "]", ":", ",", '"',
                "null", "true", "false", "\\n", "\\", " {", " [", ' "']


def json_tokenizer(vocab_size: int, seed: int = 0) -> Tokenizer:
    """A byte-level tokenizer of `vocab_size` tokens: `SPECIAL_TOKENS`, the 256 byte symbols, then
    synthetic tokens. No merges: it encodes by bytes, but every id decodes, and xgrammar reads the
    vocabulary as a byte-level BPE's."""
    rng = random.Random(seed)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab.setdefault(symbol, len(vocab))
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    while len(vocab) < vocab_size:
        pick = rng.random()
        if pick < 0.75:
            text = ("" if rng.random() < 0.4 else " ") + "".join(rng.choices(letters, k=rng.randint(2, 10)))
        elif pick < 0.85:
            text = str(rng.randint(0, 99999))
        else:
            text = "".join(rng.choices(_PUNCTUATION, k=rng.randint(1, 3)))
        vocab.setdefault(byte_level.pre_tokenize_str(text)[0][0], len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab, [], unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    return tokenizer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--size", choices=sorted(SIZES), default="nemotron-h-8b")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--backend", choices=["baseline", "replay", "baseline-async", "replay-async"], default="baseline",
                   help="SSM backend; -async: async scheduling (constrained steps overlap too)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=32, help="decode steps per timed window")
    p.add_argument("--warmup", type=int, default=8, help="decode steps before timing")
    p.add_argument("--repeats", type=int, default=3, help="timed windows; medians reported")
    p.add_argument("--window", type=int, help="replay_window of the replay backend (default: the engine's)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--budget", type=int, default=16384, help="max_num_batched_tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="CPU: torch's intra-op threads")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    return args


def decode_rate(model: NemotronHForCausalLM, tokenizer: OurTokenizer, args: argparse.Namespace, batch: int,
                constrained: bool) -> dict:
    """Median decode tok/s of `batch` rows, all constrained by SCHEMA or none; with constraints,
    the grammar's compile time and the host's mask-filling milliseconds per step."""
    device = model.lm_head.weight.device
    sync = sync_fn(device)
    total = args.warmup + args.repeats * args.steps + 2
    config = engine_config(model, args, args.backend, batch, args.prompt_len + total + batch + 8)
    engine = assemble_engine(config, model, tokenizer)
    fill_s = [0.0]
    fill = Grammars._fill

    def timed_fill(self: Grammars, *args: object) -> object:
        t0 = time.perf_counter()
        try:
            return fill(self, *args)
        finally:
            fill_s[0] += time.perf_counter() - t0

    Grammars._fill = timed_fill  # type: ignore[method-assign]
    try:
        so = StructuredOutputsParams(json=SCHEMA) if constrained else None
        params = SamplingParams(temperature=0.0, max_tokens=total + batch, ignore_eos=True, structured_outputs=so)
        prompts = random_prompts(batch, args.prompt_len, model.config.vocab_size, seed=args.seed + batch)
        t0 = time.perf_counter()
        requests = [engine.add_request(p, params) for p in prompts]
        while not all(r.decoding for r in requests):
            engine.step()  # the first waits for the grammar to compile
        sync()
        prefill_s = time.perf_counter() - t0
        for _ in range(args.warmup):
            engine.step()
        fill_s[0] = 0.0
        walls = timed_windows(engine, args.repeats, args.steps, sync)
        if engine.scheduler.num_preemptions or any(r.status is not Status.RUNNING for r in requests):
            raise RuntimeError(f"batch {batch}: a request was preempted or finished while timed")
    finally:
        Grammars._fill = fill  # type: ignore[method-assign]
        del engine
        free_memory(device)
    wall = statistics.median(walls)
    row = {"tok_s": batch * args.steps / wall, "step_ms": 1e3 * wall / args.steps, "walls_s": walls,
           "prefill_s": prefill_s}
    if constrained:
        row["mask_ms_per_step"] = 1e3 * fill_s[0] / (args.repeats * args.steps)
    return row


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    cfg = model_config(args.size)
    model = random_model(cfg, DTYPES[args.dtype], device, seed=args.seed)
    tokenizer = OurTokenizer(json_tokenizer(cfg.vocab_size, args.seed))
    t0 = time.perf_counter()  # what a first request waits: the tokenizer's vocabulary read, then the schema
    GrammarCompiler(tokenizer, cfg.vocab_size, cfg.eos_token_ids).submit(StructuredOutputsParams(json=SCHEMA)).result()
    compile_s = time.perf_counter() - t0
    result: dict = {"meta": {**{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                             "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
                             "vocab_size": cfg.vocab_size, "first_compile_s": compile_s}, "rows": []}
    print(f"{args.size} ({cfg.vocab_size} tokens), {args.dtype}, {result['meta']['device_name']}, {args.backend}; "
          f"first grammar ready in {compile_s:.2f} s")
    print(f"{'batch':>6} {'free tok/s':>11} {'JSON tok/s':>11} {'ratio':>7} {'mask ms/step':>13} {'step ms':>8}")
    for batch in args.batch:
        free = decode_rate(model, tokenizer, args, batch, constrained=False)
        json_row = decode_rate(model, tokenizer, args, batch, constrained=True)
        row = {"batch": batch, "unconstrained": free, "json_schema": json_row,
               "ratio": json_row["tok_s"] / free["tok_s"]}
        result["rows"].append(row)
        print(f"{batch:>6} {free['tok_s']:>11.1f} {json_row['tok_s']:>11.1f} {row['ratio']:>7.3f} "
              f"{json_row['mask_ms_per_step']:>13.3f} {json_row['step_ms']:>8.2f}", flush=True)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
