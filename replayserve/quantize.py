"""Turns a 16/32-bit checkpoint of any family the loader runs (``models/registry.py``: Nemotron-H,
Granite 4.0-H, Bamba, Falcon-H1, Qwen3-Next, Qwen3.5, Qwen3.5-MoE) into NVIDIA ModelOpt's FP8 layout:

    replayserve quantize MODEL_DIR OUT_DIR [--exclude PATTERN ...]    (or python -m replayserve.quantize)

Every Linear that no exclude pattern names gets a float8_e4m3fn ``weight`` and a 0-dim float32
``weight_scale`` (``amax / 448``, as ModelOpt computes it); everything else is copied in its own
dtype. ``hf_quant_config.json`` and config.json's ``quantization_config`` say ``quant_algo: FP8``
and list the excluded modules by name, as ModelOpt's exporter does (layout:
``models/quantization.py``). Tokenizer and other files are copied. Tensors and excluded modules
keep the checkpoint's own Hugging Face names, its backbone prefix included (``backbone.`` for
Nemotron-H, ``model.`` for the others, ``model.language_model.`` for a multimodal Qwen3.5:
``models/checkpoint_names.py``, the loader's table); experts a checkpoint stores fused as
transformers 5 holds them are written one tensor per expert, as the loader reads FP8 experts.
A multimodal checkpoint's vision tower and MTP layers its config does not declare (tensors the
engine does not load) are copied as they are and listed as excluded.

No ``input_scale`` is written: static activation scales need a calibration pass over real text,
which this tool does not run. replayserve then scales activations per call from their own
largest value (dynamic per-tensor quantization; config.json records
``input_activations.dynamic: true``). vLLM reads ModelOpt FP8 with static input scales only (its
``ModelOptFp8LinearMethod`` keeps ``input_scale`` as a parameter to load), so such a checkpoint
is for replayserve until calibrated scales are added. No KV-cache scales are written either
(``kv_cache_quant_algo: null``): an FP8 KV cache then runs with scale 1.0.

What stays 16-bit by default (``default_excludes``; ``--exclude`` replaces it):

- Nemotron-H: NVIDIA's recipe for its FP8 checkpoints (``nemotron_h_default_excludes``):
  attention layers, the Mamba layer feeding each attention layer, the LM head, MTP layers and MoE
  latent projections.
- The other families: ModelOpt's default FP8 recipe (``MODELOPT_DEFAULT_EXCLUDES``): the LM head,
  the MoE routers (Granite's ``router.layer``, the Qwen MoEs' ``mlp.gate``) and the Qwen MoEs'
  ``shared_expert_gate``; MTP layers too (transformers builds none, so ModelOpt's export leaves
  them as they are). Everything else is quantized: attention, Mamba and Gated DeltaNet
  projections, MLPs, shared experts and every routed expert of the Qwen MoEs (gate, up and down:
  the loader requantizes each expert's gate and up to one scale and stacks them, and refuses a
  block only partly FP8, so ``--exclude`` must keep a block's experts all or none).

Always 16-bit, whatever ``--exclude`` says: a tied LM head (the embedding table), modules with
weights that are no Linears (embeddings, conv1d, Nemotron-H's fp32 router, Granite's routed
experts, stored as (E, out, in) tensors the loader takes 16-bit only) and the Linears a family
loads 16-bit only (``LOADS_16_BIT_ONLY``: Falcon-H1's ``mamba.in_proj``, whose per-section
multipliers fold into its rows). Every
``--exclude`` pattern must name at least one module (fnmatch wildcards; ``path*`` means ``path``
and the modules under it, as in ModelOpt's lists), spelled as the checkpoint does or as the
engine does (``backbone.``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from replayserve import __version__
from replayserve.config import ATTENTION, MAMBA, ModelConfig
from replayserve.models.checkpoint_names import VISION_PREFIX, backbone_prefix, stored_name
from replayserve.models.fp8_loading import check_expert_kinds
from replayserve.models.loader import checkpoint_files, iter_checkpoint
from replayserve.models.quantization import (
    QUANT_CONFIG_FILE,
    QuantConfig,
    QuantizationError,
    quantizable_modules,
    read_quant_config,
)
from replayserve.models.registry import family_of
from replayserve.models.writer import INDEX, save_sharded
from replayserve.ops.fp8 import quantize_fp8_per_tensor

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
# ModelOpt's default FP8 recipe (`_default_disabled_quantizer_cfg`) in module names: its quantizer
# patterns `*lm_head*`, `*router*`, `*mlp.gate.*` and `*mlp.shared_expert_gate.*` name these
# Linears (its conv1d patterns name no Linear). MTP layers are no module of transformers' classes,
# so ModelOpt's export copies them as they are: kept 16-bit here too.
MODELOPT_DEFAULT_EXCLUDES = ("lm_head", "*router*", "*.mlp.gate", "*.mlp.shared_expert_gate", "mtp*")
# Linears that load in 16-bit only, whatever --exclude says: Falcon-H1 folds per-section
# multipliers into in_proj's rows, which an FP8 Linear's one scale cannot hold (layers/fold.py).
LOADS_16_BIT_ONLY = {"falcon_h1": ("*.mamba.in_proj",)}


def nemotron_h_default_excludes(cfg: ModelConfig) -> tuple[str, ...]:
    """Module patterns NVIDIA's Nemotron-H FP8 recipe keeps in 16-bit, for this layer pattern:
    every attention layer, the Mamba layer right before each one, the LM head, the MTP layers and
    the MoE latent projections."""
    patterns = ["lm_head", "mtp.*", "*.mixer.fc1_latent_proj", "*.mixer.fc2_latent_proj"]
    for i, kind in enumerate(cfg.layer_types):
        if kind == ATTENTION:
            patterns.append(f"backbone.layers.{i}.mixer*")
            if i > 0 and cfg.layer_types[i - 1] == MAMBA:
                patterns.append(f"backbone.layers.{i - 1}.mixer*")
    return tuple(patterns)


def default_excludes(cfg: ModelConfig) -> tuple[str, ...]:
    """The module patterns kept in 16-bit when no --exclude is given: NVIDIA's Nemotron-H recipe
    for Nemotron-H, ModelOpt's default FP8 recipe for the other families."""
    return nemotron_h_default_excludes(cfg) if cfg.model_type == "nemotron_h" else MODELOPT_DEFAULT_EXCLUDES


