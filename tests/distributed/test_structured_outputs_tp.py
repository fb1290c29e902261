"""Structured outputs with tensor parallelism: rank 0 masks and samples, the workers take its
tokens; 2 ranks give the constrained outputs of one (float64, greedy, n-gram drafts cut to what
the grammar allows)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from replayserve import LLM, SamplingParams
from replayserve.builtin.tiny import make_tiny
from replayserve.structured import StructuredOutputsParams
from tests.conftest import assert_pools_full
from tests.structured.examples import EMAIL, SCHEMA

pytest.importorskip("xgrammar")


def test_two_ranks_constrain_as_one(tmp_path: Path) -> None:
    model = make_tiny(tmp_path / "model", seed=3, layers="M*-ME")
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
              SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=EMAIL)),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)]
    prompts = ["def f(x):", "The quick brown fox", "import os"]
    outputs = []
    for ranks in (1, 2):
        with LLM(str(model), dtype="float64", device="cpu", max_num_seqs=4, tensor_parallel_size=ranks,
                 speculative={"method": "ngram", "num_speculative_tokens": 2}) as llm:
            done = llm.generate(prompts, params, use_tqdm=False)
            outputs.append([o.outputs[0].token_ids for o in done])
            assert_pools_full(llm)
    assert outputs[0] == outputs[1]
    text = done[0].outputs[0].text  # JSON, finished or cut by max_tokens
    assert text.startswith("{") and (done[0].outputs[0].finish_reason == "length" or isinstance(json.loads(text), dict))
