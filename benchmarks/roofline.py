"""Hardware rates measured in the run, and the bytes and FLOPs of a model's decode step and prefill.

A decode step's floor counts what must cross memory once: every weight (the embedding table only
for the batch's rows, experts only those a batch can route to), each Mamba2 or Gated DeltaNet layer's
state as the backend moves it, and each attention layer's KV cache at the rows' context lengths.
State bytes are derived from `replayserve.ssm.layout` (`MambaLayout`, `GatedDeltaLayout`), the
engine's own state geometry; the ReplaySSM count is `bench_ssm_decode`'s: checkpoint read, 1/W
written, the mean history of (W + 1) / 2 ring entries read plus one appended (a GDN ring entry is
`ops/replay_gdn.py`'s: k per key head, the correction delta and g per value head). Activations
are left out.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from replayserve.config import ATTENTION
from replayserve.layers.fp8_linear import FP8Linear
from replayserve.layers.granite_ffn import ExpertWeights
from replayserve.models.nemotron_h import NemotronHForCausalLM
from replayserve.ssm.layout import GatedDeltaLayout, MambaLayout


def median_seconds(fn: Callable[[], object], device: torch.device, reps: int = 10) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_rates(device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """Copy bandwidth (bytes read + written per second, of a large device-to-device copy) and the
    matmul rate (FLOP/s of a large square product in `dtype`) of `device`."""
    big = device.type == "cuda"
    size, n = (1 << 30, 8192) if big else (1 << 26, 1024)
    buffers = [torch.ones(size, dtype=torch.uint8, device=device) for _ in range(2)]
    copy_s = median_seconds(lambda: buffers[1].copy_(buffers[0]), device)
    buffers.clear()
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    mm_s = median_seconds(lambda: a @ b, device)
    return {"copy_bytes_per_s": 2 * size / copy_s, "matmul_flop_per_s": 2 * n**3 / mm_s}


@dataclass(frozen=True)
class Op:
    """One piece of a step: bytes it must move and matmul FLOPs it must do."""

    name: str
    bytes: float
    flops: float


def _expert_share(model: NemotronHForCausalLM, rows: int) -> tuple[float, float]:
    """(expected share of experts a batch of `rows` tokens touches, share each token runs)."""
    cfg = model.config
    # Nemotron-H's MoE layers, or a MoE inside every layer's feed-forward (Granite 4.0-H, Qwen MoEs)
    if not any(isinstance(m, ExpertWeights) or ".experts." in name for name, m in model.named_modules()):
        return 1.0, 1.0
    per_token = cfg.num_experts_per_tok / cfg.n_routed_experts
    return 1.0 - (1.0 - per_token) ** rows, per_token


def weight_ops(model: NemotronHForCausalLM, tokens: int, sampled: int) -> list[Op]:
    """Weights read once by a forward of `tokens` tokens, `sampled` of which reach the LM head;
    FLOPs are 2 x in x out per token of every projection."""
    touched, per_token = _expert_share(model, tokens)
    ops, seen = [], set()
    other = 0.0
    for name, module in model.named_modules():
        if name.startswith("mtp"):
            continue
        if isinstance(module, (nn.Linear, FP8Linear)):  # an FP8 weight counts its 1-byte codes
            expert = ".experts." in name
            rows = sampled if name == "lm_head" else tokens
            size = sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
            ops.append(Op(name, size * (touched if expert else 1.0),
                          2.0 * rows * module.weight.numel() * (per_token if expert else 1.0)))
            seen.update(id(p) for p in module.parameters(recurse=False))
        elif isinstance(module, ExpertWeights):  # Granite's (E, out, in) stacks: a batch reads the experts it routes to
            size = module.weight.numel() * module.weight.element_size()
            ops.append(Op(name, size * touched, 2.0 * tokens * module.weight.numel() * per_token))
            seen.add(id(module.weight))
        elif isinstance(module, nn.Embedding):
            other += min(tokens, module.num_embeddings) * module.embedding_dim * module.weight.element_size()
            seen.add(id(module.weight))
    for name, p in model.named_parameters():
        if id(p) not in seen and not name.startswith("mtp"):
            other += p.numel() * p.element_size()  # norms, conv weights, A, D, dt bias, routers
    return [*ops, Op("other weights", other, 0.0)]


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def mamba_bytes_per_row(model: NemotronHForCausalLM, backend: str, window: int) -> dict[str, float]:
    """Per decode row and step, summed over Mamba layers: 'state' (SSM and conv state) and 'rings'."""
    cfg = model.config
    dtype = model.backbone.embeddings.weight.dtype
    layout = MambaLayout.from_config(cfg, 1, dtype, window=window if backend == "replay" else 0)
    state = _nbytes(layout.ssm_state_shape, layout.state_dtype)
    conv = 2 * _nbytes(layout.conv_state_shape, layout.act_dtype)  # read and written every step
    if backend != "replay":
        return {"state": layout.num_layers * (2 * state + conv), "rings": 0.0}
    entry = (_nbytes(layout.x_ring_shape, layout.act_dtype) + _nbytes(layout.b_ring_shape, layout.act_dtype)
             + _nbytes(layout.dt_ring_shape, layout.state_dtype)) / layout.ring_len
    return {"state": layout.num_layers * (state * (1 + 1 / window) + conv),
            "rings": layout.num_layers * entry * ((window + 1) / 2 + 1)}


def gdn_bytes_per_row(model: NemotronHForCausalLM, backend: str, window: int) -> dict[str, float]:
    """Per decode row and step, summed over Gated DeltaNet layers: 'state' ((Hv, K, V) state and conv
    state) and 'rings' (ReplaySSM: k, delta and g of the ring entries read and appended)."""
    layout = GatedDeltaLayout.from_config(model.config, 1, model.backbone.embeddings.weight.dtype)
    state = _nbytes(layout.ssm_state_shape, layout.state_dtype)
    conv = 2 * _nbytes(layout.conv_state_shape, layout.act_dtype)
    if backend != "replay":
        return {"state": layout.num_layers * (2 * state + conv), "rings": 0.0}
    entry = layout.qk_dim * layout.act_dtype.itemsize \
        + (layout.v_dim + layout.num_value_heads) * layout.state_dtype.itemsize
    return {"state": layout.num_layers * (state * (1 + 1 / window) + conv),
            "rings": layout.num_layers * entry * ((window + 1) / 2 + 1)}


def kv_bytes(model: NemotronHForCausalLM, context_lens: list[float], itemsize: int | None = None) -> float:
    """K and V of every attention layer read at each row's context, plus the new token written;
    itemsize: bytes per cache entry (default: the model dtype's; 1 for an FP8 cache)."""
    cfg = model.config
    itemsize = itemsize or model.backbone.embeddings.weight.element_size()
    per_token = 2 * cfg.num_key_value_heads * cfg.head_dim * itemsize
    return cfg.num_attention_layers * per_token * sum(n + 1 for n in context_lens)


# The non-weight parts of a decode step, as `decode_ops` names them.
STATE_PARTS = ("mamba state", "gdn state", "replay rings", "kv cache")


def decode_ops(model: NemotronHForCausalLM, backend: str, window: int, context_lens: list[float],
               kv_itemsize: int | None = None) -> list[Op]:
    """Everything one decode step of len(context_lens) rows must move or compute (kv_itemsize: as
    ``kv_bytes``'s itemsize)."""
    rows = len(context_lens)
    mamba, gdn = mamba_bytes_per_row(model, backend, window), gdn_bytes_per_row(model, backend, window)
    parts = (rows * mamba["state"], rows * gdn["state"], rows * (mamba["rings"] + gdn["rings"]),
             kv_bytes(model, context_lens, kv_itemsize))
    return [*weight_ops(model, rows, rows), *(Op(name, b, 0.0) for name, b in zip(STATE_PARTS, parts, strict=True))]


def floors(ops: list[Op], rates: dict[str, float]) -> dict[str, float]:
    """'bytes_s': all bytes at copy bandwidth; 'ops_s': each op at max(bytes / bandwidth,
    FLOPs / matmul rate) (docs/performance-targets.md's step roofline)."""
    bw, mm = rates["copy_bytes_per_s"], rates["matmul_flop_per_s"]
    return {"bytes_s": sum(op.bytes for op in ops) / bw,
            "ops_s": sum(max(op.bytes / bw, op.flops / mm) for op in ops)}


def prefill_flops(model: NemotronHForCausalLM, prompt_lens: list[int]) -> float:
    """Matmul FLOPs of a prefill of these prompts: projections, the LM head at each prompt's last
    token, and causal attention scores and values (the SSD scan, a few percent, and the gated delta
    rule's chunks are left out)."""
    cfg = model.config
    linear = sum(op.flops for op in weight_ops(model, sum(prompt_lens), len(prompt_lens)))
    attn_pairs = sum(n * (n + 1) / 2 for n in prompt_lens)
    return linear + cfg.num_attention_layers * 4.0 * cfg.num_attention_heads * cfg.head_dim * attn_pairs


def mtp_ops(model: NemotronHForCausalLM, rows: int, drafts: int, window_lens: list[float],
            new_lens: list[float] | None = None) -> list[Op]:
    """What one MTP proposer call (`MTPProposer.propose_batch`) of `rows` rows and `drafts` drafts
    each must move and compute: the MTP layers' weights (the experts the first draft's positions
    can route to, then those `rows` tokens can) and the LM head read once per draft, the recorded
    hidden states of the positions the first draft runs (`new_lens`: per row, the positions new
    since its last call, which the MTP cache does not hold; default: the whole window, as without
    a cache), each draft's attention over the keys and values of its row's window (`window_lens`:
    positions per row) with the new ones written; FLOPs: every MTP projection over the first
    draft's positions, over one position per row after it, and the LM head per draft. The
    embedding rows and activations are left out."""
    cfg, elem = model.config, model.backbone.embeddings.weight.element_size()
    new = window_lens if new_lens is None else new_lens
    first_share, per_token = _expert_share(model, round(sum(new)))
    later_share, _ = _expert_share(model, rows)
    positions = sum(new) + rows * (drafts - 1)  # the first draft's new positions, then one per row
    weights, flops = 0.0, 0.0
    for name, p in model.mtp.named_parameters():
        expert = ".experts." in name
        size = p.numel() * p.element_size()
        weights += size * (first_share + (drafts - 1) * later_share if expert else drafts)
        if p.dim() == 2:
            flops += 2.0 * positions * p.numel() * (per_token if expert else 1.0)
    head = sum(p.numel() * p.element_size() for p in model.lm_head.parameters())
    attention = sum(t == ATTENTION for t in cfg.mtp_layer_types)
    kv_per_position = 2 * cfg.num_key_value_heads * cfg.head_dim * elem * attention
    kv = kv_per_position * (sum(drafts * (n + (drafts + 1) / 2) for n in window_lens) + sum(new))
    hidden = sum(new) * cfg.hidden_size * elem
    return [Op("mtp weights", weights, flops),
            Op("lm head", drafts * head, 2.0 * rows * drafts * model.lm_head.weight.numel()),
            Op("mtp kv and hidden", kv + hidden, 0.0)]
