"""A training-mode forward of `NemotronHForCausalLM`: batched, differentiable, on the same weights.

The engine's forward is inference-only (paged caches, state slots, in-place Triton kernels). This
one runs whole (B, L) windows through the plain-PyTorch references of `ops/` (the math the engine
runs on CPU), the per-sequence ones mapped over the batch with `torch.func.vmap`. It calls no
module's forward but `nn.Linear`'s and `nn.Embedding`'s, so autograd reaches every parameter; the
MoE experts are stacked inside the graph (not through `MoE.stacked_experts`, whose stacks are
built without autograd). The main head predicts token i + 1 from position i; the MTP stack, fed
the final hidden state at i and the embedding of token i + 1, predicts token i + 2: exactly how
`speculative.mtp.MTPProposer` uses it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import vmap

from replayserve.config import ATTENTION, MAMBA, MLP, MOE
from replayserve.layers.attention import Attention
from replayserve.layers.mamba2 import Mamba2Mixer
from replayserve.layers.mlp import MLP as MLPLayer
from replayserve.layers.mlp import MoE
from replayserve.layers.norm import RMSNorm
from replayserve.models.nemotron_h import NemotronHForCausalLM
from replayserve.ops.activation import relu_square_ref
from replayserve.ops.conv1d import causal_conv1d_ref
from replayserve.ops.moe import fused_moe_ref, topk_route_ref
from replayserve.ops.norm import gated_rms_norm_ref, rms_norm_ref
from replayserve.ops.ssd import ssd_chunk_scan_ref


@dataclass
class Losses:
    """Mean cross-entropies (nats per token) and the routed-expert counts of the step."""

    total: Tensor  # main + mtp_weight * mtp: what is minimised
    main: Tensor
    mtp: Tensor | None
    # One (E,) int64 tensor of tokens routed to each expert per MoE layer: backbone, then MTP.
    expert_load: list[Tensor] = field(default_factory=list)


def _norm(norm: RMSNorm, x: Tensor) -> Tensor:
    return rms_norm_ref(x, norm.weight, norm.eps)


def _mlp(mlp: MLPLayer, x: Tensor) -> Tensor:
    return mlp.down_proj(relu_square_ref(mlp.up_proj(x)))


def _attention(attn: Attention, x: Tensor) -> Tensor:
    """x (B, L, hidden) -> (B, L, hidden), causal, no positional encoding (Nemotron-H)."""
    b, length, _ = x.shape
    q = attn.q_proj(x).view(b, length, attn.num_heads, attn.head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(b, length, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    v = attn.v_proj(x).view(b, length, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scale, enable_gqa=True)
    return attn.o_proj(out.transpose(1, 2).reshape(b, length, -1))


def _mamba(mixer: Mamba2Mixer, x: Tensor) -> Tensor:
    """x (B, L, hidden) -> (B, L, hidden): conv1d and the chunked SSD scan of `ops/`, per sequence."""
    b, length, _ = x.shape
    z, xbc, dt = mixer.in_proj(x).split(mixer.split_sizes, dim=-1)
    heads, head_dim = mixer.num_heads, mixer.head_dim
    weight = mixer.conv1d.weight.squeeze(1)
    bias = mixer.conv1d.bias
    wide = weight.dtype  # the parameters' dtype: float32 under bf16 autocast
    # The scan's decays and sums stay in `wide` even under autocast (which would lower einsum).
    with torch.autocast(x.device.type, enabled=False):
        xbc = vmap(lambda u: causal_conv1d_ref(u, weight, bias)[0])(xbc.to(wide))
        inner = heads * head_dim
        bc = (xbc.shape[-1] - inner) // 2
        xs, bs, cs = xbc.split([inner, bc, bc], dim=-1)
        groups = inner // mixer.norm.group_size
        y = vmap(lambda u, d, bb, cc: ssd_chunk_scan_ref(
            u, d, -torch.exp(mixer.A_log), bb, cc, mixer.chunk_size, D=mixer.D, dt_bias=mixer.dt_bias,
            dt_limit=mixer.dt_limit)[0])(
            xs.reshape(b, length, heads, head_dim), dt.to(wide), bs.reshape(b, length, groups, -1),
            cs.reshape(b, length, groups, -1))
        y = gated_rms_norm_ref(y.reshape(b, length, inner), z.to(wide), mixer.norm.weight, mixer.norm.eps,
                               mixer.norm.group_size)
    return mixer.out_proj(y)


def _moe(moe: MoE, x: Tensor, loads: list[Tensor]) -> Tensor:
    """x (B, L, hidden) -> (B, L, hidden); appends the layer's (E,) expert counts to `loads`."""
    flat = x.reshape(-1, x.shape[-1])
    gate = moe.gate
    with torch.autocast(x.device.type, enabled=False):  # the router runs in its weight's dtype, as in the engine
        logits = flat.to(gate.weight.dtype) @ gate.weight.t()
        ids, weights = topk_route_ref(logits, gate.e_score_correction_bias, gate.top_k, gate.n_group,
                                      gate.topk_group, gate.norm_topk_prob, gate.scaling)
    loads.append(torch.bincount(ids.flatten(), minlength=gate.num_experts).detach())
    w_up = torch.stack([e.up_proj.weight for e in moe.experts])
    w_down = torch.stack([e.down_proj.weight for e in moe.experts])
    routed = moe.fc2_latent_proj(fused_moe_ref(moe.fc1_latent_proj(flat), w_up, w_down, ids, weights))
    return (routed + _mlp(moe.shared_experts, flat)).view_as(x)


