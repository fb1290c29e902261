"""Reference-side helpers: tiny random Nemotron-H checkpoints and Hugging Face transformers outputs.

Hugging Face's ``NemotronHForCausalLM`` is the independent reference our engine is checked against.
This module builds small random checkpoints (with structured, non-degenerate weights), and computes
teacher-forced log-probabilities and greedy continuations with the HF implementation.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GenerationConfig, NemotronHConfig, NemotronHForCausalLM

# Everything is local; never let a test reach for the Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

_F64 = torch.float64

# Fields shared by every tiny config (the known-good base from the project brief).
_BASE: dict = {
    "vocab_size": 512,
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 256,
    "mamba_num_heads": 8,
    "mamba_head_dim": 16,
    "ssm_state_size": 16,
    "n_groups": 2,
    "conv_kernel": 4,
    "expand": 1,
    "chunk_size": 8,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 64,
    "moe_shared_expert_intermediate_size": 64,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# Named tiny configs (kwargs for ``NemotronHConfig``); all well under 1M parameters.
HF_CONFIGS: dict[str, dict] = {
    # The brief's base: Mamba(n_groups=2) / MLP / attention (GQA 4q:2kv) / MLP / Mamba / MoE(4 experts,
    # top-2, 1 shared). chunk_size=8, so every test prompt spans several SSD chunks.
    "hybrid_moe": {
        **_BASE,
        "layers_block_type": [
            "linear_attention",
            "mlp",
            "full_attention",
            "mlp",
            "linear_attention",
            "moe",
        ],
    },
    # Dense only (no MoE), n_groups=1, two attention layers with full MHA (kv heads == q heads),
    # 4 Mamba heads of dim 32, state 32, chunk 16, eps 1e-6. ``expand`` deliberately disagrees with
    # mamba_num_heads * mamba_head_dim: HF ignores ``expand`` for the mixer width.
    "dense_g1": {
        **_BASE,
        "layers_block_type": [
            "linear_attention",
            "full_attention",
            "linear_attention",
            "mlp",
            "full_attention",
            "linear_attention",
            "mlp",
        ],
        "num_key_value_heads": 4,
        "mamba_num_heads": 4,
        "mamba_head_dim": 32,
        "ssm_state_size": 32,
        "n_groups": 1,
        "expand": 2,
        "chunk_size": 16,
        "layer_norm_epsilon": 1e-6,
    },
    # Legacy string pattern (M = Mamba, * = attention, - = MLP, E = MoE), MQA (1 kv head), n_groups=4.
    # Its config.json is rewritten to the old form: ``hybrid_override_pattern`` + ``num_hidden_layers``,
    # no ``layers_block_type``.
    "legacy_pattern": {
        **_BASE,
        "hybrid_override_pattern": "M-M*-ME",
        "num_key_value_heads": 1,
        "n_groups": 4,
    },
    # Grouped expert routing: 8 experts in 2 groups, only the best group is eligible (topk_group=1),
    # top-2 inside it; routed_scaling_factor != 1; attention first, MoE between Mamba layers.
    "moe_grouped": {
        **_BASE,
        "layers_block_type": ["full_attention", "linear_attention", "moe", "linear_attention", "mlp", "moe"],
        "n_routed_experts": 8,
        "n_group": 2,
        "topk_group": 1,
        "num_experts_per_tok": 2,
        "routed_scaling_factor": 2.5,
    },
    # Latent MoE: routed experts run in a 32-dim latent space (fc1/fc2_latent_proj around them), the
    # shared expert runs in hidden space; top-3 of 4 without renormalising the top-k weights.
    "moe_latent": {
        **_BASE,
        "layers_block_type": ["linear_attention", "moe", "full_attention", "linear_attention", "moe"],
        "moe_latent_size": 32,
        "num_experts_per_tok": 3,
        "norm_topk_prob": False,
    },
    # Tied embeddings: the checkpoint has no lm_head.weight; the embedding matrix is the LM head.
    "tied": {
        **_BASE,
        "layers_block_type": ["linear_attention", "full_attention", "mlp", "linear_attention", "moe"],
        "tie_word_embeddings": True,
    },
    # time_step_min raised to 0.05 so that ~20% of the softplus(dt) values fall below it: the
    # (time_step_min, inf) clamp is really exercised (the engine must read time_step_min from config).
    # HF's cached decode path does not clamp, so greedy references here need hf_greedy(use_cache=False).
    "dt_clamp": {
        **_BASE,
        "layers_block_type": ["linear_attention", "mlp", "linear_attention", "full_attention", "linear_attention"],
        "time_step_min": 0.05,
    },
}

# Configs whose perturbed dt values hit the time_step_min clamp (see "dt_clamp" above).
DT_CLAMP_CONFIGS: frozenset[str] = frozenset({"dt_clamp"})

# softplus(dt_bias) is drawn log-uniformly from this range. With the dt rows of in_proj (spread ~0.5 in
# dt_raw) dt stays in ~[0.005, 2]: clear of the default time_step_min=1e-3 (so HF's unclamped decode and
# clamped prefill agree), while about a fifth of the dt values fall below dt_clamp's 0.05.
_DT_RANGE = (0.02, 1.0)


def _normal_(t: torch.Tensor, std: float, mean: float = 0.0) -> None:
    with torch.no_grad():
        t.normal_(mean=mean, std=std)


def _fan_in_normal_(t: torch.Tensor, gain: float = 1.0) -> None:
    """N(0, gain^2 / fan_in): keeps every projection's output O(1) (random init uses std 0.02)."""
    _normal_(t, gain / math.sqrt(t.shape[-1]))


