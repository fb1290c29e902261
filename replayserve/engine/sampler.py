"""Turns a step's logits into tokens on the device, for all its sampling rows at once.

A row is one sequence that samples this step. A plain row has one position (the logits after its
last token); a speculative verify row has 1 + k (after its last known token and after each of its
k drafts). Positions are flattened in row order: logits (N, V), N = sum over rows of 1 + k.

Per position, in float32 (float64 when the logits are float64):
0. Grammar masks (`engine/grammars.py`: tokens the row's grammar refuses get -inf, in place, so
   reported log-probabilities are of the masked distribution, as vLLM's), then penalties and the
   min_tokens ban (`engine/penalties.py`), for rows that use them.
1. Filter: temperature, then min-p, top-k and top-p, each a per-position tensor of `SamplingBatch`.
   The most likely token always survives, whatever the parameters round to in the compute dtype.
2. Draw one token from the filtered distribution p by an exponential race: with E(t) ~ Exp(1)
   independent per token, argmax_t p(t) / E(t) is token t with probability p(t). Seeded rows draw
   their E from their own generator, so a seed gives the same tokens whichever requests share the
   batch; the other rows share one batched draw. Greedy rows take the argmax of the logits.
3. Verify (`spec.acceptance.accept_drafts`): a row keeps its leading drafts that equal the draws
   at their positions and emits the draws at positions 0..accepted; for one-hot drafts that is
   lossless rejection sampling, for greedy rows argmax prefix matching.
4. Log-probabilities of the model's distribution (before temperature and truncation), only when
   some row asks: the emitted token's with its rank, and the top-k.
Tokens, accepted counts and the requested log-probabilities are packed into one tensor and reach
the host in one transfer. `launch_sample` queues it and returns at once (the draws stay on the
device, where async scheduling feeds them to the next step); `collect_sample` waits for it.

A new per-request parameter is one more (N,) tensor in `SamplingBatch`, filled in
`SamplingBatch.build`, and one more step in `filter_logits`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from replayserve.engine.penalties import Penalties, apply_penalties
from replayserve.ops.token_bitmask import TokenMask, apply_token_bitmask
from replayserve.sampling_params import SamplingParams
from replayserve.speculative.acceptance import accept_drafts
from replayserve.transfer import to_device


class SampleResult(NamedTuple):
    """The tokens one sequence emits this step: one, or for a speculative verify the accepted
    drafts and the bonus token; with each token's log-probabilities when asked. (A named tuple:
    a large batch builds hundreds per step, and a frozen dataclass is slow to construct.)"""

    tokens: tuple[int, ...]
    logprobs: tuple[dict[int, float], ...] | None  # per token: the sampled token's, then the top-k
    # Per token, with logprobs: its rank in the model's distribution (`token_ranks`).
    ranks: tuple[int, ...] | None = None

    @property
    def token(self) -> int:
        return self.tokens[-1]


def compute_dtype(logits_dtype: torch.dtype) -> torch.dtype:
    """The dtype sampling filters in: float64 for float64 logits, float32 otherwise."""
    return torch.float64 if logits_dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class SamplingBatch:
    """One step's sampling parameters per position (N,) on the device, and the host-side facts
    that let the sampler run without reading the device. Built once per step by `build`."""

    temperature: torch.Tensor  # (N,) compute dtype: 0 on greedy rows, otherwise >= the dtype's tiny
    top_k: torch.Tensor  # (N,) int64: 0 = off
    top_p: torch.Tensor  # (N,) compute dtype: 1 = off
    min_p: torch.Tensor  # (N,) compute dtype: 0 = off
    drafts: torch.Tensor  # (N,) int64: the draft each position's distribution verifies, -1 at a row's last
    grid_index: torch.Tensor  # (N,) int64: row * width + j at position j of a row
    row_starts: tuple[int, ...]  # (R + 1,) each row's first position, then N
    width: int  # positions of the longest row: 1 + its drafts
    seeded: tuple[tuple[int, int, torch.Generator], ...]  # (first, end) positions and generator of seeded rows
    logprobs: tuple[int | None, ...]  # per row: SamplingParams.logprobs
    all_greedy: bool
    max_top_k: int  # the largest top_k of a row that truncates by it; 0 when none does
    any_top_p: bool  # some row truncates by top_p
    any_min_p: bool  # some row truncates by min_p

    @property
    def num_rows(self) -> int:
        return len(self.row_starts) - 1

    @classmethod
    def build(cls, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
              drafts: Sequence[Sequence[int]], vocab_size: int, dtype: torch.dtype,
              device: torch.device) -> SamplingBatch:
        """One SamplingParams, generator (or None) and draft tuple (empty for a plain row) per row;
        dtype: the compute dtype. Two host-to-device copies: the float and the integer columns."""
        tiny = torch.finfo(dtype).tiny
        width = 1 + max((len(d) for d in drafts), default=0)
        temperature: list[float] = []
        top_p: list[float] = []
        min_p: list[float] = []
        top_k: list[int] = []
        draft_ids: list[int] = []
        grid: list[int] = []
        starts = [0]
        seeded: list[tuple[int, int, torch.Generator]] = []
        for row, (p, gen, d) in enumerate(zip(params, generators, drafts, strict=True)):
            n = 1 + len(d)
            # A positive temperature that rounds to 0 in `dtype` must not read as greedy.
            temperature += [0.0 if p.greedy else max(p.temperature, tiny)] * n
            top_p += [1.0 if p.greedy else p.top_p] * n
            min_p += [0.0 if p.greedy else p.min_p] * n
            top_k += [p.top_k if not p.greedy and 0 < p.top_k < vocab_size else 0] * n
            draft_ids += [*d, -1]
            grid += range(row * width, row * width + n)
            if gen is not None and not p.greedy:
                seeded.append((starts[-1], starts[-1] + n, gen))
            starts.append(starts[-1] + n)
        floats = to_device(torch.tensor([temperature, top_p, min_p], dtype=dtype), device)
        ints = to_device(torch.tensor([top_k, draft_ids, grid], dtype=torch.int64), device)
        return cls(
            temperature=floats[0], top_p=floats[1], min_p=floats[2], top_k=ints[0], drafts=ints[1], grid_index=ints[2],
            row_starts=tuple(starts), width=width, seeded=tuple(seeded),
            logprobs=tuple(p.logprobs for p in params), all_greedy=all(p.greedy for p in params),
            max_top_k=max(top_k, default=0), any_top_p=any(v < 1.0 for v in top_p), any_min_p=any(min_p),
        )


def filter_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits (N, V), any float dtype -> (N, V) in the compute dtype: shifted so each row's maximum
    is 0, divided by the temperature (1 on greedy rows), top-k and top-p cut to -inf.

    Each row is computed on its own: a row's NaN or inf stays in that row."""
    x = logits.to(compute_dtype(logits.dtype))
    temperature = torch.where(batch.temperature == 0, 1.0, batch.temperature)
    # Shifting first keeps the most likely token at 0 (probability >= 1 / V) however small the
    # temperature: x / t alone can overflow to inf and give NaN probabilities.
    x = (x - x.amax(dim=-1, keepdim=True)) / temperature[:, None]
    if batch.any_min_p:  # p < min_p * p_max, i.e. x < log(min_p) with the maximum at 0 (min_p 0: -inf)
        x = x.masked_fill(x < batch.min_p.log()[:, None], -torch.inf)
    if batch.any_top_p:
        sorted_x, order = x.sort(dim=-1, descending=True)
        if batch.max_top_k:
            sorted_x = _cut_below_kth(sorted_x, sorted_x, batch.top_k)
        probs = sorted_x.softmax(dim=-1)
        # The smallest prefix whose mass reaches top_p; its first token is kept outright, since
        # top_p may round to 0 and the cumulative sum may round past it.
        drop = (probs.cumsum(dim=-1) - probs >= batch.top_p[:, None]) & (batch.top_p < 1)[:, None]
        drop[:, 0] = False
        x = x.scatter(-1, order, sorted_x.masked_fill(drop, -torch.inf))
    elif batch.max_top_k:
        x = _cut_below_kth(x, x.topk(batch.max_top_k, dim=-1).values, batch.top_k)
    return x


