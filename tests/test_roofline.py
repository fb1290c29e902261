"""The decode roofline (benchmarks/roofline.py) counts what a step must read: for a MoE, only the
experts a batch can route to, whatever form the experts take (Nemotron-H's and Qwen's per-expert
Linears, Granite's (E, out, in) stacks), and the experts' FLOPs per token. A Granite step at batch 1
once counted every expert's bytes and no expert FLOPs (its stacks are no Linears)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from replayserve.builtin.tiny import tiny_config
from replayserve.models.registry import family_of

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from roofline import weight_ops  # noqa: E402


@pytest.mark.parametrize(("family", "layers"), [("nemotron_h", "M*-ME"), ("granite", "M*M"), ("qwen3_5_moe", "G*")])
def test_a_moe_step_reads_the_experts_its_tokens_can_route_to(family: str, layers: str) -> None:
    cfg = tiny_config(layers, family=family)
    with torch.device("meta"):
        model = family_of(cfg).model_class(cfg)
    per_token = cfg.num_experts_per_tok / cfg.n_routed_experts
    granite = (".block_sparse_moe.input_linear", ".block_sparse_moe.output_linear")
    expert_ops = lambda tokens: [op for op in weight_ops(model, tokens, 1)  # noqa: E731
                                 if ".experts." in op.name or op.name.endswith(granite)]
    experts = [p for n, p in model.named_parameters()
               if not n.startswith("mtp") and (".experts." in n or n.removesuffix(".weight").endswith(granite))]
    whole = sum(p.numel() * p.element_size() for p in experts)
    assert whole > 0
    for tokens in (1, 3, 64):
        ops = expert_ops(tokens)
        touched = 1 - (1 - per_token) ** tokens
        assert sum(op.bytes for op in ops) == pytest.approx(whole * touched)
        assert sum(op.flops for op in ops) == pytest.approx(2 * tokens * per_token * sum(p.numel() for p in experts))
    total = sum(op.bytes for op in weight_ops(model, 1, 1))
    assert total < sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("mtp"))
