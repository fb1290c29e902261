"""64 concurrent streaming clients, a quarter of them hanging up at random points, with prefix
caching and speculation on: every stream that completes equals its offline output, and
afterwards every KV block and state slot is free."""

from __future__ import annotations

import asyncio
import random

from openai import AsyncOpenAI

from replayserve import LLM, SamplingParams
from tests.server.conftest import MODEL_NAME, RunningServer

NUM_CLIENTS = 64
# Shared openings so that prefix-cache hits happen under load.
OPENINGS = ["Once upon a time there was a small model that learned to write stories about rivers",
            "Serving such a model means batching many requests at once, splitting long prompts",
            "def fibonacci(n):\n    a, b = 0, 1\n"]


def test_many_streams_with_disconnects_equal_offline_and_free_everything(server: RunningServer,
                                                                         offline: LLM) -> None:
    rng = random.Random(0)
    prompts = [f"{OPENINGS[i % len(OPENINGS)]} {i}" for i in range(NUM_CLIENTS)]
    max_tokens = [rng.randint(4, 20) for _ in prompts]
    leavers = {i: rng.randint(0, 4) for i in rng.sample(range(NUM_CLIENTS), NUM_CLIENTS // 4)}  # chunks read first
    expected = offline.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
                                          for m in max_tokens], use_tqdm=False)
    hits_before = offline.get_metrics()["prefix_cache_hits"]

    async def one(client: AsyncOpenAI, i: int) -> str | None:
        stream = await client.completions.create(model=MODEL_NAME, prompt=prompts[i], max_tokens=max_tokens[i],
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
        text, chunks = "", 0
        async for chunk in stream:
            if i in leavers and chunks >= leavers[i]:
                await stream.close()  # hang up mid-stream
                return None
            chunks += 1
            text += chunk.choices[0].text
        return text

    async def run_all() -> list[str | None]:
        async with AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                               timeout=60) as client:
            return await asyncio.gather(*(one(client, i) for i in range(NUM_CLIENTS)))

    registry = server.app.state.metrics.registry

    def aborted() -> float:
        return registry.get_sample_value("replayserve_request_finished_total",
                                         {"model_name": MODEL_NAME, "finish_reason": "abort"}) or 0.0

    aborted_before = aborted()
    texts = asyncio.run(run_all())
    completed = [i for i, t in enumerate(texts) if t is not None]
    assert len(completed) >= NUM_CLIENTS - len(leavers)
    for i in completed:
        assert texts[i] == expected[i].text, f"client {i}"
    server.assert_pools_full()
    assert aborted() > aborted_before, "hung-up streams are aborted, not run to their end"
    assert hits_before > 0 and server.llm.get_metrics()["prefix_cache_hits"] > 0
