"""Finished rounds kept for late requests (``allreduce/archive.py``), without a network."""
from lioncub_p2p.allreduce import PeerSpec, RoundSpec
from lioncub_p2p.allreduce.archive import KEPT_ROUND_BYTES, RoundArchive


def _spec(round_id: bytes, members: str) -> RoundSpec:
    return RoundSpec(round_id, 0, tuple(PeerSpec(pid) for pid in members), 64)


def test_members_of_kept_rounds_are_known_until_their_rounds_leave_by_time_or_memory():
    """A peer behind the group asks for rounds that left the live table: while one that lists it is
    kept, its streams get a member's caps (as a stranger's two streams per peer, its hedged result
    requests were refused and it applied zeros); once every such round is gone, it is a stranger again."""
    archive = RoundArchive(window=60.0, max_bytes=2 * KEPT_ROUND_BYTES)
    archive.keep(_spec(b"1", "ab"), {}, None)
    archive.keep(_spec(b"2", "bc"), {}, None)
    assert [archive.has_member(p) for p in "abcd"] == [True, True, True, False]
    archive.keep(_spec(b"2", "bc"), {}, None)  # kept again (served): counted once
    archive.keep(_spec(b"3", "cd"), {}, None)  # over the bytes: round 1 goes
    assert [archive.has_member(p) for p in "abcd"] == [False, True, True, True]
    expired = RoundArchive(window=0.0, max_bytes=1 << 20)
    expired.keep(_spec(b"1", "ab"), {}, None)
    assert not expired.has_member("a") and len(expired) == 0
