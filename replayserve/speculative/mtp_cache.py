"""Which MTP cache row each request holds, and which of its positions that row's ring holds valid:
the host side of `models/mtp_kv.MTPKV`, so a proposer call runs the MTP layers only on the
positions that are new since the last (the tokens the last step accepted, plus the drafts).

A position p's keys and values depend on the target's hidden state at p and the token at p + 1
alone (with one attention block, as every checkpoint has; with more, also on the earlier positions
of the window the call saw), so an entry stays valid until the hidden store re-records p
(`HiddenStore.take_rewrite`: a recompute after preemption, a request restarted under the same id).
Rejected drafts need no rollback: a call commits up to the last computed position only, and the
next call writes the positions after it again (a cursor move, like the rest of the engine).

The ring holds `window + max_drafts` positions per row: a call needs the window's positions
(lo .. last) and writes its drafts' after them, all at distinct ring indices.
"""

from __future__ import annotations

from typing import NamedTuple


class RowPlan(NamedTuple):
    """A request's part in a call: its cache row, the first position the call must run (the ones
    before, down to lo, are in the ring) and lo, the lowest position its queries see."""

    row: int
    first: int
    lo: int


class CacheRows:
    """Cache rows 0 .. rows - 1 handed to requests, with each row's valid positions [low, high)."""

    def __init__(self, rows: int, ring: int, window: int) -> None:
        if ring < window + 1:
            raise ValueError(f"an MTP cache ring of {ring} positions cannot hold a window of {window} and a draft")
        self.ring, self.window = ring, window
        self.rows: dict[str, int] = {}
        self.free = list(range(rows - 1, -1, -1))
        self.valid: dict[int, tuple[int, int]] = {}  # row -> (low, high)

    def release_except(self, live: set[str] | dict) -> None:
        """Frees the rows of requests not in `live` (finished: the hidden store forgot them)."""
        for request_id in [r for r in self.rows if r not in live]:
            row = self.rows.pop(request_id)
            self.valid.pop(row, None)
            self.free.append(row)

    def plan(self, request_id: str, run_start: int, last: int, rewrite: int | None) -> RowPlan | None:
        """The positions a call must run for a request whose last computed position is `last` and
        whose recorded hidden states start at `run_start`; `rewrite`: the first re-recorded position
        since the last call (None: none). None when no row is free."""
        row = self.rows.get(request_id)
        if row is None:
            if not self.free:
                return None
            row = self.rows[request_id] = self.free.pop()
        lo = max(run_start, last - self.window + 1)
        low, high = self.valid.get(row, (lo, lo))
        if rewrite is not None:
            high = min(high, rewrite)
        high = min(high, last)  # the last position always runs: its output starts the drafts
        if lo < low or high < lo:  # the ring lacks some of lo .. high - 1: run them all again
            low = high = lo
        # Nothing below lo is read again unless the window moves back, which runs it again: so a
        # call that stops half-way (an error) leaves no entry it overwrote marked valid.
        self.valid[row] = (lo, high)
        return RowPlan(row, high, lo)

    def commit(self, request_id: str, last: int, drafts: int) -> None:
        """After a call that ran up to `last` and wrote `drafts` draft positions after it: the
        positions up to `last` are valid, the drafts' are not (they are verified, then run again),
        and those whose ring entries the call overwrote are gone."""
        row = self.rows[request_id]
        low, _ = self.valid[row]
        self.valid[row] = (max(low, last + drafts - self.ring), last + 1)
