"""Typed, frozen configuration of the model, from a Hugging Face `config.json`.

Every combination is validated at construction; an error names the option that is wrong and
what is allowed. The engine's and speculation's configs are in `engine.py`.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replayserve.config.checks import ConfigError, check_field_types, check_minimums
from replayserve.config.hf_families import BAMBA, FALCON_H1, FAMILY_FIELDS, FROM_HF, GRANITE, TO_HF
from replayserve.config.hf_qwen import QWEN_TYPES

# "linear_attention" is a Mamba2 mixer (Nemotron-H's name); "gated_delta" a Gated DeltaNet mixer
# (Qwen3-Next and Qwen3.5 call theirs "linear_attention": config/hf_qwen.py renames it).
LAYER_TYPES = ("linear_attention", "full_attention", "mlp", "moe", "gated_delta")
MAMBA, ATTENTION, MLP, MOE, GATED_DELTA = LAYER_TYPES
# The legacy one-character layer pattern (`hybrid_override_pattern`).
PATTERN_CHARS = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}

DTYPES = ("float32", "float64", "bfloat16", "float16")
DEVICES = ("cpu", "cuda")
SSM_BACKENDS = ("baseline", "replay")
MAMBA_CACHE_MODES = ("none", "align", "all")
# The Triton ReplaySSM step holds the ring in one tile of next_pow2(R) entries.
MAX_REPLAY_WINDOW = 64

# Keys every Hugging Face config may carry that do not change the computation.
_IGNORED_HF_KEYS = frozenset(
    {
        "dtype", "torch_dtype", "transformers_version", "_name_or_path",
        "auto_map", "use_cache", "num_logits_to_keep", "initializer_range", "rescale_prenorm_residual",
        "hidden_dropout", "attention_dropout", "use_mamba_kernels", "time_step_max",
        "time_step_floor", "time_step_limit", "mamba_proj_bias", "output_router_logits",
        "moe_shared_expert_overlap", "n_shared_experts", "num_hidden_layers", "expand",
        "mamba_ssm_cache_dtype", "attention_bias",
        "tie_encoder_decoder", "is_encoder_decoder", "return_dict", "output_hidden_states",
        "output_attentions", "chunk_size_feed_forward", "id2label", "label2id", "problem_type",
        "tokenizer_class", "prefix", "sep_token_id", "decoder_start_token_id", "task_specific_params",
        "finetuning_task", "add_cross_attention", "pruned_heads", "torchscript",
        # read by the loader (models/quantization.py), which checks the weights against it
        "quantization_config",
    }
)
# MTP layer types as transformers spells them, mapped to ours.
_MTP_ALIASES = {"attention": "full_attention"}
# Legacy spellings accepted by transformers, mapped to the current key.
_LEGACY_HF_KEYS = {
    "mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_dt_min": "time_step_min",
    "mamba_conv_bias": "use_conv_bias", "mamba_chunk_size": "chunk_size", "mamba_n_heads": "mamba_num_heads",
    "mamba_d_head": "mamba_head_dim", "mamba_d_state": "ssm_state_size", "rms_norm_eps": "layer_norm_epsilon",
}


# config.json keys of the fields whose name differs.
_HF_KEYS = {"layer_types": "layers_block_type", "mtp_layer_types": "mtp_layers_block_type",
            "eos_token_ids": "eos_token_id", "dt_limit": "time_step_limit"}
# Sizes and counts are at least 1 (None where optional), token ids at least 0. A context of one
# position holds a prompt token but no generated one: max_position_embeddings is at least 2, as
# the engine's max_model_len (which it defaults and bounds) is.
_MODEL_MINIMUMS = {
    "max_position_embeddings": 2,
    **dict.fromkeys(("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "intermediate_size", "mamba_num_heads", "mamba_head_dim",
                     "ssm_state_size", "n_groups", "chunk_size", "num_experts_per_tok",
                     "moe_intermediate_size", "moe_shared_expert_intermediate_size", "moe_latent_size", "n_group",
                     "topk_group", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                     "linear_value_head_dim"), 1),
    **dict.fromkeys(("conv_kernel", "linear_conv_kernel_dim"), 2),
    # Granite 4.0-H runs with none (num_local_experts 0: the shared MLP alone); MoE layers need some.
    "n_routed_experts": 0,
    **dict.fromkeys(("pad_token_id", "bos_token_id", "eos_token_ids", "num_nextn_predict_layers"), 0),
}


@dataclass(frozen=True)
class ModelConfig:
    """The Nemotron-H architecture, with Hugging Face's field names and defaults."""

    layer_types: tuple[str, ...]
    vocab_size: int = 131072
    hidden_size: int = 4096
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    max_position_embeddings: int = 4096
    intermediate_size: int = 21504
    mlp_hidden_act: str = "relu2"
    mlp_bias: bool = False
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    ssm_state_size: int = 128
    n_groups: int = 8
    conv_kernel: int = 4
    chunk_size: int = 128
    use_conv_bias: bool = True
    use_bias: bool = False
    mamba_hidden_act: str = "silu"
    time_step_min: float = 0.001
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 7688
    moe_shared_expert_intermediate_size: int = 7688
    moe_latent_size: int | None = None
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)
    # Multi-token prediction (Nemotron-H MTP): one block stack of these types after the backbone.
    num_nextn_predict_layers: int = 0
    mtp_layer_types: tuple[str, ...] = ()
    # Which family of models the checkpoint is: models/registry.py picks the model class by these.
    model_type: str = "nemotron_h"
    architectures: tuple[str, ...] = ("NemotronHForCausalLM",)
    # The other Mamba2 hybrids' own quantities (config/hf_families.py); these values are Nemotron-H's math.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0  # the logits are divided by it
    attention_multiplier: float | None = None  # the attention scale; None: head_dim ** -0.5
    rope_theta: float | None = None  # None: no positional encoding in attention (NoPE)
    partial_rotary_factor: float = 1.0  # the share of each head's dimensions RoPE rotates
    dt_limit: tuple[float, ...] = ()  # (min, max) clamp of the time step; (): (time_step_min, inf)
    # Falcon-H1's muP multipliers (attention and Mamba2 side by side in every layer).
    ssm_in_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0
    ssm_multipliers: tuple[float, ...] = ()  # z, x, B, C, dt sections of in_proj's output; (): all 1
    attention_in_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    key_multiplier: float = 1.0
    mlp_multipliers: tuple[float, ...] = ()  # (gate, down); (): both 1
    mamba_rms_norm: bool = True  # false: the scan's output is only gated, y * silu(z)
    mamba_norm_before_gate: bool = False  # true: norm(y) * silu(z); false (Nemotron-H): norm(y * silu(z))
    # Gated DeltaNet (Qwen3-Next, Qwen3.5; config/hf_qwen.py): key heads serve Hv // Hk value heads each.
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    attention_output_gate: bool = False  # q_proj also yields a gate: attention out * sigmoid(gate)
    qk_norm: bool = False  # an RMSNorm over each head of q and k before RoPE
    moe_shared_expert_gate: bool = False  # the shared expert's output scaled by sigmoid(x @ gate)

    def __post_init__(self) -> None:
        def fail(option: str, why: str) -> None:
            raise ConfigError(f"model config option {_HF_KEYS.get(option, option)}: {why}")

        # Types and ranges first: the relations below divide by these values.
        check_field_types(self, fail)
        check_minimums(self, _MODEL_MINIMUMS, fail)
        for option in ("layer_norm_epsilon", "routed_scaling_factor", "logits_scaling", "embedding_multiplier",
                       "residual_multiplier", *(("rope_theta",) if self.rope_theta is not None else ()),
                       *(("attention_multiplier",) if self.attention_multiplier is not None else ())):
            if not 0 < getattr(self, option) < math.inf:
                fail(option, f"must be a finite number > 0, got {getattr(self, option)!r}")
        if not 0 <= self.time_step_min < math.inf:
            fail("time_step_min", f"must be a finite number >= 0, got {self.time_step_min!r}")
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad or not self.layer_types:
            raise ConfigError(f"layers_block_type: unsupported layer types {bad or '[]'}; allowed: {LAYER_TYPES}")
        experts_per_group = self.n_routed_experts // self.n_group
        routed = self.n_routed_experts > 0
        rotary_dim = int(self.head_dim * self.partial_rotary_factor)
        act = "silu" if self.model_type in FROM_HF else "relu2"  # the other families' MLPs are SwiGLU
        checks = [
            (self.mlp_hidden_act == act, "mlp_hidden_act", f"{self.mlp_hidden_act!r}; only {act!r}"),
            (MOE not in self.layer_types or routed, "n_routed_experts", "0 with moe layers; they need experts"),
            (0 < self.partial_rotary_factor <= 1 and rotary_dim % 2 == 0, "partial_rotary_factor",
             f"{self.partial_rotary_factor}; a share in (0, 1] of head_dim={self.head_dim} that is even"),
            (len(self.ssm_multipliers) in (0, 5), "ssm_multipliers",
             f"{list(self.ssm_multipliers)}; five (z, x, B, C, dt) or none"),
            (len(self.mlp_multipliers) in (0, 2), "mlp_multipliers", f"{list(self.mlp_multipliers)}; two or none"),
            (not self.dt_limit or (len(self.dt_limit) == 2 and 0 <= self.dt_limit[0] <= self.dt_limit[1]),
             "dt_limit", f"{list(self.dt_limit)}; [min, max] with 0 <= min <= max"),
            (self.mamba_hidden_act == "silu", "mamba_hidden_act", f"{self.mamba_hidden_act!r}; only 'silu'"),
            (self.sliding_window is None, "sliding_window", f"{self.sliding_window}; only null"),
            (self.mamba_num_heads % self.n_groups == 0, "n_groups",
             f"{self.n_groups} must divide mamba_num_heads={self.mamba_num_heads}"),
            (self.linear_num_value_heads % self.linear_num_key_heads == 0, "linear_num_value_heads",
             f"{self.linear_num_value_heads} must be a multiple of linear_num_key_heads={self.linear_num_key_heads}"),
            (self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
             f"{self.num_key_value_heads} must divide num_attention_heads={self.num_attention_heads}"),
            (self.n_routed_experts % self.n_group == 0, "n_group",
             f"{self.n_group} must divide n_routed_experts={self.n_routed_experts}"),
            # Groups are ranked by the sum of their two best experts.
            (not routed or self.n_group == 1 or experts_per_group >= 2, "n_group",
             f"{self.n_group} leaves {experts_per_group} expert per group; grouped routing needs at least 2"),
            (self.topk_group <= self.n_group, "topk_group", f"{self.topk_group} > n_group={self.n_group}"),
            # More would pick experts of groups the router masked out.
            (not routed or self.num_experts_per_tok <= self.topk_group * experts_per_group, "num_experts_per_tok",
             f"{self.num_experts_per_tok} > the {self.topk_group * experts_per_group} experts of topk_group="
             f"{self.topk_group} groups of n_routed_experts / n_group = {experts_per_group}"),
            # An EOS the model cannot emit never ends a request, and min_tokens' ban would index past the logits.
            (all(t < self.vocab_size for t in self.eos_token_ids), "eos_token_ids",
             f"{list(self.eos_token_ids)}; token ids must be < vocab_size={self.vocab_size}"),
            (self.num_nextn_predict_layers in (0, 1), "num_nextn_predict_layers",
             f"{self.num_nextn_predict_layers}; one MTP step (1) or none (0)"),
            (not self.num_nextn_predict_layers
             or (self.mtp_layer_types and set(self.mtp_layer_types) <= {ATTENTION, MOE, MLP}),
             "mtp_layers_block_type", f"{list(self.mtp_layer_types)}; attention, moe or mlp layers, at least one"),
        ]
        if self.model_type in QWEN_TYPES:  # decoder layers of a token mixer then a feed-forward half
            mixers, ffns = self.layer_types[::2], self.layer_types[1::2]
            checks.append((len(mixers) == len(ffns) and set(mixers) <= {GATED_DELTA, ATTENTION}
                           and set(ffns) <= {MLP, MOE}, "layers_block_type",
                           f"{list(self.layer_types)}; (gated_delta or full_attention, mlp or moe) pairs"))
        for ok, option, why in checks:
            if not ok:
                fail(option, f"unsupported value {why}")

    @property
    def num_mamba_layers(self) -> int:
        return self.layer_types.count(MAMBA)

    @property
    def num_gated_delta_layers(self) -> int:
        return self.layer_types.count(GATED_DELTA)

    @property
    def num_recurrent_layers(self) -> int:
        """Layers with per-sequence recurrent state (Mamba2 and Gated DeltaNet): what prefix
        caching's state slots and the SSM backend hold."""
        return self.num_mamba_layers + self.num_gated_delta_layers

    @property
    def gated_delta_conv_dim(self) -> int:
        """Channels of the Gated DeltaNet's depthwise conv: q, k and v concatenated."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + (
            self.linear_num_value_heads * self.linear_value_head_dim)

    @property
    def num_attention_layers(self) -> int:
        return self.layer_types.count(ATTENTION)

    @property
    def mamba_intermediate_size(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        return self.mamba_intermediate_size + 2 * self.n_groups * self.ssm_state_size

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Builds the config from a parsed `config.json`; unknown keys are an error."""
        translate = FROM_HF.get(raw.get("model_type"))  # type: ignore[arg-type]
        family_raw = translate(raw) if translate else raw
        hf = {_LEGACY_HF_KEYS.get(k, k): v for k, v in family_raw.items() if k not in _IGNORED_HF_KEYS}
        if "model_type" not in raw:  # transformers' AutoConfig cannot read such a config either
            raise ConfigError("config.json has no model_type; this engine runs Nemotron-H checkpoints only, "
                              "which declare \"model_type\": \"nemotron_h\"")
        if isinstance(hf.get("architectures"), list):
            hf["architectures"] = tuple(hf["architectures"])
        elif "architectures" in hf and hf["architectures"] is None:  # null: the family's default
            del hf["architectures"]
        _check_residual_in_fp32(hf.pop("residual_in_fp32", False))
        mtp_types = _str_list(hf, "mtp_layers_block_type")
        mtp_pattern = _str_list(hf, "mtp_hybrid_override_pattern", str)
        if hf.get("num_nextn_predict_layers", 0):
            if mtp_types is None and mtp_pattern is not None:
                mtp_types = [PATTERN_CHARS.get(c, c) for c in mtp_pattern]
            hf["mtp_layer_types"] = tuple(_MTP_ALIASES.get(t, t) for t in (mtp_types or ()))
        pattern = _str_list(hf, "hybrid_override_pattern", str)
        layers = _str_list(hf, "layers_block_type") or _str_list(hf, "layer_types")
        if layers is None and pattern is not None:
            unknown = sorted(set(pattern) - set(PATTERN_CHARS))
            if unknown:
                raise ConfigError(f"hybrid_override_pattern: unknown characters {unknown}; allowed {PATTERN_CHARS}")
            layers = [PATTERN_CHARS[c] for c in pattern]
        if layers is None:
            raise ConfigError("config.json has neither layers_block_type nor hybrid_override_pattern")
        eos = hf.pop("eos_token_id", 2)
        hf["eos_token_ids"] = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if "n_routed_experts" not in hf and "num_local_experts" in hf:
            hf["n_routed_experts"] = hf.pop("num_local_experts")
        known = {f for f in cls.__dataclass_fields__ if f != "layer_types"} - (set() if translate else FAMILY_FIELDS)
        unknown = sorted(set(hf) - known)
        if unknown:
            raise ConfigError(f"config.json has unsupported keys {unknown}")
        return cls(layer_types=tuple(layers), **hf)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model directory {model_dir} has no config.json")
        try:
            raw = json.loads(path.read_text(), object_hook=_decode_special_floats)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from e
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a JSON object")
        return cls.from_hf_dict(raw)

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` content transformers' NemotronHConfig reads back to this config."""
        out: dict[str, Any] = {"architectures": list(self.architectures), "model_type": self.model_type}
        if self.model_type in TO_HF:
            return {**out, **TO_HF[self.model_type]({f: getattr(self, f) for f in self.__dataclass_fields__})}
        for name in self.__dataclass_fields__:
            if name in FAMILY_FIELDS:
                continue
            value = getattr(self, name)
            if name in out:
                continue
            if name == "layer_types":
                out["layers_block_type"] = list(value)
            elif name == "mtp_layer_types":
                if value:
                    out["mtp_layers_block_type"] = list(value)
            elif name == "eos_token_ids":
                out["eos_token_id"] = value[0] if len(value) == 1 else list(value)
            else:
                out[name] = value
        return out


def tensor_parallel_error(model: ModelConfig, world: int) -> str | None:
    """Why `model` cannot be split over `world` ranks (None: it can). Heads and inner dimensions
    split evenly; KV heads split, or are replicated when fewer than the ranks; Mamba groups follow
    the heads (ssm/layout.py: MambaShard), so any n_groups works. Granite 4.0-H, Bamba and
    Falcon-H1 have a feed-forward half in every layer (not a layer kind of their own). The Qwen
    families' Gated DeltaNet splits its key heads and their value heads (each rank whole GQA groups).
    Every family of the registry splits."""
    kinds = set(model.layer_types) | set(model.mtp_layer_types)
    sizes = {"num_attention_heads": model.num_attention_heads} if ATTENTION in kinds else {}
    if MAMBA in kinds:
        sizes["mamba_num_heads"] = model.mamba_num_heads
    if GATED_DELTA in kinds:
        # the value heads, a multiple of the key heads, then split as well
        sizes["linear_num_key_heads"] = model.linear_num_key_heads
    if MLP in kinds or model.model_type in (BAMBA, FALCON_H1):
        sizes["intermediate_size"] = model.intermediate_size
    if model.model_type == GRANITE:  # the shared MLP (moe_shared_...), and the experts where there are some
        sizes["moe_shared_expert_intermediate_size"] = model.moe_shared_expert_intermediate_size
        if model.n_routed_experts:
            sizes["moe_intermediate_size"] = model.moe_intermediate_size
    if MOE in kinds:
        sizes["moe_intermediate_size"] = model.moe_intermediate_size
        sizes["moe_shared_expert_intermediate_size"] = model.moe_shared_expert_intermediate_size
    for name, size in sizes.items():
        if size % world:
            return f"{world} ranks must divide the model's {name}={size}"
    kv = model.num_key_value_heads
    if ATTENTION in kinds and kv % world and world % kv:
        return f"{world} ranks must divide num_key_value_heads={kv} or be a multiple of it"
    return None


def _str_list(hf: dict[str, Any], key: str, kind: type = list) -> Any:
    """Pops `key`: None when absent, else a `kind` (list or str) of strings."""
    value = hf.pop(key, None)
    if value is not None and not (isinstance(value, kind) and all(isinstance(v, str) for v in value)):
        raise ConfigError(f"model config option {key}: must be {'a string' if kind is str else 'a list of strings'}, "
                          f"got {value!r}")
    return value


def _check_residual_in_fp32(value: Any) -> None:
    """transformers 5.24's NemotronHConfig declares `residual_in_fp32` (default false), but its
    decoder block never reads it: the residual stream stays in the model dtype, as in vLLM. We
    compute what transformers computes, and say so when a checkpoint asks for true (NVIDIA's
    remote modeling code, which such a checkpoint may have been trained with, does apply it)."""
    if not isinstance(value, bool):
        raise ConfigError(f"model config option residual_in_fp32: must be bool, got {value!r}")
    if value:
        logging.getLogger(__name__).warning(
            "config.json sets residual_in_fp32: true, which is not applied: the residual stream stays in the "
            "model dtype, as transformers 5.24 and vLLM run Nemotron-H; use dtype float32 for a float32 residual")


def _decode_special_floats(obj: dict[str, Any]) -> Any:
    # transformers writes non-finite floats as {"__float__": "Infinity"}.
    if set(obj) == {"__float__"}:
        return float(obj["__float__"])
    return obj
