"""The round pipeline: the training thread's side of each step's vote.

``submit`` starts the vote of a step on the event loop (as a voter, as a follower that only receives
results, or through the all-gather baseline) and returns a ``RoundInFlight``; ``wait`` on it finishes
the round: it observes who was counted, decides whether this peer votes or follows next
(``follow.py``), repairs a divergence the consensus tag shows, skips ahead when nobody keeps the
round any more, and lets this peer's reducer prepare the next step's part. Anything that goes wrong
is a missed round (a zero update), never an exception out of ``optimizer.step()``.

Threads: every field here is the training thread's. The loop reads ``follow.following`` (to
announce it) and ``part_failed_at`` (a leader rests such a reducer, ``lead.py``); whose votes counted
goes to ``Upkeep.count_vote`` (counters the loop reads and resets). Repairs go through
``StateSync`` (``state_sync.py``), membership through ``Upkeep`` (``upkeep.py``).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..aio import BackgroundLoop
from ..allreduce import RoundReport, RoundSpec, VoteNode
from ..allreduce.allgather import GatherNode
from ..optim import Resolved, TrainingView
from . import snapshot
from .follow import FAR_BEHIND_STEPS, FollowRule, far_behind
from .errors import AdmissionRefused
from .lead import failed_reducers
from .membership import MAX_EPOCH_GAP, GroupRecord
from .records import RateLimitedLog
from .state_sync import StateSync
from .upkeep import Upkeep
from .verdicts import Verdicts

logger = logging.getLogger(__name__)

STRANDED_AFTER_S = 30.0  # with no live peer that can count votes for this long, a peer that cannot lead stops
PACE_STEPS = 5  # step gaps whose median is this peer's pace
SKIP_TRIES = 3  # failed state downloads in a row after which a follower that fell out stops
EPOCH_READ_S = 2.0  # at most one group read per this long on a reducer's claim of a newer epoch


@dataclass
class StepStats:
    step: int = 0
    peers: int = 0  # voters counted in this peer's view of the round
    group_size: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    result_down: int = 0  # result bytes from reducers as they came (deltas) and as plain results
    result_plain: int = 0
    seconds: float = 0.0  # the whole aggregate call
    round_s: float = 0.0  # the vote round alone (votes, reduction, results)
    wait_s: float = 0.0  # of which idle: own uploads done, no result byte yet (overlapped: blocked on the last vote)
    bits_per_param: float = 0.0
    repaired: bool = False
    momentum_synced: bool = False
    missed: bool = False  # the round failed here: no update applied
    followed: bool = False  # received the result without voting (behind the group, ``follow.py``)


@dataclass(frozen=True)
class PipelineSettings:
    run_id: str
    client_mode: bool
    full_digest_every: int  # the state tag hashes every parameter byte on these steps
    delay: int  # 1: overlapped rounds (the next vote starts before this one is applied)
    round_bound: float  # the longest a vote round may take before its voters give up on it


class Pace:
    """Recent seconds per step: the median gap between starts of the last ``PACE_STEPS`` consecutive
    steps (a download's jump is no step). The median, because a stall of seconds (a group change) is
    not the pace, and a leader that took it for one gave its next group too few steps' notice (the
    record came after its start); over a few steps, because steps that stay slow (a member gone, each
    round waiting for its part) are the pace, and a notice of many such steps keeps the group waiting."""

    def __init__(self, steps: int = PACE_STEPS):
        self._gaps: deque[float] = deque(maxlen=steps)
        self._last: tuple[float, int] | None = None
        self.step_s = 0.0  # 0: not known yet

    def started(self, step: int, now: float) -> None:
        if self._last is not None and step == self._last[1] + 1:
            self._gaps.append(now - self._last[0])
            self.step_s = statistics.median(self._gaps)
        self._last = (now, step)


class VotePipeline:
    def __init__(self, *, peer_id: str, settings: PipelineSettings, loop: BackgroundLoop, node: VoteNode,
                 gather: GatherNode | None, upkeep: Upkeep, state: StateSync, verdicts: Verdicts,
                 spec: Callable[[GroupRecord, int], RoundSpec], rejoin: Callable[[], None],
                 in_background: Callable, log: RateLimitedLog):
        self.peer_id, self.settings, self.loop, self.node, self.gather = peer_id, settings, loop, node, gather
        self.upkeep, self.state, self.verdicts, self.spec = upkeep, state, verdicts, spec
        self.rejoin, self.in_background, self.log = rejoin, in_background, log
        self.optimizer: TrainingView | None = None  # set at join: all this room reads of the optimizer
        self.stats = StepStats()
        self.repairs = 0
        self.skips = 0  # state downloads of a follower that fell out of the group's kept rounds
        self.rejoins = 0  # state downloads after this peer found itself dropped from the group
        self._skip_failures = 0
        self.follow = FollowRule()  # vote, or only receive results when this peer's votes come too late
        self.missed_rounds = 0
        self.last_report: RoundReport | None = None
        self.stranded: str | None = None  # why training cannot go on (every other peer left), once it cannot
        self._alone_since: float | None = None
        self.part_failed_at = upkeep.part_failed_at  # written here, read there
        self.current = ("vote", 0)  # the kind and step of the round in progress, for failpoints
        self._far_skip_for: int | None = None  # the held-up step of the stall a download was tried for
        self.pace = Pace()
        # (step, round id, future) of a followed round asked for while this peer still computes the step
        self._early: tuple[int, bytes, concurrent.futures.Future] | None = None
        self._epoch_read = -math.inf  # when a reducer's newer-epoch claim last cost a DHT read here

    def prepare(self, step: int) -> None:
        """Let this peer's reducer count others' votes for ``step`` while it still computes."""
        group = self.upkeep.history.for_step(step)
        if (group is not None and self.peer_id in group.member_ids() and self.gather is None
                and any(m.reduces for m in group.members)):  # else nobody counts: the round is missed, not prepared
            spec = self.spec(group, step)

            def prepare() -> None:
                try:
                    self.node.prepare_round(spec)
                except ValueError as e:  # already run (a repeated step after a repair): nothing to prepare
                    logger.debug("not preparing step %d: %s", step, e)

            self.loop.call_soon(prepare)
            self._follow_early(spec, group, step)

    def _follow_early(self, spec: RoundSpec, group: GroupRecord, step: int) -> None:
        """A step this peer follows needs nothing of its compute: ask for its results now, so that the
        request's round trip hides behind the compute. Asked after the compute, a follower's step was a
        round trip slower than a voter's (0.113 vs 0.092 s measured behind a NAT router), it fell
        further behind each step, the probes could not bring it back, and a NAT'd volunteer followed
        for a whole CI run. Not while it still reduces a part (its wait for votes would start early),
        nor with overlapped steps (``delay``)."""
        self._drop_early()
        mine = next((m for m in group.members if m.peer_id == self.peer_id), None)
        if self.settings.delay or mine is None or mine.reduces or not self.follow.follow_next(step):
            return
        self._early = (step, spec.round_id,
                       asyncio.run_coroutine_threadsafe(self.node.follow_round(spec), self.loop.loop))

    def _drop_early(self) -> None:
        if self._early is not None:
            self._early[2].cancel()
            self._early = None

    def _take_early(self, spec: RoundSpec) -> concurrent.futures.Future | None:
        """The followed round asked for early, if it is this one; any other is dropped."""
        early, self._early = self._early, None
        if early is not None and early[:2] == (spec.step, spec.round_id):
            return early[2]
        if early is not None:
            early[2].cancel()
        return None

    def submit(self, upload: torch.Tensor, step: int) -> "RoundInFlight | Resolved":
        """Start the vote of ``step``; the returned handle's ``wait()`` gives its update."""
        self.stats = StepStats(step=step)
        self.pace.started(step, time.monotonic())
        try:
            return self._start(upload, step)
        except Exception as e:  # never into the training loop: a missed round (the digest repairs a split)
            return Resolved(self.failed(step, e))

    def failed(self, step: int, e: Exception) -> torch.Tensor:
        self.log.warning(f"round:{type(e).__name__}", "step %d: the round failed here (%s: %s); applying no update",
                         step, type(e).__name__, e)
        return self._missed(step)

    def _missed(self, step: int) -> torch.Tensor:
        self.missed_rounds += 1
        self.stats.missed = True
        try:
            self.prepare(step + 1)
        except Exception as e:
            logger.debug("not preparing step %d: %s", step + 1, e)
        return torch.zeros(self.optimizer.buffer_bytes * 8)

    def _start(self, upload: torch.Tensor, step: int) -> "RoundInFlight | Resolved":
        if self.stranded is not None:  # the trainer stops at its next step; nothing to vote or rejoin meanwhile
            self._drop_early()
            return Resolved(None)
        group = self.upkeep.history.for_step(step)
        if group is None or self.peer_id not in group.member_ids():
            logger.warning("step %d: this peer is not in the group (dropped after a stall?): rejoining", step)
            try:
                self.rejoin()
                self.rejoins += 1
            except AdmissionRefused as e:  # revoked, expired: training on alone would only look like training
                self.stranded = str(e)
            except Exception as e:  # keep the training loop alive; the next step tries again
                logger.warning("rejoining failed: %s", e)
                self.check_stranded(step)
            return Resolved(None)
        if self.settings.client_mode:  # it cannot lead: once no peer that can is left, it must stop
            self.check_stranded(step)
        if self._skipped_after_stall(step):
            return Resolved(None)
        spec = self.spec(group, step)
        tag = snapshot.state_tag(self.optimizer, full=step % self.settings.full_digest_every == 0)
        self.current = ("vote", step)
        started = time.perf_counter()
        future = self._take_early(spec)  # a followed round, asked for while this peer computed
        if future is None:
            if self.gather is not None:  # the D-Lion baseline: everyone votes
                coro = self.gather.run_round(spec, upload, tag)
            elif self.follow.follow_next(step):
                coro = self.node.follow_round(spec, tag)
            else:  # a follower's probe vote recovers what it misses as it follows: each part once
                coro = self.node.run_round(spec, upload, tag, one_at_a_time=self.follow.following,
                                           provisional=self.state.provisional is not None)
            future = asyncio.run_coroutine_threadsafe(coro, self.loop.loop)
        if self.settings.delay:  # the next vote may start before this one ends: let its part count votes already
            self.prepare(step + 1)
        return RoundInFlight(self, spec, group, tag, started, future)

    def check_stranded(self, step: int) -> None:
        """Set ``stranded`` once no other live peer that can count votes and lead has been seen for
        ``STRANDED_AFTER_S`` (records expire within seconds of a peer's death; the delay rides out
        a DHT that answers nothing for a while)."""
        others = [r for pid, r in self.upkeep.records.items()
                  if pid != self.peer_id and not r.leaving and not r.client_mode]
        if others:
            self._alone_since = None
            return
        if self._alone_since is None:
            self._alone_since = time.monotonic()
        elif time.monotonic() - self._alone_since > STRANDED_AFTER_S:
            self.stranded = (f"no peer of run {self.settings.run_id} that can count votes is left (this peer is "
                             f"at step {step}{' and in client mode' * self.settings.client_mode}): nothing to "
                             f"train with")

    def finish(self, r: "RoundInFlight") -> torch.Tensor | None:
        """The training thread's side of a round that ended: observe it, repair a divergence it shows."""
        step, group, tag = r.spec.step, r.group, r.tag
        blocked = time.perf_counter()
        try:
            update, report = r.future.result(timeout=r.time_left())
        except Exception as e:  # never into the training loop: apply nothing; the digest repairs us next step
            r.future.cancel()
            logger.warning("step %d: the vote round failed (%s: %s); applying no update", step, type(e).__name__, e)
            self.state.judge(r.started, step, None, tag, whole=False, full=False)
            return self._missed(step)
        # a group change we have not seen: fetch it now (always when most reducers ran the step in another
        # group: the record came late, and ``_again`` needs it)
        if report.split_off() and report.group_epoch > self.upkeep.history.latest.epoch \
                or self._newer_epoch(report.group_epoch):
            try:
                self.loop.run(self.upkeep.refresh_group(), timeout=10)
            except Exception as e:
                logger.info("group refresh failed: %s", e)
        holder = self.upkeep.history.for_step(step)
        if (not r.again and self.gather is None and report.split_off() and holder is not None
                and holder.epoch > group.epoch and self.peer_id in holder.member_ids()):
            if report.caught:
                self.in_background(self.verdicts.act_on(list(report.caught)))
            return self._again(r, holder)
        self._observe(r.spec, report, r.started)
        if self.gather is None and not r.again:  # a step received again says nothing of this link's pace
            self._follow_or_vote(report)
        if self.follow.fell_out(report):  # nobody keeps this round any more: skip ahead to a peer's state
            return self.skip_ahead(step, group, r)
        if self.settings.delay:  # what the step waited for: the part of the round that compute did not hide
            self.stats.wait_s = time.perf_counter() - blocked
        # a two-level group is not the whole population: a split inside it is the second level's to settle
        flat = not r.spec.combine
        consensus, parts, expected = report.tag_majority(r.spec.voters, tag if flat else None)
        # what the round decided says whether a state caught up lately was the run's (``StateSync.judge``); a
        # flat split with no majority is settled by the group's author's state (``_settles_split``)
        split = flat and not consensus and report.split_everywhere(r.spec.voters)
        # the author's state settles a split: its own, and a provisional state it served (a liar splitting
        # every round from the author and a newcomer, whose tag counts for no state, left the newcomer
        # provisional for good); no power the split rule did not already give the author
        sides = split and (r.group.author == self.peer_id
                           or (loaded := self.state.provisional) is not None and loaded.donors == {r.group.author})
        # (whole: a flat round's parts all here; a two-level round's parts come from the second level, whose
        # missing ones are not this peer's alone)
        self.state.judge(r.started, step, tag if sides else consensus, tag,
                         whole=not flat or not any(p.status == "missing" for p in report.parts),
                         full=step % self.settings.full_digest_every == 0, apart=split)
        author = self._settles_split(r, report) if flat and not consensus and not sides else None
        if consensus and consensus != tag or author:
            if author:
                logger.warning("step %d: no state is held by most of the group (every part counted every vote): "
                               "repairing from the group's author %s", step, author)
            else:
                logger.warning("step %d: parameters differ from the state %d of %d parts decide for: repairing "
                               "from a peer", step, parts, expected)
            # a two-level group may have diverged as a whole: its own members are the last donors asked
            own = [m.peer_id for m in r.spec.group] if r.spec.combine else []
            try:  # from a peer past the step in progress (overlapped: the next one, whose vote is out)
                self.state.catch_up("repair", self._past(r), group, params_only=True, last=own,
                                    slow_link=self.follow.following, only=[author] if author else None)
            except Exception as e:  # apply nothing: still diverged, so the next round tries again
                logger.warning("step %d: repair failed (%s); retrying next step", step, e)
                return self._missed(step)
            self.repairs += 1
            self.stats.repaired = True
            self.prepare(self.optimizer.step_count)
            return None
        self.prepare(step + 1)
        return update

    def _settles_split(self, r: "RoundInFlight", report: RoundReport) -> str | None:
        """The member this voter repairs from when its flat group split with no majority
        (``RoundReport.split_everywhere``): the group's author, who keeps its state, when it is another
        voter this peer may download from. Any rule on the tags alone let any lying member of a pair win:
        it picks the tag that sorts first. Only the author can now: it could already drop its mate from
        the group. A follower (not a voter) is not part of the split; an author this peer refuses (a
        liar) leaves the split to the next rounds rather than failing a download every step, and so does
        an author whose state is provisional (a newcomer leading holds its donor's state, not evidence)."""
        author = r.group.author
        spec = next((m for m in r.spec.group if m.peer_id == author), None)
        if author == self.peer_id or spec is None or not spec.voter or spec.client_mode \
                or report.peer not in r.spec.voters or not report.split_everywhere(r.spec.voters):
            return None
        index = r.spec.index_of(author)
        if any(index in p.provisional for p in report.parts):
            return None
        return author if self.state.donors(r.group, only=[author]) else None

    def _past(self, r: "RoundInFlight") -> int:
        """The first step a donor's state must be at to replace this peer's after round ``r``: past the step
        in progress, unless ``r`` is the last round in flight and no step follows (``LionCub.flush``, at
        the run's end: nobody goes past it there, and a repair asking for it waited the whole download
        bound, then applied nothing and settled apart from the group)."""
        return self.optimizer.step_count + (self.optimizer.in_flight is not (r.origin or r))

    def _newer_epoch(self, claimed: int) -> bool:
        """Whether a reducer's claim of a newer group epoch is worth a DHT read on the training thread now:
        the claim is not signed, so a liar claiming one every step made every step wait for a read. At
        most one read per ``EPOCH_READ_S``, and never for a claim past what a member would follow."""
        latest = self.upkeep.history.latest.epoch
        if not latest < claimed <= latest + MAX_EPOCH_GAP or time.monotonic() - self._epoch_read < EPOCH_READ_S:
            return False
        self._epoch_read = time.monotonic()
        return True

    def _again(self, r: "RoundInFlight", holder: GroupRecord) -> torch.Tensor | None:
        """This peer ran ``step`` in an older group than the record that holds it (the record reached it
        late: a slow DHT store), and most reducers refused these votes: they ran it in the newer group.
        Receive the newer round's results without voting, as they applied them, instead of applying a
        split round and repairing (seen: a split step, then rounds at the join timeout and a cascade of
        drops). Its own part of that round had no votes here: it is missing for everyone alike."""
        step = r.spec.step
        logger.warning("step %d: ran in group epoch %d, but epoch %d holds that step (its record came late): "
                       "receiving that round's results instead", step, r.group.epoch, holder.epoch)
        spec = self.spec(holder, step)
        future = asyncio.run_coroutine_threadsafe(self.node.follow_round(spec, r.tag), self.loop.loop)
        return self.finish(RoundInFlight(self, spec, holder, r.tag, time.perf_counter(), future, again=True,
                                         origin=r))

    def _follow_or_vote(self, report: RoundReport) -> None:
        """Follow while this peer's votes come too late to count (``follow.py``); tell the group at once."""
        was = self.follow.following
        self.follow.after(report)
        self.stats.followed = report.followed
        if self.follow.following != was:
            logger.info("step %d: %s", report.step, "this peer's votes came too late to count: following (results "
                        "only, no votes)" if self.follow.following else "votes count again: voting")
            self.in_background(self.upkeep.announce())

    def skip_ahead(self, step: int, group: GroupRecord, r: "RoundInFlight | None" = None) -> torch.Tensor | None:
        """Download a newer state; after ``SKIP_TRIES`` failures in a row stop (``stranded``) rather than
        go on applying zeros: a follower nobody serves any more must not finish as if it had trained."""
        logger.warning("step %d: this peer fell so far behind that nobody keeps its round: downloading the state", step)
        try:
            self.state.catch_up("skip ahead", self.optimizer.step_count + 1 if r is None else self._past(r), group,
                                params_only=True, slow_link=self.follow.following)
        except Exception as e:
            self._skip_failures += 1
            logger.warning("step %d: skipping ahead failed (%s); retrying next step", step, e)
            if self._skip_failures >= SKIP_TRIES:
                self.stranded = (f"this peer fell behind the group and nobody holds the rounds it missed or a newer "
                                 f"state any more ({type(e).__name__}); its parameters are not the group's: start it "
                                 f"again to download the current state")
            return self._missed(step)
        self._skip_failures = 0
        self.skips += 1
        self.stats.repaired = True
        self.prepare(self.optimizer.step_count)
        return None

    def _skipped_after_stall(self, step: int) -> bool:
        """Back from a stall of the training thread (its node refused the group's rounds as held up) with
        the group far past it (``follow.far_behind``): download the state now rather than replay. Tried
        once per stall; a failed download falls back to the replay (and ``skip_ahead`` after it)."""
        held = self.node.held_up_at
        if held is None or held == self._far_skip_for:
            return False
        latest = self.upkeep.history.latest
        members = set(latest.member_ids()) - {self.peer_id}
        records = dict(self.upkeep.records)  # written on the loop
        ahead = far_behind(step, [r.step for pid, r in records.items() if pid in members and not r.leaving])
        if ahead is None:
            return False
        self._far_skip_for = held
        logger.warning("step %d: this peer's training was held up while the group went %d steps past it: "
                       "downloading the state instead of replaying the rounds", step, ahead)
        try:  # a donor barely past this step would leave it far behind, its flag cleared by the download
            self.state.catch_up("skip ahead after a stall", max(self.optimizer.step_count + 1,
                                                                 step + ahead - FAR_BEHIND_STEPS),
                                latest, params_only=True, slow_link=self.follow.following)
        except Exception as e:
            logger.warning("step %d: downloading the state failed (%s); replaying the rounds", step, e)
            return False
        self._skip_failures = 0
        self.skips += 1
        self.stats.repaired = True
        self.prepare(self.optimizer.step_count)
        return True

    def _observe(self, spec: RoundSpec, report: RoundReport, started: float) -> None:
        self.last_report = report
        if report.caught:  # checked and acted on in the background (evidence checks recount, reports dial)
            self.in_background(self.verdicts.act_on(list(report.caught)))
        received = [p for p in report.parts if p.status in ("ok", "recovered")]
        counted = set().union(*(set(p.counted) for p in received)) if received else set()
        # a round in which nothing of any other member counted here (no vote, no part) says more about this
        # peer's own link than about their votes, unless one other member alone votes (a follower sends no
        # votes but in probe rounds): then its stall looks alike
        others = {i: member for i, member in enumerate(spec.group) if member.peer_id != self.peer_id}
        if counted & others.keys() or sum(member.voter for member in others.values()) <= 1:
            self.upkeep.count_round({member.peer_id: i in counted for i, member in others.items()})
        # a follower's parts come from archives: a missing one says little
        if not report.followed:
            for pid in failed_reducers(report.parts, spec.group, self.peer_id, two_level=bool(spec.combine)):
                self.part_failed_at[pid] = time.monotonic()
        numel = self.optimizer.param_count
        self.stats.peers = max((len(p.counted) for p in received), default=0)
        self.stats.group_size = len(spec.group)
        self.stats.bytes_up, self.stats.bytes_down = report.bytes_up, report.bytes_down
        self.stats.result_down, self.stats.result_plain = report.result_down, report.result_plain
        self.stats.bits_per_param = 8 * (report.bytes_up + report.bytes_down) / max(numel, 1)
        self.stats.seconds = time.perf_counter() - started
        timings = report.timings
        self.stats.round_s = timings.get("total", 0.0)
        if "first_result" in timings:
            self.stats.wait_s = max(timings["first_result"] - timings.get("upload", 0.0), 0.0)


