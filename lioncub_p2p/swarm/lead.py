"""What a leader makes of its group: who leads, who stays, who joins, and with which weight.

Pure: it reads the group, the validated peer records and what this peer observed of the rounds, and
returns a plan; ``Upkeep.lead`` (the event loop's thread) does the I/O, publishes the plan as the next
group and logs why members were dropped. Tested without a network (``tests/test_lead.py``).

The rules:

* a member is **healthy** unless it is suspected (``verdicts.py``: proven lies, two members' suspicion,
  its own ``leaving`` record), its record is gone, or it was not counted in ``2`` rounds in a row
  (``sync_grace`` while its record says it is still downloading the state) for at least ``drop_after``
  seconds; a member that announced ``following`` (``follow.py``) is never dropped for missed votes.
  In a two-level vote a peer counts the votes of its own group only: of a member of another group it
  knows only what that group's members report in their records (``missing_votes``, the same rule),
  and the member misses votes when most of its group-mates that vote say so (one liar cannot drop a
  group-mate; a peer's counts from an earlier epoch's group, whose members it no longer sees, are
  not used); its probation (below) ends when most of them report its votes steady (``steady_votes``).
  When a whole group stalls nobody is left to report it, so any member also misses votes when its
  own records **repeat one step** while this peer moves on (``Stalls``: its event loop announces, its
  training does not; a healthy voter is never 2 steps behind for 5 s without missing 2 rounds). This
  holds across epochs: when the leader drops one stalled member, the group changes (a two-level vote
  may turn flat) and the leader's counts of the others start afresh, while their records still tell;
* the **leader** is the first healthy member that reduces, in group order (``leader_of``);
* the unhealthy are dropped; a peer not in the group joins when its record is newer than the one it
  had when it was dropped (a dead peer's record lingers until it expires), it is not suspected and
  ``may_join`` admits it (protocol version, manifest, allow-list, run secret); one dropped for missed
  votes comes back once its record shows its training acted since: it asks to rejoin (not synced)
  or announces a later step (a peer whose training thread hangs still announces from its event loop:
  re-added while it slept, it cost every member the upload timeout at each of its steps). The leader
  that dropped it knows this (``Upkeep.missed_at``); a new leader re-adds it as before;
* weights: ``membership.assigned_weight``, with the floor computed over the members' and newcomers'
  announced weights, and the lone-reducer exception when no member that could reduce reaches it;
* members that follow or are on probation are no **voters** (``PeerSpec.voter``): the quorum is a
  majority of the others (with a follower counted, a group of two had results on probe rounds only);
* a member dropped for missed votes while alive (its record fresh, not suspected) that comes back is on
  **probation** until its votes count in ``STEADY_ROUNDS`` rounds in a row: it rejoins without a part
  and is not dropped for missed votes, as if it followed, unless its records stall (its training hangs
  again: it then stays out until its record moves, as after its first drop). A link too slow for the group's pace
  (1 Mbit/s among 100) is dropped after ``drop_after`` seconds, before its own rounds (~10 s each)
  tell it to follow; without probation it was re-added at its next record and dropped again, a group
  change every 5-25 s, and so it was when one counted vote (a probe) ended the probation;
* a member whose part was missing at the leader while the other reducers' parts came through
  (``failed_reducers``: it is behind, stalled or gone, and every voter waited out a timeout on its
  part; in a two-level vote: whose part came only from the second level) **rests**: no part for
  ``REST_S`` seconds, still a voter. Dropping it takes 2 rounds and
  ``drop_after`` seconds; a reducer a few steps behind costs every member a timeout per step until then;
* a new group takes effect ``lead_steps`` past the fastest member's step (its record's, or the newest
  step a member asked the leader to count votes for: a leader behind its group sees it there long
  before records say it), and further on a group that steps fast: every member must read the record
  before it reaches that step (``steps_ahead``), or the members split between the two groups for a
  round (a member that ran the step in the older group receives it again: ``pipeline.py``).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from ..allreduce import PeerSpec
from ..allreduce.round import PartReport
from .membership import MAX_REPORTED, GroupRecord, PeerRecord, assigned_weight, reducer_floor

# seconds most members need to read a new group record: one refresh period (0.5 s by default); a
# member that reads it later misses one round and repairs (the group epoch travels in every result).
# Twice the refresh period plus four DHT calls (a member's whole read cycle) was tried: at an overlapped
# run's pace it put group changes 100 steps ahead (the cap), and a group in which every other step
# waited the upload timeout for a newcomer lasted 100 steps instead of ~50 (a CI failure, 227f01b)
NOTICE_S = 0.5
SYNC_GRACE_ROUNDS = 30  # rounds a joining member may miss before it is dropped (it downloads the state)...
DROP_AFTER_S = 5.0  # ...and seconds any member may miss rounds: fast rounds must not drop a peer that is starting up
REST_S = 30.0  # seconds a member whose part failed reduces nothing (it votes)
STEADY_ROUNDS = 3  # rounds in a row a member on probation must be counted in to leave it
STALL_STEPS = 2  # steps this peer must be past a member's repeated step to call it stalled (``Stalls``)


def missed_votes(pid: str, failures: Mapping[str, int], failing_since: Mapping[str, float], now: float, *,
                 syncing: bool) -> bool:
    """Not counted here in 2 rounds in a row (``SYNC_GRACE_ROUNDS`` while its record says it downloads
    the state) for at least ``DROP_AFTER_S`` seconds."""
    limit = SYNC_GRACE_ROUNDS if syncing else 2
    return failures.get(pid, 0) >= limit and now - failing_since.get(pid, now) >= DROP_AFTER_S


def missing_votes(mates: Collection[str], records: Mapping[str, PeerRecord], failures: Mapping[str, int],
                  failing_since: Mapping[str, float], now: float) -> tuple[str, ...]:
    """What a peer reports in its record: the group-mates whose votes it misses (``missed_votes``), not
    those following (they vote late on purpose), at most ``MAX_REPORTED``."""
    def syncing(pid: str) -> bool:
        return pid in records and not records[pid].synced

    found = [pid for pid in sorted(mates) if missed_votes(pid, failures, failing_since, now, syncing=syncing(pid))
             and not (pid in records and records[pid].following)]
    return tuple(found[:MAX_REPORTED])


def steady_votes(mates: Collection[str], counted_run: Mapping[str, int]) -> tuple[str, ...]:
    """What a peer reports in its record to end a probation it cannot see ended: the group-mates in
    ``mates`` (those the group gives no vote) whose votes counted here in ``STEADY_ROUNDS`` rounds in a
    row, at most ``MAX_REPORTED``."""
    return tuple(sorted(pid for pid in mates if counted_run.get(pid, 0) >= STEADY_ROUNDS)[:MAX_REPORTED])


def reported_group(pid: str, me: str, mates: Mapping[str, Collection[str]]) -> Collection[str] | None:
    """``pid``'s group when its group-mates' reports decide about it (a member of another group of a
    two-level vote); None when ``me`` counts its votes itself (its own group, or a flat vote)."""
    group = mates.get(pid)
    return None if group is None or me in group else group


def reported_by_most(pid: str, group: Collection[str], records: Mapping[str, PeerRecord], suspects: Collection[str],
                     field: str) -> bool:
    """Most of ``pid``'s group-mates that vote (a fresh record, synced, not following, not suspected) list
    it in ``field`` of their records (``missing`` or ``steady``). One liar is not most of a group."""
    witnesses = [records[m] for m in group if m != pid and m in records and m not in suspects and not records[m].leaving
                 and records[m].synced and not records[m].following]
    reports = sum(pid in getattr(r, field) for r in witnesses)
    return reports > 0 and 2 * reports > len(witnesses)


@dataclass
class _Watch:
    record: PeerRecord  # the member's newest record seen
    since: float  # local time its first record with this step (and flags) was read
    passed_at: float | None = None  # local time this peer was first seen STALL_STEPS or more past its step
    renewals: int = 0  # newer records with the same step first seen since then


class Stalls:
    """Members whose records repeat one step while this peer moves on: their event loops announce, their
    training does not. The evidence for a two-level vote's group whose members all stall (nobody left to
    report their missed votes), and for members whose votes this peer has counted for a few rounds only
    (the group just changed).

    A record says the step its member had when it announced it, up to one announcement period (a third
    of the record's lifetime) and a store earlier. So a member counts as stalled only after this peer is
    ``STALL_STEPS`` past its step and then reads **two** newer records of it with that same step: the
    second was announced one period after the first, which was still being stored when this peer passed
    it. A pause of the whole group at one step, then fast steps, shows a newer step in those records. A
    member is watched from when this peer's group in force holds it (a newcomer waits for its first group
    step); a record that failed to land proves nothing, nor does an older copy the DHT returns."""

    def __init__(self) -> None:
        self.watched: dict[str, _Watch] = {}

    def update(self, records: Mapping[str, PeerRecord], members: Collection[str], *, step: int, now: float) -> None:
        """Called with each read of the records; ``members``: this peer's group in force, ``step``: its own,
        taken before the read (a slow read must not make a record look announced after this peer passed it).
        A member missing from one read (a read that timed out returns none) keeps its watch."""
        for pid in [p for p in self.watched if p not in members]:
            del self.watched[pid]
        for pid in members:
            record, w = records.get(pid), self.watched.get(pid)
            if record is None or (w is not None and record.expires <= w.record.expires):
                continue  # nothing new (or an older copy)
            if w is None or (record.step, record.synced, record.following) != (w.record.step, w.record.synced,
                                                                              w.record.following):
                w = self.watched[pid] = _Watch(record, now)
            else:
                w.record, w.renewals = record, w.renewals + (w.passed_at is not None)
        for w in self.watched.values():
            if w.passed_at is None and step - w.record.step >= STALL_STEPS:
                w.passed_at = now

    def stalled(self, *, now: float) -> set[str]:
        """Members that announced their step twice since this peer passed it, first read ``DROP_AFTER_S``
        ago or more; not those syncing, following, leaving or finished."""
        return {pid for pid, w in self.watched.items() if w.renewals >= 2 and now - w.since >= DROP_AFTER_S
                and w.record.synced and not (w.record.following or w.record.leaving or w.record.final)}


class Health:
    """Which members a leader keeps (the first rule above), from one moment's records and observations."""

    def __init__(self, records: Mapping[str, PeerRecord], *, me: str, now: float, failures: Mapping[str, int],
                 failing_since: Mapping[str, float], suspects: set[str], part_failed_at: Mapping[str, float] | None = None,
                 probation: Collection[str] = (), mates: Mapping[str, Collection[str]] | None = None,
                 stalled: Collection[str] = ()):
        self.records, self.me, self.now, self.suspects = records, me, now, suspects
        self.stalled = set(stalled)  # ``Stalls``
        self.mates = mates or {}  # two-level: each member's group (itself included); flat: none
        self.probation = set(probation) - {me}
        self.failures, self.failing_since = failures, failing_since
        self.resting = {pid for pid, at in (part_failed_at or {}).items() if now - at < REST_S and pid != me}
        self.alive = {pid for pid, r in records.items() if not r.leaving} | {me}
        self.syncing = {pid for pid, r in records.items() if not r.synced}
        self.following = {pid for pid, r in records.items() if r.following and not r.leaving}

    def __call__(self, pid: str) -> bool:
        if pid in self.suspects:
            return False
        if pid in self.stalled:  # its training hangs, probation or not (a follower is never stalled)
            return pid == self.me
        return pid == self.me or (pid in self.alive and (not self.misses_votes(pid) or pid in self.following
                                                         or pid in self.probation))

    def misses_votes(self, pid: str) -> bool:
        return self.why_missed(pid) is not None

    def why_missed(self, pid: str) -> str | None:
        """Which rule says ``pid`` misses votes (None: none does): its records' stall, or what this peer
        counted of its votes, or, for a member of another group of a two-level vote, what most of that
        group's voting members report. Said in the log when it is dropped."""
        if pid in self.stalled:
            return "its records repeat one step while this peer moved on"
        group = reported_group(pid, self.me, self.mates)
        if group is None:
            if missed_votes(pid, self.failures, self.failing_since, self.now, syncing=pid in self.syncing):
                return (f"its votes were not counted here in {self.failures.get(pid, 0)} rounds in a row for "
                        f"{self.now - self.failing_since.get(pid, self.now):.1f} s")
            return None
        return "most of its group report its votes missing" if reported_by_most(
            pid, group, self.records, self.suspects, "missing") else None

    def dropped_alive(self, pid: str) -> bool:
        """Dropped for missed votes alone: its record fresh, not leaving, not suspected (on probation when
        it comes back). A member whose record expired is not: it may be gone (measured: counting it in
        made more group changes, not fewer)."""
        return pid in self.alive and pid != self.me and pid not in self.suspects


