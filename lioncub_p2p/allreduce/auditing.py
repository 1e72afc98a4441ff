"""Audits and convictions (``AuditingMixin``, a base of ``VoteNode``). As an auditor: after a round,
pick other reducers' parts and leaves with private randomness, have each reducer open every counted
voter's codes there (``AUDIT_PROTOCOL``, one audit at a time per reducer, within half the audit window)
and recount (``audit.py``); in a two-level round, compare a slice of the second level instead and
recount the margins the reducer sent up (``_compare_with_second_level``, ``_check_margins``). As the
audited reducer: open the leaves asked of a part this peer reduced (``_on_audit_stream``). A reducer
caught lying, here or by a voter's own root (voting.py), is recorded by ``_convict``.

Reads ``config``, ``p2p``, ``peer_id``, ``admission``, ``verifier``, ``audit_rng``, ``_rounds`` and
``archive`` (rounds audited after they left the live table); writes ``_audits`` (audits in flight),
``_audit_turns`` and ``_audit_users`` (one audit per reducer at a time), ``audits_expired``,
``margins_checked``, ``caught``, ``catches``, ``_new_caught`` and the round report's ``audit``. Fetches
slices with recovery.py's ``_fetch_slice``; checks askers with serving.py's ``_check_asker``.

Runs on the event loop thread that owns the node's P2P, as everything in ``VoteNode``; audits run as
background tasks there.
"""
from __future__ import annotations

import asyncio
import contextlib
import time

import numpy as np
from hivemind.p2p import PeerID

from ..wire import PROTOCOL_VERSION, WireError, close_after_reply, pb, read_frame, write_frame
from .audit import (MAX_AUDIT_LEAVES, check_openings, first_level_leaves, judge, leaf_span, make_evidence,
                    owed_margins, signed_by)
from .commit import DIGEST_BYTES, leaf_bytes, leaf_count, leaf_of, parse_header
from .reducer import PartReduction
from .round import AUDIT_MIN_RATE, Caught, PartResult, RoundReport, RoundSpec
from .shared import AUDIT_PROTOCOL, NETWORK_ERRORS, RoundState, StreamClosed, logger

MAX_AUDITS_IN_FLIGHT = 8


class BadOpening(WireError):
    """An audit answer that does not open the reducer's signed commitments: never honest."""


class Unreachable(Exception):
    """The reducer to audit cannot be dialed (it left or died): no verdict."""


class TurnMissed(Exception):
    """An audit whose turn (one at a time per audited peer) did not come in time: not asked."""


