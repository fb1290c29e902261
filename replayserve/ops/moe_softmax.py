"""The routed experts of Granite 4.0-H and the Qwen MoEs (softmax top-k routing, SwiGLU experts): one
entry point, ``softmax_moe``, that runs the Triton kernels or the references of ``ops.moe``.

Its own module, not ``ops.moe``: both kernel modules it calls import ``ops.moe`` (its references
and checks), and the import rule allows no circle.
"""

from __future__ import annotations

from torch import Tensor

from replayserve.ops.dispatch import use_triton
from replayserve.ops.moe import fused_moe_ref, softmax_all_topk_route_ref, softmax_topk_route_ref


def softmax_moe(x: Tensor, logits: Tensor, w_up: Tensor, w_down: Tensor, top_k: int, renormalize: bool = True,
                add: Tensor | None = None, softmax_first: bool = False,
                scales: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Granite 4.0-H's and the Qwen MoEs' routed SwiGLU experts from their router logits, plus `add`.

    On the kernels (``use_triton``) the softmax routing and its alignment by expert (one launch up
    to 32 tokens, ``moe_softmax_route_triton``), then the grouped GEMMs with silu(gate) * up in the
    up GEMM's epilogue and `add` summed in the down GEMM's (``moe_triton``): no host sync, so CUDA
    graphs capture it. Elsewhere ``softmax_topk_route_ref`` (``softmax_all_topk_route_ref`` with
    `softmax_first` or without `renormalize`) and ``fused_moe_ref``.

    Arguments:
        x: (T, W) the hidden states.
        logits: (T, E) router logits, any float dtype (both families compute them in x's dtype).
        w_up: (E, 2I, W) each expert's gate rows then its up rows, x's dtype; w_down: (E, W, I).
            Or both float8_e4m3fn with `scales`.
        top_k: experts per token.
        renormalize: the chosen k's weights sum to 1 (Granite; Qwen's `norm_topk_prob`); else each
            is its softmax over all E experts.
        add: optional (T, W) in x's dtype (Granite's shared MLP, Qwen's gated shared expert).
        softmax_first: the reference takes the softmax over all E before the top-k (transformers'
            Qwen3NextTopKRouter) instead of over the chosen k (its GraniteMoeHybridTopKGating):
            equal to rounding when renormalized, so the kernel does not tell them apart.
        scales: (up, down) per-expert weight scales of FP8 stacks, each (E,) float32: expert e's gate
            and up rows share the one up scale (the Qwen MoEs requantize them to it at load). The
            kernels widen the FP8 weights in registers and scale the fp32 sums; the activations stay
            in x's dtype (no input scale: the checkpoint's are checked and not applied).

    Returns:
        (T, W) in x.dtype: the routing weights are cast to x's dtype before they scale the experts,
        as transformers casts them.
    """
    if use_triton(x):
        from replayserve.ops.moe_softmax_route_triton import softmax_route_align_triton
        from replayserve.ops.moe_triton import config_for, fused_moe_triton

        config = config_for(x, w_up, w_down, x.shape[0] * top_k, w_up.shape[0])
        ids, weights, aligned = softmax_route_align_triton(logits, top_k, config.block_m, x.dtype,
                                                           renormalize=renormalize)
        return fused_moe_triton(x, w_up, w_down, ids, weights, add=add, config=config, aligned=aligned,
                                scales=scales, swiglu=True)
    if softmax_first or not renormalize:
        ids, weights = softmax_all_topk_route_ref(logits, top_k, renormalize)
    else:
        ids, weights = softmax_topk_route_ref(logits, top_k)
    routed = fused_moe_ref(x, w_up, w_down, ids, weights.to(x.dtype), scales=scales, swiglu=True)
    return routed if add is None else routed + add
