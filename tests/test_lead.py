"""The leader's plan for the next group (``swarm/lead.py``), without a network: each rule, one case."""
import asyncio
import logging
import time
from dataclasses import replace

from lioncub_p2p.allreduce import PartReport, PeerSpec, RoundSpec
from lioncub_p2p.swarm import lead
from lioncub_p2p.swarm.lead import Health, failed_reducers, leader_of, plan_group
from lioncub_p2p.swarm.membership import GroupRecord, PeerRecord
from lioncub_p2p.swarm.records import RateLimitedLog
from lioncub_p2p.swarm import upkeep as upkeep_module
from lioncub_p2p.swarm.upkeep import Local, Upkeep

NOW = 1000.0


def _records(**overrides) -> dict[str, PeerRecord]:
    """Peers a..d synced with weight 1; ``overrides``: peer -> PeerRecord fields."""
    base = {pid: dict(weight=1.0, synced=True, expires=50.0) for pid in "abcd"}
    for pid, fields in overrides.items():
        base.setdefault(pid, dict(weight=1.0, synced=True, expires=50.0)).update(fields)
    return {pid: PeerRecord(pid, **fields) for pid, fields in base.items()}


def _plan(records, members="abcd", *, failures=None, since=None, suspects=(), evicted=None, refuse=(),
          part_failed_at=None):
    latest = GroupRecord(3, 10, tuple(PeerSpec(pid) for pid in members))
    healthy = Health(records, me="a", now=NOW, failures=failures or {}, failing_since=since or {},
                     suspects=set(suspects), part_failed_at=part_failed_at)
    asked = []

    def may_join(r: PeerRecord) -> bool:
        asked.append(r.peer_id)
        return r.peer_id not in refuse

    plan = plan_group(latest, healthy, evicted=evicted or {}, may_join=may_join)
    weights = {m.peer_id: m.weight for m in plan.members}
    return plan, weights, leader_of(latest, healthy), asked


def test_the_first_healthy_reducer_leads_and_an_unchanged_group_stays():
    plan, weights, leader, asked = _plan(_records())
    assert leader == "a" and weights == dict.fromkeys("abcd", 1.0) and not plan.dropped and not asked
    _, _, leader, _ = _plan(_records(), failures={"a": 0}, suspects={"a"})
    assert leader == "b"  # a suspected peer never leads, not even itself


def test_a_member_is_dropped_after_two_missed_rounds_and_drop_after_seconds_only():
    failing = {"failures": {"c": 2}, "since": {"c": NOW - lead.DROP_AFTER_S - 1}}
    plan, weights, _, _ = _plan(_records(), **failing)
    assert [m.peer_id for m in plan.dropped] == ["c"] and "c" not in weights
    plan, _, _, _ = _plan(_records(), failures={"c": 2}, since={"c": NOW - 1})  # recent: a starting peer
    assert not plan.dropped
    plan, _, _, _ = _plan(_records(c=dict(synced=False)), **failing)  # still downloading: 30 rounds
    assert not plan.dropped
    plan, weights, _, _ = _plan(_records(c=dict(following=True)), **failing)  # a follower misses on purpose
    assert not plan.dropped and weights["c"] == 0.0


def test_followers_and_members_on_probation_are_no_voters_and_leave_the_quorum():
    """A follower and a member on probation stay in the group but are not expected to vote: the
    quorum is a majority of the others (a follower counted in it left a group of two without
    results but on its probe rounds)."""
    plan, _, _, _ = _plan(_records(c=dict(following=True)))
    assert {m.peer_id: m.voter for m in plan.members} == {"a": True, "b": True, "c": False, "d": True}
    spec = RoundSpec(b"r", 0, plan.members, 64)
    assert spec.quorum == 2  # of a, b, d; with c counted it would be 3
    assert RoundSpec(b"r", 0, _plan(_records())[0].members, 64).quorum == 3
    healthy = Health(_records(), me="a", now=NOW, failures={}, failing_since={}, suspects=set(), probation={"d"})
    on_probation = plan_group(GroupRecord(3, 10, tuple(PeerSpec(pid) for pid in "abcd")), healthy, evicted={},
                              may_join=lambda r: True)
    assert [m.peer_id for m in on_probation.members if not m.voter] == ["d"]
    pair = (PeerSpec("a"), PeerSpec("b", 0.0, voter=False))
    assert RoundSpec(b"r", 0, pair, 64).quorum == 1  # a group of two with a follower: the other's vote suffices


def test_suspects_the_leaving_and_peers_without_records_are_dropped():
    records = _records(b=dict(leaving=True))
    del records["d"]
    plan, weights, _, _ = _plan(records, suspects={"c"})
    assert sorted(m.peer_id for m in plan.dropped) == ["b", "c", "d"] and list(weights) == ["a"]


def test_newcomers_join_when_admitted_and_newer_than_their_eviction():
    records = _records(e=dict(expires=70.0), f=dict(expires=40.0), g=dict(), h=dict(leaving=True))
    plan, weights, _, asked = _plan(records, evicted={"f": 45.0}, refuse={"g"}, suspects={"x"})
    assert [m.peer_id for m in plan.joined] == ["e"] and "e" in weights  # f: its old record; g: refused
    assert asked == ["e", "g"]  # neither the stale record nor the leaving peer is asked about
    assert [m.peer_id for m in plan.members] == sorted(weights)


