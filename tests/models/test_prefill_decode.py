"""The model's decode path equals a full prefill over the same tokens (float64)."""

from __future__ import annotations

from pathlib import Path

import torch

from replayserve import LLM, SamplingParams


def test_decode_logprobs_equal_full_prefill(tiny_model_dir: Path) -> None:
    llm = LLM(model=str(tiny_model_dir), dtype="float64", device="cpu", block_size=4, max_num_batched_tokens=7)
    vocab = llm.config.model.vocab_size
    prompt = torch.randint(3, vocab, (21,), generator=torch.Generator().manual_seed(3)).tolist()
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=4), use_tqdm=False)[0]
    # Each prefix is prefilled from scratch (in chunks of at most 7 tokens); its first sampled
    # token's distribution must be the decode step's.
    prefixes = [{"prompt_token_ids": prompt + out.token_ids[:i]} for i in range(len(out.token_ids))]
    firsts = llm.generate(prefixes, SamplingParams(temperature=0.0, max_tokens=1, logprobs=4), use_tqdm=False)
    for i, first in enumerate(firsts):
        assert first.token_ids[0] == out.token_ids[i]
        decode_lp, prefill_lp = out.logprobs[i], first.logprobs[0]
        assert decode_lp.keys() == prefill_lp.keys()
        for tok, lp in decode_lp.items():
            assert abs(lp.logprob - prefill_lp[tok].logprob) < 1e-10, (i, tok)