@dataclass
class RoundInFlight:
    """A vote round started by ``VotePipeline.submit`` (``optim.PendingUpdate``)."""

    pipeline: VotePipeline
    spec: RoundSpec
    group: GroupRecord
    tag: bytes
    started: float
    future: concurrent.futures.Future
    again: bool = False  # the same step received again in the group that holds it (``VotePipeline._again``)
    origin: "RoundInFlight | None" = None  # for ``again``: the round it stands in for (the one in flight)

    def wait(self) -> torch.Tensor | None:
        """On the training thread: the update to apply (zeros for a missed round; None after a repair)."""
        try:
            return self.pipeline.finish(self)
        except Exception as e:  # never into the training loop
            return self.pipeline.failed(self.spec.step, e)

    def time_left(self) -> float:
        """Until the round's bound, counted from its start (an overlapped round started a step ago)."""
        return max(self.started + self.pipeline.settings.round_bound - time.perf_counter(), 0.0)

    def peek(self, timeout: float) -> torch.Tensor:
        """From any thread: the update ``wait`` applies unless this peer must repair (then it is replaced).
        Waits at most ``timeout`` and never past the round's bound, after which ``wait`` gives up on it."""
        try:
            update, _ = self.future.result(timeout=min(timeout, self.time_left()))
            return update
        except concurrent.futures.TimeoutError:
            raise
        except Exception:  # a failed round applies no update
            return torch.zeros(self.spec.nbytes * 8)

    def done(self) -> bool:
        return self.future.done()
