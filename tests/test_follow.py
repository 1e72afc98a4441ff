"""Slow peers off the critical path, without a network: punctuality, excused voters, the follow rule."""
import asyncio
import dataclasses

import pytest
import torch

from lioncub_p2p.allreduce import PartReport, PeerSpec, RoundReport, RoundSpec
from lioncub_p2p.allreduce.punctuality import Punctuality, probe_round
from lioncub_p2p.allreduce.reducer import PartReduction
from lioncub_p2p.codecs import result_codec, upload_codec
from lioncub_p2p.swarm.follow import FAR_BEHIND_STEPS, FollowRule, far_behind, link_role
from lioncub_p2p.swarm.membership import PeerRecord, assigned_weight, reducer_floor


def test_punctuality_excuses_after_rounds_in_a_row_and_takes_back_after_more():
    p = Punctuality(late_after=2, on_time_after=3)
    members = {"a", "b", "c"}
    p.observe({"a", "b"}, members)
    assert p.late() == set()  # one miss is jitter
    p.observe({"a", "b", "c"}, members)
    p.observe({"a", "b"}, members)
    assert p.late() == set()  # not in a row
    p.observe({"a", "b"}, members)
    assert p.late() == {"c"}
    for rounds in range(2):
        p.observe(members, members)
        assert p.late() == {"c"}  # hysteresis: on time twice is not enough
    p.observe(members, members)
    assert p.late() == set()
    p.observe({"a"}, {"a", "b"})
    p.observe({"a"}, {"a", "b"})
    assert p.late() == {"b"}
    p.observe({"a"}, {"a"})  # b left the group: forgotten, late no more
    assert p.late() == set()
    with pytest.raises(ValueError):
        Punctuality(late_after=0)


def test_probe_rounds_wait_for_a_late_member_four_times_then_at_powers_of_two_of_its_misses():
    """A member that lags and catches up is counted within a few probes; one that never comes costs
    the group a probe's wait a handful of times a run, not every probe round."""
    p = Punctuality(late_after=1)
    members = {"a", "b"}
    p.observe({"a"}, members)
    waited = []
    for probe in range(1, 40):
        waited.append("b" in p.probed())
        p.observe({"a"}, members)  # a plain round says nothing about probes
        p.observe({"a"}, members, probe=True)
    assert [m for m, w in enumerate(waited) if w] == [0, 1, 2, 3, 4, 8, 16, 32]
    assert p.late() == {"b"} and "b" not in p.probed()
    p.observe(members, members, probe=True)  # its probe counted: waited for again, its misses forgotten
    assert p.late() == set()
    p.observe({"a"}, members)
    assert p.probed() == {"b"}
    vote = _spec(3)
    assert [probe_round(dataclasses.replace(vote, step=s, family=f)) for s, f in
            ((8, "vote"), (8, ""), (9, "vote"), (8, "momentum"), (8, "combine"))] == [True, True, False, False, False]


def _spec(n: int, nbytes: int = 64) -> RoundSpec:
    return RoundSpec(b"r", 1, tuple(PeerSpec(f"p{i}") for i in range(n)), nbytes, upload_codec("sign"),
                     result_codec("majority"))


def test_a_reduction_stops_waiting_for_excused_voters_but_never_below_the_quorum():
    async def main():
        spec = _spec(5)
        a, b = spec.bounds[0]
        codes = torch.randint(0, 256, (1, b - a), dtype=torch.uint8)
        red = PartReduction(spec, 0)
        red.excuse(frozenset({3, 4}))
        for v in (0, 1):
            red.add(v, 0, codes.clone(), last=True)
        assert not red.all_in.is_set()  # 2 of 5: below the quorum of 3, excused or not
        red.add(3, 0, codes.clone(), last=True)  # an excused vote in time counts
        assert not red.all_in.is_set()  # voter 2 is still awaited
        red.add(2, 0, codes.clone(), last=True)
        assert red.all_in.is_set()
        outcome = red.close()
        assert outcome is not None and outcome.counted == [0, 1, 2, 3]

        assert not red.only_excused_left.is_set()

        plain = PartReduction(spec, 0)  # without excuses: all five awaited
        for v in (0, 1, 2, 3):
            plain.add(v, 0, codes.clone(), last=True)
        assert not plain.all_in.is_set() and not plain.only_excused_left.is_set()

        hinged = PartReduction(spec, 0)  # the quorum of 3 hinges on excused voters: the node stops waiting soon
        hinged.excuse(frozenset({2, 3, 4}))
        hinged.add(0, 0, codes.clone(), last=True)
        assert not hinged.only_excused_left.is_set()  # voter 1 is awaited
        hinged.add(1, 0, codes.clone(), last=True)
        assert hinged.only_excused_left.is_set() and not hinged.quorum_in.is_set()
        hinged.add(4, 0, codes.clone(), last=True)  # an excused vote in time still counts
        assert hinged.quorum_in.is_set() and hinged.close().counted == [0, 1, 4]

        cut = PartReduction(spec, 0)  # a member that cuts its stream is not excused by it
        cut.excuse(frozenset({3, 4}))
        cut.add(0, 0, codes.clone(), last=True)
        cut.drop(1, "stream closed before its last chunk")
        assert not cut.only_excused_left.is_set()  # voter 2 is still awaited
        cut.drop(2, "stream closed before its last chunk")
        assert not cut.only_excused_left.is_set() and not cut.quorum_in.is_set()
        assert not cut.all_in.is_set()  # voters 3 and 4 can still make the quorum of 3
        cut.drop(3, "its votes were refused before this peer started the round")
        assert cut.all_in.is_set() and cut.close() is None  # 2 left can make no quorum: decided at once

    asyncio.run(main())