def _never_quantized(model: nn.Module) -> list[str]:
    """Modules that hold weights but are no Linears, which ModelOpt's export lists as excluded:
    embeddings, convolutions, MoE routers and Granite's (E, out, in) expert stacks."""
    return [name for name, m in model.named_modules()
            if not isinstance(m, nn.Linear) and any(p.dim() > 1 for p in m.parameters(recurse=False))]


def _quantization_config(excluded: list[str]) -> tuple[dict, dict]:
    """(hf_quant_config.json, config.json quantization_config) for FP8 weights with dynamic
    activation scales, in ModelOpt's two spellings."""
    producer = {"name": "replayserve", "version": __version__}
    quant_file = {"producer": producer,
                  "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": excluded}}
    section = {
        "config_groups": {"group_0": {"input_activations": {"dynamic": True, "num_bits": 8, "type": "float"},
                                      "weights": {"dynamic": False, "num_bits": 8, "type": "float"},
                                      "targets": ["Linear"]}},
        "ignore": excluded, "quant_algo": "FP8", "producer": producer, "quant_method": "modelopt",
    }
    return quant_file, section


def _stored_names(files: list[Path]) -> list[str]:
    """Every tensor name the checkpoint stores, as stored (headers only)."""
    names: list[str] = []
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            names.extend(f.keys())
    return names


def _vision_tower(files: list[Path]) -> dict[str, torch.Tensor]:
    """A multimodal checkpoint's vision tower, by stored name: copied as it is (the loader skips it)."""
    tensors = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            tensors.update({n: f.get_tensor(n) for n in f.keys() if n.startswith(VISION_PREFIX)})  # noqa: SIM118
    return tensors


def _chosen_modules(model: nn.Module, cfg: ModelConfig, exclude: Sequence[str] | None, stored: list[str],
                    ) -> tuple[set[str], list[str]]:
    """(the Linears to quantize, every module kept 16-bit), as the engine names them; the errors
    name them as the checkpoint's tensor names (`stored`) spell them. A tied LM head (not stored:
    the embedding table) stays 16-bit."""
    prefix = backbone_prefix(stored)
    linears, _ = quantizable_modules(model)
    modules = [*linears, *_never_quantized(model)]
    unused = [p for p in exclude or () if not any(QuantConfig("FP8", None, (p,), "").is_excluded(m) for m in modules)]
    if unused:
        raise QuantizationError(f"--exclude {unused} name no module of this model; modules are named like "
                                f"{stored_name(linears[0], prefix)!r} or 'lm_head'")
    patterns = (*(default_excludes(cfg) if exclude is None else exclude), *LOADS_16_BIT_ONLY.get(cfg.model_type, ()))
    rule = QuantConfig("FP8", None, patterns, "--exclude")
    quantized = {m for m in linears if not rule.is_excluded(m) and (m != "lm_head" or "lm_head.weight" in stored)}
    check_expert_kinds(model, quantized, "--exclude", lambda m: stored_name(m, prefix))
    return quantized, [m for m in modules if m not in quantized]


