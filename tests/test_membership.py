"""Signed membership records, their DHT validator, group acceptance windows, and the admission exchange."""
from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import msgpack
import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import P2P
from hivemind.utils import get_dht_time

from lioncub_p2p.allreduce import PeerSpec
from lioncub_p2p.allreduce.admission import Admission
from lioncub_p2p.identity import Identity, Verifier
from lioncub_p2p.sim.hosts import HostNetwork, missing_tools
from lioncub_p2p.swarm import admit
from lioncub_p2p.swarm.membership import (MAX_EPOCH_GAP, MAX_RIVAL_LEAD, GroupHistory, GroupRecord, PeerRecord,
                                          announced_step, next_group, preferred_rival)
from lioncub_p2p.swarm.records import (REGULAR_VALUE_TAG, RateLimitedLog, RecordError, RunRecordValidator, canonical,
                                       open_record, seal, signed_bytes)

ALICE, MALLORY = Identity.load_or_create(None), Identity.load_or_create(None)
PAYLOAD = PeerRecord(ALICE.peer_id, step=5).payload()


def _expires(ahead: float = 10.0) -> float:
    return get_dht_time() + ahead


# -- signed records ----------------------------------------------------------------------------------

def test_a_record_opens_only_as_what_its_author_signed():
    verifier, exp = Verifier(), _expires()
    value = seal(ALICE, "run", "peers", exp, PAYLOAD)
    assert open_record(verifier, "run", "peers", ALICE.peer_id, value, exp) == PAYLOAD
    cases = {
        "another run": ("other", "peers", ALICE.peer_id, value, exp),
        "another kind": ("run", "group", ALICE.peer_id, {**value, "t": "group"}, exp),
        "another subkey": ("run", "peers", MALLORY.peer_id, value, exp),
        "a later expiration": ("run", "peers", ALICE.peer_id, value, exp + 5),  # replayed to shadow newer records
        "the author's key swapped": ("run", "peers", ALICE.peer_id, {**value, "k": MALLORY.public_key}, exp),
        "the payload changed": ("run", "peers", ALICE.peer_id, {**value, "p": value["p"].replace(b"5", b"6")}, exp),
    }
    for name, args in cases.items():
        with pytest.raises(RecordError):
            open_record(verifier, *args)
    # a record signed by Mallory for Alice's subkey (the forgery that crashed every trainer) is refused
    forged = seal(MALLORY, "run", "peers", exp, {**PAYLOAD, "weight": 1e6})
    with pytest.raises(RecordError, match="signature"):
        open_record(verifier, "run", "peers", ALICE.peer_id, forged, exp)
    # Mallory's key signing exactly what a record under Alice's subkey signs: only the peer id binds
    body = canonical({**PAYLOAD, "weight": 1e6})
    crafted = {"r": "run", "t": "peers", "p": body, "k": MALLORY.public_key,
               "s": MALLORY.sign(signed_bytes("run", "peers", ALICE.peer_id, exp, body))}
    with pytest.raises(RecordError, match="signature"):
        open_record(verifier, "run", "peers", ALICE.peer_id, crafted, exp)
    with pytest.raises(RecordError, match="ahead"):  # a far-future expiration cannot pin a record
        far = get_dht_time() + 3600
        open_record(verifier, "run", "peers", ALICE.peer_id, seal(ALICE, "run", "peers", far, PAYLOAD), far)


def _signed_raw(identity: Identity, body: bytes, exp: float, run: str = "run", kind: str = "peers") -> dict:
    """A record whose payload bytes are exactly ``body`` (what a hostile author can sign)."""
    sig = identity.sign(signed_bytes(run, kind, identity.peer_id, exp, body))
    return {"r": run, "t": kind, "p": body, "k": identity.public_key, "s": sig}