def leader_of(latest: GroupRecord, healthy: Health) -> str | None:
    """The first healthy member that reduces: only it publishes the next group."""
    return next((m.peer_id for m in latest.members if m.reduces and healthy(m.peer_id)), None)


@dataclass(frozen=True)
class GroupPlan:
    members: tuple[PeerSpec, ...]  # the next group, sorted by peer id
    dropped: tuple[PeerSpec, ...]
    joined: tuple[PeerSpec, ...]


def asleep_since_drop(record: PeerRecord, missed_at: Mapping[str, int]) -> bool:
    """Dropped for missed votes (``missed_at``: the step its record announced then), and its record still
    says it holds the state at that step: its training has not acted since (it may hang)."""
    return record.synced and record.step <= missed_at.get(record.peer_id, -1)


def plan_group(latest: GroupRecord, healthy: Health, *, evicted: Mapping[str, float],
               may_join: Callable[[PeerRecord], bool], missed_at: Mapping[str, int] | None = None) -> GroupPlan:
    """The next group as its leader makes it. ``evicted``: the expiry of a dropped peer's record when it
    was dropped; ``missed_at``: the step a peer dropped for missed votes announced then; ``may_join`` is
    asked only about peers that would join otherwise (it may log why not)."""
    missed_at = missed_at or {}
    records, syncing = healthy.records, healthy.syncing
    following = healthy.following | healthy.probation  # neither gets a part

    def announced(m: PeerSpec) -> float:  # a member's group weight is 0 while it syncs: its record says more
        return records[m.peer_id].weight if m.peer_id in records else m.weight

    known = {m.peer_id for m in latest.members}
    floor = reducer_floor([announced(m) for m in latest.members if not m.client_mode]
                          + [r.weight for r in records.values() if r.peer_id not in known and not r.client_mode])
    # the floor never leaves the group without a reducer (a slow founder while the others sync)
    reducible = [announced(m) for m in latest.members if m.peer_id not in syncing and m.peer_id not in following
                 and m.peer_id not in healthy.resting and not m.client_mode]
    lone_reducers = bool(reducible) and max(reducible) < floor

    def spec(pid: str, weight: float, client_mode: bool) -> PeerSpec:
        voter = pid not in following  # a follower's late votes must not hold back the quorum
        if client_mode:  # it reduces nothing whatever its weight: a weight that changes as it syncs would make a
            return PeerSpec(pid, 0.0, True, voter)  # new group that means nothing (and splits a group's first step)
        return PeerSpec(pid, assigned_weight(weight, syncing=pid in syncing, following=pid in following,
                                             resting=pid in healthy.resting, floor=floor,
                                             lone_reducers=lone_reducers), client_mode, voter)

    dropped = tuple(m for m in latest.members if not healthy(m.peer_id))
    kept = [spec(m.peer_id, announced(m), m.client_mode) for m in latest.members if m not in dropped]
    joined = tuple(spec(r.peer_id, r.weight, r.client_mode) for r in records.values()
                   if r.peer_id not in known and not r.leaving and r.expires > evicted.get(r.peer_id, 0.0)
                   and not asleep_since_drop(r, missed_at)
                   and r.peer_id not in healthy.suspects and may_join(r))
    return GroupPlan(tuple(sorted(kept + list(joined), key=lambda m: m.peer_id)), dropped, joined)


