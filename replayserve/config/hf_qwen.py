"""config.json of the Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5 dense and MoE), translated to
`ModelConfig`'s fields and back (`FROM_HF` / `TO_HF` in hf_families.py hold these).

A decoder layer is a token mixer, Gated DeltaNet where Hugging Face's `layer_types` says
"linear_attention" (here "gated_delta": this engine's "linear_attention" is Mamba2) or gated
attention where it says "full_attention", then a feed-forward half: `layer_types` here lists both,
[mixer, ffn] per decoder layer, the ffn an MoE ("moe": top-k of the softmax over experts plus a
sigmoid-gated shared expert) or a dense SwiGLU ("mlp": Qwen3.5, and Qwen3-Next's `mlp_only_layers`
and layers off its `decoder_sparse_step`). The multimodal wrappers (`qwen3_5`, `qwen3_5_moe`: a
`text_config` beside a `vision_config`) give their language model; the vision tower is not run.
`mtp_num_hidden_layers: 1` declares the checkpoint's MTP layer (models/qwen3_next_mtp.py).
"""

from __future__ import annotations

import logging
from typing import Any

from replayserve.config.checks import ConfigError

logger = logging.getLogger(__name__)

QWEN3_NEXT = "qwen3_next"
QWEN3_5, QWEN3_5_TEXT = "qwen3_5", "qwen3_5_text"
QWEN3_5_MOE, QWEN3_5_MOE_TEXT = "qwen3_5_moe", "qwen3_5_moe_text"
# The multimodal wrappers' model_type -> their text_config's.
WRAPPERS = {QWEN3_5: QWEN3_5_TEXT, QWEN3_5_MOE: QWEN3_5_MOE_TEXT}
# Each model_type's class in transformers, for a config.json that names none.
_ARCHITECTURES = {QWEN3_NEXT: "Qwen3NextForCausalLM", QWEN3_5: "Qwen3_5ForConditionalGeneration",
                  QWEN3_5_TEXT: "Qwen3_5ForCausalLM", QWEN3_5_MOE: "Qwen3_5MoeForConditionalGeneration",
                  QWEN3_5_MOE_TEXT: "Qwen3_5MoeForCausalLM"}

# transformers 5.24's defaults (Qwen3NextConfig, Qwen3_5TextConfig, Qwen3_5MoeTextConfig), for keys a
# config.json leaves out.
_COMMON: dict[str, Any] = {
    "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "attention_bias": False, "head_dim": 256, "num_attention_heads": 16, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
    "full_attention_interval": 4, "attn_output_gate": True, "sliding_window": None, "use_sliding_window": False,
}
_MOE: dict[str, Any] = {"moe_intermediate_size": 512, "shared_expert_intermediate_size": 512}
_DEFAULTS: dict[str, dict[str, Any]] = {
    QWEN3_NEXT: {**_COMMON, **_MOE, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
                 "num_hidden_layers": 48, "num_key_value_heads": 2, "decoder_sparse_step": 1, "num_experts": 512,
                 "num_experts_per_tok": 10, "norm_topk_prob": True, "mlp_only_layers": []},
    QWEN3_5_TEXT: {**_COMMON, "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288,
                   "num_hidden_layers": 32, "num_key_value_heads": 4},
    QWEN3_5_MOE_TEXT: {**_COMMON, **_MOE, "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
                       "num_key_value_heads": 2, "num_experts": 256, "num_experts_per_tok": 8},
}
# Keys that change nothing here: training-only, or read elsewhere (the recurrent state's dtype is the
# compute dtype, float32 for half-precision models, as `mamba_ssm_dtype` asks of published ones).
_IGNORED = frozenset({"router_aux_loss_coef", "output_router_logits", "max_window_layers", "mamba_ssm_dtype",
                      "initializer_range", "use_cache",
                      "attention_dropout", "dtype", "torch_dtype", "transformers_version", "_name_or_path"})
# The wrappers' own keys beside text_config: the vision tower's, which the language model never reads.
_WRAPPER_KEYS = frozenset({"vision_config", "image_token_id", "video_token_id", "vision_start_token_id",
                           "vision_end_token_id"})
# Renamed one to one: Hugging Face's key -> ModelConfig's.
_RENAMES = {"rms_norm_eps": "layer_norm_epsilon", "shared_expert_intermediate_size":
            "moe_shared_expert_intermediate_size", "num_experts": "n_routed_experts"}
_SAME = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
         "max_position_embeddings", "tie_word_embeddings", "pad_token_id", "bos_token_id", "linear_conv_kernel_dim",
         "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads")
_MIXERS = {"linear_attention": "gated_delta", "full_attention": "full_attention"}


