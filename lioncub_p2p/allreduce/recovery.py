"""Recovery of a round's missed parts (``RecoveryMixin``, a base of ``VoteNode``): a part whose result
did not come from its reducer is asked of the reducer and the other members, hedged one at a time
(``_recover``), accepted only signed by its reducer; in a two-level round it is assembled from the
second level's slices, each signed by its combiner (``_recover_combined``, ``_fetch_slice``).
``_fetch`` (one ask on ``FETCH_PROTOCOL``) also serves the audits' slice comparisons (auditing.py).

Reads ``config``, ``p2p``, ``peer_id``, ``admission`` and ``_rounds`` (a second-level round this peer
combined itself); writes only the ``RoundState`` it recovers for (``received``, the report's parts).
Reads results with voting.py's ``_read_result``.

Runs on the event loop thread that owns the node's P2P, as everything in ``VoteNode``.
"""
from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque

from hivemind.p2p import PeerID

from ..wire import PROTOCOL_VERSION, WireError, pb, write_frame
from .archive import FORGOTTEN
from .round import PartResult
from .shared import FETCH_PROTOCOL, OTHER_GROUP, RoundState, logger


class RecoveryMixin:
    """Parts that did not come from their reducers: asked of the others, or of the second level."""

    async def _fetch(self, state: RoundState, i: int, j: int, answering: asyncio.Event | None = None) -> PartResult:
        """Part j's signed result of ``state``'s round, asked of member i (``FETCH_PROTOCOL``)."""
        spec = state.spec
        _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(spec.group[i].peer_id),
                                                                      FETCH_PROTOCOL)
        try:
            sent = await write_frame(writer, pb.FetchResult(version=PROTOCOL_VERSION, round_id=spec.round_id, part=j,
                                                            token=self.admission.token(self.peer_id), step=spec.step,
                                                            family=spec.family))
            state.report.bytes_up += sent
            return await self._read_result(reader, state, j, forwarded=True, answering=answering)
        finally:
            writer.close()  # after the last chunk: the member waits for this close before its own

    async def _recover_either(self, state: RoundState, j: int, *, one_at_a_time: bool,
                              transfer_s: float) -> PartResult | None:
        """A missing part: from its reducer or this group's members (``_recover``: its signed header
        carries the counted votes and the state tag a follower's repair rule reads), then, in a
        two-level round, from the second level (``_recover_combined``): its reducer did not answer, or
        it is this peer's own part and its group's votes fell below the quorum (nobody here has it)."""
        outcome = None
        if j != state.me:
            outcome = await self._recover(state, j, one_at_a_time=one_at_a_time, transfer_s=transfer_s)
        if outcome is None and state.spec.combine:
            outcome = await self._recover_combined(state, j, transfer_s)
            if outcome is not None:
                logger.info("round %s: part %d assembled from the second level", state.spec.round_id.hex()[:12], j)
                state.report.parts[j].note = "assembled from the second level's signed slices"
                state.report.parts[j].second_level = True
        return outcome

    async def _recover_combined(self, state: RoundState, j: int, transfer_s: float) -> PartResult | None:
        """Part j of a two-level round from its second level: part j's round among the groups' reducers
        of part j decides part j for every group, so when this group's reducer fails after combining (it
        left mid-round), its voters fetch that round's slices, each signed by the combiner that reduced
        it, from any of those reducers. Before, the group applied nothing there while the other groups
        applied the part: it diverged as a whole, and each member downloaded the state. The same when
        the group's votes for part j fell below its quorum (its reducer, still a combiner, sent no
        margins: the group's votes are left out of part j), the reducer itself included.

        The assembled part has no header of this group's round: it counts nobody and carries no state
        tag, and it is never forwarded (no single signature covers it). All within
        ``recovery_timeout`` plus ``transfer_s``; None if a slice is nowhere to be had (then no group
        has the part: a combiner that failed before sending its slice leaves it missing for everyone)."""
        combine = state.spec.combine[j]  # one per member (``RoundSpec``); None for a member with no part
        if combine is None:
            return None
        second = RoundState(combine, -1, state.report, None, {})  # what _read_result checks the slices against
        failed = state.spec.group[j].peer_id  # this group's reducer of part j: asked last
        own = [p.peer_id for p in combine.group].index(failed)
        skip = own if failed == self.peer_id else None  # this peer's own part: it never asks itself
        per_ask = self.config.recovery_timeout / 2 + transfer_s

        async def own_slice() -> tuple[int, PartResult] | None:
            local = self._rounds.get(combine.round_id) if skip is not None else None
            if local is not None and own in local.direct:  # this peer combined it: no need to ask
                with contextlib.suppress(asyncio.TimeoutError):
                    outcome = await asyncio.wait_for(asyncio.shield(local.direct[own]), per_ask)
                    if outcome is not None:
                        return own, outcome
            return await self._fetch_slice(second, own, per_ask, last=failed, skip=skip)

        async def fetch_all() -> list[PartResult] | None:
            # the failed reducer's own slice first: if it died before combining, nobody has it (every
            # group misses the part alike) and the other slices are not worth their bytes
            first = await own_slice()
            if first is None:
                return None
            rest = await asyncio.gather(*(self._fetch_slice(second, q, per_ask, last=failed, skip=skip)
                                          for q in range(len(combine.group)) if q != own))
            if any(r is None for r in rest):
                return None
            slices = [r[1] for r in rest]
            slices.insert(own, first[1])
            return slices

        try:
            slices = await asyncio.wait_for(fetch_all(), self.config.recovery_timeout + transfer_s)
        except asyncio.TimeoutError:
            return None
        if slices is None:
            return None
        wire = b"".join(s.wire for s in slices)
        a, b = state.spec.bounds[j]
        if len(wire) != b - a:  # each slice's size was checked against the second level's spec
            return None
        state.received[j] = (time.monotonic(), False)
        return PartResult(wire, [])

    async def _fetch_slice(self, second: RoundState, q: int, per_ask: float, *, last: str = "",
                           skip: int | None = None) -> tuple[int, PartResult] | None:
        """(combiner asked, slice q of a second-level round signed by its combiner): asked of that
        combiner first, then of the others in turn, ``last`` last, ``skip`` never, each within
        ``per_ask`` seconds; None if nobody gave it."""
        combiners = [p.peer_id for p in second.spec.group]
        for i in sorted(range(len(combiners)), key=lambda i: (combiners[i] == last, i != q, (i - q) % len(combiners))):
            if i == skip:
                continue
            try:
                return i, await asyncio.wait_for(self._fetch(second, i, q), per_ask)
            except Exception as e:
                logger.info("round %s: slice %d not from combiner %d: %s: %s", second.spec.round_id.hex()[:12], q, i,
                            type(e).__name__, e)
        return None

    async def _recover(self, state: RoundState, j: int, *, one_at_a_time: bool = False,
                       transfer_s: float = 0.0) -> PartResult | None:
        """Ask the other reachable members (the reducer first: its vote stream may have failed while it
        lives; last if it was just asked in vain) for part j's result; accept the first one its reducer signed.

        Hedged, never all at once: the next member is asked when the last one asked failed, or has not
        begun to answer (a checked header) within ``recovery_hedge_s`` while no byte of this round
        came in meanwhile, so a slow link downloads a part about once instead of once per member
        (asking all at once made a 1 Mbit/s peer time out on every copy and apply zeros where the
        others applied the part). All within ``recovery_timeout`` plus ``transfer_s``.
        ``one_at_a_time`` (a follower): no hedging, each member in turn within twice the recovery
        timeout (a member that has not started the round waits up to the join timeout before it
        refuses)."""
        spec = state.spec
        n = len(spec.group)
        # the reducer first, unless it was just asked in vain (``_ask_reducer``: a second ask would cost
        # another hedge); the others rotated, so that members spread their asks
        first = j not in state.asked
        askers = sorted((i for i, p in enumerate(spec.group) if i != state.me and not p.client_mode),
                        key=lambda i: ((i != j) == first, (i - state.me) % n))

        async def ask(i: int, answering: asyncio.Event | None = None) -> tuple[int, PartResult]:
            return i, await self._fetch(state, i, j, answering)

        def failed(i: int, e: BaseException) -> None:  # a refusal says why (kept in the report); else: gone
            if isinstance(e, WireError):
                logger.info("round %s: refused a result for part %d: %s", spec.round_id.hex()[:12], j, e)
                # only the part's own reducer speaks for it: any other member could say so of every part
                # and push a follower into a state download (``follow.FollowRule.fell_out``)
                state.report.parts[j].forgotten |= FORGOTTEN in str(e) and i == state.report.parts[j].reducer
                state.report.parts[j].other_group |= OTHER_GROUP in str(e)
            else:  # unreachable, timed out, gone
                logger.info("round %s: part %d not from member %d: %s", spec.round_id.hex()[:12], j, i,
                            type(e).__name__)

        if one_at_a_time:
            until = time.monotonic() + 2 * self.config.recovery_timeout
            for i in askers:
                left = min(until - time.monotonic(), self.config.recovery_timeout)
                if left <= 0:
                    break
                try:
                    sender, outcome = await asyncio.wait_for(ask(i), left)
                except Exception as e:
                    failed(i, e)
                    continue
                state.received[j] = (time.monotonic(), sender == j)
                return outcome
            return None
        begun = time.monotonic()
        limit = begun + self.config.recovery_timeout + transfer_s
        asking: dict[asyncio.Task, tuple[int, asyncio.Event]] = {}
        queue, last_ask, flowed = deque(askers), -math.inf, state.report.bytes_down
        try:
            while queue or asking:
                now = time.monotonic()
                answering = any(event.is_set() for _, event in asking.values())
                if queue and not answering and (not asking or now - last_ask >= self.config.recovery_hedge_s):
                    if asking and state.report.bytes_down > flowed:  # the link is busy with other parts: their
                        last_ask, flowed = now, state.report.bytes_down  # bytes would delay a new answer as much
                    else:
                        i, event = queue.popleft(), asyncio.Event()
                        asking[asyncio.create_task(ask(i, event))] = (i, event)
                        last_ask, flowed = now, state.report.bytes_down
                        continue
                until = limit if answering or not queue else min(limit, last_ask + self.config.recovery_hedge_s)
                if until <= now:
                    break
                done, _ = await asyncio.wait(asking, timeout=until - now, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    i, _ = asking.pop(task)
                    if task.exception() is None:
                        sender, outcome = task.result()
                        state.received[j] = (time.monotonic(), sender == j)
                        return outcome
                    failed(i, task.exception())
                    last_ask = -math.inf  # a member that failed: ask the next one now
            logger.info("round %s: part %d not recovered in %.1f s (%s)", spec.round_id.hex()[:12], j,
                        time.monotonic() - begun, ", ".join(f"member {i} {'answering' if event.is_set() else 'silent'}"
                                                           for i, event in asking.values()) or "every member failed")
            return None
        finally:
            for task in asking:
                task.cancel()
                task.add_done_callback(lambda t: t.cancelled() or t.exception())
