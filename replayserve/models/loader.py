"""Loads a Hugging Face Nemotron-H checkpoint directory (`config.json` + `*.safetensors`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from replayserve.config import ModelConfig
from replayserve.models.nemotron_h import NemotronHForCausalLM

# transformers' in-memory names use `model.`; checkpoints on disk use `backbone.`.
_PREFIXES = (("model.", "backbone."),)
# In-memory fused expert tensors (E, out, in), as transformers 5 holds them.
_FUSED_EXPERTS = re.compile(r"(.*\.mixer\.experts)\.(up_proj|down_proj)$")
# Multi-token-prediction layers: loaded when the config declares them, else skipped.
_MTP = re.compile(r"^mtp\.")


class CheckpointError(ValueError):
    """The checkpoint directory is missing files or holds tensors the model does not expect."""


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is malformed: {e}") from e
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names shards that do not exist: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"model directory {model_dir} has no *.safetensors files")
    return files


def _canonical_name(name: str) -> str:
    for old, new in _PREFIXES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def iter_checkpoint(model_dir: Path, with_mtp: bool = False):
    """Yields (parameter name as this engine names it, tensor) for every stored tensor (`mtp.*`
    only when `with_mtp`)."""
    for path in checkpoint_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for raw_name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if not with_mtp and _MTP.match(raw_name):
                        continue
                    name, tensor = _canonical_name(raw_name), f.get_tensor(raw_name)
                    fused = _FUSED_EXPERTS.match(name)
                    if fused:
                        for e, expert in enumerate(tensor):
                            yield f"{fused.group(1)}.{e}.{fused.group(2)}.weight", expert
                    else:
                        yield name, tensor
        except SafetensorError as e:
            raise CheckpointError(f"{path} is not a valid safetensors file: {e}") from e


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device) -> NemotronHForCausalLM:
    """Builds the model from `config.json` and fills every parameter from the checkpoint."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist")
    cfg = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = NemotronHForCausalLM(cfg)
    model.to_empty(device=device)
    model.cast_(dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.backbone.embeddings.weight
    expected = dict(model.state_dict(keep_vars=True))
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight")
    seen: set[str] = set()
    unexpected = []
    for name, tensor in iter_checkpoint(model_dir, with_mtp=cfg.num_nextn_predict_layers > 0):
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue  # tied: the embedding matrix is the output projection
        target = expected.get(name)
        if target is None:
            unexpected.append(name)
            continue
        if tuple(tensor.shape) != tuple(target.shape):
            raise CheckpointError(
                f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, the config implies {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(tensor)
        seen.add(name)
    if unexpected:
        raise CheckpointError(f"checkpoint has tensors this model does not use: {sorted(unexpected)[:8]}")
    missing = sorted(set(expected) - seen)
    if missing:
        raise CheckpointError(f"checkpoint is missing tensors: {missing[:8]}")
    return model.eval()