def _fail(key: str, why: str) -> ConfigError:
    return ConfigError(f"model config option {key}: {why}")


def _rope(hf: dict[str, Any], text_type: str) -> dict[str, Any]:
    """rope_theta and partial_rotary_factor from `rope_parameters` (or the legacy top-level keys).
    Qwen3.5's multimodal RoPE (`mrope_section`) rotates text, whose three position ids are equal,
    as plain RoPE: its keys are accepted there and change nothing."""
    if hf.pop("rope_scaling", None) is not None:
        raise _fail("rope_scaling", "unsupported; only null (unscaled RoPE)")
    params = hf.pop("rope_parameters", None) or {}
    if not isinstance(params, dict):
        raise _fail("rope_parameters", f"must be an object, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise _fail("rope_parameters.rope_type", f"unsupported value {rope_type!r}; only 'default' (unscaled RoPE)")
    allowed = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    if text_type != QWEN3_NEXT:
        allowed |= {"mrope_section", "mrope_interleaved"}
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise _fail("rope_parameters", f"unsupported keys {unknown}")
    theta = params.get("rope_theta", hf.pop("rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", hf.pop("partial_rotary_factor", 0.25))
    return {"rope_theta": theta, "partial_rotary_factor": factor}


def _ffn_types(hf: dict[str, Any], text_type: str, count: int) -> list[str]:
    """Each decoder layer's feed-forward kind, as transformers picks it."""
    if text_type == QWEN3_5_TEXT:
        return ["mlp"] * count
    if text_type == QWEN3_5_MOE_TEXT:
        return ["moe"] * count
    step, dense = hf.pop("decoder_sparse_step"), hf.pop("mlp_only_layers") or []
    if not isinstance(step, int) or step < 1:
        raise _fail("decoder_sparse_step", f"must be an int >= 1, got {step!r}")
    if not isinstance(dense, list) or any(not isinstance(i, int) for i in dense):
        raise _fail("mlp_only_layers", f"must be a list of layer indices, got {dense!r}")
    routed = hf["num_experts"] != 0  # ModelConfig checks the count itself
    return ["moe" if routed and i not in dense and (i + 1) % step == 0 else "mlp" for i in range(count)]


def _mixer_types(hf: dict[str, Any]) -> list[str]:
    layers, count = hf.pop("layer_types", None), hf.pop("num_hidden_layers")
    interval = hf.pop("full_attention_interval")
    if not isinstance(count, int) or count < 1:
        raise _fail("num_hidden_layers", f"must be an int >= 1, got {count!r}")
    if layers is None:  # transformers' default: every `full_attention_interval`-th layer attends
        if not isinstance(interval, int) or interval < 1:
            raise _fail("full_attention_interval", f"must be an int >= 1, got {interval!r}")
        layers = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(count)]
    if not isinstance(layers, list) or len(layers) != count:
        raise _fail("layer_types", f"must list num_hidden_layers={count} layer names, got {layers!r}")
    bad = sorted({str(t) for t in layers if t not in _MIXERS})
    if bad:
        raise _fail("layer_types", f"unsupported layer types {bad}; allowed: {sorted(_MIXERS)}")
    return [_MIXERS[t] for t in layers]


def _text_from_hf(raw: dict[str, Any], text_type: str) -> dict[str, Any]:
    hf = {**_DEFAULTS[text_type], **{k: v for k, v in raw.items() if k not in _IGNORED}}
    hf.pop("model_type", None)
    mixers = _mixer_types(hf)
    ffns = _ffn_types(hf, text_type, len(mixers))
    for key, ok, allowed in (("hidden_act", hf.pop("hidden_act") == "silu", "'silu'"),
                             ("attention_bias", hf.pop("attention_bias") is False, "false"),
                             ("attn_output_gate", hf.pop("attn_output_gate") is True, "true"),
                             ("use_sliding_window", hf.pop("use_sliding_window") is False, "false"),
                             ("sliding_window", hf.pop("sliding_window") is None, "null")):
        if not ok:
            raise _fail(key, f"unsupported value {raw.get(key)!r}; only {allowed}")
    if text_type == QWEN3_5_MOE_TEXT:  # its router always renormalizes the chosen experts' weights
        hf["norm_topk_prob"] = True
    out: dict[str, Any] = {
        "layers_block_type": [t for pair in zip(mixers, ffns, strict=True) for t in pair],
        "mlp_hidden_act": "silu", "attention_output_gate": True, "qk_norm": True, **_rope(hf, text_type),
        "n_routed_experts": 0,
    }
    for key, field in _RENAMES.items():
        if key in hf:
            out[field] = hf.pop(key)
    if "moe" in ffns:
        out["moe_shared_expert_gate"] = True
    mtp = _mtp(hf, routed=bool(out["n_routed_experts"]))
    return {**hf, **out, **mtp}


def _mtp(hf: dict[str, Any], routed: bool) -> dict[str, Any]:
    """The MTP layer's keys (`mtp_num_hidden_layers`: 0 or 1) -> ModelConfig's: one step of gated
    attention and the family's feed-forward (MoE where the model has experts, as the published
    checkpoints' `mtp.layers.0.mlp` is)."""
    layers = hf.pop("mtp_num_hidden_layers", 0)
    if hf.pop("mtp_use_dedicated_embeddings", False):
        raise _fail("mtp_use_dedicated_embeddings", "unsupported value true; the MTP layer shares the model's "
                    "embedding (false)")
    if layers not in (0, 1):
        raise _fail("mtp_num_hidden_layers", f"unsupported value {layers!r}; one MTP layer (1) or none (0)")
    if not layers:
        return {}
    return {"num_nextn_predict_layers": 1, "mtp_layers_block_type": ["full_attention", "moe" if routed else "mlp"]}


def qwen_from_hf(raw: dict[str, Any]) -> dict[str, Any]:
    """A Qwen3-Next, Qwen3.5 or Qwen3.5-MoE config.json (text model or multimodal wrapper) ->
    ModelConfig keys; the wrapper keeps its own model_type and architectures."""
    model_type = raw["model_type"]
    architectures = raw.get("architectures") or [_ARCHITECTURES[model_type]]
    if model_type not in WRAPPERS:
        return {**_text_from_hf(raw, model_type), "model_type": model_type, "architectures": architectures}
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise _fail("text_config", f"a {model_type} config.json needs its language model's config, got {text!r}")
    # The wrapper's other keys go on to ModelConfig.from_hf_dict, which ignores the generic ones
    # and names any other.
    rest = {k: v for k, v in raw.items() if k not in _WRAPPER_KEYS | _IGNORED | {"text_config", "tie_word_embeddings"}}
    logger.info("%s is a multimodal checkpoint: its language model (text_config) runs; the vision tower "
                "(vision_config, model.visual.*) is ignored", model_type)
    out = _text_from_hf({k: v for k, v in text.items() if k != "model_type"}, WRAPPERS[model_type])
    if "tie_word_embeddings" in raw:  # the wrapper's own setting is the one transformers applies
        out["tie_word_embeddings"] = raw["tie_word_embeddings"]
    return {**rest, **out, "architectures": architectures}


def _text_to_hf(fields: dict[str, Any], text_type: str) -> dict[str, Any]:
    mixers, ffns = fields["layer_types"][::2], fields["layer_types"][1::2]
    out: dict[str, Any] = {key: fields[key] for key in _SAME}
    eos = fields["eos_token_ids"]
    out.update({
        "num_hidden_layers": len(mixers), "hidden_act": fields["mlp_hidden_act"],
        "layer_types": ["linear_attention" if t == "gated_delta" else t for t in mixers],
        "rms_norm_eps": fields["layer_norm_epsilon"],
        "rope_parameters": {"rope_type": "default", "rope_theta": fields["rope_theta"] or 10000.0,
                            "partial_rotary_factor": fields["partial_rotary_factor"]},
        "eos_token_id": None if not eos else eos[0] if len(eos) == 1 else list(eos),
    })
    if text_type != QWEN3_5_MOE_TEXT:
        out["intermediate_size"] = fields["intermediate_size"]
    if text_type != QWEN3_5_TEXT:
        out.update({"moe_intermediate_size": fields["moe_intermediate_size"],
                    "shared_expert_intermediate_size": fields["moe_shared_expert_intermediate_size"],
                    "num_experts": fields["n_routed_experts"], "num_experts_per_tok": fields["num_experts_per_tok"]})
    if fields["num_nextn_predict_layers"]:
        out["mtp_num_hidden_layers"] = 1
    if text_type == QWEN3_NEXT:
        out.update({"norm_topk_prob": fields["norm_topk_prob"], "decoder_sparse_step": 1,
                    "mlp_only_layers": [i for i, t in enumerate(ffns) if t == "mlp"]})
    return out


def qwen_to_hf(fields: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields -> the config.json transformers' config class of the family reads back to them."""
    model_type = fields["model_type"]
    if model_type not in WRAPPERS:
        return _text_to_hf(fields, model_type)
    text = {"model_type": WRAPPERS[model_type], **_text_to_hf(fields, WRAPPERS[model_type])}
    return {"text_config": text, "tie_word_embeddings": fields["tie_word_embeddings"]}


QWEN_TYPES = (QWEN3_NEXT, QWEN3_5, QWEN3_5_TEXT, QWEN3_5_MOE, QWEN3_5_MOE_TEXT)
