"""The Qwen families' tensor-parallel slices in one process (no process group): each rank's
column-parallel projections give the whole model's outputs for the rank's heads, picked out of them
by meaning (q, k, v per key or value head), and the rank's row-parallel partial sums add up to the
whole model's output. The end-to-end check over processes is test_tp_families.py; this one names
the projection at fault."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from replayserve.builtin.tiny import init_random_weights, tiny_config
from replayserve.config import ModelConfig
from replayserve.layers.qwen_moe import SparseMoeBlock
from replayserve.models.registry import family_of
from replayserve.models.sharding import RankShard

# (family, ranks, config overrides): 4 ranks of 1 GDN key head (2 value heads) and 1 attention head
# each, the 2 KV heads each replicated on 2 ranks.
CASES = [("qwen3_next", 2, {}), ("qwen3_5", 2, {}), ("qwen3_5_moe", 2, {}),
         ("qwen3_next", 4, {"linear_num_key_heads": 4, "linear_num_value_heads": 8})]


def _models(family: str, world: int, overrides: dict) -> tuple[ModelConfig, nn.Module, list[nn.Module]]:
    """(config, the whole model with random weights, each rank's model loaded from its state dict).
    Layers: a GDN, a gated attention, then Qwen3-Next's dense first layer aside, MoE or MLP."""
    cfg = dataclasses.replace(tiny_config("G*G", family=family), **overrides)
    model_class = family_of(cfg).model_class
    whole = model_class(cfg)
    init_random_weights(whole, 0)
    state = whole.state_dict()
    ranks = []
    for rank in range(world):
        shard = RankShard(cfg, rank, world)
        with torch.device("meta"):
            net = shard.build(model_class)
        net.allocate_("cpu", torch.float32)
        with torch.no_grad():
            for name, param in net.state_dict(keep_vars=True).items():
                param.copy_(shard.slice(name, state[name]))
        ranks.append(net)
    return cfg, whole, ranks


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-tp{c[1]}")
def models(request: pytest.FixtureRequest) -> tuple[ModelConfig, nn.Module, list[nn.Module]]:
    return _models(*request.param)


def _heads(x: torch.Tensor, count: int, rank: int, first: int | None = None) -> torch.Tensor:
    """x (T, H, D): the rank's run of `count` heads, from head `first` (default rank * count)."""
    first = rank * count if first is None else first
    return x[:, first : first + count]


def test_gated_delta_net_rank_heads(models: tuple) -> None:
    cfg, whole, ranks = models
    hk, hv, kd, vd = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    h = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    mixer = whole.backbone.layers[0].linear_attn
    qkv, z, b, a = mixer.project(h)
    g, beta = mixer.gates(b, a)
    q, k, v = qkv.split([hk * kd, hk * kd, hv * vd], dim=-1)
    o = torch.randn(5, hv * vd, generator=torch.Generator().manual_seed(2))
    out = torch.zeros(5, cfg.hidden_size)
    for rank, net in enumerate(ranks):
        local = net.backbone.layers[0].linear_attn
        lk, lv = local.num_k_heads, local.num_v_heads
        assert (lk, lv) == (hk // len(ranks), hv // len(ranks))
        lqkv, lz, lb, la = local.project(h)
        lq, lk_, lv_ = lqkv.split([lk * kd, lk * kd, lv * vd], dim=-1)
        for mine, theirs, count, dim in ((lq, q, lk, kd), (lk_, k, lk, kd), (lv_, v, lv, vd)):
            torch.testing.assert_close(mine.view(5, count, dim), _heads(theirs.view(5, -1, dim), count, rank))
        torch.testing.assert_close(lz, _heads(z, lv, rank))
        lg, lbeta = local.gates(lb, la)
        torch.testing.assert_close(lg, _heads(g[..., None], lv, rank)[..., 0])
        torch.testing.assert_close(lbeta, _heads(beta[..., None], lv, rank)[..., 0])
        # The conv's channels are the projection's: the rank's q, k and v channels of the whole conv.
        conv = mixer.conv1d.weight.squeeze(1)
        cq, ck, cv = conv.split([hk * kd, hk * kd, hv * vd])
        expected = torch.cat([_heads(c.view(1, -1, dim, c.shape[-1]), n, rank).flatten(0, 2)
                              for c, n, dim in ((cq, lk, kd), (ck, lk, kd), (cv, lv, vd))])
        torch.testing.assert_close(local.conv1d.weight.squeeze(1), expected)
        torch.testing.assert_close(local.norm.weight, mixer.norm.weight)
        # out_proj's partial sums (the hook all-reduces them; called here without it)
        out += F.linear(_heads(o.view(5, hv, vd), lv, rank).flatten(1), local.out_proj.weight)
    torch.testing.assert_close(out, mixer.out_proj(o))


def test_gated_attention_rank_heads(models: tuple) -> None:
    cfg, whole, ranks = models
    h = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    attn = whole.backbone.layers[1].self_attn
    dh = cfg.head_dim
    query_gate = attn.q_proj(h).view(5, cfg.num_attention_heads, 2 * dh)  # [query, gate] per head
    o = torch.randn(5, cfg.num_attention_heads * dh, generator=torch.Generator().manual_seed(4))
    out = torch.zeros(5, cfg.hidden_size)
    for rank, net in enumerate(ranks):
        local = net.backbone.layers[1].self_attn
        heads, kv = local.num_heads, local.num_kv_heads
        torch.testing.assert_close(local.q_proj(h).view(5, heads, 2 * dh), _heads(query_gate, heads, rank))
        first_kv = rank * heads // (cfg.num_attention_heads // cfg.num_key_value_heads)  # the one its heads read
        for name in ("k_proj", "v_proj"):
            whole_kv = getattr(attn, name)(h).view(5, cfg.num_key_value_heads, dh)
            torch.testing.assert_close(getattr(local, name)(h).view(5, kv, dh), _heads(whole_kv, kv, rank, first_kv))
        out += F.linear(_heads(o.view(5, -1, dh), heads, rank).flatten(1), local.o_proj.weight)
    torch.testing.assert_close(out, attn.o_proj(o))


def test_feed_forward_partial_sums_add_up_with_one_all_reduce(models: tuple) -> None:
    """The last layer's MLP or MoE (routed experts and the gated shared expert, run one by one here:
    the weights are not stacked): the ranks' outputs add up to the whole block's. The block alone
    all-reduces: a hook inside a MoE block would reduce its partial sums twice (and here, with no
    process group, fail)."""
    cfg, whole, ranks = models
    x = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    block = whole.backbone.layers[2].mlp
    out = torch.zeros(7, cfg.hidden_size)
    for net in ranks:
        local = net.backbone.layers[2].mlp
        assert local._forward_hooks  # the one all-reduce
        if isinstance(local, SparseMoeBlock):
            assert not [name for name, m in local.named_modules() if m is not local and m._forward_hooks]
        out += local.forward(x)  # forward() without the block's own hook
    torch.testing.assert_close(out, block(x), rtol=1e-5, atol=1e-5)
