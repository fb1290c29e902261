"""Writes a model in Hugging Face layout: `config.json` and safetensors shards with their index."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

INDEX = "model.safetensors.index.json"


def checkpoint_state(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint stores, with Hugging Face names, cast to `dtype` on the CPU: every
    parameter and buffer (the routers' `e_score_correction_bias` too), the LM head once when tied.
    MoE routers keep their float32 weights in a half checkpoint, as transformers saves them. The
    backbone's prefix is the family's (`checkpoint_prefix`: `model.` for Granite 4.0-H)."""
    if getattr(model, "weights_rescaled", False):
        raise ValueError(f"{type(model).__name__} has its multipliers folded into its weights (layers/fold.py): "
                         "write the model before prepare_weights_() runs, or reload it from its checkpoint")
    keep_wide = {n for n in model.state_dict() if ".gate." in n}
    prefix = getattr(model, "checkpoint_prefix", "backbone.")
    state = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        target = torch.promote_types(dtype, torch.float32) if name in keep_wide else dtype
        stored = prefix + name.removeprefix("backbone.") if name.startswith("backbone.") else name
        # A stacked projection's weights are views of one tensor (layers/stacked.py): safetensors stores
        # no shared memory, so each view gets its own copy.
        cpu = tensor.detach().to("cpu", target).contiguous()
        state[stored] = cpu.clone() if cpu.untyped_storage().nbytes() != cpu.nbytes else cpu
    return state


def save_sharded(state: dict[str, torch.Tensor], out_dir: str | Path, max_shard_bytes: int) -> list[Path]:
    """Writes `state` as `model-0000i-of-0000n.safetensors` shards of at most `max_shard_bytes`
    each (in name order; a tensor larger than that gets a shard of its own) plus
    `model.safetensors.index.json`, or as one `model.safetensors` when everything fits in one.
    Returns the files written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(state):
        nbytes = state[name].numel() * state[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = state[name]
        size += nbytes
    if len(shards) == 1:
        path = out / "model.safetensors"
        save_file(shards[0], str(path), metadata={"format": "pt"})
        return [path]
    files, weight_map = [], {}
    for i, shard in enumerate(shards, start=1):
        path = out / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path), metadata={"format": "pt"})
        files.append(path)
        weight_map.update(dict.fromkeys(shard, path.name))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return [*files, out / INDEX]


def save_model(model: nn.Module, out_dir: str | Path, dtype: torch.dtype,
               max_shard_bytes: int) -> list[Path]:
    """`config.json` plus the checkpoint of `model` in `dtype`, sharded by `save_sharded`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2) + "\n")
    return [out / "config.json", *save_sharded(checkpoint_state(model, dtype), out, max_shard_bytes)]
