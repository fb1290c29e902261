"""SamplingParams.prompt_logprobs against transformers' full-sequence log_softmax (float64): across
chunked prefill, with prefix caching (no hit is read for the scored part), preemption and `n`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from replayserve import LLM, SamplingParams
from tests.conftest import assert_pools_full
from tests.models.hf_reference import hf_teacher_forced_logprobs, make_hf_checkpoint

TOL = 1e-9  # float64 engine vs float64 transformers
K = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("hf_prompt_logprobs"), "hybrid_moe")


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _check(prompt_logprobs: list, prompt: list[int], ref: torch.Tensor, k: int = K) -> None:
    """ref: (len(prompt), V) float64 log_softmax; its row i is the distribution after prompt[: i + 1]."""
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        row, token, entry = ref[i - 1], prompt[i], prompt_logprobs[i]
        top = row.topk(k).indices.tolist()
        assert set(entry) == {token, *top}, i
        for t, lp in entry.items():
            assert abs(lp.logprob - float(row[t])) < TOL, (i, t)
            assert lp.rank == int((row >= row[t]).sum()), (i, t)


@pytest.mark.parametrize("budget", [7, 16, 1024])  # 7: the 37-token prompt spans six prefill chunks
def test_prompt_logprobs_equal_the_full_sequence_log_softmax(model_dir: Path, budget: int) -> None:
    llm = LLM(model=str(model_dir), dtype="float64", device="cpu", block_size=4, max_num_batched_tokens=budget)
    vocab = llm.config.model.vocab_size
    prompts = [_prompt(37, 0, vocab), _prompt(12, 1, vocab)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=K), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        _check(out.prompt_logprobs, prompt, hf_teacher_forced_logprobs(model_dir, prompt, torch.float64))
        assert out.outputs[0].logprobs is None
    assert_pools_full(llm)


@pytest.mark.parametrize("mode", ["align", "all"])
def test_a_cached_prefix_is_not_read_for_prompt_logprobs(model_dir: Path, mode: str) -> None:
    llm = LLM(model=str(model_dir), dtype="float64", device="cpu", block_size=4, max_num_batched_tokens=16,
              enable_prefix_caching=True, mamba_cache_mode=mode, mamba_block_size=8)
    prompt = _prompt(30, 2, llm.config.model.vocab_size)
    ref = hf_teacher_forced_logprobs(model_dir, prompt, torch.float64)
    greedy = SamplingParams(temperature=0.0, max_tokens=3)
    first = llm.generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False)[0]  # publishes the prefix
    hits = llm.get_metrics()["prefix_cache_hits"]
    scored = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=3,
                                                                       prompt_logprobs=0), use_tqdm=False)[0]
    assert llm.get_metrics()["prefix_cache_hits"] == hits  # every position was computed
    _check(scored.prompt_logprobs, prompt, ref, k=0)
    assert scored.token_ids == first.token_ids
    again = llm.generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False)[0]
    assert llm.get_metrics()["prefix_cache_hits"] > hits and again.token_ids == first.token_ids
    assert_pools_full(llm)


def test_preemption_keeps_prompt_logprobs_once(model_dir: Path) -> None:
    """Two prompts in a pool too small for both: one is preempted and recomputes its chunks."""
    llm = LLM(model=str(model_dir), dtype="float64", device="cpu", block_size=4, max_num_batched_tokens=8,
              max_model_len=48, num_kv_blocks=14)
    vocab = llm.config.model.vocab_size
    prompts = [_prompt(20, 3, vocab), _prompt(22, 4, vocab)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, prompt_logprobs=2),
                        use_tqdm=False)
    assert llm.get_metrics()["num_preemptions"] > 0
    for prompt, out in zip(prompts, outs, strict=True):
        _check(out.prompt_logprobs, prompt, hf_teacher_forced_logprobs(model_dir, prompt, torch.float64), k=2)
    assert_pools_full(llm)


def test_n_completions_share_one_prompt_scoring_and_edge_cases(model_dir: Path) -> None:
    llm = LLM(model=str(model_dir), dtype="float64", device="cpu", block_size=4)
    prompt = _prompt(9, 5, llm.config.model.vocab_size)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=1.0, seed=0, n=3, max_tokens=2,
                                                                    prompt_logprobs=1), use_tqdm=False)[0]
    _check(out.prompt_logprobs, prompt, hf_teacher_forced_logprobs(model_dir, prompt, torch.float64), k=1)
    assert len(out.outputs) == 3
    one = llm.generate({"prompt_token_ids": prompt[:1]}, SamplingParams(max_tokens=1, prompt_logprobs=2),
                       use_tqdm=False)[0]
    assert one.prompt_logprobs == [None]
    plain = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None


@pytest.mark.parametrize("value", [-1, 1.5, True, "3"])
def test_bad_prompt_logprobs_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match="SamplingParams.prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)  # type: ignore[arg-type]


def test_prompt_logprobs_above_the_vocabulary_is_refused(model_dir: Path) -> None:
    llm = LLM(model=str(model_dir), dtype="float32", device="cpu")
    vocab = llm.config.model.vocab_size
    with pytest.raises(ValueError, match=rf"SamplingParams.prompt_logprobs={vocab + 1} is more than"):
        llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(prompt_logprobs=vocab + 1), use_tqdm=False)


def test_a_failed_step_takes_back_its_prompt_logprobs(model_dir: Path) -> None:
    """A fault after the forward of a prefill chunk: the chunk's scores are taken back with its
    tokens, and the request, recomputed, scores every prompt token once."""
    llm = LLM(model=str(model_dir), dtype="float64", device="cpu", block_size=4, max_num_batched_tokens=8)
    prompt = _prompt(20, 6, llm.config.model.vocab_size)
    engine = llm.engine
    request = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1))
    engine.step()
    scored = list(request.prompt_logprobs)
    assert len(scored) == 8
    update = engine.scheduler.update

    def failing(*args: object) -> None:  # a fault after the chunk's scores were added
        raise RuntimeError("injected")

    engine.scheduler.update = failing  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    assert request.prompt_logprobs == scored and len(request.prompt_ranks) == 8
    engine.scheduler.update = update  # type: ignore[method-assign]
    while engine.has_unfinished():
        engine.step()
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1),
                       use_tqdm=False)[0]
    assert request.prompt_logprobs == [{t: lp.logprob for t, lp in e.items()} for e in out.prompt_logprobs[1:]]
    assert_pools_full(llm)
