"""Sampling parameters and stop rules, end to end through LLM.generate."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from replayserve import LLM, SamplingParams
from replayserve.engine.sampler import (
    SampleResult,
    SamplingBatch,
    compute_dtype,
    filter_logits,
    filter_ref,
    sample,
    sample_tokens,
)
from replayserve.sampling_params import MIN_TEMPERATURE, MIN_TOP_P
from tests.conftest import assert_pools_full

PROMPT = {"prompt_token_ids": [10, 11, 12, 13, 14, 15]}


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(model=str(tiny_model_dir), dtype="float64", device="cpu", max_num_seqs=8)


def _greedy(llm: LLM, n: int = 12) -> list[int]:
    return llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)[
        0
    ].token_ids


def test_seeded_sampling_is_reproducible_and_independent_of_batch(llm: LLM) -> None:
    p = SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    alone = llm.generate(PROMPT, p, use_tqdm=False)[0].token_ids
    others = [SamplingParams(temperature=1.0, seed=s, max_tokens=16, ignore_eos=True) for s in (1, 2, 3)]
    batch = llm.generate([PROMPT] * 4, [others[0], p, others[1], others[2]], use_tqdm=False)
    assert batch[1].token_ids == alone
    assert len({tuple(o.token_ids) for o in batch}) > 1, "different seeds should give different samples"


def test_top_k_one_and_tiny_top_p_are_greedy(llm: LLM) -> None:
    greedy = _greedy(llm)
    for p in (SamplingParams(temperature=1.5, top_k=1, seed=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.5, top_p=1e-9, seed=0, max_tokens=12, ignore_eos=True)):
        assert llm.generate(PROMPT, p, use_tqdm=False)[0].token_ids == greedy


def test_logprobs_are_top_k_of_the_model_distribution(llm: LLM) -> None:
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=3),
                       use_tqdm=False)[0]
    assert len(out.logprobs) == 5
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert len(lp) == 3 and token in lp  # greedy: the sampled token is the top-1
        values = [entry.logprob for entry in lp.values()]
        assert lp[token].logprob == max(values) and all(v <= 0 for v in values)
        assert sum(math.exp(v) for v in values) <= 1 + 1e-12


def test_stop_token_ids_eos_and_max_tokens(llm: LLM) -> None:
    greedy = _greedy(llm)
    stop_at = greedy[4]
    first = greedy.index(stop_at)
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_at]),
                       use_tqdm=False)[0]
    assert out.token_ids == greedy[: first + 1] and out.finish_reason == "stop"
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert out.token_ids == greedy[:3] and out.finish_reason == "length"


def test_eos_stops_unless_ignored(tiny_model_dir: Path) -> None:
    llm = LLM(model=str(tiny_model_dir), dtype="float64", device="cpu")
    greedy = _greedy(llm)
    # Make the model's own 3rd greedy token the EOS token.
    object.__setattr__(llm.engine.config.model, "eos_token_ids", (greedy[2],))
    first = greedy.index(greedy[2])
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0]
    assert out.token_ids == greedy[: first + 1] and out.finish_reason == "stop"
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    assert out.token_ids == greedy


def test_stop_string_truncates_text(llm: LLM) -> None:
    greedy_out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                              use_tqdm=False)[0]
    text = greedy_out.text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), "pick a visible stop string"
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.find(stop)]
    assert greedy_out.token_ids[: len(out.token_ids)] == out.token_ids
    assert_pools_full(llm)


def test_text_prompt_is_tokenized(llm: LLM) -> None:
    ids = llm.tokenizer.encode("The quick brown fox")
    a = llm.generate("The quick brown fox", SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    b = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    assert a.token_ids == b.token_ids and a.prompt_token_ids == ids


def test_sampler_distribution_matches_temperature_and_top_k() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]], dtype=torch.float64)
    p = SamplingParams(temperature=0.5, top_k=3, seed=0)
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(5)
    for _ in range(4000):
        counts[sample(logits, [p], [gen])[0].token] += 1
    want = torch.zeros(5, dtype=torch.float64)
    want[:3] = torch.softmax(logits[0, :3] / 0.5, -1)
    assert counts[3:].sum() == 0
    assert torch.allclose(counts.double() / 4000, want, atol=0.03)


def test_sampler_top_p_keeps_smallest_prefix_reaching_mass() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    seen = {sample(probs.log(), [SamplingParams(top_p=0.75)], [gen])[0].token for _ in range(500)}
    assert seen == {0, 1}


# ------------------------------------------------------------------------------ the batched sampler

# Chi-square critical values at alpha = 0.001 by degrees of freedom (standard chi-square table).
CHI2_CRIT_ALPHA_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of counts (V,) against probabilities (V,), over the tokens with p > 0."""
    keep = probs > 0
    expected = counts.sum() * probs[keep]
    return float(((counts[keep] - expected) ** 2 / expected).sum())


def _batch(logits: torch.Tensor, params: list[SamplingParams], generators: list | None = None,
           drafts: list | None = None) -> SamplingBatch:
    generators = generators or [None] * len(params)
    drafts = drafts or [()] * len(params)
    dtype = compute_dtype(logits.dtype)
    return SamplingBatch.build(params, generators, drafts, logits.shape[-1], dtype, logits.device)