def test_weights_follow_the_floor_the_sync_and_the_lone_reducer_exception():
    records = _records(a=dict(weight=100.0), b=dict(weight=100.0), c=dict(weight=100.0), d=dict(weight=1.0),
                       e=dict(weight=100.0, synced=False))
    _, weights, _, _ = _plan(records)
    assert weights == {"a": 100.0, "b": 100.0, "c": 100.0, "d": 0.0, "e": 0.0}  # below a tenth; syncing
    slow_founder = _records(a=dict(weight=1.0), b=dict(weight=100.0, synced=False),
                            c=dict(weight=100.0, synced=False), d=dict(weight=100.0, synced=False))
    _, weights, _, _ = _plan(slow_founder)
    assert weights == {"a": 1.0, "b": 0.0, "c": 0.0, "d": 0.0}  # the only reducer keeps its part


def test_a_client_mode_member_finishing_its_sync_changes_nothing_in_the_group():
    """A member behind NAT reduces nothing, so its group weight is 0 syncing or not: the group made while it
    syncs is the one made after (a weight 0 -> 1 made a new group from step 0 that split the first step)."""
    members = (PeerSpec("a"), PeerSpec("b", 0.0, client_mode=True))
    latest = GroupRecord(1, 0, members)
    for synced in (False, True):
        records = _records(b=dict(client_mode=True, synced=synced))
        healthy = Health({p: r for p, r in records.items() if p in "ab"}, me="a", now=NOW, failures={},
                         failing_since={}, suspects=set())
        plan = plan_group(latest, healthy, evicted={}, may_join=lambda r: True)
        assert plan.members == members, (synced, plan.members)
    joined = plan_group(GroupRecord(1, 0, members[:1]), healthy, evicted={}, may_join=lambda r: True)
    assert joined.members == members  # a newcomer in client mode joins with the weight it keeps


def test_a_new_group_starts_far_enough_ahead_for_every_member_to_read_it():
    """``lead_steps`` at an internet pace; at dozens of steps per second, the steps the group makes while
    its members read the record (else the leader steps into the new group alone and fails its round)."""
    import math

    from lioncub_p2p.swarm.lead import NOTICE_S, steps_ahead

    assert steps_ahead(3, 0.0) == steps_ahead(3, 1.0) == 3  # idle, or a step a second: lead_steps
    assert steps_ahead(3, 35.0) == 18 == math.ceil(35 * NOTICE_S)  # a small model on loopback
    assert steps_ahead(3, 35.0, notice_s=0.05) == 3


def test_a_member_whose_part_failed_alone_rests_without_a_part_then_gets_one_back():
    plan, weights, _, _ = _plan(_records(), part_failed_at={"c": NOW - 1})
    assert weights == {"a": 1.0, "b": 1.0, "c": 0.0, "d": 1.0} and not plan.dropped  # still a voter
    _, weights, _, _ = _plan(_records(), part_failed_at={"c": NOW - lead.REST_S - 1})
    assert weights["c"] == 1.0  # rested long enough
    _, weights, _, _ = _plan(_records(), part_failed_at={"a": NOW - 1})
    assert weights["a"] == 1.0  # the leader does not rest itself on its own word
    lone = _records(a=dict(weight=0.0), b=dict(weight=1.0), c=dict(weight=0.0), d=dict(weight=0.0))
    _, weights, _, _ = _plan(lone, part_failed_at={"b": NOW - 1})
    assert not any(weights.values())  # no reducer left: Upkeep.lead publishes no such group


def test_failed_reducers_are_those_missing_while_another_part_came_through():
    group = [PeerSpec(pid) for pid in "abcd"]
    part = lambda i, status: PartReport(i, i, 0, 0, status=status)  # noqa: E731
    statuses = {"ok": ["ok", "ok", "missing", "recovered"], "alone": ["ok", "missing", "missing", "missing"]}
    assert failed_reducers([part(i, s) for i, s in enumerate(statuses["ok"])], group, me="a") == ["c"]
    # everything missing but this peer's own part: more likely this peer's own link
    assert failed_reducers([part(i, s) for i, s in enumerate(statuses["alone"])], group, me="a") == []
    assert failed_reducers([part(0, "ok"), part(1, "empty"), part(2, "missing"), part(3, "ok")], group, "b") == ["c"]
    # two-level: a missing part may be another group's combiner's fault; one the combiners had (assembled
    # from the second level) was its reducer's alone
    parts = [part(0, "ok"), part(1, "missing"), part(2, "recovered"), part(3, "recovered")]
    parts[3].second_level = True
    assert failed_reducers(parts, group, me="a", two_level=True) == ["d"]
    assert failed_reducers(parts, group, me="a") == ["b"]


def test_a_member_dropped_for_missed_votes_comes_back_on_probation_until_a_vote_counts():
    """Dropped alive for missed votes, it rejoins with no part and is not dropped for missed votes
    again (a 1 Mbit/s link was re-added and dropped every 5-25 s); counted once, the rules are the
    usual ones again."""
    failing = {"failures": {"c": 2}, "since": {"c": NOW - lead.DROP_AFTER_S - 1}}
    records = _records(c=dict(expires=60.0))  # a newer record than at its drop
    latest = GroupRecord(3, 10, tuple(PeerSpec(pid) for pid in "abd"))

    def plan(probation):
        healthy = Health(records, me="a", now=NOW, failures=failing["failures"], failing_since=failing["since"],
                         suspects=set(), probation=probation)
        return healthy, plan_group(latest, healthy, evicted={"c": 50.0}, may_join=lambda r: True)

    healthy, rejoined = plan({"c"})
    assert [m.peer_id for m in rejoined.joined] == ["c"] and {m.peer_id: m.weight for m in rejoined.members}["c"] == 0.0
    member = GroupRecord(4, 12, rejoined.members)
    assert not plan_group(member, healthy, evicted={}, may_join=lambda r: True).dropped  # missed votes, kept
    healthy, _ = plan(set())  # its vote counted: probation over
    after = plan_group(member, healthy, evicted={}, may_join=lambda r: True)
    assert [m.peer_id for m in after.dropped] == ["c"]
    assert healthy.dropped_alive("c") and not healthy.dropped_alive("a")  # "a" is the leader itself
    assert not Health(records, me="a", now=NOW, failures={}, failing_since={}, suspects={"c"}).dropped_alive("c")
    leaving = _records(c=dict(leaving=True))
    assert not Health(leaving, me="a", now=NOW, failures={}, failing_since={}, suspects=set()).dropped_alive("c")
    del records["c"]  # an expired record: perhaps gone
    assert not Health(records, me="a", now=NOW, failures={}, failing_since={}, suspects=set()).dropped_alive("c")


