"""RoundBook without a network: how a peer names its rounds and looks up the rounds others report on."""
from __future__ import annotations

import hashlib

import pytest

from lioncub_p2p.allreduce import PeerSpec, hierarchy
from lioncub_p2p.allreduce.audit import MAX_EVIDENCE_BYTES
from lioncub_p2p.allreduce.commit import MAX_HEADER_BYTES, MAX_LEAF_BYTES, leaf_bytes
from lioncub_p2p.codecs import result_codec, upload_codec
from lioncub_p2p.swarm.accuse import Accusation, Refused
from lioncub_p2p.swarm.membership import GroupHistory, GroupRecord
from lioncub_p2p.swarm.round_book import RoundBook, RoundShape
from lioncub_p2p.wire import PROTOCOL_VERSION


def _book(peer_id: str = "a", *, max_group: int = 3, liars: dict[str, str] | None = None,
          joined: bool = True) -> RoundBook:
    book = RoundBook("run", peer_id, GroupHistory(), liars=lambda: liars or {})
    if joined:
        book.shape = RoundShape(4096, upload_codec("sign"), result_codec("majority"), seed=0, max_group=max_group)
    return book


def test_round_ids_name_run_protocol_kind_step_and_epoch():
    """Every member derives the same id from the same record; any field changed names another round; a
    header signed under another protocol version names no round of this one."""
    book = _book()
    rid = book.round_id("vote", 7, 5)
    assert rid == hashlib.blake2b(f"run|{PROTOCOL_VERSION}|vote|7|5".encode(), digest_size=16).digest()
    assert rid != hashlib.blake2b(f"run|{PROTOCOL_VERSION - 1}|vote|7|5".encode(), digest_size=16).digest()
    assert len({rid, book.round_id("momentum", 7, 5), book.round_id("vote", 8, 5), book.round_id("vote", 7, 6),
                RoundBook("other", "a", GroupHistory(), dict).round_id("vote", 7, 5)}) == 5


def test_a_group_too_small_for_three_groups_votes_flat():
    """Of two groups neither is a majority that could tell a diverged one (a member leaving mid-round
    costs its group a part the other applies): with fewer than 3 groups the round is flat."""
    group = GroupRecord(5, 0, tuple(PeerSpec(pid) for pid in "abcdef"))
    assert _book(max_group=3).two_level_spec(group, 0, b"r") is None  # 2 groups of 3
    spec = _book(max_group=2).two_level_spec(group, 0, b"r")  # 3 groups of 2
    assert spec is not None and len(spec.group) == 2 and len(spec.combine[0].group) == 3
    flat = _book(max_group=2).spec(GroupRecord(5, 0, tuple(PeerSpec(pid) for pid in "abcd")), 0)
    assert [m.peer_id for m in flat.group] == list("abcd") and flat.nbytes == 4096  # 2 groups of 2: flat
    assert _book(max_group=0).two_level_spec(group, 0, b"r") is None  # the manifest asks for no groups
    assert _book(joined=False).two_level_spec(group, 0, b"r") is None  # not joined: no rounds of its own


def test_reports_on_a_two_level_groups_round_are_resolved_by_any_member_and_only_from_that_groups_members():
    """What a voter's audits catch in a two-level vote names its group's round (an id derived from the
    flat round's): the peer finds it among its own rounds (``step_of``), and any member, the leader in
    another group included, resolves it to the run's group (``round_of``) when the accused reduces that
    part there; only the accused's group-mates may report on it."""
    book = _book()
    group = GroupRecord(5, 0, tuple(PeerSpec(pid) for pid in "abcdefghi"))
    book.history.add(group)
    mine = book.spec(group, 7)
    flat = book.round_id("vote", 7, 5)
    assert mine.round_id != flat and book.step_of(mine.round_id) == 7 and book.step_of(flat) == 7
    specs = hierarchy.two_level_specs(flat, 7, hierarchy.two_level_layout(list("abcdefghi"), 5, 4096, 3), 4096,
                                      family="vote")
    other = next(spec for pid, spec in specs.items() if "a" not in [m.peer_id for m in spec.group])
    assert book.step_of(other.round_id) is None  # not this peer's own round
    reducer, mate = other.group[1].peer_id, other.group[0].peer_id
    stranger = next(pid for pid in "abcdefghi" if pid not in [m.peer_id for m in other.group])
    assert book.round_of(other.round_id, 7, 1, reducer) == (group, "vote")
    assert book.round_of(other.round_id, 7, 1, mate) is None  # it did not reduce that part
    assert book.round_of(other.round_id, 8, 1, reducer) is None  # another step's round
    report = Accusation("misrepresented", reducer, other.round_id, 1, 7, "margins")
    assert book.accusation_header(mate, report, 0) == 0
    with pytest.raises(Refused, match="not another member"):
        book.accusation_header(stranger, report, 0)


