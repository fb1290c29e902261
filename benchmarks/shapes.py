"""Named model shapes for the benchmarks, and random-weight models of them built in memory.

A shape is a layer pattern (`LAYERS`, the `hybrid_override_pattern` alphabet: M Mamba2, * attention,
- MLP, E MoE; for the Qwen families G Gated DeltaNet and * gated attention, each layer with its MLP or
MoE) plus `ModelConfig` fields that replace `replayserve.builtin.tiny.tiny_config`'s (`SIZES`), of the
family `FAMILY` names (Nemotron-H unless it names another; a Granite or Bamba layer is M or *, each
with its MLP; a Falcon-H1 layer is M, with both mixers).
`make_tiny(dir, layers=LAYERS[s], **SIZES[s])` writes one to disk; `random_model` builds one on the
device directly (no checkpoint), which is the only practical way for `nemotron-h-8b`, and
`write_checkpoint` writes what it builds for the benchmarks that need a model directory.
"""

from __future__ import annotations

import dataclasses
import gc
import math
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from replayserve.builtin.tiny import SPECIAL_TOKENS, tiny_config
from replayserve.config import ModelConfig
from replayserve.models.registry import family_of
from replayserve.models.writer import save_model

# Granite's multipliers at 1 and the attention scale at head_dim ** -0.5.
_NEUTRAL = {"embedding_multiplier": 1.0, "residual_multiplier": 1.0, "logits_scaling": 1.0,
            "attention_multiplier": None, "rope_theta": None}