def test_a_member_dropped_for_missed_votes_comes_back_only_once_its_record_shows_its_training_acted(caplog):
    """A peer whose training thread hangs still announces from its event loop, synced at the step it
    hangs at: re-added (on probation) 1 s after its drop, it cost every member the upload timeout at each
    step until it woke. The leader re-adds it once its record asks to rejoin or shows a later step."""
    def leader_dropping_c() -> tuple[Upkeep, _Directory]:
        directory = _Directory(*[True] * 4)
        upkeep = _upkeep("a", directory)
        upkeep.may_join = lambda record, manifest: True  # same version, manifest and admission
        upkeep.trust(GroupRecord(3, 5, tuple(PeerSpec(pid) for pid in "abcd")))
        upkeep.records = _records(**{pid: dict(step=10) for pid in "abcd"})
        upkeep.failures["c"], upkeep.failing_since["c"] = 2, time.monotonic() - lead.DROP_AFTER_S - 1
        asyncio.run(upkeep.lead())
        dropped = directory.published[-1]
        assert dropped.epoch == 4 and dropped.member_ids() == ["a", "b", "d"] and upkeep.missed_at == {"c": 10}
        upkeep.local = lambda: Local(joined=True, step=dropped.from_step, synced=True, idle=False, steps_per_s=1.0)
        return upkeep, directory

    def lead_with(upkeep: Upkeep, **c) -> GroupRecord:
        upkeep.records = {**upkeep.records, "c": replace(upkeep.records["c"], expires=90.0, **c)}
        asyncio.run(upkeep.lead())
        return upkeep.directory.published[-1]

    upkeep, directory = leader_dropping_c()
    with caplog.at_level(logging.WARNING, logger="test"):
        assert lead_with(upkeep).epoch == 4  # a newer record, still synced at step 10: asleep, not re-added
    assert "c stays out of the group: dropped for missed votes at step 10" in caplog.text
    readded = lead_with(upkeep, synced=False)  # it found itself dropped and asks to rejoin
    assert readded.epoch == 5 and "c" in readded.member_ids() and "c" in upkeep.missed_out  # on probation
    assert upkeep.missed_at == {}
    upkeep, _ = leader_dropping_c()
    assert "c" in lead_with(upkeep, step=11).member_ids()  # or trained on
    upkeep, _ = leader_dropping_c()
    upkeep.records = {pid: r for pid, r in upkeep.records.items() if pid != "c"}
    upkeep._prune_round_counters()
    assert upkeep.missed_at == {}  # forgotten with its record


def _counters_upkeep() -> Upkeep:
    """Upkeep of peer a for its round counters alone: no DHT, verdicts or training side."""
    return Upkeep(peer_id="a", spec=PeerSpec("a"), run_id="run", directory=None, store_manifest=None, admission=None,
                  verdicts=None, local=None, record_ttl=10.0, refresh_period=0.5, lead_steps=2, log=None)


def test_upkeep_keeps_a_probation_until_votes_count_in_a_row_and_forgets_peers_without_records():
    """One counted vote (a slow peer's probe) does not end a probation: a 1 Mbit/s peer was then dropped
    again 5 s later, a group change every 5-10 s; ``STEADY_ROUNDS`` counted rounds in a row do."""
    upkeep = _counters_upkeep()
    upkeep.records = _records()
    upkeep.missed_out.update(c=time.monotonic() - 1, d=time.monotonic() - 1)
    for counted in [True, False] * 3 + [True] * (lead.STEADY_ROUNDS - 1):  # c: counted now and then
        upkeep.count_vote("c", counted)
    for _ in range(lead.STEADY_ROUNDS):
        upkeep.count_vote("d", True)
    upkeep.count_vote("x", True)  # x has no record
    assert upkeep.failures["c"] == 0 and upkeep.failures["d"] == 0
    upkeep._prune_round_counters()
    assert upkeep._probation({}, set()) == {"c"} and "x" not in upkeep.counted_run and set(upkeep.missed_out) == {"c"}
    upkeep.count_vote("c", False)
    assert upkeep.failures["c"] == 1 and upkeep.counted_run["c"] == 0 and "c" in upkeep.failing_since
    upkeep.records = {pid: r for pid, r in upkeep.records.items() if pid != "c"}  # its record expired
    assert upkeep._probation({}, set()) == set() and not upkeep.missed_out


def test_upkeep_forgets_part_failures_whose_rest_is_over():
    upkeep = _counters_upkeep()
    now = time.monotonic()
    upkeep.part_failed_at.update(b=now - lead.REST_S - 1, c=now - 1)
    upkeep._prune_round_counters()
    assert upkeep.part_failed_at == {"c": now - 1}  # b's rest is over; c still rests