def _ref_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    return filter_ref(logits, p).softmax(-1)


GRID = [SamplingParams(temperature=t, top_k=k, top_p=q)
        for t in (0.3, 1.0, 2.5) for k in (-1, 1, 7, 50, 64) for q in (1.0, 0.9, 0.3, 1e-9)]


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float64, 1e-13), (torch.float32, 2e-6)])
def test_batched_filter_equals_the_reference_per_row(dtype: torch.dtype, atol: float) -> None:
    logits = (3 * torch.randn(len(GRID), 64, generator=torch.Generator().manual_seed(0))).to(dtype)
    probs = filter_logits(logits, _batch(logits, GRID)).softmax(-1)
    assert probs.dtype == dtype
    for row, p in enumerate(GRID):
        want = _ref_probs(logits[row], p)
        assert torch.equal(probs[row] > 0, want > 0), f"support differs for {p}"
        assert torch.allclose(probs[row], want, rtol=0, atol=atol), p


def test_batched_greedy_is_the_argmax() -> None:
    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        logits = torch.randn(12, 100, generator=gen).to(dtype)
        params = [SamplingParams(temperature=0.0) if i % 2 else SamplingParams(top_k=5) for i in range(12)]
        draws, accepted = sample_tokens(logits, _batch(logits, params))
        assert torch.equal(draws[1::2], logits[1::2].argmax(-1)) and not accepted.any()
        all_greedy = [SamplingParams(temperature=0.0)] * 12
        assert [r.token for r in sample(logits, all_greedy, [None] * 12)] == logits.argmax(-1).tolist()


def test_batched_sampling_follows_the_filtered_distribution() -> None:
    """Three parameter sets interleaved in one batch of 60k rows (every 7th seeded): each set's
    samples against its reference distribution, with a 2% mass shift as the power check."""
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0, 1.5, -0.5, 0.7], dtype=torch.float64)
    sets = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.3, top_p=0.8),
            SamplingParams(temperature=1.0, top_k=6, top_p=0.9)]
    n = 20000
    params = [sets[i % 3] for i in range(3 * n)]
    generators = [torch.Generator().manual_seed(i) if i % 7 == 0 else None for i in range(3 * n)]
    rows = logits.expand(3 * n, -1)
    draws, _ = sample_tokens(rows, _batch(rows, params, generators))
    for s, p in enumerate(sets):
        want = _ref_probs(logits, p)
        counts = torch.bincount(draws[s::3], minlength=8).double()
        assert counts[want == 0].sum() == 0
        crit = CHI2_CRIT_ALPHA_001[int((want > 0).sum()) - 1]
        assert _chi2(counts, want) < crit, p
        a, b = want.topk(2).indices.tolist()
        shifted = want.clone()
        shifted[a] -= 0.02
        shifted[b] += 0.02
        assert _chi2(counts, shifted) > crit, p


def _mixed_step(step: int) -> tuple[torch.Tensor, list[SamplingParams], list[tuple[int, ...]]]:
    """A step of six rows, two of them (rows 1 and 4) the seeded rows under test."""
    gen = torch.Generator().manual_seed(100 + step)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.9, top_p=0.95, seed=5),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.2, seed=9),
              SamplingParams(temperature=0.8, top_k=20, seed=11), SamplingParams(temperature=1.0, top_k=3)]
    drafts = [(), (4, 7), (1,), (), (), (2, 2, 2)]
    logits = torch.randn(sum(1 + len(d) for d in drafts), 32, generator=gen, dtype=torch.float64)
    logits[1:3, 4] += 3.0  # row 1 accepts its first draft now and then
    return logits, params, drafts


def test_seeded_rows_give_the_same_tokens_alone_and_in_a_mixed_batch() -> None:
    # Row 1 verifies two drafts with top-p, row 4 is plain with top-k: alone neither takes the sort
    # path the other forces on the batch, nor shares its noise draw.
    torch.manual_seed(0)
    gens_alone = {1: torch.Generator().manual_seed(5), 4: torch.Generator().manual_seed(11)}
    gens_mixed = [None, torch.Generator().manual_seed(5), None, torch.Generator().manual_seed(9),
                  torch.Generator().manual_seed(11), None]
    for step in range(8):
        logits, params, drafts = _mixed_step(step)
        starts = [0, 1, 4, 6, 7, 8]
        mixed = sample(logits, params, gens_mixed, drafts)
        for row, gen in gens_alone.items():
            rows = logits[starts[row] : starts[row] + 1 + len(drafts[row])]
            alone = sample(rows, [params[row]], [gen], [drafts[row]])[0]
            assert mixed[row].tokens == alone.tokens, (step, row)


def _forced(**fields: float) -> SamplingParams:
    """SamplingParams holding values its checks refuse (the sampler's own robustness)."""
    params = SamplingParams()
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


