"""Which voters a reducer no longer waits for: members whose votes miss its deadline round after round.

A reducer finalizes a part when every vote is in, or a grace period after the quorum. A member
whose link or compute cannot deliver a vote per group step (a volunteer on a 1 Mbit/s uplink among
100 Mbit/s ones) would otherwise cost every round that grace. After ``late_after`` rounds in a row in
which a member was not counted, the reducer stops waiting for it (its vote still counts whenever it
is complete before the part closes); it is waited for again once it was counted in
``on_time_after`` rounds in a row (one by default: an excused voter is counted only when it beats
the others, so a caught-up peer must not need a run of such luck to be waited for again). Such a
peer soon stops voting and follows (``swarm/follow.py``).

Pure bookkeeping, owned by the event loop's thread: no network, bounded by the group's size.
"""
from __future__ import annotations

from collections.abc import Iterable


class Punctuality:
    def __init__(self, *, late_after: int = 3, on_time_after: int = 1):
        if late_after < 1 or on_time_after < 1:
            raise ValueError("late_after and on_time_after must be at least 1")
        self.late_after, self.on_time_after = late_after, on_time_after
        self._missed: dict[str, int] = {}  # rounds in a row not counted
        self._counted: dict[str, int] = {}  # rounds in a row counted
        self._late: set[str] = set()

    def observe(self, counted: Iterable[str], expected: Iterable[str]) -> None:
        """One finalized part: ``expected`` the members it could have counted (not the reducer
        itself), ``counted`` those whose whole vote was in. Members not expected are forgotten."""
        counted, expected = set(counted), set(expected)
        for table in (self._missed, self._counted):
            for pid in [p for p in table if p not in expected]:
                del table[pid]
        self._late &= expected
        for pid in expected:
            if pid in counted:
                self._missed[pid] = 0
                self._counted[pid] = self._counted.get(pid, 0) + 1
                if self._counted[pid] >= self.on_time_after:
                    self._late.discard(pid)
            else:
                self._counted[pid] = 0
                self._missed[pid] = self._missed.get(pid, 0) + 1
                if self._missed[pid] >= self.late_after:
                    self._late.add(pid)

    def late(self) -> frozenset[str]:
        """Members not waited for."""
        return frozenset(self._late)