def quantize_checkpoint(model_dir: str | Path, out_dir: str | Path, exclude: Sequence[str] | None = None,
                        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> QuantConfig:
    """Writes the FP8 checkpoint of ``model_dir`` to ``out_dir`` (which must be absent or empty).

    exclude: module patterns kept in 16-bit; None takes ``default_excludes``.
    Returns the quantization config written (exclude_modules in the checkpoint's names).
    """
    src, out = Path(model_dir), Path(out_dir)
    if read_quant_config(src) is not None:
        raise QuantizationError(f"{src} is already a quantized checkpoint; give the 16/32-bit one")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"output directory {out} exists and is not empty; give a new directory")
    raw_config = json.loads((src / "config.json").read_text())
    cfg = ModelConfig.from_dir(src)
    with torch.device("meta"):
        model = family_of(cfg).model_class(cfg)
    files = checkpoint_files(src)
    names = _stored_names(files)
    prefix = backbone_prefix(names)
    quantized, kept = _chosen_modules(model, cfg, exclude, names)

    state = _vision_tower(files)
    modelled = set(model.state_dict())
    for path, name, tensor in iter_checkpoint(files, with_mtp=True):
        module = name.removesuffix(".weight")
        if name not in modelled and tensor.dim() > 1:  # MTP layers the config does not declare: copied
            kept.append(module)
        if module not in quantized or module == name:
            state[stored_name(name, prefix)] = tensor
            continue
        if not torch.isfinite(tensor).all():
            raise QuantizationError(f"checkpoint tensor {name} in {path} holds NaN or Inf values; it cannot be scaled")
        stored = stored_name(module, prefix)
        state[f"{stored}.weight"], state[f"{stored}.weight_scale"] = quantize_fp8_per_tensor(tensor)
    save_sharded(state, out, max_shard_bytes)
    excluded = sorted(stored_name(m, prefix) for m in kept) + (["model.visual*"] if any(
        n.startswith(VISION_PREFIX) for n in state) else [])
    quant_file, section = _quantization_config(excluded)
    (out / QUANT_CONFIG_FILE).write_text(json.dumps(quant_file, indent=4) + "\n")
    (out / "config.json").write_text(json.dumps({**raw_config, "quantization_config": section}, indent=2) + "\n")
    skip = {"config.json", QUANT_CONFIG_FILE, INDEX}
    for extra in src.iterdir():
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in skip:
            shutil.copy2(extra, out / extra.name)
    return QuantConfig("FP8", None, tuple(excluded), str(out / QUANT_CONFIG_FILE))


def add_quantize_arguments(p: argparse.ArgumentParser) -> None:
    """This tool's arguments, shared with ``replayserve quantize``: model_dir, out_dir, --exclude, --max-shard-bytes."""
    p.add_argument("model_dir", help="the 16/32-bit Hugging Face checkpoint directory")
    p.add_argument("out_dir", type=Path, help="where to write the FP8 checkpoint (new or empty)")
    p.add_argument("--exclude", action="append", metavar="PATTERN",
                   help="a module pattern to keep in 16-bit (repeat it); replaces the family's default "
                        "(NVIDIA's Nemotron-H recipe, ModelOpt's default FP8 recipe for the others)")
    p.add_argument("--max-shard-bytes", type=int, default=DEFAULT_MAX_SHARD_BYTES,
                   help="largest safetensors shard (default: %(default)s)")


def quantize_from_args(args: argparse.Namespace, model_dir: str | Path) -> str:
    """Runs ``quantize_checkpoint`` for parsed ``add_quantize_arguments``; returns the line to print."""
    quant = quantize_checkpoint(model_dir, args.out_dir, args.exclude, args.max_shard_bytes)
    return (f"wrote {args.out_dir}: FP8 weights with dynamic activation scales; kept in 16-bit: "
            f"{', '.join(quant.exclude_modules)}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m replayserve.quantize", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_quantize_arguments(p)
    args = p.parse_args(argv)
    try:
        print(quantize_from_args(args, args.model_dir))
    except (QuantizationError, FileExistsError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
