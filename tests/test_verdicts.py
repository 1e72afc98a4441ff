"""Verdicts on reducers without a network: a fake view of the swarm's rounds and a recording sender."""
from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from lioncub_p2p.allreduce import Caught, PeerSpec
from lioncub_p2p.swarm.accuse import RATE_LIMITED, Accusation, Refused
from lioncub_p2p.swarm.membership import GroupRecord
from lioncub_p2p.swarm.records import RateLimitedLog
from lioncub_p2p.swarm.verdicts import Verdicts

ME, LEADER, REDUCER, OTHER = "me", "leader", "reducer", "other"
GROUP = GroupRecord(1, 0, (PeerSpec(LEADER), PeerSpec(REDUCER), PeerSpec(ME), PeerSpec(OTHER)), author=LEADER)
ROUND = b"r" * 16


class Rounds:
    """One known round: step 7, part 1 reduced by REDUCER."""

    def round_of(self, round_id, step, part, reducer):
        ok = (round_id, step) == (ROUND, 7) and GROUP.members[part].peer_id == reducer
        return (GROUP, "vote") if ok else None

    def step_of(self, round_id):
        return 7 if round_id == ROUND else None

    def latest(self):
        return GROUP

    def accusation_header(self, accuser, accusation, evidence_bytes):
        if self.round_of(accusation.round_id, accusation.step, accusation.part, accusation.accused) is None:
            raise Refused("not a recent round of this peer's groups")
        return 1 << 22


def _verdicts() -> tuple[Verdicts, list[tuple[str, Accusation]]]:
    sent: list[tuple[str, Accusation]] = []

    async def send(to: str, accusation: Accusation) -> tuple[bool, str]:
        sent.append((to, accusation))
        return True, "taken"

    return Verdicts(ME, Rounds(), send, lambda coro: coro.close(), RateLimitedLog(logging.getLogger("t"))), sent


def _accusation(kind="unanswered", round_id=ROUND) -> Accusation:
    return Accusation(kind, REDUCER, round_id, 1, 7, "no answer to the audit")


def test_one_report_is_a_note_two_members_for_one_round_make_a_suspect():
    verdicts, _ = _verdicts()
    assert verdicts.suspect(_accusation(), ME) == "noted" and verdicts.suspects() == set()
    assert verdicts.suspect(_accusation(), ME) == "noted"  # the same member again counts once
    assert verdicts.suspect(_accusation(round_id=b"s" * 16), OTHER) == "noted"  # another round
    assert verdicts.suspect(_accusation(), OTHER) == "suspected"
    assert verdicts.suspects() == {REDUCER} and not verdicts.liars


def test_a_lie_without_evidence_that_proves_it_is_refused_and_convicts_nobody():
    verdicts, sent = _verdicts()
    with pytest.raises(Refused, match="does not prove"):
        asyncio.run(verdicts.on_accusation(OTHER, _accusation("lie")))
    assert not verdicts.liars and not sent


def test_caught_suspicions_go_to_the_leader_and_unknown_rounds_go_nowhere():
    verdicts, sent = _verdicts()
    caught = [Caught(REDUCER, ROUND, 1, "unanswered", "no answer"), Caught(REDUCER, b"x" * 16, 1, "unanswered", "old")]
    asyncio.run(verdicts.act_on(caught))
    assert [(to, a.round_id, a.step) for to, a in sent] == [(LEADER, ROUND, 7)]  # the old round is not reported
    assert verdicts.suspicions.reasons(REDUCER) == [] and verdicts.suspects() == set()  # one member: a note


def test_a_caught_lie_without_evidence_is_not_acted_on():
    verdicts, sent = _verdicts()
    asyncio.run(verdicts.act_on([Caught(REDUCER, ROUND, 1, "lie", "wrong count")]))
    assert not verdicts.liars and not sent


def test_the_leader_is_the_first_reducing_member_not_proven_to_lie():
    verdicts, _ = _verdicts()
    assert verdicts.leader(GROUP) == LEADER and verdicts.leader(GROUP, besides=LEADER) == REDUCER
    verdicts.liars[LEADER] = "proved"
    assert verdicts.leader(GROUP) == REDUCER and verdicts.leader(None) is None


def _hold_recounts(monkeypatch) -> threading.Event:
    """Recounts block (in their threads) until the returned event is set, then prove nothing."""
    from lioncub_p2p.swarm import verdicts as verdicts_module

    release = threading.Event()

    def slow_prove(evidence):
        release.wait(10)
        return None

    monkeypatch.setattr(verdicts_module, "prove", slow_prove)
    return release