def test_tiny_top_p_top_k_one_and_tiny_temperature_keep_the_argmax() -> None:
    gen = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.float64):
        logits = torch.randn(16, 1000, generator=gen).to(dtype)
        # SamplingParams refuses these extremes; the sampler must still survive any that slip past.
        for p in (_forced(top_p=1e-300), SamplingParams(temperature=2.0, top_k=1),
                  _forced(temperature=1e-300), _forced(temperature=1e-45, top_p=1e-300),
                  _forced(temperature=1e-30, top_k=3, top_p=0.5),
                  SamplingParams(temperature=MIN_TEMPERATURE, top_p=MIN_TOP_P)):
            params = [p] * 16
            probs = filter_logits(logits, _batch(logits, params)).softmax(-1)
            assert torch.isfinite(probs).all(), (dtype, p)
            assert [r.token for r in sample(logits, params, [None] * 16)] == logits.argmax(-1).tolist(), (dtype, p)


def test_logprobs_are_log_softmax_of_the_logits() -> None:
    gen = torch.Generator().manual_seed(3)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=1.0, seed=1),
                  SamplingParams(temperature=1.0, logprobs=0), SamplingParams(temperature=0.0, logprobs=5)]
        drafts = [(), (), (), (3, 3)]
        logits = torch.randn(6, 40, generator=gen).to(dtype)
        logits[3:5, 3] += 8.0  # the greedy verify row accepts both drafts
        want = torch.log_softmax(logits.double(), -1)
        results = sample(logits, params, [None, torch.Generator().manual_seed(1), None, None], drafts)
        assert results[1].logprobs is None
        assert results[3].tokens[:2] == (3, 3)
        for result, start, p in ((results[0], 0, params[0]), (results[2], 2, params[2]), (results[3], 3, params[3])):
            assert result.logprobs is not None and len(result.logprobs) == len(result.tokens)
            assert result.ranks is not None
            for i, (token, lp) in enumerate(zip(result.tokens, result.logprobs, strict=True)):
                assert next(iter(lp)) == token  # the sampled token comes first
                assert result.ranks[i] == int((want[start + i] >= want[start + i, token]).sum())
                top = set(want[start + i].topk(p.logprobs).indices.tolist())
                assert set(lp) == top | {token}
                for t, v in lp.items():
                    assert abs(v - float(want[start + i, t])) < tol


def test_a_rows_nan_or_inf_does_not_poison_the_others() -> None:
    def run(bad: bool) -> list[SampleResult]:
        gen = torch.Generator().manual_seed(4)
        good = torch.randn(4, 50, generator=gen, dtype=torch.float64)
        params = [SamplingParams(temperature=1.0, top_p=0.9, seed=1, logprobs=2), SamplingParams(temperature=0.0),
                  SamplingParams(temperature=0.7, top_k=10, seed=2)]
        drafts = [(), (), (5,)]
        gens = [torch.Generator().manual_seed(1), None, torch.Generator().manual_seed(2)]
        if not bad:
            return sample(good, params, gens, drafts)
        nan, inf, ninf, partial = (torch.full((1, 50), v, dtype=torch.float64)
                                   for v in (math.nan, math.inf, -math.inf, 0.0))
        partial[0, ::3] = math.nan
        partial[0, 1] = math.inf
        rows = torch.cat([nan, good[:1], inf, good[1:2], ninf, good[2:], partial, nan, nan])
        bad_params = [SamplingParams(temperature=1.0, top_p=0.5, logprobs=1), SamplingParams(temperature=0.0),
                      SamplingParams(temperature=1.0, top_k=4), SamplingParams(temperature=0.9),
                      SamplingParams(temperature=1.0, seed=3)]
        out = sample(rows, [bad_params[0], params[0], bad_params[1], params[1], bad_params[2], params[2],
                            bad_params[3], bad_params[4]],
                     [None, gens[0], None, None, None, gens[2], None, torch.Generator().manual_seed(3)],
                     [(), (), (), (), (), (5,), (), (7,)])
        assert all(0 <= t < 50 for r in out for t in r.tokens)
        return [out[1], out[3], out[5]]

    assert run(bad=True) == run(bad=False)


class _HostReads(TorchDispatchMode):
    """Records the ops that read a tensor's value on the host (a device sync on a GPU)."""

    SYNCING = ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.unique")

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # torch's protocol
        name = str(func)
        bool_index = name.startswith("aten.index.") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
        if name.startswith(self.SYNCING) or bool_index:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def test_a_step_reads_the_device_once(monkeypatch: pytest.MonkeyPatch) -> None:
    logits, params, drafts = _mixed_step(0)
    params[0] = SamplingParams(temperature=1.0, logprobs=2)
    transfers: list[str] = []
    for method in ("tolist", "cpu", "numpy", "item"):
        original = getattr(torch.Tensor, method)

        def counted(self: torch.Tensor, *args, _name: str = method, _f=original, **kwargs):
            transfers.append(_name)
            return _f(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, counted)
    gens = [None, torch.Generator().manual_seed(5), None, torch.Generator().manual_seed(9), None, None]
    with _HostReads() as mode:
        results = sample(logits, params, gens, drafts)
    assert transfers == ["tolist"] and mode.reads == []
    assert len(results) == 6 and results[0].logprobs is not None
