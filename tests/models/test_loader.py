"""Bad checkpoints fail at load with the file or tensor named, instead of loading wrong weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from replayserve.models.loader import CheckpointError, load_model

CPU = torch.device("cpu")


@pytest.fixture
def model_dir(tmp_path: Path, tiny_model_dir: Path) -> Path:
    """A copy of the tiny checkpoint's config, without its weights."""
    d = tmp_path / "model"
    d.mkdir()
    shutil.copy(tiny_model_dir / "config.json", d / "config.json")
    return d


@pytest.fixture(scope="module")
def state(tiny_model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(tiny_model_dir / "model.safetensors")


def _split(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    names = sorted(state)
    half = len(names) // 2
    return {k: state[k] for k in names[:half]}, {k: state[k] for k in names[half:]}


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.state_dict())


def test_shards_without_an_index_load_when_disjoint(model_dir: Path, tiny_model_dir: Path, state: dict) -> None:
    first, second = _split(state)
    save_file(first, str(model_dir / "a.safetensors"))
    save_file(second, str(model_dir / "b.safetensors"))
    loaded = _params(load_model(model_dir, torch.float32, CPU))
    reference = _params(load_model(tiny_model_dir, torch.float32, CPU))
    assert loaded.keys() == reference.keys()
    assert all(torch.equal(loaded[k], reference[k]) for k in reference)


@pytest.mark.parametrize("spelling", ["backbone.", "model."])
def test_tensor_stored_in_two_files_names_both(model_dir: Path, state: dict, spelling: str) -> None:
    """Without an index every *.safetensors is read: a tensor in two of them is refused, in either
    of its spellings, rather than one copy silently overriding the other."""
    first, second = _split(state)
    name = next(iter(first))
    copy = spelling + name.removeprefix("backbone.")
    save_file(first, str(model_dir / "a.safetensors"))
    save_file({**second, copy: first[name] + 1.0}, str(model_dir / "b.safetensors"))
    with pytest.raises(CheckpointError, match=rf"{name} is stored twice, in .*a\.safetensors and .*b\.safetensors"):
        load_model(model_dir, torch.float32, CPU)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "sub/../../outside.safetensors", "ABSOLUTE"])
def test_index_shard_outside_the_model_directory_is_refused(model_dir: Path, state: dict, shard: str) -> None:
    outside = model_dir.parent / "outside.safetensors"
    save_file(state, str(outside))  # a complete checkpoint: loading it would succeed
    shard = str(outside) if shard == "ABSOLUTE" else shard
    index = {"metadata": {}, "weight_map": dict.fromkeys(state, shard)}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="shards outside the model directory"):
        load_model(model_dir, torch.float32, CPU)


def test_linked_shards_of_a_hub_cache_load(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Hub snapshots link each file to a blob outside the snapshot directory: that is allowed."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_model_dir / name, blobs / name)
        (snapshot / name).symlink_to(Path("..") / ".." / "blobs" / name)
    first, second = _split(load_file(tiny_model_dir / "model.safetensors"))
    (snapshot / "model.safetensors").unlink()
    for shard, part in (("model-1.safetensors", first), ("model-2.safetensors", second)):
        save_file(part, str(blobs / shard))
        (snapshot / shard).symlink_to(Path("..") / ".." / "blobs" / shard)
    weight_map = {**dict.fromkeys(first, "model-1.safetensors"), **dict.fromkeys(second, "model-2.safetensors")}
    (snapshot / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded = _params(load_model(snapshot, torch.float32, CPU))
    reference = _params(load_model(tiny_model_dir, torch.float32, CPU))
    assert all(torch.equal(loaded[k], reference[k]) for k in reference)


@pytest.mark.parametrize(
    ("value", "dtype", "why"),
    [
        (float("nan"), torch.float32, "holds NaN or Inf"),
        (float("inf"), torch.float64, "holds NaN or Inf"),
        (1e6, torch.float16, "overflows torch.float16"),  # finite on disk, past float16's 65504
    ],
)
def test_non_finite_weight_names_the_tensor(model_dir: Path, state: dict, value: float, dtype: torch.dtype,
                                            why: str) -> None:
    name = "backbone.layers.1.mixer.k_proj.weight"
    bad = state[name].clone()
    bad[0, 3] = value
    save_file({**state, name: bad}, str(model_dir / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"{name} in .*model\.safetensors {why}"):
        load_model(model_dir, dtype, CPU)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_integer_weight_names_the_tensor(model_dir: Path, state: dict, dtype: torch.dtype) -> None:
    """copy_ would cast it to the model dtype without a word: an integer A_log loaded as whole numbers."""
    name = "backbone.layers.0.mixer.A_log"
    save_file({**state, name: state[name].round().to(dtype)}, str(model_dir / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"{name} in .*model\.safetensors has dtype {dtype}; .*floating-point"):
        load_model(model_dir, torch.float32, CPU)
