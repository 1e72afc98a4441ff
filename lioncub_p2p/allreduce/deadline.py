"""When a reducer stops waiting for votes: adaptive, from the arrival times it observed."""
from __future__ import annotations

import statistics
from collections import deque

from .partition import quorum


class AdaptiveDeadline:
    """Wait for every vote, but once a quorum (more than half of the group) is in, wait at most a
    grace period learned from recent rounds.

    The grace is ``margin`` times the 90th percentile of the recent *spreads* (time from the quorum
    to the last vote, in rounds where every vote arrived), clamped to [min_grace, max_grace]. Normal
    jitter keeps every peer counted; a peer that is persistently slower than that stops holding the
    others back: it is left out of the count and applies the same result when it arrives."""

    def __init__(self, *, min_grace: float = 0.05, max_grace: float = 2.0, initial_grace: float = 1.0,
                 margin: float = 2.0, window: int = 32):
        if not 0 <= min_grace <= max_grace:
            raise ValueError("need 0 <= min_grace <= max_grace")
        self.min_grace, self.max_grace, self.margin = min_grace, max_grace, margin
        self.initial_grace = initial_grace
        self.spreads: deque[float] = deque(maxlen=window)

    @staticmethod
    def quorum(group_size: int) -> int:
        return quorum(group_size)

    def grace(self) -> float:
        if len(self.spreads) < 3:
            return min(max(self.initial_grace, self.min_grace), self.max_grace)
        p90 = statistics.quantiles(self.spreads, n=10)[-1] if len(self.spreads) >= 2 else self.spreads[0]
        return min(max(self.margin * p90, self.min_grace), self.max_grace)

    def observe(self, spread: float | None) -> None:
        """Record a round: the quorum-to-last-vote time, or None if some vote never came."""
        if spread is not None:
            self.spreads.append(max(spread, 0.0))