def test_a_flood_of_records_cannot_hide_the_authors_a_reader_wants():
    """Only the first ``limit`` records of a key are looked at: 300 manifests from throwaway ids stored
    before the coordinator's pushed its manifest out, and a joiner fell back to default settings. A
    reader that names the authors it would take looks at theirs only."""
    from lioncub_p2p.swarm.records import read_records

    exp = _expires()
    items = {f"junk{i}": SimpleNamespace(value={"r": "run"}, expiration_time=exp) for i in range(300)}
    items[ALICE.peer_id] = SimpleNamespace(value=seal(ALICE, "run", "manifest", exp, {"lr": 0.1}), expiration_time=exp)

    class Dht:
        def get(self, key, latest, return_future):
            future = asyncio.get_running_loop().create_future()
            future.set_result(SimpleNamespace(value=items))
            return future

    log = RateLimitedLog(logging.getLogger("test"))
    read = lambda **kw: asyncio.run(read_records(Dht(), "run", "manifest", Verifier(), log, timeout=5,  # noqa: E731
                                                 limit=256, **kw))
    assert read() == []  # ALICE's is the 301st
    assert [author for author, _, _ in read(authors={ALICE.peer_id, "someone"})] == [ALICE.peer_id]


def test_hostile_payloads_are_refused_before_conversion():
    verifier, exp = Verifier(), _expires()
    body = json.loads(canonical(PAYLOAD))
    hostile = {
        "NaN weight": canonical(body).replace(b'"weight":1.0', b'"weight":NaN'),
        "infinite weight": canonical(body).replace(b'"weight":1.0', b'"weight":1e400'),
        "huge weight": canonical({**body, "weight": 1e300}),
        "step 2**62": canonical({**body, "step": 1 << 62}),
        "negative step": canonical({**body, "step": -1}),
        "float step": canonical({**body, "step": 5.0}),
        "bool weight": canonical({**body, "weight": True}),
        "deep nesting": b"[" * 100_000,  # over the size cap: never parsed
        "not a map": b"[1,2,3]",
        "long manifest field": canonical({**body, "manifest": "x" * 65}),
        "a 2**62 token field": canonical({**body, "token": 1 << 62}),  # ignored, never converted
        "missing not a list": canonical({**body, "missing": "abc"}),
        "missing a number": canonical({**body, "missing": [7]}),
        "missing too many": canonical({**body, "missing": [f"p{k}" for k in range(17)]}),
        "missing a long id": canonical({**body, "missing": ["x" * 129]}),
        "final not hex": canonical({**body, "final": "zz" * 16}),
        "final in capitals": canonical({**body, "final": "AB" * 16}),
        "final too long": canonical({**body, "final": "ab" * 17}),
        "final too short": canonical({**body, "final": "0"}),  # would win a tie broken by the smallest
        "final a number": canonical({**body, "final": 7}),
    }
    for name, raw in hostile.items():
        value = _signed_raw(ALICE, raw, exp) if len(raw) < 8192 else {
            "r": "run", "t": "peers", "p": raw, "k": ALICE.public_key, "s": b"x" * 256}
        record = PeerRecord.parse(ALICE.peer_id, value, exp, run_id="run", verifier=verifier)
        if name == "a 2**62 token field":  # extra fields are dropped, not converted
            assert record is not None and not hasattr(record, "token"), name
        else:
            assert record is None, name
    mates = [Identity.load_or_create(None).peer_id for _ in range(16)]  # the most a record reports, full-length ids
    final = hashlib.blake2b(b"params", digest_size=16).hexdigest()  # a parameter digest, as a record carries it
    reporting = PeerRecord(ALICE.peer_id, step=5, missing=tuple(mates), final=final).payload()
    record = PeerRecord.parse(ALICE.peer_id, seal(ALICE, "run", "peers", exp, reporting), exp, run_id="run",
                              verifier=verifier)
    assert record is not None and record.missing == tuple(mates) and record.final == final
    assert PeerRecord.parse(ALICE.peer_id, seal(ALICE, "run", "peers", exp, PAYLOAD), exp, run_id="run",
                            verifier=verifier).missing == ()
    with pytest.raises(RecordError, match="too large"):
        open_record(verifier, "run", "peers", ALICE.peer_id, {"r": "run", "t": "peers", "p": b"x" * (1 << 20),
                                                                "k": ALICE.public_key, "s": b""}, exp)