def _cut_below_kth(x: torch.Tensor, descending: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """x (N, V) with the values below each row's top_k-th largest set to -inf (ties kept; top_k 0
    keeps all). descending (N, >= max top_k): each row's largest values, largest first."""
    kth = descending.gather(-1, (top_k.clamp(min=1) - 1)[:, None])
    kth = kth.masked_fill((top_k == 0)[:, None], -torch.inf)
    return x.masked_fill(x < kth, -torch.inf)


def sample_tokens(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Draws a token at every position and verifies the drafts; nothing is read back to the host.

    Args:
        logits: (N, V), any float dtype, positions in `batch` order.
        batch: the step's parameters.

    Returns:
        draws: (N,) int64, the token drawn at each position (greedy rows: the argmax of the logits).
        accepted: (R,) int64, drafts each row keeps; the row emits draws[start : start + accepted + 1].
    """
    draws = logits.argmax(dim=-1)
    if not batch.all_greedy:
        probs = filter_logits(logits, batch).softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for start, end, generator in batch.seeded:
            noise[start:end].exponential_(generator=generator)
        # An Exp(1) draw can be 0; at the dtype's tiny p / noise stays finite, as p <= 1.
        sampled = (probs / noise.clamp_(min=torch.finfo(probs.dtype).tiny)).argmax(dim=-1)
        draws = torch.where(batch.temperature == 0, draws, sampled)
    accepted = accept_drafts(draws, batch.drafts, batch.grid_index, batch.num_rows, batch.width)
    return draws, accepted


class PendingSample(NamedTuple):
    """A step's draws on the device, with their transfer to the host queued behind them
    (`launch_sample`); `collect_sample` waits for it and unpacks the results."""

    tokens: torch.Tensor  # (N,) int64 on the device: the token drawn at each position
    host: torch.Tensor  # the transfer: filled once `ready` completes (pinned memory on CUDA)
    ready: torch.cuda.Event | None  # None: `host` is filled already (CPU)
    batch: SamplingBatch | None  # None: the greedy fast path, `host` holds the tokens
    k_max: int  # top log-probabilities per position in the transfer


def launch_sample(logits: torch.Tensor, params: Sequence[SamplingParams],
                  generators: Sequence[torch.Generator | None], drafts: Sequence[Sequence[int]] | None = None,
                  histories: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
                  eos_token_ids: Sequence[int] = (), grammar: TokenMask | None = None) -> PendingSample:
    """Samples every row of a step on the device and queues the one device-to-host transfer,
    without waiting for it (arguments as `sample`). Seeded generators advance now."""
    if grammar is not None:
        every = grammar.positions == tuple(range(logits.shape[0]))
        apply_token_bitmask(logits, to_device(grammar.bitmask, logits.device),
                            None if every else to_device(torch.tensor(grammar.positions), logits.device))
    if histories is None and (drafts is None or not any(drafts)) and all(
            p.greedy and p.logprobs is None for p in params):
        # The common decode step: argmax per row and one transfer, without building the batch's
        # parameter columns (their Python loop is most of a large batch's sampling time).
        tokens = logits.argmax(dim=-1)
        return PendingSample(tokens, *_to_host(tokens), None, 0)
    drafts = [()] * len(params) if drafts is None else drafts
    dtype = compute_dtype(logits.dtype)
    batch = SamplingBatch.build(params, generators, drafts, logits.shape[-1], dtype, logits.device)
    penalties = None
    if histories is not None:
        penalties = Penalties.build(params, batch.row_starts[:-1], histories, eos_token_ids, logits.shape[-1], dtype,
                                    logits.device)
    draws, accepted = sample_tokens(logits if penalties is None else apply_penalties(logits, penalties), batch)
    parts = [draws, accepted]
    k_max = max((k for k in batch.logprobs if k is not None), default=None)
    if k_max is not None:
        logprobs = torch.log_softmax(logits.to(dtype), dim=-1)
        chosen = logprobs.gather(-1, draws[:, None])
        parts += [chosen, token_ranks(logprobs, chosen)]
        if k_max:
            top = logprobs.topk(k_max, dim=-1)
            parts += [top.indices, top.values]
    # float64 holds token ids exactly and float32 log-probabilities exactly.
    packed = torch.cat([p.reshape(-1).to(torch.float64) for p in parts])
    return PendingSample(draws, *_to_host(packed), batch, k_max or 0)


def _to_host(values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """A copy of `values` on the host, queued on the stream (CUDA: into pinned memory, with an
    event that completes when it has landed), so the host can go on while the device runs."""
    if values.device.type != "cuda":
        return values, None
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


def collect_sample(pending: PendingSample) -> list[SampleResult]:
    """Waits for a launched step's transfer (the step's one host sync) and unpacks it: one
    SampleResult per row."""
    if pending.ready is not None:
        pending.ready.synchronize()
    values = pending.host.tolist()
    if pending.batch is None:
        return [SampleResult((token,), None) for token in values]
    return _results(values, pending.batch, pending.k_max)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
           drafts: Sequence[Sequence[int]] | None = None,
           histories: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
           eos_token_ids: Sequence[int] = (), grammar: TokenMask | None = None) -> list[SampleResult]:
    """Samples every row of a step; one device-to-host transfer.

    Args:
        logits: (N, V), any float dtype: row i's 1 + len(drafts[i]) positions, rows in order.
        params, generators: one SamplingParams and generator (None: unseeded) per row.
        drafts: per row, the drafts its positions verify; None: every row is plain.
        histories: per row, its (prompt, output) tokens so far, for penalties and min_tokens.
        eos_token_ids: the model's, banned by min_tokens.
        grammar: the grammar masks of the constrained positions; the logits are masked in place.

    Returns:
        One SampleResult per row. Reported log-probabilities are those of the model's distribution,
        before temperature and truncation.
    """
    return collect_sample(launch_sample(logits, params, generators, drafts, histories, eos_token_ids, grammar))


def token_ranks(logprobs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """logprobs (N, V), chosen (N, 1) -> (N,) int64: the tokens at least as likely as the chosen
    one, itself included (1 = the most likely; tied tokens share the larger rank, as in vLLM)."""
    return (logprobs >= chosen).sum(dim=-1)


def _results(host: list[float], batch: SamplingBatch, k_max: int) -> list[SampleResult]:
    """Unpacks `sample`'s transfer: draws (N), accepted (R), then with log-probabilities the
    emitted tokens' (N) and ranks (N), and the top-k_max ids and values (N x k_max each)."""
    n, rows = batch.row_starts[-1], batch.num_rows
    draws, accepted = host[:n], host[n : n + rows]
    chosen = host[n + rows : 2 * n + rows]
    ranks = host[2 * n + rows : 3 * n + rows]
    top_ids = host[3 * n + rows : (3 + k_max) * n + rows]
    top_vals = host[(3 + k_max) * n + rows :]
    results = []
    for row, want in enumerate(batch.logprobs):
        positions = range(batch.row_starts[row], batch.row_starts[row] + int(accepted[row]) + 1)
        tokens = tuple(int(draws[i]) for i in positions)
        if want is None:
            results.append(SampleResult(tokens, None))
            continue
        lps = []
        for i, token in zip(positions, tokens, strict=True):
            lp = {token: chosen[i]}
            top = slice(i * k_max, i * k_max + want)
            lp.update(zip(map(int, top_ids[top]), top_vals[top], strict=True))
            lps.append(lp)
        results.append(SampleResult(tokens, tuple(lps), tuple(int(ranks[i]) for i in positions)))
    return results


def filter_ref(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The oracle of `filter_logits` for one row: (V,) logits -> temperature-scaled logits with
    min-p, top-k and top-p cuts to -inf (params not greedy)."""
    logits = logits / params.temperature
    if params.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), -torch.inf)
    if params.top_k != -1 and params.top_k < logits.numel():
        kth = logits.topk(params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p, and the first token always.
        drop = probs.cumsum(-1) - probs >= params.top_p
        drop[0] = False
        logits = logits.scatter(0, order[drop], -torch.inf)
    return logits