class _Directory:
    """The run's group records as ``groups``; each publish answered from ``answers`` (True: confirmed,
    False: not confirmed, an exception: raised)."""

    def __init__(self, *answers, groups=()):
        self.answers, self.published, self.stored = list(answers), [], list(groups)

    async def publish_group(self, record: GroupRecord, ttl: float) -> bool:
        self.published.append(record)
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    async def groups(self) -> list[GroupRecord]:
        return list(self.stored)


class _Verdicts:
    liars: dict = {}

    def suspects(self) -> set:
        return set()


def _upkeep(me: str, directory: _Directory, step: int = 10) -> Upkeep:
    return Upkeep(peer_id=me, spec=PeerSpec(me), run_id="run", directory=directory, store_manifest=None,
                  admission=None, verdicts=_Verdicts(), record_ttl=10.0, refresh_period=0.5, lead_steps=2,
                  local=lambda: Local(joined=True, step=step, synced=True, idle=False, steps_per_s=1.0),
                  log=RateLimitedLog(logging.getLogger("test")))


def test_a_group_whose_store_was_not_confirmed_is_kept_and_stored_again_never_a_rival_for_its_epoch():
    """A store reported failed can still land, and members that read it move to its epoch; a leader that
    planned another group for that epoch split them from the rest (seen on a loaded machine: three
    rounds at the join timeout, then a repair). It keeps the record and stores the same one again."""
    directory = _Directory(False, asyncio.TimeoutError(), ConnectionError("no DHT node answered"), True)
    upkeep = _upkeep("a", directory)
    upkeep.trust(GroupRecord(3, 5, tuple(PeerSpec(pid) for pid in "abcd")))
    upkeep.records = {pid: r for pid, r in _records().items() if pid != "d"}  # d's record expired: dropped
    asyncio.run(upkeep.lead())
    first = directory.published[-1]
    assert first.epoch == 4 and first.member_ids() == ["a", "b", "c"]
    assert upkeep.history.latest == first and upkeep.published == 0.0  # kept, though not confirmed
    upkeep.records = _records(e={})  # meanwhile e asks to join: still the same record, stored again
    asyncio.run(upkeep.lead())  # a timeout: not confirmed either
    asyncio.run(upkeep.lead())  # an error: nor this
    assert upkeep.published == 0.0
    asyncio.run(upkeep.lead())
    assert [g.epoch for g in directory.published] == [4, 4, 4, 4] and all(g == first for g in directory.published)
    assert upkeep.published > 0 and upkeep.history.latest == first


def test_a_member_holding_the_later_listed_leaders_record_switches_to_the_first_listed_ones():
    """b saw a miss rounds and published epoch 5 without it; a, still alive, published epoch 5 with d
    added. c read b's first: its next refresh follows a's (listed first in epoch 4), as does b itself."""
    previous = GroupRecord(4, 5, tuple(PeerSpec(pid) for pid in "abc"), author="a")
    b_record = GroupRecord(5, 20, tuple(PeerSpec(pid) for pid in "bc"), previous, "b")
    a_record = GroupRecord(5, 21, tuple(PeerSpec(pid) for pid in "abcd"), previous, "a")
    for me in "cb":
        upkeep = _upkeep(me, _Directory(groups=[b_record, a_record]))
        upkeep.trust(b_record)
        asyncio.run(upkeep.refresh_group())
        assert upkeep.history.latest == a_record and upkeep.history.latest.author == "a"
        assert upkeep.history.by_epoch[4] == previous
    late = _upkeep("c", _Directory(groups=[b_record, a_record]), step=19)  # b's record takes effect next step
    late.trust(b_record)
    asyncio.run(late.refresh_group())
    assert late.history.latest.author == "b"  # too late to switch: the digest and a repair mend it


def test_a_founder_alone_starts_a_group_that_adds_a_newcomer_as_far_ahead_as_its_pace_needs():
    """Alone, a leader's new group needs nobody to read it first: ``lead_steps`` ahead. A group that adds
    a newcomer does: the newcomer must ask for the state of its first step before the founder takes that
    step (mid-step it has no snapshot, and the step's round waited the upload timeout for its vote)."""
    def planned(records: dict, steps_per_s: float = 60.0) -> int:
        directory = _Directory(True)
        upkeep = _upkeep("a", directory)
        upkeep.local = lambda: Local(joined=True, step=40, synced=True, idle=False, steps_per_s=steps_per_s)
        upkeep.trust(GroupRecord(1, 0, (PeerSpec("a"),)))
        upkeep.records = records
        upkeep.may_join = lambda record, manifest: True  # same version, manifest and admission
        asyncio.run(upkeep.lead())
        assert directory.published[-1].member_ids() == sorted(records)
        return directory.published[-1].from_step

    alone = {"a": _records()["a"]}
    assert planned({"a": replace(alone["a"], weight=2.0)}) == 40 + 2  # its own weight changed: lead_steps
    assert planned({**alone, "b": replace(_records()["b"], synced=False)}) == 40 + 30  # 60 steps/s x 0.5 s
    # a toy model's pace: no further than members accept a record (2 x STEP_WINDOW + lead_steps past the run)
    assert planned({**alone, "b": replace(_records()["b"], synced=False)}, 2000.0) == 40 + upkeep_module.STEP_WINDOW


