"""Turns a 16/32-bit Nemotron-H checkpoint directory into NVIDIA ModelOpt's FP8 layout:

    replayserve quantize MODEL_DIR OUT_DIR [--exclude PATTERN ...]    (or python -m replayserve.quantize)

Every Linear that no exclude pattern names gets a float8_e4m3fn ``weight`` and a 0-dim float32
``weight_scale`` (``amax / 448``, as ModelOpt computes it); everything else is copied in its own
dtype. ``hf_quant_config.json`` and config.json's ``quantization_config`` say ``quant_algo: FP8``
and list the excluded modules by name, as ModelOpt's exporter does (layout:
``models/quantization.py``). Tokenizer and other files are copied.

No ``input_scale`` is written: static activation scales need a calibration pass over real text,
which this tool does not run. replayserve then scales activations per call from their own
largest value (dynamic per-tensor quantization; config.json records
``input_activations.dynamic: true``). vLLM reads ModelOpt FP8 with static input scales only (its
``ModelOptFp8LinearMethod`` keeps ``input_scale`` as a parameter to load), so such a checkpoint
is for replayserve until calibrated scales are added. No KV-cache scales are written either
(``kv_cache_quant_algo: null``): an FP8 KV cache then runs with scale 1.0.

The default exclusions follow NVIDIA's recipe for its Nemotron-H FP8 checkpoints
(``nemotron_h_default_excludes``): attention layers, the Mamba layer feeding each attention
layer, the LM head, MTP layers and MoE latent projections stay in 16-bit (embeddings, conv1d and
the fp32 router are no Linears and are never quantized). ``--exclude`` replaces that list.
Every pattern must name at least one module (fnmatch wildcards; ``path*`` means ``path`` and the
modules under it, as in ModelOpt's lists).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from replayserve import __version__
from replayserve.config import ATTENTION, MAMBA, ModelConfig
from replayserve.layers.mlp import TopkRouter
from replayserve.models.loader import checkpoint_files, iter_checkpoint
from replayserve.models.nemotron_h import NemotronHForCausalLM
from replayserve.models.quantization import (
    QUANT_CONFIG_FILE,
    QuantConfig,
    QuantizationError,
    quantizable_modules,
    read_quant_config,
)
from replayserve.models.writer import INDEX, save_sharded
from replayserve.ops.fp8 import quantize_fp8_per_tensor

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30


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


def _never_quantized(model: nn.Module) -> list[str]:
    """Modules ModelOpt lists as excluded although they are no Linears: embeddings, the Mamba
    convolutions and the MoE routers."""
    return [name for name, m in model.named_modules()
            if isinstance(m, nn.Embedding | nn.Conv1d | TopkRouter)]


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


def quantize_checkpoint(model_dir: str | Path, out_dir: str | Path, exclude: Sequence[str] | None = None,
                        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> QuantConfig:
    """Writes the FP8 checkpoint of ``model_dir`` to ``out_dir`` (which must be absent or empty).

    exclude: module patterns kept in 16-bit; None takes ``nemotron_h_default_excludes``.
    Returns the quantization config written.
    """
    src, out = Path(model_dir), Path(out_dir)
    if read_quant_config(src) is not None:
        raise QuantizationError(f"{src} is already a quantized checkpoint; give the 16/32-bit one")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"output directory {out} exists and is not empty; give a new directory")
    raw_config = json.loads((src / "config.json").read_text())
    cfg = ModelConfig.from_dir(src)
    if cfg.model_type != "nemotron_h":  # its default excludes and module names are Nemotron-H's
        raise QuantizationError(f"{src} is a {cfg.model_type} checkpoint; quantize writes Nemotron-H (nemotron_h) "
                                "checkpoints only")
    with torch.device("meta"):
        model = NemotronHForCausalLM(cfg)
    linears, _ = quantizable_modules(model)
    patterns = tuple(nemotron_h_default_excludes(cfg) if exclude is None else exclude)
    rule = QuantConfig("FP8", None, patterns, "--exclude")
    modules = [*linears, *_never_quantized(model)]
    unused = [p for p in exclude or () if not any(QuantConfig("FP8", None, (p,), "").is_excluded(m) for m in modules)]
    if unused:
        raise QuantizationError(f"--exclude {unused} name no module of this model; modules are named like "
                                f"{linears[0]!r} or 'lm_head'")
    quantized = {m for m in linears if not rule.is_excluded(m)}
    excluded = sorted(m for m in modules if m not in quantized)

    state: dict[str, torch.Tensor] = {}
    for path, name, tensor in iter_checkpoint(checkpoint_files(src), with_mtp=cfg.num_nextn_predict_layers > 0):
        module = name.removesuffix(".weight")
        if module not in quantized or module == name:
            state[name] = tensor
            continue
        if not torch.isfinite(tensor).all():
            raise QuantizationError(f"checkpoint tensor {name} in {path} holds NaN or Inf values; it cannot be scaled")
        state[name], state[f"{module}.weight_scale"] = quantize_fp8_per_tensor(tensor)
    save_sharded(state, out, max_shard_bytes)
    quant_file, section = _quantization_config(excluded)
    (out / QUANT_CONFIG_FILE).write_text(json.dumps(quant_file, indent=4) + "\n")
    (out / "config.json").write_text(json.dumps({**raw_config, "quantization_config": section}, indent=2) + "\n")
    skip = {"config.json", QUANT_CONFIG_FILE, INDEX}
    for extra in src.iterdir():
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in skip:
            shutil.copy2(extra, out / extra.name)
    return dataclasses.replace(rule, exclude_modules=tuple(excluded), source=str(out / QUANT_CONFIG_FILE))


def add_quantize_arguments(p: argparse.ArgumentParser) -> None:
    """This tool's arguments, shared with ``replayserve quantize``: model_dir, out_dir, --exclude, --max-shard-bytes."""
    p.add_argument("model_dir", help="the 16/32-bit Hugging Face checkpoint directory")
    p.add_argument("out_dir", type=Path, help="where to write the FP8 checkpoint (new or empty)")
    p.add_argument("--exclude", action="append", metavar="PATTERN",
                   help="a module pattern to keep in 16-bit (repeat it); replaces NVIDIA's Nemotron-H recipe")
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