SIZES: dict[str, dict] = {
    "tiny": {},
    # Runs the end-to-end benchmark in seconds on a CPU; 8B-like layer mix, everything narrow.
    "small": {"hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
              "intermediate_size": 1024, "mamba_num_heads": 8, "mamba_head_dim": 32, "ssm_state_size": 32,
              "n_groups": 2, "chunk_size": 32, "max_position_embeddings": 8192},
    # A few hundred million parameters: Nemotron-H-like layer mix, 8B-like Mamba head geometry.
    "medium": {"hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64,
               "intermediate_size": 2048, "mamba_num_heads": 32, "mamba_head_dim": 64, "ssm_state_size": 128,
               "n_groups": 8, "chunk_size": 128, "moe_intermediate_size": 512,
               "moe_shared_expert_intermediate_size": 512, "max_position_embeddings": 8192},
    # nvidia/Nemotron-H-8B-Base-8K: 8.1B parameters, 16.2 GB in bf16.
    "nemotron-h-8b": {"vocab_size": 131072, "hidden_size": 4096, "num_attention_heads": 32,
                      "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 21504,
                      "mamba_num_heads": 128, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8,
                      "conv_kernel": 4, "chunk_size": 128, "max_position_embeddings": 8192},
    # nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B: 31.6B parameters (63 GB in bf16), ~3.5B active per token;
    # 128 routed experts of 1856, top-6 in one group, and a shared expert of 3712 in each MoE layer.
    "nemotron-3-nano-30b-a3b": {"vocab_size": 131072, "hidden_size": 2688, "num_attention_heads": 32,
                                "num_key_value_heads": 2, "head_dim": 128, "intermediate_size": 1856,
                                "mamba_num_heads": 64, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8,
                                "conv_kernel": 4, "chunk_size": 128, "n_routed_experts": 128,
                                "num_experts_per_tok": 6, "moe_intermediate_size": 1856,
                                "moe_shared_expert_intermediate_size": 3712, "routed_scaling_factor": 2.5,
                                "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
                                "max_position_embeddings": 8192},
    # ibm-granite/granite-4.0-h-tiny (7B total, ~1B active): the published config.json's sizes as a
    # public test fixture copies them (hidden 1536, 12 heads over 4 KV heads, 64 experts of 512, top 6,
    # shared MLP 1024, 48 Mamba heads of 64, state 128, one group, chunk 256, vocabulary 100352, tied).
    # NoPE (IBM: Granite 4.0-H has no positional encoding). The multipliers are left neutral: they were
    # not in the sources found, and no timing depends on them.
    "granite-4.0-h-tiny": {"vocab_size": 100352, "hidden_size": 1536, "num_attention_heads": 12,
                           "num_key_value_heads": 4, "head_dim": 128, "n_routed_experts": 64,
                           "num_experts_per_tok": 6, "moe_intermediate_size": 512,
                           "moe_shared_expert_intermediate_size": 1024, "mamba_num_heads": 48,
                           "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 1, "chunk_size": 256,
                           "tie_word_embeddings": True, "max_position_embeddings": 131072, **_NEUTRAL},
    # ibm-granite/granite-4.0-h-small (32B total, 9B active): hidden 4096, 32 heads over 8 KV heads,
    # 72 experts of 768, top 10, shared MLP 1536, state 128, mamba_expand 2, vocabulary 100352, tied
    # (the config.json fields a public write-up quotes); 36 Mamba2 and 4 attention layers at 5, 15,
    # 25, 35 (a public GGUF card). Mamba heads of 64 (128 heads = 2 * 4096 / 64) and one group as the
    # Tiny's: assumed, not seen in a source.
    "granite-4.0-h-small": {"vocab_size": 100352, "hidden_size": 4096, "num_attention_heads": 32,
                            "num_key_value_heads": 8, "head_dim": 128, "n_routed_experts": 72,
                            "num_experts_per_tok": 10, "moe_intermediate_size": 768,
                            "moe_shared_expert_intermediate_size": 1536, "mamba_num_heads": 128,
                            "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 1, "chunk_size": 256,
                            "tie_word_embeddings": True, "max_position_embeddings": 131072, **_NEUTRAL},
    # ibm-ai-platform/Bamba-9B: 32 layers, attention at 9, 18, 27, hidden 4096, 32 heads, state 128
    # (the config.json fields a public fixture copies); 8 KV heads, MLP 14336, 128 Mamba heads of 64,
    # one group, chunk 256, vocabulary 128256 and RoPE on half of each head: transformers' BambaConfig
    # defaults and our memory of the card, not seen in a source here.
    "bamba-9b": {"vocab_size": 128256, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "head_dim": 128, "intermediate_size": 14336, "mamba_num_heads": 128, "mamba_head_dim": 64,
                 "ssm_state_size": 128, "n_groups": 1, "chunk_size": 256, "max_position_embeddings": 262144},
    # tiiuae/Falcon-H1-7B: 44 layers, each with both mixers; hidden 3072, 12 heads of 128 over 2 KV heads,
    # MLP 12288, 24 Mamba heads of 128 (mamba_d_ssm 3072), state 256, one group, chunk 128, vocabulary
    # 130048, untied (the published config.json's sizes as a public test fixture copies them). Its muP
    # multipliers were not in that source: neutral here, as the SSM norm's placement (after the gate).
    "falcon-h1-7b": {"vocab_size": 130048, "hidden_size": 3072, "num_attention_heads": 12, "num_key_value_heads": 2,
                     "head_dim": 128, "intermediate_size": 12288, "mamba_num_heads": 24, "mamba_head_dim": 128,
                     "ssm_state_size": 256, "n_groups": 1, "chunk_size": 128, "max_position_embeddings": 262144,
                     "embedding_multiplier": 1.0, "logits_scaling": 1.0, "ssm_in_multiplier": 1.0,
                     "ssm_out_multiplier": 1.0, "ssm_multipliers": (), "attention_in_multiplier": 1.0,
                     "attention_out_multiplier": 1.0, "key_multiplier": 1.0, "mlp_multipliers": (),
                     "mamba_norm_before_gate": False},
    # The Gated DeltaNet hybrids: three GDN layers to one gated attention layer. A CPU-sized Qwen3.5 for the
    # smoke tests (tiny_config's GDN geometry, 8 layers).
    "qwen3.5-small": {"max_position_embeddings": 8192},
    # Qwen/Qwen3.5-9B (text_config of the published config.json, as public copies and the model card give it):
    # hidden 4096, MLP 12288, 32 layers, gated attention 16 heads over 4 KV heads of 256 with RoPE on 64 of them,
    # GDN 16 key heads and 32 value heads of 128, conv 4, vocabulary 248320 (padded). RoPE theta 1e7 (a GGUF
    # card's freq_base) and untied embeddings: assumed, not seen in the config.json itself.
    "qwen3.5-9b": {"vocab_size": 248320, "hidden_size": 4096, "num_attention_heads": 16, "num_key_value_heads": 4,
                   "head_dim": 256, "intermediate_size": 12288, "partial_rotary_factor": 0.25, "rope_theta": 1e7,
                   "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                   "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "max_position_embeddings": 262144,
                   "tie_word_embeddings": False},
    # Qwen/Qwen3.5-35B-A3B (the model card): hidden 2048, 40 layers, gated attention 16 heads over 2 KV heads of
    # 256 (RoPE on 64), GDN 16 key / 32 value heads of 128, 256 experts of 512, top 8, one shared expert of 512
    # (sigmoid-gated), vocabulary 248320. 35B parameters: ~70 GB in bf16, which leaves an H100 ~8 GB. RoPE theta
    # 1e7 and untied embeddings assumed as for the 9B. (Qwen3-Next-80B-A3B, 160 GB in bf16, fits no single card.)
    "qwen3.5-35b-a3b": {"vocab_size": 248320, "hidden_size": 2048, "num_attention_heads": 16,
                        "num_key_value_heads": 2, "head_dim": 256, "partial_rotary_factor": 0.25, "rope_theta": 1e7,
                        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "n_routed_experts": 256,
                        "num_experts_per_tok": 8, "moe_intermediate_size": 512,
                        "moe_shared_expert_intermediate_size": 512, "norm_topk_prob": True,
                        "max_position_embeddings": 262144, "tie_word_embeddings": False},
}
LAYERS: dict[str, str] = {
    "tiny": "M*-ME",
    "small": "M-M-M*-M-M-M*-",
    "medium": "M-M*-M-M*-ME",
    # 24 Mamba2, 24 MLP, 4 attention layers (the checkpoint's hybrid_override_pattern).
    "nemotron-h-8b": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    # 23 Mamba2, 23 MoE, 6 attention layers.
    "nemotron-3-nano-30b-a3b": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
    # 40 layers: attention at 5, 15, 25, 35.
    "granite-4.0-h-tiny": "MMMMM*MMMMMMMMM*MMMMMMMMM*MMMMMMMMM*MMMM",
    "granite-4.0-h-small": "MMMMM*MMMMMMMMM*MMMMMMMMM*MMMMMMMMM*MMMM",
    # 32 layers: attention at 9, 18, 27.
    "bamba-9b": "MMMMMMMMM*MMMMMMMM*MMMMMMMM*MMMM",
    # 44 layers, each a Mamba2 and an attention mixer side by side.
    "falcon-h1-7b": "M" * 44,
    # G Gated DeltaNet, * gated attention: every fourth layer attends (full_attention_interval 4).
    "qwen3.5-small": "GGG*" * 2,
    "qwen3.5-9b": "GGG*" * 8,
    "qwen3.5-35b-a3b": "GGG*" * 10,
}
# The family of each shape that is not Nemotron-H (a make-tiny --family name).
FAMILY: dict[str, str] = {"granite-4.0-h-tiny": "granite", "granite-4.0-h-small": "granite", "bamba-9b": "bamba",
                          "falcon-h1-7b": "falcon_h1", "qwen3.5-small": "qwen3_5", "qwen3.5-9b": "qwen3_5",
                          "qwen3.5-35b-a3b": "qwen3_5_moe"}


