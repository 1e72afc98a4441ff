"""The training thread's side of a round (``swarm/pipeline.py``) on real vote nodes, without a Swarm."""
import concurrent.futures
import dataclasses
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lioncub_p2p.allreduce import PartReport, RoundReport
from lioncub_p2p.codecs import upload_codec
from lioncub_p2p.swarm.membership import GroupHistory, GroupRecord
from lioncub_p2p.swarm.pipeline import Pace, PipelineSettings, RoundInFlight, VotePipeline
from lioncub_p2p.testing import LocalSwarm

from reference import unpack


def _values(update: torch.Tensor, numel: int) -> np.ndarray:
    if update.dtype == torch.uint8:
        return np.where(unpack(update.numpy(), numel), 1.0, -1.0)
    return update.double().numpy()[:numel]


def test_split_off_means_most_other_reducers_ran_the_step_in_another_group():
    def report(*flags: bool, me: int = 0) -> RoundReport:
        parts = [PartReport(j, j, 8 * j, 8 * j + 8, "missing", other_group=f) for j, f in enumerate(flags)]
        return RoundReport("r", 7, me, parts)

    assert report(False, True, True, False).split_off()  # 2 of the 3 others
    assert not report(False, True, False, False).split_off()  # one reducer on a newer record: not this peer's fault
    assert not report(True, False, False, me=0).split_off()  # its own part does not count
    assert not report(True).split_off()  # alone: nobody else


