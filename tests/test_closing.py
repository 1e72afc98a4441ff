"""The run's closing check (swarm/closing.py): whose final digests count, who is waited for, the digest
a group settles on (against a count by hand), and the download that refuses other parameters. The
network side is in test_swarm.py."""
from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from lioncub_p2p.aio import BackgroundLoop
from lioncub_p2p.allreduce import PeerSpec
from lioncub_p2p.allreduce.admission import OPEN
from lioncub_p2p.optim import LionCub
from lioncub_p2p.swarm import snapshot, state_sync
from lioncub_p2p.swarm.closing import agreed, finals_at, settled_on
from lioncub_p2p.swarm.membership import GroupRecord, PeerRecord
from lioncub_p2p.swarm.state_sync import StateSync
from lioncub_p2p.swarm.state_transfer import StateTransferError

GROUP = GroupRecord(3, 0, tuple(PeerSpec(pid) for pid in "abcdef"))


def test_finals_count_members_at_the_step_and_wait_for_those_still_stepping_or_silent():
    records = {
        "b": PeerRecord("b", step=100, final="11"),
        "c": PeerRecord("c", step=97),  # still stepping
        "d": PeerRecord("d", step=100),  # at the step, its digest not announced yet
        "e": PeerRecord("e", step=100, final="22", leaving=True),  # settled and left: its digest still counts
        "x": PeerRecord("x", step=100, final="33"),  # not a member
        # "f" has no record: gone
    }
    finals, pending = finals_at(100, GROUP, records, "a", "11")
    assert finals == {"a": "11", "b": "11", "e": "22"}
    assert pending == ["c", "d"]
    # left without a digest (stopped early): not waited for; a proven liar: neither counted nor waited for
    finals, pending = finals_at(100, GROUP, {"c": PeerRecord("c", step=97, leaving=True),
                                            "b": PeerRecord("b", step=100, final="22"),
                                            "d": PeerRecord("d", step=90)}, "a", "11", exclude={"b", "d"})
    assert finals == {"a": "11"} and pending == []
    # a member past the step trains another run's length: not this run's end
    finals, pending = finals_at(100, GROUP, {"b": PeerRecord("b", step=150, final="44")}, "a", "11")
    assert finals == {"a": "11"} and pending == []
    # this peer's own record (maybe stale) never replaces the digest it holds now
    finals, _ = finals_at(100, GROUP, {"a": PeerRecord("a", step=100, final="99")}, "a", "11")
    assert finals == {"a": "11"}


def _by_hand(finals: dict[str, str], first: str) -> str:
    """Count each digest's holders; of the most held, the one ``first`` holds if it is one of them,
    else the smallest."""
    held = {digest: sum(d == digest for d in finals.values()) for digest in finals.values()}
    best = [digest for digest in sorted(held) if held[digest] == max(held.values())]
    return finals[first] if first in finals and finals[first] in best else best[0]


def test_the_group_settles_on_the_digest_most_hold_and_of_a_tie_the_one_its_first_reducer_holds():
    assert agreed({"a": "aa", "b": "bb", "c": "bb"}, GROUP) == "bb"  # a majority wins over the first reducer
    assert agreed({"a": "bb", "b": "aa", "c": "bb", "d": "aa"}, GROUP) == "bb"  # 2:2 (the 3:3 seen in CI alike)
    assert agreed({"b": "bb", "c": "aa"}, GROUP) == "bb"  # "a" announced nothing: "b" is the first
    no_reducer_a = GroupRecord(3, 0, (PeerSpec("a", 0.0),) + GROUP.members[1:])  # on probation: no part
    assert agreed({"a": "aa", "b": "bb"}, no_reducer_a) == "bb"
    assert agreed({"x": "cc", "y": "bb"}, GROUP) == "bb"  # nobody of the group: the smallest
    for values in itertools.product(["0a", "1b", "2c"], repeat=5):  # every assignment of 3 digests to 5 peers
        finals = dict(zip("abcde", values))
        assert agreed(finals, GROUP) == _by_hand(finals, "a"), finals
        partial = dict(zip("bcde", values))  # "a" silent: "b" breaks ties
        assert agreed(partial, GROUP) == _by_hand(partial, "b"), partial
        # every member lists the announcements in its own order: the same verdict
        assert agreed(dict(reversed(list(finals.items()))), GROUP) == agreed(finals, GROUP)
    with pytest.raises(ValueError):
        agreed({}, GROUP)


