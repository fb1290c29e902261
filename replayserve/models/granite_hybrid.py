"""IBM Granite 4.0-H (`granitemoehybrid`) for causal LM, with the checkpoints' parameter names.

Each decoder layer is a Mamba2 or an attention mixer, then the SwiGLU shared MLP plus, with
`num_local_experts` > 0, the softmax-routed MoE; both halves scale their output by
`residual_multiplier` before the residual add. The embeddings are scaled by `embedding_multiplier`,
the logits divided by `logits_scaling`, the attention scale is `attention_multiplier`, and attention
has RoPE or none (`position_embedding_type`). The Mamba2 mixer and the attention are Nemotron-H's.

The multipliers are folded into the weights once they are loaded (`prepare_weights_`, which the
loader calls; `layers/fold.py` says what folds where), and the forward is Nemotron-H's: each
residual add fused with the next pre-norm.
"""

from __future__ import annotations

import torch
from torch import nn

from replayserve.config import MAMBA, ModelConfig
from replayserve.layers.attention import Attention
from replayserve.layers.fold import multipliers, scale_, scale_rows_
from replayserve.layers.granite_ffn import SharedMLP, SoftmaxMoE
from replayserve.layers.linear import Linear
from replayserve.layers.mamba2 import Mamba2Mixer
from replayserve.layers.norm import RMSNorm
from replayserve.layers.step_context import StepContext
from replayserve.ops.dtypes import compute_dtype
from replayserve.ssm.backend import SSMBackend


class MixerLayer(nn.Module):
    """A decoder layer's first half: `input_layernorm` and a Mamba2 (`mamba`) or attention
    (`self_attn`) mixer; `index` counts the layers of the same mixer kind (Mamba state, KV cache).
    Subclasses add the feed-forward half (`ffn`)."""

    def __init__(self, cfg: ModelConfig, block_type: str, index: int) -> None:
        super().__init__()
        self.block_type = block_type
        self.index = index
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        if block_type == MAMBA:
            self.mamba = Mamba2Mixer(cfg, index)
        else:
            self.self_attn = Attention(cfg)

    def mix(self, normed: torch.Tensor, ctx: StepContext, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
            ssm: SSMBackend | None) -> torch.Tensor:
        if self.block_type == MAMBA:
            return self.mamba(normed, ctx, ssm)
        return self.self_attn(normed, ctx, kv_caches[self.index])

    @property
    def ffn_norm(self) -> RMSNorm:
        """The feed-forward half's pre-norm."""
        raise NotImplementedError

    def ffn(self, normed: torch.Tensor) -> torch.Tensor:
        """The feed-forward half's output (before the residual add) from its pre-norm's output."""
        raise NotImplementedError

    def fold_multipliers_(self, cfg: ModelConfig) -> None:
        """Folds `residual_multiplier` into both halves' output projections."""
        out = self.mamba.out_proj if self.block_type == MAMBA else self.self_attn.o_proj
        scale_rows_(out, cfg.residual_multiplier)
        self.fold_ffn_(cfg.residual_multiplier)

    def fold_ffn_(self, factor: float) -> None:
        """Folds `factor` into the feed-forward half's output projection."""
        raise NotImplementedError

    def stack_projections_(self) -> None:
        """Stacks the projections that share an input (`layers/stacked.py`): attention's q, k and v,
        and the feed-forward half's where it has separate gate and up."""
        if self.block_type != MAMBA:
            self.self_attn.stack_projections_()
        feed_forward = getattr(self, "feed_forward", None)
        if feed_forward is not None:
            feed_forward.stack_projections_()


class GraniteDecoderLayer(MixerLayer):
    def __init__(self, cfg: ModelConfig, block_type: str, index: int) -> None:
        super().__init__(cfg, block_type, index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.shared_mlp = SharedMLP(cfg.hidden_size, cfg.moe_shared_expert_intermediate_size)
        self.block_sparse_moe = SoftmaxMoE(cfg) if cfg.n_routed_experts else None

    @property
    def ffn_norm(self) -> RMSNorm:
        return self.post_attention_layernorm

    def ffn(self, normed: torch.Tensor) -> torch.Tensor:
        if self.block_sparse_moe is None:
            return self.shared_mlp(normed)
        # The shared MLP's output is summed in the experts' kernel. `forward`, not a call: under tensor
        # parallelism both halves are partial sums, and the MoE's hook all-reduces them together once.
        return self.block_sparse_moe(normed, add=self.shared_mlp.forward(normed))

    def fold_ffn_(self, factor: float) -> None:
        scale_rows_(self.shared_mlp.output_linear, factor)
        if self.block_sparse_moe is not None:
            scale_rows_(self.block_sparse_moe.output_linear, factor)


class HybridModel(nn.Module):
    """The backbone (`model.*` in a checkpoint: the loader reads it as `backbone.*`): the embedding,
    the layers, and the final norm under the family's name."""

    def __init__(self, cfg: ModelConfig, layer_class: type, final_norm_name: str) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.build_layers(cfg, layer_class))
        self.final_norm_name = final_norm_name
        setattr(self, final_norm_name, RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon))

    @staticmethod
    def build_layers(cfg: ModelConfig, layer_class: type) -> list[nn.Module]:
        """One layer per entry of layer_types, each told its index among the layers of its kind."""
        counts: dict[str, int] = {}
        layers = []
        for block_type in cfg.layer_types:
            layers.append(layer_class(cfg, block_type, counts.get(block_type, 0)))
            counts[block_type] = counts.get(block_type, 0) + 1
        return layers

    @property
    def embeddings(self) -> nn.Embedding:
        """The runner's and the speculators' name for the token embedding."""
        return self.embed_tokens


