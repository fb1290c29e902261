"""Granite 4.0-H's and the Qwen MoEs' softmax top-k routing: the Triton route-and-align equals
``softmax_topk_route_ref`` (renormalized) or ``softmax_all_topk_route_ref`` (Qwen without
`norm_topk_prob`: over all experts), ids exact, weights to rounding, and its alignment equals
``align_by_expert`` of those ids; the
reference equals transformers' formula written out (softmax, top-k, renormalised); and the MoE layer
on the kernels equals it on the references (fp32 in the interpreter on the CPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from replayserve.builtin.tiny import tiny_config
from replayserve.layers.granite_ffn import SoftmaxMoE
from replayserve.ops.dispatch import force_triton
from replayserve.ops.moe import softmax_all_topk_route_ref, softmax_topk_route_ref
from replayserve.ops.moe_align_triton import align_by_expert
from replayserve.ops.moe_softmax_route_triton import softmax_route_align_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_reference_is_softmax_then_topk_renormalised() -> None:
    logits = torch.randn(9, 12, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ids, weights = softmax_topk_route_ref(logits, 3)
    probs = torch.softmax(logits, dim=-1)
    want_w, want_ids = probs.topk(3, dim=-1)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights.double(), want_w / want_w.sum(-1, keepdim=True), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "block_m"), [
    (1, 64, 6, 16),   # Granite 4.0-H Tiny's router at batch 1
    (5, 3, 1, 16),    # experts off a power of two, top 1
    (32, 40, 8, 32),  # the most tokens one program routes
    (40, 8, 2, 16),   # past it: the reference's ops and align_by_expert
    (3, 512, 10, 16),  # Qwen3-Next's router at 3 tokens
])
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_and_align_equal_the_reference(num_tokens: int, num_experts: int, top_k: int, block_m: int,
                                             renormalize: bool) -> None:
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(num_tokens)).to(DEVICE)
    ids, weights, (sorted_pairs, block_expert, num_padded) = softmax_route_align_triton(
        logits, top_k, block_m, torch.float32, renormalize=renormalize)
    want_ids, want_w = softmax_all_topk_route_ref(logits, top_k, renormalize)
    if renormalize:  # Granite's reference: the same to rounding
        granite_ids, granite_w = softmax_topk_route_ref(logits, top_k)
        assert torch.equal(granite_ids, want_ids)
        torch.testing.assert_close(granite_w, want_w, atol=1e-6, rtol=1e-6)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_w, atol=1e-6, rtol=1e-6)
    want_pairs, want_experts, want_padded = align_by_expert(want_ids, num_experts, block_m)
    used = int(want_padded.item())
    assert int(num_padded.item()) == used
    assert torch.equal(sorted_pairs[:used], want_pairs[:used])
    assert torch.equal(block_expert[: used // block_m], want_experts[: used // block_m])


def test_granite_moe_on_the_kernels_equals_the_reference() -> None:
    cfg = dataclasses.replace(tiny_config("M*", family="granite"), n_routed_experts=6, num_experts_per_tok=2)
    gen = torch.Generator().manual_seed(1)
    moe = SoftmaxMoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    moe = moe.to(DEVICE)
    x = torch.randn(7, cfg.hidden_size, generator=gen).to(DEVICE)
    add = torch.randn(7, cfg.hidden_size, generator=gen).to(DEVICE)
    want = moe(x, add=add) if DEVICE == "cpu" else None
    with force_triton():
        got = moe(x, add=add)
    if want is None:  # on CUDA the plain call takes the kernels too: the reference by hand
        from replayserve.ops.moe import fused_moe_ref

        ids, weights = softmax_topk_route_ref(torch.nn.functional.linear(x, moe.router.layer.weight), 2)
        want = fused_moe_ref(x, moe.input_linear.weight, moe.output_linear.weight, ids, weights, swiglu=True) + add
    assert not torch.allclose(got, add, atol=1e-3)  # the experts contribute
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
