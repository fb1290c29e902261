"""Tensor parallelism for the families beside Nemotron-H on the CPU (gloo, float32): 2 ranks give
the greedy (and seeded sampled) tokens of one rank and its log-probabilities to float32 round-off.

The Mamba2 hybrids (Granite 4.0-H, Bamba, Falcon-H1) run tiny checkpoints transformers writes
(tests/models/test_family_parity.py, whose engine at one rank matches transformers): Granite's
stacked gate|up `input_linear` (shared MLP and experts) with RoPE and without, Bamba's SwiGLU and
partial RoPE, Falcon-H1's per-section in_proj multipliers with its norm before the gate over groups
the ranks cut (the sharded norm) and its gate-only variant. The Gated DeltaNet hybrids run
make-tiny's checkpoints (which transformers runs the same: tests/models/test_qwen_parity.py):
Qwen3-Next's fused per-key-head in_proj_qkvz / in_proj_ba with a dense first layer and MoE, and its
MTP layer drafting (the verify path of the GDN; the seeded request's tokens follow the drafts),
Qwen3.5's four projections with a dense MLP, Qwen3.5-MoE; GQA value heads (Hv = 2 Hk), each rank
one key head. Both SSM backends; the caches each rank allocates are those sizing prices per rank."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from replayserve import LLM, SamplingParams
from replayserve.builtin.tiny import TINY_FAMILIES, make_tiny
from replayserve.cache.memory import cache_bytes_for
from replayserve.config import ModelConfig
from replayserve.outputs import RequestOutput
from tests.models.test_family_parity import make_family_checkpoint

TOLERANCE = 1e-4  # float32 round-off, summed in another order over the ranks, over 32 tokens
NUM_NEW = 32
MTP_SPEC = {"method": "mtp", "num_speculative_tokens": 2}
# (checkpoint: a test_family_parity name or a make-tiny family, its overrides, ssm_backend)
CASES = [
    ("granite_moe_rope_g2", {}, "replay"),
    ("bamba_half_rope_g2", {}, "baseline"),
    # One group for 2 ranks: each rank's channels are half of the norm's one group.
    ("falcon_h1_norm_before_gate_g2", {"mamba_n_groups": 1}, "replay"),
    ("qwen3_next", {"mtp": True}, "replay"),
    ("qwen3_5", {}, "baseline"),
    ("qwen3_5_moe", {}, "replay"),
    pytest.param(("qwen3_next", {}, "baseline"), marks=pytest.mark.slow),
    pytest.param(("granite_dense_nope_g1", {}, "baseline"), marks=pytest.mark.slow),
    pytest.param(("falcon_h1_gate_only_g4", {}, "baseline"), marks=pytest.mark.slow),
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=1, prompt_logprobs=1)
SEEDED = SamplingParams(temperature=0.8, seed=7, max_tokens=NUM_NEW, ignore_eos=True, logprobs=1)


def _checkpoint(out_dir: Path, name: str, overrides: dict) -> Path:
    if name in TINY_FAMILIES:
        return make_tiny(out_dir, seed=1, family=name, **overrides)
    return make_family_checkpoint(out_dir, name, **overrides)


def _run(model_dir: Path, ranks: int, backend: str, prompts: list[list[int]]) -> tuple[list[RequestOutput], tuple,
                                                                                        list]:
    """The outputs of greedy requests for `prompts` and a seeded one for the first, (the bytes of
    rank 0's KV caches and recurrent states, what `cache_bytes_for` prices one rank's), and the
    drafts of each of the MTP proposer's calls (rank 0's; none without MTP layers)."""
    mtp = ModelConfig.from_dir(model_dir).num_nextn_predict_layers > 0
    llm = LLM(str(model_dir), dtype="float32", device="cpu", max_num_seqs=4, max_num_batched_tokens=32,
              max_model_len=128, ssm_backend=backend, replay_window=8, tensor_parallel_size=ranks,
              speculative=MTP_SPEC if mtp else None)
    drafts: list[list] = []
    proposer = llm.engine.proposer
    if proposer is not None:  # recorded: the target's tokens alone would not tell a broken MTP slice
        propose_batch = proposer.propose_batch

        def recorded(requests: list) -> dict:
            proposed = propose_batch(requests)
            drafts.append(sorted(proposed.items()))
            return proposed

        proposer.propose_batch = recorded  # type: ignore[method-assign]
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts + prompts[:1]],
                               [GREEDY] * len(prompts) + [SEEDED], use_tqdm=False)
        runner, cfg = llm.engine.runner, llm.config
        kv = sum(t.numel() * t.element_size() for pair in runner.kv_caches for t in pair)
        states = sum(t.numel() * t.element_size() for t in runner.ssm.state_tensors())
        priced = cache_bytes_for(cfg, torch.float32, cfg.resolved_num_kv_blocks, cfg.resolved_num_mamba_cache_slots,
                                 per_rank=True)
        return outputs, ((kv, states), priced), drafts
    finally:
        llm.close()


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}{'-' + str(c[1]) if c[1] else ''}-{c[2]}")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    """(outputs at 1 rank, outputs at 2 ranks, the 2-rank run's cache bytes: allocated, priced,
    the MTP drafts at 1 rank, at 2 ranks)."""
    name, overrides, backend = request.param
    model_dir = _checkpoint(tmp_path_factory.mktemp(name), name, overrides)
    gen = torch.Generator().manual_seed(0)
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 19, 40)]
    reference, _, reference_drafts = _run(model_dir, 1, backend, prompts)
    outputs, cache_bytes, drafts = _run(model_dir, 2, backend, prompts)
    yield reference, outputs, cache_bytes, (reference_drafts, drafts)


def test_tokens_equal_one_rank(runs: tuple) -> None:
    reference, outputs, *_ = runs
    for ref, out in zip(reference, outputs, strict=True):
        assert len(out.outputs[0].token_ids) == NUM_NEW
        assert len(set(ref.outputs[0].token_ids)) > 4, "degenerate continuation: the comparison would be weak"
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_logprobs_equal_one_rank_to_round_off(runs: tuple) -> None:
    reference, outputs, *_ = runs
    pairs = []
    for ref, out in zip(reference, outputs, strict=True):
        for a, b in zip(ref.outputs[0].logprobs, out.outputs[0].logprobs, strict=True):
            pairs += [(a[t].logprob, b[t].logprob) for t in a]
        for a, b in zip(ref.prompt_logprobs or [], out.prompt_logprobs or [], strict=True):
            if a is not None:
                pairs += [(a[t].logprob, b[t].logprob) for t in a]
    assert len(pairs) > 4 * NUM_NEW
    worst = max(abs(a - b) for a, b in pairs)
    print(f"max |logprob difference| over {len(pairs)} logprobs: {worst:.3g}")
    assert worst <= TOLERANCE


def test_rank_caches_are_what_sizing_prices_per_rank(runs: tuple) -> None:
    """Rank 0 allocates its slice's KV heads and recurrent (Mamba2 or GDN) heads, as sizing prices them."""
    _, _, (allocated, priced), _ = runs
    assert allocated == priced


def test_mtp_drafts_equal_one_rank(runs: tuple) -> None:
    """The MTP layer's drafts (its slice of attention and feed-forward on each rank) are one rank's."""
    reference, drafts = runs[3]
    if not reference:
        pytest.skip("no MTP layer in this checkpoint")
    tokens = {t for call in reference for _, row in call for t in row}
    assert len(tokens) > 4, "degenerate drafts: the comparison would be weak"
    assert drafts == reference
