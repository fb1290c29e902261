"""Writes a random tiny Nemotron-H in Hugging Face format, with a locally trained tokenizer."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from replayserve.config import PATTERN_CHARS, ModelConfig
from replayserve.models.nemotron_h import NemotronHForCausalLM

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2, as the model config expects

# A small built-in corpus, so the tokenizer trains offline and identically everywhere.
_CORPUS = """\
Hybrid language models mix state-space layers with attention. A Mamba2 layer keeps a recurrent
state that it updates for every token, while an attention layer reads the keys and values of all
earlier tokens from a paged cache. Serving such a model means batching many requests at once,
splitting long prompts into chunks, and keeping one state slot for every running request.
The quick brown fox jumps over the lazy dog. Once upon a time there was a small model that
learned to write stories about rivers, mountains, cities and the people who lived in them.
def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Questions? Answers! Lists, commas; colons: quotes "x".
"""


def train_tokenizer(vocab_size: int = 512, texts: Iterable[str] | None = None) -> Tokenizer:
    """A byte-level BPE tokenizer trained on `texts` (default: the built-in corpus's lines), with
    `SPECIAL_TOKENS` first; deterministic for the same texts."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines() if texts is None else texts, trainer=trainer)
    return tok


def tiny_config(layers: str = "M*-ME", vocab_size: int = 512) -> ModelConfig:
    unknown = sorted(set(layers) - set(PATTERN_CHARS))
    if unknown:
        raise ValueError(f"--layers: unknown characters {unknown}; use {sorted(PATTERN_CHARS)}")
    return ModelConfig(
        layer_types=tuple(PATTERN_CHARS[c] for c in layers),
        vocab_size=vocab_size, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=1024, intermediate_size=256, mamba_num_heads=8, mamba_head_dim=16,
        ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=16, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=64, moe_shared_expert_intermediate_size=64,
    )


@torch.no_grad()
def init_random_weights(model: NemotronHForCausalLM, seed: int) -> None:
    """Random weights with enough scale that greedy text is not one repeated token."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or name.endswith("norm_f.weight") or name.endswith(".D"):
            p.fill_(1.0)
        elif name.endswith("A_log"):
            p.copy_(torch.log(torch.arange(1, p.numel() + 1, dtype=p.dtype)))
        elif name.endswith("dt_bias"):
            # softplus^-1 of time steps spread log-uniformly over [1e-3, 1e-1]
            dt = torch.exp(torch.rand(p.shape, generator=gen) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            p.copy_(dt + torch.log(-torch.expm1(-dt)))
        elif name.endswith("bias"):
            p.zero_()
        else:
            fan_in = p.shape[-1] if p.dim() > 1 else 1
            std = 1.0 if "embeddings" in name else 1.5 / math.sqrt(fan_in)
            p.copy_(torch.randn(p.shape, generator=gen) * std)


def make_tiny(out_dir: str | Path, seed: int = 0, layers: str = "M*-ME", **sizes: int) -> Path:
    """Writes config.json, model.safetensors and tokenizer.json to `out_dir`.

    sizes: ModelConfig fields to override (e.g. hidden_size=1024 for a benchmark-sized model).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    cfg = dataclasses.replace(tiny_config(layers, vocab_size=tokenizer.get_vocab_size()), **sizes)
    model = NemotronHForCausalLM(cfg)
    init_random_weights(model, seed)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        del state["lm_head.weight"]  # the checkpoint holds the shared matrix once
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
    tokenizer.save(str(out / "tokenizer.json"))
    return out
