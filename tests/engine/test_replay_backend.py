"""ReplaySSM behind the engine: token-identical to the baseline backend (float64, CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from replayserve import LLM, SamplingParams
from replayserve.config import ConfigError
from replayserve.ssm.replay import ReplayBackend
from tests.conftest import assert_pools_full


def _prompts(vocab: int) -> list[dict[str, list[int]]]:
    gen = torch.Generator().manual_seed(5)
    return [{"prompt_token_ids": torch.randint(3, vocab, (n,), generator=gen).tolist()} for n in (9, 30, 2, 17)]


@pytest.fixture(scope="module")
def baseline(tiny_model_dir: Path) -> list:
    llm = LLM(model=str(tiny_model_dir), dtype="float64", device="cpu", max_num_seqs=4, max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, logprobs=0)
    return llm.generate(_prompts(llm.config.model.vocab_size), params, use_tqdm=False)


@pytest.mark.parametrize("window", [1, 5, 16, None])
def test_replay_matches_baseline_over_200_tokens(tiny_model_dir: Path, baseline: list, window: int | None) -> None:
    # A 12-token budget chunks the prefills; 160 blocks of 4 cannot hold 4 requests of ~230
    # tokens, so requests are preempted and readmitted into fresh slots mid-decode.
    llm = LLM(
        model=str(tiny_model_dir), dtype="float64", device="cpu", max_num_seqs=4, max_model_len=256, block_size=4,
        max_num_batched_tokens=12, num_kv_blocks=160, ssm_backend="replay", replay_window=window,
    )
    assert isinstance(llm.engine.runner.ssm, ReplayBackend)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, logprobs=0)
    outs = llm.generate(_prompts(llm.config.model.vocab_size), params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for got, want in zip(outs, baseline, strict=True):
        assert got.token_ids == want.token_ids
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            assert abs(next(iter(a.values())).logprob - next(iter(b.values())).logprob) < 1e-9
    assert_pools_full(llm)
    ssm = llm.engine.runner.ssm
    assert ssm.layout.window == (window or 32)
    assert int(ssm.history.max()) <= ssm.layout.window


@pytest.mark.parametrize(("kwargs", "window"), [
    ({}, 32),
    ({"speculative": {"method": "ngram", "num_speculative_tokens": 3}}, 16),
    ({"speculative": {"method": "ngram", "num_speculative_tokens": 3}, "replay_window": 8}, 8),
    ({"replay_window": 7}, 7),
])
def test_default_window_is_32_for_plain_decode_and_16_with_speculation(tiny_model_dir: Path, kwargs: dict,
                                                                       window: int) -> None:
    llm = LLM(model=str(tiny_model_dir), dtype="float32", device="cpu", max_num_seqs=2, max_model_len=64,
              ssm_backend="replay", **kwargs)
    layout = llm.engine.runner.ssm.layout
    assert (llm.config.resolved_replay_window, layout.window) == (window, window)
    assert layout.ring_len == window + llm.config.tokens_per_step


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        ({"replay_window": 0}, "replay_window"),
        ({"replay_window": 65}, "replay_window"),
        ({"dtype": "float64", "device": "cuda"}, "dtype"),
    ],
)
def test_invalid_replay_options_name_the_option(tiny_model_dir: Path, kwargs: dict, option: str) -> None:
    with pytest.raises(ConfigError, match=f"engine option {option}"):
        LLM(model=str(tiny_model_dir), ssm_backend="replay", **kwargs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="runs the Triton kernels; exercised on the H200")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_replay_matches_baseline_on_cuda(tiny_model_dir: Path, dtype: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=0)
    outs = {}
    for backend in ("baseline", "replay"):
        llm = LLM(model=str(tiny_model_dir), dtype=dtype, device="cuda", max_num_seqs=4, ssm_backend=backend)
        outs[backend] = llm.generate(_prompts(llm.config.model.vocab_size), params, use_tqdm=False)
    tol = 2e-3 if dtype == "float32" else 0.3
    for a, b in zip(outs["baseline"], outs["replay"], strict=True):
        # Compare where the sequences still agree: a near-tie may flip a bf16 greedy token.
        n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y), len(a.token_ids))
        assert n >= (64 if dtype == "float32" else 8)
        for la, lb in zip(a.logprobs[:n], b.logprobs[:n], strict=True):
            assert abs(next(iter(la.values())).logprob - next(iter(lb.values())).logprob) < tol


@pytest.mark.skipif(not torch.cuda.is_available(), reason="runs the Triton kernels; exercised on the H200")
@pytest.mark.parametrize("backend", ["baseline", "replay"])
def test_prefix_cache_on_cuda_matches_caching_off(tiny_model_dir: Path, backend: str) -> None:
    """Triton materialize and the boundary copies on CUDA (float32): a second wave that hits the
    first wave's prefixes and decode boundaries produces what caching off produces."""
    prompts = _prompts(512)
    system = prompts[1]["prompt_token_ids"]
    second = [{"prompt_token_ids": system + p["prompt_token_ids"]} for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=0)
    outs = {}
    for mode in ("off", "all", "align"):
        llm = LLM(model=str(tiny_model_dir), dtype="float32", device="cuda", max_num_seqs=4, block_size=16,
                  ssm_backend=backend, enable_prefix_caching=mode != "off",
                  mamba_cache_mode="none" if mode == "off" else mode, num_mamba_cache_slots=32,
                  num_kv_blocks=256)  # given: sized from memory, each test worker sharing the GPU wants its share
        first = llm.generate(prompts, params, use_tqdm=False)
        turn = [{"prompt_token_ids": p["prompt_token_ids"] + o.token_ids + [5, 6]}
                for p, o in zip(prompts, first, strict=True)]
        outs[mode] = llm.generate(second + turn, params, use_tqdm=False)
        if mode != "off":
            assert llm.get_metrics()["prefix_cache_hits"] > 0
        assert_pools_full(llm)
    for mode in ("all", "align"):
        for a, b in zip(outs["off"], outs[mode], strict=True):
            n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y), 40)
            assert n >= 20
            for la, lb in zip(a.logprobs[:n], b.logprobs[:n], strict=True):
                assert abs(next(iter(la.values())).logprob - next(iter(lb.values())).logprob) < 2e-3
