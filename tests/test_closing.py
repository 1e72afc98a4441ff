"""The run's closing check (swarm/closing.py): whose final digests count, who is waited for, and the
digest a group settles on, against a count by hand. The network side is in test_swarm.py."""
from __future__ import annotations

import itertools

import pytest

from lioncub_p2p.allreduce import PeerSpec
from lioncub_p2p.swarm.closing import agreed, finals_at
from lioncub_p2p.swarm.membership import GroupRecord, PeerRecord

GROUP = GroupRecord(3, 0, tuple(PeerSpec(pid) for pid in "abcdef"))


def test_finals_count_members_at_the_step_and_wait_for_those_still_stepping_or_silent():
    records = {
        "b": PeerRecord("b", step=100, final="11"),
        "c": PeerRecord("c", step=97),  # still stepping
        "d": PeerRecord("d", step=100),  # at the step, its digest not announced yet
        "e": PeerRecord("e", step=100, final="22", leaving=True),  # stopped: neither counted nor waited for
        "x": PeerRecord("x", step=100, final="33"),  # not a member
        # "f" has no record: gone
    }
    finals, pending = finals_at(100, GROUP, records, "a", "11")
    assert finals == {"a": "11", "b": "11"}
    assert pending == ["c", "d"]
    # a member past the step trains another run's length: not this run's end
    finals, pending = finals_at(100, GROUP, {"b": PeerRecord("b", step=150, final="44")}, "a", "11")
    assert finals == {"a": "11"} and pending == []
    # this peer's own record (maybe stale) never replaces the digest it holds now
    finals, _ = finals_at(100, GROUP, {"a": PeerRecord("a", step=100, final="99")}, "a", "11")
    assert finals == {"a": "11"}


def _by_hand(finals: dict[str, str]) -> str:
    best = None
    for digest in sorted(set(finals.values())):  # ascending: the first of the most held wins a tie
        held = sum(d == digest for d in finals.values())
        if best is None or held > best[0]:
            best = (held, digest)
    return best[1]


def test_the_group_settles_on_the_digest_most_hold_and_of_a_tie_the_smallest():
    assert agreed({"a": "aa", "b": "bb", "c": "bb"}) == "bb"  # a majority wins over a smaller digest
    assert agreed({"a": "bb", "b": "aa", "c": "bb", "d": "aa"}) == "aa"  # 2:2, the 3:3 split seen in CI alike
    assert agreed({"a": "cc"}) == "cc"
    for values in itertools.product(["0a", "1b", "2c"], repeat=5):  # every assignment of 3 digests to 5 peers
        finals = dict(zip("abcde", values))
        assert agreed(finals) == _by_hand(finals), finals
    # every member reaches the same verdict from the same announcements, whatever its own digest
    finals = {"a": "0a", "b": "1b", "c": "1b", "d": "0a"}
    assert {agreed({**finals, me: finals[me]}) for me in finals} == {"0a"}
    with pytest.raises(ValueError):
        agreed({})
