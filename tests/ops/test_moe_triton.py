"""The Triton routed experts equal the references of ``replayserve.ops.moe``: routing (ids exact,
weights to rounding), the alignment by expert (both of its implementations, against a plain
construction), and the fused experts against a float64 reference, including experts without
tokens, every token on the same experts, T=1 and sizes off the tile grid. fp32 in the interpreter
on CPU; bf16 too, the MoE layer and a CUDA-graph replay on CUDA."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from replayserve.builtin.tiny import tiny_config
from replayserve.layers.mlp import MoE
from replayserve.ops.activation import relu_square_ref
from replayserve.ops.dispatch import force_triton
from replayserve.ops.moe import fused_moe_ref, topk_route_ref
from replayserve.ops.moe_align_triton import align_by_expert, max_blocks
from replayserve.ops.moe_route_triton import (
    arrivals_counter,
    logits_route_align_triton,
    route_and_align_triton,
    router_logits_triton,
    topk_route_triton,
)
from replayserve.ops.moe_triton import GemmConfig, default_config, fused_moe_triton
from tests.graph_capture import capture

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
cuda_only = pytest.mark.skipif(DEVICE != "cuda", reason="exercised on the H200")


@pytest.mark.parametrize(("num_experts", "top_k", "n_group", "topk_group", "norm", "scaling"), [
    (8, 2, 1, 1, True, 1.0),
    (16, 6, 4, 2, True, 2.5),
    (12, 3, 3, 1, False, 1.5),  # groups of 3 (padded to 4 in the kernel), one group kept
    (128, 6, 1, 1, True, 2.5),  # Nemotron-3-Nano's router
])
@pytest.mark.parametrize("num_tokens", [1, 9, 70])  # 70: three programs of 32 tokens
def test_route_equals_the_reference(num_experts: int, top_k: int, n_group: int, topk_group: int, norm: bool,
                                    scaling: float, num_tokens: int) -> None:
    gen = torch.Generator().manual_seed(num_experts * 100 + num_tokens)
    logits = torch.randn(num_tokens, num_experts, generator=gen) * 2
    bias = torch.randn(num_experts, generator=gen) * 0.5
    args = (top_k, n_group, topk_group, norm, scaling)
    want_ids, want_w = topk_route_ref(logits.double(), bias.double(), *args)
    ids, weights = topk_route_triton(logits.to(DEVICE), bias.to(DEVICE), *args)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.cpu().long(), want_ids)
    torch.testing.assert_close(weights.cpu().double(), want_w, atol=1e-6, rtol=1e-6)


def _plain_alignment(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[list[int], list[int]]:
    """Pairs by expert, each expert's run padded with T * top_k to a multiple of block_m; the
    expert of each block."""
    flat = ids.reshape(-1).tolist()
    pairs: list[int] = []
    owners: list[int] = []
    for e in range(num_experts):
        run = [p for p, x in enumerate(flat) if x == e]
        run += [len(flat)] * (-len(run) % block_m)
        pairs += run
        owners += [e] * (len(run) // block_m)
    return pairs, owners


def test_route_appends_the_always_on_experts() -> None:
    """`always` = S: each row is the top_k choice as without it, then experts E .. E + S - 1 at 1."""
    logits = torch.randn(7, 16, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    bias = torch.randn(16, generator=torch.Generator().manual_seed(3)).to(DEVICE) * 0.1
    ids, weights = topk_route_triton(logits, bias, 4, 4, 2, True, 2.5)
    ids2, weights2 = topk_route_triton(logits, bias, 4, 4, 2, True, 2.5, always=2)
    assert ids2.shape == (7, 6) and torch.equal(ids2[:, :4], ids) and torch.equal(weights2[:, :4], weights)
    assert (ids2[:, 4] == 16).all() and (ids2[:, 5] == 17).all() and (weights2[:, 4:] == 1.0).all()


@pytest.mark.parametrize("one_program", [True, False])
@pytest.mark.parametrize(("num_tokens", "top_k", "num_experts", "block_m"), [
    (1, 6, 128, 16), (5, 2, 8, 16), (40, 4, 8, 32), (3, 2, 64, 16), (300, 2, 4, 16),
])
def test_align_by_expert(one_program: bool, num_tokens: int, top_k: int, num_experts: int, block_m: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    ids[num_tokens // 2:, 0] = 1  # a crowded expert
    sorted_pairs, block_expert, num_padded = align_by_expert(ids.to(torch.int32).to(DEVICE), num_experts, block_m,
                                                             one_program=one_program)
    want_pairs, want_owners = _plain_alignment(ids, num_experts, block_m)
    blocks = max_blocks(num_tokens * top_k, num_experts, block_m)
    assert sorted_pairs.shape == (blocks * block_m,) and block_expert.shape == (blocks,)
    assert num_padded.item() == len(want_pairs) <= blocks * block_m
    assert sorted_pairs[:len(want_pairs)].tolist() == want_pairs
    assert (sorted_pairs[len(want_pairs):] == num_tokens * top_k).all()
    assert block_expert[:len(want_owners)].tolist() == want_owners


@pytest.mark.parametrize(("num_tokens", "hidden", "num_experts"), [(1, 2688, 128), (5, 100, 12), (32, 48, 7),
                                                               (2, 5000, 3)])  # 5000: two steps of 4096
def test_router_logits_equal_the_product(num_tokens: int, hidden: int, num_experts: int) -> None:
    """The cast-in-kernel GEMV is x @ W.T in fp32 (vs float64), for bf16 x too and strided rows."""
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(num_tokens, 2 * hidden, generator=gen)[:, ::2]  # strided rows and columns
    weight = torch.randn(num_experts, hidden, generator=gen) / hidden**0.5
    for dtype in DTYPES:
        xd = x.to(dtype)
        got = router_logits_triton(xd.to(DEVICE), weight.to(DEVICE))
        assert got.dtype == torch.float32 and got.shape == (num_tokens, num_experts)
        torch.testing.assert_close(got.cpu().double(), xd.double() @ weight.double().t(), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "n_group", "topk_group", "always", "block_m"), [
    (1, 128, 6, 1, 1, 2, 16),   # Nemotron-3-Nano at one token, shared expert folded
    (7, 16, 4, 4, 2, 0, 16),
    (32, 12, 3, 3, 1, 1, 32),   # the most tokens one program routes
    (33, 16, 2, 1, 1, 0, 16),   # past it: the two separate calls
])
def test_route_and_align_in_one_program(num_tokens: int, num_experts: int, top_k: int, n_group: int,
                                        topk_group: int, always: int, block_m: int) -> None:
    """One program's ids, weights and alignment equal the route kernel's and the alignment of
    its ids over the E + S experts, and the route kernel's ids equal the reference's."""
    gen = torch.Generator().manual_seed(num_tokens * 31 + num_experts)
    logits = (torch.randn(num_tokens, num_experts, generator=gen) * 2).to(DEVICE)
    bias = (torch.randn(num_experts, generator=gen) * 0.3).to(DEVICE)
    args = (top_k, n_group, topk_group, True, 2.5)
    ids, weights, aligned = route_and_align_triton(logits, bias, *args, block_m=block_m, always=always)
    want_ids, want_weights = topk_route_triton(logits, bias, *args, always=always)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)
    ref_ids, _ = topk_route_ref(logits.cpu().double(), bias.cpu().double(), *args)
    assert torch.equal(ids[:, :top_k].cpu().long(), ref_ids)
    want_pairs, want_owners = _plain_alignment(ids.cpu(), num_experts + always, block_m)
    sorted_pairs, block_expert, num_padded = aligned
    assert num_padded.item() == len(want_pairs)
    assert sorted_pairs[:len(want_pairs)].tolist() == want_pairs
    assert block_expert[:len(want_owners)].tolist() == want_owners


def _small_tiles(num_pairs: int, num_experts: int, swap_ab: bool = False) -> GemmConfig | None:
    """The default tiles on CUDA; in the interpreter the default block_m with 16-wide N and K
    steps (several tiles and K steps on tiny sizes, and fast). swap_ab: the swapped product (out^T =
    W x^T) at those tiles, or on CUDA at the default block_m with 64-wide ones."""
    if DEVICE == "cuda":
        block_m = default_config(num_pairs, num_experts).block_m
        return GemmConfig(block_m=block_m, block_n=64, block_k=64, swap_ab=True) if swap_ab else None
    return GemmConfig(block_m=default_config(num_pairs, num_experts).block_m, block_n=16, block_k=16, swap_ab=swap_ab)


def _weights(num_experts: int, inner: int, width: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w_up = torch.randn(num_experts, inner, width, generator=gen, dtype=torch.float64) / width**0.5
    w_down = torch.randn(num_experts, width, inner, generator=gen, dtype=torch.float64) / inner**0.5
    return w_up, w_down


def _random_ids(num_tokens: int, num_experts: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    return torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("case", "num_tokens", "num_experts", "top_k", "width", "inner"), [
    ("one token", 1, 8, 2, 32, 48),
    ("odd sizes, idle experts", 7, 16, 3, 24, 40),
    ("all on the same experts", 20, 8, 2, 32, 16),
    ("many tokens", 70, 4, 2, 16, 32),
])
@pytest.mark.parametrize(("with_add", "swiglu", "swap_ab"), [(False, False, False), (True, False, False),
                                                        (True, True, False), (False, False, True), (True, True, True)])
def test_fused_moe_equals_the_reference(dtype: torch.dtype, case: str, num_tokens: int, num_experts: int, top_k: int,
                                        width: int, inner: int, with_add: bool, swiglu: bool, swap_ab: bool) -> None:
    gen = torch.Generator().manual_seed(num_tokens * 7 + width)
    w_up, w_down = _weights(num_experts, inner, width, gen)
    if swiglu:  # Granite's experts: the gate's rows, then the up's
        w_up = torch.cat([_weights(num_experts, inner, width, gen)[0], w_up], dim=1)
    x = torch.randn(num_tokens, width, generator=gen, dtype=torch.float64)
    ids = _random_ids(num_tokens, num_experts, top_k, gen)
    if case == "all on the same experts":
        ids[:] = torch.tensor([5, 2])
    if case == "odd sizes, idle experts":
        assert len(ids.unique()) < num_experts
    weights = torch.rand(num_tokens, top_k, generator=gen, dtype=torch.float64) + 0.5
    add = torch.randn(num_tokens, width, generator=gen, dtype=torch.float64) if with_add else None

    def dev(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype).to(DEVICE)

    # The reference on the same rounded inputs, in float64.
    x_r, up_r, down_r = (dev(t).cpu().double() for t in (x, w_up, w_down))
    want = fused_moe_ref(x_r, up_r, down_r, ids, weights.float().double(), swiglu=swiglu)
    if add is not None:
        want = want + dev(add).cpu().double()
    got = fused_moe_triton(dev(x), dev(w_up), dev(w_down), ids.to(torch.int32).to(DEVICE), weights.float().to(DEVICE),
                           add=None if add is None else dev(add),
                           config=_small_tiles(num_tokens * top_k, num_experts, swap_ab), swiglu=swiglu)
    assert got.dtype == dtype and got.shape == (num_tokens, width)
    scale = want.abs().max().item()
    torch.testing.assert_close(got.cpu().double(), want, atol=TOL[dtype] * scale, rtol=TOL[dtype])


def test_fused_moe_has_a_token_route_to_a_wrong_expert_caught() -> None:
    """The comparison above can fail: one token sent to another expert moves the output."""
    gen = torch.Generator().manual_seed(3)
    w_up, w_down = _weights(4, 16, 16, gen)
    x = torch.randn(3, 16, generator=gen, dtype=torch.float64)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]])
    weights = torch.ones(3, 2, dtype=torch.float64)
    wrong = ids.clone()
    wrong[1, 0] = 0
    got = fused_moe_triton(x.float().to(DEVICE), w_up.float().to(DEVICE), w_down.float().to(DEVICE),
                           wrong.to(torch.int32).to(DEVICE), weights.float().to(DEVICE), config=_small_tiles(6, 4))
    assert not torch.allclose(got.cpu().double(), fused_moe_ref(x, w_up, w_down, ids, weights), atol=1e-3)


def _moe_config(latent: bool, shared: int = 32) -> object:
    """`shared` = 96, twice the routed width: the shared expert folds into 2 pseudo-experts."""
    return dataclasses.replace(tiny_config("E"), hidden_size=64, n_routed_experts=16, num_experts_per_tok=4,
                               moe_intermediate_size=48, moe_shared_expert_intermediate_size=shared, n_group=4,
                               topk_group=2, routed_scaling_factor=2.5, moe_latent_size=32 if latent else None)


def _random_moe(latent: bool, seed: int = 0, shared: int = 32) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(_moe_config(latent, shared)).double()
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
        moe.gate.e_score_correction_bias.copy_(torch.randn(moe.gate.num_experts) * 0.1)
    return moe


def test_stacked_experts_are_the_parameters() -> None:
    moe = _random_moe(latent=False)
    w_up, w_down = moe.stacked_experts()
    assert w_up.shape == (16, 48, 64) and w_down.shape == (16, 64, 48)
    with torch.no_grad():
        moe.experts[3].up_proj.weight.fill_(0.5)  # an in-place load lands in the stack
    assert (w_up[3] == 0.5).all()
    assert moe.stacked_experts()[0] is w_up
    moe.float()  # moved parameters are stacked again
    w_up32, _ = moe.stacked_experts()
    assert w_up32.dtype == torch.float32 and (w_up32[3] == 0.5).all()
    assert moe.experts[3].up_proj.weight.data_ptr() == w_up32[3].data_ptr()
    assert set(moe.state_dict()) >= {"experts.3.up_proj.weight", "experts.15.down_proj.weight"}


def test_a_folded_shared_expert_is_two_pseudo_experts_of_the_stacks() -> None:
    moe = _random_moe(latent=False, shared=96)
    assert moe.num_folded == 2 and _random_moe(latent=True, shared=96).num_folded == 0
    x = torch.randn(3, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    shared_before = moe.shared_experts(x)
    w_up, w_down = moe.stacked_experts()
    assert w_up.shape == (18, 48, 64) and w_down.shape == (18, 64, 48)
    torch.testing.assert_close(moe.shared_experts(x), shared_before, rtol=0, atol=0)  # same values, now views
    pieces = sum(F.linear(relu_square_ref(F.linear(x, w_up[16 + s])), w_down[16 + s]) for s in range(2))
    torch.testing.assert_close(pieces, shared_before)
    with torch.no_grad():  # in-place loads land in the stacks, down projections included
        moe.shared_experts.down_proj.weight[:, 50].fill_(0.25)
        moe.experts[15].down_proj.weight.fill_(0.5)
    assert (w_down[17][:, 2] == 0.25).all() and (w_down[15] == 0.5).all()
    assert moe.stacked_experts()[1] is w_down


@pytest.mark.skipif(DEVICE == "cuda", reason="the CUDA test below runs this path for real")
@pytest.mark.parametrize(("latent", "shared", "num_tokens"), [(False, 32, 5), (True, 32, 5), (False, 96, 5),
                                                              (False, 96, 40)])  # folded up to 32 tokens
def test_moe_layer_triton_path_in_the_interpreter(latent: bool, shared: int, num_tokens: int) -> None:
    """MoE.forward's Triton branch (router, stacks, latent projections, the shared expert added
    or folded in as pseudo-experts) on CPU."""
    moe = _random_moe(latent, shared=shared).float()
    x = torch.randn(num_tokens, 64, generator=torch.Generator().manual_seed(5))
    want = _random_moe(latent, shared=shared).float().double()(x.double())
    with force_triton():
        got = moe(x)
    torch.testing.assert_close(got.double(), want, atol=1e-4 * want.abs().max().item(), rtol=1e-4)


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("latent", "shared"), [(False, 32), (True, 32), (False, 96)])
@pytest.mark.parametrize("num_tokens", [1, 37, 300])
def test_moe_layer_on_cuda_equals_the_reference(dtype: torch.dtype, latent: bool, shared: int,
                                                num_tokens: int) -> None:
    """The reference runs the same rounded weights and input in float64 (the CPU path), so that
    only float32 against float64 router logits could change a choice. Shared width 96 folds the
    shared expert into the grouped GEMM up to 32 tokens."""
    cuda = _random_moe(latent, shared=shared).to(dtype).cuda()
    cuda.gate.float()
    ref = _random_moe(latent, shared=shared).to(dtype).double()
    x = torch.randn(num_tokens, 64, generator=torch.Generator().manual_seed(num_tokens)).to(dtype)
    want = ref(x.double())
    got = cuda(x.cuda())
    scale = want.abs().max().item()
    torch.testing.assert_close(got.cpu().double(), want, atol=3 * TOL[dtype] * scale, rtol=3 * TOL[dtype])


@cuda_only
def test_moe_layer_replays_in_a_cuda_graph() -> None:
    moe = _random_moe(latent=False).to(torch.bfloat16).cuda()
    moe.gate.float()
    static_x = torch.randn(8, 64, dtype=torch.bfloat16, device="cuda")
    graph, static_out = capture(moe, static_x)
    for seed in range(3):
        static_x.copy_(torch.randn(8, 64, generator=torch.Generator().manual_seed(seed)).to(static_x))
        graph.replay()
        assert torch.equal(static_out, moe(static_x))


@pytest.mark.parametrize(("num_tokens", "hidden", "num_experts", "top_k", "n_group", "topk_group", "always"), [
    (1, 2688, 128, 6, 1, 1, 2),  # Nemotron-3-Nano at one token, shared expert folded
    (7, 100, 16, 4, 4, 2, 0),
    (32, 48, 12, 3, 3, 1, 1),   # the most tokens it takes
])
def test_logits_route_align_in_one_launch(num_tokens: int, hidden: int, num_experts: int, top_k: int, n_group: int,
                                          topk_group: int, always: int) -> None:
    """The last-arriving program's routing equals the logits kernel then the one-program route and
    align on every launch: the arrivals counter is back at zero after each (three
    launches on one counter; on CUDA programs finish in any order)."""
    gen = torch.Generator().manual_seed(num_tokens + hidden)
    x = torch.randn(num_tokens, 2 * hidden, generator=gen)[:, ::2].to(DEVICE)  # strided rows and columns
    weight = (torch.randn(num_experts, hidden, generator=gen) / hidden**0.5).to(DEVICE)
    bias = (torch.randn(num_experts, generator=gen) * 0.3).to(DEVICE)
    args = (top_k, n_group, topk_group, True, 2.5)
    want_ids, want_w, want_al = route_and_align_triton(router_logits_triton(x, weight), bias, *args, block_m=16,
                                                       always=always)
    arrivals = arrivals_counter(x.device)
    for _ in range(3):
        ids, weights, aligned = logits_route_align_triton(x, weight, arrivals, bias, *args, block_m=16, always=always)
        assert arrivals.item() == 0
        assert torch.equal(ids, want_ids)  # the logits' sums may round differently on a GPU: weights to 1e-6
        torch.testing.assert_close(weights, want_w, atol=1e-6, rtol=1e-6)
        used = int(want_al[2].item())
        assert torch.equal(aligned[2], want_al[2]) and torch.equal(aligned[0][:used], want_al[0][:used])
        assert torch.equal(aligned[1][:used // 16], want_al[1][:used // 16])
    with pytest.raises(ValueError, match="route_and_align_triton"):
        logits_route_align_triton(torch.zeros(33, hidden, device=DEVICE), weight, arrivals, bias, *args, block_m=16)



def test_decode_tiles_step_deeper_on_fp8_experts_but_keep_the_activation_tile() -> None:
    """Decode tiles read 256 bytes of a weight column per K step (FP8 experts: 256 deep, 16-bit: 128,
    fp32: 64), while the 16-row activation tile stays within 16 x 256 bf16: float32 activations on
    FP8 experts step 128 deep (256 would crowd shared memory on the GPU)."""
    depth = {(w, a): default_config(8, 64, weight_bytes=w, act_bytes=a).block_k for w in (1, 2, 4) for a in (2, 4)}
    assert depth == {(1, 2): 256, (1, 4): 128, (2, 2): 128, (2, 4): 128, (4, 2): 64, (4, 4): 64}
    assert default_config(64 * 64, 64, 1, 4).block_k == 64  # prefill tiles do not depend on either


def test_decode_tiles_narrow_until_every_multiprocessor_has_a_program() -> None:
    """One program per (routed expert, column tile) at decode: Granite 4.0-H-Tiny's 6 experts of 512
    inner columns get 16-column tiles on 132 SMs (6 x 32 programs, not 6 x 8), Nemotron-3-Nano's 8
    (6 routed + 2 folded shared pieces) of 1856 keep 64 (8 x 29); prefill tiles do not change."""
    assert default_config(6, 64, columns=512, sms=132).block_n == 16
    assert default_config(12, 64, columns=512, sms=132).block_n == 32  # two tokens: 12 experts x 16 tiles
    assert default_config(8, 130, columns=1856, sms=132).block_n == 64
    assert default_config(6, 64).block_n == 64  # columns unknown: the old tile
    assert default_config(4096, 64, columns=512, sms=132) == default_config(4096, 64)