def test_a_slow_dht_moves_a_new_group_further_ahead():
    """A record stored in 3 s started at a step the group had reached by then: the members that read it
    in time split from the rest. The leader's notice counts its recent DHT store and read times."""
    class _SlowDirectory(_Directory):
        async def publish_group(self, record, ttl):
            await asyncio.sleep(0.3)
            return await super().publish_group(record, ttl)

    directory = _SlowDirectory(True, True)
    upkeep = _upkeep("a", directory)
    upkeep.local = lambda: Local(joined=True, step=100, synced=True, idle=False, steps_per_s=10.0)
    upkeep.trust(GroupRecord(3, 5, tuple(PeerSpec(pid) for pid in "abcd")))
    upkeep.records = {pid: r for pid, r in _records().items() if pid != "d"}
    asyncio.run(upkeep.lead())
    assert directory.published[-1].from_step == 100 + 5  # 10 steps/s x 0.5 s: nothing measured yet
    assert 0.3 <= upkeep.dht_s < 1.0
    upkeep.records = {pid: r for pid, r in _records().items() if pid in "ab"}  # c gone at step 106: the next
    # group starts 10 x (0.5 + 2 x 0.3) steps on
    upkeep.local = lambda: Local(joined=True, step=106, synced=True, idle=False, steps_per_s=10.0)
    asyncio.run(upkeep.lead())
    assert directory.published[-1].epoch == 5 and directory.published[-1].from_step >= 106 + 11


def test_a_leader_behind_its_group_starts_the_next_group_past_the_step_its_members_ask_it_for():
    """The leader lags (a slow round) at step 22 while the members already vote for step 26, and their
    records (announced every few seconds) still say 22: a group from step 22 + 2 took effect at a step
    they had passed (seen: a split step 26, 20 s rounds and a repair). The steps its members ask it for
    (votes it is asked to count) say where they are now; one beyond the step window is a lie, ignored."""
    def planned(asked: int) -> int:
        directory = _Directory(True)
        upkeep = _upkeep("a", directory)
        upkeep.local = lambda: Local(joined=True, step=22, synced=True, idle=False, steps_per_s=1.0, asked_step=asked)
        upkeep.trust(GroupRecord(3, 5, tuple(PeerSpec(pid) for pid in "abcd")))
        upkeep.records = {pid: r for pid, r in _records().items() if pid != "d"}  # d gone: a new group
        asyncio.run(upkeep.lead())
        return directory.published[-1].from_step

    assert planned(asked=0) == 22 + 2  # nothing asked: its own step and the records' (lead_steps 2)
    assert planned(asked=26) == 26 + 2
    assert planned(asked=10_000) == 22 + 2  # far beyond the step window: not progress


def test_a_waiting_leader_starts_a_group_at_once_unless_a_member_already_votes_at_its_step():
    """While everyone waits for peers a group takes effect at the leader's step. A member that did not
    wait and already asked the leader to count its votes of that step is stepping it: a group from
    there would split that step (it ran in the older group), so this one starts ahead as usual."""
    def planned(asked: int) -> int:
        directory = _Directory(True)
        upkeep = _upkeep("a", directory)
        upkeep.local = lambda: Local(joined=True, step=0, synced=True, idle=True, steps_per_s=0.0, asked_step=asked)
        upkeep.trust(GroupRecord(3, 0, tuple(PeerSpec(pid) for pid in "abcd")))
        upkeep.records = {pid: replace(r, step=0) for pid, r in _records().items() if pid != "d"}  # d gone
        asyncio.run(upkeep.lead())
        return directory.published[-1].from_step

    assert planned(asked=-1) == 0  # nobody votes yet: at once
    assert planned(asked=0) == 0 + 2  # b votes step 0 already: lead_steps ahead


def test_a_new_group_starts_past_the_step_the_group_reached_while_the_leader_stored_the_manifest():
    """The leader keeps the run's manifest alive before it plans; on a loaded machine that store takes
    seconds of steps, and a group planned from the step read before it took effect at a step already
    passed (seen: from step 50 read by a member at step 61, a split)."""
    directory, progress = _Directory(True), {"step": 22}

    async def store_manifest(manifest) -> None:  # a slow DHT: the group steps on meanwhile
        progress["step"] = 30

    upkeep = _upkeep("a", directory)
    upkeep.store_manifest = store_manifest
    upkeep.local = lambda: Local(joined=True, step=progress["step"], synced=True, idle=False, steps_per_s=1.0,
                                 run_manifest=object())
    upkeep.trust(GroupRecord(3, 5, tuple(PeerSpec(pid) for pid in "abcd")))
    upkeep.records = {pid: r for pid, r in _records().items() if pid != "d"}  # d gone: a new group
    asyncio.run(upkeep.lead())
    assert progress["step"] == 30, "the manifest was stored"
    assert directory.published[-1].from_step == 30 + 2


def test_the_leader_moves_to_its_new_group_before_the_store_is_confirmed():
    """Members read a record from the DHT while its store is still being confirmed; the leader holds it
    from the moment it makes it, or it runs the new group's first steps in the old one apart from them."""
    held = []

    class Slow(_Directory):
        async def publish_group(self, record: GroupRecord, ttl: float) -> bool:
            held.append(upkeep.history.latest)  # what the leader holds while its store is in flight
            return await super().publish_group(record, ttl)

    directory = Slow(True)
    upkeep = _upkeep("a", directory)
    upkeep.trust(GroupRecord(3, 5, tuple(PeerSpec(pid) for pid in "abcd")))
    upkeep.records = {pid: r for pid, r in _records().items() if pid != "d"}
    asyncio.run(upkeep.lead())
    assert held == [directory.published[-1]] and held[0].epoch == 4