def _inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    return y + torch.log(-torch.expm1(-y))


@torch.no_grad()
def _perturb(model: NemotronHForCausalLM) -> None:
    """Give the random model structure.

    Default init (std 0.02, unit norms, D=1, A_log=log(1..H) identical in every layer, zero router) gives
    near-uniform logits, so greedy parity would be decided by noise, and an engine that ignored a norm
    weight or D would still pass. Here every parameter gets a distinct, O(1)-effect value.
    """
    cfg = model.config
    _normal_(model.model.embeddings.weight, 0.25)
    # logits std ~ 0.25 * sqrt(hidden=128) ~ 3: peaked but not one-hot.
    _normal_(model.lm_head.weight, 0.25)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
            _normal_(p, 0.2, mean=1.0)
        elif ".experts.up_proj" in name or ".experts.down_proj" in name:
            _fan_in_normal_(p)
        elif ".conv1d." in name:
            # weight (conv_dim, 1, K): fan-in is K; bias small but nonzero.
            _normal_(p, 1.0 / math.sqrt(cfg.conv_kernel) if leaf == "weight" else 0.1)
        elif ".gate.weight" in name:
            # Router logits std ~2: sigmoid scores spread over (0, 1), expert choice input dependent.
            _fan_in_normal_(p, gain=2.0)
        elif leaf == "weight" and p.dim() == 2 and "embeddings" not in name and "lm_head" not in name:
            gain = 1.5 if (".q_proj." in name or ".k_proj." in name) else 1.0
            _fan_in_normal_(p, gain=gain)
    for layer in model.model.layers:
        mixer = layer.mixer
        if layer.block_type == "linear_attention":
            heads = mixer.num_heads
            lo, hi = _DT_RANGE
            dt0 = torch.exp(torch.empty(heads).uniform_(math.log(lo), math.log(hi)))
            mixer.dt_bias.copy_(_inverse_softplus(dt0))
            # The dt rows of in_proj are the last `heads` rows; smaller gain keeps dt_raw's spread ~0.5.
            _fan_in_normal_(mixer.in_proj.weight[-heads:], gain=0.5)
            mixer.A_log.copy_(torch.empty(heads).uniform_(math.log(0.5), math.log(8.0)))
            mixer.D.copy_(torch.empty(heads).uniform_(0.5, 1.5))
        elif layer.block_type == "moe":
            # Real checkpoints carry a nonzero selection bias; it affects which experts are chosen but
            # not the routing weights, so a zero bias would hide a bug there.
            _normal_(mixer.gate.e_score_correction_bias, 0.1)


def _to_legacy_config(model_dir: Path) -> None:
    """Rewrite config.json the way older NVIDIA Nemotron-H configs spell the layer layout."""
    cfg_path = model_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    pattern = NemotronHConfig._list_to_pattern(cfg.pop("layers_block_type"))
    cfg["hybrid_override_pattern"] = pattern
    cfg["num_hidden_layers"] = len(pattern)
    cfg.pop("mtp_layers_block_type", None)
    # Old configs write the limit with a bare JSON Infinity (HF 5.24 writes {"__float__": "Infinity"}).
    cfg["time_step_limit"] = [0.0, float("inf")]
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def make_hf_checkpoint(out_dir: str | Path, name: str, seed: int = 0, own_lm_head: bool = False) -> Path:
    """Build, perturb and save the tiny random checkpoint ``name`` (float32) into ``out_dir``.

    ``own_lm_head``: a tied config ("tied") whose checkpoint still stores its own lm_head.weight,
    different from the embedding matrix.
    """
    out_dir = Path(out_dir)
    torch.manual_seed(seed)
    model = NemotronHForCausalLM(NemotronHConfig(**HF_CONFIGS[name])).eval()
    _perturb(model)
    tied = bool(model.config.tie_word_embeddings) and not own_lm_head
    if tied:
        # transformers 5.24's NemotronH never ties (empty _tied_weights_keys); emulate a tied checkpoint.
        with torch.no_grad():
            model.lm_head.weight.copy_(model.model.embeddings.weight)
    model.save_pretrained(out_dir)
    if tied:
        st_path = out_dir / "model.safetensors"
        tensors = load_file(st_path)
        del tensors["lm_head.weight"]
        save_file(tensors, st_path, metadata={"format": "pt"})
    if "hybrid_override_pattern" in HF_CONFIGS[name]:
        _to_legacy_config(out_dir)
    return out_dir