def _record(key: str, subkey, value: bytes, exp: float) -> DHTRecord:
    subkey_bytes = REGULAR_VALUE_TAG if subkey is None else msgpack.packb(subkey)
    return DHTRecord(DHTID.generate(key).to_bytes(), subkey_bytes, value, exp)


def test_dht_validator_refuses_forgeries_junk_and_unkeyed_values_under_run_keys():
    validator, exp = RunRecordValidator(["run"]), _expires()
    good = msgpack.packb(seal(ALICE, "run", "peers", exp, PAYLOAD))
    assert validator.validate(_record("run.peers", ALICE.peer_id, good, exp))
    assert validator.validate(_record("run.peers", ALICE.peer_id, good, exp))  # cached verdict, same answer
    refused = {
        "forged subkey": _record("run.peers", MALLORY.peer_id, good, exp),
        "later expiration": _record("run.peers", ALICE.peer_id, good, exp + 1),
        "undecodable": _record("run.peers", ALICE.peer_id, b"\xc1\xc1garbage", exp),
        "not an envelope": _record("run.peers", ALICE.peer_id, msgpack.packb({"weight": float("inf")}), exp),
        "no subkey": _record("run.peers", None, good, exp),  # would block every subkey store of the key
        "group key": _record("run.group", ALICE.peer_id, good, exp),
    }
    for name, record in refused.items():
        assert not validator.validate(record), name
    # other keys are not the validator's business, unless the value claims to be a lioncub record
    assert validator.validate(_record("something.else", "x", b"\xc1junk", exp))
    other_run = msgpack.packb(seal(ALICE, "run2", "peers", exp, PAYLOAD))
    assert validator.validate(_record("run2.peers", ALICE.peer_id, other_run, exp))
    assert not validator.validate(_record("run2.peers", MALLORY.peer_id, other_run, exp))


# -- which group a member follows ----------------------------------------------------------------------

def _group(epoch: int, from_step: int, members: list[str], author: str, previous=None) -> GroupRecord:
    return GroupRecord(epoch, from_step, tuple(PeerSpec(m) for m in members), previous, author)


def test_members_follow_only_their_group_within_windows(caplog):
    history = GroupHistory()
    current = _group(4, 100, ["a", "b"], "a")
    history.add(current)
    log = RateLimitedLog(logging.getLogger("test"))
    pick = lambda groups, step=120: next_group(groups, history, step=step, window=50, log=log)  # noqa: E731
    follow = _group(5, 123, ["a", "b", "c"], "b", current)
    outsider = _group(6, 123, ["m", "a"], "m")  # validly signed by m, who is not a member
    far_future = _group(6, 4611686018427387907, ["a", "b"], "a", follow)  # the frozen-groups attack
    too_many_epochs = _group(5 + MAX_EPOCH_GAP, 123, ["a", "b"], "a")
    older = _group(3, 50, ["a"], "a")
    assert pick([follow]) == follow
    assert pick([outsider, far_future, too_many_epochs, older]) is None
    assert pick([outsider, far_future, follow]) == follow
    assert pick([_group(5, 160, ["a", "b"], "a")], step=110) is not None  # within window of step 110
    assert pick([_group(5, 161, ["a", "b"], "a")], step=110) is None
    # two members decided the same epoch: everyone takes the one whose author is listed first
    assert pick([_group(5, 123, ["a", "b"], "b"), _group(5, 124, ["a", "b"], "a")]).author == "a"
    caplog.clear()
    log = RateLimitedLog(logging.getLogger("test"))
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            pick([outsider])
    assert sum("not following" in r.message for r in caplog.records) == 1  # rate-limited


