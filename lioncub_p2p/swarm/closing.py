"""The run's end: one check that every member of the group holds the same parameters.

A round's result is checked by the next round's state tags (``pipeline.finish`` repairs a peer that
differs from most votes). The last step has no next round, so a split there stays: a round that failed
for some members and not others, a group change at the last step (seen in a two-level run: 3 of 6
peers ended on another state). After its last step (``Swarm.settle_final_state``) each peer announces
its parameters' digest in its record (``PeerRecord.final``); once every live member of the group has,
a peer holding another digest than most downloads the parameters from those who hold it.

Pure functions here, unit-tested without a network; ``Swarm`` does the waiting and the download.
"""
from __future__ import annotations

from collections import Counter
from typing import Mapping

from .membership import GroupRecord, PeerRecord


def finals_at(step: int, group: GroupRecord, records: Mapping[str, PeerRecord], me: str,
              own: str) -> tuple[dict[str, str], list[str]]:
    """(member -> final digest announced at ``step``, with this peer's ``own``; the members still to
    announce one: stepping, or at ``step`` without a digest yet). A member without a record is gone
    (the leader drops it), one that leaves has stopped, and one past ``step`` trains another run's
    length: none of them is waited for or counted."""
    finals, pending = {me: own}, []
    for member in group.members:
        record = records.get(member.peer_id)
        if member.peer_id == me or record is None or record.leaving or record.step > step:
            continue
        if record.step == step and record.final:
            finals[member.peer_id] = record.final
        else:
            pending.append(member.peer_id)
    return finals, sorted(pending)


def agreed(finals: Mapping[str, str]) -> str:
    """The digest the group settles on: the one most members hold; of a tie, the smallest, so that
    every member picks the same one (a minority cannot move a majority; one liar can only break a tie,
    and only towards parameters it can serve: the download is checked against the digest)."""
    if not finals:
        raise ValueError("no final digest to agree on")
    counts = Counter(finals.values())
    return min(counts, key=lambda digest: (-counts[digest], digest))
