"""config.json of the Mamba2 hybrids beside Nemotron-H, translated to `ModelConfig`'s fields and back.

Each family's config names the same quantities its own way (`mamba_n_heads` for `mamba_num_heads`,
`num_local_experts` for `n_routed_experts`, ...) and adds a few of its own (Granite's multipliers,
RoPE). `FROM_HF[model_type]` turns a parsed config.json into the keys `ModelConfig.from_hf_dict`
reads (Nemotron-H's spelling plus `FAMILY_FIELDS`); `TO_HF[model_type]` writes a config.json that
transformers' config class of the family reads back to the same `ModelConfig`. A value the engine
cannot run (another RoPE type, attention bias, an activation other than SiLU) fails naming its key.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from replayserve.config.checks import ConfigError
from replayserve.config.hf_qwen import QWEN_TYPES, qwen_from_hf, qwen_to_hf

GRANITE = "granitemoehybrid"
BAMBA = "bamba"
FALCON_H1 = "falcon_h1"

# ModelConfig fields that only the families here set; a Nemotron-H config.json naming one is refused.
FAMILY_FIELDS = frozenset({"embedding_multiplier", "residual_multiplier", "logits_scaling", "attention_multiplier",
                           "rope_theta", "partial_rotary_factor", "dt_limit", "ssm_in_multiplier",
                           "ssm_out_multiplier", "ssm_multipliers", "attention_in_multiplier",
                           "attention_out_multiplier", "key_multiplier", "mlp_multipliers", "mamba_rms_norm",
                           "mamba_norm_before_gate", "linear_num_key_heads", "linear_num_value_heads",
                           "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
                           "attention_output_gate", "qk_norm", "moe_shared_expert_gate"})

# transformers 5.24's defaults (GraniteMoeHybridConfig, BambaConfig), for keys a config.json leaves out.
_MAMBA_DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": None, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
    "tie_word_embeddings": False, "attention_bias": False, "mamba_n_heads": 128, "mamba_n_groups": 1,
    "mamba_d_state": 256, "mamba_d_head": "auto", "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 256,
    "mamba_conv_bias": True, "mamba_proj_bias": False, "time_step_limit": [0.0, math.inf], "hidden_size": 4096,
    "num_attention_heads": 32,
}
_GRANITE_DEFAULTS: dict[str, Any] = {
    **_MAMBA_DEFAULTS, "vocab_size": 32000, "intermediate_size": 11008, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6, "pad_token_id": None, "embedding_multiplier": 1.0, "logits_scaling": 1.0,
    "residual_multiplier": 1.0, "attention_multiplier": 1.0, "num_local_experts": 8, "num_experts_per_tok": 2,
    "shared_intermediate_size": 1024, "position_embedding_type": None,
}
_BAMBA_DEFAULTS: dict[str, Any] = {
    **_MAMBA_DEFAULTS, "vocab_size": 128000, "intermediate_size": 14336, "num_key_value_heads": 8,
    "num_hidden_layers": 32, "max_position_embeddings": 262144, "rms_norm_eps": 1e-5, "pad_token_id": 0,
    "attn_layer_indices": None, "mlp_bias": False,
}
_FALCON_DEFAULTS: dict[str, Any] = {
    **_MAMBA_DEFAULTS, "vocab_size": 128000, "intermediate_size": 14336, "num_key_value_heads": 8,
    "num_hidden_layers": 32, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "pad_token_id": 0,
    "mamba_d_ssm": 1024, "mamba_norm_before_gate": True, "mamba_rms_norm": False, "projectors_bias": False,
    "lm_head_multiplier": 1.0, "embedding_multiplier": 1.0, "mlp_multipliers": None, "key_multiplier": 1.0,
    "attention_out_multiplier": 1.0, "attention_in_multiplier": 1.0, "ssm_multipliers": None,
    "ssm_in_multiplier": 1.0, "ssm_out_multiplier": 1.0, "mlp_bias": False,
}
# Falcon-H1's multipliers kept as they are named.
_FALCON_SAME = ("embedding_multiplier", "key_multiplier", "attention_out_multiplier", "attention_in_multiplier",
                "ssm_in_multiplier", "ssm_out_multiplier", "mamba_rms_norm", "mamba_norm_before_gate",
                "intermediate_size", "mlp_bias")
# Keys that change nothing at inference.
_IGNORED = frozenset({"router_aux_loss_coef", "output_router_logits", "init_method", "z_loss_coefficient"})
# Renamed one to one: the family's key -> ModelConfig's.
_MAMBA_RENAMES = {
    "rms_norm_eps": "layer_norm_epsilon", "mamba_n_heads": "mamba_num_heads", "mamba_n_groups": "n_groups",
    "mamba_d_state": "ssm_state_size", "mamba_d_conv": "conv_kernel", "mamba_chunk_size": "chunk_size",
    "mamba_conv_bias": "use_conv_bias", "mamba_proj_bias": "use_bias",
}
_GRANITE_RENAMES = {
    **_MAMBA_RENAMES, "intermediate_size": "moe_intermediate_size",
    "shared_intermediate_size": "moe_shared_expert_intermediate_size", "num_local_experts": "n_routed_experts",
}
# Written back as they are named.
_SAME_KEYS = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
              "tie_word_embeddings", "pad_token_id", "bos_token_id")
# transformers' legacy layer names.
_LAYER_ALIASES = {"mamba": "linear_attention", "attention": "full_attention"}


def _fail(key: str, why: str) -> ConfigError:
    return ConfigError(f"model config option {key}: {why}")


def _rope(raw: dict[str, Any], partial_default: float = 1.0) -> dict[str, Any]:
    """rope_theta and partial_rotary_factor from `rope_parameters` (or the legacy top-level keys);
    only the default (unscaled) RoPE runs here."""
    params = raw.pop("rope_parameters", None) or {}
    if not isinstance(params, dict):
        raise _fail("rope_parameters", f"must be an object, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise _fail("rope_parameters.rope_type", f"unsupported value {rope_type!r}; only 'default' (unscaled RoPE)")
    unknown = sorted(set(params) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"})
    if unknown:
        raise _fail("rope_parameters", f"unsupported keys {unknown}")
    theta = params.get("rope_theta", raw.pop("rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", raw.pop("partial_rotary_factor", partial_default))
    return {"rope_theta": theta, "partial_rotary_factor": factor}


def _layer_types(raw: dict[str, Any], allowed: tuple[str, ...]) -> list[str]:
    layers = raw.pop("layer_types", None) or raw.pop("layers_block_type", None)
    if not isinstance(layers, list) or not layers:
        raise _fail("layer_types", f"must be a non-empty list of layer names, got {layers!r}")
    out = [_LAYER_ALIASES.get(t, t) for t in layers]
    bad = sorted({t for t in out if t not in allowed})
    if bad:
        raise _fail("layer_types", f"unsupported layer types {bad}; allowed: {list(allowed)} (or 'mamba', 'attention')")
    return out


def _mamba_hybrid(hf: dict[str, Any], out: dict[str, Any], inner: int | None = None) -> None:
    """The keys Granite 4.0-H, Bamba and Falcon-H1 share (attention, Mamba2, activation), popped
    from `hf` into ModelConfig's keys in `out`; `inner`: the Mamba2 width where the config gives it
    (Falcon-H1's mamba_d_ssm), else mamba_expand * hidden_size."""
    if hf.pop("rope_scaling", None) is not None:
        raise _fail("rope_scaling", "unsupported; only null (unscaled RoPE)")
    if hf.pop("attention_bias"):
        raise _fail("attention_bias", "unsupported value true; only false")
    act = hf.pop("hidden_act")
    if act != "silu":
        raise _fail("hidden_act", f"unsupported value {act!r}; only 'silu'")
    out["mlp_hidden_act"] = out["mamba_hidden_act"] = act
    norm = hf.pop("normalization_function", "rmsnorm")
    if norm != "rmsnorm":
        raise _fail("normalization_function", f"unsupported value {norm!r}; only 'rmsnorm'")
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    if hf["num_key_value_heads"] is None:
        hf["num_key_value_heads"] = heads
    if not isinstance(heads, int) or not isinstance(hidden, int) or heads < 1 or (hidden % heads
                                                                                   and "head_dim" not in hf):
        raise _fail("num_attention_heads", f"{heads!r} must divide hidden_size={hidden!r}")
    out["head_dim"] = hf.pop("head_dim", None) or hidden // heads
    expand, mamba_heads, d_head = hf.pop("mamba_expand"), hf["mamba_n_heads"], hf.pop("mamba_d_head")
    if inner is None:
        inner = expand * hidden if isinstance(expand, int) else None
    if d_head == "auto" and inner is not None and isinstance(mamba_heads, int) and mamba_heads > 0:
        d_head = inner // mamba_heads
    if inner is None or not isinstance(d_head, int) or d_head * mamba_heads != inner:
        raise _fail("mamba_d_head", f"{d_head!r} x mamba_n_heads={mamba_heads!r} must equal mamba_expand * "
                                    f"hidden_size = {expand!r} * {hidden}")
    out["mamba_head_dim"] = d_head
    limit = hf.pop("time_step_limit")
    out["dt_limit"] = (0.0, math.inf) if limit is None else tuple(limit) if isinstance(limit, list) else limit


def _check_layer_count(hf: dict[str, Any], layers: list[str]) -> None:
    count = hf.pop("num_hidden_layers", len(layers))
    if count != len(layers):
        raise _fail("num_hidden_layers", f"{count!r} differs from the {len(layers)} layer_types")


def granite_from_hf(raw: dict[str, Any]) -> dict[str, Any]:
    """A GraniteMoeHybridConfig's config.json -> ModelConfig keys."""
    hf = {**_GRANITE_DEFAULTS, **{k: v for k, v in raw.items() if k not in _IGNORED}}
    out: dict[str, Any] = {"layers_block_type": _layer_types(hf, ("linear_attention", "full_attention"))}
    _check_layer_count(hf, out["layers_block_type"])
    _mamba_hybrid(hf, out)
    position = hf.pop("position_embedding_type")
    if position not in (None, "nope", "rope"):
        raise _fail("position_embedding_type", f"unsupported value {position!r}; only null or 'rope'")
    rope = _rope(hf)
    if rope["partial_rotary_factor"] != 1.0:  # transformers' Granite rotates whole heads whatever it says
        raise _fail("rope_parameters.partial_rotary_factor", f"{rope['partial_rotary_factor']!r}; Granite only 1.0")
    if position == "rope":
        out.update(rope)
    for key, field in _GRANITE_RENAMES.items():
        out[field] = hf.pop(key)
    return {**hf, **out}


def bamba_from_hf(raw: dict[str, Any]) -> dict[str, Any]:
    """A BambaConfig's config.json -> ModelConfig keys: attention at `attn_layer_indices`, Mamba2
    elsewhere; RoPE always (transformers 5.24 rotates half of each head unless rope_parameters says)."""
    hf = {**_BAMBA_DEFAULTS, **{k: v for k, v in raw.items() if k not in _IGNORED}}
    count, indices = hf.pop("num_hidden_layers"), hf.pop("attn_layer_indices") or []
    if not isinstance(count, int) or count < 1 or not isinstance(indices, list) or any(
            not isinstance(i, int) or not 0 <= i < count for i in indices):
        raise _fail("attn_layer_indices", f"{indices!r} must be layer indices below num_hidden_layers={count!r}")
    out: dict[str, Any] = {"layers_block_type": ["full_attention" if i in indices else "linear_attention"
                                                 for i in range(count)], "n_routed_experts": 0}
    _mamba_hybrid(hf, out)
    out.update(_rope(hf, partial_default=0.5))
    for key, field in _MAMBA_RENAMES.items():
        out[field] = hf.pop(key)
    return {**hf, **out}


def falcon_h1_from_hf(raw: dict[str, Any]) -> dict[str, Any]:
    """A FalconH1Config's config.json -> ModelConfig keys. Every layer holds a Mamba2 and an
    attention mixer side by side: layer_types lists the pair, Mamba2 first, for each layer."""
    hf = {**_FALCON_DEFAULTS, **{k: v for k, v in raw.items() if k not in _IGNORED}}
    count = hf.pop("num_hidden_layers")
    if not isinstance(count, int) or count < 1:
        raise _fail("num_hidden_layers", f"must be an int >= 1, got {count!r}")
    if hf.pop("attn_layer_indices", None) is not None:
        raise _fail("attn_layer_indices", "unsupported; Falcon-H1 has attention in every layer")
    out: dict[str, Any] = {"layers_block_type": ["linear_attention", "full_attention"] * count, "n_routed_experts": 0}
    d_ssm = hf.pop("mamba_d_ssm")
    _mamba_hybrid(hf, out, inner=d_ssm if d_ssm is not None else None)
    rope = _rope(hf)
    if rope["partial_rotary_factor"] != 1.0:
        raise _fail("rope_parameters.partial_rotary_factor", f"{rope['partial_rotary_factor']!r}; Falcon-H1 only 1.0")
    out.update(rope)
    if hf.pop("projectors_bias") != hf["mamba_proj_bias"]:
        raise _fail("projectors_bias", "must equal mamba_proj_bias (the Mamba2 in_proj and out_proj share one bias "
                                       "setting here)")
    multiplier = hf.pop("lm_head_multiplier")
    if not isinstance(multiplier, (int, float)) or isinstance(multiplier, bool) or not 0 < multiplier < math.inf:
        raise _fail("lm_head_multiplier", f"must be a finite number > 0, got {multiplier!r}")
    out["logits_scaling"] = 1.0 / multiplier
    for key, size in (("ssm_multipliers", 5), ("mlp_multipliers", 2)):
        value = hf.pop(key)
        out[key] = (1.0,) * size if value is None else tuple(value) if isinstance(value, list) else value
    for key in _FALCON_SAME:
        out[key] = hf.pop(key)
    for key, field in _MAMBA_RENAMES.items():
        out[field] = hf.pop(key)
    return {**hf, **out}


def _mamba_hybrid_to_hf(fields: dict[str, Any]) -> dict[str, Any]:
    explicit_head_dim = fields["model_type"] == FALCON_H1  # its config.json states head_dim
    if not explicit_head_dim and fields["head_dim"] * fields["num_attention_heads"] != fields["hidden_size"]:
        raise ConfigError(f"{fields['model_type']}: head_dim must be hidden_size / num_attention_heads")
    out = {key: fields[field] for key, field in _MAMBA_RENAMES.items()}
    out.update({key: fields[key] for key in _SAME_KEYS})
    eos = fields["eos_token_ids"]
    out.update({
        "num_hidden_layers": len(fields["layer_types"]), "hidden_act": fields["mlp_hidden_act"],
        "mamba_d_head": fields["mamba_head_dim"],
        "mamba_expand": fields["mamba_num_heads"] * fields["mamba_head_dim"] // fields["hidden_size"],
        "time_step_limit": list(fields["dt_limit"] or (0.0, math.inf)),
        "rope_parameters": {"rope_type": "default", "rope_theta": fields["rope_theta"] or 10000.0,
                            "partial_rotary_factor": fields["partial_rotary_factor"]},
        "eos_token_id": eos[0] if len(eos) == 1 else list(eos),
    })
    return out


def granite_to_hf(fields: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields -> the config.json transformers' GraniteMoeHybridConfig reads back to them."""
    out = _mamba_hybrid_to_hf(fields)
    out.update({key: fields[field] for key, field in _GRANITE_RENAMES.items()})
    out.update({key: fields[key] for key in ("num_experts_per_tok", "embedding_multiplier", "residual_multiplier",
                                             "logits_scaling", "attention_multiplier")})
    out["layer_types"] = list(fields["layer_types"])
    out["position_embedding_type"] = "rope" if fields["rope_theta"] is not None else None
    return out


def falcon_h1_to_hf(fields: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields -> the config.json transformers' FalconH1Config reads back to them."""
    out = _mamba_hybrid_to_hf(fields)
    inner = fields["mamba_num_heads"] * fields["mamba_head_dim"]
    out.update({key: fields[key] for key in _FALCON_SAME})
    out.update({
        "num_hidden_layers": len(fields["layer_types"]) // 2, "head_dim": fields["head_dim"], "mamba_d_ssm": inner,
        "mamba_expand": max(1, inner // fields["hidden_size"]), "projectors_bias": fields["use_bias"],
        "lm_head_multiplier": 1.0 / fields["logits_scaling"],
        "ssm_multipliers": list(fields["ssm_multipliers"] or (1.0,) * 5),
        "mlp_multipliers": list(fields["mlp_multipliers"] or (1.0, 1.0)),
    })
    return out


def bamba_to_hf(fields: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields -> the config.json transformers' BambaConfig reads back to them."""
    out = _mamba_hybrid_to_hf(fields)
    out["attn_layer_indices"] = [i for i, t in enumerate(fields["layer_types"]) if t == "full_attention"]
    out["intermediate_size"], out["mlp_bias"] = fields["intermediate_size"], fields["mlp_bias"]
    return out


FROM_HF: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    GRANITE: granite_from_hf, BAMBA: bamba_from_hf, FALCON_H1: falcon_h1_from_hf,
    **dict.fromkeys(QWEN_TYPES, qwen_from_hf)}
TO_HF: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    GRANITE: granite_to_hf, BAMBA: bamba_to_hf, FALCON_H1: falcon_h1_to_hf, **dict.fromkeys(QWEN_TYPES, qwen_to_hf)}
