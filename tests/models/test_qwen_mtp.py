"""The Qwen families' MTP layer (`mtp.*`, models/qwen3_next_mtp.py): config.json's
`mtp_num_hidden_layers` in and out, a checkpoint with the layer loads and one declaring it
without its tensors fails naming them, and its output equals an independent float64 reference
whose decoder layer is transformers' own full-attention Qwen3-Next layer holding the MTP weights
(transformers has no MTP, but the MTP's layer is that layer under other names)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM

from replayserve.builtin.tiny import make_tiny
from replayserve.config import ConfigError, ModelConfig
from replayserve.models.loader import CheckpointError, load_model

from .hf_reference import hf_float64_exact

HF_CLASSES = {"qwen3_next": Qwen3NextForCausalLM, "qwen3_5": Qwen3_5ForCausalLM, "qwen3_5_moe": Qwen3_5MoeForCausalLM}
MTP_TYPES = {"qwen3_next": ("full_attention", "moe"), "qwen3_5": ("full_attention", "mlp"),
             "qwen3_5_moe": ("full_attention", "moe")}


def make_qwen_mtp(out: Path, family: str = "qwen3_next", seed: int = 0) -> Path:
    return make_tiny(out, seed=seed, family=family, mtp=True)


@pytest.mark.parametrize("family", sorted(MTP_TYPES))
def test_config_declares_the_mtp_layer_and_reads_back(tmp_path: Path, family: str) -> None:
    cfg = ModelConfig.from_dir(make_qwen_mtp(tmp_path, family))
    assert cfg.num_nextn_predict_layers == 1 and cfg.mtp_layer_types == MTP_TYPES[family]
    hf = cfg.to_hf_dict()
    assert (hf.get("text_config") or hf)["mtp_num_hidden_layers"] == 1
    assert ModelConfig.from_hf_dict(hf) == cfg
    without = ModelConfig.from_dir(make_tiny(tmp_path / "plain", family=family))
    assert without.num_nextn_predict_layers == 0 and "mtp_num_hidden_layers" not in without.to_hf_dict()


@pytest.mark.parametrize(("key", "value"), [("mtp_num_hidden_layers", 2), ("mtp_use_dedicated_embeddings", True)])
def test_unsupported_mtp_keys_are_named(tmp_path: Path, key: str, value: object) -> None:
    hf = {**ModelConfig.from_dir(make_qwen_mtp(tmp_path)).to_hf_dict(), key: value}
    with pytest.raises(ConfigError, match=key):
        ModelConfig.from_hf_dict(hf)


def test_a_checkpoint_declaring_mtp_without_its_tensors_fails_naming_them(tmp_path: Path) -> None:
    path = make_qwen_mtp(tmp_path)
    tensors = load_file(path / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k not in ("mtp.fc.weight", "mtp.norm.weight")},
              path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensors: \['mtp.fc.weight', 'mtp.norm.weight'\]"):
        load_model(path, torch.float64, torch.device("cpu"))


def _zero_centered_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + weight)


@pytest.mark.parametrize(("family", "seed"), [("qwen3_next", 0), ("qwen3_next", 1), ("qwen3_5", 0), ("qwen3_5_moe", 0)])
def test_mtp_output_equals_transformers_decoder_layer_holding_its_weights(tmp_path: Path, family: str,
                                                                          seed: int) -> None:
    path = make_qwen_mtp(tmp_path / "mtp", family, seed)
    model = load_model(path, torch.float64, torch.device("cpu"))
    # The same checkpoint with the MTP layer's tensors as decoder layer 2 ("GG*G": attention and the
    # family's feed-forward there, MoE or MLP as the MTP's).
    tensors = load_file(path / "model.safetensors")
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    swapped = {k: v for k, v in tensors.items() if not k.startswith(("mtp.", "model.layers.2."))}
    swapped.update({k.replace("mtp.layers.0.", "model.layers.2."): v for k, v in tensors.items()
                    if k.startswith("mtp.layers.0.")})
    save_file(swapped, hf_dir / "model.safetensors")
    (hf_dir / "config.json").write_text((path / "config.json").read_text())
    hf = HF_CLASSES[family].from_pretrained(hf_dir, dtype=torch.float64, attn_implementation="sdpa",
                                             experts_implementation="eager").eval()

    gen = torch.Generator().manual_seed(seed)
    n = 11
    ids = torch.randint(3, model.config.vocab_size, (n,), generator=gen)
    hidden = torch.randn(n, model.config.hidden_size, generator=gen, dtype=torch.float64)
    # Both in float64 throughout: transformers' norms, and both sides' RoPE angles, compute in float32.
    with torch.no_grad(), hf_float64_exact():
        rotary = hf.model.rotary_emb  # its inverse frequencies, made in float32 at construction, again in float64
        rotary.inv_freq = type(rotary).compute_default_rope_parameters(hf.config, torch.device("cpu"))[0]
        embeds = hf.model.embed_tokens(ids)
        fused = torch.cat([_zero_centered_norm(embeds, tensors["mtp.pre_fc_norm_embedding.weight"].double()),
                           _zero_centered_norm(hidden, tensors["mtp.pre_fc_norm_hidden.weight"].double())], -1)
        x = (fused @ tensors["mtp.fc.weight"].double().T)[None]
        positions = torch.arange(n)[None] + 5  # RoPE is relative: any start gives the same output
        layer = hf.model.layers[2]
        want = _zero_centered_norm(layer(x, rotary(x, positions), position_ids=positions)[0],
                                   tensors["mtp.norm.weight"].double())
        got = model.mtp(model.backbone.embeddings(ids), hidden)
        last = model.mtp(model.backbone.embeddings(ids), hidden, last_only=True)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(last, want[-1:], rtol=1e-10, atol=1e-10)


def test_mtp_experts_stored_fused_load_as_the_per_expert_ones(tmp_path: Path) -> None:
    """Published Qwen3.5-MoE checkpoints hold experts fused (`experts.gate_up_proj` (E, 2 I, H),
    `experts.down_proj` (E, H, I)); the MTP layer's load as the per-expert tensors do."""
    path = make_qwen_mtp(tmp_path / "split")
    want = load_model(path, torch.float64, torch.device("cpu")).mtp.state_dict()
    tensors = load_file(path / "model.safetensors")
    prefix = "mtp.layers.0.mlp.experts."
    experts = range(4)
    fused = {k: v for k, v in tensors.items() if not k.startswith(prefix)}
    fused[prefix + "gate_up_proj"] = torch.stack([torch.cat([tensors[f"{prefix}{e}.gate_proj.weight"],
                                                             tensors[f"{prefix}{e}.up_proj.weight"]]) for e in experts])
    fused[prefix + "down_proj"] = torch.stack([tensors[f"{prefix}{e}.down_proj.weight"] for e in experts])
    save_file(fused, path / "model.safetensors")
    got = load_model(path, torch.float64, torch.device("cpu")).mtp.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_the_mtp_attention_makes_its_rope_frequencies_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls after the first reuse the layer's inverse frequencies (`Attention.rope_inv_freq`)."""
    from replayserve.layers import attention

    model = load_model(make_qwen_mtp(tmp_path / "mtp"), torch.float32, torch.device("cpu"))
    made: list[torch.Tensor] = []
    real = attention.rope_inv_freq

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        made.append(real(*args, **kwargs))  # type: ignore[arg-type]
        return made[-1]

    monkeypatch.setattr(attention, "rope_inv_freq", counted)
    ids = torch.randint(3, model.config.vocab_size, (6,), generator=torch.Generator().manual_seed(1))
    hidden = torch.randn(6, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        first = model.mtp(model.backbone.embeddings(ids), hidden)
        again = model.mtp(model.backbone.embeddings(ids), hidden)
    assert len(made) == len(model.mtp.layers) and torch.equal(first, again)
