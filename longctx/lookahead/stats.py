"""Lookahead statistics: how much was drafted and accepted, per request and overall.

Owns: the counters and the ratios derived from them. Never: torch, or deciding anything from
them (the engine may, e.g. to shrink drafts that are rarely accepted).

A step is one verify pass of one request. It drafts ``len(tree)`` tokens, accepts
``num_accepted`` of them and always emits one more (the bonus token), so a request that ran
``num_steps`` steps emitted ``num_accepted + num_steps`` tokens (before stop rules cut any).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass


@dataclass
class LookaheadStats:
    num_steps: int = 0
    num_drafted: int = 0
    num_accepted: int = 0

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """Count one step that drafted ``num_drafted`` tokens and accepted ``num_accepted``."""
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError(f"a step accepts between 0 and the {num_drafted} drafted tokens, "
                             f"got {num_accepted}")
        self.num_steps += 1
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted

    @property
    def mean_accepted_per_step(self) -> float:
        """Draft tokens accepted per verify step (0 before any step)."""
        return self.num_accepted / self.num_steps if self.num_steps else 0.0

    @property
    def mean_tokens_per_step(self) -> float:
        """Tokens emitted per verify step, bonus included: plain decoding's is 1."""
        return (self.num_accepted + self.num_steps) / self.num_steps if self.num_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted over drafted tokens (0 before anything was drafted)."""
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"num_steps": self.num_steps, "num_drafted": self.num_drafted,
                "num_accepted": self.num_accepted,
                "mean_accepted_per_step": self.mean_accepted_per_step,
                "mean_tokens_per_step": self.mean_tokens_per_step,
                "acceptance_rate": self.acceptance_rate}


class LookaheadStatsTracker:
    """Stats of running requests, and the total over every step ever recorded."""

    def __init__(self) -> None:
        self.overall = LookaheadStats()
        self._requests: dict[Hashable, LookaheadStats] = {}

    def record(self, request_id: Hashable, num_drafted: int, num_accepted: int) -> None:
        self._requests.setdefault(request_id, LookaheadStats()).record(num_drafted, num_accepted)
        self.overall.record(num_drafted, num_accepted)

    def of(self, request_id: Hashable) -> LookaheadStats:
        """A running request's stats (zeros if it has recorded nothing)."""
        return self._requests.get(request_id, LookaheadStats())

    def finish(self, request_id: Hashable) -> LookaheadStats:
        """Forget a finished request and return its stats (they stay in ``overall``)."""
        return self._requests.pop(request_id, LookaheadStats())
