"""What a newcomer makes of its admission verdicts (swarm/finding.py), without a network."""
from __future__ import annotations

import pytest

from lioncub_p2p.swarm.admit import Verdict
from lioncub_p2p.swarm.finding import refusal


@pytest.mark.parametrize("verdict, needs_secret, line", [
    (Verdict(True, False, False), False, None),  # an open run admits a peer without a secret
    (Verdict(True, True, True), True, None),  # a private run admits a peer holding its key
    (Verdict(True, False, True), True, None),  # the member did not prove the key: its group is ignored, no refusal
    (Verdict(False, False, True, "wrong or missing run secret"), False,
     "run r is private: pass its --run-secret (its leader L refused this peer)"),
    (Verdict(False, False, True, "wrong or missing run secret"), True,
     "run r refused this peer: wrong or missing run secret (asked L): check --run-secret"),
    (Verdict(False, False, False, "not on the run's allow-list"), False,
     "run r refused this peer: not on the run's allow-list (asked L): ask the run's organizer to add peer id me"),
    (Verdict(False, False, False, "too many admission attempts; try again later"), False,
     "run r refused this peer: too many admission attempts; try again later (asked L): check --run-secret"),
    (Verdict(True, False, False), True, "run r is open (no run secret): drop --run-secret"),
], ids=["open", "private", "unproved", "no-secret", "wrong-secret", "allow-list", "busy", "secret-to-open-run"])
def test_each_verdict_is_admission_or_one_line_naming_the_fix(verdict, needs_secret, line):
    assert refusal(verdict, "r", "L", "me", needs_secret) == line


def test_the_allow_list_reason_is_the_one_admission_sends():
    """The line names the peer id to add only if the member's reason is recognized."""
    from lioncub_p2p.swarm import admit
    from lioncub_p2p.swarm.finding import ALLOW_LIST_REASON

    assert admit._REASONS[admit.NOT_ALLOWED] == ALLOW_LIST_REASON


def test_a_busy_member_is_asked_again_later_never_taken_for_a_refusal():
    """A member busy with other newcomers (17 starting at once, or someone holding its exchange slots)
    answered "too many admission attempts": the newcomer took it for a refusal and stopped for good.
    It is now an author that did not answer yet (``unreachable``): the join waits and asks again."""
    import logging
    from types import SimpleNamespace

    from lioncub_p2p.allreduce import PeerSpec
    from lioncub_p2p.swarm import finding
    from lioncub_p2p.swarm.membership import GroupRecord
    from lioncub_p2p.swarm.records import RateLimitedLog

    finder = finding.RunFinder.__new__(finding.RunFinder)
    asked = []

    class Loop:
        def run(self, coro, timeout):
            coro.close()
            return verdicts[len(asked) - 1]

    def ask(p2p, author, admission):
        asked.append(author)

        async def never():  # the Loop above answers instead
            raise AssertionError
        return never()

    finder.loop, finder.p2p, finder.peer_id, finder.run_id = Loop(), None, "me", "r"
    finder.admission = SimpleNamespace(needs_secret=False, invited=False)
    finder.upkeep = SimpleNamespace(records={}, admissible=lambda group: None)
    finder.log, finder.proved_to = RateLimitedLog(logging.getLogger("test")), set()
    groups = [GroupRecord(3, 10, (PeerSpec(a),), author=a) for a in ("A", "B")]
    busy = Verdict(False, False, False, "too many admission attempts; try again later", busy=True)
    original = finding.ask_admission
    finding.ask_admission = ask
    try:
        verdicts = [busy, busy]
        assert finder.admitted_group(groups) is None and finder.unreachable == 2  # no AdmissionRefused
        verdicts, asked[:] = [busy, Verdict(True, False, False)], []
        assert finder.admitted_group(groups).author == "B"
        verdicts, asked[:] = [Verdict(False, False, False, "not on the run's allow-list")] * 2, []
        with pytest.raises(finding.AdmissionRefused):
            finder.admitted_group(groups)
    finally:
        finding.ask_admission = original