def test_a_slow_store_counts_in_the_notice_over_the_quick_reads_after_it_for_a_while(monkeypatch):
    """The notice decayed 20% a DHT call: a 5 s store, then the reads every half second, left ~0.3 s
    of notice by the next group change. The slowest call of the last ``DHT_MEMORY_S`` counts."""
    class _SlowStore(_Directory):
        async def publish_group(self, record, ttl):
            await asyncio.sleep(0.3)
            return await super().publish_group(record, ttl)

    upkeep = _upkeep("a", _SlowStore(True))
    upkeep.trust(GroupRecord(3, 5, tuple(PeerSpec(pid) for pid in "abcd")))
    upkeep.records = {pid: r for pid, r in _records().items() if pid != "d"}
    asyncio.run(upkeep.lead())
    for _ in range(30):  # quick reads
        asyncio.run(upkeep.refresh_group())
    assert 0.3 <= upkeep.dht_s < 1.0
    later = time.monotonic() + upkeep_module.DHT_MEMORY_S + 1
    monkeypatch.setattr(upkeep_module.time, "monotonic", lambda: later)
    assert upkeep.dht_s == 0.0  # forgotten: no call since


class _RecordStore(_Directory):
    """Peer records as the DHT keeps them: per author, the latest-expiring one."""

    def __init__(self, earlier: PeerRecord | None = None):
        super().__init__()
        self.kept = {earlier.peer_id: earlier} if earlier else {}
        self.announced: list[tuple[PeerRecord, float]] = []  # (record, its expiration)

    async def announce(self, record: PeerRecord, ttl: float, *, expiration: float) -> bool:
        self.announced.append((record, expiration))
        if record.peer_id not in self.kept or expiration > self.kept[record.peer_id].expires:
            self.kept[record.peer_id] = PeerRecord(**{**record.__dict__, "expires": expiration})
        return True

    async def peers(self) -> dict[str, PeerRecord]:
        return dict(self.kept)


def test_a_record_outlives_slow_announcements_a_follower_s_busy_link_and_a_state_download(monkeypatch):
    """At 1 Mbit/s the link carries votes, results or a state download for seconds to minutes; the
    10 s record expired between announcements and the leader dropped a live member, then added it
    back (a group change each time, 5-10 a run). The lifetime follows the slowest recent DHT call,
    a follower's or a download's needs, within what other peers accept (``records.LIMITS``)."""
    store = _RecordStore()
    upkeep = _upkeep("a", store)
    assert upkeep.record_lifetime() == 10.0
    upkeep._dht_calls.append((time.monotonic(), 3.0))  # a store took 3 s
    assert upkeep.record_lifetime() == 6 * 3.0
    assert upkeep.record_lifetime(following=True) == upkeep_module.FOLLOWER_TTL_S
    assert upkeep.record_lifetime(hold_s=200.0) == 200.0
    assert upkeep.record_lifetime(hold_s=1e4) == upkeep_module.MAX_TTL_S < upkeep_module.LIMITS["peers"][1]
    asyncio.run(upkeep.announce(hold_s=200.0))  # before a download
    asyncio.run(upkeep.announce())  # the next, shorter-lived record must not shadow it...
    (_, held), (_, next_one) = store.announced
    assert held > upkeep_module.get_dht_time() + 150 and next_one > held  # ...so it expires later still


def test_a_restarted_peer_announces_past_its_earlier_record():
    """The DHT keeps a peer's latest-expiring record: a peer restarted while its earlier record (a
    long-lived or leaving one) still lives announced records nobody saw until that one expired."""
    earlier = PeerRecord("a", expires=upkeep_module.get_dht_time() + 120.0, leaving=True)
    store = _RecordStore(earlier)
    asyncio.run(_upkeep("a", store).announce())
    record, expiration = store.announced[0]
    assert expiration > earlier.expires and store.kept["a"].expires == expiration and not store.kept["a"].leaving


# -- two-level votes: a peer counts the votes of its own group only --------------------------------------

TWO_LEVEL = {pid: group for group in ("abc", "def", "ghi") for pid in group}  # leader a's group: a, b, c


def _two_level_health(reports: dict[str, tuple[str, ...]], *, failures=None, since=None, stalled=(), **record_fields):
    """Health as leader a sees nine synced members in three groups; ``reports``: peer -> the
    group-mates its record says it misses; ``record_fields``: peer -> other PeerRecord fields."""
    records = {pid: PeerRecord(pid, **{"synced": True, "expires": 50.0, "missing": reports.get(pid, ()),
                                       **record_fields.get(pid, {})}) for pid in "abcdefghi"}
    return Health(records, me="a", now=NOW, failures=failures or {}, failing_since=since or {}, suspects=set(),
                  mates={pid: tuple(group) for pid, group in TWO_LEVEL.items()}, stalled=stalled)


def test_a_member_of_another_group_misses_votes_when_most_of_its_voting_group_mates_say_so():
    assert not _two_level_health({}).misses_votes("d")
    assert _two_level_health({"e": ("d",), "f": ("d",)}).misses_votes("d")  # both voting mates
    assert not _two_level_health({"e": ("d",)}).misses_votes("d")  # one of two: a liar cannot drop a mate
    # a mate that follows or downloads the state sees no votes: only e witnesses, and e reports d
    assert _two_level_health({"e": ("d",)}, f={"following": True}).misses_votes("d")
    assert _two_level_health({"e": ("d",)}, f={"synced": False}).misses_votes("d")
    assert not _two_level_health({"e": ("d",), "g": ("d",), "h": ("d",)}).misses_votes("d")  # not its group
    health = _two_level_health({"e": ("d",), "f": ("d",)})
    assert not health("d") and health("e")  # dropped from the next group, its reporters kept


