"""A leader's group notice is checked as a DHT record is (group_notice.py): signed by its sender for
this run, unexpired, its author a member. In a swarm: tests/test_swarm.py
(test_members_that_cannot_read_group_records_follow_the_groups_their_leader_sends_them)."""
import pytest

from lioncub_p2p.allreduce import PeerSpec
from lioncub_p2p.identity import Identity, Verifier
from lioncub_p2p.swarm.group_notice import notice_of, open_notice
from lioncub_p2p.swarm.membership import GroupRecord
from lioncub_p2p.swarm.records import RecordError

LEADER, OUTSIDER = Identity.load_or_create(None), Identity.load_or_create(None)


def _group(author: Identity, members: tuple[str, ...]) -> GroupRecord:
    previous = GroupRecord(1, 0, tuple(PeerSpec(m) for m in members))
    return GroupRecord(2, 10, tuple(PeerSpec(m) for m in members), previous, author.peer_id)


def test_a_notice_opens_to_the_record_its_leader_signed():
    group = _group(LEADER, (LEADER.peer_id, "member"))
    opened = open_notice(notice_of(LEADER, "run", group, 60.0), "run", LEADER.peer_id, Verifier())
    assert opened == group and opened.author == LEADER.peer_id and opened.previous == group.previous


def test_notices_that_are_not_the_senders_own_record_for_this_run_are_refused():
    verifier = Verifier()
    group = _group(LEADER, (LEADER.peer_id, "member"))
    notice = notice_of(LEADER, "run", group, 60.0)
    with pytest.raises(RecordError, match="signature"):  # relayed by another peer under its own id
        open_notice(notice, "run", OUTSIDER.peer_id, verifier)
    with pytest.raises(RecordError, match="signature"):  # signed for another run
        open_notice(notice, "other-run", LEADER.peer_id, verifier)
    tampered = notice_of(LEADER, "run", group, 60.0)
    tampered.payload = tampered.payload.replace(b'"from_step":10', b'"from_step":99')
    with pytest.raises(RecordError, match="signature"):
        open_notice(tampered, "run", LEADER.peer_id, verifier)
    with pytest.raises(RecordError, match="expired"):
        open_notice(notice_of(LEADER, "run", group, -1.0), "run", LEADER.peer_id, verifier)
    with pytest.raises(RecordError, match="ahead"):  # no notice that outlives what a DHT record may
        open_notice(notice_of(LEADER, "run", group, 3600.0), "run", LEADER.peer_id, verifier)
    outside = _group(OUTSIDER, (LEADER.peer_id, "member"))  # well signed, but its author is not in it
    with pytest.raises(RecordError, match="not a member"):
        open_notice(notice_of(OUTSIDER, "run", outside, 60.0), "run", OUTSIDER.peer_id, verifier)
