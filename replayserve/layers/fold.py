"""The scalar and muP multipliers of Granite 4.0-H, Bamba and Falcon-H1 folded into the weights once
they are loaded, so that a step runs none of them (each was one elementwise kernel per use: Falcon-H1
ran eight a layer, Granite two even where residual_multiplier is 1).

Each fold is exact in real arithmetic (a multiplier of a Linear's output scales its weight rows and
bias; one of its input scales its weight), rounded once in the weights' dtype. Folded:

- `embedding_multiplier` into the embedding table; with tied embeddings the LM head then holds it
  too, so the logits' divisor becomes logits_scaling * embedding_multiplier (a runtime divide, once a
  step); untied, 1 / logits_scaling goes into the LM head and nothing is divided.
- Granite's `residual_multiplier` (both halves of every layer) into each half's output projection:
  the Mamba out_proj, the attention's o_proj, the shared MLP's and the experts' output_linear (the
  routing weights multiply the experts' outputs: linear), Bamba's down_proj.
- Falcon-H1's `ssm_in_multiplier` and per-section `ssm_multipliers` (z, x, B, C, dt) into in_proj's
  rows (its bias by the section's multiplier alone), `ssm_out_multiplier` into out_proj,
  `attention_in_multiplier * attention_out_multiplier` into o_proj (the input multiplier's effect on
  the scores is in the attention scale already), `mlp_multipliers` into gate_proj and down_proj.

Not folded: the logits' divisor with tied embeddings (above); per-row factors into an FP8 Linear's
codes (refused: a scalar goes into its per-tensor scale). Granite's `attention_multiplier` and
Falcon-H1's `key_multiplier` are the attention's scale already. Tensor parallelism folds each rank's
slice the same way (the in_proj sections are the rank's, from its local config); a row-parallel
bias held by rank 0 alone is scaled there, zeros elsewhere stay zero.
"""

from __future__ import annotations

import torch
from torch import nn

from replayserve.config import ModelConfig


def multipliers(cfg: ModelConfig) -> list[float]:
    """Every multiplier of the config that folds into weights (1 where it does nothing)."""
    return [cfg.embedding_multiplier, cfg.logits_scaling, cfg.residual_multiplier, cfg.ssm_in_multiplier,
            cfg.ssm_out_multiplier, cfg.attention_in_multiplier * cfg.attention_out_multiplier,
            *cfg.ssm_multipliers, *cfg.mlp_multipliers]


def scale_rows_(linear: nn.Module, factor: float | torch.Tensor, bias_factor: float | torch.Tensor | None = None
                ) -> None:
    """Multiplies `linear`'s output by `factor` through its weight and bias in place: a scalar, or an
    (out,) float32 (float64 for a float64 model) vector of per-row factors; the bias by `bias_factor`
    where given (a multiplier of the input scales the weight, not the bias). Each product is computed
    in float32 or wider and rounded once to the weight's dtype. An FP8 Linear (`layers/fp8_linear.py`)
    takes a scalar in its per-tensor `weight_scale` (its codes would round again); per-row factors
    are refused there."""
    weight = linear.weight
    bias = getattr(linear, "bias", None)
    with torch.no_grad():
        if weight.element_size() == 1:
            if not isinstance(factor, float) or bias_factor is not None:
                raise NotImplementedError(f"per-row multipliers cannot fold into the FP8 weight of "
                                          f"{type(linear).__name__}; load this family from a 16-bit checkpoint")
            _mul_rows_(linear.weight_scale, factor)
        else:
            _mul_rows_(weight, factor)
        if bias is not None:
            _mul_rows_(bias, factor if bias_factor is None else bias_factor)


def _mul_rows_(t: torch.Tensor, factor: float | torch.Tensor) -> None:
    if isinstance(factor, float):
        if factor != 1.0:
            t.mul_(factor)
    else:
        t.mul_(factor.to(t.device).view((-1,) + (1,) * (t.dim() - 1)))


def scale_(param: nn.Parameter, factor: float) -> None:
    """Multiplies `param` by `factor` in place, rounded once in its dtype."""
    if factor != 1.0:
        with torch.no_grad():
            param.mul_(factor)