def test_a_member_whose_records_repeat_one_step_while_the_leader_moves_on_has_stalled():
    """A two-level group whose members all stall has nobody to report them: their own records do, once
    this peer is 2 steps past them and reads two newer records with the same step."""
    def rec(pid: str, step: int, expires: float, **fields) -> PeerRecord:
        return PeerRecord(pid, step=step, expires=expires, **{"synced": True, **fields})

    members = "abcdefg"
    stalls = lead.Stalls()
    stalls.update({pid: rec(pid, 20, 50.0) for pid in "defgh"}, members, step=20, now=NOW)
    stalls.update({pid: rec(pid, 20, 50.0) for pid in "defgh"}, members, step=22, now=NOW + 1)  # passed at NOW + 1
    # two announcements later: d still says step 20; e moved on; f's records did not land (a store that
    # failed proves nothing); g follows (behind on purpose); h is watched only once the group holds it
    for k, expires in ((1, 53.3), (2, 56.6)):
        latest = {"d": rec("d", 20, expires), "e": rec("e", 21 + k, expires), "f": rec("f", 20, 50.0),
                  "g": rec("g", 20, expires, following=True), "h": rec("h", 20, expires)}
        stalls.update(latest, members, step=22 + 2 * k, now=NOW + 1 + 3 * k)
    assert stalls.stalled(now=NOW + 7) == {"d"}
    assert stalls.stalled(now=NOW + 4.9) == set()  # its step first read less than DROP_AFTER_S ago
    stalls.update({**latest, "d": rec("d", 19, 50.0)}, members, step=30, now=NOW + 8)  # an older copy: ignored
    assert stalls.stalled(now=NOW + 8) == {"d"}
    stalls.update({}, members, step=30, now=NOW + 8.5)  # a read that timed out (no records) forgets nothing
    assert stalls.stalled(now=NOW + 8.5) == {"d"}
    for fields, found in (({}, {"d"}), ({"synced": False}, set()), ({"following": True}, set()),
                          ({"leaving": True}, set()), ({"final": "ab" * 32}, set())):  # no stall: downloading,
        alone = lead.Stalls()  # behind on purpose, leaving, finished
        for k in range(4):
            alone.update({"d": rec("d", 20, 50.0 + 3.3 * k, **fields)}, members, step=22, now=NOW + 3.3 * k)
        assert alone.stalled(now=NOW + 20) == found, fields
    near = lead.Stalls()  # this peer one step past it only (STALL_STEPS is 2)
    for k in range(4):
        near.update({"d": rec("d", 20, 50.0 + 3.3 * k)}, members, step=21, now=NOW + 3.3 * k)
    assert near.stalled(now=NOW + 20) == set()
    flipped = lead.Stalls()  # it starts following mid-watch: watched afresh (its renewals so far say nothing)
    for k, following in enumerate((False, False, False, True)):
        flipped.update({"d": rec("d", 20, 50.0 + 3.3 * k, following=following)}, members, step=22, now=NOW + 3.3 * k)
    flipped.update({"d": rec("d", 20, 70.0, following=False)}, members, step=22, now=NOW + 14)
    assert flipped.stalled(now=NOW + 20) == set()
    stalls.update(latest, "abc", step=30, now=NOW + 9)  # out of the group: forgotten, watched afresh if back
    stalls.update(latest, members, step=30, now=NOW + 10)
    assert stalls.stalled(now=NOW + 20) == set()

    # the whole group waited at step 20 (renewing its records), then stepped fast: the record read just
    # after this peer passed it was announced before; the next one shows the member's new step
    pause = lead.Stalls()
    for k in range(5):
        pause.update({"d": rec("d", 20, 50.0 + 3.3 * k)}, members, step=20, now=NOW + 3.3 * k)
    pause.update({"d": rec("d", 20, 50.0 + 3.3 * 5)}, members, step=23, now=NOW + 17)
    pause.update({"d": rec("d", 20, 50.0 + 3.3 * 6)}, members, step=26, now=NOW + 18)  # announced before it passed
    assert pause.stalled(now=NOW + 23) == set()  # one record since: it may have been announced before
    pause.update({"d": rec("d", 27, 50.0 + 3.3 * 7)}, members, step=29, now=NOW + 21)
    assert pause.stalled(now=NOW + 30) == set()

    # the evidence holds for a member of another group, whose votes nobody reports, and of its own
    health = _two_level_health({}, stalled={"d", "b"})
    assert health.misses_votes("d") and not health("d") and health.misses_votes("b") and not health("b")
    assert health("c") and not health.misses_votes("e")
    # probation keeps a member whose votes this peer misses, not one whose training hangs again
    records = _records()
    kept = Health(records, me="a", now=NOW, failures={"d": 9}, failing_since={"d": NOW - 60}, suspects=set(),
                  probation={"d"})
    assert kept("d") and not Health(records, me="a", now=NOW, failures={}, failing_since={}, suspects=set(),
                                     probation={"d"}, stalled={"d"})("d")


def test_a_leader_counts_its_own_groups_votes_itself_and_not_the_stale_counts_of_another():
    long_ago = {"b": NOW - 60, "d": NOW - 60}
    failing = {"b": 5, "d": 5}  # d was in a's group at an earlier epoch, and missed votes then
    health = _two_level_health({}, failures=failing, since=long_ago)
    assert health.misses_votes("b") and not health("b")  # its own group: what a counted
    assert not health.misses_votes("d") and health("d")  # another group now: its mates report nothing
    assert not _two_level_health({"c": ("b",)}).misses_votes("b")  # of its own group a trusts only itself
    flat = Health(_records(), me="a", now=NOW, failures=failing, failing_since=long_ago, suspects=set())
    assert flat.misses_votes("d")  # a flat vote: a sees every vote


