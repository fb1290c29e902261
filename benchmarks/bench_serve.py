"""Load generator for a running OpenAI-compatible server (`replayserve serve`): throughput, time
to first token and inter-token latency under Poisson arrivals or a fixed number of clients.

Every request streams a `/v1/completions` call whose prompt is token ids: ``--input-len`` random
ids (uniform in ``[len * (1 - r), len * (1 + r)]`` with ``r = --range-ratio``; the same for
``--output-len``), after one of ``--num-prefixes`` shared prefixes of ``--prefix-len`` ids when
``--prefix-len`` > 0. Outputs ignore EOS, so each request generates exactly its output length.
Arrivals: ``--request-rate R`` sends at Poisson times with mean rate R per second (inf: all at
once); ``--concurrency C`` keeps at most C requests in flight (both may be given).

Per request: TTFT is the time from sending to the first chunk with text; ITL is the gap between
successive text chunks (a chunk can carry more than one token under speculative decoding, so
ITL is per chunk); TPOT is (latency - TTFT) / (output tokens - 1). Throughput counts the tokens the
server reports in `usage` over the time from the first send to the last response.

    python benchmarks/bench_serve.py --base-url http://127.0.0.1:8000 --num-requests 200 --request-rate 8  # needs httpx
    python benchmarks/bench_serve.py --concurrency 16 --input-len 256 --output-len 64 --prefix-len 128
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # imported where requests are sent: the offline half of bench_serve_vs_offline needs no httpx
    import httpx


@dataclass
class Result:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = math.nan
    latency: float = math.nan
    itl: list[float] = field(default_factory=list)
    error: str = ""


def _length(rng: random.Random, mean: int, ratio: float) -> int:
    return max(1, rng.randint(int(mean * (1 - ratio)), int(mean * (1 + ratio))))


def make_workload(args: argparse.Namespace) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request."""
    rng = random.Random(args.seed)

    def ids(n: int) -> list[int]:  # ids 0-2 are special tokens in the tiny model's vocabulary
        return [rng.randrange(3, args.vocab_size) for _ in range(n)]

    prefixes = [ids(args.prefix_len) for _ in range(args.num_prefixes)] if args.prefix_len else [[]]
    return [(rng.choice(prefixes) + ids(_length(rng, args.input_len, args.range_ratio)),
             _length(rng, args.output_len, args.range_ratio)) for _ in range(args.num_requests)]


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int) -> Result:
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    result, last = Result(ok=False), None
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                return Result(ok=False, error=f"{response.status_code}: {(await response.aread())[:200]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if "error" in chunk:
                    return Result(ok=False, error=str(chunk["error"]))
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.latency = time.perf_counter() - start
        result.ok = result.output_tokens > 0
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


def arrival_times(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: Poisson arrivals at `request_rate`
    per second (the first at 0), or all at 0 when the rate is inf."""
    if not math.isfinite(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    gaps = (rng.expovariate(request_rate) for _ in range(num_requests - 1))
    return list(itertools.accumulate(gaps, initial=0.0))[:num_requests]


async def drive(base_url: str, workload: list[tuple[list[int], int]], request_rate: float = math.inf,
                concurrency: int | None = None, model: str | None = None, warmup: int = 0, timeout: float = 600,
                seed: int = 0) -> tuple[list[Result], float]:
    """Streams every request of `workload` to the server at `base_url`, sent at `arrival_times`
    (`seed` draws them) with at most `concurrency` in flight; results in workload order and the
    seconds from the first send to the last response. `warmup` short requests go first, untimed."""
    import httpx

    limit = concurrency or len(workload)
    url = f"{base_url}/v1/completions"
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout),
                                 limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit)) as client:
        model = model or (await client.get(f"{base_url}/v1/models")).json()["data"][0]["id"]
        for prompt, _ in workload[:warmup]:
            await one_request(client, url, model, prompt, 4)
        gate = asyncio.Semaphore(limit)

        async def gated(prompt: list[int], max_tokens: int) -> Result:
            async with gate:
                return await one_request(client, url, model, prompt, max_tokens)

        tasks = []
        start = time.perf_counter()
        for (prompt, max_tokens), at in zip(workload, arrival_times(len(workload), request_rate, seed), strict=True):
            if at > 0:
                await asyncio.sleep(start + at - time.perf_counter())
            tasks.append(asyncio.create_task(gated(prompt, max_tokens)))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


async def run(args: argparse.Namespace) -> tuple[list[Result], float]:
    return await drive(args.base_url, make_workload(args), args.request_rate, args.concurrency, args.model,
                       args.warmup, args.timeout, args.seed + 1)


def summarize(results: list[Result], duration: float) -> dict[str, float]:
    ok = [r for r in results if r.ok]

    def pct(values: list[float], name: str) -> dict[str, float]:
        if not values:
            return {}
        return {f"{name}_p{p}_ms": float(np.percentile(values, p)) * 1e3 for p in (50, 90, 99)}

    output = sum(r.output_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "requests": len(results), "failed": len(results) - len(ok), "duration_s": duration,
        "request_throughput": len(ok) / duration, "output_tok_s": output / duration,
        "total_tok_s": (output + sum(r.prompt_tokens for r in ok)) / duration,
        **pct([r.ttft for r in ok], "ttft"), **pct([g for r in ok for g in r.itl], "itl"),
        **pct(tpot, "tpot"), **pct([r.latency for r in ok], "latency"),
    }


def markdown_row(args: argparse.Namespace, s: dict[str, float]) -> str:
    arrivals = f"rate {args.request_rate:g}/s" if math.isfinite(args.request_rate) else "all at once"
    if args.concurrency:
        arrivals += f", ≤{args.concurrency} in flight"
    cells = [arrivals, f"{args.input_len}+{args.prefix_len}/{args.output_len}", f"{s['requests']}",
             f"{s['request_throughput']:.2f}", f"{s['output_tok_s']:.0f}"]
    for name in ("ttft", "itl", "tpot"):
        cells.append(" / ".join(f"{s.get(f'{name}_p{p}_ms', math.nan):.0f}" for p in (50, 90, 99)))
    return "| " + " | ".join(cells) + " |"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default %(default)s)")
    p.add_argument("--model", help="model name to send (default: the first of /v1/models)")
    p.add_argument("--num-requests", type=int, default=100, help="(default %(default)s)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrival rate, requests/s; inf sends all at once (default %(default)s)")
    p.add_argument("--concurrency", type=int, help="at most this many requests in flight (default: no limit)")
    p.add_argument("--input-len", type=int, default=64,
                   help="mean prompt tokens after the prefix (default %(default)s)")
    p.add_argument("--output-len", type=int, default=32, help="mean output tokens (default %(default)s)")
    p.add_argument("--range-ratio", type=float, default=0.5,
                   help="lengths are uniform in [mean*(1-r), mean*(1+r)] (default %(default)s)")
    p.add_argument("--prefix-len", type=int, default=0, help="tokens of a shared prefix (default %(default)s)")
    p.add_argument("--num-prefixes", type=int, default=1, help="distinct shared prefixes (default %(default)s)")
    p.add_argument("--vocab-size", type=int, default=500,
                   help="prompt ids are drawn from [3, this) (default %(default)s)")
    p.add_argument("--warmup", type=int, default=2,
                   help="short requests sent first, not measured (default %(default)s)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per request (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default %(default)s)")
    p.add_argument("--out", help="also write the summary as JSON here")
    return p


def main() -> None:
    p = build_parser()
    args = p.parse_args()
    if not 0 <= args.range_ratio < 1:
        p.error("--range-ratio must be in [0, 1)")
    results, duration = asyncio.run(run(args))
    summary = summarize(results, duration)
    for key, value in summary.items():
        print(f"{key:>22}: {value:.2f}" if isinstance(value, float) else f"{key:>22}: {value}")
    errors = sorted({r.error for r in results if not r.ok})
    for error in errors[:5]:
        print(f"error: {error}")
    print("| arrivals | input+prefix/output | requests | req/s | output tok/s | TTFT ms p50/p90/p99 "
          "| ITL ms p50/p90/p99 | TPOT ms p50/p90/p99 |")
    print(markdown_row(args, summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "summary": summary,
                       "results": [asdict(r) for r in results]}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