def _mixer(block_type: str, mixer: torch.nn.Module, x: Tensor, loads: list[Tensor]) -> Tensor:
    if block_type == MAMBA:
        return _mamba(mixer, x)  # type: ignore[arg-type]
    if block_type == ATTENTION:
        return _attention(mixer, x)  # type: ignore[arg-type]
    if block_type == MOE:
        return _moe(mixer, x, loads)  # type: ignore[arg-type]
    assert block_type == MLP
    return _mlp(mixer, x)  # type: ignore[arg-type]


def backbone_hidden(model: NemotronHForCausalLM, ids: Tensor, loads: list[Tensor]) -> Tensor:
    """ids (B, L) int64 -> final hidden states (B, L, hidden) after norm_f, as the engine's forward
    returns them for each sequence (the residual stream in the embedding's dtype)."""
    x = model.backbone.embeddings(ids)
    for block in model.backbone.layers:
        x = x + _mixer(block.block_type, block.mixer, _norm(block.norm, x), loads)
    return _norm(model.backbone.norm_f, x)


def mtp_hidden(model: NemotronHForCausalLM, next_ids: Tensor, hidden: Tensor, loads: list[Tensor]) -> Tensor:
    """`NemotronHMTP.forward` over a batch: next_ids (B, L) the tokens i + 1, hidden (B, L, hidden)
    the final hidden states at i -> (B, L, hidden) after final_layernorm; row i predicts token i + 2."""
    layers = model.mtp.layers
    first = layers[0]
    embeds = model.backbone.embeddings(next_ids)
    x = first.eh_proj(torch.cat([_norm(first.enorm, embeds), _norm(first.hnorm, hidden)], dim=-1))
    for block in layers:
        x = x + _mixer(block.block_type, block.mixer, _norm(block.norm, x), loads)
    return _norm(layers[-1].final_layernorm, x)


def _cross_entropy(model: NemotronHForCausalLM, hidden: Tensor, targets: Tensor) -> Tensor:
    logits = model.lm_head(hidden)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def losses(model: NemotronHForCausalLM, window: Tensor, mtp_weight: float = 0.3) -> Losses:
    """window (B, L + 1) int64 token ids -> the next-token loss over positions 0..L-1 and, when the
    model has MTP layers, the next-next-token loss of the MTP stack over positions 0..L-2."""
    loads: list[Tensor] = []
    hidden = backbone_hidden(model, window[:, :-1], loads)
    main = _cross_entropy(model, hidden, window[:, 1:])
    if not hasattr(model, "mtp"):
        return Losses(main, main, None, loads)
    out = mtp_hidden(model, window[:, 1:-1], hidden[:, :-1], loads)
    mtp = _cross_entropy(model, out, window[:, 2:])
    return Losses(main + mtp_weight * mtp, main, mtp, loads)


def moe_layers(model: NemotronHForCausalLM) -> list[MoE]:
    """The MoE mixers in the order `losses` reports their loads: backbone, then MTP."""
    blocks = list(model.backbone.layers) + (list(model.mtp.layers) if hasattr(model, "mtp") else [])
    return [b.mixer for b in blocks if b.block_type == MOE]


@torch.no_grad()
def balance_experts_(model: NemotronHForCausalLM, loads: list[Tensor], rate: float) -> None:
    """Auxiliary-loss-free load balancing (DeepSeek-V3): each router's `e_score_correction_bias`
    moves by `rate` towards its under-used experts. The bias shifts which experts are chosen, not
    their weights, and is saved with the checkpoint (the engine and transformers read it)."""
    for moe, load in zip(moe_layers(model), loads, strict=True):
        bias = moe.gate.e_score_correction_bias
        bias += rate * torch.sign(load.float().mean() - load.float()).to(bias.device)
