"""The run's end: one check that every member of the group holds the same parameters.

A round's result is checked by the next round's state tags (``pipeline.finish`` repairs a peer that
differs from most votes). The last step has no next round, so a split there stays: a round that failed
for some members and not others, a group change at the last step (seen in a two-level run: 3 of 6
peers ended on another state). After its last step (``Swarm.settle_final_state``) each peer announces
its parameters' digest in its record (``PeerRecord.final``); once the members still to announce one
cannot change the verdict (``settled_on``), a peer holding another digest than the group settles on
(``agreed``) downloads the parameters from those who hold it, refusing any that do not hash to it.

After that, a peer lingers while members are behind, leading and serving this final state
(``RunEnd.linger``). ``finals_at``, ``agreed`` and ``settled_on`` are pure and unit-tested without a network;
``RunEnd`` does the waiting and the download on the training thread (``Swarm.settle_final_state`` and
``Swarm.linger`` hand it the optimizer).
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Collection, Mapping

from ..aio import BackgroundLoop
from ..optim import LionCub
from . import snapshot
from .membership import GroupRecord, PeerRecord
from .state_sync import StateSync
from .state_transfer import download_bound
from .upkeep import Upkeep

logger = logging.getLogger(__name__)


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


def settled_on(finals: Mapping[str, str], pending: Collection[str], group: GroupRecord) -> str | None:
    """The digest the group settles on (``agreed``) once no member still to announce can change it:
    nobody is pending, or one digest is held by more than half of those announced and pending together
    (a peer that finished first need not wait out members dropped near the end: seen, it gave up on
    them after its 30 s and kept a minority state while they rejoined); else None."""
    target = agreed(finals, group)
    held = sum(digest == target for digest in finals.values())
    return target if not pending or 2 * held > len(finals) + len(pending) else None


class RunEnd:
    """The end of this peer's run, on the training thread. ``final``: the parameters' digest its record
    announces once it settles (``upkeep.Local.final``); ``repairs``: downloads of the final parameters."""

    def __init__(self, *, peer_id: str, loop: BackgroundLoop, upkeep: Upkeep, state: StateSync,
                 refresh_period: float):
        self.peer_id, self.loop, self.upkeep, self.state = peer_id, loop, upkeep, state
        self.refresh_period = refresh_period
        self.final = ""
        self.repairs = 0

    def _announce(self, what: str) -> None:
        try:
            self.loop.run(self.upkeep.announce(), timeout=10)
        except Exception as e:  # the periodic announcement carries it too
            logger.debug("announcing %s failed: %s", what, e)

    def settle(self, optimizer: LionCub, seconds: float) -> bool:
        """Apply the update of a round still in flight, announce the parameters' digest and wait, up to
        ``seconds``, for the live members of the group to announce theirs; once the group settles on
        another digest (``settled_on``: the members still to announce cannot change it), download those
        parameters from a member holding them, refusing any that do not hash to it (this peer's momenta
        stay: they differ between peers anyway). True when every member announced the same digest in
        time."""
        step = optimizer.step_count
        optimizer.flush()  # overlapped rounds: the last round's update is part of what is compared (and may
        deadline = time.monotonic() + seconds  # repair: the wait for the others starts after it)
        self.state.server.forget()  # a snapshot cached before the flush holds the state without it
        own = snapshot.params_digest(optimizer).hex()  # again only after a download: hashing takes time
        while True:
            if own != self.final:  # at once: the others wait for it
                self.final = own
                self._announce("the final digest")
            group = self.upkeep.history.latest
            finals, pending = finals_at(step, group, self.upkeep.records, self.peer_id, own, self.state.liars())
            target = settled_on(finals, pending, group)
            if not pending and set(finals.values()) == {own}:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                logger.warning("step %d: the group did not settle on one final state in %.0f s (%s)", step, seconds,
                               f"still waiting for {len(pending)} member(s)" if pending else
                               f"{len(set(finals.values()))} digests among {len(finals)} members")
                return False
            if target is not None and target != own:
                own = self._take(optimizer, step, group, finals, target, left)
                if own == target:
                    self.repairs += 1
                    continue  # announce it, and wait for the others to settle
            time.sleep(self.refresh_period)

    def _take(self, optimizer: LionCub, step: int, group: GroupRecord, finals: dict[str, str], target: str,
              seconds: float) -> str:
        """Download the parameters ``target`` names from a member that announced it (one at a time: a
        donor serving others is refused and the next asked); this peer's digest afterwards."""
        records = self.upkeep.records
        holders = [pid for pid, digest in finals.items() if digest == target and pid != self.peer_id
                   and not (pid in records and records[pid].leaving)]
        logger.warning("step %d: these parameters differ from those %d of %d members ended with: downloading "
                       "them", step, sum(digest == target for digest in finals.values()), len(finals))
        deadline = time.monotonic() + seconds
        for holder in holders:
            if time.monotonic() >= deadline:
                break
            try:
                self.state.catch_up("settle", step, group, params_only=True, only=[holder],
                                    expect=bytes.fromhex(target), within=deadline - time.monotonic())
                break
            except Exception as e:  # the next holder
                logger.warning("downloading the final parameters from %s failed: %s: %s", holder,
                               type(e).__name__, e)
        return snapshot.params_digest(optimizer).hex()

    def linger(self, optimizer: LionCub, seconds: float) -> None:
        """Stay up to ``seconds`` while a live member is behind, leading and serving this final state. A
        member dropped near the end (a stall, a lost link) rejoins at the last step (``final_step`` caps
        the group's start) and downloads it, instead of waiting for a group that nobody steps any more.
        Returns at once when nobody is behind. A download this peer serves is not cut at ``seconds``: it
        stays while one is under way, up to the time a whole state takes at 1 Mbit/s
        (``state_transfer.download_bound``: a slow link's last state took minutes)."""
        step, deadline = optimizer.step_count, time.monotonic() + seconds
        serving_until = deadline + download_bound(snapshot.max_size(optimizer), 0.0)
        self._announce("the last step")  # at once: those finishing with this peer need not wait for it
        waited = extended = False
        while True:
            now, serving = time.monotonic(), self.state.server.uploading
            if now >= (serving_until if serving else deadline):
                break
            behind = sorted(pid for pid, r in self.upkeep.records.items()  # refreshed on the loop thread
                            if pid != self.peer_id and not r.leaving and r.step < step)
            if not behind and not serving:
                break
            if not waited:
                logger.info("finished at step %d; staying up to %.0f s for %d peer(s) behind", step, seconds,
                            len(behind))
                waited = True
            if now >= deadline and not extended:
                logger.info("a state download from this peer is under way: staying until it ends")
                extended = True
            time.sleep(self.refresh_period)