def test_a_member_cannot_lead_by_listing_itself_first_or_slip_a_group_under_steps_already_run():
    """m, a member, publishes the next group with itself listed first (the leader rule takes the first
    reducer alive: m would lead without dropping anyone), or from a step before the current group's
    (peers still running those steps would vote in another group than the rest)."""
    history = GroupHistory()
    current = _group(4, 100, ["a", "b", "m"], "a")
    history.add(current)
    reordered = _group(5, 110, ["m", "a", "b"], "m", current)
    with pytest.raises(RecordError, match="sorted"):
        GroupRecord.authored(json.loads(json.dumps(reordered.payload())), "m")
    assert GroupRecord.authored(json.loads(json.dumps(_group(5, 110, ["a", "b", "m"], "m", current).payload())),
                                "m").member_ids() == ["a", "b", "m"]
    pick = lambda group, step=105: next_group([group], history, step=step, window=50)  # noqa: E731
    assert pick(_group(5, 99, ["a", "b", "m"], "m", current)) is None  # before the current group's first step
    assert pick(_group(5, 100, ["a", "b", "m"], "a", current)) is not None  # from the same step: a leader may
    assert pick(_group(5, 120, ["a", "b", "m"], "a", current)) is not None


def test_two_leaders_of_one_epoch_every_member_ends_on_the_record_of_the_one_listed_first():
    """b thought a missed rounds and led: b and a each published epoch 5. A member that read b's first
    switches to a's while neither has taken effect here; never to a later-listed author, a liar's,
    another lineage's, a far-future start, or once either record is in effect (then a repair mends it)."""
    previous = _group(4, 100, ["a", "b", "c"], "a")
    b_record = _group(5, 130, ["b", "c"], "b", previous)  # b dropped a
    a_record = _group(5, 131, ["a", "b", "c", "d"], "a", previous)  # a added d
    history = GroupHistory()
    history.add(b_record)
    assert history.latest == b_record and history.by_epoch[4] == previous
    rival = lambda groups, step=120, **kw: preferred_rival(groups, history, step=step, **kw)  # noqa: E731
    assert rival([b_record, a_record]) == a_record
    assert rival([a_record], step=128) == a_record and rival([a_record], step=129) is None  # b's starts at 130
    assert rival([_group(5, 131, ["a", "b"], "c", previous)]) is None  # listed after b
    assert rival([a_record], refused={"a"}) is None
    assert rival([_group(5, 131, ["a", "b"], "a", _group(4, 90, ["a", "b"], "a"))]) is None  # another lineage
    assert rival([_group(5, 130 + MAX_RIVAL_LEAD + 1, ["a", "b"], "a", previous)]) is None
    assert rival([_group(5, 121, ["a", "b"], "a", previous)]) is None  # starts at the next step: too late
    history.replace(a_record)
    assert history.latest == a_record and history.by_epoch[4] == previous and len(history.by_epoch) == 2
    assert rival([b_record, a_record]) is None  # a's record holds: nothing wins over it
    assert preferred_rival([a_record], GroupHistory(), step=0) is None


