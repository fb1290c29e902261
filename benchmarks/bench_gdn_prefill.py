"""Prefill through one Gated DeltaNet layer alone, a named Qwen shape's (default Qwen3.5-9B: hidden
4096, 16 key and 32 value heads of 128), `--prompts` x `--len` tokens packed (varlen), bf16 weights
and activations, fp32 states, random weights (``shapes.random_model`` of a one-layer model).

The layer is the model's own module (``layers.gated_delta_net.GatedDeltaNet``: its projections, gates,
gated norm and out_proj) around the prefill ops: the varlen causal conv (its Triton kernel on CUDA)
and ``chunk_gated_delta`` (flash-linear-attention's ``chunk_gated_delta_rule`` on CUDA where fla-core
is installed, else the chunked reference), which is what a baseline backend with the fast ops runs
per GDN layer. Timed with CUDA events after a warm-up call (fla autotunes its kernels on the first
call), it reports tokens/s, the layer's MFU (its projections' FLOPs, as ``roofline.prefill_flops``
counts a model's, over the bf16 matmul rate measured in the same run) and the chunked rule's share
of the layer's time. Before timing, the rule's output on 2 x 128 of the tokens is compared with
the token-by-token float64 reference (max abs difference printed; a disagreement stops the run).

    python benchmarks/bench_gdn_prefill.py [--prompts 16 --len 1024] [--size qwen3.5-9b] [--out r.json]
    python benchmarks/bench_gdn_prefill.py --device cpu --prompts 2 --len 64 --iters 1   # the references
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from roofline import measure_rates, median_seconds  # noqa: E402
from shapes import SIZES, model_config, random_model  # noqa: E402

from replayserve.config import GATED_DELTA, MLP, ModelConfig  # noqa: E402
from replayserve.layers.gated_delta_net import GatedDeltaNet  # noqa: E402
from replayserve.ops.conv1d import causal_conv1d_varlen_ref  # noqa: E402
from replayserve.ops.dispatch import use_triton  # noqa: E402
from replayserve.ops.gated_delta import chunk_gated_delta, gated_delta_recurrent_ref  # noqa: E402
from replayserve.ssm.layout import GatedDeltaLayout  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def gdn_layer(size: str, dtype: torch.dtype, device: str) -> tuple[GatedDeltaNet, ModelConfig]:
    """The GDN mixer of a one-layer model of the shape (vocabulary cut to 512: only the layer runs), and
    that model's config."""
    cfg = dataclasses.replace(model_config(size), layer_types=(GATED_DELTA, MLP), vocab_size=512,
                              tie_word_embeddings=False)
    return random_model(cfg, dtype, device).backbone.layers[0].linear_attn, cfg


