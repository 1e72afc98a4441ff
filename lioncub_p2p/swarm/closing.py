"""The run's end: one check that every member of the group holds the same parameters.

A round's result is checked by the next round's state tags (``pipeline.finish`` repairs a peer that
differs from most votes). The last step has no next round, so a split there stays: a round that failed
for some members and not others, a group change at the last step (seen in a two-level run: 3 of 6
peers ended on another state). After its last step (``Swarm.settle_final_state``) each peer announces
its parameters' digest in its record (``PeerRecord.final``); once every live member of the group has,
a peer holding another digest than most downloads the parameters from those who hold it, refusing
any that do not hash to that digest.

Pure functions here, unit-tested without a network; ``Swarm`` does the waiting and the download.
"""
from __future__ import annotations

from collections import Counter
from typing import Collection, Mapping

from .membership import GroupRecord, PeerRecord


def finals_at(step: int, group: GroupRecord, records: Mapping[str, PeerRecord], me: str, own: str,
              exclude: Collection[str] = ()) -> tuple[dict[str, str], list[str]]:
    """(member -> final digest announced at ``step``, with this peer's ``own``; the members still to
    announce one: stepping, or at ``step`` without a digest yet). A member that already left with its
    digest still counts (a peer that settled first must not shift the count by leaving); one that left
    without, has no record (gone: the leader drops it), is ``exclude``d (a proven liar) or is past
    ``step`` (another run's length) is neither counted nor waited for."""
    finals, pending = {me: own}, []
    for member in group.members:
        record = records.get(member.peer_id)
        if member.peer_id == me or member.peer_id in exclude or record is None or record.step > step:
            continue
        if record.step == step and record.final:
            finals[member.peer_id] = record.final
        elif not record.leaving:
            pending.append(member.peer_id)
    return finals, sorted(pending)


def agreed(finals: Mapping[str, str], group: GroupRecord) -> str:
    """The digest the group settles on: the one most members hold. Of a tie (3 against 3 was seen), the
    one held by the first member of the group that reduces and announced one, the member that would lead
    (the leader already decides the group; a minority cannot move a majority), else the smallest; every
    member picks the same from the same announcements."""
    if not finals:
        raise ValueError("no final digest to agree on")
    counts = Counter(finals.values())
    most = max(counts.values())
    tied = sorted(digest for digest, held in counts.items() if held == most)
    first = next((m.peer_id for m in group.members if m.reduces and m.peer_id in finals), None)
    return finals[first] if first is not None and finals[first] in tied else tied[0]
