"""Trains the built-in model `replayserve/tiny-code`: a small hybrid Nemotron-H (Mamba2, attention,
MLP and MoE layers) with one MTP layer, on the Python standard library's own source.

Corpus (`replayserve/training/corpus.py`): the stdlib's `*.py` files in sorted order, every 20th
held out; a byte-level BPE tokenizer trained on the rest. Training: our own model class through
the differentiable batched forward of `replayserve/training/forward.py`; next-token loss plus 0.3 x
the MTP layer's next-next-token loss; AdamW, linear warm-up then cosine decay, gradient clipping,
auxiliary-loss-free expert balancing; bf16 autocast on CUDA. Windows are drawn from a generator
seeded by (seed, step), so a resumed run sees the batches an uninterrupted one would (bitwise
equality on CUDA is not promised: some backward kernels use atomics).

The work directory (`--out`) keeps the tokenizer, the token streams, `ckpt.pt` (weights, optimizer,
step) and `log.jsonl`. Every run stops itself within `--minutes` of wall time (checkpoint
included), and ends by exporting the current weights to `OUT/model/` in Hugging Face layout: bf16
shards of at most 16 MB, `tokenizer.json`, `tokenizer_config.json`, `heldout_sample.json` and
`eval.json` (held-out perplexity and function-header share, measured with this engine on CPU in
float32, which the package's tests check). `--install` copies that directory over
`replayserve/builtin/tiny_code_checkpoint/`. It prints `done` once every step has run.

The shipped weights (NVIDIA H200, 16 CPU cores), from the repository root; run the same command
until it prints `done` (each run resumes from `ckpt.pt`, the first starts fresh):

    python scripts/train_default_model.py --preset h200 --seed 0 --out runs/tiny-code --minutes 9 --resume

The first run also builds the tokenizer and token streams (about a minute); each logs tokens/s and
the minutes left (`eta_min`) every 10 steps. Then replace the package's files with the export:
`rm replayserve/builtin/tiny_code_checkpoint/* &&
cp runs/tiny-code/model/* replayserve/builtin/tiny_code_checkpoint/` (or
add `--install` to the last run), and set `MIN_HEADER_SHARE` in tests/builtin/test_tiny_code.py from the
new `eval.json`. The shipped weights came from one run on 2026-12-04 (torch 2.11, Python 3.12.3's
stdlib: 2.7M training tokens, 8 passes = 659 steps): `--minutes 6.5` (tokenizer and streams ~1 min,
104 s of training at ~210k tokens/s; held-out perplexity 12.1, 43 of 64 held-out function headers
Python). The 4-pass weights before them (330 steps, 55 s) had perplexity 14.4 and 9 of 24 headers.
The CPU placeholder shipped before them (2 shared cores, one thread: 50 minutes, stopped at step
1,995 by the budget and finished by a second run with `--resume`):

    OMP_NUM_THREADS=1 python scripts/train_default_model.py --preset cpu --seed 0 --out runs/tiny-code-cpu \
        --minutes 50 --resume --install
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from replayserve.builtin.tiny import SPECIAL_TOKENS, train_tokenizer  # noqa: E402
from replayserve.builtin.tiny_code import (  # noqa: E402
    CODE_CHAT_TEMPLATE,
    EVAL_RESULTS,
    HELDOUT_SAMPLE,
    TINY_CODE_DIR,
    completes_as_python,
    function_headers,
    heldout_perplexity,
    heldout_texts,
    perplexity_windows,
)
from replayserve.builtin.training.corpus import (  # noqa: E402
    corpus_files,
    read_texts,
    split_files,
    stdlib_root,
    token_stream,
    write_heldout_sample,
)
from replayserve.builtin.training.forward import balance_experts_, losses  # noqa: E402
from replayserve.config import PATTERN_CHARS, ModelConfig  # noqa: E402
from replayserve.models.nemotron_h import NemotronHForCausalLM  # noqa: E402
from replayserve.models.writer import save_model  # noqa: E402

EOS_ID = SPECIAL_TOKENS.index("</s>")
HELDOUT_EVERY = 20
MAX_SHARD_BYTES = 16 * 10**6
# What eval.json records and tests/builtin/test_tiny_code.py re-measures on the shipped weights.
PPL_FILES, PPL_TOKENS = 16, 256
HEADERS, HEADER_TOKENS = 64, 96


@dataclasses.dataclass(frozen=True)
class Preset:
    """Model shape and training schedule."""

    layers: str  # M Mamba2, * attention, - MLP, E MoE
    mtp_layers: str
    vocab_size: int
    hidden_size: int
    heads: int
    head_dim: int
    intermediate_size: int
    mamba_heads: int
    moe_intermediate_size: int
    experts: int
    seq_len: int
    batch_size: int
    steps: int | None  # None: `passes` over the training tokens, rounded up to whole steps
    lr: float
    warmup: int
    eval_every: int
    checkpoint_every: int
    passes: float = 0.0

    def model_config(self) -> ModelConfig:
        return ModelConfig(
            layer_types=tuple(PATTERN_CHARS[c] for c in self.layers), vocab_size=self.vocab_size,
            hidden_size=self.hidden_size, num_attention_heads=self.heads, num_key_value_heads=2,
            head_dim=self.head_dim, max_position_embeddings=4096, intermediate_size=self.intermediate_size,
            mamba_num_heads=self.mamba_heads, mamba_head_dim=64, ssm_state_size=64, n_groups=2, conv_kernel=4,
            chunk_size=64, n_routed_experts=self.experts, num_experts_per_tok=2,
            moe_intermediate_size=self.moe_intermediate_size,
            moe_shared_expert_intermediate_size=self.moe_intermediate_size, tie_word_embeddings=False,
            num_nextn_predict_layers=1, mtp_layer_types=tuple(PATTERN_CHARS[c] for c in self.mtp_layers),
        )


PRESETS = {
    # 18.5M parameters (37 MB in bf16); 8 passes over the training tokens in steps of 32 x 1,024
    # tokens: ~2,200 steps for the ~8.9M tokens of CPython 3.11's stdlib, ~660 for one without its
    # test suite (as some distributions ship it: the H200 box's 3.12 has 2.7M tokens). 4 passes
    # (330 steps there) left 9 of 24 held-out headers Python.
    "h200": Preset(layers="M-M*EM-M*EM", mtp_layers="*E", vocab_size=8192, hidden_size=384, heads=6, head_dim=64,
                   intermediate_size=768, mamba_heads=10, moe_intermediate_size=256, experts=8, seq_len=1024,
                   batch_size=32, steps=None, passes=8.0, lr=2e-3, warmup=100, eval_every=100,
                   checkpoint_every=100),
    # The placeholder: 3.1M parameters, 2,000 steps of 8 x 256 tokens (4.1M tokens, half a pass); 15
    # minutes on two idle CPU cores, 50 on two shared ones.
    "cpu": Preset(layers="M-M*EM", mtp_layers="*E", vocab_size=4096, hidden_size=192, heads=4, head_dim=48,
                  intermediate_size=384, mamba_heads=4, moe_intermediate_size=128, experts=4, seq_len=256,
                  batch_size=8, steps=2000, lr=3e-3, warmup=50, eval_every=250, checkpoint_every=250),
}


def log(work: Path, record: dict) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    with (work / "log.jsonl").open("a") as f:
        f.write(line + "\n")


def prepare_corpus(work: Path, vocab_size: int) -> tuple[Tokenizer, torch.Tensor, torch.Tensor]:
    """The tokenizer and the training / held-out token streams, built once per work directory."""
    cache = work / "tokens.pt"
    if cache.is_file():
        data = torch.load(cache)
        tokenizer = Tokenizer.from_file(str(work / "tokenizer.json"))
        if tokenizer.get_vocab_size() != vocab_size:
            sys.exit(f"{work} holds a tokenizer of {tokenizer.get_vocab_size()} tokens, this preset wants "
                     f"{vocab_size}; use another --out")
        return tokenizer, data["train"], data["heldout"]
    root = stdlib_root()
    train_files, heldout_files = split_files(corpus_files(root), HELDOUT_EVERY)
    train_texts, heldout = read_texts(root, train_files), read_texts(root, heldout_files)
    tokenizer = train_tokenizer(vocab_size, train_texts)
    tokenizer.save(str(work / "tokenizer.json"))
    write_heldout_sample(work / HELDOUT_SAMPLE, heldout_files, heldout, max_chars_per_file=4000, max_chars=240_000)
    train, held = token_stream(tokenizer, train_texts, EOS_ID), token_stream(tokenizer, heldout, EOS_ID)
    torch.save({"train": train, "heldout": held, "root": str(root), "train_files": train_files,
                "heldout_files": heldout_files}, cache)
    log(work, {"corpus": str(root), "train_files": len(train_files), "heldout_files": len(heldout_files),
               "train_tokens": len(train), "heldout_tokens": len(held),
               "bytes_per_token": sum(len(t.encode()) for t in train_texts) / len(train)})
    return tokenizer, train, held


@torch.no_grad()
def init_weights_(model: NemotronHForCausalLM, seed: int) -> None:
    """GPT-style init: N(0, 0.02), output projections scaled by 1/sqrt(2 * layers), norms 1;
    Mamba decays A in [1, 16] and time steps in [1e-3, 1e-1] as in Mamba2."""
    gen = torch.Generator().manual_seed(seed)
    depth = len(model.config.layer_types) + len(model.config.mtp_layer_types)
    for name, p in model.named_parameters():
        if name.endswith(("norm.weight", "norm_f.weight", "layernorm.weight", ".D")):
            p.fill_(1.0)
        elif name.endswith("A_log"):
            p.copy_(torch.log(torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen)))
        elif name.endswith("dt_bias"):
            dt = torch.exp(torch.empty(p.shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
            p.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1
        elif name.endswith("bias"):
            p.zero_()
        elif "conv1d" in name:
            p.copy_(torch.empty(p.shape).uniform_(-0.5, 0.5, generator=gen))
        else:
            std = 0.02 / math.sqrt(2 * depth) if name.endswith(("out_proj.weight", "o_proj.weight",
                                                                 "down_proj.weight")) else 0.02
            p.copy_(torch.randn(p.shape, generator=gen) * std)


def make_optimizer(model: NemotronHForCausalLM, preset: Preset, device: torch.device) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and ".gate." not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and ".gate." not in n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=preset.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def lr_at(step: int, preset: Preset) -> float:
    if step < preset.warmup:
        return preset.lr * (step + 1) / preset.warmup
    progress = (step - preset.warmup) / max(1, preset.steps - preset.warmup)
    return preset.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def windows(stream: torch.Tensor, starts: torch.Tensor, length: int, device: torch.device) -> torch.Tensor:
    """(B, length + 1) int64 windows of `stream` at `starts`."""
    return stream[starts[:, None] + torch.arange(length + 1)].long().to(device, non_blocking=True)


@torch.no_grad()
def heldout_loss(model: NemotronHForCausalLM, held: torch.Tensor, preset: Preset, device: torch.device,
                 autocast: bool) -> dict[str, float]:
    """Mean main and MTP losses over 64 evenly spaced held-out windows."""
    model.eval()
    starts = torch.linspace(0, len(held) - preset.seq_len - 2, 64).long()
    main, mtp = [], []
    for chunk in starts.split(preset.batch_size):
        with torch.autocast(device.type, torch.bfloat16, enabled=autocast):
            out = losses(model, windows(held, chunk, preset.seq_len, device))
        main.append(float(out.main) * len(chunk))
        mtp.append(float(out.mtp or 0.0) * len(chunk))
    model.train()
    return {"heldout_loss": sum(main) / len(starts), "heldout_mtp_loss": sum(mtp) / len(starts)}


def export(model: NemotronHForCausalLM, work: Path, summary: dict) -> Path:
    """Writes OUT/model/ (weights, tokenizer, held-out sample) and measures eval.json with the engine."""
    from replayserve import LLM, SamplingParams

    out = work / "model"
    shutil.rmtree(out, ignore_errors=True)
    save_model(model, out, torch.bfloat16, MAX_SHARD_BYTES)
    shutil.copy(work / "tokenizer.json", out / "tokenizer.json")
    shutil.copy(work / HELDOUT_SAMPLE, out / HELDOUT_SAMPLE)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
        "model_max_length": model.config.max_position_embeddings, "clean_up_tokenization_spaces": False,
        "chat_template": CODE_CHAT_TEMPLATE}, indent=2))
    llm = LLM(model=str(out), dtype="float32", device="cpu", max_num_seqs=HEADERS)
    texts = heldout_texts(out)
    ppl = heldout_perplexity(llm, perplexity_windows(llm, texts, PPL_FILES, PPL_TOKENS))
    headers = function_headers(texts, HEADERS)
    outs = llm.generate(headers, SamplingParams(temperature=0.0, max_tokens=HEADER_TOKENS), use_tqdm=False)
    parsed = [completes_as_python(h, o.outputs[0].text) for h, o in zip(headers, outs, strict=True)]
    result = {
        "heldout_perplexity": {"value": ppl, "files": PPL_FILES, "tokens_per_file": PPL_TOKENS,
                               "dtype": "float32", "device": "cpu"},
        "function_headers": {"share": sum(parsed) / len(parsed), "count": len(parsed), "max_tokens": HEADER_TOKENS},
        "training": summary,
    }
    (out / EVAL_RESULTS).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{headers[0]}{outs[0].outputs[0].text}\n---", flush=True)
    return out


def install(exported: Path) -> None:
    """Replaces the package's tiny_code_checkpoint/ files with the export (old shards removed first)."""
    TINY_CODE_DIR.mkdir(parents=True, exist_ok=True)
    for old in TINY_CODE_DIR.iterdir():
        old.unlink()
    for f in exported.iterdir():
        shutil.copy(f, TINY_CODE_DIR / f.name)
    print(f"installed {exported} -> {TINY_CODE_DIR}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), required=True)
    parser.add_argument("--out", type=Path, required=True, help="work directory (checkpoint, logs, export)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--minutes", type=float, default=9.0, help="wall-clock budget of this run, export included")
    parser.add_argument("--resume", action="store_true", help="continue from OUT/ckpt.pt when there is one")
    parser.add_argument("--steps", type=int, help="total steps (default: the preset's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--install", action="store_true",
                        help="copy the export into replayserve/builtin/tiny_code_checkpoint/")
    parser.add_argument("--reserve-s", type=float, default=90.0,
                        help="seconds of the budget kept for the checkpoint, export and evaluation")
    args = parser.parse_args()
    start = time.perf_counter()
    preset = PRESETS[args.preset]
    device = torch.device(args.device)
    autocast = device.type == "cuda"
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    args.out.mkdir(parents=True, exist_ok=True)
    ckpt_path = args.out / "ckpt.pt"
    if ckpt_path.exists() and not args.resume:
        sys.exit(f"{ckpt_path} exists: pass --resume to continue it, or another --out")

    tokenizer, train, held = prepare_corpus(args.out, preset.vocab_size)
    steps = args.steps or preset.steps or math.ceil(preset.passes * len(train) / (preset.batch_size * preset.seq_len))
    preset = dataclasses.replace(preset, steps=steps)
    cfg = dataclasses.replace(preset.model_config(), vocab_size=tokenizer.get_vocab_size())
    torch.manual_seed(args.seed)
    model = NemotronHForCausalLM(cfg)
    init_weights_(model, args.seed)
    model.to(device).train()
    optimizer = make_optimizer(model, preset, device)
    step, trained_s = 0, 0.0
    if ckpt_path.exists():
        state = torch.load(ckpt_path, map_location=device)
        now = dataclasses.asdict(preset)
        if any(now.get(k) != v for k, v in state["preset"].items()) or state["seed"] != args.seed:
            sys.exit(f"{ckpt_path} was written with another preset or seed; use another --out")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, trained_s = state["step"], state["trained_s"]
    params = sum(p.numel() for p in model.parameters())
    log(args.out, {"preset": args.preset, "seed": args.seed, "params": params, "step": step, "steps": preset.steps,
                   "device": str(device), "torch": torch.__version__})

    def save(step: int, trained_s: float) -> None:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                 "trained_s": trained_s, "preset": dataclasses.asdict(preset), "seed": args.seed}
        torch.save(state, args.out / "ckpt.tmp")
        os.replace(args.out / "ckpt.tmp", ckpt_path)

    budget = args.minutes * 60 - args.reserve_s
    tokens_per_step = preset.batch_size * preset.seq_len
    slowest, loop_start = 0.0, time.perf_counter()
    last_t, last_step = loop_start, step
    while step < preset.steps and time.perf_counter() - start + 2 * slowest < budget:
        t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, preset)
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
        starts = torch.randint(0, len(train) - preset.seq_len - 1, (preset.batch_size,), generator=gen)
        with torch.autocast(device.type, torch.bfloat16, enabled=autocast):
            out = losses(model, windows(train, starts, preset.seq_len, device))
        optimizer.zero_grad(set_to_none=True)
        out.total.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        balance_experts_(model, out.expert_load, rate=1e-3)
        step += 1
        if step % 10 == 0 or step == preset.steps:
            record = {"step": step, "loss": out.main.item(), "mtp_loss": 0.0 if out.mtp is None else out.mtp.item(),
                      "grad_norm": float(grad_norm), "lr": lr_at(step - 1, preset)}
            per_step = (time.perf_counter() - last_t) / (step - last_step)
            record |= {"tokens_per_s": round(tokens_per_step / per_step),
                       "eta_min": round((preset.steps - step) * per_step / 60, 1)}
            if step % preset.eval_every == 0 or step == preset.steps:
                record |= heldout_loss(model, held, preset, device, autocast)
            log(args.out, record)
            last_t, last_step = time.perf_counter(), step  # evaluation is not training time
        if step % preset.checkpoint_every == 0:
            save(step, trained_s + time.perf_counter() - loop_start)
        slowest = max(slowest, time.perf_counter() - t0)
    trained_s += time.perf_counter() - loop_start
    save(step, trained_s)
    summary = {"preset": args.preset, "seed": args.seed, "step": step, "steps": preset.steps, "params": params,
               "train_tokens_seen": step * preset.batch_size * preset.seq_len, "train_s": round(trained_s),
               "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               **heldout_loss(model, held, preset, device, autocast)}
    exported = export(model.cpu().float(), args.out, summary)
    log(args.out, {"exported": str(exported), **json.loads((exported / EVAL_RESULTS).read_text())})
    if args.install:
        install(exported)
    print("done" if step >= preset.steps else f"stopped at step {step} of {preset.steps}: run again with --resume")


if __name__ == "__main__":
    main()