def test_a_drop_for_missed_votes_names_the_rule_that_made_it():
    """The leader's log says which evidence dropped a member: its stalled records, its votes this peer
    did not count, or its group-mates' reports (two-level)."""
    since = {"b": NOW - 7.5}
    health = _two_level_health({"e": ("d",), "f": ("d",)}, failures={"b": 3}, since=since, stalled={"c"})
    assert "not counted here in 3 rounds in a row for 7.5 s" in health.why_missed("b")
    assert "repeat one step" in health.why_missed("c")
    assert "most of its group" in health.why_missed("d")
    assert health.why_missed("e") is None and health.why_missed("a") is None


def test_a_peer_reports_the_group_mates_it_misses_by_the_leaders_rule():
    records = _records(b={"synced": False}, c={"following": True}, e={}, f={})
    failures = {"b": 5, "c": 5, "d": 2, "e": 1, "f": 40}
    since = {pid: NOW - 10 for pid in failures} | {"d": NOW - 1}
    found = lead.missing_votes({"b", "c", "d", "e", "f"}, records, failures, since, NOW)
    # b downloads the state (30 rounds of grace), c follows, d fails for 1 s only, e missed one round
    assert found == ("f",)
    many = {f"p{k:02d}": 3 for k in range(20)}
    assert lead.missing_votes(set(many), {}, many, {p: NOW - 10 for p in many}, NOW) == \
        tuple(f"p{k:02d}" for k in range(lead.MAX_REPORTED))


def test_upkeep_forgets_missed_votes_of_peers_no_longer_in_its_rounds():
    upkeep = _counters_upkeep()
    upkeep.count_round({"b": False, "c": False, "d": True})
    upkeep.count_round({"b": False, "c": True, "d": True})
    assert upkeep.failures["b"] == 2 and upkeep.failures["c"] == 0 and "b" in upkeep.failing_since
    upkeep.count_round({"c": False, "e": False})  # regrouped: b and d vote in another group now
    assert "b" not in upkeep.failures and "b" not in upkeep.failing_since and "d" not in upkeep.failures
    assert "d" not in upkeep.counted_run  # a run of counted votes does not span two groups either
    assert upkeep.failures["c"] == 1 and upkeep.failures["e"] == 1


def test_a_probation_in_another_group_ends_when_most_of_its_group_mates_report_its_votes_steady():
    upkeep = _counters_upkeep()
    mates = {pid: tuple(group) for group in ("abc", "def", "ghi") for pid in group}
    dropped_at = time.monotonic() - 1
    upkeep.missed_out.update(b=dropped_at, d=dropped_at)

    def records(**steady):
        return {pid: PeerRecord(pid, synced=True, expires=50.0, steady=tuple(steady.get(pid, ())))
                for pid in "abcdefghi"}

    upkeep.records = records(e="d", c="b")  # c's word on b counts for nothing: b is in a's own group
    assert upkeep._probation(mates, set()) == {"b", "d"}  # one of d's two voting mates: not most
    upkeep.records = records(e="d", f="d")
    assert upkeep._probation(mates, set()) == {"b"}
    for _ in range(lead.STEADY_ROUNDS):
        upkeep.count_vote("b", True)
    assert upkeep._probation(mates, set()) == set()


def test_a_peer_reports_the_voteless_group_mates_whose_votes_count_steadily():
    run = {"b": lead.STEADY_ROUNDS, "c": lead.STEADY_ROUNDS - 1, "d": lead.STEADY_ROUNDS + 4}
    assert lead.steady_votes({"b", "c"}, run) == ("b",)  # d is no voteless mate


def test_a_follower_warns_when_a_group_drops_a_member_whose_votes_it_counts_steadily(caplog):
    """Followers cannot check a leader's judgement of health; a drop of a member whose votes counted here
    in a row lately, whose record is unexpired and says nothing of leaving, is said in the log (naming
    the author), and the group is followed all the same."""
    from hivemind.utils import get_dht_time

    def fresh(records: dict[str, PeerRecord]) -> dict[str, PeerRecord]:
        return {pid: replace(r, expires=get_dht_time() + 60) if r.expires == 50.0 else r for pid, r in records.items()}

    def follow(records: dict[str, PeerRecord], *, epoch: int = 4, suspects: frozenset = frozenset()) -> list[str]:
        upkeep = _upkeep("b", _Directory())
        upkeep.verdicts = type("V", (_Verdicts,), {"suspects": lambda self: set(suspects)})()
        upkeep.trust(GroupRecord(3, 5, tuple(PeerSpec(pid) for pid in "abcd")))
        upkeep.records = records
        upkeep.steady_at.update(c=time.monotonic(), d=time.monotonic() - 60)  # d: steady, but long ago
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="test"):
            upkeep.consider([GroupRecord(epoch, 12, (PeerSpec("a"), PeerSpec("b")), author="a")])
        assert upkeep.history.latest.epoch == epoch
        return [r.getMessage() for r in caplog.records if "drops" in r.getMessage()]

    warned = follow(fresh(_records()))
    assert len(warned) == 1 and "by a drops c" in warned[0], warned
    assert follow(fresh(_records(c=dict(leaving=True)))) == []  # it said it leaves
    assert follow({pid: r for pid, r in fresh(_records()).items() if pid != "c"}) == []  # its record is gone
    assert follow(_records()) == []  # ...or expired
    assert follow(fresh(_records()), suspects=frozenset({"c"})) == []  # suspected here too
    assert follow(fresh(_records()), epoch=5) == []  # an epoch was skipped: the drop may be another author's
