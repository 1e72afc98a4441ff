"""Membership upkeep: a member's view of the run's records, kept fresh on the event loop's thread.

Every ``refresh_period`` the loop reads the run's group records (accepting the next group,
``membership.next_group``) and peer records, announces this peer's record every third of its TTL,
and, where this peer leads, publishes the group the leader's rules give (``lead.plan_group``).

Threads. ``Upkeep`` runs on the event loop and is the only writer of ``history`` (published whole
per group, ``GroupHistory``), ``evicted``, ``admitted`` and its publishing clocks once the member
has joined; before that the joining (training) thread calls ``trust`` while the loop does not run
upkeep yet. ``records`` is replaced whole, never mutated: by the loop, or by the training thread
with a fresh read made on the loop. It sees the training side only through ``Local``, a snapshot
built on demand (``local()``), and the shared round counters ``failures``/``failing_since``/``counted_run``/``steady_at``
(counted by the training thread, reset or pruned here; one key at a time, atomic under the GIL: a
lost count delays a drop, or the end of a probation, by a round at most).
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass

from hivemind.utils import get_dht_time

from ..allreduce.admission import OPEN
from ..wire import PROTOCOL_VERSION
from . import manifest as manifests
from .lead import (DROP_AFTER_S, NOTICE_S, REST_S, STEADY_ROUNDS, Health, Stalls, asleep_since_drop, leader_of,
                   missing_votes, plan_group, reported_by_most, reported_group, steady_votes, steps_ahead)
from .manifest import Manifest
from .membership import (MAX_CARRIED_TICKETS, Directory, GroupHistory, GroupRecord, PeerRecord, PeerSpec,
                         announced_step, next_group, preferred_rival)
from .records import LIMITS, RateLimitedLog

logger = logging.getLogger(__name__)

STEP_WINDOW = 100  # steps a member's announced step may lead the leader's and still count (forged far-future steps)
GROUP_TTL = 60.0  # seconds a published group record lives; the leader republishes it every third of that
GROUP_REPUBLISH_S = 20.0
REVOKED_READ_S = 30.0  # an invited run's revocation list is read this often (a revocation takes effect within it)
DHT_MEMORY_S = 120.0  # how long a slow DHT store or read counts in a new group's notice (dht_s)
# A record must outlive the time until the next one lands: an upkeep cycle (three DHT calls) after a
# third of its lifetime, plus the store. Over a 1 Mbit/s link carrying votes and results a call takes
# seconds and a 10 s record expired between two announcements: the leader dropped a live member and
# added it back a few seconds later, a group change each time (5-10 a run).
SLOW_DHT_TTL_FACTOR = 6.0
FOLLOWER_TTL_S = 60.0  # a follower's link carries results without pause; keeping a dead follower costs nothing
MAX_TTL_S = LIMITS["peers"][1] - 10.0  # what others accept (records.py), less clock skew


@dataclass(frozen=True)
class Local:
    """What upkeep reads of the training side, taken at once when it needs it."""

    joined: bool = False  # an optimizer is attached
    step: int = 0
    synced: bool = False  # holds the swarm's state
    following: bool = False  # receives results without voting (``follow.py``)
    idle: bool = True  # waiting for peers or past its last step, not stepping: a group may start at once
    final_step: int | None = None  # no group may start past it
    final: str = ""  # past its last step: its parameters' digest, for the closing check (closing.py)
    steps_per_s: float = 0.0  # this peer's recent pace (the group's, as it steps with it)
    asked_step: int = -1  # the newest step of a vote round another member asked this peer for (-1: none)
    bytes_up_per_s: float = 0.0
    bytes_down_per_s: float = 0.0
    samples_per_step: int = 0
    loss: float | None = None
    run_manifest: Manifest | None = None


class Upkeep:
    def __init__(self, *, peer_id: str, spec: PeerSpec, run_id: str, directory: Directory, store_manifest,
                 admission, verdicts, local: Callable[[], Local], record_ttl: float, refresh_period: float,
                 lead_steps: int, log: RateLimitedLog, history: GroupHistory | None = None):
        self.peer_id, self.spec, self.run_id = peer_id, spec, run_id
        self.directory, self.store_manifest = directory, store_manifest  # store_manifest(manifest): a coroutine
        self.admission = admission if admission is not None else OPEN
        self.verdicts, self.local = verdicts, local
        self.record_ttl, self.refresh_period, self.lead_steps = record_ttl, refresh_period, lead_steps
        self.log = log
        self.history = history if history is not None else GroupHistory()  # written here only (others read it)
        self.records: dict[str, PeerRecord] = {}
        self.evicted: dict[str, float] = {}  # dropped peer -> expiry of its record when it was dropped
        self.admitted: set[str] = set()  # peers that proved the run key to this peer, or were members of its groups
        # counted by the training thread from its round reports (``pipeline.py``), read and reset here
        self.failures: Counter[str] = Counter()  # rounds in a row a member was not counted...
        self.failing_since: dict[str, float] = {}  # ...since when
        self.part_failed_at: dict[str, float] = {}  # when a member's part last failed here alone (lead.REST_S)
        self.counted_run: Counter[str] = Counter()  # rounds in a row a member's vote counted here...
        self.steady_at: dict[str, float] = {}  # ...when that run last reached lead.STEADY_ROUNDS
        self.missed_out: dict[str, float] = {}  # (here only) member dropped for missed votes -> when: probation
        self.missed_at: dict[str, int] = {}  # ... -> the step its record announced then (``lead.plan_group``)
        self.stalls = Stalls()  # members whose records repeat one step while this peer moves on
        self.on_epoch: Callable[[int], None] | None = None  # told the newest group's epoch (the vote node)
        self.on_new_group: Callable[[GroupRecord], None] | None = None  # a group this leader planned (notices)
        self.stop_waiting_for: Callable[[set[str], str], None] | None = None  # reducers stop waiting for leavers
        # each member's group of a group record's two-level vote (RoundBook.groups_of; empty: a flat vote)
        self.groups_of: Callable[[GroupRecord], Mapping[str, Collection[str]]] = lambda group: {}
        self.published = 0.0  # when this peer last published the group record
        self._dht_calls: deque[tuple[float, float]] = deque()  # (when, seconds) of recent DHT stores and reads
        self.manifest_published = 0.0
        self._progress = (time.monotonic(), 0)  # (time, step) at the last announcement, for samples/s
        self._last_expiration = 0.0  # of this peer's newest record (a leaving record must outlive it)

    def trust(self, group: GroupRecord) -> None:
        """Accept ``group`` as the newest; its members (and those of older groups kept) are admitted."""
        self.history.add(group)
        for g in self.history.by_epoch.values():
            self.admitted.update(g.member_ids())
        if self.on_epoch is not None:
            self.on_epoch(self.history.latest.epoch)

    def admissible(self, group: GroupRecord) -> str | None:
        """Why this peer does not follow ``group`` (``Admission.refuses_listing``), or None."""
        return self.admission.refuses_listing(group.members, group.tickets)

    def tickets_for(self, members: Iterable[PeerSpec], previous: GroupRecord | None) -> tuple[tuple[str, str], ...]:
        """The tickets a record carries (an invited run): of the ``members`` ``previous`` did not list."""
        book = self.admission.invitations
        if book is None:
            return ()
        listed = set(previous.member_ids()) if previous is not None else set()
        found = ((m.peer_id, book.text(m.peer_id)) for m in members if m.peer_id not in listed)
        return tuple((pid, text) for pid, text in found if text is not None)[:MAX_CARRIED_TICKETS]

    async def adopt(self, group: GroupRecord) -> None:
        """Follow ``group`` instead of the lineage this peer lost (on the loop: the history's writer)."""
        self.history.clear()
        self.trust(group)

    async def run_forever(self) -> None:
        last_announce = last_revoked = 0.0
        while True:
            try:
                if self.admission.invited and time.monotonic() - last_revoked > REVOKED_READ_S:
                    last_revoked = time.monotonic()
                    await self.read_revocations()
                await self.refresh_group()
                await self.verdicts.remind_leader()
                step = self.local().step  # before the read: ``Stalls.update``
                self.records = await self.directory.peers()
                in_force = self.history.for_step(step)
                self.stalls.update(self.records, in_force.member_ids() if in_force else (), step=step,
                                   now=time.monotonic())
                leaving = {pid for pid, r in self.records.items() if r.leaving}  # signed by the peer itself
                if leaving and self.stop_waiting_for is not None:
                    self.stop_waiting_for(leaving, "it left the run")
                if time.monotonic() - last_announce > self.record_ttl / 3:
                    await self.announce()
                    last_announce = time.monotonic()
                await self.lead()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the DHT, a bad record: upkeep goes on with the next refresh
                self.log.warning(f"upkeep:{type(e).__name__}", "membership refresh failed: %s: %s", type(e).__name__, e)
            await asyncio.sleep(self.refresh_period)

    async def read_revocations(self) -> None:
        """An invited run: take the authority's list of revoked tickets (their holders' streams are refused
        from then on, and a leader drops them)."""
        revoked = await self._timed(self.directory.revoked())
        if revoked is not None and not revoked <= self.admission.invitations.revoked:
            self.admission.invitations.revoke(revoked)
            logger.info("the run's authority revokes %d tickets", len(self.admission.invitations.revoked))

    async def refresh_group(self) -> None:
        """Accept the next group from the run's records (``membership.next_group``), or the record that
        wins this peer's newest epoch from a rival leader (``membership.preferred_rival``)."""
        if self.history.latest is None:
            return
        self.consider(await self._timed(self.directory.groups()))

    def consider(self, candidates: list[GroupRecord], how: str = "read") -> None:
        """Follow the next group among ``candidates`` (read from the DHT, or a leader's notice:
        ``group_notice.py``), or a rival's record that wins this peer's newest epoch."""
        if self.history.latest is None:
            return
        window = 2 * STEP_WINDOW + self.lead_steps
        step, liars = self.local().step, set(self.verdicts.liars)
        chosen = next_group(candidates, self.history, step=step, window=window,
                            run_step=announced_step(self.history.latest, self.records), refused=liars, log=self.log,
                            admissible=self.admissible)
        if chosen is not None:
            before = self.history.latest
            self.trust(chosen)
            self.note_drops(before, chosen)
            # how much notice it came with: a member at or past its first step when it reads it ran that
            # step in the old group (not logged in ``trust``: a joining peer trusts its first group before
            # it has a step to compare)
            logger.info("group epoch %d from step %d %s at step %d (%d steps of notice)", chosen.epoch,
                        chosen.from_step, how, step, chosen.from_step - step)
            return
        rival = preferred_rival(candidates, self.history, step=step, refused=liars, admissible=self.admissible)
        if rival is not None:
            logger.info("group epoch %d: following %s's record, not %s's (two leaders; the one listed first wins)",
                        rival.epoch, rival.author, self.history.latest.author)
            self.history.replace(rival)
            self.trust(rival)

    def note_drops(self, before: GroupRecord | None, group: GroupRecord) -> None:
        """Say so when ``group``, the epoch after ``before``, drops a member whose votes counted here in
        ``STEADY_ROUNDS`` rounds in a row lately (``steady_at``: this peer's own rounds went on), whose record
        is unexpired, not leaving, and which is neither stalled nor suspected here. Followers cannot check a
        leader's judgement of health (any member of the last two groups may author the next), so this is only
        a warning: a link between the leader and that member, suspicions told to the leader alone, or a
        member dropping honest ones to lead the rest. Never raises: the group is followed already."""
        if before is None or group.epoch != before.epoch + 1:
            return  # across skipped epochs the drop may be another author's
        try:
            now, dht_now = time.monotonic(), get_dht_time()
            kept, stalled = set(group.member_ids()), self.stalls.stalled(now=now)
            suspects = self.verdicts.suspects()  # proven liars among them
            recent = DROP_AFTER_S + 2 * self.refresh_period
            for pid in before.member_ids():
                record = self.records.get(pid)
                if pid in kept or pid == self.peer_id or record is None or record.leaving or record.expires <= dht_now \
                        or pid in stalled or pid in suspects or now - self.steady_at.get(pid, -math.inf) > recent:
                    continue
                self.log.warning(f"drop:{group.author}:{pid}", "group epoch %d by %.60s drops %.60s, whose votes "
                                 "counted here in every recent round and whose record is fresh: a link between the "
                                 "two, suspicions told to the leader alone, or a member dropping honest ones",
                                 group.epoch, group.author, pid)
        except Exception as e:  # a warning must never cost the group change
            logger.debug("could not check group epoch %d's drops: %s", group.epoch, e)

    def record_lifetime(self, following: bool = False, hold_s: float = 0.0) -> float:
        """Seconds this peer's next record lives: ``record_ttl``, longer where announcements land late
        (slow DHT calls, a follower's busy link) or the link is about to carry a state download for
        ``hold_s`` (its announcements starve meanwhile; a member whose record expires is dropped)."""
        ttl = max(self.record_ttl, SLOW_DHT_TTL_FACTOR * self.dht_s, FOLLOWER_TTL_S if following else 0.0, hold_s)
        return min(ttl, max(MAX_TTL_S, self.record_ttl))

    async def announce(self, *, leaving: bool = False, hold_s: float = 0.0) -> None:
        """Publish this peer's record: its step, rates, whether it holds the state, follows, leaves;
        ``hold_s``: it lives at least that long (``record_lifetime``)."""
        me = self.local()
        now, (t0, step0) = time.monotonic(), self._progress
        samples_per_s = max(me.samples_per_step * (me.step - step0) / max(now - t0, 1e-6), 0.0)
        record = PeerRecord(self.peer_id, self.spec.weight, self.spec.client_mode, me.step, PROTOCOL_VERSION,
                            me.synced and not leaving, samples_per_s=samples_per_s, steps_per_s=me.steps_per_s,
                            bytes_up_per_s=me.bytes_up_per_s, bytes_down_per_s=me.bytes_down_per_s, loss=me.loss,
                            manifest=me.run_manifest.digest() if me.run_manifest else "", leaving=leaving,
                            following=me.following and not leaving, final=me.final,
                            ticket=self.admission.invitations.own_text if self.admission.invited else "",
                            **(self._reports() if me.synced and not me.following and not leaving else {}))
        self._progress = (now, me.step)
        # a newer record must expire later than the last (the DHT keeps the latest-expiring one), even
        # one whose store was not confirmed: it may have landed all the same
        if not self._last_expiration:  # a restarted peer's records (a leaving one too) may outlive a new one
            self._last_expiration = max(self._last_expiration, await self._own_expiration())
        ttl = self.record_lifetime(me.following and not leaving, 0.0 if leaving else hold_s)
        expiration = max(get_dht_time() + ttl, self._last_expiration + 1e-3)
        self._last_expiration = expiration
        await self._timed(self.directory.announce(record, ttl, expiration=expiration))

    def _reports(self) -> dict[str, tuple[str, ...]]:
        """What this peer tells the leader of a two-level vote about its group-mates (it counts only its own
        group's votes, ``lead.py``): whose votes it misses, and which of those the group gives no vote
        (on probation) count steadily. Nothing in a flat vote, where the leader sees every vote."""
        latest = self.history.latest
        mates = set(self.groups_of(latest).get(self.peer_id, ())) - {self.peer_id} if latest is not None else set()
        if not mates:
            return {}
        voteless = {m.peer_id for m in latest.members if not m.voter and m.peer_id in mates}
        return dict(missing=missing_votes(mates, self.records, dict(self.failures), dict(self.failing_since),
                                          time.monotonic()),
                    steady=steady_votes(voteless, dict(self.counted_run)))

    async def _own_expiration(self) -> float:
        """When this peer's newest record in the DHT expires (0 if none or unreadable)."""
        try:
            own = (await self._timed(self.directory.peers())).get(self.peer_id)
        except Exception as e:  # announce anyway: at worst the old record shows until it expires
            logger.info("reading this peer's earlier record failed: %s: %s", type(e).__name__, e)
            return 0.0
        return own.expires if own is not None else 0.0

    def may_join(self, record: PeerRecord, run_manifest: Manifest | None) -> bool:
        """Whether the leader may add the peer of ``record`` to the group (logged, rate-limited, if not)."""
        problem = None
        if record.version != PROTOCOL_VERSION:
            problem = f"it speaks protocol version {record.version}, this peer {PROTOCOL_VERSION}"
        elif run_manifest is None or record.manifest != run_manifest.digest():
            problem = "it follows another manifest (other settings or model)"
        elif (uninvited := self.admission.vouches(record.peer_id)) is not None:
            problem = uninvited
        elif self.admission.needs_secret and record.peer_id not in self.admitted:
            problem = "it has not proved the run secret to this peer"
        if problem:
            self.log.warning(f"refuse:{record.peer_id}", "peer %s asked to join but is not added: %s",
                             record.peer_id, problem)
        return problem is None

    def count_round(self, votes: Mapping[str, bool]) -> None:
        """From the training thread, per finished round: whose votes counted here, of the other members of
        its group (this peer's own group in a two-level vote). Missed votes counted of peers outside it
        are forgotten: a two-level vote regroups the members at every epoch, and counts from a group this
        peer no longer sees would drop a member that votes in another (whose group-mates report on it)."""
        for pid in [p for p in set(self.failures) | set(self.counted_run) if p not in votes]:
            self.failures.pop(pid, None)
            self.failing_since.pop(pid, None)
            self.counted_run.pop(pid, None)
        for pid, counted in votes.items():
            self.count_vote(pid, counted)

    def count_vote(self, pid: str, counted: bool) -> None:
        """From the training thread, per member and finished round: whether its vote counted here."""
        if counted:
            self.failures[pid] = 0
            self.failing_since.pop(pid, None)
            self.counted_run[pid] += 1
            if self.counted_run[pid] >= STEADY_ROUNDS:
                self.steady_at[pid] = time.monotonic()
        else:
            self.counted_run[pid] = 0
            self.failures[pid] += 1
            self.failing_since.setdefault(pid, time.monotonic())

    def _probation(self, mates: Mapping[str, Collection[str]], suspects: Collection[str]) -> set[str]:
        """Members this leader dropped for missed votes whose votes have not counted since in
        ``lead.STEADY_ROUNDS`` rounds in a row (``lead.py``): here, or, for a member of another group of a
        two-level vote (``mates``), at most of its group-mates; a peer whose record is gone is forgotten."""
        def steady(pid: str, at: float) -> bool:
            group = reported_group(pid, self.peer_id, mates)
            if group is None:
                return self.steady_at.get(pid, 0.0) > at
            return reported_by_most(pid, group, self.records, suspects, "steady")

        for pid in [p for p, at in self.missed_out.items() if p not in self.records or steady(p, at)]:
            del self.missed_out[pid]
        return set(self.missed_out)

    def _prune_round_counters(self) -> None:
        """Bounded memory: forget counts of peers without a record, and part failures whose rest is over.
        Copies first (the training thread writes these); a failure rewritten meanwhile is kept."""
        for counter in (self.steady_at, self.counted_run, self.missed_at):
            for pid in [p for p in list(counter) if p not in self.records]:
                counter.pop(pid, None)
        now = time.monotonic()
        for pid, at in list(self.part_failed_at.items()):
            if now - at >= REST_S and self.part_failed_at.get(pid) == at:
                self.part_failed_at.pop(pid, None)

    async def lead(self) -> None:
        """If this peer leads the group, keep it equal to the live, admitted, compatible peers: who stays,
        who joins and with which weight is ``lead.plan_group``'s (the rules are in ``lead.py``); this
        publishes it, starting ``lead_steps`` past the fastest member's step, where a member's step
        counts only within ``STEP_WINDOW`` of this peer's (a far-future step is a lie, not progress)."""
        latest, me = self.history.latest, self.local()
        if latest is None or not me.joined or not me.synced:
            return
        if self.published == 0.0 and latest.author == self.peer_id:  # its store was not confirmed (below)
            if await self._publish(latest):
                self.published = time.monotonic()
            return
        # members whose invitation expired or was revoked are dropped like suspects (never added again)
        suspects = self.verdicts.suspects() | {pid for pid in latest.member_ids()
                                               if pid != self.peer_id and self.admission.vouches(pid) is not None}
        self._prune_round_counters()
        mates = self.groups_of(latest)
        now = time.monotonic()
        healthy = Health(self.records, me=self.peer_id, now=now, failures=self.failures,
                         failing_since=self.failing_since, suspects=suspects,
                         part_failed_at=dict(self.part_failed_at), probation=self._probation(mates, suspects),
                         mates=mates, stalled=self.stalls.stalled(now=now))
        step = me.step
        if leader_of(latest, healthy) != self.peer_id or step < latest.from_step:
            return
        if me.run_manifest is not None and time.monotonic() - self.manifest_published > manifests.MANIFEST_TTL / 3:
            self.manifest_published = time.monotonic()  # the leader keeps the run's manifest alive
            await self.store_manifest(me.run_manifest)
            if self.history.latest is not latest:  # a rival's group came meanwhile (a notice): plan from it next
                return
        plan = plan_group(latest, healthy, evicted=self.evicted, missed_at=self.missed_at,
                          may_join=lambda record: self.may_join(record, me.run_manifest))
        liars = self.verdicts.liars
        for m in plan.dropped:  # remember what the record of a dropped member said when it was dropped
            if m.peer_id in self.records:
                self.evicted[m.peer_id] = self.records[m.peer_id].expires
            if healthy.dropped_alive(m.peer_id):
                self.missed_out[m.peer_id] = time.monotonic()
                self.missed_at[m.peer_id] = self.records[m.peer_id].step
            if m.peer_id in liars:
                logger.warning("dropping %s from the group: it lied (%s)", m.peer_id, liars[m.peer_id])
            elif m.peer_id in suspects:
                logger.warning("dropping %s from the group: suspected (%s)", m.peer_id,
                               "; ".join(self.verdicts.suspicions.reasons(m.peer_id)))
            elif (why := healthy.why_missed(m.peer_id)) is not None and m.peer_id in healthy.alive:
                logger.info("dropping %s from the group for missed votes: %s", m.peer_id, why)
        reducing = {m.peer_id for m in latest.members if m.reduces}
        for pid in sorted(healthy.resting & reducing & {m.peer_id for m in plan.members}):
            self.log.warning(f"rest:{pid}", "%s reduces nothing for the next %.0f s: its part failed while the "
                             "others came through", pid, REST_S)
        members = set(latest.member_ids())
        for pid, step_then in self.missed_at.items():  # held out by ``plan_group``: say why, once a minute
            record = self.records.get(pid)
            if record is not None and pid not in members and asleep_since_drop(record, self.missed_at):
                self.log.warning(f"asleep:{pid}", "%s stays out of the group: dropped for missed votes at step %d, "
                                 "its record still says it holds the state at that step (its training may hang)",
                                 pid, step_then)
        for m in plan.joined:  # a returning peer starts with a clean slate
            self.missed_at.pop(m.peer_id, None)
            self.failures[m.peer_id] = 0
            self.failing_since.pop(m.peer_id, None)
            if m.peer_id in healthy.probation:
                logger.info("%s rejoins without a part, on probation: it was dropped for missed votes and is not "
                            "dropped for them again until its votes count in %d rounds in a row", m.peer_id, STEADY_ROUNDS)
        desired = plan.members
        if set(desired) == set(latest.members) or not any(m.reduces for m in desired):
            if time.monotonic() - self.published > GROUP_REPUBLISH_S:  # keep the record alive (our own subkey)
                self.published = time.monotonic()
                if latest.author != self.peer_id:
                    latest = GroupRecord(latest.epoch, latest.from_step, latest.members, latest.previous, self.peer_id,
                                         latest.tickets)
                if not await self._publish(latest):
                    self.published = 0.0  # again at the next upkeep
            return
        me = self.local()  # again: the manifest's store above may have taken seconds of steps
        step = max(step, me.step)
        known = {m.peer_id for m in latest.members}
        steps = [r.step for pid, r in self.records.items() if pid in known and step <= r.step <= step + STEP_WINDOW]
        # a leader behind its group sees the fastest member's step in the votes it is asked to count long
        # before records say it (announced every few seconds): a group from a step already passed splits it
        steps += [me.asked_step] if step <= me.asked_step <= step + STEP_WINDOW else []
        ahead = max([step] + steps)  # the fastest member (a step beyond the window is a lie, not progress)
        # alone, nobody else must read the record first (a founder alone steps at any pace),
        # unless it adds a newcomer, which must ask for the state of its first step before the leader takes
        # it: mid-step there is no snapshot, and the round waited out the upload timeout for its vote
        pace = me.steps_per_s if len(latest.members) > 1 or plan.joined else 0.0
        # the members must read the record before the group reaches its first step: a store and a read
        # take seconds on a loaded machine (a record stored in 3 s started at a step the group had
        # reached: the members that read it in time split from the rest, measured)
        notice = NOTICE_S + 2 * self.dht_s
        # a waiting leader starts a group at once, unless a member already asked it to count votes of its
        # step: that member did not wait and is stepping it, so a group from there would split that step
        waiting = me.idle and ahead == step and me.asked_step < step
        # and never past what members accept (``next_group``'s window, 2 x STEP_WINDOW + lead_steps past
        # the run's step): a toy model's founder at ~400 steps/s planned a newcomer's group 205 steps
        # ahead, the newcomer refused it ("more than 203 steps ahead") and timed out waiting
        lead = 0 if waiting else min(steps_ahead(self.lead_steps, pace, notice), STEP_WINDOW)
        from_step = ahead + lead
        if me.final_step is not None:  # a group from past this peer's last step would never take effect
            from_step = max(latest.from_step, min(from_step, me.final_step))
        record = GroupRecord(latest.epoch + 1, from_step, desired, previous=latest, author=self.peer_id,
                             tickets=self.tickets_for(desired, latest))
        # One epoch, one record, in force here from now: members read it from the DHT while its store
        # is still being confirmed (seconds on a loaded machine), and a leader that moved to it only
        # after the confirmation ran its first steps in the old group apart from them (seen: a split).
        # A store reported failed may still land too: planning another group for the same epoch would
        # split those that read it from the rest; this peer stores the same record again next upkeep.
        self.trust(record)
        if self.history.by_epoch.get(record.epoch) is not record:  # another record holds this epoch here
            return
        if self.on_new_group is not None:  # straight to the members: a DHT read can come after its first step
            try:
                self.on_new_group(record)
            except Exception as e:  # the DHT store below still tells them
                self.log.warning("notice", "group epoch %d: no notices sent: %s: %s", record.epoch,
                                 type(e).__name__, e)
        stored = await self._publish(record)
        self.published = time.monotonic() if stored else 0.0
        logger.info("group epoch %d from step %d: %d members (+%d, -%d), %d reducing%s", record.epoch,
                    record.from_step, len(desired), len(plan.joined), len(plan.dropped),
                    sum(m.reduces for m in desired), "" if stored else " (its store was not confirmed: again next)")

    async def _publish(self, record: GroupRecord) -> bool:
        """Store a group record; False when the DHT did not confirm it (a timeout or an error included:
        the leader holds the record already and stores it again at its next upkeep)."""
        try:
            return bool(await self._timed(self.directory.publish_group(record, ttl=GROUP_TTL)))
        except Exception as e:  # (a cancellation is no Exception: it passes)
            if not isinstance(e, asyncio.TimeoutError):
                logger.info("storing group epoch %d failed: %s: %s", record.epoch, type(e).__name__, e)
            return False

    async def _timed(self, call):
        """Await a DHT call, keeping its time for ``dht_s``."""
        start = time.monotonic()
        try:
            return await call
        finally:
            self._dht_calls.append((start, time.monotonic() - start))

    @property
    def dht_s(self) -> float:
        """This peer's slowest DHT store or read of the last ``DHT_MEMORY_S``: how long members may take
        to read a new group. The slowest, for a while: stores are bursty on a loaded machine, and a
        notice that decayed over the quick reads in between (20% a call) gave 3 steps to a record that
        reached the members in seconds (seen: splits at a run's first group changes)."""
        horizon = time.monotonic() - DHT_MEMORY_S
        while self._dht_calls and self._dht_calls[0][0] < horizon:
            self._dht_calls.popleft()
        return max((seconds for _, seconds in self._dht_calls), default=0.0)