@pytest.mark.slow
def test_a_step_run_in_an_older_group_is_received_again_from_the_group_that_holds_it():
    """Peer 3 read the record of epoch 5 (from step 7) late and ran step 7 in epoch 4's round; peers
    0-2 ran it in epoch 5's and refused its votes. Its pipeline, seeing most reducers refuse it as
    another group's and the newer record holding step 7, receives epoch 5's results without voting:
    it applies exactly what the others applied (its own part of that round missing for all alike),
    no split, no repair."""
    numel = 8 * 4000
    codec = upload_codec("sign")
    g = torch.Generator().manual_seed(3)
    codes = [codec.encode(torch.randn(numel, generator=g), seed=i) for i in range(4)]
    ran = {}

    async def in_the_older_group(node, spec, upload):
        older = dataclasses.replace(spec, round_id=b"epoch-4-step-7")
        ran["newer"], ran["older"] = spec, older
        node.prepare_round(older)
        ran["outcome"] = await node.run_round(older, upload)

    with LocalSwarm(4) as swarm:
        results = swarm.allreduce(codes, step=7, family="vote", behaviors={3: in_the_older_group})
        older_group = GroupRecord(4, 0, swarm.group)
        history = GroupHistory()
        history.add(GroupRecord(5, 7, swarm.group, previous=older_group))
        upkeep = SimpleNamespace(history=history, part_failed_at={}, count_round=lambda votes: None)
        pipeline = VotePipeline(peer_id=swarm.nodes[3].peer_id, settings=PipelineSettings("run", False, 1 << 30, 0, 60.0),
                                loop=swarm._loop, node=swarm.nodes[3], gather=None, upkeep=upkeep,
                                state=SimpleNamespace(judge=lambda *args, **kwargs: None),
                                verdicts=None, spec=lambda group, step: ran["newer" if group.epoch == 5 else "older"],
                                rejoin=None, in_background=None, log=None)
        pipeline.optimizer = SimpleNamespace(param_count=numel, buffer_bytes=numel // 8, step_count=7)
        done = concurrent.futures.Future()
        done.set_result(ran["outcome"])
        first_report = ran["outcome"][1]
        assert first_report.split_off(), first_report.parts
        update = pipeline.finish(RoundInFlight(pipeline, ran["older"], older_group, b"", time.perf_counter(), done))
        assert pipeline.last_report.followed and pipeline.repairs == 0
        applied = _values(results[0], numel)
        assert not np.all(applied == 0)
        for i in (1, 2):
            np.testing.assert_array_equal(_values(results[i], numel), applied)
        np.testing.assert_array_equal(_values(update, numel), applied)


def test_the_pace_is_the_median_step_ignores_a_stall_and_a_jump_and_follows_steps_that_stay_slow():
    pace = Pace()
    assert pace.step_s == 0.0
    t = 100.0
    for step, gap in zip(range(1, 8), [0.3, 0.3, 0.3, 7.0, 0.3, 0.3, 0.3]):  # a 7 s group change at step 4
        pace.started(step, t)
        t += gap
    assert pace.step_s == pytest.approx(0.3)  # the stall is in the window: their mean is 1.64
    t += 60
    pace.started(50, t)  # a state download's jump is no step
    assert pace.step_s == pytest.approx(0.3)
    for step in range(51, 54):  # a member gone: every round now waits 5 s for its part
        t += 5.0
        pace.started(step, t)
    assert pace.step_s == pytest.approx(5.0)


def test_a_round_in_which_nothing_of_the_others_counted_counts_nobodys_votes_in_a_group_above_two():
    """Every part missing but this peer's own, its own holding only its own vote: its link is the likelier
    fault, and counting the others' votes as missed would report all its group-mates (``count_round``).
    Where one other member alone votes (a group of two; three with a follower, which votes only in
    probe rounds) a stalled voter looks alike, and counts as it did."""
    from lioncub_p2p.allreduce import PartReport, PeerSpec, RoundReport, RoundSpec
    from lioncub_p2p.swarm.pipeline import StepStats, VotePipeline

    def observe(members: str, parts: list[PartReport], followers: str = "") -> list[dict]:
        counts = []
        fake = SimpleNamespace(last_report=None, peer_id="a", upkeep=SimpleNamespace(count_round=counts.append),
                               part_failed_at={}, optimizer=SimpleNamespace(param_count=8), stats=StepStats())
        group = tuple(PeerSpec(pid, 0.0 if pid in followers else 1.0, voter=pid not in followers) for pid in members)
        spec = RoundSpec(b"r" * 16, 3, group, 64)
        VotePipeline._observe(fake, spec, RoundReport("r", 3, 0, parts), 0.0)
        return counts

    alone = PartReport(0, 0, 0, 16, "ok", counted=[0])
    gone = [PartReport(k, k, 16 * k, 16 * k + 16, "missing") for k in (1, 2)]
    assert observe("abc", [alone, *gone]) == []
    heard = PartReport(0, 0, 0, 16, "ok", counted=[0, 1])
    assert observe("abc", [heard, *gone]) == [{"b": True, "c": False}]
    assert observe("ab", [alone, gone[0]]) == [{"b": False}]
    # a's only other voter c stalls while b follows: c's missed votes count (b's are late anyway)
    assert observe("abc", [alone, PartReport(1, 2, 16, 48, "missing")], followers="b") == [{"b": False, "c": False}]


def test_back_from_a_stall_far_behind_the_group_a_peer_downloads_the_state_once_instead_of_replaying():
    """``_skipped_after_stall``: only when its node refused rounds as held up (its training thread was
    away) and the median of the other members' announced steps is more than ``FAR_BEHIND_STEPS`` past
    its step; once per stall; a failed download falls back to the replay. A lying minority, a leaving
    member and a peer outside the group move nothing."""
    from lioncub_p2p.allreduce import PeerSpec
    from lioncub_p2p.swarm.follow import FAR_BEHIND_STEPS
    from lioncub_p2p.swarm.pipeline import StepStats

    group = GroupRecord(3, 0, tuple(PeerSpec(pid, 1.0) for pid in "mabc"))
    history = GroupHistory()
    history.add(group)
    downloads, prepared = [], []

    def catch_up(why, min_step, group, **kwargs):
        downloads.append(dict(min_step=min_step, group=group, **kwargs))
        if fail:
            raise TimeoutError("no donor answered")

    def pipeline(held: int | None, steps: dict[str, int], leaving: str = "") -> SimpleNamespace:
        records = {pid: SimpleNamespace(step=s, leaving=pid in leaving) for pid, s in steps.items()}
        return SimpleNamespace(node=SimpleNamespace(held_up_at=held), _far_skip_for=tried, peer_id="m",
                               upkeep=SimpleNamespace(history=history, records=records), skips=0, stats=StepStats(),
                               state=SimpleNamespace(catch_up=catch_up), optimizer=SimpleNamespace(step_count=20),
                               follow=SimpleNamespace(following=False), prepare=prepared.append)

    def skipped(p: SimpleNamespace) -> bool:
        nonlocal tried
        result = VotePipeline._skipped_after_stall(p, 21)
        tried = p._far_skip_for
        return result

    tried, fail = None, False
    far = 21 + FAR_BEHIND_STEPS + 1
    assert not skipped(pipeline(None, {"a": 400, "b": 400, "c": 400}))  # never held up: it replays
    assert not skipped(pipeline(21, {"a": far - 1, "b": far - 1, "c": 400}))  # the median is near enough
    assert not skipped(pipeline(21, {"a": 21, "b": 22, "c": 10**6}))  # one liar cannot start a download
    assert not skipped(pipeline(21, {"a": 21, "b": 400, "c": 400, "x": 400, "y": 400}, leaving="b"))  # x, y: not members
    assert downloads == [] and tried is None
    p = pipeline(21, {"a": far, "b": far, "c": 21, "m": 21})
    assert skipped(p) and p.skips == 1 and p.stats.repaired and prepared == [20]
    # from a donor within FAR_BEHIND_STEPS of the group's median step (not one barely past its own)
    assert downloads == [dict(min_step=far - FAR_BEHIND_STEPS, group=group, params_only=True, slow_link=False)]
    assert not skipped(pipeline(21, {"a": far, "b": far, "c": far}))  # once per stall
    fail = True
    p = pipeline(40, {"a": 400, "b": 400, "c": 400})  # a new stall: tried, failed, replays
    assert not skipped(p) and p.skips == 0 and len(downloads) == 2
    assert not skipped(pipeline(40, {"a": 400, "b": 400, "c": 400})) and len(downloads) == 2


def test_a_step_whose_stall_download_succeeded_starts_no_round_and_applies_nothing():
    """``_start``'s side of the rule above: after the download the step's update is None (the state was
    replaced), and no round is specified or started."""
    from lioncub_p2p.allreduce import PeerSpec
    from lioncub_p2p.optim import Resolved

    history = GroupHistory()
    history.add(GroupRecord(3, 0, tuple(PeerSpec(pid, 1.0) for pid in "mabc")))

    def no_round(group, step):
        raise AssertionError("a round was specified after the download")

    fake = SimpleNamespace(upkeep=SimpleNamespace(history=history), peer_id="m", stranded=None,
                           settings=SimpleNamespace(client_mode=False), _skipped_after_stall=lambda step: True,
                           spec=no_round)
    result = VotePipeline._start(fake, torch.zeros(1), 21)
    assert isinstance(result, Resolved) and result.wait() is None


def test_a_reducers_newer_epoch_claim_costs_at_most_one_group_read_per_period():
    """The epoch a reducer puts on its result chunks is not signed: a liar claiming a newer one on every
    chunk made every step of every member wait for a DHT read on the training thread. A claim within
    the epochs a member would follow is read at most once per ``EPOCH_READ_S``; one past them never;
    ``_again``'s recovery (most reducers ran the step in another group) reads whatever the limit
    (``finish``)."""
    import math
    from types import SimpleNamespace

    from lioncub_p2p.swarm import pipeline
    from lioncub_p2p.swarm.membership import MAX_EPOCH_GAP

    fake = SimpleNamespace(upkeep=SimpleNamespace(history=SimpleNamespace(latest=SimpleNamespace(epoch=7))),
                           _epoch_read=-math.inf)
    newer = lambda claim: VotePipeline._newer_epoch(fake, claim)  # noqa: E731
    assert not newer(7) and not newer(7 + MAX_EPOCH_GAP + 1) and not newer(2**63)
    assert newer(8)
    assert not newer(8) and not newer(9)  # within the period: no second read
    fake._epoch_read -= pipeline.EPOCH_READ_S
    assert newer(9)


def test_a_split_with_no_majority_is_settled_by_the_groups_author_only():
    """Every part counted every voter and no state has a majority: the voters other than the group's
    author repair from it (``VotePipeline._settles_split``). The author keeps its state; an author that
    cannot serve one (not a voter of the round, a client, refused as a liar) settles nothing, nor do
    missing votes, and a follower is not part of the split; nor does an author whose state the parts
    name provisional (a newcomer leading holds its donor's state, which is no evidence)."""
    from lioncub_p2p.allreduce import PeerSpec

    def part(k: int, counted: list[int], status: str = "ok", provisional: tuple = ()) -> PartReport:
        return PartReport(k, k, 0, 1, status, counted=counted, tag=b"\x00", tag_votes=1, provisional=list(provisional))

    def settles(me: str, author: str, members: tuple, *parts: PartReport, liar: bool = False) -> str | None:
        ids = [m.peer_id for m in members]
        spec = SimpleNamespace(group=members, voters=[i for i, m in enumerate(members) if m.voter], index_of=ids.index)
        r = SimpleNamespace(group=GroupRecord(3, 10, members, author=author), spec=spec)
        report = RoundReport("r", 10, [m.peer_id for m in members].index(me), list(parts))
        refused = {"m"} if liar else set()
        state = SimpleNamespace(donors=lambda group, only: [pid for pid in only if pid not in refused])
        return VotePipeline._settles_split(SimpleNamespace(peer_id=me, state=state), r, report)

    pair = (PeerSpec("a"), PeerSpec("m"))
    split = [part(0, [0, 1]), part(1, [0, 1])]
    assert settles("a", "m", pair, *split) == "m"  # the author's mate repairs from it...
    assert settles("m", "m", pair, *split) is None  # ...the author keeps its state, whatever its mate sends
    assert settles("a", "m", pair, part(0, [0, 1], "missing"), split[1]) is None  # a withheld vote: no split
    assert settles("a", "x", pair, *split) is None  # an author outside the round: nobody to follow
    assert settles("a", "m", (PeerSpec("a"), PeerSpec("m", client_mode=True)), *split) is None  # serves nothing
    with_follower = pair + (PeerSpec("f", 0.0, voter=False),)  # not a voter: no obstacle to the split...
    assert settles("a", "m", with_follower, *split, PartReport(2, 2, 0, 1, "empty")) == "m"
    assert settles("f", "m", with_follower, *split, PartReport(2, 2, 0, 1, "empty")) is None  # ...nor in it
    assert settles("a", "m", pair, *split, liar=True) is None  # an author it refuses: no download to fail
    trio = pair + (PeerSpec("z"),)
    assert settles("a", "m", trio, *[part(k, [0, 1, 2]) for k in range(3)]) == "m"
    assert settles("a", "m", trio, *[part(k, [0, 1, 2], provisional=[1]) for k in range(3)]) is None


def _finished(tags: dict[int, bytes], own: bytes, *, author: str = "a", me: str = "a", donors: frozenset = frozenset()):
    """``VotePipeline.finish`` on a round of group a, b, c whose three parts each counted every voter and
    name ``tags[part]`` with all three votes (a round this peer, ``me``, voted with tag ``own``); what it
    applies, and the state downloads it asked for. ``donors``: this peer's state is provisional, from them."""
    from lioncub_p2p.allreduce import PeerSpec
    from lioncub_p2p.allreduce.round import RoundSpec
    from lioncub_p2p.codecs import result_codec
    from lioncub_p2p.swarm.records import RateLimitedLog

    members = tuple(PeerSpec(pid) for pid in "abc")
    group = GroupRecord(1, 0, members, author=author)
    history = GroupHistory()
    history.add(group)
    catch_ups, judged = [], []
    state = SimpleNamespace(catch_up=lambda why, step, group, **kw: catch_ups.append((why, step, kw.get("only"))),
                            judge=lambda *args, **kwargs: judged.append(args), donors=lambda group, only: list(only),
                            provisional=SimpleNamespace(donors=donors) if donors else None)
    upkeep = SimpleNamespace(history=history, part_failed_at={}, count_round=lambda votes: None)
    pipeline = VotePipeline(peer_id=me, settings=PipelineSettings("run", False, 10, 0, 60.0),
                            loop=SimpleNamespace(call_soon=lambda f: None), node=None, gather=None, upkeep=upkeep,
                            state=state, verdicts=None, spec=lambda group, step: None, rejoin=None, in_background=None,
                            log=RateLimitedLog(__import__("logging").getLogger("test")))
    pipeline.optimizer = SimpleNamespace(param_count=64, buffer_bytes=8, step_count=5, in_flight=None)
    spec = RoundSpec(round_id=b"r", step=5, group=members, nbytes=24, upload=upload_codec("sign"),
                     result=result_codec("majority"))
    parts = [PartReport(k, k, 8 * k, 8 * k + 8, "ok", counted=[0, 1, 2], tag=tags[k], tag_votes=3) for k in range(3)]
    update = torch.ones(8, dtype=torch.uint8)
    done = concurrent.futures.Future()
    done.set_result((update, RoundReport("r", 5, "abc".index(me), parts)))
    applied = pipeline.finish(RoundInFlight(pipeline, spec, group, own, time.perf_counter(), done))
    return applied, catch_ups, judged


def test_a_peer_whose_state_differs_from_the_one_the_round_decided_for_repairs_instead_of_applying():
    """The digest check on the fast path: every part decides for "H" while this peer voted with "X": it
    applies nothing and catches up from a peer past the step (a repair); with its own tag it applies the
    round's update and downloads nothing. The round's decision is told to the state sync (``judge``)."""
    applied, catch_ups, judged = _finished({0: b"H", 1: b"H", 2: b"H"}, b"X")
    assert applied is None and catch_ups == [("repair", 6, None)]  # a state past this step
    assert judged and judged[0][2:4] == (b"H", b"X")
    applied, catch_ups, _ = _finished({0: b"H", 1: b"H", 2: b"H"}, b"H")
    assert applied is not None and torch.equal(applied, torch.ones(8, dtype=torch.uint8)) and catch_ups == []


def test_a_split_settled_by_the_author_confirms_a_provisional_state_the_author_served():
    """A flat split (every part counted every voter, no majority): a voter repairs from the group's
    author, unless its state is provisional and the author alone served it; that state is the author's,
    and the round is told to the state sync as deciding for it (a liar splitting every round from the
    author left such a newcomer provisional, not serving, and downloading the author's state each step).
    A provisional state from another donor repairs as any."""
    split = {0: b"A", 1: b"B", 2: b"C"}  # each part 3 of 3 for another tag: 1 of 3 parts each
    applied, catch_ups, judged = _finished(split, b"B", me="b", donors=frozenset({"a"}))
    assert applied is not None and catch_ups == [] and judged[0][2] == b"B"
    applied, catch_ups, judged = _finished(split, b"B", me="b", donors=frozenset({"c"}))
    assert applied is None and catch_ups == [("repair", 6, ["a"])] and judged[0][2] in (b"", None)
    applied, catch_ups, _ = _finished(split, b"B", me="b")
    assert applied is None and catch_ups == [("repair", 6, ["a"])]


def test_a_follower_asks_for_the_next_rounds_results_while_it_computes():
    """A followed step needs nothing of this peer's compute, so its results are asked for when the step is
    prepared (the end of the previous round), and the step takes that request (one ask, not two). Asked
    after the compute, a follower's step was a round trip slower than a voter's and it fell further
    behind each step (a NAT'd volunteer followed through a whole CI run). A probe step (it votes), a
    follower that still reduces a part, and a round that changed meanwhile (a new group) are asked as
    before. Break-check: without the early ask, nothing is asked at prepare."""
    from lioncub_p2p.aio import BackgroundLoop
    from lioncub_p2p.allreduce import PeerSpec
    from lioncub_p2p.allreduce.punctuality import PROBE_EVERY
    from lioncub_p2p.allreduce.round import RoundSpec
    from lioncub_p2p.codecs import result_codec
    from lioncub_p2p.swarm.records import RateLimitedLog

    asked = []

    class Node:
        def prepare_round(self, spec):
            pass

        async def follow_round(self, spec, tag=b""):
            asked.append(spec.step)
            return spec.round_id

    def pipeline_for(members, epoch=1):
        history = GroupHistory()
        history.add(GroupRecord(epoch, 0, members, author="a"))
        spec = lambda group, step: RoundSpec(round_id=b"r%d-%d" % (group.epoch, step), step=step,  # noqa: E731
                                             group=group.members, nbytes=8, upload=upload_codec("sign"),
                                             result=result_codec("majority"))
        pipeline = VotePipeline(peer_id="f", settings=PipelineSettings("run", False, 10, 0, 60.0), loop=loop,
                                node=Node(), gather=None, upkeep=SimpleNamespace(history=history, part_failed_at={}),
                                state=None, verdicts=None, spec=spec, rejoin=None, in_background=None,
                                log=RateLimitedLog(__import__("logging").getLogger("test")))
        pipeline.follow.following = True
        return pipeline, history, spec

    loop = BackgroundLoop()
    try:
        follower = (PeerSpec("a"), PeerSpec("b"), PeerSpec("f", 0.0))
        pipeline, history, spec = pipeline_for(follower)
        step = PROBE_EVERY + 1
        pipeline.prepare(step)
        future = pipeline._take_early(spec(history.latest, step))
        assert future is not None and future.result(10) == b"r1-%d" % step and asked == [step]
        pipeline.prepare(step + 1)
        history.add(GroupRecord(2, 0, follower, author="a"))  # a new group for that step: another round
        assert pipeline._take_early(spec(history.latest, step + 1)) is None
        pipeline.prepare(2 * PROBE_EVERY)  # a probe step: it votes
        assert pipeline._early is None
        reducing, _, _ = pipeline_for((PeerSpec("a"), PeerSpec("b"), PeerSpec("f")))
        reducing.prepare(step)
        assert reducing._early is None
    finally:
        loop.stop()