def failed_reducers(parts: Sequence[PartReport], group: Sequence[PeerSpec], me: str, *,
                    two_level: bool = False) -> list[str]:
    """The members whose part was missing in this round while another member's part came through
    (when every part is missing, the fault is more likely this peer's own). ``two_level``: whose part
    came only from the second level (the combiners had it: its reducer did not answer, or its group's
    votes for it fell below the quorum); a part missing there may be another group's combiner's
    fault, which this peer cannot tell."""
    others = [p for p in parts if p.status != "empty" and group[p.reducer].peer_id != me]
    failed = [group[p.reducer].peer_id for p in others if (p.second_level if two_level else p.status == "missing")]
    return failed if len(failed) < len(others) else []


__all__ = ["Health", "Stalls", "GroupPlan", "leader_of", "plan_group", "asleep_since_drop", "failed_reducers",
           "SYNC_GRACE_ROUNDS", "DROP_AFTER_S", "REST_S", "STEADY_ROUNDS", "STALL_STEPS"]


def steps_ahead(lead_steps: int, steps_per_s: float, notice_s: float = NOTICE_S) -> int:
    """How far past the fastest member's step a new group starts: ``lead_steps``, or the steps the group
    makes while its members read the record, whichever is more (a fast small model makes dozens per
    second; a step of seconds over the internet makes ``lead_steps`` the rule)."""
    return max(lead_steps, math.ceil(max(steps_per_s, 0.0) * notice_s))
