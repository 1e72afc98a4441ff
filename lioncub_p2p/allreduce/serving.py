"""The serving side of a round (``ServingMixin``, a base of ``VoteNode``): as the reducer of this
peer's part, count the votes streamed in (``_on_vote_stream``, ``_serve_round``, ``_receive_votes``),
finalize the part (``_reduce_part``; in a two-level round via its second level, ``_combine``), sign it
and stream it back to every voter, as a delta where the voter named bases (``_delta_for``); forward a
part's signed result to a member that missed it (``_on_fetch_stream``). A stream for a round not
started here waits for it (``_find_round``), or is refused at once: a round of this step ran under
another group's id, or this peer's training is held up (``_stalled_at``).

Reads ``config``, ``admission``, ``identity``, ``verifier``, ``bases``, ``group_epoch``, ``_rounds``,
``_finished``, ``_by_step``, ``_second_level``, ``_runs``, ``_active`` and ``archive``; writes
``asked_step``, ``_stalled_at``, ``_waiting``, ``_waiting_key``, ``_waiters`` and ``_pending_by_peer``
(rounds waited for), ``_warned``, ``_new_caught`` (a second level's catches), ``deadline`` and the
punctuality tables (what it observed) and the ``RoundState`` it serves (``handlers``, ``deltas``, its
report). Calls node.py's ``run_round`` (a second level), ``_punctuality`` and ``_emit``.

Runs on the event loop thread that owns the node's P2P, as everything in ``VoteNode``; each stream
handler is a task there.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np
import torch

from ..wire import PROTOCOL_VERSION, WireError, close_after_reply, pb, read_frame, write_frame
from . import hierarchy
from .archive import FORGOTTEN
from .audit import signed_by
from .commit import DIGEST_BYTES, MAX_TAG_BYTES, build_header, result_signed_bytes
from .punctuality import probe_round
from .reducer import PartReduction
from .result_delta import check_declared, encode_for
from .round import (MAX_FAMILY_CHARS, MAX_FIRST_FRAME_BYTES, PartResult, RoundReport, RoundSpec, chunk_spans,
                    result_wire)
from .shared import FINISHED, HELD_UP, NETWORK_ERRORS, OTHER_GROUP, RoundState, _first_of, _set_within, logger


REFUSED_ROUNDS, REFUSED_PEERS = 16, 256  # bounds of ``_refused_before_start``


async def _unless_closed(reader: asyncio.StreamReader, wait):
    """``wait``'s result, unless the other side closes the stream (or sends anything: it has no more to
    send) first; then ``wait`` is cancelled and ConnectionError raised."""
    waiting, closed = asyncio.ensure_future(wait), asyncio.ensure_future(reader.read(1))
    try:
        await asyncio.wait({waiting, closed}, return_when=asyncio.FIRST_COMPLETED)
        if waiting.done():
            return waiting.result()
        raise ConnectionError("the asker closed its stream before the round started here")
    finally:
        for task in (waiting, closed):
            task.cancel()
            task.add_done_callback(lambda t: t.cancelled() or t.exception())


class ServingMixin:
    """This peer's part reduced and answered, and results forwarded to members that missed them."""

    async def _reduce_part(self, state: RoundState, red: PartReduction, result: asyncio.Future) -> None:
        """Finalize when every vote is in, or a grace period after the quorum, or ``upload_timeout``
        after the first vote arrived."""
        await red.first_in.wait()
        started = time.perf_counter()
        deadline = started + self.config.upload_timeout
        try:
            # a group's round of a two-level vote whose quorum hinges on voters late round after round (a
            # member gone): a grace for them, not the upload timeout every round (which every group waits
            # for: this peer combines a slice of the part for all); the other groups decide the part. In a
            # flat round nobody else would: the late voters get the whole upload timeout
            hinge = red.only_excused_left if state.spec.combine else asyncio.Event()
            await _first_of(red.quorum_in, hinge, max(deadline - time.perf_counter(), 0.0))
            for awaited in (red.quorum_in, red.all_in):
                if not awaited.is_set():
                    await asyncio.wait_for(awaited.wait(), min(self.deadline.grace(),
                                                               max(deadline - time.perf_counter(), 0.0)))
            everyone = red.complete >= set(range(len(state.spec.group))) - red.excused
            # the spread before a probe's wait: a follower's lag must not teach the grace (the pace cap's point)
            self.deadline.observe(red.last_arrival - red.quorum_time if everyone else None,
                                  red.quorum_time if len(red.complete) >= red.quorum else None)  # no quorum: no pace
        except asyncio.TimeoutError:
            self.deadline.observe(None)
        if red.probed and red.quorum_in.is_set() and not red.probed_in.is_set():
            # a probe round: excused voters (followers vote in it) get until the quorum's time plus the longest
            # the deadline waits for anyone at this group's pace; a follower lagging the group gains that much
            until = min(red.quorum_time + self.deadline.probe_grace(), deadline) - time.perf_counter()
            await _set_within(red.probed_in, max(until, 0.0))
        self._emit("finalize")
        outcome = red.close()
        if outcome is not None and state.spec.combine:
            outcome = await self._combine(state, red, outcome)
        group = state.spec.group
        self._punctuality(state.spec).observe({group[v].peer_id for v in red.complete},
                                              {p.peer_id for i, p in enumerate(group) if i != state.me},
                                              probe=probe_round(state.spec))
        if outcome is not None and self.identity is not None:
            outcome = dataclasses.replace(outcome, signature=self.identity.sign(result_signed_bytes(outcome.header)),
                                          public_key=self.identity.public_key)
            red.outcome = outcome
        part = state.report.parts[state.me]
        if outcome is not None:
            part.record(outcome)
        else:
            part.note = f"{len(red.complete)} of {len(state.spec.group)} votes: below the quorum, no result"
        state.report.dropped.extend(red.dropped.items())
        state.report.timings["reduce"] = time.perf_counter() - started  # from the first vote
        red.result.set_result(outcome)
        result.set_result(outcome)

    async def _combine(self, state: RoundState, red: PartReduction, outcome: PartResult) -> PartResult | None:
        """A two-level vote's second level: this group's counts of the part go to the part's round among
        the groups (``spec.combine``, margins as L1 votes, ``hierarchy.margin_codes``); its majority, the
        flat majority of every group counted there, is this part's result. None when a slice of it is
        missing (every group misses it alike) or the round could not run."""
        combine = state.spec.combine[state.me]
        try:
            margins = hierarchy.margin_codes(red.counts, len(outcome.counted), combine.upload.bits)
            state_tag = hierarchy.decided_tag(outcome.tag, outcome.tag_votes, state.spec.voters, outcome.counted,
                                              outcome.provisional)
            update, report = await self.run_round(combine, margins, state_tag)
        except Exception as e:  # never let the second level take the first one down
            logger.warning("round %s part %d: second level failed: %s: %s", state.spec.round_id.hex()[:12],
                           red.part, type(e).__name__, e)
            return None
        finally:
            red.counts = None
        state.report.combine = report
        self._new_caught.extend(report.caught)  # reported with the first level's round, which the swarm reads
        if update.dtype != torch.uint8:  # a slice nobody received: no result for the part
            return None
        wire = update.numpy().tobytes()
        tag, tag_votes = hierarchy.group_tag(outcome.tag, outcome.tag_votes, len(outcome.counted), report,
                                             len(combine.voters))
        # the group's own count names its provisional voters as the flat round does; the second level's tag
        # counts as every voter's (``group_tag``), provisional or not
        provisional = outcome.provisional if tag_votes <= len(outcome.counted) - len(outcome.provisional) else ()
        header = build_header(state.spec, red.part, outcome.counted, outcome.roots, tag, tag_votes, wire,
                              provisional=provisional)
        red.outcome = dataclasses.replace(outcome, wire=wire, header=header, tag=tag, tag_votes=tag_votes,
                                          provisional=provisional)
        return red.outcome

    def _outcome_for(self, state: RoundState, voter: int, outcome: PartResult) -> PartResult:
        """The result sent to ``voter``: the same for everyone (simulations override it to lie to one)."""
        return outcome

    def _delta_for(self, state: RoundState, part: int, outcome: PartResult,
                   declared: list[bytes]) -> tuple[bytes, bytes, bytes] | None:
        """The part's result as flips against bases the voter named (None: send it plain); encoded
        once per round for all voters that named the same bases."""
        spec = state.spec
        if not declared or not self.config.result_deltas or spec.result.name != "majority":
            return None
        key = (tuple(declared), outcome.wire)
        if key not in state.deltas:
            state.deltas[key] = encode_for(self.bases, declared, spec.nbytes, spec.bounds[part], outcome.wire)
        return state.deltas[key]

    async def _send_result(self, writer: asyncio.StreamWriter, spec: RoundSpec, part: int, outcome: PartResult,
                           report: RoundReport | None = None, *,
                           delta: tuple[bytes, bytes, bytes] | None = None) -> None:
        """``delta``: (blob, base id, before id) from ``_delta_for``, sent in place of the plain result."""
        wire = outcome.wire if delta is None else delta[0]
        base, before = (b"", b"") if delta is None else delta[1:]
        # a small first chunk: its header tells a peer recovering the part that this sender answers
        for offset, length in chunk_spans(len(wire), self.config.chunk_bytes) or [(0, 0)]:
            first = offset == 0
            chunk = pb.ResultChunk(version=PROTOCOL_VERSION, round_id=spec.round_id, part=part, offset=offset,
                                   data=wire[offset : offset + length], last=offset + length >= len(wire),
                                   result=result_wire(spec.result), group_epoch=self.group_epoch,
                                   header=outcome.header if first else b"",
                                   signature=outcome.signature if first else b"",
                                   public_key=outcome.public_key if first else b"",
                                   delta_base=base if first else b"", delta_before=before if first else b"")
            sent = await write_frame(writer, chunk)
            if report is not None:
                report.bytes_up += sent
                report.payload_up += length
            self._emit("combined_chunk" if spec.round_id in self._second_level else "result_chunk")

    async def _find_round(self, round_id: bytes, peer: str, family: str = "", step: int = 0) -> RoundState:
        """The round, waiting up to ``join_timeout`` for this peer to start it; each peer may wait for at
        most ``max_pending_rounds`` rounds at once (the stream gate bounds the streams doing so).
        ``family`` and ``step``: which round of its step the asker means, if it says; when this peer ran
        that round under another id (another group), it will never start here: refused at once rather
        than after the join timeout (seen: 3 rounds at 10 s each, then a repair). When this peer still
        runs the step before, the wait goes on up to ``upload_timeout`` longer: its own round starts when
        that one ends (a voter one step ahead otherwise stays ahead, its votes refused every round: seen
        behind a NAT, 5 rounds lost and then a drop)."""
        if family:
            self.asked_step[family] = max(self.asked_step.get(family, 0), step)
        if round_id in self._rounds:
            return self._rounds[round_id]
        if round_id in self._finished:
            raise WireError(FINISHED)
        self._refuse_other_group(round_id, family, step)
        held_at = min(self._stalled_at.values(), default=step + 1)  # any family: a hung training thread starts none
        if family and held_at <= step:
            raise WireError(f"this peer has not started its rounds of step {held_at} yet ({HELD_UP}): refused at once")
        if self._pending_by_peer[peer] >= self.config.max_pending_rounds:
            raise WireError("too many rounds not started here yet")
        event = self._waiting.setdefault(round_id, asyncio.Event())
        if family:
            self._waiting_key[round_id] = (family, step)
        self._waiters[round_id] += 1
        self._pending_by_peer[peer] += 1
        runs = self._runs
        try:
            started = await _set_within(event, self.config.join_timeout)
            if not started and self._running_step_before(family, step):
                started = await _set_within(event, self.config.upload_timeout)
            if not started:
                # it started no round meanwhile and runs none now: its later rounds, of any family, are refused
                # at once until it catches up (``_ran``; a hung training thread made every round wait the join
                # timeout for it: steps of 3-12 s until it was dropped). The askers' parts stop waiting for
                # its votes (``_vote_remote``). Not when it ran any (a round it skipped, a bogus step asked: it is
                # alive), nor while one of its rounds is still in progress (a slow round holds it up: refusing
                # made the next rounds slow in turn, measured), and only a family it runs itself, so that an
                # asker cannot grow the table
                if family and self._runs == runs and not self._active and (family in self._stalled_at
                                                      or any(f == family for f, _ in self._by_step)):
                    self._stalled_at[family] = min(self._stalled_at.get(family, step), step)
                raise WireError(f"unknown round {round_id.hex()[:16]} (not started here within the join timeout)")
        finally:
            self._pending_by_peer[peer] -= 1
            if self._pending_by_peer[peer] <= 0:
                del self._pending_by_peer[peer]
            self._waiters[round_id] -= 1
            if self._waiters[round_id] <= 0:
                del self._waiters[round_id]
                self._waiting_key.pop(round_id, None)
                if not event.is_set():
                    self._waiting.pop(round_id, None)
        if round_id not in self._rounds:
            self._refuse_other_group(round_id, family, step)
            raise WireError(FINISHED)
        return self._rounds[round_id]

    def _running_step_before(self, family: str, step: int) -> bool:
        """Whether this peer's newest round (any family: a momentum round follows its step's vote) is of
        ``step`` - 1 or of ``step`` itself, so that its round of ``family`` and ``step`` comes next."""
        return bool(family) and max((s for _, s in self._by_step), default=-2) in (step - 1, step)

    def _refuse_other_group(self, round_id: bytes, family: str, step: int) -> None:
        if family and self._by_step.get((family, step), round_id) != round_id:
            raise WireError(f"this peer ran the {family[:MAX_FAMILY_CHARS]} round of step {step} {OTHER_GROUP} "
                            f"(the newest epoch here is {self.group_epoch})")

    async def _on_vote_stream(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = True
        while await self._serve_round(info, reader, writer, first):
            first = False  # the voter keeps this stream for its next round

    async def _serve_round(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, first: bool) -> bool:
        """Count one round's votes from this stream and answer them. True: the stream may carry the
        voter's next round; False: it is done (closed by the voter, idle, or refused)."""
        state = voter = red = None
        replied = False
        peer = info.peer_id.to_base58()
        task = asyncio.current_task()
        try:
            wait = self.config.first_frame_timeout if first else 2 * self.config.keep_streams_s
            try:  # a round's first chunk is small (chunk_spans): at most 16 KiB before the sender is admitted
                chunk, nread = await asyncio.wait_for(read_frame(reader, pb.VoteChunk, MAX_FIRST_FRAME_BYTES), wait)
            except (asyncio.TimeoutError, *NETWORK_ERRORS):
                if first:
                    raise
                return False  # a kept stream: idle too long, or the voter went away between rounds
            if chunk is None:
                return False
            until = time.monotonic() + self.config.serve_deadline
            refused = self.admission.reason(peer, chunk.token)
            if refused:
                raise WireError(f"not admitted: {refused}")
            try:
                state = await self._find_round(chunk.round_id, peer, chunk.family, chunk.step)
            except WireError as e:
                if FINISHED not in str(e):
                    self._refused_before_start_of(chunk.round_id, peer)
                raise
            state.handlers.add(task)
            spec = state.spec
            voter = spec.index_of(peer)
            if chunk.part != state.me or state.reduction is None:
                raise WireError(f"part {chunk.part} is not reduced by this peer")
            red = state.reduction
            if len(chunk.tag) > MAX_TAG_BYTES:
                raise WireError(f"tag of {len(chunk.tag)} bytes")
            self._take_statement(state, red, voter, peer, chunk)
            declared = list(chunk.result_bases)
            try:
                check_declared(declared)
            except ValueError as e:
                raise WireError(str(e)) from None
            red.tags.setdefault(voter, chunk.tag)
            if chunk.provisional:
                red.provisional.add(voter)
            state.report.bytes_down += nread
            await asyncio.wait_for(self._receive_votes(state, red, voter, chunk, reader),
                                   max(until - time.monotonic(), 0.0))
            outcome = await asyncio.wait_for(asyncio.shield(red.result), max(until - time.monotonic(), 0.0))
            if outcome is None:
                raise WireError("no result: fewer than a quorum of votes were counted")
            outcome = self._outcome_for(state, voter, outcome)
            await asyncio.wait_for(self._send_result(writer, spec, red.part, outcome, state.report,
                                                     delta=self._delta_for(state, red.part, outcome, declared)),
                                   max(until - time.monotonic(), 0.0))
            return True
        except WireError as e:
            self._refuse(state, red, voter, info, str(e))
            replied = await self._try_send_error(writer, state, state.me if state else 0, str(e))
        except (asyncio.TimeoutError, *NETWORK_ERRORS) as e:
            self._refuse(state, red, voter, info, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
        except Exception as e:  # never let a peer's bytes crash this peer
            logger.warning("vote stream from %s failed: %s: %s", info.peer_id, type(e).__name__, e)
            self._refuse(state, red, voter, info, f"internal error: {e}")
        finally:
            if state is not None:
                state.handlers.discard(task)
        if replied:  # a refusal ends the stream: let the voter read it before closing (QUIC loses it otherwise)
            await close_after_reply(reader, writer)
        return False

    def _refused_before_start_of(self, round_id: bytes, peer: str) -> None:
        """Remember that ``peer``'s votes for a round not started here were refused (bounded: the newest
        ``REFUSED_ROUNDS`` rounds, ``REFUSED_PEERS`` peers each)."""
        refused = self._refused_before_start.setdefault(round_id, set())
        self._refused_before_start.move_to_end(round_id)
        if len(refused) < REFUSED_PEERS:
            refused.add(peer)
        while len(self._refused_before_start) > REFUSED_ROUNDS:
            self._refused_before_start.popitem(last=False)

    def _take_statement(self, state: RoundState, red: PartReduction, voter: int, peer: str,
                        chunk: pb.VoteChunk) -> None:
        """Momentum and second-level rounds: the voter's signed root (and bound; required from everyone when
        this peer signs)."""
        if not state.spec.signs_votes:
            if chunk.HasField("statement"):
                raise WireError("a statement in a vote round")
            return
        if not chunk.HasField("statement"):
            if self.identity is not None:
                raise WireError("votes without the voter's signed statement")
            return
        st = chunk.statement
        if not np.isfinite(st.max_abs) or st.max_abs < 0 or len(st.root) != DIGEST_BYTES:
            raise WireError("statement with a bad bound or root")
        if not signed_by(st, peer, state.spec.round_id, red.part, self.verifier):
            raise WireError("statement not signed by the voter")
        red.statements.setdefault(voter, st)

    async def _receive_votes(self, state: RoundState, red: PartReduction, voter: int, chunk: pb.VoteChunk,
                             reader: asyncio.StreamReader) -> None:
        spec = state.spec
        limit = spec.upload.planes * red.nbytes  # a late voter's bytes are read (not counted) up to this
        received = 0
        while True:
            if chunk.round_id != spec.round_id or chunk.part != red.part:
                raise WireError("chunk for another round or part on the same stream")
            spec.check_vote_header(chunk)
            codes = red.codes_from(chunk)
            state.report.payload_down += codes.numel()
            if red.closed:  # late: drain without counting, then answer like everyone else
                received += codes.numel()
                if received > limit:
                    raise WireError("late voter sent more than its part")
                if voter not in red.complete and voter not in red.dropped:
                    red.dropped[voter] = "late: arrived after the part was reduced"
            else:
                red.add(voter, chunk.offset, codes, chunk.last)
            if chunk.last:
                return
            remaining = self.config.upload_timeout + self.config.join_timeout
            chunk, nread = await asyncio.wait_for(read_frame(reader, pb.VoteChunk), remaining)
            if chunk is None:
                raise WireError("stream ended before the last chunk")
            state.report.bytes_down += nread

    def _refuse(self, state, red, voter, info, reason: str) -> None:
        key, now = (info.peer_id.to_base58(), reason[:48]), time.monotonic()
        if now - self._warned.get(key, -60.0) >= 60.0:  # a flood of the same refusal is logged once a minute
            if len(self._warned) > 4096:
                self._warned.clear()
            self._warned[key] = now
            logger.warning("rejected votes from %s: %s", info.peer_id, reason)
        else:
            logger.debug("rejected votes from %s: %s", info.peer_id, reason)
        if red is not None and voter is not None:
            red.drop(voter, reason)

    async def _try_send_error(self, writer, state, part: int, reason: str) -> bool:
        """Tell the other side why its stream ends; True if that was written."""
        try:
            await asyncio.wait_for(write_frame(writer, pb.ResultChunk(
                version=PROTOCOL_VERSION, round_id=state.spec.round_id if state else b"", part=part, error=reason[:200])),
                1.0)
            return True
        except Exception:
            return False

    async def _on_fetch_stream(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Forward a part's signed result: from a live round (waiting for it to settle; for one not started
        here yet, up to ``join_timeout`` for it to start), else from the archive."""
        state = None
        replied = False
        peer = info.peer_id.to_base58()
        task = asyncio.current_task()
        try:
            req = await self._first_request(reader, pb.FetchResult, peer)
            if req is None:
                return
            state = self._rounds.get(req.round_id)
            if state is None and req.round_id not in self._finished and self.archive.get(req.round_id) is None:
                # not started here yet (a follower caught up). An asker that gives up closes its stream
                # (``_ask_reducer`` waits one hedge): that ends the wait, and frees the pending slot it
                # holds (``max_pending_rounds``) for the asker's next rounds
                state = await _unless_closed(reader, self._find_round(req.round_id, peer, req.family, req.step))
            if state is not None:
                spec = state.spec
                self._check_asker(spec, peer)
                future = state.direct.get(req.part)
                if future is None:
                    raise WireError(f"no part {req.part} in this round")
                state.handlers.add(task)
                outcome = await asyncio.wait_for(asyncio.shield(future), self.config.result_timeout)
                outcome = outcome or state.recovered.get(req.part)
            else:
                kept = self.archive.get(req.round_id)
                if kept is None:
                    raise WireError(FORGOTTEN)
                spec = kept.spec
                self._check_asker(spec, peer)
                outcome = kept.results.get(req.part)
            if outcome is None or not outcome.signature:
                raise WireError(f"part {req.part}: no result signed by its reducer here")
            await asyncio.wait_for(self._send_result(writer, spec, req.part, outcome, state and state.report),
                                   self.config.result_timeout)
            self.archive.served(req.round_id)
            replied = True
        except WireError as e:
            (logger.warning if "not admitted" in str(e) else logger.info)(
                "refused a result request from %s: %s", info.peer_id, e)
            replied = await self._try_send_error(writer, state, 0, str(e))
        except (asyncio.TimeoutError, *NETWORK_ERRORS):
            pass
        except Exception as e:
            logger.warning("fetch stream from %s failed: %s: %s", info.peer_id, type(e).__name__, e)
        finally:
            if state is not None:
                state.handlers.discard(task)
        if replied:  # the asker closes after the last chunk; closing first can lose it (QUIC)
            await close_after_reply(reader, writer)

    def _check_asker(self, spec: RoundSpec, peer: str) -> None:
        """Members ask for their round's results and audits; a second-level round's slices and openings go
        to any admitted peer (the voters of a group whose reducer failed assemble their part from them,
        ``_recover_combined``; a group's voters open their reducer's margins, ``_check_margins``)."""
        if spec.round_id not in self._second_level:
            spec.index_of(peer)
