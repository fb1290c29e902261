"""The choice between an op's reference and its Triton kernel (``ops/dispatch.py``): what
``use_triton`` answers, how ``force_triton`` puts the CPU on the kernel path (in the interpreter),
that the entry points follow it, and that nothing outside ``ops/`` picks a kernel by itself."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import replayserve
from replayserve.ops import dispatch
from replayserve.ops.activation import relu_square
from replayserve.ops.dispatch import force_triton, use_triton
from replayserve.ops.moe import topk_route
from replayserve.ops.moe_softmax import softmax_moe
from replayserve.ops.replay_ssm import replay_commit

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="forcing shows on CPU tensors")


@CPU_ONLY
def test_cpu_takes_the_references_unless_forced() -> None:
    x32, x64 = torch.zeros(2), torch.zeros(2, dtype=torch.float64)
    assert not use_triton(x32) and not use_triton(x64, None)
    with force_triton():
        assert use_triton(x32) and use_triton(x32.bfloat16()) and use_triton(x32.half())
        assert not use_triton(x64)  # float64 stays with the references: the tests' oracle
        assert use_triton(x64, None)  # a kernel chosen by device alone
        assert not use_triton(x32, (torch.bfloat16,))
    assert not use_triton(x32)


@CPU_ONLY
def test_force_triton_nests_and_ends_on_an_error() -> None:
    x = torch.zeros(1)
    with pytest.raises(KeyError), force_triton():
        with force_triton():
            assert use_triton(x)
        assert use_triton(x)  # the inner one restored the outer one's setting
        raise KeyError("boom")
    assert not use_triton(x)


def test_force_triton_without_a_gpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"), force_triton():
        pass
    assert not dispatch._forced


@CPU_ONLY
def test_entry_points_follow_the_choice() -> None:
    """Observable differences of the two paths: the Triton router's ids are int32 (the reference's
    int64), and the Triton relu^2 writes over its contiguous input."""
    logits, bias = torch.randn(5, 8, generator=torch.Generator().manual_seed(0)), torch.zeros(8)
    assert topk_route(logits, bias, 2, 1, 1, True, 1.0)[0].dtype == torch.int64
    with pytest.raises(ValueError, match="always-on"):
        topk_route(logits, bias, 2, 1, 1, True, 1.0, always=1)
    with force_triton():
        ids, _ = topk_route(logits, bias, 2, 1, 1, True, 1.0, always=1)
        assert ids.dtype == torch.int32 and ids.shape == (5, 3)
        assert topk_route(logits.double(), bias.double(), 2, 1, 1, True, 1.0)[0].dtype == torch.int64
        x = torch.randn(4, 6)
        assert relu_square(x) is x
        strided = torch.randn(6, 4).t()
        assert relu_square(strided) is not strided  # the kernel needs a contiguous tensor
    x = torch.randn(4, 6)
    before = x.clone()
    assert torch.equal(relu_square(x), before.relu().square()) and torch.equal(x, before)


@CPU_ONLY
@pytest.mark.parametrize(("renormalize", "softmax_first"), [(True, False), (True, True), (False, True)])
def test_softmax_moe_follows_the_choice(monkeypatch: pytest.MonkeyPatch, renormalize: bool,
                                        softmax_first: bool) -> None:
    """Granite's and the Qwen MoEs' entry point runs the grouped-GEMM kernel when forced and the
    per-expert reference otherwise (each seen by a spy), with the same result."""
    from replayserve.ops import moe_softmax, moe_triton

    ran: list[str] = []

    def spy(name: str, real: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def call(*args: object, **kwargs: object) -> torch.Tensor:
            ran.append(name)
            return real(*args, **kwargs)
        return call

    for module, name in ((moe_triton, "fused_moe_triton"), (moe_softmax, "fused_moe_ref")):
        monkeypatch.setattr(module, name, spy(name, getattr(module, name)))
    gen = torch.Generator().manual_seed(0)
    x, logits, add = (torch.randn(5, width, generator=gen) for width in (8, 6, 8))
    w_up, w_down = torch.randn(6, 2 * 4, 8, generator=gen) / 3, torch.randn(6, 8, 4, generator=gen) / 2
    args = (x, logits, w_up, w_down, 2, renormalize, add, softmax_first)
    want = softmax_moe(*args)
    assert ran == ["fused_moe_ref"]
    with force_triton():
        got = softmax_moe(*args)
    assert ran == ["fused_moe_ref", "fused_moe_triton"]
    assert not torch.allclose(got, add, atol=1e-3)  # the experts contribute
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_reference_path_skips_the_pad_slot() -> None:
    """Padded decode rows name the pad slot, several at once; the references take them as -1
    (they need distinct slots), so the pad slot's cursors stay as they were."""
    ring_start, history = torch.zeros(4, dtype=torch.int32), torch.tensor([1, 2, 0, 7], dtype=torch.int32)
    is_flush = torch.zeros(4, dtype=torch.bool)
    slots, accepted = torch.tensor([1, 3, 3]), torch.tensor([1, 1, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="distinct"):
        replay_commit(ring_start, history, is_flush, slots, accepted, ring_len=10)
    replay_commit(ring_start, history, is_flush, slots, accepted, ring_len=10, pad_slot=3)
    assert history.tolist() == [1, 3, 0, 7]


ROOT = Path(replayserve.__file__).parent
KERNEL_MODULES = {path.stem for path in (ROOT / "ops").glob("*_triton.py")}


def _is_kernel_module(name: str) -> bool:
    return name.split(".")[0] == "triton" or name.split(".")[-1] in KERNEL_MODULES


def _kernel_imports(source: str) -> set[str]:
    """The Triton and ``*_triton`` modules a module's source imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if _is_kernel_module(a.name)}
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            found |= {module} if _is_kernel_module(module) else {
                f"{module}.{a.name}" for a in node.names if _is_kernel_module(a.name)}
    return found


def test_only_ops_picks_a_kernel() -> None:
    """Outside ``ops/`` no module imports a Triton kernel module, but for the compositions that run
    on the kernels alone, each behind ``use_triton`` (ops/dispatch.py): Nemotron-H's MoE (its
    grouped GEMM with the shared expert folded in; Granite 4.0-H's and the Qwen MoEs' go through
    ``ops.moe_softmax.softmax_moe``), the batch-1 GEMV with the conv update in its epilogue, and
    the packed prefill."""
    importers = {str(path.relative_to(ROOT)): found for path in sorted(ROOT.rglob("*.py"))
                 if path.parent.name != "ops" and (found := _kernel_imports(path.read_text()))}
    assert importers == {
        "layers/mlp.py": {"replayserve.ops.moe_triton", "replayserve.ops.moe_route_triton",
                          "replayserve.ops.moe_align_triton"},
        "layers/mamba2.py": {"replayserve.ops.gemv_triton"},
        "ssm/packed_prefill.py": {"replayserve.ops.conv1d_varlen_triton", "replayserve.ops.ssd_triton"},
    }