def test_a_newcomer_follows_the_group_of_a_long_running_run_but_not_a_liars_far_future():
    """A peer joining at step 0 (or coming back far behind) was admitted to the group record of a run
    whose last change was at step 100, while the run is at step 5000: the leader's next record (adding
    it, from step 5003) must be followed. Where the run is comes from the members' signed records (the
    lower median of the synced ones), so one member lying about its step cannot open the window."""
    history = GroupHistory()
    current = _group(4, 100, ["a", "b", "c"], "a")
    history.add(current)
    adding_me = _group(5, 5003, ["a", "b", "c", "me"], "a", current)
    records = {pid: PeerRecord(pid, step=5000 + i, synced=True) for i, pid in enumerate("abc")}
    records["me"] = PeerRecord("me", step=0, synced=False)  # itself, joining: not counted
    records["x"] = PeerRecord("x", step=10**12, synced=True)  # not a member: not counted
    run_step = announced_step(current, records)
    assert run_step == 5001  # sorted synced members' steps [5000, 5001, 5002], lower median
    assert next_group([adding_me], history, step=0, window=203) is None  # the bug: the window of step 0
    assert next_group([adding_me], history, step=0, window=203, run_step=run_step) == adding_me
    # one member (of three) claims a far-future step and publishes a group from there: the median holds
    lying = dict(records, b=PeerRecord("b", step=10**12, synced=True))
    assert announced_step(current, lying) == 5002
    far = _group(5, 10**12, ["a", "b", "c", "me"], "b", current)
    assert next_group([far], history, step=0, window=203, run_step=announced_step(current, lying)) is None
    # of a group of two, the lower median is the honest one; a majority of liars is the run itself
    pair = _group(4, 100, ["a", "b"], "a")
    assert announced_step(pair, {"a": records["a"], "b": lying["b"]}) == 5000
    assert announced_step(pair, {"a": PeerRecord("a", step=9, synced=False)}) is None
    assert announced_step(pair, {"a": PeerRecord("a", step=9, synced=True, leaving=True)}) is None
    # a group whose author was proven to lie is not followed, whatever else holds
    assert next_group([adding_me], history, step=0, window=203, run_step=run_step, refused={"a"}) is None


# -- the admission exchange between two daemons ----------------------------------------------------------

async def _no_wait() -> None:
    return None


