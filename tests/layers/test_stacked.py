"""Stacked projections (`layers/stacked.py`): one GEMM gives what the Linears give one by one, the
parameters stay the checkpoint's (views, loaded in place), the forward falls back when they stop
being views, and a model with stacked projections still writes its checkpoint (views copied)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from replayserve.builtin.tiny import make_tiny
from replayserve.config import ModelConfig
from replayserve.layers.linear import Linear
from replayserve.layers.stacked import StackedProjection, stack_as_views_
from replayserve.models.loader import load_model
from replayserve.models.registry import family_of
from replayserve.models.writer import save_model


def _linears(bias: bool) -> tuple[Linear, ...]:
    torch.manual_seed(0)
    return Linear(16, 8, bias=bias), Linear(16, 4, bias=bias), Linear(16, 4, bias=bias)


@pytest.mark.parametrize("bias", [False, True])
def test_stacked_outputs_equal_the_linears(bias: bool) -> None:
    linears = _linears(bias)
    x = torch.randn(3, 16, dtype=torch.float64)
    for m in linears:
        m.double()
    want = [m(x) for m in linears]
    stacked = StackedProjection(*linears)
    assert stacked.stack_()
    got = stacked(x)
    assert linears[1].weight.data_ptr() == linears[0].weight.data_ptr() + 8 * 16 * 8  # views of one tensor
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)
    with torch.no_grad():  # an in-place load lands in the stack
        linears[2].weight.fill_(0.5)
    torch.testing.assert_close(stacked(x)[2], linears[2](x), rtol=0, atol=1e-12)


@pytest.mark.parametrize("dim", [0, 1])
def test_stack_as_views_keeps_each_parameter_as_a_view_of_its_slice(dim: int) -> None:
    """The MoE layers' expert stacks are made by rows (dim 0) and, Nemotron-H's down projections, by
    columns (dim 1): each parameter keeps its object, shape and values, and writes land in the stack."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(4, 3), (4, 5), (4, 2)] if dim == 1 else [(3, 4), (5, 4), (2, 4)]
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in shapes]
    before = [p.detach().clone() for p in params]
    ids = [id(p) for p in params]
    stack = stack_as_views_(params, dim=dim)
    assert stack.shape == ((10, 4) if dim == 0 else (4, 10))
    assert torch.equal(stack, torch.cat(before, dim=dim))
    assert [id(p) for p in params] == ids
    for p, b in zip(params, before, strict=True):
        assert torch.equal(p, b) and p.untyped_storage().data_ptr() == stack.untyped_storage().data_ptr()
    with torch.no_grad():
        params[1].fill_(7.0)
    assert torch.equal(stack.narrow(dim, 3, 5), torch.full(shapes[1], 7.0))


def test_falls_back_when_the_parameters_move_and_refuses_mixed_biases() -> None:
    linears = _linears(False)
    stacked = StackedProjection(*linears)
    assert stacked.stack_()
    linears[0].weight = torch.nn.Parameter(torch.zeros(8, 16))  # replaced: no longer the stack's view
    x = torch.randn(2, 16)
    assert torch.equal(stacked(x)[0], torch.zeros(2, 8))
    assert not StackedProjection(Linear(16, 4, bias=True), Linear(16, 4, bias=False)).stack_()


def test_a_model_with_stacked_projections_writes_and_reloads(tmp_path: Path) -> None:
    """Bamba has no multipliers: its loaded (stacked) model writes a checkpoint that loads back equal."""
    model = load_model(make_tiny(tmp_path / "src", family="bamba"), torch.float32, torch.device("cpu"))
    attention = next(layer.self_attn for layer in model.backbone.layers if hasattr(layer, "self_attn"))
    assert attention._qkv is not None and not model.weights_rescaled
    save_model(model, tmp_path / "out", torch.float32, max_shard_bytes=1 << 30)
    (tmp_path / "out" / "tokenizer.json").write_bytes((tmp_path / "src" / "tokenizer.json").read_bytes())
    again = load_model(tmp_path / "out", torch.float32, torch.device("cpu"))
    for (name, p), q in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


def test_a_model_with_folded_multipliers_is_not_written(tmp_path: Path) -> None:
    model = load_model(make_tiny(tmp_path / "src", family="falcon_h1"), torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="multipliers folded"):
        save_model(model, tmp_path / "out", torch.float32, max_shard_bytes=1 << 30)


def test_folding_marks_a_model_rescaled_only_once_it_has_run(tmp_path: Path) -> None:
    """Falcon-H1 has multipliers: unprepared it may be written, prepared it may not; Bamba's
    (multipliers of 1) never counts as rescaled."""
    for family, rescaled in (("falcon_h1", True), ("bamba", False)):
        cfg = ModelConfig.from_dir(make_tiny(tmp_path / family, family=family))
        model = family_of(cfg).model_class(cfg)
        assert not model.weights_rescaled
        assert model.prepare_weights_().weights_rescaled == rescaled, family
