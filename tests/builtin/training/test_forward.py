"""The training forward computes what the engine serves: the same log-probabilities as the engine's
prompt logprobs, the same MTP output as `NemotronHMTP.forward`, and gradients for every parameter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from replayserve import LLM, SamplingParams
from replayserve.builtin.tiny import make_tiny
from replayserve.builtin.training.forward import backbone_hidden, balance_experts_, losses, moe_layers, mtp_hidden
from replayserve.models.loader import load_model


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # chunk_size 16 < the 40-token windows: the scan crosses chunks.
    return make_tiny(tmp_path_factory.mktemp("train_fwd"), seed=1, layers="M*-ME", num_nextn_predict_layers=1,
                     mtp_layer_types=("full_attention", "moe"))


def _windows(vocab: int, batch: int = 3, length: int = 40) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(0))


def test_log_probabilities_equal_the_engines_prompt_logprobs(mtp_dir: Path) -> None:
    llm = LLM(model=str(mtp_dir), dtype="float64", device="cpu")
    model = llm.engine.runner.model
    ids = _windows(model.config.vocab_size)
    with torch.no_grad():
        logp = torch.log_softmax(model.lm_head(backbone_hidden(model, ids, [])), dim=-1)
    outs = llm.generate([{"prompt_token_ids": row.tolist()} for row in ids],
                        SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    for row, lp, out in zip(ids, logp, outs, strict=True):
        engine = torch.tensor([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], row[1:].tolist(), strict=True)],
                              dtype=torch.float64)
        ours = lp[:-1].gather(1, row[1:, None]).squeeze(1)
        torch.testing.assert_close(ours, engine, rtol=0, atol=1e-9)


def test_mtp_output_equals_the_inference_module(mtp_dir: Path) -> None:
    model = load_model(mtp_dir, torch.float64, torch.device("cpu"))
    ids = _windows(model.config.vocab_size)
    with torch.no_grad():
        hidden = backbone_hidden(model, ids, [])
        batched = mtp_hidden(model, ids[:, 1:], hidden[:, :-1], [])
        for b in range(ids.shape[0]):
            one = model.mtp(model.backbone.embeddings(ids[b, 1:]), hidden[b, :-1])
            torch.testing.assert_close(batched[b], one, rtol=0, atol=1e-10)


def test_every_parameter_gets_a_gradient_and_balancing_moves_router_biases(mtp_dir: Path) -> None:
    model = load_model(mtp_dir, torch.float32, torch.device("cpu")).train()
    out = losses(model, _windows(model.config.vocab_size), mtp_weight=0.3)
    assert out.mtp is not None
    torch.testing.assert_close(out.total, out.main + 0.3 * out.mtp)
    out.total.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, f"no gradient reaches {missing}"
    assert len(out.expert_load) == len(moe_layers(model)) == 2
    assert all(int(load.sum()) == 3 * 39 * model.config.num_experts_per_tok for load in out.expert_load[:1])
    before = [m.gate.e_score_correction_bias.clone() for m in moe_layers(model)]
    balance_experts_(model, out.expert_load, rate=1e-3)
    for b, m, load in zip(before, moe_layers(model), out.expert_load, strict=True):
        busiest = int(load.argmax())
        assert m.gate.e_score_correction_bias[busiest] < b[busiest]
