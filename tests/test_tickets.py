"""Invited runs: tickets signed by the run's authority, bound to one peer id each (swarm/tickets.py),
checked in the admission exchange, on every stream, in peer records and in group records."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest
from hivemind.p2p import P2P

from lioncub_p2p.allreduce.admission import Admission
from lioncub_p2p.identity import Identity, Verifier
from lioncub_p2p.swarm import admit
from lioncub_p2p.swarm.finding import refusal
from lioncub_p2p.swarm.membership import GroupHistory, GroupRecord, PeerRecord, PeerSpec, next_group
from lioncub_p2p.swarm.tickets import (TicketBook, TicketError, check, decode, issue, revocation_payload,
                                       revoked_serials)

RUN = "inv"


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys")
    return {name: Identity.load_or_create(folder / f"{name}.key") for name in ("authority", "other", "a", "b", "c")}


def test_a_ticket_round_trips_and_admits_only_its_peer_in_its_run_until_it_expires_or_is_revoked(keys):
    authority, peer = keys["authority"], keys["a"].peer_id
    ticket = issue(authority, RUN, peer, days=2, max_weight=10)
    again = decode(ticket.text(), Verifier())
    assert again == ticket and decode(ticket.encode(), Verifier()) == ticket
    ok = dict(run_id=RUN, authority=authority.peer_id, peer_id=peer)
    assert check(again, **ok) is None
    assert "not by the run's authority" in check(again, **{**ok, "authority": keys["other"].peer_id})
    assert "for run inv" in check(again, **{**ok, "run_id": "another"})
    assert f"for peer {peer}" in check(again, **{**ok, "peer_id": keys["b"].peer_id})
    assert "expired" in check(again, **ok, now=time.time() + 3 * 86400)
    assert "revoked" in check(again, **ok, revoked={ticket.serial})
    # the authority is whoever's key signed it: a ticket signed by another key names that key's id
    forged = issue(keys["other"], RUN, peer, days=2, max_weight=10)
    assert decode(forged.text(), Verifier()).authority == keys["other"].peer_id


@pytest.mark.parametrize("damage", ["payload", "signature", "text", "prefix", "size"])
def test_a_damaged_or_altered_ticket_is_refused_with_one_line(keys, damage):
    ticket = issue(keys["authority"], RUN, keys["a"].peer_id, days=2, max_weight=10)
    raw = ticket.encode()
    if damage == "payload":  # a holder raising its own weight bound breaks the signature
        data = raw.replace(b'"max_weight":10.0', b'"max_weight":99.0')
        assert data != raw
    elif damage == "signature":
        data = raw[:-3] + bytes(b ^ 1 for b in raw[-3:])
    elif damage == "text":
        data = ticket.text()[:-20] + "!!!!"
    elif damage == "prefix":
        data = ticket.text().removeprefix("lioncub-ticket:")
    else:
        data = b"\x81" * 5000
    with pytest.raises(TicketError) as e:
        decode(data, Verifier())
    assert "\n" not in str(e.value)


def test_the_book_learns_only_valid_tickets_caps_weights_and_follows_revocations(keys):
    authority = keys["authority"]
    mine = issue(authority, RUN, keys["a"].peer_id, days=1, max_weight=5)
    book = TicketBook(RUN, authority.peer_id, own=mine)
    assert book.refusal(keys["a"].peer_id) is None and book.own == mine.encode()
    b_ticket = issue(authority, RUN, keys["b"].peer_id, days=1, max_weight=3)
    assert "no ticket" in book.refusal(keys["b"].peer_id) and not book.known(keys["b"].peer_id)
    assert "for peer" in book.learn(keys["c"].peer_id, b_ticket.text())  # someone else's ticket
    assert book.learn(keys["b"].peer_id, b_ticket.text()) is None
    assert book.known(keys["b"].peer_id) and book.max_weight(keys["b"].peer_id) == 3.0
    assert "not by the run's authority" in book.learn(keys["c"].peer_id, issue(keys["other"], RUN, keys["c"].peer_id,
                                                                                days=1, max_weight=1).text())
    assert book.refusal(keys["c"].peer_id) is not None
    book.revoke(revoked_serials(revocation_payload([b_ticket.serial])))
    assert "revoked" in book.refusal(keys["b"].peer_id) and book.known(keys["b"].peer_id)
    admission = Admission(RUN, invitations=book)
    assert admission.reason(keys["a"].peer_id, b"") is None
    assert "revoked" in admission.reason(keys["b"].peer_id, b"") and admission.may_list(keys["b"].peer_id)
    assert not admission.may_list(keys["c"].peer_id) and not admission.open


async def _exchange(member_book: TicketBook | None, newcomer_book: TicketBook | None, *, member_key: Identity,
                    newcomer_key: Identity) -> admit.Verdict:
    member = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=member_key.path,
                              nat_port_map=False, auto_nat=False)
    newcomer = await P2P.create(initial_peers=[str(m) for m in await member.get_visible_maddrs()],
                                host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=newcomer_key.path,
                                nat_port_map=False, auto_nat=False)
    try:
        server = admit.AdmitServer(member, Admission(RUN, invitations=member_book), lambda pid: None)
        await server.start()
        return await admit.ask_admission(newcomer, member_key.peer_id, Admission(RUN, invitations=newcomer_book))
    finally:
        await asyncio.gather(member.shutdown(), newcomer.shutdown())


def test_k_tickets_admit_k_identities_over_real_streams_and_the_member_proves_its_own(keys):
    """An attacker holding k=2 tickets owns k+1 identities: the third is refused whatever ticket it shows
    (a ticket is bound to its peer id, which libp2p authenticates), and so is every identity in the
    member's stream checks (``Admission.reason``). A member without the authority's ticket does not
    prove itself to a newcomer, whose group from it is then ignored."""
    authority = keys["authority"]
    member_ticket = issue(authority, RUN, keys["c"].peer_id, days=1, max_weight=1)
    tickets = {name: issue(authority, RUN, keys[name].peer_id, days=1, max_weight=1) for name in ("a", "b")}
    member_book = TicketBook(RUN, authority.peer_id, own=member_ticket)

    def newcomer(name: str, ticket=None) -> TicketBook:
        return TicketBook(RUN, authority.peer_id, own=ticket if ticket is not None else tickets.get(name))

    async def scenario():
        verdicts = {}
        for name in ("a", "b"):
            verdicts[name] = await _exchange(member_book, newcomer(name), member_key=keys["c"], newcomer_key=keys[name])
        # the third identity ("other") shows each of the two tickets in turn, then none
        for shown in ("a", "b", None):
            verdicts[f"other+{shown}"] = await _exchange(member_book, newcomer("other", tickets.get(shown) if shown
                                                                               else None) if shown else
                                                         TicketBook(RUN, authority.peer_id),
                                                         member_key=keys["c"], newcomer_key=keys["other"])
        impostor = TicketBook(RUN, authority.peer_id)  # a "member" with no ticket of its own
        verdicts["impostor"] = await _exchange(impostor, newcomer("a"), member_key=keys["b"], newcomer_key=keys["a"])
        return verdicts

    verdicts = asyncio.run(scenario())
    for name in ("a", "b"):
        assert verdicts[name].admitted and verdicts[name].member_proved and verdicts[name].invited, verdicts[name]
    for shown in ("a", "b"):
        v = verdicts[f"other+{shown}"]
        assert not v.admitted and v.not_invited and f"for peer {keys[shown].peer_id}" in v.reason, v
    v = verdicts["other+None"]
    assert not v.admitted and v.not_invited and "no ticket" in v.reason
    line = refusal(v, RUN, keys["c"].peer_id, keys["other"].peer_id, False, invited=False)
    assert "invited-only" in line and f"--peer {keys['other'].peer_id}" in line
    assert not verdicts["impostor"].member_proved  # no ticket shown: its group is ignored (finding.py)
    admission = Admission(RUN, invitations=member_book)
    assert {k for k in ("a", "b", "other") if admission.reason(keys[k].peer_id, b"") is None} == {"a", "b"}


def test_records_carry_tickets_weights_are_capped_and_groups_listing_strangers_are_not_followed(keys):
    """A member learns tickets from peer records (capping each claimed weight at its ticket's bound) and
    drops records without one (they would count in the leader's reducer floor and the run's step). A
    group that lists a peer never shown to hold a ticket, or gives one more weight than its ticket
    allows, is followed by no path: the next group, a rival record for the same epoch, the group a
    newcomer asks admission of (``Admission.refuses_listing``). Break-checks: without the rule in
    ``next_group`` or ``preferred_rival``, these groups are followed."""
    import logging

    from lioncub_p2p.swarm.membership import Directory, preferred_rival
    from lioncub_p2p.swarm.records import RateLimitedLog

    authority = keys["authority"]
    book = TicketBook(RUN, authority.peer_id, own=issue(authority, RUN, keys["a"].peer_id, days=1, max_weight=1))
    directory = Directory.__new__(Directory)
    directory.tickets, directory.bad = book, RateLimitedLog(logging.getLogger("test"))
    b_ticket = issue(authority, RUN, keys["b"].peer_id, days=1, max_weight=4)
    record = directory._invited(PeerRecord(keys["b"].peer_id, weight=1e6, ticket=b_ticket.text()))
    assert record.weight == 4.0 and book.known(keys["b"].peer_id)
    assert directory._invited(PeerRecord(keys["other"].peer_id, weight=500.0)) is None  # no ticket: no record
    assert directory._invited(PeerRecord(keys["a"].peer_id, weight=0.5)).weight == 0.5  # its own, known here

    a, b, other = (keys[k].peer_id for k in ("a", "b", "other"))
    sort = lambda specs: tuple(sorted(specs, key=lambda m: m.peer_id))  # noqa: E731
    first = GroupRecord(0, 0, sort([PeerSpec(a), PeerSpec(b)]), author=a)
    history = GroupHistory()
    history.add(first)
    admission = Admission(RUN, invitations=book)
    admissible = lambda g: admission.refuses_listing(g.members)  # noqa: E731
    padded = GroupRecord(1, 5, sort([PeerSpec(a), PeerSpec(b), PeerSpec(other)]), previous=first, author=b)
    heavy = GroupRecord(1, 5, sort([PeerSpec(a), PeerSpec(b, weight=1e6)]), previous=first, author=b)
    assert "not admitted" in admissible(padded) and "more than its ticket's 4" in admissible(heavy)
    for group in (padded, heavy):
        assert next_group([group], history, step=0, window=100, admissible=admissible) is None
        assert next_group([group], history, step=0, window=100) == group  # the rule is what refuses it
    honest = GroupRecord(1, 5, first.members, previous=first, author=b)
    assert next_group([honest], history, step=0, window=100, admissible=admissible) == honest
    # a rival record for an epoch this peer holds (its author listed first) is held to the same rule
    before, after = sorted([a, b])  # the rival's author is listed first in the group both came from
    history.add(GroupRecord(1, 9, first.members, previous=first, author=after))
    rival = GroupRecord(1, 9, sort([PeerSpec(a), PeerSpec(b), PeerSpec(other)]), previous=first, author=before)
    assert preferred_rival([rival], history, step=0) == rival
    assert preferred_rival([rival], history, step=0, admissible=admissible) is None


def test_a_group_record_carries_the_tickets_of_the_members_it_adds(keys):
    """A member that has not yet read a newcomer's peer record follows the record that adds it: the
    record carries the newcomer's ticket (the leader's, from the admission exchange), learned before the
    listing rule (a loaded 2-core run split here: members refused the record, "not admitted"). Carried
    through the signed payload, in the nested previous record too; a ticket of another authority or for
    a peer the record does not list admits nobody. Break-check: without learning them, the record is
    refused."""
    from lioncub_p2p.swarm.records import RecordError
    from lioncub_p2p.swarm.upkeep import Upkeep

    authority = keys["authority"]
    a, b, c, other = (keys[k].peer_id for k in ("a", "b", "c", "other"))
    leader_book = TicketBook(RUN, authority.peer_id, own=issue(authority, RUN, a, days=1, max_weight=1))
    for pid in (b, c):
        assert leader_book.learn(pid, issue(authority, RUN, pid, days=1, max_weight=2).text()) is None
    sort = lambda specs: tuple(sorted(specs, key=lambda m: m.peer_id))  # noqa: E731
    leader = Upkeep.__new__(Upkeep)
    leader.admission = Admission(RUN, invitations=leader_book)
    first = GroupRecord(0, 0, sort([PeerSpec(a), PeerSpec(b)]), author=a,
                        tickets=leader.tickets_for([PeerSpec(a), PeerSpec(b)], None))
    members = sort([PeerSpec(a), PeerSpec(b), PeerSpec(c)])
    added = GroupRecord(1, 5, members, previous=first, author=a, tickets=leader.tickets_for(members, first))
    assert [pid for pid, _ in added.tickets] == [c] and {pid for pid, _ in first.tickets} == {a, b}
    carried = GroupRecord.authored(added.payload(), a)  # what a member reads from the DHT or a notice
    assert carried.tickets == added.tickets and carried.previous.tickets == first.tickets

    member_book = TicketBook(RUN, authority.peer_id, own=issue(authority, RUN, b, days=1, max_weight=1))
    member_book.learn(a, leader_book.text(a))
    member = Admission(RUN, invitations=member_book)
    assert "not admitted" in member.refuses_listing(carried.members)  # c's peer record not read yet
    assert member.refuses_listing(carried.members, carried.tickets) is None and member_book.known(c)

    forged = dict(carried.tickets)
    forged[c] = issue(keys["other"], RUN, c, days=1, max_weight=2).text()  # signed by someone else
    stranger_book = TicketBook(RUN, authority.peer_id)
    assert "not admitted" in Admission(RUN, invitations=stranger_book).refuses_listing(carried.members,
                                                                                       tuple(forged.items()))
    payload = added.payload()
    payload["tickets"] = [[other, leader_book.text(c)]]  # for a peer the record does not list
    with pytest.raises(RecordError, match="does not list"):
        GroupRecord.authored(payload, a)


def test_lioncub_invite_issues_shows_and_revokes(tmp_path, capsys):
    from lioncub_p2p.cli import invite as cli

    def invite(*args: str) -> subprocess.CompletedProcess:
        """The command in this process (an import of the package costs seconds per subprocess)."""
        code = 0
        try:
            cli.main(list(args))
        except SystemExit as e:
            code = 1 if e.code else 0
            print(e.code, file=sys.stderr)
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out.out, out.err)

    authority = invite("authority", "--key", str(tmp_path / "authority.key"))
    peer = invite("id", "--identity-path", str(tmp_path / "me.key"))
    assert authority.returncode == 0 and peer.returncode == 0
    assert Identity(tmp_path / "authority.key").peer_id == authority.stdout.strip()
    issued = invite("issue", "--key", str(tmp_path / "authority.key"), "--run-id", "demo", "--peer",
                    peer.stdout.strip(), "--days", "7", "--max-weight", "20", "--out", str(tmp_path / "t.txt"))
    assert issued.returncode == 0, issued.stderr
    ticket = decode((tmp_path / "t.txt").read_text(), Verifier())
    assert (ticket.run_id, ticket.peer_id, ticket.max_weight, ticket.authority) == \
        ("demo", peer.stdout.strip(), 20.0, authority.stdout.strip())
    shown = invite("show", str(tmp_path / "t.txt"))
    assert ticket.serial in shown.stdout and "in 7.0 days" in shown.stdout
    revoked = invite("revoke", "--serial", ticket.serial, "--list", str(tmp_path / "revoked.txt"))
    assert revoked.returncode == 0 and (tmp_path / "revoked.txt").read_text().split() == [ticket.serial]
    for bad in (invite("issue", "--key", str(tmp_path / "missing.key"), "--run-id", "demo", "--peer", "Qm1"),
                invite("show", str(tmp_path / "revoked.txt")), invite("revoke", "--serial", "xyz", "--list", "l")):
        assert bad.returncode == 1 and bad.stderr.count("error:") == 1 and "Traceback" not in bad.stderr, bad.stderr


def test_lioncub_invite_as_a_command_ends_a_mistake_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "lioncub_p2p.cli.invite", "issue", "--key", str(tmp_path / "no.key"),
                           "--run-id", "demo", "--peer", "Qm1"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [
        f"error: --key {tmp_path / 'no.key'} does not exist: create it with lioncub-invite authority --key "
        f"{tmp_path / 'no.key'}"]


@pytest.mark.slow
def test_an_invited_run_trains_with_its_ticket_holders_and_refuses_everyone_else_in_one_line(keys, tmp_path):
    """Two ticket holders train and end equal; a peer without a ticket is refused by the leader within one
    exchange (one line naming its peer id and the fix), one showing another peer's ticket stops before
    starting anything, and an expired ticket is refused by the group."""
    from lioncub_p2p import LionCub
    from lioncub_p2p.swarm import Swarm, SwarmError
    from lioncub_p2p.swarm.errors import AdmissionRefused
    from lioncub_p2p.tasks.digits import digits_task
    from tests.test_swarm import _config, _train_swarm

    authority = keys["authority"]
    holders = {name: issue(authority, "invited", keys[name].peer_id, days=1, max_weight=2).text() for name in "ab"}
    configs = [_config("invited", identity_path=keys[n].path, ticket=holders[n], join_timeout=8.0) for n in "ab"]
    out = _train_swarm(configs, 10)
    assert out[0][1] == out[1][1] and out[0][0] == out[1][0] == 10

    task = digits_task(0, hidden=64)
    first = Swarm(_config("invited2", identity_path=keys["a"].path, ticket=issue(
        authority, "invited2", keys["a"].peer_id, days=1, max_weight=2).text()))
    try:
        first.join(LionCub(task.make_model(0).named_parameters(), aggregator=first))
        maddrs = first.visible_maddrs()
        started = time.monotonic()
        with pytest.raises(AdmissionRefused, match="invited-only") as refused:
            Swarm(_config("invited2", initial_peers=maddrs, identity_path=keys["c"].path))
        assert time.monotonic() - started < 15.0 and "\n" not in str(refused.value)
        assert f"--peer {keys['c'].peer_id}" in str(refused.value) or keys["c"].peer_id in str(refused.value)
        with pytest.raises(SwarmError, match="the ticket is for peer id"):  # another's ticket: stops at once
            Swarm(_config("invited2", initial_peers=maddrs, identity_path=keys["c"].path, ticket=issue(
                authority, "invited2", keys["b"].peer_id, days=1, max_weight=2).text()))
        expired = issue(authority, "invited2", keys["c"].peer_id, days=1, max_weight=2, now=time.time() - 2 * 86400)
        with pytest.raises(AdmissionRefused, match="expired"):
            Swarm(_config("invited2", initial_peers=maddrs, identity_path=keys["c"].path, ticket=expired.text()))
        assert first.history.latest.member_ids() == [first.peer_id]
    finally:
        first.shutdown()


@pytest.mark.slow
def test_a_revoked_ticket_takes_its_holder_out_of_the_run(keys, monkeypatch):
    """The authority revokes one of three holders' tickets mid-run (its signed list, as a coordinator
    publishes it): members refuse its streams, the leader drops it, and its trainer stops with one line
    naming the revocation; the two others train on and end equal. Break-check: without the list being
    read (``Upkeep.read_revocations``), the revoked peer trains on to the end."""
    import threading

    from lioncub_p2p.swarm import upkeep as upkeep_module
    from lioncub_p2p.swarm.tickets import publish_revocations
    from tests.test_swarm import _config, _train_swarm

    monkeypatch.setattr(upkeep_module, "REVOKED_READ_S", 1.0)
    authority = keys["authority"]
    tickets = {n: issue(authority, "revoking", keys[n].peer_id, days=1, max_weight=2) for n in "abc"}
    configs = [_config("revoking", identity_path=keys[n].path, ticket=tickets[n].text(), join_timeout=8.0)
               for n in "abc"]
    stranded = {}

    def instrument(i, swarm):
        if i == 0:
            def revoke():
                time.sleep(4.0)  # mid-run: the three are stepping together by now
                publish_revocations(swarm.dht, "revoking", authority, [tickets["c"].serial])

            threading.Thread(target=revoke, daemon=True).start()
        if i == 2:
            stranded["swarm"] = swarm

    out = _train_swarm(configs, 120, instrument=instrument)
    assert out[0][1] == out[1][1] and out[0][0] == out[1][0] == 120, (out[0], out[1])
    why = stranded["swarm"].stranded or ""
    assert "revoked" in why and "\n" not in why and out[2][0] < 120, (why, out[2])


def test_revocations_add_up_and_a_reissued_ticket_replaces_a_revoked_one(keys):
    """Two lists (two coordinators, or a file republished after it went missing) never let a revoked
    holder back in; a ticket re-issued after a revocation is taken, and learning says what holds."""
    authority = keys["authority"]
    old = issue(authority, RUN, keys["b"].peer_id, days=10, max_weight=1)
    book = TicketBook(RUN, authority.peer_id)
    assert book.learn(keys["b"].peer_id, old.text()) is None
    book.revoke({old.serial})
    book.revoke(set())  # another coordinator's empty list
    assert "revoked" in book.refusal(keys["b"].peer_id)
    new = issue(authority, RUN, keys["b"].peer_id, days=1, max_weight=1)  # shorter than the revoked one
    assert book.learn(keys["b"].peer_id, new.text()) is None and book.refusal(keys["b"].peer_id) is None


def test_only_the_authority_signs_the_revocation_list_a_node_stores(keys):
    """Throwaway ids filling ``{run}.revoked``'s subkeys kept the authority's list out of budgeted nodes:
    a node that knows the run's authority takes that key's records from the authority alone."""
    import msgpack
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import get_dht_time

    from lioncub_p2p.swarm.records import RunRecordValidator, dht_key, seal

    def record(signer: Identity) -> DHTRecord:
        exp = get_dht_time() + 600
        value = seal(signer, RUN, "revoked", exp, revocation_payload([]))
        return DHTRecord(DHTID.generate(dht_key(RUN, "revoked")).to_bytes(), msgpack.packb(signer.peer_id),
                         msgpack.packb(value), exp)

    knows = RunRecordValidator([RUN], authorities={RUN: keys["authority"].peer_id})
    assert knows.validate(record(keys["authority"])) and not knows.validate(record(keys["other"]))
    assert RunRecordValidator([RUN]).validate(record(keys["other"]))  # an open run's node: any signer


def test_a_refusal_counts_only_from_a_member_that_proved_its_ticket(keys):
    """Throwaway ids publishing lure groups and answering "not invited" stopped ticket holders: a refusal
    from a member that showed no ticket of the run's authority is ignored (the newcomer asks the others),
    and a lure listing peers the run never admitted is not asked at all."""
    import logging
    from types import SimpleNamespace

    from lioncub_p2p.swarm import finding
    from lioncub_p2p.swarm.records import RateLimitedLog

    authority = keys["authority"]
    book = TicketBook(RUN, authority.peer_id, own=issue(authority, RUN, keys["a"].peer_id, days=1, max_weight=1))
    admission = Admission(RUN, invitations=book)
    verdicts = {"Lure": admit.Verdict(False, False, False, "its ticket is signed by someone else", invited=True,
                                       not_invited=True)}
    finder = finding.RunFinder.__new__(finding.RunFinder)
    asked = []

    class Loop:
        def run(self, coro, timeout):
            coro.close()
            return verdicts[asked[-1]]

    def ask(p2p, author, admission):
        asked.append(author)

        async def never():
            raise AssertionError
        return never()

    finder.loop, finder.p2p, finder.peer_id, finder.run_id, finder.admission = Loop(), None, "me", RUN, admission
    finder.upkeep = SimpleNamespace(records={}, admissible=lambda g: admission.refuses_listing(g.members))
    finder.log, finder.proved_to = RateLimitedLog(logging.getLogger("test")), set()
    lure = GroupRecord(3, 10, (PeerSpec("Lure"),), author="Lure")
    original = finding.ask_admission
    finding.ask_admission = ask
    try:
        book.learn("Lure", issue(authority, RUN, keys["b"].peer_id, days=1, max_weight=1).text())  # not its own
        assert finder.admitted_group([lure]) is None and asked == []  # never shown a ticket: not asked
        book._tickets["Lure"] = book._tickets[keys["a"].peer_id]  # as if listed with a ticket, then unproved
        assert finder.admitted_group([lure]) is None and asked == ["Lure"]  # asked, its refusal ignored
    finally:
        finding.ask_admission = original