async def _exchanges(cases: list[tuple[Admission, Admission]], repeat_last: int = 1):
    """Run each (member's admission, newcomer's admission) exchange on one pair of daemons."""
    member = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    newcomer = await P2P.create(initial_peers=[str(m) for m in await member.get_visible_maddrs()],
                                host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    admitted: list[str] = []
    server = admit.AdmitServer(member, Admission(), admitted.append)
    try:
        await server.start()
        results = []
        for i, (member_admission, newcomer_admission) in enumerate(cases):
            server.admission = member_admission
            server._attempts.clear()  # each case its own quota (the last one tests it)
            admitted.clear()
            verdicts = [await admit.ask_admission(newcomer, member.peer_id.to_base58(), newcomer_admission)
                        for _ in range(repeat_last if i == len(cases) - 1 else 1)]
            results.append((verdicts, list(admitted)))
        return results, newcomer.peer_id.to_base58()
    finally:
        await asyncio.gather(member.shutdown(), newcomer.shutdown())


def test_admission_exchange_proves_the_key_both_ways_says_why_it_refuses_and_rate_limits():
    secret, wrong, none = Admission("run", b"s3cret"), Admission("run", b"wrong"), Admission("run")
    listed = Admission("run", None, frozenset({"somebody-else"}))
    cases = [(secret, secret), (secret, wrong), (secret, none), (wrong, secret), (none, secret), (listed, none),
             (secret, Admission("run", b"guess"))]
    results, newcomer = asyncio.run(_exchanges(cases, repeat_last=admit.MAX_PER_PEER_PER_MINUTE + 2))
    [(ok,), ok_admitted], [(bad,), bad_admitted], [(missing,), missing_admitted] = results[:3]
    assert ok.admitted and ok.member_proved and ok_admitted == [newcomer]
    assert not bad.admitted and bad.reason == "wrong or missing run secret" and not bad_admitted
    assert not missing.admitted and missing.secret_required and not missing_admitted
    (impostor,), _ = results[3]  # a member with another key cannot prove ours (and refuses our proof)...
    assert not impostor.admitted and not impostor.member_proved
    (open_member,), _ = results[4]  # ...nor can an open one: it gets no proof from us, so none to check
    assert open_member.admitted and not open_member.member_proved and not open_member.secret_required
    (not_listed,), _ = results[5]
    assert not not_listed.admitted and not_listed.reason == "not on the run's allow-list"
    guesses, guessed_admitted = results[6]  # online guessing: a few tries per peer per minute, then "busy"
    assert [v.reason for v in guesses[-2:]] == ["too many admission attempts; try again later"] * 2
    assert [v.busy for v in guesses[-3:]] == [False, True, True]  # a newcomer asks again later: no refusal
    assert all(not v.admitted for v in guesses) and not guessed_admitted


def test_idle_admission_streams_neither_hold_slots_for_long_nor_make_newcomers_quit():
    """An outsider keeps 40 admission streams open without a hello, re-dialing each as soon as it is
    closed. Before, each held one of the member's 16 exchange slots for 10 s and every newcomer heard
    "busy", which stopped it for good. Now one peer holds at most two (the rest closed at once), a
    silent one is dropped after the hello timeout, and the newcomer is admitted at once."""
    from lioncub_p2p.testing import hold_streams

    async def scenario():
        member = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        maddrs = [str(m) for m in await member.get_visible_maddrs()]
        outsider = await P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        newcomer = await P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        server = admit.AdmitServer(member, Admission(), lambda pid: None)
        stop, dialed = asyncio.Event(), [0]
        try:
            await server.start()
            holding = asyncio.create_task(hold_streams(outsider, member.peer_id.to_base58(), admit.ADMIT_PROTOCOL,
                                                       40, stop, dialed=dialed))
            await asyncio.sleep(1.0)
            verdict = await admit.ask_admission(newcomer, member.peer_id.to_base58(), Admission())
            open_now = server.gate.open_total
            stop.set()
            await holding
            return verdict, open_now, server.gate.refused
        finally:
            await asyncio.gather(member.shutdown(), outsider.shutdown(), newcomer.shutdown())

    verdict, open_now, refused = asyncio.run(scenario())
    assert verdict.admitted and not verdict.busy, verdict
    assert open_now <= 3 and refused >= 38, (open_now, refused)  # the outsider's two and the newcomer's


def test_a_member_whose_admission_slots_are_full_answers_busy_by_closing_the_stream():
    """A gate closes a stream over its caps before reading a byte: the newcomer reads no challenge at all,
    which means "busy, ask again" (it logged "could not ask ...: IncompleteReadError" before); a stream
    that breaks after a partial challenge is still an error."""
    async def scenario():
        member = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        newcomer = await P2P.create(initial_peers=[str(m) for m in await member.get_visible_maddrs()],
                                    host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        server = admit.AdmitServer(member, Admission(), lambda pid: None)
        try:
            await server.start()
            server.gate.total = 0  # full
            return await admit.ask_admission(newcomer, member.peer_id.to_base58(), Admission()), server.gate.refused
        finally:
            await asyncio.gather(member.shutdown(), newcomer.shutdown())

    verdict, refused = asyncio.run(scenario())
    assert verdict.busy and not verdict.admitted and refused == 1, verdict

    async def half_a_challenge():
        reader = asyncio.StreamReader()
        reader.feed_data(admit.MAGIC + b"\0")
        reader.feed_eof()
        return await admit._ask("me", "member", Admission(), reader, SimpleNamespace(write=lambda b: None,
                                                                                      drain=_no_wait))

    with pytest.raises(asyncio.IncompleteReadError):
        asyncio.run(half_a_challenge())



FLOOD_MEMBER = textwrap.dedent("""
    import asyncio, sys
    from hivemind.p2p import P2P
    from lioncub_p2p.allreduce.admission import Admission
    from lioncub_p2p.swarm import admit
    async def main():
        p2p = await P2P.create(host_maddrs=["/ip4/0.0.0.0/tcp/31338"], announce_maddrs=[f"/ip4/{sys.argv[1]}/tcp/31338"],
                               nat_port_map=False, auto_nat=False)
        server = admit.AdmitServer(p2p, Admission(), lambda pid: None)
        await server.start()
        print(f"/ip4/{sys.argv[1]}/tcp/31338/p2p/{p2p.peer_id.to_base58()}", flush=True)
        peak = {}

        async def watch():  # the most streams each address held at once
            while True:
                for bucket, n in server.gate.open_by_address.items():
                    peak[bucket] = max(peak.get(bucket, 0), n)
                await asyncio.sleep(0.005)
        watching = asyncio.create_task(watch())
        await asyncio.to_thread(sys.stdin.readline)  # until the test asks (or is gone: end of file)
        watching.cancel()
        print(peak, server.gate.refused, flush=True)
    asyncio.run(main())
""")
FLOOD_ATTACKER = textwrap.dedent("""
    import asyncio, sys
    from hivemind.p2p import P2P
    from lioncub_p2p.swarm import admit
    from lioncub_p2p.testing import hold_streams
    async def main():
        ids = await asyncio.gather(*(P2P.create(initial_peers=[sys.argv[1]], host_maddrs=["/ip4/0.0.0.0/tcp/0"])
                                     for _ in range(8)))
        stop, dialed = asyncio.Event(), [0]
        member = sys.argv[1].split("/")[-1]
        tasks = [asyncio.create_task(hold_streams(p, member, admit.ADMIT_PROTOCOL, 2, stop, dialed=dialed,
                                                  first=admit.MAGIC + bytes(32), redial=0.01)) for p in ids]
        for _ in range(200):  # until all 16 streams were dialed (without the cap, 16 slots held from now on)
            if dialed[0] >= 16:
                break
            await asyncio.sleep(0.05)
        print("holding", dialed[0], flush=True)
        await asyncio.sleep(40)
    asyncio.run(main())
""")
FLOOD_NEWCOMER = textwrap.dedent("""
    import asyncio, sys, time
    from hivemind.p2p import P2P
    from lioncub_p2p.allreduce.admission import Admission
    from lioncub_p2p.swarm import admit
    async def main():
        p2p = await P2P.create(initial_peers=[sys.argv[1]], host_maddrs=["/ip4/0.0.0.0/tcp/0"])
        await asyncio.to_thread(sys.stdin.readline)  # started beside the attacker: go once it holds its streams
        start, tries = time.monotonic(), 0
        while time.monotonic() - start < 6.0:
            tries += 1
            try:
                verdict = await admit.ask_admission(p2p, sys.argv[1].split("/")[-1], Admission(), timeout=3.0)
                if verdict.admitted:
                    break
            except Exception:
                await asyncio.sleep(0.2)
        else:
            verdict = None
        print("admitted" if verdict else "not-admitted", f"{time.monotonic() - start:.2f} {tries}", flush=True)
        await p2p.shutdown()
    asyncio.run(main())
""")


@pytest.mark.slow
@pytest.mark.xdist_group("processes")  # ten daemons in three processes: not beside a trainer-process test
def test_throwaway_ids_on_another_host_cannot_keep_a_newcomer_behind_nat_out():
    """Eight peer ids on one host hold two admission streams each, each sending a hello and then
    nothing, re-dialing at once whenever one is closed: without the cap per network address they held
    all 16 of the member's slots and a newcomer found none free (its streams closed at once). Now the
    attacker's host holds two, and a newcomer behind a NAT router (counted under the router's
    address) is admitted at once. One network namespace per host."""
    why = missing_tools(nat=True)
    assert why is None, f"this test builds network namespaces and a NAT router: {why}"
    with HostNetwork() as net:
        member_host, attacker_host, home = net.add_public("m"), net.add_public("a"), net.add_private("n")
        member = subprocess.Popen(net.exec_prefix("m") + [sys.executable, "-c", FLOOD_MEMBER, member_host.ip],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
        attacker = newcomer_proc = None
        try:
            maddr = member.stdout.readline().strip()
            attacker = subprocess.Popen(net.exec_prefix("a") + [sys.executable, "-c", FLOOD_ATTACKER, maddr],
                                        stdout=subprocess.PIPE, text=True, start_new_session=True)
            newcomer_proc = subprocess.Popen(net.exec_prefix("n") + [sys.executable, "-c", FLOOD_NEWCOMER, maddr],
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                             start_new_session=True)
            holding = attacker.stdout.readline().split()
            newcomer = newcomer_proc.communicate("go\n", timeout=60)[0].split()
            member.stdin.write("report\n")
            member.stdin.flush()
            peak_by_address = member.stdout.readline().strip()
        finally:
            for proc in (member, attacker, newcomer_proc):
                if proc is not None:
                    proc.kill()
                    proc.wait(10)
    assert holding[0] == "holding" and int(holding[1]) >= 16, holding  # the flood was on
    # at its first try: without the cap, every try is closed at once until a silent stream of the attacker
    # times out (3 s) and a try lands in the gap before it re-dials
    assert newcomer[0] == "admitted" and newcomer[2] == "1", newcomer
    assert f"'{attacker_host.ip}': 2" in peak_by_address and home.public_ip != attacker_host.ip, peak_by_address

async def _store_raw_locally(_dht, node, key: str, subkey, value: bytes, expiration: float) -> None:
    node.protocol.storage.store_subkey(DHTID.generate(key), subkey, value, expiration)


def test_monitors_read_peer_records_in_bounded_time_and_junk_never_reaches_hiveminds_decoder():
    """Why reads hung: hivemind decodes each subkey's value inside its search (``finish_search``); an
    undecodable one raises there and the search's future is never set, so ``get`` waits for ever. A
    node without the validator (the rogue here) hangs on its own junk: the read gives up at its
    timeout. A node with it never stores the junk and ignores answers that carry it."""
    from hivemind import DHT

    from lioncub_p2p.swarm.membership import read_peer_records

    honest = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validators=[RunRecordValidator(["mon"])])
    rogue = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                initial_peers=[str(m) for m in honest.get_visible_maddrs()])
    try:
        exp = _expires(30)
        assert honest.store("mon.peers", seal(ALICE, "mon", "peers", exp, PAYLOAD), exp, subkey=ALICE.peer_id)
        rogue.run_coroutine(functools.partial(_store_raw_locally, key="mon.peers", subkey="junk", value=b"\xc1\xc1",
                                              expiration=exp))
        started = time.monotonic()
        records = read_peer_records(honest, "mon", timeout=10)
        assert time.monotonic() - started < 5 and list(records) == [ALICE.peer_id] and records[ALICE.peer_id].step == 5
        started = time.monotonic()
        assert read_peer_records(rogue, "mon", timeout=2) == {}  # hangs inside hivemind: bounded by our timeout
        assert 1.5 < time.monotonic() - started < 5
    finally:
        rogue.shutdown()
        honest.shutdown()


def test_group_history_can_be_read_on_one_thread_while_another_adds_groups():
    """The loop thread adds groups while the training thread looks up the group of its step: a reader
    must never see the dict change under it (the old in-place dict: KeyError from ``latest`` between
    its two reads, or "dictionary changed size during iteration")."""
    import threading

    history, errors, done = GroupHistory(keep=4), [], threading.Event()

    def read() -> None:
        try:
            while not done.is_set():
                history.for_step(10**9)
                _ = history.latest
        except Exception as e:  # what the old in-place dict did
            errors.append(e)

    readers = [threading.Thread(target=read) for _ in range(2)]
    for t in readers:
        t.start()
    try:
        for epoch in range(30_000):
            history.add(GroupRecord(epoch, epoch, (PeerSpec("a"),)))
    finally:
        done.set()
        for t in readers:
            t.join(10)
    assert not errors, errors[:1]
    assert sorted(history.by_epoch) == list(range(29_996, 30_000)) and history.latest.epoch == 29_999