class Prefill:
    """The layer's prefill of packed sequences from zero states, in its parts."""

    def __init__(self, layer: GatedDeltaNet, cfg: ModelConfig, cu_seqlens: torch.Tensor) -> None:
        weight = layer.conv1d.weight
        self.layer, self.cfg, self.cu = layer, cfg, cu_seqlens
        seqs = cu_seqlens.shape[0] - 1
        self.layout = GatedDeltaLayout.from_config(cfg, seqs, weight.dtype)
        self.slots = torch.arange(seqs, device=weight.device)
        self.conv_state = torch.zeros(self.layout.conv_state_shape, dtype=weight.dtype, device=weight.device)
        self.state = torch.zeros(self.layout.ssm_state_shape, dtype=self.layout.state_dtype, device=weight.device)

    def conv(self, qkv: torch.Tensor) -> torch.Tensor:
        weight = self.layer.conv1d.weight.squeeze(1)
        if use_triton(qkv):
            from replayserve.ops.conv1d_varlen_triton import causal_conv1d_varlen_triton

            return causal_conv1d_varlen_triton(qkv, weight, None, self.conv_state, self.slots, self.cu)
        return causal_conv1d_varlen_ref(qkv, weight, None, self.conv_state, self.slots, self.cu)

    def rule(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        """(T, conv_dim) post-conv q|k|v, g and beta (T, Hv) -> o (T, Hv, V); final states into the pool."""
        q, k, v = self.layout.split_qkv(mixed)
        o, self.state[:], _ = chunk_gated_delta(q, k, v, g, beta, self.cu, self.state, self.slots, use_qk_l2norm=True)
        return o

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (T, hidden_size) -> (T, hidden_size)."""
        qkv, z, b, a = self.layer.project(hidden)
        g, beta = self.layer.gates(b, a)
        o = self.rule(self.conv(qkv), g, beta)
        return self.layer.out_proj(self.layer.norm(o, z).reshape(hidden.shape[0], -1))


def check(prefill: Prefill, hidden: torch.Tensor, lengths: list[int]) -> dict[str, float]:
    """The rule's output on the first 128 tokens of the first two prompts against the token-by-token float64
    reference: max abs difference and the relative one."""
    cut = [min(128, n) for n in lengths[:2]]
    starts = [0, lengths[0]]
    rows = torch.cat([torch.arange(s, s + n, device=hidden.device) for s, n in zip(starts, cut, strict=True)])
    qkv, _, b, a = prefill.layer.project(hidden[rows])
    g, beta = prefill.layer.gates(b, a)
    small = Prefill(prefill.layer, prefill.cfg, torch.tensor([0, cut[0], sum(cut)], device=hidden.device))
    mixed = small.conv(qkv)
    o = small.rule(mixed, g, beta)
    q, k, v = small.layout.split_qkv(mixed)
    refs = []
    for lo, hi in ((0, cut[0]), (cut[0], sum(cut))):
        refs.append(gated_delta_recurrent_ref(*(t[None, lo:hi].double() for t in (q, k, v, g, beta)),
                                              use_qk_l2norm=True)[0][0])
    ref = torch.cat(refs)
    diff = (o.double() - ref).abs().max().item()
    return {"o_abs_vs_ref64": diff, "o_rel_vs_ref64": diff / ref.abs().max().item()}


def linear_flops(layer: GatedDeltaNet, tokens: int) -> float:
    return 2.0 * tokens * sum(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--size", default="qwen3.5-9b", choices=sorted(s for s in SIZES if s.startswith("qwen")))
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--len", type=int, default=1024, help="tokens per prompt")
    p.add_argument("--iters", type=int, default=5, help="timed runs; medians reported")
    p.add_argument("--out", type=Path, help="write the result as JSON here")
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    dtype = DTYPES[args.dtype or ("bfloat16" if cuda else "float32")]
    torch.manual_seed(0)
    layer, cfg = gdn_layer(args.size, dtype, args.device)
    lengths = [args.len] * args.prompts
    tokens = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=args.device)
    hidden = torch.randn(tokens, layer.out_proj.weight.shape[0], device=args.device, dtype=dtype)
    prefill = Prefill(layer, cfg, cu)
    fla = cuda and use_triton(hidden) and _fla_importable()
    with torch.no_grad():
        checked = check(prefill, hidden, lengths)
        print(f"check (2 x {min(128, args.len)} tokens): the rule's o max abs difference from the float64 "
              f"token-by-token reference {checked['o_abs_vs_ref64']:.2e} (rel {checked['o_rel_vs_ref64']:.1e})")
        if not checked["o_rel_vs_ref64"] < 2e-2:
            raise SystemExit("the chunked rule disagrees with the float64 reference: not timed")
        rates = measure_rates(torch.device(args.device), dtype)
        qkv, z, b, a = layer.project(hidden)
        g, beta = layer.gates(b, a)
        mixed = prefill.conv(qkv)
        device = torch.device(args.device)
        layer_s = median_seconds(lambda: prefill(hidden), device, args.iters)
        rule_s = median_seconds(lambda: prefill.rule(mixed, g, beta), device, args.iters)
        proj_s = median_seconds(lambda: (layer.project(hidden), layer.out_proj(z.flatten(1))), device,
                                args.iters)
    mfu = linear_flops(layer, tokens) / layer_s / rates["matmul_flop_per_s"]
    name = torch.cuda.get_device_name() if cuda else "CPU"
    result = {"meta": {"device": name, "size": args.size, "dtype": str(dtype), "prompts": args.prompts,
                       "len": args.len, "rule": "fla chunk_gated_delta_rule" if fla else "chunked reference",
                       "matmul_tflop_s": rates["matmul_flop_per_s"] / 1e12, "check": checked},
              "layer_ms": 1e3 * layer_s, "rule_ms": 1e3 * rule_s, "projections_ms": 1e3 * proj_s,
              "tok_s": tokens / layer_s, "layer_mfu": mfu, "rule_share": rule_s / layer_s,
              "projections_mfu": linear_flops(layer, tokens) / proj_s / rates["matmul_flop_per_s"]}
    print(f"{args.size} GDN layer, {args.prompts} x {args.len} tokens, {dtype} on {name} (rule: "
          f"{result['meta']['rule']}); matmul {result['meta']['matmul_tflop_s']:.1f} TFLOP/s measured")
    print("| layer ms | tokens/s | layer MFU (projection FLOPs) | rule ms (share) | projections ms (their MFU) |")
    print("|---:|---:|---:|---:|---:|")
    print(f"| {result['layer_ms']:.2f} | {result['tok_s']:.0f} | {mfu:.1%} | {result['rule_ms']:.2f} "
          f"({result['rule_share']:.0%}) | {result['projections_ms']:.2f} ({result['projections_mfu']:.1%}) |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    return result


def _fla_importable() -> bool:
    from replayserve.ops.gated_delta_fla import fla_chunk_rule

    return fla_chunk_rule() is not None


if __name__ == "__main__":
    main()
