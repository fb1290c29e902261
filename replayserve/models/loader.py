"""Loads a Hugging Face Nemotron-H checkpoint directory (`config.json` + `*.safetensors`)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from replayserve.config import ModelConfig
from replayserve.models.checkpoint_error import CheckpointError
from replayserve.models.checkpoint_names import VISION_PREFIX, canonical_name
from replayserve.models.fp8_loading import keep_row_scales_, prepare_fp8_model
from replayserve.models.quantization import read_quant_config
from replayserve.models.registry import family_of
from replayserve.models.sharding import RankShard
from replayserve.ops.fp8 import FP8_DTYPE

logger = logging.getLogger(__name__)

# In-memory fused expert tensors (E, out, in), as transformers 5 holds them.
_FUSED_EXPERTS = re.compile(r"(.*\.mixer\.experts)\.(up_proj|down_proj)$")
# The Qwen MoE's in-memory form: gate and up stacked in one (E, 2 I, H) tensor, down (E, H, I).
_FUSED_GATE_UP = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
# Multi-token-prediction layers: loaded when the config declares them, else skipped.
_MTP = re.compile(r"^mtp\.")
_LM_HEAD = "lm_head.weight"
T = TypeVar("T")
# safetensors' dtype names, for reading a tensor's dtype from the header without its data.
_HEADER_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "BF16": torch.bfloat16, "F16": torch.float16,
                  "F32": torch.float32, "F64": torch.float64}

__all__ = ["CheckpointError", "checkpoint_files", "iter_checkpoint", "load_model"]


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


def _walk(files: list[Path], with_mtp: bool, read: Callable[[Any, str], T]) -> Iterator[tuple[Path, str, T]]:
    """Yields (file, tensor name as this engine names it, read(handle, stored name)) for every stored
    tensor (`mtp.*` only when `with_mtp`; a vision tower never). The one walk over the files: a safetensors error,
    in `read` too, becomes a CheckpointError naming the file."""
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for raw_name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if (with_mtp or not _MTP.match(raw_name)) and not raw_name.startswith(VISION_PREFIX):
                        yield path, canonical_name(raw_name), read(f, raw_name)
        except SafetensorError as e:
            raise CheckpointError(f"{path} is not a valid safetensors file: {e}") from e


def iter_checkpoint(files: list[Path], with_mtp: bool = False) -> Iterator[tuple[Path, str, torch.Tensor]]:
    """Yields (file, parameter name as this engine names it, tensor) for every stored tensor
    (`mtp.*` only when `with_mtp`). A name stored twice, in one spelling or the other, is an error:
    which copy won would depend on file order."""
    stored_in: dict[str, Path] = {}
    for path, name, tensor in _walk(files, with_mtp, lambda f, raw_name: f.get_tensor(raw_name)):
        if name in stored_in:
            raise CheckpointError(f"tensor {name} is stored twice, in {stored_in[name]} and {path}; "
                                  "a checkpoint holds each tensor once")
        stored_in[name] = path
        fused = _FUSED_EXPERTS.match(name)
        gate_up = _FUSED_GATE_UP.match(name)
        if fused:
            for e, expert in enumerate(tensor):
                yield path, f"{fused.group(1)}.{e}.{fused.group(2)}.weight", expert
        elif gate_up:
            for e, expert in enumerate(tensor):
                parts = expert.chunk(2) if gate_up.group(2) == "gate_up_proj" else (expert,)
                names = ("gate_proj", "up_proj") if len(parts) == 2 else ("down_proj",)
                for part_name, part in zip(names, parts, strict=True):
                    yield path, f"{gate_up.group(1)}.{e}.{part_name}.weight", part
        else:
            yield path, name, tensor


def _header_entry(f: Any, raw_name: str) -> torch.Tensor:
    """A meta tensor of the stored tensor's dtype and shape; a tensor of at most one value is read."""
    part = f.get_slice(raw_name)
    shape = part.get_shape()
    if math.prod(shape) <= 1:
        return f.get_tensor(raw_name)
    return torch.empty(shape, dtype=_HEADER_DTYPES.get(part.get_dtype(), torch.uint8), device="meta")


