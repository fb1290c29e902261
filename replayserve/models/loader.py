"""Loads a Hugging Face Nemotron-H checkpoint directory (`config.json` + `*.safetensors`)."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import torch
from safetensors import SafetensorError, safe_open

from replayserve.config import ModelConfig
from replayserve.models.nemotron_h import NemotronHForCausalLM

logger = logging.getLogger(__name__)

# transformers' in-memory names use `model.`; checkpoints on disk use `backbone.`.
_PREFIXES = (("model.", "backbone."),)
# In-memory fused expert tensors (E, out, in), as transformers 5 holds them.
_FUSED_EXPERTS = re.compile(r"(.*\.mixer\.experts)\.(up_proj|down_proj)$")
# Multi-token-prediction layers: loaded when the config declares them, else skipped.
_MTP = re.compile(r"^mtp\.")
_LM_HEAD = "lm_head.weight"


class CheckpointError(ValueError):
    """The checkpoint directory is missing files or holds tensors the model does not expect."""


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files: the shards `model.safetensors.index.json` names, else every `*.safetensors`."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index} is malformed: {e}") from e
        # Checked on the name, not the resolved path: hub caches link shards to blobs elsewhere.
        outside = [n for n in names if not isinstance(n, str) or PurePosixPath(n).is_absolute()
                   or ".." in PurePosixPath(n).parts or "\\" in n]
        if outside:
            raise CheckpointError(f"{index} names shards outside the model directory: {outside}; "
                                  "shards must be file names relative to it")
        files = [model_dir / name for name in names]
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


def iter_checkpoint(files: list[Path], with_mtp: bool = False) -> Iterator[tuple[Path, str, torch.Tensor]]:
    """Yields (file, parameter name as this engine names it, tensor) for every stored tensor
    (`mtp.*` only when `with_mtp`). A name stored twice, in one spelling or the other, is an error:
    which copy won would depend on file order."""
    stored_in: dict[str, Path] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for raw_name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if not with_mtp and _MTP.match(raw_name):
                        continue
                    name = _canonical_name(raw_name)
                    if name in stored_in:
                        raise CheckpointError(f"tensor {name} is stored twice, in {stored_in[name]} and {path}; "
                                              "a checkpoint holds each tensor once")
                    stored_in[name] = path
                    tensor = f.get_tensor(raw_name)
                    fused = _FUSED_EXPERTS.match(name)
                    if fused:
                        for e, expert in enumerate(tensor):
                            yield path, f"{fused.group(1)}.{e}.{fused.group(2)}.weight", expert
                    else:
                        yield path, name, tensor
        except SafetensorError as e:
            raise CheckpointError(f"{path} is not a valid safetensors file: {e}") from e


def _file_holding(files: list[Path], name: str) -> Path | None:
    """The file that stores tensor `name` (reads headers only), or None."""
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                if name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    return path
        except SafetensorError as e:
            raise CheckpointError(f"{path} is not a valid safetensors file: {e}") from e
    return None


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device, rank: int = 0,
               world_size: int = 1) -> NemotronHForCausalLM:
    """Builds the model from `config.json` and fills every parameter from the checkpoint; with
    `world_size` > 1, tensor-parallel rank `rank`'s slice of it (`models/sharding.py`), each
    checkpoint tensor cut to that rank's part as it is read.

    With `tie_word_embeddings: true` the embedding matrix is the LM head, unless the checkpoint
    stores its own `lm_head.weight`: then that one is used (with a warning naming its file), as
    transformers 5.24 does, whose Nemotron-H never ties. Every tensor must be floating-point and
    finite once cast to `dtype`: an integer tensor, a NaN or Inf (or a value `dtype` cannot hold) is
    an error naming the tensor.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist")
    cfg = ModelConfig.from_dir(model_dir)
    files = checkpoint_files(model_dir)
    if cfg.tie_word_embeddings and (head_file := _file_holding(files, _LM_HEAD)) is not None:
        logger.warning("%s stores %s although config.json sets tie_word_embeddings: true; using the stored "
                       "%s instead of the embedding matrix, as transformers does", head_file, _LM_HEAD, _LM_HEAD)
        cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
    shard = None
    if world_size > 1:
        from replayserve.models.sharding import RankShard  # imports the layers: only when sharding

        shard = RankShard(cfg, rank, world_size)
    with torch.device("meta"):
        model = NemotronHForCausalLM(cfg) if shard is None else shard.build()
    model.allocate_(device, dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.backbone.embeddings.weight
    expected = dict(model.state_dict(keep_vars=True))
    if cfg.tie_word_embeddings:
        expected.pop(_LM_HEAD)
    seen: set[str] = set()
    unexpected = []
    for path, name, tensor in iter_checkpoint(files, with_mtp=cfg.num_nextn_predict_layers > 0):
        target = expected.get(name)
        if target is None:
            unexpected.append(name)
            continue
        if shard is not None:
            tensor = shard.slice(name, tensor)
        if target.is_floating_point() and not tensor.is_floating_point():
            # copy_ would cast it without a word: an integer A_log is a truncated (or quantized) tensor
            raise CheckpointError(f"checkpoint tensor {name} in {path} has dtype {tensor.dtype}; the model needs "
                                  "floating-point weights (float32, bfloat16, float16 or float64)")
        if tuple(tensor.shape) != tuple(target.shape):
            raise CheckpointError(
                f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, the config implies {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(tensor)
        if not torch.isfinite(target).all():
            why = "holds NaN or Inf values" if not torch.isfinite(tensor).all() else f"overflows {target.dtype}"
            raise CheckpointError(f"checkpoint tensor {name} in {path} {why}")
        seen.add(name)
    if unexpected:
        raise CheckpointError(f"checkpoint has tensors this model does not use: {sorted(unexpected)[:8]}")
    missing = sorted(set(expected) - seen)
    if missing:
        raise CheckpointError(f"checkpoint is missing tensors: {missing[:8]}")
    return model.eval()
