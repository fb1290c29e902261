"""`save_model` writes Hugging Face shards with an index that our loader reads back exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from replayserve.builtin.tiny import make_tiny
from replayserve.models.loader import load_model
from replayserve.models.writer import INDEX, save_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    src = make_tiny(tmp_path_factory.mktemp("writer"), seed=2, layers="M*-ME", num_nextn_predict_layers=1,
                    mtp_layer_types=("full_attention", "moe"))
    return load_model(src, torch.float32, CPU)


def test_shards_stay_under_the_limit_and_load_back_equal(mtp_model: torch.nn.Module, tmp_path: Path) -> None:
    limit = 200_000
    files = save_model(mtp_model, tmp_path, torch.float32, max_shard_bytes=limit)
    shards = sorted(tmp_path.glob("*.safetensors"))
    n = len(shards)
    assert n > 2 and [s.name for s in shards] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert set(files) == {tmp_path / "config.json", tmp_path / INDEX, *shards}
    index = json.loads((tmp_path / INDEX).read_text())
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            names = list(f.keys())  # noqa: SIM118 - safe_open is not a mapping
            size = sum(f.get_tensor(k).numel() * 4 for k in names)
        assert size <= limit or len(names) == 1
        assert all(index["weight_map"][k] == shard.name for k in names)
    assert any(k.startswith("mtp.layers.") for k in index["weight_map"])
    loaded = load_model(tmp_path, torch.float32, CPU).state_dict()
    original = mtp_model.state_dict()
    assert loaded.keys() == original.keys()
    assert all(torch.equal(loaded[k], original[k]) for k in original)


def test_a_model_that_fits_one_shard_is_one_file_and_routers_stay_float32(mtp_model: torch.nn.Module,
                                                                          tmp_path: Path) -> None:
    save_model(mtp_model, tmp_path, torch.bfloat16, max_shard_bytes=10**9)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        dtypes = {k: f.get_tensor(k).dtype for k in f.keys()}  # noqa: SIM118 - safe_open is not a mapping
    gates = [k for k in dtypes if ".gate." in k]
    assert gates and all(dtypes[k] == torch.float32 for k in gates)
    assert all(dtypes[k] == torch.bfloat16 for k in dtypes if k not in gates)
    loaded = load_model(tmp_path, torch.bfloat16, CPU).state_dict()
    for name, tensor in mtp_model.state_dict().items():
        torch.testing.assert_close(loaded[name].float(), tensor.to(loaded[name].dtype).float(), rtol=0, atol=0)