def test_an_accusation_of_a_flat_round_is_bounded_by_what_that_round_can_produce():
    """A lie's evidence is at most the part's result, a header and one opened leaf per voter: the
    accusation server refuses a longer stream before reading it. Before joining there is no bound."""
    book, group = _book(max_group=0), GroupRecord(2, 0, tuple(PeerSpec(pid) for pid in "abcd"))
    book.history.add(group)
    lie = Accusation("lie", "c", book.round_id("vote", 3, 2), 2, 3, "flipped")
    bound = book.accusation_header("a", lie, 0)
    spec = book.spec(group, 3, own=False)
    start, stop = spec.bounds[2]
    leaf = min(leaf_bytes(stop - start, 1), MAX_LEAF_BYTES)  # sign votes: one plane
    assert bound == spec.result_size(2, 4) + MAX_HEADER_BYTES + 8192 + 4 * (leaf + 1024) < MAX_EVIDENCE_BYTES
    assert book.step_of(spec.round_id) is None  # another's round read on the loop is not recorded as its own
    with pytest.raises(Refused, match="did not reduce"):
        book.accusation_header("a", Accusation("lie", "b", lie.round_id, 2, 3, "x"), 0)
    with pytest.raises(Refused, match="not another member"):
        book.accusation_header("c", lie, 0)  # the accused reporting itself
    book.shape = None
    with pytest.raises(Refused, match="not joined"):
        book.accusation_header("a", lie, 0)


def test_the_runs_members_for_the_fetch_gate_are_the_current_groups_not_caught_lying():
    """Other groups' members ask a combiner for second-level slices as members of the run, not as
    strangers (``VoteNode.in_run``): the members of the newest group record, less proven liars. Any
    group still kept counts for accusations (``is_member``)."""
    book = _book(liars={"c": "flipped a result"})
    older = GroupRecord(4, 0, tuple(PeerSpec(pid) for pid in "abcdxy"))
    book.history.add(GroupRecord(5, 10, tuple(PeerSpec(pid) for pid in "abcdef"), previous=older))
    assert [pid for pid in "abcdefxyz" if book.in_run(pid)] == ["a", "b", "d", "e", "f"]
    assert [pid for pid in "abcdefxyz" if book.is_member(pid)] == list("abcdefxy")


def test_own_rounds_are_kept_for_the_last_512_steps_ids():
    book = _book(max_group=0)
    group = GroupRecord(0, 0, tuple(PeerSpec(pid) for pid in "ab"))
    for step in range(600):
        book.spec(group, step)
    assert len(book.steps) == 512 and book.step_of(book.round_id("vote", 599, 0)) == 599
    assert book.step_of(book.round_id("vote", 87, 0)) is None and book.step_of(book.round_id("vote", 88, 0)) == 88


def test_each_members_group_is_the_one_its_two_level_round_is_voted_in():
    """What the leader and the reporters of missed votes read (``groups_of``) is the grouping the rounds
    use; a flat vote has none."""
    book = _book(max_group=3)
    group = GroupRecord(5, 0, tuple(PeerSpec(pid) for pid in "abcdefghi"))
    groups = book.groups_of(group)
    specs = book.two_level_specs(group, 7, book.round_id("vote", 7, 5))
    assert set(groups) == set("abcdefghi") and len(set(groups.values())) == 3
    for pid, mates in groups.items():
        assert pid in mates and set(mates) == {m.peer_id for m in specs[pid].group}
    assert book.groups_of(GroupRecord(5, 0, tuple(PeerSpec(pid) for pid in "abcdef"))) == {}  # 2 groups: flat
    assert _book(max_group=0).groups_of(group) == {} and _book(joined=False).groups_of(group) == {}
