"""The Qwen MoE block (`layers/qwen_moe.py`) against transformers' own Qwen3NextSparseMoeBlock holding
the same weights (per-expert loop, softmax router, sigmoid-gated shared expert): on the kernels
(routing + grouped GEMM with the shared expert added in its last kernel; fp32 in Triton's interpreter on
the CPU) and on the references, stacked and not, with and without `norm_topk_prob`, at decode sizes
(one routing program) and past them. Stacking keeps the checkpoint's per-expert parameters as views
and a loaded model, its MTP layer included, runs stacked."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock, Qwen3NextTopKRouter

from replayserve.builtin.tiny import make_tiny, tiny_config
from replayserve.layers.qwen_moe import SparseMoeBlock
from replayserve.models.loader import load_model
from replayserve.ops.dispatch import force_triton
from replayserve.ops.moe import softmax_all_topk_route_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_EXPERTS, TOP_K = 6, 2


def _pair(norm_topk_prob: bool, seed: int = 0) -> tuple[SparseMoeBlock, Qwen3NextSparseMoeBlock]:
    """Our block and transformers', the same random weights in both (fp32, unstacked)."""
    cfg = dataclasses.replace(tiny_config("G*", family="qwen3_next"), n_routed_experts=NUM_EXPERTS,
                              num_experts_per_tok=TOP_K, norm_topk_prob=norm_topk_prob)
    ours = SparseMoeBlock(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    hf_cfg = Qwen3NextConfig(hidden_size=cfg.hidden_size, num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K,
                             moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=norm_topk_prob,
                             shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size, hidden_act="silu")
    theirs = Qwen3NextSparseMoeBlock(hf_cfg).eval()
    with torch.no_grad():
        theirs.gate.weight.copy_(ours.gate.weight)
        theirs.experts.gate_up_proj.copy_(torch.stack([torch.cat([m.gate_proj.weight, m.up_proj.weight])
                                                       for m in ours.experts]))
        theirs.experts.down_proj.copy_(torch.stack([m.down_proj.weight for m in ours.experts]))
        theirs.shared_expert.load_state_dict(ours.shared_expert.state_dict())
        theirs.shared_expert_gate.weight.copy_(ours.shared_expert_gate.weight)
    return ours.to(DEVICE), theirs.to(DEVICE)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_router_reference_equals_transformers(norm_topk_prob: bool) -> None:
    ours, theirs = _pair(norm_topk_prob)
    x = torch.randn(9, ours.gate.weight.shape[1], generator=torch.Generator().manual_seed(3)).to(DEVICE)
    _, want_w, want_ids = theirs.gate(x)
    ids, weights = softmax_all_topk_route_ref(torch.nn.functional.linear(x, ours.gate.weight), TOP_K, norm_topk_prob)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=0, atol=0)
    assert isinstance(theirs.gate, Qwen3NextTopKRouter)


@pytest.mark.parametrize("num_tokens", [1, 7, 40])  # 40: past one routing program (the reference's route, aligned)
@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("path", ["kernels", "references"])
def test_block_equals_transformers(path: str, norm_topk_prob: bool, num_tokens: int) -> None:
    if path == "references" and DEVICE != "cpu":
        pytest.skip("on CUDA the plain call takes the kernels")
    ours, theirs = _pair(norm_topk_prob, seed=num_tokens)
    ours.stack_projections_()
    assert ours.expert_stacks() is not None and ours._inputs._stacked() is not None
    x = torch.randn(num_tokens, ours.gate.weight.shape[1], generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.no_grad():
        want = theirs(x[None])[0]
        if path == "kernels":
            with force_triton():
                got = ours(x)
        else:
            got = ours(x)
    routed = want - torch.sigmoid(theirs.shared_expert_gate(x)) * theirs.shared_expert(x)
    assert routed.abs().max() > 1e-2  # the routed experts contribute
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_unstacked_experts_run_one_by_one_and_equal_the_stacked() -> None:
    """Unstacked experts (before `stack_projections_`) take the per-expert loop: the same output."""
    ours, theirs = _pair(True, seed=5)
    x = torch.randn(5, ours.gate.weight.shape[1], generator=torch.Generator().manual_seed(2)).to(DEVICE)
    with torch.no_grad():
        assert ours.expert_stacks() is None
        unstacked = ours(x)
        ours.stack_projections_()
        torch.testing.assert_close(unstacked, ours(x), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(unstacked, theirs(x[None])[0], atol=1e-5, rtol=1e-5)


def test_stacked_experts_stay_the_checkpoints_parameters() -> None:
    ours, _ = _pair(False)
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    ours.stack_projections_()
    after = ours.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    w_up, w_down = ours.expert_stacks()
    inner = w_down.shape[2]
    assert w_up.shape == (NUM_EXPERTS, 2 * inner, w_down.shape[1])
    last = ours.experts[-1]
    assert last.up_proj.weight.data_ptr() == w_up[-1, inner:].data_ptr()
    assert last.down_proj.weight.data_ptr() == w_down[-1].data_ptr()
    with torch.no_grad():  # an in-place load lands in the stack
        last.up_proj.weight.fill_(0.25)
    assert torch.all(w_up[-1, inner:] == 0.25)
    ours.experts[0].gate_proj.weight = torch.nn.Parameter(torch.zeros_like(ours.experts[0].gate_proj.weight))
    assert ours.expert_stacks() is None  # replaced: no longer the stack's view


def test_a_loaded_model_runs_its_moe_blocks_stacked(tmp_path: Path) -> None:
    model = load_model(make_tiny(tmp_path, family="qwen3_next", mtp=True), torch.float32, torch.device("cpu"))
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert len(blocks) == 3 + 1  # "GG*G": layer 0 dense; the MTP layer's MoE
    assert all(b.expert_stacks() is not None and b._inputs._stacked() is not None for b in blocks)