class AuditingMixin:
    """Audits of other reducers' parts, answers to audits of this peer's, and the reducers caught."""

    async def settle_audits(self, timeout: float | None = None) -> None:
        """Wait for the audits in flight (tests, and a peer that wants its verdicts before leaving)."""
        if self._audits:
            await asyncio.wait(list(self._audits), timeout=timeout or self.config.audit_window_s)

    def _convict(self, caught: Caught) -> None:
        logger.warning("reducer %s caught (%s): %s", caught.peer_id, caught.kind, caught.reason)
        if caught.peer_id not in self.caught or (caught.evidence and not self.caught[caught.peer_id].evidence):
            self.caught[caught.peer_id] = caught
        self.catches.append(caught)
        if len(self._new_caught) < 1024:
            self._new_caught.append(caught)

    def _start_audits(self, state: RoundState, outcomes: dict[int, PartResult]) -> None:
        """Audit ``audits_per_round`` other reducers' parts, chosen now that their results are in."""
        candidates = sorted(j for j, outcome in outcomes.items() if j != state.me and outcome.header)
        if state.spec.combine:  # two-level: a part is the second level's majority, not its group's: compared
            candidates = [j for j in candidates if state.spec.combine[j] is not None]
            if self.audit_rng.random() >= self.config.slice_audit_rate:
                return
            for j in self.audit_rng.sample(candidates, min(self.config.audits_per_round, len(candidates))):
                self._track_audit(self._compare_with_second_level(state, j, outcomes[j]))
            return
        for j in self.audit_rng.sample(candidates, min(self.config.audits_per_round, len(candidates))):
            header = parse_header(outcomes[j].header)
            count = leaf_count(header.stop - header.start, header.leaf_bytes)
            leaves = self.audit_rng.sample(range(count), min(self.config.audit_leaves, count))
            self._track_audit(self._audit(state, j, outcomes[j], header, leaves))

    def _track_audit(self, coroutine) -> None:
        """Run an audit in the background, unless ``MAX_AUDITS_IN_FLIGHT`` run already (then none)."""
        if len(self._audits) >= MAX_AUDITS_IN_FLIGHT:
            self.audits_expired += 1
            logger.debug("no audit (%d in flight)", len(self._audits))  # counted: ``audits_expired``
            coroutine.close()
            return
        task = asyncio.create_task(coroutine)
        self._audits.add(task)
        task.add_done_callback(self._audits.discard)

    async def _compare_with_second_level(self, state: RoundState, j: int, outcome: PartResult) -> None:
        """A two-level round's audit (after a share ``slice_audit_rate`` of rounds): part j's result is its
        second-level round's majority, which this voter cannot recount, but can compare: one slice,
        chosen privately, fetched signed by the combiner that reduced it, must equal those bytes of what
        part j's reducer sent. A mismatch is checked against a second copy of the slice from another
        combiner (a combiner that signed two versions, one for auditors, must not frame an honest
        reducer); then the reducer is reported: a suspicion, not a proof. Bounded by half the audit
        window each; a slice nobody gives is no verdict."""
        combine = state.spec.combine[j]
        reducer = state.spec.group[j].peer_id
        q = self.audit_rng.randrange(len(combine.group))
        a, b = combine.bounds[q]
        second = RoundState(combine, -1, RoundReport(combine.round_id.hex(), combine.step, -1, []), None, {})
        per_ask = self.config.audit_window_s / 8 + (b - a) / AUDIT_MIN_RATE
        try:  # the audited reducer is asked last: it could serve a slice that matches its own lie
            got = await asyncio.wait_for(self._fetch_slice(second, q, per_ask, last=reducer),
                                         self.config.audit_window_s / 2)
            if got is not None and outcome.wire[a:b] != got[1].wire:
                # a second copy from another combiner: a combiner that signed two versions of its slice
                # (one for the reducers, one for auditors) must not get an honest reducer accused
                again = await asyncio.wait_for(self._fetch_slice(second, q, per_ask, last=reducer, skip=got[0]),
                                               self.config.audit_window_s / 2)
                if again is None or again[1].wire != got[1].wire:
                    logger.warning("round %s part %d: slice %d of the second level came in two versions signed by "
                                   "%s (or once only): no verdict on reducer %s", state.spec.round_id.hex()[:12],
                                   j, q, combine.group[q].peer_id, reducer)
                    return
                self._convict(Caught(reducer, state.spec.round_id, j, "misrepresented",
                                     f"round {state.spec.round_id.hex()[:12]} part {j}: its signed result differs "
                                     f"from slice {q} of the second level, signed by {combine.group[q].peer_id}"))
                return
        except asyncio.TimeoutError:
            got = None
        if got is None:
            self.audits_expired += 1
            return
        try:
            await asyncio.wait_for(self._check_margins(state, j, outcome, q, got[1]), self.config.audit_window_s / 2)
        except asyncio.TimeoutError:
            self.audits_expired += 1
        except Exception as e:  # a bug here must not look like a lie
            logger.warning("margins check of part %d failed: %s: %s", j, type(e).__name__, e)

    async def _check_margins(self, state: RoundState, j: int, outcome: PartResult, q: int, piece: PartResult) -> None:
        """After a slice compared equal: do the margins part j's reducer sent the second level match its
        group's votes? Slice q's combiner committed to each counted reducer's margin codes, each signed by
        that reducer (its statement in the slice's header: a combiner cannot put other margins in its
        name). One margin leaf, chosen privately, is opened by the combiner; the reducer opens its
        counted voters' codes for the same positions against the roots it signed for its group; the
        recount (``audit.owed_margins``: 2c - v + s) must equal what it sent. A mismatch convicts it with
        evidence that every piece of is signed by it (``audit.judge_margins``); an opening that does not
        verify is reported (a suspicion); a reducer that does not answer counts as in
        ``_audit``; a combiner that does not open is no verdict on the reducer, unless it is the reducer
        itself (it combines its own group's slice of the part). Both are asked within half the audit
        window from the result's arrival, as ``_audit`` asks (later, an honest peer may have forgotten
        the round)."""
        spec, combine = state.spec, state.spec.combine[j]
        reducer = spec.group[j].peer_id
        first, second = parse_header(outcome.header), parse_header(piece.header)
        r = combine.index_of(reducer)
        if r not in second.counted:
            return  # its group's margins were not counted in this slice: nothing of them to check
        if not second.statements:
            return  # an unsigned swarm's (a node with an identity refuses such a slice, ``_check_result``)
        pos = list(second.counted).index(r)
        statement = second.statements[pos] if len(second.statements) == len(second.counted) else None
        if statement is None or statement.root != second.roots[pos] \
                or not signed_by(statement, reducer, second.round_id, second.part, self.verifier):
            logger.warning("round %s part %d: slice %d's header does not carry reducer %s's signed margins: no "
                           "margins check", spec.round_id.hex()[:12], j, q, reducer)
            return
        k2 = self.audit_rng.randrange(leaf_count(second.stop - second.start, second.leaf_bytes))
        a2, b2 = leaf_span(second, k2)
        x, y = second.start + a2, second.start + b2  # the leaf's bytes of part j
        leaves = first_level_leaves(first, x, y)
        if len(leaves) > MAX_AUDIT_LEAVES:  # more than one audit may ask (never with the leaf sizes of commit.py)
            return
        combiner = combine.group[q].peer_id
        received_at, direct = state.received.get(j, (time.monotonic(), False))
        ask_by = received_at + self.config.audit_window_s / 2

        try:
            async with self._audit_turn(combiner, ask_by - time.monotonic()):
                opened = await asyncio.wait_for(self._ask_audit(combine, q, [k2], len(second.counted)),
                                                self._audit_deadline(combine, second, 1))
            try:
                check_openings(second, combine.upload.planes, k2, opened[k2])
            except WireError as e:
                raise BadOpening(str(e)) from e
        except (TurnMissed, Unreachable, asyncio.TimeoutError, WireError, *NETWORK_ERRORS) as e:
            logger.info("round %s part %d: combiner %s did not open slice %d's margins (%s): no margins check",
                        spec.round_id.hex()[:12], j, combiner, q, type(e).__name__)
            if combiner == reducer and not isinstance(e, (TurnMissed, Unreachable)):
                self._unanswered(state, j, direct, "did not open its own margins in its slice", e)
            return
        sent = opened[k2][pos].codes
        try:
            async with self._audit_turn(reducer, ask_by - time.monotonic()):
                votes = await asyncio.wait_for(self._ask_audit(spec, j, leaves, len(first.counted)),
                                               self._audit_deadline(spec, first, len(leaves)))
            try:
                owed = owed_margins(first, votes, second.upload_bits, x, y)
            except WireError as e:
                raise BadOpening(str(e)) from e
        except (TurnMissed, Unreachable) as e:
            logger.info("round %s part %d: reducer %s not asked for its votes: %s", spec.round_id.hex()[:12], j,
                        reducer, type(e).__name__)
            return
        except (asyncio.TimeoutError, WireError, *NETWORK_ERRORS) as e:
            self._unanswered(state, j, direct, "did not open the votes behind its margins", e)
            return
        self.margins_checked += 1
        if owed == sent:
            return
        differ = int(np.count_nonzero(np.frombuffer(owed, np.uint8) != np.frombuffer(sent, np.uint8)))
        reason = (f"round {spec.round_id.hex()[:12]} part {j}: the margins it sent slice {q} of the second level "
                  f"differ from its counted votes in {differ} of {len(owed)} bytes of leaf {k2}")
        if not outcome.signature:  # an unsigned swarm's: nothing to prove it with
            self._convict(Caught(reducer, spec.round_id, j, "misrepresented", reason))
            return
        proof = pb.MarginsProof(flat_round=spec.flat_round, group=spec.group_index, slice=q, statement=statement,
                                margins=opened[k2][pos])
        evidence = pb.Evidence(version=PROTOCOL_VERSION, header=outcome.header, signature=outcome.signature,
                               public_key=outcome.public_key, wire=outcome.wire, leaf=leaves[0],
                               votes=[answer for k in leaves for answer in votes[k]], margins=proof)
        self._convict(Caught(reducer, spec.round_id, j, "lie", reason, evidence.SerializeToString()))

    async def _audit(self, state: RoundState, j: int, outcome: PartResult, header: pb.ResultHeader,
                     leaves: list[int]) -> None:
        """Ask reducer j to open ``leaves`` and recount them. An auditor asks within half of the reducer's
        ``audit_window_s`` after the result arrived, one audit at a time per reducer (its audit stream
        cap is 2), or not at all. What counts against the reducer: a recount that differs (a lie, with
        evidence), an opening that does not verify, and, for a result its reducer sent this peer itself
        (so the window surely still ran when asked), a refusal, a timeout or a stream closed twice
        before any answer. A reducer this peer cannot dial any more (gone) is not accused."""
        spec = state.spec
        reducer = spec.group[j].peer_id
        received_at, direct = state.received.get(j, (time.monotonic(), False))
        ask_by = received_at + self.config.audit_window_s / 2
        verdict = "ok"
        try:
            async with self._audit_turn(reducer, ask_by - time.monotonic()):
                answers = await asyncio.wait_for(self._ask_audit(spec, j, leaves, len(header.counted)),
                                                 self._audit_deadline(spec, header, len(leaves)))
            for k in leaves:
                try:
                    reason = judge(header, outcome.wire, k, answers[k])
                except WireError as e:
                    raise BadOpening(str(e)) from e
                if reason:
                    evidence = make_evidence(outcome.header, outcome.signature, outcome.public_key, outcome.wire, k,
                                             answers[k]) if outcome.signature else b""
                    self._convict(Caught(reducer, spec.round_id, j, "lie",
                                         f"round {spec.round_id.hex()[:12]} part {j}: {reason}", evidence))
                    verdict = "lie"
                    break
        except TurnMissed:
            self.audits_expired += 1
            logger.info("round %s part %d: audit not asked within %.0f s of the result: dropped",
                        spec.round_id.hex()[:12], j, self.config.audit_window_s / 2)
            state.report.audit = (j, j, "expired")
            return
        except asyncio.CancelledError:
            return
        except Unreachable as e:
            verdict = "unreachable"
            logger.info("round %s part %d: reducer %s not audited: %s", spec.round_id.hex()[:12], j, reducer, e)
        except (asyncio.TimeoutError, WireError, *NETWORK_ERRORS) as e:
            counted = self._unanswered(state, j, direct, "audit not answered", e)
            verdict = "unanswered" if counted else "unanswered (forwarded result: not counted)"
        except Exception as e:  # a bug here must not look like a lie
            logger.warning("audit of part %d failed: %s: %s", j, type(e).__name__, e)
            return
        state.report.audit = (j, j, verdict)

    def _unanswered(self, state: RoundState, j: int, direct: bool, what: str, e: BaseException) -> bool:
        """Reducer j did not answer an audit (``e``). It counts against it, and is True, for an opening
        that does not verify or a result it sent this peer itself; a result forwarded by another member
        may have reached this peer after the reducer's window ended: not counted."""
        spec, reason = state.spec, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        if not direct and not isinstance(e, BadOpening):
            logger.info("round %s part %d: %s for a forwarded result (%s): not counted", spec.round_id.hex()[:12], j,
                        what, reason)
            return False
        self._convict(Caught(spec.group[j].peer_id, spec.round_id, j, "unanswered",
                             f"round {spec.round_id.hex()[:12]} part {j}: {what} ({reason})"))
        return True

    @contextlib.asynccontextmanager
    async def _audit_turn(self, peer: str, wait_s: float):
        """One audit of ``peer`` at a time (its audit stream cap is 2): enters once this one's turn came,
        raises ``TurnMissed`` when it did not come within ``wait_s``."""
        turn = self._audit_turns.setdefault(peer, asyncio.Lock())
        self._audit_users[peer] += 1
        try:
            try:
                await asyncio.wait_for(turn.acquire(), max(wait_s, 0.0))
            except asyncio.TimeoutError:
                raise TurnMissed(peer) from None
            try:
                yield
            finally:
                turn.release()
        finally:
            self._audit_users[peer] -= 1
            if self._audit_users[peer] <= 0:
                del self._audit_users[peer]
                self._audit_turns.pop(peer, None)

    def _audit_deadline(self, spec: RoundSpec, header: pb.ResultHeader, leaves: int) -> float:
        """``audit_timeout`` plus the answer's transfer at ``AUDIT_MIN_RATE`` (a slow link is no lie)."""
        count = leaf_count(header.stop - header.start, header.leaf_bytes)
        per_answer = spec.upload.planes * header.leaf_bytes + DIGEST_BYTES * max(count - 1, 0).bit_length() + 64
        return self.config.audit_timeout + leaves * len(header.counted) * per_answer / AUDIT_MIN_RATE

    async def _ask_audit(self, spec: RoundSpec, j: int, leaves: list[int], voters: int) -> dict[int, list]:
        """The reducer's answers, by leaf. A stream that ends before any answer (a stream cap that
        refused it, a reset) is asked again once; a reducer that cannot be dialed raises Unreachable."""
        attempt = 0
        while True:
            try:
                _, reader, writer = await self.p2p.call_binary_stream_handler(
                    PeerID.from_base58(spec.group[j].peer_id), AUDIT_PROTOCOL)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                raise Unreachable(f"{type(e).__name__}: {e}") from e
            answers: dict[int, list] = {k: [] for k in leaves}
            try:
                await write_frame(writer, pb.AuditRequest(version=PROTOCOL_VERSION, round_id=spec.round_id, part=j,
                                                          leaves=leaves, token=self.admission.token(self.peer_id)))
                for k in leaves:
                    for _ in range(voters):
                        msg, _ = await read_frame(reader, pb.AuditAnswer)
                        if msg is None:
                            raise StreamClosed("audit stream closed early")
                        if msg.error:
                            raise WireError(f"reducer refused the audit: {msg.error}")
                        answers[k].append(msg)
                return answers
            except (StreamClosed, *NETWORK_ERRORS):
                if attempt or any(answers.values()):
                    raise
            finally:
                writer.close()  # every answer read (or given up): the reducer waits for this close
            attempt += 1
            await asyncio.sleep(0.2)

    def _audited(self, round_id: bytes) -> tuple[RoundSpec, PartReduction | None] | None:
        """The spec and this peer's reduction of a round, live or archived (None: unknown or forgotten)."""
        state = self._rounds.get(round_id)
        if state is not None:
            return state.spec, state.reduction
        kept = self.archive.get(round_id)
        return (kept.spec, kept.reduction) if kept is not None else None

    async def _on_audit_stream(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Open every counted voter's codes in the asked leaves of the part this peer reduced."""
        peer = info.peer_id.to_base58()
        replied = False
        try:
            req = await self._first_request(reader, pb.AuditRequest, peer)
            if req is None:
                return
            found = self._audited(req.round_id)
            if found is None:
                raise WireError("unknown or forgotten round")
            spec, red = found
            self._check_asker(spec, peer)
            if red is None or req.part != red.part or red.outcome is None or not red.trees:
                raise WireError(f"no result of part {req.part} here")
            leaf = leaf_bytes(red.nbytes, spec.upload.planes)
            count = leaf_count(red.nbytes, leaf)
            if not 0 < len(req.leaves) <= MAX_AUDIT_LEAVES or any(k >= count for k in req.leaves):
                raise WireError(f"audit of leaves {list(req.leaves)[:8]} of {count}")
            for k in req.leaves:
                for voter in red.outcome.counted:
                    answer = pb.AuditAnswer(version=PROTOCOL_VERSION, leaf=k, voter=voter,
                                            codes=leaf_of(red.votes[voter], leaf, k), path=red.trees[voter].path(k))
                    await asyncio.wait_for(write_frame(writer, answer), self.config.audit_timeout)
                    replied = True
        except WireError as e:
            logger.info("refused an audit from %s: %s", info.peer_id, e)
            try:
                await asyncio.wait_for(write_frame(writer, pb.AuditAnswer(version=PROTOCOL_VERSION, error=str(e)[:200])),
                                       1.0)
                replied = True
            except Exception:
                pass
        except (asyncio.TimeoutError, *NETWORK_ERRORS):
            pass
        except Exception as e:
            logger.warning("audit stream from %s failed: %s: %s", info.peer_id, type(e).__name__, e)
        if replied:  # the auditor closes once it has every answer; closing first can lose the last (QUIC)
            await close_after_reply(reader, writer)
