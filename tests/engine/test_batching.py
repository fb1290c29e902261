"""Batching is invisible: a batch gives exactly the tokens each prompt gives alone."""

from __future__ import annotations

import torch

from replayserve import LLM, SamplingParams
from tests.conftest import assert_pools_full


def _prompts(n: int, vocab: int) -> list[dict[str, list[int]]]:
    gen = torch.Generator().manual_seed(1)
    lengths = [3, 29, 11, 40, 1, 17, 23, 8][:n]
    return [{"prompt_token_ids": torch.randint(3, vocab, (n_,), generator=gen).tolist()} for n_ in lengths]


def test_batch_equals_alone_with_chunked_prefill_and_preemption(tiny_model_dir) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    alone = LLM(model=str(tiny_model_dir), dtype="float64", device="cpu", max_num_seqs=1, max_model_len=80,
                block_size=4)
    prompts = _prompts(8, alone.config.model.vocab_size)
    expected = [alone.generate(p, params, use_tqdm=False)[0] for p in prompts]

    # A 16-token budget chunks the longer prompts and mixes chunks with decodes; 24 blocks of 4
    # tokens cannot hold 8 growing requests, so the newest are preempted and recomputed.
    batched = LLM(
        model=str(tiny_model_dir), dtype="float64", device="cpu", max_num_seqs=8, max_num_batched_tokens=16,
        max_model_len=80, block_size=4, num_kv_blocks=24,
    )
    outputs = batched.generate(prompts, params, use_tqdm=False)
    assert batched.engine.scheduler.num_preemptions > 0
    for got, want in zip(outputs, expected, strict=True):
        assert got.token_ids == want.token_ids
        assert got.finish_reason == "length"
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            (tok_a, lp_a), (tok_b, lp_b) = next(iter(a.items())), next(iter(b.items()))
            assert tok_a == tok_b and abs(lp_a.logprob - lp_b.logprob) < 1e-10
    assert_pools_full(batched)


def test_identical_prompts_in_one_batch_give_identical_rows(tiny_model_dir) -> None:
    llm = LLM(model=str(tiny_model_dir), dtype="float64", device="cpu", max_num_seqs=4)
    prompt = _prompts(2, llm.config.model.vocab_size)[1]
    outs = llm.generate([prompt] * 4, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)
    assert all(o.token_ids == outs[0].token_ids for o in outs)
