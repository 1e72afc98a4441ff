"""When a peer votes, and when it only follows: receives each step's result without voting.

A peer whose link or compute cannot deliver a vote per group step sees it in its own rounds: the
reducers' signed results do not count it (its votes reached parts that had closed). After
``late_after`` such rounds in a row (one is a hiccup, and a rule that reacts to one feeds on itself
in a swarm under strain) voting only spends its uplink and the reducers' time, so it **follows**: each round it downloads the results
(each part once, from the reducer's archive first, ``VoteNode.follow_round``) and applies them, so
its parameters stay bitwise equal to the group's, checked by the same state digest as a voter's.
It announces ``following`` in its peer record: the leader keeps it in the group but gives it no part
to reduce, and reducers stop waiting for its votes (``allreduce/punctuality.py``).

In the group's probe rounds (every ``PROBE_EVERY``-th step, ``allreduce/punctuality.py``) it votes,
and the reducers wait a while for its vote (up to half the group's step after the quorum, with a
back-off for a member that never makes it): counted in at least half of the parts, it is a voter
again. A probe is cheap when the follower is still behind: reducers refuse a vote for a round
they closed at its first chunk. When it falls so far behind that nobody keeps its round any more (every
part missing, and at least half of the parts' reducers say they no longer keep the round), it **skips ahead**: it downloads the state of a peer past its step, as a repair does;
after three failed tries it stops with one line rather than train on zeros (``VotePipeline.skip_ahead``).
A peer whose training thread was held up (its node refused the group's rounds as held up) and finds
the group more than ``FAR_BEHIND_STEPS`` past it downloads the state at once instead of replaying
(``far_behind``): replayed rounds are served only while members keep them, each costs a round trip,
and a step it missed in its own part waited the upload timeout for votes that never came.

Owned by the training thread; pure, tested without a network.
"""
from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from ..allreduce import RoundReport
from ..allreduce.punctuality import probe_step

# Held-up peers only, once per stall (at most one download too many per stall). A download is 32 bits per
# parameter (fp32) in one transfer; a replayed step at least 1 bit and a round, whose parts wait for voters
# that moved on (1.9 s a step in a two-level group of 2, measured), and the members' records, announced every
# few seconds, understate their steps by tens at a tenth of a second a step (with 32 here, a hung peer
# replayed 9 steps at 1.9 s before its download)
FAR_BEHIND_STEPS = 10


def far_behind(step: int, member_steps: Iterable[int], limit: int = FAR_BEHIND_STEPS) -> int | None:
    """How many steps the group is past ``step``, when that is more than ``limit``; else None. From the
    steps the other members announce, their median: a lying minority can neither start a download nor
    hide the group's progress."""
    steps = list(member_steps)
    if not steps:
        return None
    ahead = statistics.median_low(steps) - step
    return ahead if ahead > limit else None


class FollowRule:
    def __init__(self, *, late_after: int = 2):
        if late_after < 1:
            raise ValueError("late_after must be at least 1")
        self.late_after = late_after
        self.following = False
        self.late = 0  # voted rounds in a row in which this peer's votes did not count
        self.rounds_followed = 0  # in all (metrics)

    def follow_next(self, step: int) -> bool:
        """Whether this step's round is received without voting (else this peer votes, maybe as a probe)."""
        return self.following and not probe_step(step)

    def after(self, report: RoundReport) -> None:
        """Learn from one finished vote round of this peer."""
        if report.followed:
            self.rounds_followed += 1
            return
        others = [p for p in report.parts if p.reducer != report.peer and p.status != "empty"]
        if others and all(p.status in ("ok", "recovered") for p in others):  # a disturbed round (a reducer
            # gone, a group change) says nothing about this peer's pace
            counted = sum(report.peer in p.counted for p in others)
            self.late = self.late + 1 if 2 * counted < len(others) else 0
            self.following = self.late >= (1 if self.following else self.late_after)  # a failed probe: go on

    @staticmethod
    def fell_out(report: RoundReport) -> bool:
        """A followed round of which nobody held any part any more (most parts' reducers said they no
        longer keep the round): skip ahead by downloading state. A round that failed for everyone
        (reducers below their quorum, a reducer gone) is missing here as at every voter: apply nothing,
        as they do. At least half, not one: a single lying reducer of three must not send a follower into
        a download (of two, it can, when the other part is missing too: a needless download, nothing
        worse); half, not most: a reducer that left says nothing, and a round of two reducers, one gone,
        must still let the follower skip ahead."""
        parts = [p for p in report.parts if p.status != "empty" and p.reducer != report.peer]
        return (report.followed and bool(parts) and all(p.status == "missing" for p in parts)
                and 2 * sum(p.forgotten for p in parts) >= len(parts))


@dataclass(frozen=True)
class LinkRole:
    role: str  # "voter" | "follower" | "behind"
    vote_s: float  # seconds to upload one step's votes
    result_s: float  # ... to download one step's results (plain, before deltas)
    line: str  # what preflight prints


def link_role(*, numel: int, peers: int, up_mbit: float, down_mbit: float, group_step_s: float | None,
              compute_s: float, slack: float = 1.5) -> LinkRole:
    """Which role a link puts a peer in, from its measured bandwidth and the group's pace.

    Per step a voter uploads (peers−1)/peers bit per parameter and downloads as much. It keeps up as a
    voter when its compute plus its votes, and its results, each fit in ``slack`` group steps
    (overlapped rounds hide one behind the other); as a follower when its compute and its results fit
    in one step (it keeps up, but its votes would come too late to count); else it falls behind and
    skips ahead by downloading the state now and then."""
    bits = numel * (peers - 1) / max(peers, 1)
    vote_s, result_s = bits / (up_mbit * 1e6), bits / (down_mbit * 1e6)
    figures = f"votes {vote_s:.2f} s up, results {result_s:.2f} s down, compute {compute_s:.2f} s per step"
    if group_step_s is None or max(compute_s + vote_s, result_s) <= slack * group_step_s:
        pace = f"the group steps every {group_step_s:.2f} s" if group_step_s else "nobody steps yet"
        return LinkRole("voter", vote_s, result_s, f"voter: {figures}; {pace}")
    if max(compute_s, result_s) <= group_step_s:
        return LinkRole("follower", vote_s, result_s,
                        f"follower: {figures}, the group steps every {group_step_s:.2f} s: your votes would come "
                        f"too late to count, so you will receive every result and vote only when you can")
    return LinkRole("behind", vote_s, result_s,
                    f"behind: {figures}, the group steps every {group_step_s:.2f} s: you cannot keep up and will "
                    f"skip ahead by downloading the state now and then; a run whose pace suits your link fits better")