def test_voters_refused_before_the_round_started_are_not_waited_for_but_counted_if_they_vote_after_all():
    """``refuse_early``: voters this peer refused before it started the round were told so and send
    nothing more; the part does not wait for them, and decides at once when they leave its quorum out
    of reach. One whose refusal was lost on the way retries on a fresh stream: its votes count."""
    async def main():
        spec = _spec(5)  # quorum 3
        a, b = spec.bounds[0]
        codes = torch.randint(0, 256, (1, b - a), dtype=torch.uint8)
        red = PartReduction(spec, 0)
        red.refuse_early({3, 4})
        for v in (0, 1):
            red.add(v, 0, codes.clone(), last=True)
        assert not red.all_in.is_set()  # voter 2 is awaited
        red.add(2, 0, codes.clone(), last=True)
        assert red.all_in.is_set()  # the refused two are not
        outcome = red.close()
        assert outcome is not None and outcome.counted == [0, 1, 2] and set(red.dropped) == {3, 4}

        lost = PartReduction(spec, 0)  # voter 3's refusal was lost: it votes after all, and counts
        lost.refuse_early({3, 4})
        for v in (0, 3, 1):
            lost.add(v, 0, codes.clone(), last=True)
        assert not lost.all_in.is_set()  # voter 2 is awaited: voter 3 counts once, as a voter
        lost.add(2, 0, codes.clone(), last=True)
        assert lost.all_in.is_set() and lost.close().counted == [0, 1, 2, 3]

        out = PartReduction(spec, 0)  # three refused: 2 left can make no quorum of 3
        out.excuse(frozenset({1}), probed=frozenset({1}))
        out.refuse_early({2, 3, 4})
        assert out.all_in.is_set() and out.probed_in.is_set()  # no probe wait either
        out.add(0, 0, codes.clone(), last=True)
        assert out.close() is None

    asyncio.run(main())


def _report(peer: int, counted: list[list[int]], *, followed: bool = False, status: str = "ok") -> RoundReport:
    parts = [PartReport(j, j, 8 * j, 8 * j + 8, status, counted=c) for j, c in enumerate(counted)]
    return RoundReport("r", 1, peer, parts, followed=followed)


def test_follow_rule_follows_after_rounds_in_a_row_of_votes_that_did_not_count():
    rule = FollowRule(late_after=3)
    late, fine = _report(2, [[0, 1], [0, 1], [0, 1, 2]]), _report(2, [[0, 1, 2], [0, 1, 2], [0, 1]])
    for report in (late, late, fine, late, late):
        rule.after(report)
        assert not rule.following  # never three in a row
    rule.after(late)
    assert rule.following


def test_follow_rule_follows_when_votes_stop_counting_and_probes_back():
    rule = FollowRule(late_after=1)
    rule.after(_report(2, [[0, 1, 2], [0, 1], [0, 1, 2]]))  # counted in 2 of the others' 2 parts
    assert not rule.following and not rule.follow_next(5)
    rule.after(_report(2, [[0, 1, 2], [0, 1], [0, 1]]))  # counted in 1 of 2: half still counts
    assert not rule.following
    rule.after(_report(2, [[0, 1], [0, 1], [0, 1, 2]]))  # counted in 0 of 2 (its own part 2 does not count)
    assert rule.following
    for step in (5, 6, 7):
        assert rule.follow_next(step)
        rule.after(_report(2, [[0, 1], [0, 1], []], followed=True))
    assert not rule.follow_next(8)  # the group's probe round (a multiple of PROBE_EVERY): vote once
    rule.after(_report(2, [[0, 1, 2], [0, 1, 2], [0, 1]]))  # the probe counted: a voter again
    assert not rule.following and rule.rounds_followed == 3
    rule.after(_report(2, [[0], [1]], status="missing"))  # no result at all says nothing
    assert not rule.following
    disturbed = _report(2, [[0, 1], [0, 1], [0, 1]])
    disturbed.parts[1].status = "missing"  # a reducer gone or a group change: not this peer's pace
    for _ in range(3):
        rule.after(disturbed)
    assert not rule.following and rule.late == 0


