"""Which voters a reducer no longer waits for: members whose votes miss its deadline round after round.

A reducer finalizes a part when every vote is in, or a grace period after the quorum. A member
whose link or compute cannot deliver a vote per group step (a volunteer on a 1 Mbit/s uplink among
100 Mbit/s ones) would otherwise cost every round that grace. After ``late_after`` rounds in a row in
which a member was not counted, the reducer stops waiting for it (its vote still counts whenever it
is complete before the part closes); it is waited for again once it was counted in
``on_time_after`` rounds in a row (one by default: an excused voter is counted only when it beats
the others, so a caught-up peer must not need a run of such luck to be waited for again). Such a
peer soon stops voting and follows (``swarm/follow.py``).

Every ``PROBE_EVERY``-th step's vote round is a **probe round**: followers vote in it, and once the
others are in, reducers wait for the excused a while longer: until the quorum's time plus the
longest their deadline ever waits for anyone at the group's pace (half its step,
``AdaptiveDeadline.probe_grace``). Without it an excused follower was counted only when its vote beat
every awaited voter's: a follower that lags the group by a fraction of a second at the group's own
pace never does, and followed for the rest of the run. Each wait lets it gain that much; the group
pays about the follower's lag once. A member that really is too slow (or gone, until the group drops
it) would cost that wait every ``PROBE_EVERY`` rounds, so after 4 probes in a row without its vote a
reducer waits for it only when its count of missed probes is a power of two (4, 8, 16, ...): a
handful of waits a run. A probe's late arrivals do not teach the deadline's spreads (they are the
lateness the pace cap keeps out).

Pure bookkeeping, owned by the event loop's thread: no network, bounded by the group's size.
"""
from __future__ import annotations

from collections.abc import Iterable

from .round import RoundSpec


PROBE_EVERY = 4


def probe_step(step: int) -> bool:
    """Whether followers vote in this step's vote round."""
    return step % PROBE_EVERY == 0


def probe_round(spec: RoundSpec) -> bool:
    """Whether this round waits a while for excused members: a probe step's vote round (not its
    momentum or second-level rounds: followers never vote in those)."""
    return probe_step(spec.step) and spec.family in ("vote", "")


class Punctuality:
    def __init__(self, *, late_after: int = 3, on_time_after: int = 1):
        if late_after < 1 or on_time_after < 1:
            raise ValueError("late_after and on_time_after must be at least 1")
        self.late_after, self.on_time_after = late_after, on_time_after
        self._missed: dict[str, int] = {}  # rounds in a row not counted
        self._counted: dict[str, int] = {}  # rounds in a row counted
        self._late: set[str] = set()
        self._probes_missed: dict[str, int] = {}  # probe rounds in a row a late member was not counted in

    def observe(self, counted: Iterable[str], expected: Iterable[str], *, probe: bool = False) -> None:
        """One finalized part: ``expected`` the members it could have counted (not the reducer
        itself), ``counted`` those whose whole vote was in; ``probe``: a probe round. Members not
        expected are forgotten."""
        counted, expected = set(counted), set(expected)
        for table in (self._missed, self._counted, self._probes_missed):
            for pid in [p for p in table if p not in expected]:
                del table[pid]
        self._late &= expected
        if probe:
            for pid in self._late:
                self._probes_missed[pid] = 0 if pid in counted else self._probes_missed.get(pid, 0) + 1
        for pid in expected:
            if pid in counted:
                self._missed[pid] = 0
                self._counted[pid] = self._counted.get(pid, 0) + 1
                if self._counted[pid] >= self.on_time_after:
                    self._late.discard(pid)
                    self._probes_missed.pop(pid, None)
            else:
                self._counted[pid] = 0
                self._missed[pid] = self._missed.get(pid, 0) + 1
                if self._missed[pid] >= self.late_after:
                    self._late.add(pid)

    def late(self) -> frozenset[str]:
        """Members not waited for."""
        return frozenset(self._late)

    def probed(self) -> frozenset[str]:
        """Late members a probe round waits for: each until it missed 4 probes in a row, then only when
        its count of missed probes is a power of two."""
        return frozenset(p for p in self._late if (m := self._probes_missed.get(p, 0)) < 4 or not m & (m - 1))
