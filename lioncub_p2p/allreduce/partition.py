"""Who reduces which bytes: a pure function of the group, identical on every peer."""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

ALIGN = 8  # parts start on 64-bit words so reducers count on whole words
# A weight is its owner's claim (its upload rate, say). Believed as announced, one member claiming 1e6
# reduced the whole buffer of a group of five, so every vote passed through it. Parts follow weights only
# up to this multiple of the group's lower median: a fast uplink still takes a larger part, a claim cannot
# take the round.
MAX_OVER_MEDIAN = 4.0


def quorum(voters: int) -> int:
    """Votes a part's result must count to be applied: more than half of the group's expected voters."""
    return voters // 2 + 1


@dataclass(frozen=True)
class PeerSpec:
    """One member of a round's group.

    ``weight`` is the peer's share of the reduction work (its bandwidth, in any unit); a peer in
    ``client_mode`` (behind NAT, dials out only) or with weight 0 reduces nothing but still votes.
    ``voter``: the group expects its vote in time; False for a member whose link cannot keep the
    group's pace (it follows, or is on probation after a drop): its votes count when they come in
    time (reducers give it the usual grace after the quorum), but the quorum is a majority of the
    expected voters alone (else a group of two with a follower would have no result but on its
    probe rounds)."""

    peer_id: str
    weight: float = 1.0
    client_mode: bool = False
    voter: bool = True

    def __post_init__(self) -> None:
        if not self.weight >= 0.0:
            raise ValueError(f"peer {self.peer_id}: weight must be >= 0, got {self.weight}")

    @property
    def reduces(self) -> bool:
        return not self.client_mode and self.weight > 0


def bounded_weights(group: Sequence[PeerSpec]) -> list[float]:
    """Each member's share of the reduction, bounded: 0 for non-reducers; else its weight, at most
    ``MAX_OVER_MEDIAN`` times the lower median of the reducers' weights, and with three reducers or
    more at most the others' sum (no member reduces most of the buffer)."""
    weights = [p.weight if p.reduces else 0.0 for p in group]
    reducing = [w for w in weights if w > 0]
    if not reducing:
        return weights
    capped = [min(w, MAX_OVER_MEDIAN * statistics.median_low(reducing)) for w in weights]
    if len(reducing) >= 3:
        total = sum(capped)
        capped = [min(w, total - w) for w in capped]  # only the largest can exceed the others' sum
    return capped


def part_bounds(nbytes: int, group: Sequence[PeerSpec]) -> list[tuple[int, int]]:
    """Byte range [start, stop) of the buffer that each group member reduces, in group order.

    Sizes follow the reducing members' ``bounded_weights`` (within ALIGN bytes); every start is a
    multiple of ALIGN; ranges are contiguous and cover [0, nbytes); non-reducers get empty ranges."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    weights = bounded_weights(group)
    total = sum(weights)
    if total <= 0:
        raise ValueError("the group has no reducer: every peer is in client mode or has weight 0")
    bounds, cumulative, start = [], 0.0, 0
    last = max(i for i, w in enumerate(weights) if w > 0)
    for i, w in enumerate(weights):
        cumulative += w
        stop = nbytes if i == last else min(nbytes, int(nbytes * cumulative / total) // ALIGN * ALIGN)
        stop = max(stop, start) if w > 0 else start
        bounds.append((start, stop))
        start = stop
    return bounds
