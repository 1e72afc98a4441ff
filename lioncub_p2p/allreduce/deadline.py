"""When a reducer stops waiting for votes: adaptive, from the arrival times it observed."""
from __future__ import annotations

import statistics
from collections import deque

from .partition import quorum


class AdaptiveDeadline:
    """Wait for every vote, but once a quorum (more than half of the group) is in, wait at most a
    grace period learned from recent rounds.

    The grace is ``margin`` times the 90th percentile of the recent *spreads* (time from the quorum
    to the last vote, in rounds where every vote arrived), but at most ``pace_share`` of the group's
    own pace (the median time between the quorums of consecutive rounds) but never below ``pace_floor``
    (lateness of a fraction of a second is a busy host's scheduling, not a slow link: a group stepping
    every 0.1 s would otherwise leave out whichever peer the CPU served last), clamped to [min_grace,
    max_grace]. Normal jitter keeps every peer counted. Without the pace cap a peer that is always
    equally late would teach the spreads its own lateness and set everybody's pace. The pace itself
    includes what the group waited, so with a share of 1/2 a peer is waited for only while its
    lateness is below the group's own step: one that would more than double everybody's step is left
    out of the count (it applies the same result when it arrives, and soon follows: ``punctuality.py``,
    ``swarm/follow.py``)."""

    def __init__(self, *, min_grace: float = 0.05, max_grace: float = 2.0, initial_grace: float = 1.0,
                 margin: float = 2.0, window: int = 32, pace_share: float = 0.5,
                 pace_floor: float = 0.2):
        if not 0 <= min_grace <= max_grace:
            raise ValueError("need 0 <= min_grace <= max_grace")
        self.min_grace, self.max_grace, self.margin = min_grace, max_grace, margin
        self.initial_grace = initial_grace
        self.spreads: deque[float] = deque(maxlen=window)
        self.pace_share, self.pace_floor = pace_share, pace_floor
        self.intervals: deque[float] = deque(maxlen=window)  # between consecutive rounds' quorums
        self._last_quorum: float | None = None

    @staticmethod
    def quorum(group_size: int) -> int:
        return quorum(group_size)

    def grace(self) -> float:
        if len(self.spreads) < 3:
            return min(max(self.initial_grace, self.min_grace), self.max_grace)
        p90 = statistics.quantiles(self.spreads, n=10)[-1] if len(self.spreads) >= 2 else self.spreads[0]
        grace = self.margin * p90
        cap = self._pace_cap()
        if cap is not None:
            grace = min(grace, cap)
        return min(max(grace, self.min_grace), self.max_grace)

    def probe_grace(self) -> float:
        """The longest this deadline waits for anyone at the group's pace: a probe round's wait for
        members not otherwise waited for (``punctuality.py``)."""
        cap = self._pace_cap()
        return self.grace() if cap is None else min(max(self.grace(), cap), self.max_grace)

    def _pace_cap(self) -> float | None:
        """``pace_share`` of the group's pace, at least ``pace_floor``; None before 3 intervals."""
        if len(self.intervals) < 3:
            return None
        return max(self.pace_share * statistics.median(self.intervals), self.pace_floor)

    def observe(self, spread: float | None, quorum_at: float | None = None) -> None:
        """Record a round: the quorum-to-last-vote time, or None if some vote never came; and when
        its quorum was in (``time.perf_counter``), for the group's pace."""
        if spread is not None:
            self.spreads.append(max(spread, 0.0))
        if quorum_at is not None:
            if self._last_quorum is not None and quorum_at > self._last_quorum:
                self.intervals.append(quorum_at - self._last_quorum)
            self._last_quorum = quorum_at