@contextlib.contextmanager
def hf_float64_exact() -> Iterator[None]:
    """Make HF's NemotronH forward really compute in float64 when the model is float64.

    Why: the HF code upcasts "to fp32" for stability (``.float()`` / ``.to(torch.float32)`` /
    ``dtype=torch.float32`` in mamba2_chunk_scan, the RMS norms, the router, attention softmax and
    ``lm_head(...).float()``). For a float64 model these *downcast*, leaving ~1e-7 errors, far above
    the 1e-9 float64 parity we want. While active, ``torch.float32``/``torch.float`` name float64 and
    ``Tensor.float()`` returns float64. Only wrap forward passes (not loading) in it.
    """
    saved_f32, saved_float = torch.float32, torch.float
    own_float = vars(torch.Tensor).get("float")  # normally absent: inherited from the C base class

    def _float(self: torch.Tensor, memory_format: torch.memory_format = torch.preserve_format) -> torch.Tensor:
        return self.to(dtype=_F64, memory_format=memory_format)

    torch.float32 = _F64
    torch.float = _F64
    torch.Tensor.float = _float
    try:
        yield
    finally:
        torch.float32, torch.float = saved_f32, saved_float
        if own_float is None:
            del torch.Tensor.float
        else:
            torch.Tensor.float = own_float


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


@functools.lru_cache(maxsize=4)
def load_hf_model(model_dir: str, dtype: torch.dtype) -> NemotronHForCausalLM:
    """Load (and cache) a checkpoint with HF's class of its family, in ``dtype``; handles Nemotron-H's
    lm_head-less tied checkpoints."""
    # Plain PyTorch ("eager") attention and experts: the default grouped_mm experts kernel rejects
    # float64, and the eager code is the modeling file's own, whose fp32 casts hf_float64_exact handles.
    model = AutoModelForCausalLM.from_pretrained(
        model_dir,
        dtype=dtype,
        local_files_only=True,
        attn_implementation="eager",
        experts_implementation="eager",
    ).eval()
    # generate() refills an eos_token_id=None from the model's generation config, so disable EOS there:
    # our engine's ignore_eos may still *sample* EOS, whereas min_new_tokens would mask its logit.
    model.generation_config.eos_token_id = None
    if model.config.tie_word_embeddings and model.config.model_type == "nemotron_h":
        keys = load_file(Path(model_dir) / "model.safetensors").keys()
        if "lm_head.weight" not in keys:
            # HF would leave lm_head randomly initialised here (it does not tie NemotronH).
            with torch.no_grad():
                model.lm_head.weight.copy_(model.model.embeddings.weight)
    return model


def _forward_ctx(dtype: torch.dtype) -> contextlib.AbstractContextManager:
    return hf_float64_exact() if dtype == _F64 else contextlib.nullcontext()


def hf_teacher_forced_logprobs(model_dir: str | Path, token_ids: list[int], dtype: torch.dtype | str) -> torch.Tensor:
    """log_softmax of HF's logits, shape (len(token_ids), vocab), float64.

    One full forward without cache: every Mamba layer runs HF's chunked scan, which applies the same
    (time_step_min, inf) dt clamp as our engine, so this is the exact reference for prefill and decode.
    Row i is the distribution of the token following token_ids[: i + 1].
    """
    dtype = _as_dtype(dtype)
    model = load_hf_model(str(model_dir), dtype)
    with torch.no_grad(), _forward_ctx(dtype):
        logits = model(input_ids=torch.tensor([token_ids]), use_cache=False).logits[0]
    return torch.log_softmax(logits.to(_F64), dim=-1)


def hf_greedy(
    model_dir: str | Path,
    prompt_ids: list[int],
    max_new_tokens: int,
    dtype: torch.dtype | str,
    use_cache: bool = True,
) -> list[int]:
    """HF ``generate`` greedy continuation: exactly ``max_new_tokens`` new tokens.

    EOS is disabled (see load_hf_model) rather than suppressed, matching ``ignore_eos``.
    ``use_cache=False`` re-runs the full (chunked, dt-clamped) forward each step; needed for
    DT_CLAMP_CONFIGS, where HF's cached decode path skips the clamp.
    """
    dtype = _as_dtype(dtype)
    model = load_hf_model(str(model_dir), dtype)
    gen_cfg = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        pad_token_id=model.config.pad_token_id,
        bos_token_id=model.config.bos_token_id,
        use_cache=use_cache,
    )
    ids = torch.tensor([prompt_ids])
    with torch.no_grad(), _forward_ctx(dtype):
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen_cfg)
    new = out[0, len(prompt_ids) :].tolist()
    assert len(new) == max_new_tokens, (len(new), max_new_tokens)
    return new
