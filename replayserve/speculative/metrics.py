"""Speculative-decoding counters: drafts proposed, drafts accepted, acceptance per position."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecMetrics:
    num_drafts: int = 0  # verify rows
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0  # accepted drafts (bonus tokens not counted)
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, drafted: dict[str, int], kept: dict[str, int]) -> None:
        """drafted: drafts per verify row; kept: tokens each sampling row emitted (accepted + 1)."""
        for request_id, k in drafted.items():
            accepted = kept[request_id] - 1
            self.num_drafts += 1
            self.num_draft_tokens += k
            self.num_accepted_tokens += accepted
            if len(self.accepted_per_position) < k:
                self.accepted_per_position += [0] * (k - len(self.accepted_per_position))
            for i in range(accepted):
                self.accepted_per_position[i] += 1

    def as_dict(self) -> dict[str, object]:
        rate = self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
        return {"spec_num_drafts": self.num_drafts, "spec_num_draft_tokens": self.num_draft_tokens,
                "spec_num_accepted_tokens": self.num_accepted_tokens, "spec_acceptance_rate": rate,
                "spec_accepted_per_position": list(self.accepted_per_position)}
