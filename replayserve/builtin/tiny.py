"""Writes a random tiny model of a supported family in Hugging Face format, with a locally trained tokenizer."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn

from replayserve.config import ATTENTION, GATED_DELTA, MAMBA, MLP, MOE, PATTERN_CHARS, ModelConfig
from replayserve.models.registry import family_of
from replayserve.models.writer import save_model

# make-tiny's --family names: the config.json model_type of each.
TINY_FAMILIES = {"nemotron_h": "nemotron_h", "granite": "granitemoehybrid", "bamba": "bamba", "falcon_h1": "falcon_h1",
                 "qwen3_next": "qwen3_next", "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
_QWEN_ARCHITECTURES = {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM",
                       "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}
# The Gated DeltaNet families' layer pattern characters: G a Gated DeltaNet layer, * a gated attention one.
_QWEN_MIXERS = {"G": GATED_DELTA, "*": ATTENTION}

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


# The MTP layer `make_tiny(mtp=True)` writes: Nemotron-H's attention + MoE blocks; the Qwen
# families' one decoder layer of gated attention and their feed-forward.
MTP_LAYERS = {"nemotron_h": ("full_attention", "moe"), "qwen3_next": ("full_attention", "moe"),
              "qwen3_5": ("full_attention", "mlp"), "qwen3_5_moe": ("full_attention", "moe")}


def tiny_config(layers: str = "M*-ME", vocab_size: int = 512, family: str = "nemotron_h") -> ModelConfig:
    """A small config of `family` (a TINY_FAMILIES name). Granite's layers are M and * only (each
    has the shared MLP and 4 experts); its multipliers differ from 1 and its attention has RoPE,
    so that a test of it sees every one of them."""
    if family not in TINY_FAMILIES:
        raise ValueError(f"--family: unknown family {family!r}; use one of {sorted(TINY_FAMILIES)}")
    qwen = family.startswith("qwen")
    allowed = {"nemotron_h": "".join(PATTERN_CHARS), "falcon_h1": "M"}.get(family, "G*" if qwen else "M*")
    unknown = sorted(set(layers) - set(allowed))
    if unknown:
        raise ValueError(f"--layers: unknown characters {unknown} for family {family}; use {sorted(allowed)}")
    if qwen:  # each layer's feed-forward: Qwen3.5's dense MLP, the others' MoE (Qwen3-Next's first layer dense)
        ffns = [MLP if family == "qwen3_5" or (family == "qwen3_next" and i == 0) else MOE for i in range(len(layers))]
        return ModelConfig(
            layer_types=tuple(t for c, ffn in zip(layers, ffns, strict=True) for t in (_QWEN_MIXERS[c], ffn)),
            model_type=TINY_FAMILIES[family], architectures=(_QWEN_ARCHITECTURES[family],), vocab_size=vocab_size,
            hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
            intermediate_size=192, mlp_hidden_act="silu", layer_norm_epsilon=1e-6, rope_theta=10000.0,
            partial_rotary_factor=0.25, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
            linear_value_head_dim=32, linear_conv_kernel_dim=4, attention_output_gate=True, qk_norm=True,
            n_routed_experts=0 if family == "qwen3_5" else 4, num_experts_per_tok=2, moe_intermediate_size=64,
            moe_shared_expert_intermediate_size=96, moe_shared_expert_gate=family != "qwen3_5",
        )
    if family == "granite":
        return ModelConfig(
            layer_types=tuple(MAMBA if c == "M" else ATTENTION for c in layers), model_type="granitemoehybrid",
            architectures=("GraniteMoeHybridForCausalLM",), vocab_size=vocab_size, hidden_size=128,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
            mlp_hidden_act="silu", mamba_num_heads=8, mamba_head_dim=32, ssm_state_size=16, n_groups=2,
            chunk_size=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
            moe_shared_expert_intermediate_size=96, layer_norm_epsilon=1e-6, embedding_multiplier=2.0,
            residual_multiplier=0.5, logits_scaling=2.0, attention_multiplier=0.125, rope_theta=10000.0,
            dt_limit=(0.0, math.inf),
        )
    if family == "falcon_h1":  # every layer has both mixers: `layers` counts the layers ("M" each)
        return ModelConfig(
            layer_types=(MAMBA, ATTENTION) * len(layers), model_type="falcon_h1",
            architectures=("FalconH1ForCausalLM",), vocab_size=vocab_size, hidden_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, intermediate_size=256,
            mlp_hidden_act="silu", mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2,
            chunk_size=16, n_routed_experts=0, rope_theta=10000.0, dt_limit=(0.0, math.inf),
            embedding_multiplier=1.5, logits_scaling=1.25, ssm_in_multiplier=0.9, ssm_out_multiplier=1.2,
            ssm_multipliers=(1.2, 0.9, 1.1, 0.8, 1.3), attention_in_multiplier=1.1, attention_out_multiplier=0.6,
            key_multiplier=0.9, mlp_multipliers=(0.8, 1.2), mamba_rms_norm=True, mamba_norm_before_gate=True,
        )
    if family == "bamba":
        return ModelConfig(
            layer_types=tuple(MAMBA if c == "M" else ATTENTION for c in layers), model_type="bamba",
            architectures=("BambaForCausalLM",), vocab_size=vocab_size, hidden_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, intermediate_size=256,
            mlp_hidden_act="silu", mamba_num_heads=8, mamba_head_dim=32, ssm_state_size=16, n_groups=2,
            chunk_size=16, n_routed_experts=0, rope_theta=10000.0, partial_rotary_factor=0.5, dt_limit=(0.0, math.inf),
        )
    return ModelConfig(
        layer_types=tuple(PATTERN_CHARS[c] for c in layers),
        vocab_size=vocab_size, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=1024, intermediate_size=256, mamba_num_heads=8, mamba_head_dim=16,
        ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=16, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=64, moe_shared_expert_intermediate_size=64,
    )


@torch.no_grad()
def init_random_weights(model: nn.Module, seed: int) -> None:
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
            std = 1.0 if "embed" in name else 1.5 / math.sqrt(fan_in)
            p.copy_(torch.randn(p.shape, generator=gen) * std)


def make_tiny(out_dir: str | Path, seed: int = 0, layers: str | None = None, family: str = "nemotron_h",
              mtp: bool = False, **sizes: Any) -> Path:
    """Writes config.json, model.safetensors and tokenizer.json to `out_dir`, in the family's
    Hugging Face layout (the files transformers' class of the family loads).

    layers: the layer pattern (default "M*-ME" for Nemotron-H, "MMM" for Falcon-H1, "GG*G" for the Qwen
    families, "M*MM*M" for the others).
    mtp: also write one MTP layer (`mtp.*`) of the family's kind (`MTP_LAYERS`).
    sizes: ModelConfig fields to override (e.g. hidden_size=1024 for a benchmark-sized model).
    """
    if mtp:
        if family not in MTP_LAYERS:
            raise ValueError(f"--mtp: family {family} has no MTP layers; use one of {sorted(MTP_LAYERS)}")
        sizes = {"num_nextn_predict_layers": 1, "mtp_layer_types": MTP_LAYERS[family], **sizes}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    default = {"nemotron_h": "M*-ME", "falcon_h1": "MMM"}.get(family, "GG*G" if family.startswith("qwen") else "M*MM*M")
    pattern = layers if layers is not None else default
    cfg = dataclasses.replace(tiny_config(pattern, tokenizer.get_vocab_size(), family), **sizes)
    model = family_of(cfg).model_class(cfg)
    init_random_weights(model, seed)
    save_model(model, out, torch.float32, max_shard_bytes=2**40)
    tokenizer.save(str(out / "tokenizer.json"))
    return out