def test_evidence_recounts_are_bounded_even_when_their_accusations_time_out(monkeypatch):
    """The accusation stream's timeout cancels the wait for a recount, not the recount in its thread: a
    member uploading evidence slowly and often stacked recounts in the thread pool. At most
    ``MAX_PROVING`` run at once, counted until their threads end."""
    from lioncub_p2p.swarm import verdicts as verdicts_module

    release = _hold_recounts(monkeypatch)
    verdicts, _ = _verdicts()

    async def scenario():
        waits = [asyncio.create_task(verdicts.on_accusation(OTHER, _accusation("lie")))
                 for _ in range(verdicts_module.MAX_PROVING)]
        await asyncio.sleep(0.1)
        for wait in waits:  # the streams time out
            wait.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
        with pytest.raises(Refused, match="busy"):  # their recounts still run
            await verdicts.on_accusation(OTHER, _accusation("lie"))
        release.set()
        for _ in range(100):
            if verdicts._proving == 0:
                break
            await asyncio.sleep(0.02)
        with pytest.raises(Refused, match="does not prove"):  # a slot again
            await verdicts.on_accusation(OTHER, _accusation("lie"))

    asyncio.run(scenario())
    assert verdicts._proving == 0


def test_a_leader_busy_with_other_evidence_is_told_again_later(monkeypatch):
    """Several members report one liar to the leader at once; past its recounts in progress it answers
    "busy", past its rate limit "too many accusations": that report is retried after
    ``RETRY_REPORT_S``, unlike a refusal that says why."""
    from lioncub_p2p.swarm import verdicts as verdicts_module

    monkeypatch.setattr(verdicts_module, "RETRY_REPORT_S", 0.05)
    answers = [(False, verdicts_module.BUSY), (False, RATE_LIMITED), (True, "convicted")]
    sent: list[str] = []

    async def send(to: str, accusation: Accusation) -> tuple[bool, str]:
        sent.append(to)
        return answers.pop(0)

    verdicts = Verdicts(ME, Rounds(), send, lambda coro: coro.close(), RateLimitedLog(logging.getLogger("t")))
    lie = Accusation("lie", REDUCER, ROUND, 1, 7, "flipped", b"evidence")

    async def scenario():
        await verdicts._report(lie)
        assert (REDUCER, LEADER) in verdicts._reported  # in flight...
        await asyncio.sleep(0.2)
        assert (REDUCER, LEADER) not in verdicts._reported  # ...and, busy, open to a retry
        await verdicts._report(lie)
        await asyncio.sleep(0.2)
        assert (REDUCER, LEADER) not in verdicts._reported  # rate-limited (busy retries count there): again
        await verdicts._report(lie)
        await asyncio.sleep(0.2)
        assert (REDUCER, LEADER) in verdicts._reported  # heard this time: not told a fourth time

    asyncio.run(scenario())
    assert sent == [LEADER, LEADER, LEADER]


def test_a_member_busy_with_recounts_says_so_before_the_evidence_is_uploaded(monkeypatch):
    """Over a real stream (``AccuseServer`` behind ``Verdicts.on_header``): while ``MAX_PROVING`` recounts
    run, a lie's header is answered "busy" before READY, so the accuser never uploads its evidence (up
    to 64 MiB) only to hear "busy" after it; once a slot is free the evidence is read and recounted."""
    from hivemind.p2p import P2P

    from lioncub_p2p.swarm import verdicts as verdicts_module
    from lioncub_p2p.swarm.accuse import AccuseServer, send_accusation

    release = _hold_recounts(monkeypatch)
    verdicts, _ = _verdicts()
    lie = Accusation("lie", REDUCER, ROUND, 1, 7, "flipped", b"e" * (1 << 20))
    read: list[int] = []  # evidence bytes the server took in

    async def on_accusation(accuser: str, accusation: Accusation) -> str:
        read.append(len(accusation.evidence))
        return await verdicts.on_accusation(accuser, accusation)

    async def scenario() -> list[tuple[bool, str]]:
        member = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        accuser = await P2P.create(initial_peers=[str(m) for m in await member.get_visible_maddrs()],
                                   host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        answers = []
        try:
            await AccuseServer(member, verdicts.on_header, on_accusation, lambda pid: True).start()
            held = [asyncio.create_task(verdicts.on_accusation(OTHER, _accusation("lie")))
                    for _ in range(verdicts_module.MAX_PROVING)]
            await asyncio.sleep(0.1)
            answers.append(await send_accusation(accuser, member.peer_id.to_base58(), lie, timeout=20))
            release.set()
            await asyncio.gather(*held, return_exceptions=True)
            for _ in range(100):
                if verdicts._proving == 0:
                    break
                await asyncio.sleep(0.02)
            answers.append(await send_accusation(accuser, member.peer_id.to_base58(), lie, timeout=20))
            return answers
        finally:
            release.set()
            await asyncio.gather(member.shutdown(), accuser.shutdown())

    busy, recounted = asyncio.run(scenario())
    assert busy == (False, verdicts_module.BUSY)
    assert not recounted[0] and "does not prove" in recounted[1], recounted
    assert read == [1 << 20]  # only the second upload was read: the busy answer came before READY