def checkpoint_header(files: list[Path], with_mtp: bool = False) -> dict[str, torch.Tensor]:
    """Every stored tensor as this engine names it -> a meta tensor of its dtype and shape, except
    tensors of at most one value (the FP8 scales), which are read. Reads headers and scales only."""
    return {name: entry for _, name, entry in _walk(files, with_mtp, _header_entry)}


def _all_finite(t: torch.Tensor) -> bool:
    # isfinite has no float8 kernel; every e4m3fn value is exact in float16 (NaN stays NaN)
    return bool(torch.isfinite(t.to(torch.float16) if t.dtype == FP8_DTYPE else t).all())


def _file_holding(files: list[Path], name: str) -> Path | None:
    """The file that stores tensor `name` as this engine names it (reads headers only), or None."""
    return next((path for path, stored, _ in _walk(files, True, lambda f, raw_name: None) if stored == name), None)


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device, rank: int = 0,
               world_size: int = 1) -> nn.Module:
    """Builds the model of the checkpoint's family (`models/registry.py`) from `config.json` and
    fills every parameter from the checkpoint; with `world_size` > 1, tensor-parallel rank
    `rank`'s slice of it (`models/sharding.py`), each checkpoint tensor cut to that rank's part as
    it is read.

    With `tie_word_embeddings: true` the embedding matrix is the LM head, unless the checkpoint
    stores its own `lm_head.weight`: then that one is used (with a warning naming its file), as
    transformers 5.24 does, whose Nemotron-H never ties. Every tensor must be floating-point and
    finite once cast to `dtype`: an integer tensor, a NaN or Inf (or a value `dtype` cannot hold) is
    an error naming the tensor.

    A ModelOpt FP8 checkpoint (`hf_quant_config.json` or config.json's `quantization_config`) is
    checked before anything is allocated and its quantized Linears load as `FP8Linear`s, their
    weights in float8_e4m3fn (`models/fp8_loading.py`). Under tensor parallelism each rank cuts the
    FP8 codes as it cuts a 16-bit weight and keeps every per-tensor scale whole (it applies to each
    slice); a Qwen expert's gate and up are requantized to one scale after the cut, which gives the
    codes of requantizing first, the scales being per tensor.
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
    model_class = family_of(cfg).model_class
    shard = RankShard(cfg, rank, world_size) if world_size > 1 else None
    quant = read_quant_config(model_dir)
    with_mtp = cfg.num_nextn_predict_layers > 0
    with torch.device("meta"):
        model = model_class(cfg) if shard is None else shard.build(model_class)
    fp8 = None if quant is None else prepare_fp8_model(model, quant, checkpoint_header(files, with_mtp))
    model.allocate_(device, dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.backbone.embeddings.weight
    expected = dict(model.state_dict(keep_vars=True))
    if cfg.tie_word_embeddings:
        expected.pop(_LM_HEAD)
    seen: set[str] = set()
    unexpected = []
    for path, name, tensor in iter_checkpoint(files, with_mtp=with_mtp):
        target = expected.get(name)
        if target is None:
            if fp8 is None or not fp8.takes_as_scale(name):  # KV-cache scales, experts' input scales: checked
                unexpected.append(name)
            continue
        if shard is not None:
            tensor = shard.slice(name, tensor)
        if fp8 is not None:
            tensor = fp8.loaded(tensor, target)
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
        if not _all_finite(target):
            why = "holds NaN or Inf values" if not _all_finite(tensor) else f"overflows {target.dtype}"
            raise CheckpointError(f"checkpoint tensor {name} in {path} {why}")
        seen.add(name)
    if unexpected:
        raise CheckpointError(f"checkpoint has tensors this model does not use: {sorted(unexpected)[:8]}")
    missing = sorted(set(expected) - seen)
    if missing:
        raise CheckpointError(f"checkpoint is missing tensors: {missing[:8]}")
    if hasattr(model, "prepare_weights_"):  # the Granite-style families: multipliers folded, projections stacked
        model.prepare_weights_()
    if fp8 is not None:  # after the folding, which rescales weight_scale
        keep_row_scales_(model)
    return model.eval()