def model_config(size: str) -> ModelConfig:
    """The ModelConfig of a named shape (vocabulary 512 unless the shape sets one)."""
    if size not in SIZES:
        raise ValueError(f"unknown model shape {size!r}; known: {sorted(SIZES)}")
    return dataclasses.replace(tiny_config(LAYERS[size], family=FAMILY.get(size, "nemotron_h")), **SIZES[size])


@torch.no_grad()
def random_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                 seed: int = 0, fold: bool = True) -> torch.nn.Module:
    """A model of `cfg` with random weights, allocated and drawn on `device`.

    The value rules are `replayserve.builtin.tiny.init_random_weights`'s (unit norms and D, A_log = log(1..H),
    log-uniform time steps, fan-in scaled matrices), drawn with a generator on the device: the CPU
    generator that function uses takes minutes for 8B parameters.
    """
    device = torch.device(device)
    with torch.device("meta"):
        model = family_of(cfg).model_class(cfg)
    model.allocate_(device, dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.backbone.embeddings.weight
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith(("norm.weight", "norm_f.weight", ".D")):
            p.fill_(1.0)
        elif name.endswith("A_log"):
            p.copy_(torch.log(torch.arange(1, p.numel() + 1, dtype=torch.float32, device=device)))
        elif name.endswith("dt_bias"):
            lo, hi = math.log(1e-3), math.log(0.1)
            dt = torch.exp(torch.rand(p.shape, generator=gen, device=device) * (hi - lo) + lo)
            p.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1
        elif name.endswith("bias"):
            p.zero_()
        else:
            std = 1.0 if "embed" in name else 1.5 / math.sqrt(p.shape[-1] if p.dim() > 1 else 1)
            p.normal_(0.0, std, generator=gen)
    for buffer in model.buffers():  # to_empty leaves them uninitialised (MoE score-correction bias)
        buffer.zero_()
    if fold and hasattr(model, "prepare_weights_"):  # as the loader does (layers/fold.py); not for a checkpoint
        model.prepare_weights_()
    return model.eval()


def word_tokenizer(vocab_size: int) -> Tokenizer:
    """A word-level tokenizer of `vocab_size` tokens: `SPECIAL_TOKENS`, then token i is "t{i}" (decoded
    tokens are joined by spaces), so every id a random model samples decodes to some text."""
    vocab = {name: i for i, name in enumerate(SPECIAL_TOKENS)}
    vocab |= {f"t{i}": i for i in range(len(SPECIAL_TOKENS), vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_TOKENS[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    return tokenizer


def write_checkpoint(size: str, out_dir: str | Path, dtype: torch.dtype, device: torch.device | str,
                     seed: int = 0) -> Path:
    """A model directory for the shape `size` that `LLM` and `replayserve serve` load: `random_model`'s
    weights (drawn on `device`) as `dtype` safetensors shards of at most 4 GiB, config.json and
    `word_tokenizer`'s tokenizer.json. A directory whose config.json and tokenizer.json are already
    this shape's is kept as it is (Nemotron-H-8B in bfloat16 is 16 GB to write)."""
    out = Path(out_dir)
    cfg = model_config(size)
    config_path, tokenizer_path = out / "config.json", out / "tokenizer.json"
    if (config_path.is_file() and tokenizer_path.is_file()
            and ModelConfig.from_dir(out) == cfg and Tokenizer.from_file(str(tokenizer_path)).get_vocab_size() ==
            cfg.vocab_size):
        return out
    model = random_model(cfg, dtype, device, seed, fold=False)
    save_model(model, out, dtype, max_shard_bytes=4 << 30)
    word_tokenizer(cfg.vocab_size).save(str(tokenizer_path))
    del model
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # the engines that load the directory get the memory back
    return out
