"""The engine's requests with a grammar (`SamplingParams.structured_outputs`): their compilation,
their drafts, each step's token masks and the tokens they accept.

Per step, for the engine (`engine/engine.py`):
- `compiled`: requests whose grammar has compiled go to the scheduler (they waited beside it);
- `cut_drafts`: a constrained row verifies only the drafts its grammar allows (none while it
  reasons), so every position of a verify has a mask; rows without drafts leave their matchers
  to the fill;
- `masks`: a callable the runner calls once the forward is queued, so the masks are filled on the
  host while the device runs: one bitmask row per position of each constrained sampling row (a
  verify's positions by advancing the matcher over the drafts, then rolling it back);
- `accept_all`: the tokens kept advance the matcher; a grammar that ends (its stop token) ends the
  request with "stop", and a failed step's `take_back` rolls the matchers back with the output. A
  masked row's one token is checked against its mask and reaches the matcher at the next fill,
  so that accept, too, runs while the device computes.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from replayserve.engine.request import Request
from replayserve.ops.token_bitmask import TokenMask
from replayserve.structured.compiler import GrammarCompiler
from replayserve.structured.request_grammar import GrammarViolation, RequestGrammar
from replayserve.tokenizer import Tokenizer

if TYPE_CHECKING:
    import xgrammar

    from replayserve.engine.scheduler import StepPlan

logger = logging.getLogger(__name__)


class Grammars:
    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, stop_token_ids: Sequence[int],
                 pin_memory: bool = False) -> None:
        """vocab_size: the model's (the width of its logits); stop_token_ids: its EOS ids;
        pin_memory: the masks go to a CUDA device (their buffer is pinned, so the copy is asynchronous)."""
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = tuple(stop_token_ids)
        self._pin_memory = pin_memory
        self._compiler: GrammarCompiler | None = None  # made by the first constrained request
        self._batch = None  # xgrammar.BatchGrammarMatcher: fills a step's masks on several threads
        # Every step's masks are filled into this (rows, ceil(V / 32)) int32 buffer, grown to the
        # most positions a step has masked: a fresh 4 MB tensor per step at 256 rows of a 131072-token
        # vocabulary, and on CUDA its copy into pinned memory, cost the host time outside the fill.
        self._bitmask: torch.Tensor | None = None
        # Depth 0's bitmask row of each grammar the step's fill masked: `accept_all` reads whether
        # a row's token was allowed there, so its matcher can take the token later.
        self._mask_rows: dict[RequestGrammar, int] = {}
        # (grammar, token): one-token accepts the matchers take at the next fill, which runs while
        # the device computes the forward, not between the step's sync and the next launch.
        self._pending: list[tuple[RequestGrammar, int]] = []
        self._grammars: dict[str, RequestGrammar] = {}  # by request id
        self._compiling: dict[str, Request] = {}

    def __len__(self) -> int:
        """Requests with a grammar (compiled or compiling)."""
        return len(self._grammars)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._grammars

    def add(self, request: Request) -> None:
        """Starts compiling the request's grammar; `compiled` hands it back once done."""
        so = request.params.structured_outputs
        assert so is not None and self._tokenizer is not None, "validation refuses a grammar without a tokenizer"
        if self._compiler is None:
            self._compiler = GrammarCompiler(self._tokenizer, self._vocab_size, self._stop_token_ids)
        prompt = "" if so.reasoning_markers is None else self._decode(request.prompt_token_ids)
        self._grammars[request.request_id] = RequestGrammar(self._compiler.submit(so), so.reasoning_markers, prompt)
        self._compiling[request.request_id] = request

    def compiled(self, block: bool) -> tuple[list[Request], list[tuple[Request, BaseException]]]:
        """Requests whose grammar has compiled since the last call, and those whose compilation
        failed (with why). block: wait until at least one is done (nothing else can run)."""
        if not self._compiling:
            return [], []
        if block:
            concurrent.futures.wait([self._grammars[i].compiled for i in self._compiling],
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        ready: list[Request] = []
        failed: list[tuple[Request, BaseException]] = []
        for request_id, request in list(self._compiling.items()):
            grammar = self._grammars[request_id]
            if not grammar.compiled.done():
                continue
            del self._compiling[request_id]
            if (error := grammar.compiled.exception()) is not None:
                logger.error("request %s: its grammar did not compile: %s", request_id, error)
                failed.append((request, error))
                continue
            grammar.start_matching()
            ready.append(request)
        return ready, failed

    def cut_drafts(self, drafts: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """``drafts`` with each constrained row's cut to what its grammar allows. Only the rows
        with drafts read their matchers here, so only their last tokens are handed over now; the
        others' wait for the fill, which the device's forward hides."""
        drafting = {request_id: grammar for request_id, proposed in drafts.items()
                    if proposed and (grammar := self._grammars.get(request_id)) is not None}
        self._hand_over(set(drafting.values()))
        out = dict(drafts)
        for request_id, grammar in drafting.items():
            out[request_id] = drafts[request_id][: grammar.valid_drafts(drafts[request_id])]
        return out

    def masks(self, plan: StepPlan, sampling: Sequence[Request]) -> Callable[[], TokenMask | None] | None:
        """The step's token masks, found and filled when called (None then: no sampling row is
        constrained now; None at once: no request has a grammar). sampling: the requests of the
        plan's sampling rows, in plan order."""
        self._mask_rows = {}
        return functools.partial(self._fill, plan, sampling) if self._grammars else None

    def _fill(self, plan: StepPlan, sampling: Sequence[Request]) -> TokenMask | None:
        """Masks of every position of the constrained rows: depth d of a row is its matcher after
        its first d drafts. Positions after a draft the grammar refuses or after its end allow
        every token (verification never emits them). The last step's tokens reach their matchers
        first."""
        self._hand_over()
        rows: list[tuple[RequestGrammar, int, tuple[int, ...]]] = []  # grammar, first position, drafts
        position = 0
        for seq, request in zip((s for s in plan.seqs if s.sample), sampling, strict=True):
            grammar = self._grammars.get(request.request_id)
            if grammar is not None and grammar.active:
                rows.append((grammar, position, seq.token_ids[len(seq.token_ids) - seq.num_drafts :]))
            position += 1 + seq.num_drafts
        if not rows:
            return None
        firsts = []
        positions: list[int] = []
        for _, first, drafts in rows:
            firsts.append(len(positions))
            positions += range(first, first + 1 + len(drafts))
        bitmask = self._bitmask_rows(len(positions))
        self._mask_rows = {grammar: row for (grammar, _, _), row in zip(rows, firsts, strict=True)}
        advanced = [0] * len(rows)
        live = list(range(len(rows)))
        try:
            for depth in range(1 + max(len(drafts) for _, _, drafts in rows)):
                live = [i for i in live if len(rows[i][2]) >= depth]
                if not live:
                    break
                self._batch_matcher().batch_fill_next_token_bitmask([rows[i][0].matcher for i in live], bitmask,
                                                          [firsts[i] + depth for i in live])
                going = []
                for i in live:
                    grammar, _, drafts = rows[i]
                    if depth < len(drafts) and grammar.matcher.accept_token(drafts[depth]):
                        advanced[i] += 1
                        if not grammar.matcher.is_terminated():
                            going.append(i)
                live = going
        finally:  # the matchers stay where the output is, whatever happens
            for (grammar, _, _), n in zip(rows, advanced, strict=True):
                if n:
                    grammar.matcher.rollback(n)
        return TokenMask(bitmask, tuple(positions))

    def _bitmask_rows(self, n: int) -> torch.Tensor:
        """The first n rows of the mask buffer, every token allowed (rows a fill skips stay so).
        Reusing it is safe because a fill comes after the tokens of the last masked step were read
        (synchronously, or with async scheduling after `Engine._complete_launched` collected them),
        and its copy to the device was queued before that step's sampling."""
        import xgrammar as xgr

        if self._bitmask is None or self._bitmask.shape[0] < n:
            self._bitmask = xgr.allocate_token_bitmask(n, self._vocab_size)
            if self._pin_memory:
                self._bitmask = self._bitmask.pin_memory()
        return self._bitmask[:n].fill_(-1)

    def accept_all(self, requests: Sequence[Request], tokens: Sequence[Sequence[int]]) -> list[int | None]:
        """Each constrained request's grammar advances over the tokens a step appends to its
        output: how many of them to keep when it ended (then the request stops), else None (None
        too for a request without a grammar). Called before any output grows. A refused token
        raises GrammarViolation once every other row has taken its token (a failed step's
        take-back rolls each back).

        Rows of one token past their reasoning that the step masked are checked against their
        mask (xgrammar's is exact: a token is allowed iff the matcher accepts it) and handed to
        the matchers at the next fill, on the host time the forward hides: their accepts are most
        of a large constrained batch's exposed host time. Such a token cannot end the grammar
        unless it is a stop token; those, and other one-token rows, go to the matchers now,
        together on xgrammar's batched accept."""
        self._hand_over()  # tokens of a step no fill followed (none when each step masks)
        masked, self._mask_rows = self._mask_rows, {}
        kept: list[int | None] = [None] * len(requests)
        now: list[tuple[int, RequestGrammar]] = []
        later: list[tuple[int, RequestGrammar, int]] = []  # row, grammar, its bitmask row
        for i, (request, new) in enumerate(zip(requests, tokens, strict=True)):
            grammar = self._grammars.get(request.request_id)
            if grammar is None:
                continue
            if not grammar.takes_one(new):
                kept[i] = grammar.accept(request.output_token_ids, new, self._decode)
            elif (row := masked.get(grammar)) is not None and new[0] not in grammar.stop_token_ids:
                later.append((i, grammar, row))
            else:
                now.append((i, grammar))
        took = (self._batch_matcher().batch_accept_token([g.matcher for _, g in now], [tokens[i][0] for i, _ in now])
                if now else [])
        allowed = self._allowed([row for _, _, row in later], [tokens[i][0] for i, _, _ in later]) if later else []
        refused: GrammarViolation | None = None
        for (i, grammar), ok in zip(now, took, strict=True):
            try:
                kept[i] = grammar.accepted(ok, requests[i].output_token_ids, tokens[i][0])
            except GrammarViolation as e:
                refused = refused or e
        for (i, grammar, _), ok in zip(later, allowed, strict=True):
            try:
                grammar.accepted(ok, requests[i].output_token_ids, tokens[i][0], later=True)
                self._pending.append((grammar, tokens[i][0]))
            except GrammarViolation as e:
                refused = refused or e
        if refused is not None:
            raise refused
        return kept

    def _allowed(self, rows: list[int], tokens: list[int]) -> list[bool]:
        """Whether bitmask row rows[i] of the last fill allows tokens[i]."""
        assert self._bitmask is not None
        t = torch.tensor(tokens)
        words = self._bitmask[torch.tensor(rows), t >> 5]
        return ((words >> (t & 31)) & 1).bool().tolist()

    def _hand_over(self, only: set[RequestGrammar] | None = None) -> None:
        """The matchers (those in `only` where given) take the tokens `accept_all` checked against
        their masks. One they refuse means xgrammar's mask and matcher disagree: GrammarViolation
        (the output has the token)."""
        if only is None:
            pending, self._pending = self._pending, []
        else:
            pending = [(g, t) for g, t in self._pending if g in only]
            self._pending = [(g, t) for g, t in self._pending if g not in only]
        if not pending:
            return
        took = self._batch_matcher().batch_accept_token([g.matcher for g, _ in pending], [t for _, t in pending])
        refused = [t for (_, t), ok in zip(pending, took, strict=True) if not ok]
        if refused:
            raise GrammarViolation(f"tokens {refused} were allowed by their masks but refused by their grammars")

    def take_back(self, requests: Iterable[Request], lengths: Iterable[int]) -> None:
        """A failed step: each request's output goes back to its length, and its matcher with it."""
        self._mask_rows = {}
        self._hand_over()
        for request, length in zip(requests, lengths, strict=True):
            grammar = self._grammars.get(request.request_id)
            if grammar is not None:
                grammar.take_back(length)

    def forget(self, request_id: str) -> None:
        grammar = self._grammars.pop(request_id, None)
        self._pending = [(g, t) for g, t in self._pending if g is not grammar]  # a token no matcher needs now
        self._compiling.pop(request_id, None)

    def _batch_matcher(self) -> xgrammar.BatchGrammarMatcher:
        if self._batch is None:
            import xgrammar as xgr

            self._batch = xgr.BatchGrammarMatcher()
        return self._batch

    def _decode(self, ids: list[int]) -> str:
        assert self._tokenizer is not None
        return self._tokenizer.decode(ids, skip_special_tokens=False)
