"""What a peer keeps of the rounds it has finished, for requests that come late.

A round leaves a peer's table of live rounds after ``keep_rounds`` newer ones (a fast swarm does
that in a fraction of a second), but two kinds of request may come later than that:

* an **audit** of the part this peer reduced: an auditor whose queue or link is slow, or who got the
  result late, still asks within the window below, and must be answered (a refusal then counts
  against this peer as a reducer that cannot back its result);
* a **result request** (``lioncub/fetch/1``) from a member that missed a part: a late voter whose
  reducer had already moved on, or a newcomer that loaded a state a few steps behind the group.

The promise, stated in docs/protocol.md ("Audits"): a reducer keeps the votes and Merkle trees of a
part it reduced for at least ``window`` seconds after it last sent that part's result to anyone
(on a vote stream, or forwarded from here); a member keeps the signed results it holds as long.
Memory is bounded by ``max_bytes`` over all kept rounds; past that the oldest go first, with a
warning, since that shortens the window (it takes more than ``max_bytes / window`` of kept votes and
results per second: 8.5 MiB/s with the defaults).
"""
from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from .reducer import PartReduction
from .round import PartResult, RoundSpec

logger = logging.getLogger(__name__)
WARN_EVERY_S = 60.0
# A member's refusal of a result request for a round it finished and no longer keeps: the group moved on
# past that round. A follower every member answers so skips ahead (``swarm/follow.py``).
FORGOTTEN = "round no longer kept here"
KEPT_ROUND_BYTES = 512  # what a kept round costs besides its results and votes (its spec, the table entry)


@dataclass
class KeptRound:
    spec: RoundSpec
    results: dict[int, PartResult] = field(default_factory=dict)  # signed results this peer holds, by part
    reduction: PartReduction | None = None  # the part this peer reduced, with its votes and trees (audits)
    until: float = 0.0  # monotonic time until which it is kept
    nbytes: int = 0


def reduction_bytes(reduction: PartReduction | None) -> int:
    if reduction is None:
        return 0
    trees = sum(32 * len(level) for tree in reduction.trees.values() for level in tree.levels)
    return sum(votes.nbytes for votes in reduction.votes.values()) + trees


class RoundArchive:
    """Finished rounds by round id, each kept ``window`` seconds after it was archived or last served."""

    def __init__(self, window: float, max_bytes: int):
        if window < 0 or max_bytes < 0:
            raise ValueError("need window >= 0 and max_bytes >= 0")
        self.window, self.max_bytes = window, max_bytes
        self._rounds: OrderedDict[bytes, KeptRound] = OrderedDict()  # oldest first (by archiving or serving)
        self.nbytes = 0
        self._members: Counter[str] = Counter()  # kept rounds whose group lists each peer
        self.evicted_early = 0  # rounds dropped before their window ended, for lack of memory
        self._warned = -WARN_EVERY_S

    def __len__(self) -> int:
        return len(self._rounds)

    def __contains__(self, round_id: bytes) -> bool:
        return self.get(round_id) is not None

    def keep(self, spec: RoundSpec, results: dict[int, PartResult], reduction: PartReduction | None) -> None:
        """Archive a round leaving the live table: its signed results, and its reduction if it has a result.
        A round without any is kept too (``KEPT_ROUND_BYTES``): a late request then learns that the round
        failed here, not that it was forgotten (``FORGOTTEN``: a follower skips ahead on that)."""
        if reduction is not None and reduction.outcome is None:
            reduction = None  # no result: nothing to audit
        results = {j: r for j, r in results.items() if r.signature}
        kept = KeptRound(spec, results, reduction, time.monotonic() + self.window, KEPT_ROUND_BYTES
                         + sum(len(r.wire) + len(r.header) for r in results.values()) + reduction_bytes(reduction))
        self._drop(spec.round_id)
        self._rounds[spec.round_id] = kept
        self.nbytes += kept.nbytes
        self._members.update(p.peer_id for p in spec.group)
        self._prune()

    def has_member(self, peer_id: str) -> bool:
        """Whether a kept round's group lists this peer: one behind the group recovers results of rounds
        that left the live table (``wire/gate.py`` must not cap it as a stranger)."""
        self._prune()
        return peer_id in self._members

    def get(self, round_id: bytes) -> KeptRound | None:
        self._prune()
        return self._rounds.get(round_id)

    def served(self, round_id: bytes) -> None:
        """A result of this round was sent again: the window starts over."""
        kept = self._rounds.get(round_id)
        if kept is not None:
            kept.until = time.monotonic() + self.window
            self._rounds.move_to_end(round_id)

    def _drop(self, round_id: bytes) -> None:
        kept = self._rounds.pop(round_id, None)
        if kept is not None:
            self.nbytes -= kept.nbytes
            self._members.subtract(p.peer_id for p in kept.spec.group)
            for p in kept.spec.group:
                if self._members[p.peer_id] <= 0:
                    del self._members[p.peer_id]

    def _prune(self) -> None:
        now = time.monotonic()
        for round_id in [rid for rid, kept in self._rounds.items() if kept.until <= now]:
            self._drop(round_id)
        while self.nbytes > self.max_bytes and self._rounds:
            round_id, kept = next(iter(self._rounds.items()))
            self._drop(round_id)
            self.evicted_early += 1
            if now - self._warned >= WARN_EVERY_S:
                self._warned = now
                logger.warning("finished rounds hold more than %d MiB: round %s dropped %.0f s before its audit "
                               "window ended (raise AllReduceConfig.audit_keep_bytes)", self.max_bytes >> 20,
                               round_id.hex()[:12], kept.until - now)
