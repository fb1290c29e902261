"""Tensor parallelism for the Mamba2 hybrids beside Nemotron-H (Granite 4.0-H, Bamba, Falcon-H1) on
the CPU (gloo, float32): on tiny checkpoints transformers writes (tests/models/test_family_parity.py,
whose engine at one rank matches transformers), 2 ranks give the greedy tokens of one rank and its
log-probabilities to float32 round-off. The cases cover each family's cuts: Granite's stacked
gate|up `input_linear` (shared MLP and experts) with RoPE and without, Bamba's SwiGLU and partial
RoPE, Falcon-H1's per-section in_proj multipliers with its norm before the gate over groups the
ranks cut (the sharded norm) and its gate-only variant; both SSM backends."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from replayserve import LLM, SamplingParams
from replayserve.outputs import RequestOutput
from tests.models.test_family_parity import FAMILY_CONFIGS, make_family_checkpoint

TOLERANCE = 1e-4  # float32 round-off, summed in another order over the ranks, over 32 tokens
NUM_NEW = 32
# (checkpoint, config overrides, ssm_backend)
CASES = [
    ("granite_moe_rope_g2", {}, "replay"),
    ("bamba_half_rope_g2", {}, "baseline"),
    # One group for 2 ranks: each rank's channels are half of the norm's one group.
    ("falcon_h1_norm_before_gate_g2", {"mamba_n_groups": 1}, "replay"),
    pytest.param(("granite_dense_nope_g1", {}, "baseline"), marks=pytest.mark.slow),
    pytest.param(("falcon_h1_gate_only_g4", {}, "baseline"), marks=pytest.mark.slow),
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=1, prompt_logprobs=1)


def _llm(model_dir: Path, ranks: int, backend: str) -> LLM:
    return LLM(str(model_dir), dtype="float32", device="cpu", max_num_seqs=4, max_num_batched_tokens=32,
               max_model_len=128, ssm_backend=backend, replay_window=8, tensor_parallel_size=ranks)


def _generate(llm: LLM, prompts: list[list[int]]) -> list[RequestOutput]:
    try:
        return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    finally:
        llm.close()


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}{'-' + str(c[1]) if c[1] else ''}-{c[2]}")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list, list]]:
    """(outputs at 1 rank, outputs at 2 ranks) for the case's checkpoint."""
    name, overrides, backend = request.param
    model_dir = make_family_checkpoint(tmp_path_factory.mktemp(name), name, **overrides)
    gen = torch.Generator().manual_seed(0)
    vocab = FAMILY_CONFIGS[name][2]["vocab_size"]
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 19, 40)]
    yield _generate(_llm(model_dir, 1, backend), prompts), _generate(_llm(model_dir, 2, backend), prompts)


def test_tokens_equal_one_rank(runs: tuple[list, list]) -> None:
    reference, outputs = runs
    for ref, out in zip(reference, outputs, strict=True):
        assert len(out.outputs[0].token_ids) == NUM_NEW
        assert len(set(ref.outputs[0].token_ids)) > 4, "degenerate continuation: the comparison would be weak"
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_logprobs_equal_one_rank_to_round_off(runs: tuple[list, list]) -> None:
    reference, outputs = runs
    pairs = []
    for ref, out in zip(reference, outputs, strict=True):
        for a, b in zip(ref.outputs[0].logprobs, out.outputs[0].logprobs, strict=True):
            pairs += [(a[t].logprob, b[t].logprob) for t in a]
        for a, b in zip(ref.prompt_logprobs, out.prompt_logprobs, strict=True):
            if a is not None:
                pairs += [(a[t].logprob, b[t].logprob) for t in a]
    assert len(pairs) > 3 * NUM_NEW
    worst = max(abs(a - b) for a, b in pairs)
    print(f"max |logprob difference| over {len(pairs)} logprobs: {worst:.3g}")
    assert worst <= TOLERANCE