def test_a_followed_round_nobody_keeps_is_a_skip_ahead():
    forgotten = _report(1, [[], [], [], []], followed=True, status="missing")  # parts 0, 2, 3 (1 is its own)
    assert not FollowRule.fell_out(forgotten)  # a round that failed for everyone: apply nothing, as voters do
    forgotten.parts[2].forgotten = True  # one reducer of three says it no longer keeps it: it may lie
    assert not FollowRule.fell_out(forgotten)
    forgotten.parts[0].forgotten = True  # two of three do: the group moved on
    assert FollowRule.fell_out(forgotten)
    one_gone = _report(1, [[], [], []], followed=True, status="missing")  # parts 0 and 2; reducer 0 left
    one_gone.parts[2].forgotten = True  # the one still there says so: half is enough
    assert FollowRule.fell_out(one_gone)
    voted = _report(1, [[], [], []], followed=False, status="missing")
    voted.parts[0].forgotten = voted.parts[2].forgotten = True
    assert not FollowRule.fell_out(voted)
    mixed = _report(1, [[0], [], [0]], followed=True)
    mixed.parts[0].status, mixed.parts[0].forgotten = "missing", True
    assert not FollowRule.fell_out(mixed)


def test_a_peer_record_says_following_and_older_records_parse_as_not_following():
    record = PeerRecord("peer", step=5, synced=True, following=True)
    payload = record.payload()
    assert PeerRecord.from_payload("peer", payload, 1.0).following
    del payload["following"]
    assert not PeerRecord.from_payload("peer", payload, 1.0).following


@pytest.mark.parametrize("up, down, step_s, role", [
    (100, 100, 0.2, "voter"),  # 1.1M params: 0.01 s of votes each way
    (2, 20, 0.2, "follower"),  # compute + votes 0.49 s > 1.5 steps; results 0.04 s down fit
    (1, 1, 0.2, "behind"),  # results alone take 1 s per 0.2 s step
    (1, 1, None, "voter"),  # nobody trains yet: no pace to keep
])
def test_link_role_from_the_formula(up, down, step_s, role):
    numel, peers = 1_100_000, 5
    got = link_role(numel=numel, peers=peers, up_mbit=up, down_mbit=down, group_step_s=step_s, compute_s=0.05)
    bits = numel * (peers - 1) / peers
    assert got.role == role
    assert got.vote_s == pytest.approx(bits / (up * 1e6)) and got.result_s == pytest.approx(bits / (down * 1e6))
    assert got.line.startswith(role)


def test_a_member_far_below_the_median_weight_reduces_nothing():
    assert reducer_floor([100, 100, 100, 100, 1]) == pytest.approx(10.0)  # the 1 Mbit/s peer: no part
    assert reducer_floor([3, 1, 2, 1]) == pytest.approx(0.15)  # uneven but comparable: everyone reduces
    assert reducer_floor([]) == 0.0
    floor = reducer_floor([100, 100, 100, 100, 1])
    given = lambda w, **kw: assigned_weight(w, **{"syncing": False, "following": False, "floor": floor,  # noqa: E731
                                                  "lone_reducers": False, **kw})
    assert (given(100), given(1), given(1, lone_reducers=True)) == (100, 0.0, 1)  # a group always has a reducer
    assert given(100, syncing=True) == given(100, following=True) == given(100, following=True, lone_reducers=True) == 0


def test_a_follower_nobody_serves_any_more_stops_instead_of_training_on_zeros():
    """Skipping ahead fails while nobody is left to download from: two failures apply zeros and retry,
    the third stops the peer with one line (``stranded``, which lioncub-train turns into exit 1)."""
    from types import SimpleNamespace

    from lioncub_p2p.swarm.pipeline import SKIP_TRIES, VotePipeline

    def gone(**kwargs):
        raise ConnectionError("all dials failed")

    missed = []
    fake = SimpleNamespace(state=SimpleNamespace(download=gone), _missed=lambda step: missed.append(step) or torch.zeros(8),
                           _skip_failures=0, stranded=None, skips=0, optimizer=SimpleNamespace(step_count=40))
    for step in range(SKIP_TRIES):
        assert fake.stranded is None
        update = VotePipeline.skip_ahead(fake, step, group=None)
        assert torch.equal(update, torch.zeros(8))
    assert missed == list(range(SKIP_TRIES))
    assert "fell behind" in fake.stranded and "start it again" in fake.stranded and "\n" not in fake.stranded


def test_far_behind_is_the_median_of_the_members_steps_past_the_limit():
    assert far_behind(10, []) is None  # nobody to compare with
    assert far_behind(10, [10 + FAR_BEHIND_STEPS] * 3) is None  # at the limit: it replays
    assert far_behind(10, [11 + FAR_BEHIND_STEPS] * 3) == 1 + FAR_BEHIND_STEPS
    assert far_behind(10, [12, 13, 10**9]) is None  # a forged far-future step alone moves nothing
    assert far_behind(10, [0, 0, 500, 500]) is None  # the lower median: half the members near it is enough
    assert far_behind(10, [9, 500, 500, 500]) == 490