class GraniteMoeHybridForCausalLM(nn.Module):
    # How a checkpoint spells `backbone.` (models/writer.py writes it so).
    checkpoint_prefix = "model."
    layer_class: type[nn.Module] = GraniteDecoderLayer
    backbone_class: type[HybridModel] = HybridModel
    final_norm_name = "norm"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.backbone = self.backbone_class(cfg, self.layer_class, self.final_norm_name)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.backbone.embed_tokens.weight
        # What the logits are divided by: logits_scaling until the multipliers are folded.
        self.logits_divisor = cfg.logits_scaling
        self.weights_prepared = False

    def prepare_weights_(self) -> GraniteMoeHybridForCausalLM:
        """Once the weights are loaded (the loader calls it), once: folds the config's multipliers
        into them (`layers/fold.py`) and stacks the projections that share an input
        (`layers/stacked.py`). The forward refuses to run before."""
        if self.weights_prepared:
            return self
        cfg = self.config
        scale_(self.backbone.embed_tokens.weight, cfg.embedding_multiplier)
        if cfg.tie_word_embeddings:  # the LM head is the scaled table: its logits are divided back
            self.logits_divisor = cfg.logits_scaling * cfg.embedding_multiplier
        else:
            scale_rows_(self.lm_head, 1.0 / cfg.logits_scaling)
            self.logits_divisor = 1.0
        for layer in self.backbone.layers:
            layer.fold_multipliers_(cfg)
            layer.stack_projections_()
        self.weights_prepared = True
        return self

    @property
    def weights_rescaled(self) -> bool:
        """Whether folding changed any weight: a checkpoint written now would hold other weights
        (`models/writer.py` refuses it)."""
        return self.weights_prepared and any(m != 1.0 for m in multipliers(self.config))

    def cast_(self, dtype: torch.dtype) -> GraniteMoeHybridForCausalLM:
        return self.to(dtype)

    def allocate_(self, device: torch.device | str, dtype: torch.dtype) -> GraniteMoeHybridForCausalLM:
        """Gives a model built on the meta device uninitialised weights in `dtype` on `device`."""
        self.to(dtype)
        return self.to_empty(device=device)

    def forward(
        self,
        input_ids: torch.Tensor,
        ctx: StepContext,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        ssm: SSMBackend | None,
    ) -> torch.Tensor:
        """input_ids (T,) -> final hidden states (T, hidden_size); one (K, V) pair per attention
        layer in kv_caches, every Mamba layer's state in `ssm`."""
        if not self.weights_prepared:
            raise RuntimeError(f"{type(self).__name__}: call prepare_weights_() once the weights are loaded "
                               "(models/loader.py does)")
        residual = self.backbone.embed_tokens(input_ids)
        out = None
        for layer in self.backbone.layers:
            # Each residual add is fused with the next pre-norm, as Nemotron-H's forward does.
            if out is None:
                normed = layer.input_layernorm(residual)
            else:
                normed, residual = layer.input_layernorm.add_forward(out, residual)
            normed, residual = layer.ffn_norm.add_forward(layer.mix(normed, ctx, kv_caches, ssm), residual)
            out = layer.ffn(normed)
        final_norm = getattr(self.backbone, self.final_norm_name)
        return final_norm(residual) if out is None else final_norm.add_forward(out, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(S, hidden_size) -> (S, vocab) in the compute dtype, divided by logits_scaling (folded into
        the LM head where it is not the embedding table)."""
        logits = self.lm_head(hidden).to(compute_dtype(hidden.dtype))
        return logits if self.logits_divisor == 1.0 else logits / self.logits_divisor


__all__ = ["GraniteMoeHybridForCausalLM"]
