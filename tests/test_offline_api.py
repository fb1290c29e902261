"""vLLM's offline API shape: RequestOutput(request_id, prompt, prompt_token_ids, outputs=[
CompletionOutput(index, text, token_ids, cumulative_logprob, logprobs, finish_reason,
stop_reason)], finished), `n` completions, `__version__`, `get_tokenizer()`."""

from __future__ import annotations

import math
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

import replayserve
from replayserve import LLM, CompletionOutput, Logprob, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(model=str(tiny_model_dir), dtype="float64", device="cpu", max_num_seqs=8)


def test_the_vllm_quickstart_runs_unchanged(llm: LLM) -> None:
    prompts = ["Hello, my name is", "The capital of France is"]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95, seed=0)
    outputs = llm.generate(prompts, sampling_params)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.prompt == prompt and output.finished
        assert output.prompt_token_ids == llm.get_tokenizer().encode(prompt)
        completion = output.outputs[0]
        assert isinstance(completion, CompletionOutput) and completion.index == 0
        assert len(completion.token_ids) == 16 and completion.finish_reason == "length"
        assert completion.text == llm.get_tokenizer().decode(completion.token_ids)
        assert completion.cumulative_logprob is None and completion.logprobs is None
    assert len({o.request_id for o in outputs}) == 2


def test_n_completions_sample_from_seed_plus_index(llm: LLM) -> None:
    prompt = {"prompt_token_ids": [5, 17, 42, 7]}
    out = llm.generate(prompt, SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=8), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.prompt is None
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    for c in out.outputs:
        solo = llm.generate(prompt, SamplingParams(temperature=1.0, seed=3 + c.index, max_tokens=8), use_tqdm=False)
        assert solo[0].outputs[0].token_ids == c.token_ids
    greedy = llm.generate(prompt, SamplingParams(temperature=0.0, n=2, max_tokens=8), use_tqdm=False)[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids


def test_cumulative_logprob_is_the_sum_of_the_sampled_tokens(llm: LLM) -> None:
    out = llm.generate({"prompt_token_ids": [9, 8, 7]}, SamplingParams(temperature=0.7, seed=1, logprobs=2,
                                                                     max_tokens=6), use_tqdm=False)[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 6
    want = sum(lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids, strict=True))
    assert out.cumulative_logprob is not None and math.isclose(out.cumulative_logprob, want)
    assert out.cumulative_logprob < 0


def test_logprobs_are_vllm_logprob_objects_with_ranks_and_text(llm: LLM) -> None:
    """Ranks and log-probabilities against the whole distribution (logprobs=vocab), float64; a hot
    temperature samples tokens outside the top 2, whose rank must still be exact."""
    prompt = {"prompt_token_ids": [9, 8, 7, 6]}
    vocab = llm.config.model.vocab_size
    out = llm.generate(prompt, SamplingParams(temperature=3.0, seed=5, logprobs=2, max_tokens=12),
                       use_tqdm=False)[0].outputs[0]
    assert out.logprobs is not None
    outside_top = 0
    for i, (token, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        full = llm.generate({"prompt_token_ids": prompt["prompt_token_ids"] + out.token_ids[:i]},
                            SamplingParams(temperature=0.0, max_tokens=1, logprobs=vocab),
                            use_tqdm=False)[0].outputs[0].logprobs[0]
        assert len(full) == vocab
        values = torch.tensor([full[t].logprob for t in range(vocab)], dtype=torch.float64)
        order = values.argsort(descending=True).tolist()
        assert set(lp) == {token, *order[:2]}
        outside_top += token not in order[:2]
        for t, entry in lp.items():
            assert isinstance(entry, Logprob)
            assert abs(entry.logprob - float(values[t])) < 1e-12
            assert entry.rank == int((values >= values[t]).sum())
            assert entry.decoded_token == llm.get_tokenizer().token_text(t)
        assert [lp[t].rank for t in order[:2]] == [1, 2]
    assert outside_top > 0


def test_stop_reason_names_what_matched(llm: LLM) -> None:
    prompt = {"prompt_token_ids": [5, 17, 42, 7, 99]}
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    path = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0]
    assert path.stop_reason is None and path.finish_reason == "length"
    by_token = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                   stop_token_ids=[path.token_ids[3]]), use_tqdm=False)[0].outputs[0]
    assert by_token.finish_reason == "stop" and by_token.stop_reason == path.token_ids[3]
    stop = path.text[len(path.text) // 2 : len(path.text) // 2 + 2]
    by_text = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                  stop=["\x00never", stop]), use_tqdm=False)[0].outputs[0]
    assert by_text.finish_reason == "stop" and by_text.stop_reason == stop
    assert by_text.text == path.text[: path.text.find(stop)]


def test_version_is_the_installed_distributions() -> None:
    assert replayserve.__version__ == version("replayserve")


@pytest.mark.parametrize("n", [0, 1.5, True])
def test_bad_n_is_refused(n: object) -> None:
    with pytest.raises(ValueError, match="SamplingParams.n"):
        SamplingParams(n=n)  # type: ignore[arg-type]


def test_the_progress_bar_shows_prompts_and_token_rates(llm: LLM, capsys: pytest.CaptureFixture) -> None:
    """It counts prompts, as vLLM's does: 3 prompts of n=2 completions are 0/3 ... 3/3, never /6."""
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}] * 3, SamplingParams(temperature=0.0, max_tokens=5, n=2))
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "0/3" in err and "3/3" in err and "/6" not in err
    assert "input:" in err and "output:" in err and "tok/s" in err
    assert llm.get_metrics()["num_prefill_tokens"] >= 12