def test_a_verdict_is_taken_once_no_member_still_to_announce_can_change_it():
    finals = {"a": "aa", "b": "aa", "c": "bb"}
    assert settled_on(finals, [], GROUP) == "aa"  # everyone announced
    assert settled_on(finals, ["d"], GROUP) is None  # 2 of 4: "d" could tie it (a strict majority is asked)
    assert settled_on({**finals, "e": "aa"}, ["d"], GROUP) == "aa"  # 3 of 5: nothing "d" says changes it
    assert settled_on({"a": "aa", "b": "aa"}, ["c", "d"], GROUP) is None  # 2 of 4
    assert settled_on({"c": "bb"}, ["a", "b"], GROUP) is None
    verdicts = 0
    for announced in range(1, 6):  # every split of the 6 members into announced and pending...
        for values in itertools.product(["0a", "1b", "2c"], repeat=announced):  # ...and every announcement
            finals, pending = dict(zip("abcdef", values)), list("abcdef"[announced:])
            verdict = settled_on(finals, pending, GROUP)
            held = max(sum(v == d for v in values) for d in values)
            assert (verdict is not None) == (2 * held > 6), (finals, pending)  # a strict majority of all six
            if verdict is not None:  # whatever the pending members announce later, the same verdict
                verdicts += 1
                for later in itertools.product(["0a", "1b", "2c", "3d"], repeat=len(pending)):
                    assert agreed({**finals, **dict(zip(pending, later))}, GROUP) == verdict, (finals, later)
    assert verdicts == 36  # the announcements where 4 or 5 members already hold one digest


def _sync_with(monkeypatch, served: tuple[int, bytes, bytes]) -> tuple[StateSync, LionCub, BackgroundLoop]:
    """A StateSync whose downloads all return ``served`` (step, blob, digest), as a donor would."""
    async def fake_download(*args, **kwargs):
        return served

    monkeypatch.setattr(state_sync, "download_state", fake_download)
    loop = BackgroundLoop("closing-test")
    sync = StateSync(p2p=None, loop=loop, run_id="r", peer_id="me", admission=OPEN,
                     upkeep=SimpleNamespace(records={}), liars=dict, max_uploads=1, join_timeout=5.0,
                     round_bound=5.0)
    model = torch.nn.Linear(4, 3)
    sync.optimizer = LionCub(model.parameters(), lr=1e-3)
    return sync, sync.optimizer, loop


def test_the_final_download_refuses_a_donor_whose_parameters_are_not_the_ones_settled_on(monkeypatch):
    """A holder that announced the digest the group settled on but serves other parameters (or another
    step) is refused before anything is loaded; the right ones load and hash to that digest."""
    torch.manual_seed(0)
    donor = LionCub(torch.nn.Linear(4, 3).parameters(), lr=1e-3)
    blob, digest = snapshot.encode(donor)
    group = GroupRecord(1, 0, (PeerSpec("me"), PeerSpec("donor")))
    for served, expect in [((0, blob, digest), bytes(16)),  # other parameters than those settled on
                           ((1, blob, digest), digest)]:  # the right ones, of a later step
        sync, mine, loop = _sync_with(monkeypatch, served)
        try:
            before = snapshot.params_digest(mine)
            with pytest.raises(StateTransferError, match="not the"):
                sync.catch_up("settle", 0, group, params_only=True, only=["donor"], expect=expect, within=5.0)
            assert snapshot.params_digest(mine) == before and sync.loads == 0
        finally:
            loop.stop()
    sync, mine, loop = _sync_with(monkeypatch, (0, blob, digest))
    try:
        sync.catch_up("settle", 0, group, params_only=True, only=["donor"], expect=digest, within=5.0)
        assert snapshot.params_digest(mine) == snapshot.params_digest(donor) == digest  # what records announce
        assert sync.loads == 1
    finally:
        loop.stop()
