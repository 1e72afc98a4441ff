"""The voter's side of a round (``VotingMixin``, a base of ``VoteNode``): vote (``_vote_round``: this
peer's codes for each part to its reducer, in rotated order, on a vote stream kept between rounds) or
follow (``_follow_round``: results only), read and check each part's signed result, then conclude:
recover the missing parts (recovery.py), assemble the update (assembly.py), start audits (auditing.py).

Reads ``config``, ``p2p``, ``peer_id``, ``admission``, ``identity``, ``verifier``, ``deadline`` and
``asked_step``; writes ``_kept`` (vote streams kept for the next round), ``bases`` (a complete majority
result remembered), ``_new_caught`` (handed to the round's report) and the ``RoundState`` of the round
it runs (``direct``, ``received``, ``recovered``, ``declared``, its report). Calls node.py's
``prepare_round``, ``_ran`` and ``_emit``, and recovery.py's ``_fetch`` (a reducer that closed a vote
stream without a word is asked why, ``_ask_reducer``).

Runs on the event loop thread that owns the node's P2P, as everything in ``VoteNode``.
"""
from __future__ import annotations

import asyncio
import hashlib
import time

import torch
from hivemind.p2p import PeerID

from ..codecs import is_values, signed_max
from ..wire import PROTOCOL_VERSION, WireError, pb, read_frame, write_frame
from .assembly import assemble
from .audit import check_statements, decoded, value_bound
from .commit import MAX_TAG_BYTES, check_header, leaf_bytes, result_signed_bytes, root_of, statement_signed_bytes
from .result_delta import decode_from
from .round import AUDIT_MIN_RATE, Caught, PartResult, RoundReport, RoundSpec, chunk_spans, result_wire, upload_wire
from .shared import (FINISHED, HELD_UP, NETWORK_ERRORS, OTHER_GROUP, RESULT_FRAME_BYTES, VOTE_PROTOCOL, RoundState,
                     StreamClosed, _set_within, logger)


class VotingMixin:
    """A voter's rounds: vote or follow, send codes, read and check results, conclude."""

    async def _vote_round(self, spec: RoundSpec, upload: torch.Tensor, tag: bytes = b"", *,
                          one_at_a_time: bool = False, provisional: bool = False) -> tuple[torch.Tensor, RoundReport]:
        """Vote with ``upload`` ((planes, nbytes) uint8 codes) and return (update, report).
        ``one_at_a_time``: recover missing parts as a follower does (a follower's probe vote).

        ``tag`` (≤ 32 bytes, e.g. a digest of this peer's parameters) travels with the votes; each
        reducer returns the most common tag of the voters it counted (``RoundReport.tag_majority``).
        ``provisional``: this peer's state was caught up and no full-digest round decided for it yet; its
        tag then counts for no state (``decides``).

        The update is packed uint8 (nbytes,) for a complete majority result, else float32
        (nbytes*8,) with zeros in parts nobody received (bf16 rounds: values, NaN where missing).
        Raises ValueError only for the caller's own mistakes (shapes, a repeated round); nothing a
        peer sends makes it raise: missed parts are in the report."""
        started = time.perf_counter()
        if upload.dtype != torch.uint8 or tuple(upload.shape) != (spec.upload.planes, spec.nbytes):
            raise ValueError(f"upload must be uint8 of shape ({spec.upload.planes}, {spec.nbytes}), "
                             f"got {upload.dtype} {tuple(upload.shape)}")
        if len(tag) > MAX_TAG_BYTES:
            raise ValueError(f"tag of {len(tag)} bytes exceeds {MAX_TAG_BYTES}")
        upload = upload.cpu().contiguous()
        state = self.prepare_round(spec)
        if state.voted:
            raise ValueError(f"round {spec.round_id.hex()} was already run by this peer")
        state.voted, state.tag, state.provisional = True, tag, provisional
        state.report.provisional = provisional
        self._ran(state.spec)
        if self.config.result_deltas and spec.result.name == "majority":
            state.declared = self.bases.declared(spec.nbytes)
        me, report = state.me, state.report
        report.started = started
        codes = upload.numpy()
        roots = {j: root_of(codes[:, a:b], leaf_bytes(b - a, spec.upload.planes))
                 for j, (a, b) in enumerate(spec.bounds) if b > a}
        statements = {j: self._statement(spec, j, upload, roots[j]) for j in roots} \
            if spec.signs_votes and self.identity is not None else {}
        red = state.reduction
        if red is not None and not red.closed:
            a, b = spec.bounds[me]
            red.tags[me] = tag
            if provisional:
                red.provisional.add(me)
            if me in statements:
                red.statements[me] = statements[me]
            red.add(me, 0, upload[:, a:b].clone(), last=True)

        tasks = [state.reducing] if state.reducing is not None else []
        turn = asyncio.Lock()  # uploads leave one reducer at a time, in rotated order
        n = len(spec.group)
        for k in range(1, n):
            j = (me + k) % n
            if j in state.direct:
                tasks.append(asyncio.create_task(self._vote_remote(state, j, upload, statements.get(j), turn, started)))
        await asyncio.gather(*tasks, return_exceptions=True)
        report.timings["results"] = time.perf_counter() - started
        return await self._conclude(state, roots, one_at_a_time=one_at_a_time)

    async def _follow_round(self, spec: RoundSpec, tag: bytes = b"") -> tuple[torch.Tensor, RoundReport]:
        """Receive a round's results without voting: for a peer behind the group, whose votes would
        reach parts that closed long ago (``punctuality.py``). Each part is asked of its reducer first
        (finished rounds are kept, ``archive.py``), then of one other member at a time, so a slow link
        downloads each part once. Returns what ``run_round`` returns (``report.followed`` set); a part
        nobody holds any more is missing."""
        started = time.perf_counter()
        state = self.prepare_round(spec)
        if state.voted:
            raise ValueError(f"round {spec.round_id.hex()} was already run by this peer")
        state.voted, state.tag = True, tag
        self._ran(state.spec)
        state.report.started, state.report.followed = started, True
        red = state.reduction
        # still a reducer (the leader has not taken its part away yet): a follower on time reduces its part
        # as any reducer. One behind (a member already asked it for a later step) finds the votes in, held
        # for it since, or nobody will send any: a short wait, then no result
        behind = self.asked_step.get(spec.family, -1) > spec.step
        wait = self.deadline.grace() if behind else self.deadline.probe_grace()
        if red is not None and not red.closed and not await _set_within(red.first_in, wait):
            state.reducing.cancel()
            outcome = red.close()
            for future in (red.result, state.direct[state.me]):
                if not future.done():
                    future.set_result(outcome)
        if state.reducing is not None:
            await asyncio.gather(state.reducing, return_exceptions=True)
        state.report.timings["results"] = time.perf_counter() - started
        return await self._conclude(state, {}, one_at_a_time=True)

    async def _conclude(self, state: RoundState, roots: dict[int, bytes], *,
                        one_at_a_time: bool = False) -> tuple[torch.Tensor, RoundReport]:
        """Recover the parts that did not come from their reducers, assemble the update, start audits.
        ``roots``: this peer's own code roots by part (none when it did not vote)."""
        spec, me, report, parts, started = state.spec, state.me, state.report, state.report.parts, state.report.started
        outcomes: dict[int, PartResult | None] = {j: fut.result() if fut.done() and not fut.cancelled() else None
                                                  for j, fut in state.direct.items()}
        for j, outcome in outcomes.items():
            if outcome is not None and j != me and j in roots:
                self._check_own_root(state, j, outcome, roots[j])
        # this peer's own part is missing when its group's votes fell below the quorum; in a two-level round
        # the other groups still decide it at the second level, so it is missing only if that fails too
        missing = [j for j, outcome in outcomes.items()
                   if outcome is None and (j != me or (spec.combine and spec.combine[j] is not None))]
        if missing:
            # all missing parts come over this peer's link at once: give each answer the time of all at 1 Mbit/s
            transfer_s = sum(spec.result_size(j, len(spec.group)) for j in missing) / AUDIT_MIN_RATE
            recovered = await asyncio.gather(*(self._recover_either(state, j, one_at_a_time=one_at_a_time,
                                                                    transfer_s=transfer_s) for j in missing))
            for j, outcome in zip(missing, recovered):
                outcomes[j] = outcome
                parts[j].status = "recovered" if outcome is not None else "missing"
                if outcome is not None:
                    parts[j].record(outcome)
                    state.recovered[j] = outcome
                    if j in roots:
                        self._check_own_root(state, j, outcome, roots[j])
            report.timings["recovery"] = time.perf_counter() - started - report.timings["results"]
        for j, outcome in outcomes.items():
            if parts[j].status == "pending":
                parts[j].status = "ok" if outcome is not None else "missing"
        update, undecodable = assemble(spec, outcomes)
        if self.config.result_deltas and update.dtype == torch.uint8 and spec.result.name == "majority":
            self.bases.remember(spec.round_id, update.numpy())  # a copy and a digest: only when deltas are on
        for j, reason in undecodable.items():
            parts[j].status, parts[j].note = "missing", f"undecodable result: {reason}"
        self._start_audits(state, {j: o for j, o in outcomes.items() if o is not None and j not in undecodable})
        report.caught, self._new_caught = self._new_caught, []
        report.timings["total"] = time.perf_counter() - started
        return update, report

    def _statement(self, spec: RoundSpec, j: int, upload: torch.Tensor, root: bytes) -> pb.VoterStatement:
        a, b = spec.bounds[j]
        max_abs = 0.0  # a second level's margins are bounded by their codec
        if is_values(spec.upload):
            max_abs = signed_max(spec.upload, upload[0, a:b])
        signature = self.identity.sign(statement_signed_bytes(spec.round_id, j, root, max_abs))
        return pb.VoterStatement(root=root, max_abs=max_abs, signature=signature, public_key=self.identity.public_key)

    def _check_own_root(self, state: RoundState, j: int, outcome: PartResult, own_root: bytes) -> None:
        """A header that counts this peer must carry the root of exactly the codes it sent."""
        if state.me in outcome.counted and outcome.roots:
            if outcome.roots[outcome.counted.index(state.me)] != own_root:
                self._convict(Caught(state.spec.group[j].peer_id, state.spec.round_id, j, "misrepresented",
                                     f"round {state.spec.round_id.hex()[:12]} part {j}: its signed header has a "
                                     f"root for this peer's codes that is not theirs"))

    async def _vote_remote(self, state: RoundState, j: int, upload: torch.Tensor,
                           statement: pb.VoterStatement | None, turn: asyncio.Lock, started: float) -> None:
        """Send part j to its reducer and put its result (or None) in ``state.direct[j]``."""
        spec, report = state.spec, state.report
        deadline = self.config.result_timeout - (time.perf_counter() - started)
        writer = None

        async def exchange() -> PartResult:
            nonlocal writer
            peer = spec.group[j].peer_id
            for attempt in range(2):
                sent = False
                async with turn:  # dial inside the turn: the reducer expects the first chunk right after the dial
                    reader, writer, kept = await self._vote_stream(peer, fresh=attempt > 0)
                    try:
                        await self._send_votes(writer, state, j, upload, statement)
                        sent = True
                    except NETWORK_ERRORS:
                        writer.close()
                        writer = None
                    else:
                        report.timings["upload"] = max(report.timings.get("upload", 0.0),
                                                       time.perf_counter() - started)
                if sent:  # the turn is free again: the next reducer's upload goes while this one answers
                    try:
                        outcome = await self._read_result(reader, state, j)
                    except (*NETWORK_ERRORS, StreamClosed):
                        writer.close()
                        writer = None
                    else:
                        self._kept.setdefault(peer, []).append((reader, writer, time.monotonic()))
                        writer = None  # kept for the next round, not closed below
                        return outcome
                if not kept:  # a fresh stream the reducer closed without a word: ask it why
                    return await self._ask_reducer(state, j)
                # a kept stream the reducer closed meanwhile (idle): dial afresh, once
            raise AssertionError("unreachable: the second attempt is on a fresh stream")

        outcome: PartResult | None = None
        try:
            outcome = await asyncio.wait_for(exchange(), max(deadline, 0.0))
            state.received[j] = (time.monotonic(), True)
            report.parts[j].record(outcome)
            self._emit(f"result:{j}")
        except Exception as e:  # any failure of this reducer leaves the part to recovery
            note = f"no result from reducer {j}: {type(e).__name__}: {e}"
            report.parts[j].note, report.parts[j].other_group = note, OTHER_GROUP in str(e)
            logger.info("round %s: part %d %s", spec.round_id.hex()[:12], j, note)
            # it has not started this round (held up), or it ran it and moved on (finished: a peer replaying
            # steps it missed while the others went on): no votes of its will come, so this part stops waiting;
            # not once some of them came (a fast two-level run can take a round out of j's table while j
            # still votes in it)
            reason = next((r for r in (HELD_UP, FINISHED) if r in str(e)), None)
            red = state.reduction
            if reason and red is not None and j not in red.next_offset:
                red.drop(j, reason)
        finally:
            if writer is not None:
                writer.close()
            if not state.direct[j].done():
                state.direct[j].set_result(outcome)

    async def _ask_reducer(self, state: RoundState, j: int) -> PartResult:
        """Part j's result asked of its reducer on a fetch stream, after it closed a fresh vote stream without
        a word. A reducer that refuses a long upload cuts it after ``close_after_reply``'s drain, and the
        reset that cuts it can discard the refusal written just before (seen under load): the voter then
        waited for a held-up peer's votes until the upload timeout. A fetch request is short, so nothing
        cuts the answer. A held-up reducer refuses it at once, saying so (the caller reads it); one that
        finished the round sends the part from its archive, or says it no longer keeps it; one that runs
        the round sends the part once it has it. One that has not begun to answer within
        ``recovery_hedge_s`` (a round it has not started, a dead peer) is left to recovery."""
        answering = asyncio.Event()
        fetch = asyncio.create_task(self._fetch(state, j, j, answering))
        begun = asyncio.create_task(answering.wait())
        try:
            await asyncio.wait({fetch, begun}, timeout=self.config.recovery_hedge_s,
                               return_when=asyncio.FIRST_COMPLETED)
            if not fetch.done() and not answering.is_set():
                raise StreamClosed("stream closed before the first result chunk, and no answer to a fetch")
            return await fetch
        except BaseException:
            state.asked.add(j)  # recovery asks the other members first, this reducer last
            raise
        finally:
            begun.cancel()
            fetch.cancel()  # no-op once done; its exception, if any, is read either way
            fetch.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _vote_stream(self, peer: str, *, fresh: bool = False):
        """(reader, writer, kept): a stream to ``peer``'s vote handler, kept from an earlier round
        when one is recent enough, else newly dialed."""
        kept = self._kept.get(peer, [])
        while kept and not fresh:
            reader, writer, since = kept.pop()
            if time.monotonic() - since < self.config.keep_streams_s and not writer.is_closing() \
                    and not reader.at_eof():
                return reader, writer, True
            writer.close()
        for other in [p for p, streams in self._kept.items() if not streams]:
            del self._kept[other]  # forget peers left without kept streams (e.g. gone from the group)
        _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer), VOTE_PROTOCOL)
        return reader, writer, False

    async def _send_votes(self, writer: asyncio.StreamWriter, state: RoundState, j: int, upload: torch.Tensor,
                          statement: pb.VoterStatement | None) -> None:
        spec = state.spec
        a, b = spec.bounds[j]
        encoding, bits = upload_wire(spec.upload)
        for offset, length in chunk_spans(b - a, self.config.chunk_bytes, planes=upload.shape[0]):
            codes = upload[:, a + offset : a + offset + length].contiguous().numpy().tobytes()
            first = offset == 0
            chunk = pb.VoteChunk(version=PROTOCOL_VERSION, round_id=spec.round_id, step=spec.step, part=j,
                                 family=spec.family,
                                 offset=offset, length=length, upload=encoding, upload_bits=bits,
                                 result=result_wire(spec.result), codes=codes, last=offset + length == b - a,
                                 tag=state.tag if first else b"", provisional=first and state.provisional,
                                 token=self.admission.token(self.peer_id) if first else b"",
                                 statement=statement if first and statement is not None else None,
                                 result_bases=state.declared if first else ())
            sent = await write_frame(writer, chunk)  # not `+= await`: that reads the total before awaiting
            state.report.bytes_up += sent
            state.report.payload_up += len(codes)
            self._emit("vote_chunk")

    async def _read_result(self, reader: asyncio.StreamReader, state: RoundState, j: int, *,
                           forwarded: bool = False, answering: asyncio.Event | None = None) -> PartResult:
        """Read and check a part's result chunks, from its reducer or (``forwarded``) another peer.
        ``answering`` is set once a checked header came: the sender has the result and is sending it."""
        spec, report = state.spec, state.report
        data, header, first, expected, delta = bytearray(), None, None, 0, None
        while True:
            msg, nread = await read_frame(reader, pb.ResultChunk, RESULT_FRAME_BYTES)
            if msg is None and header is None:
                raise StreamClosed("stream closed before the first result chunk")
            if msg is None:
                raise WireError("stream closed before the last result chunk")
            report.bytes_down += nread
            if msg.error:
                raise WireError(f"peer refused: {msg.error}")
            report.timings.setdefault("first_result", time.perf_counter() - report.started)
            if not forwarded:
                report.group_epoch = max(report.group_epoch, msg.group_epoch)
            if msg.round_id != spec.round_id or msg.part != j or msg.result != result_wire(spec.result):
                raise WireError("result chunk for another round, part or encoding")
            if header is None:
                if not msg.header:
                    raise WireError("the first result chunk has no header")
                header, first = check_header(spec, j, msg.header), msg
                if answering is not None:
                    answering.set()
                expected = spec.result_size(j, len(header.counted))
                if msg.delta_base:
                    if forwarded:
                        raise WireError("a forwarded result sent as a delta")
                    delta = (msg.delta_base, msg.delta_before)
            elif msg.header or msg.signature or msg.delta_base:
                raise WireError("a later result chunk repeats the header")
            if msg.offset != len(data) or len(data) + len(msg.data) > expected:
                raise WireError(f"result chunk at {msg.offset} (+{len(msg.data)}) after {len(data)} of {expected} bytes")
            data += msg.data
            report.payload_down += len(msg.data)
            if msg.last:
                report.result_down += len(data)
                if delta is not None:
                    try:
                        data = decode_from(self.bases, state.declared, spec.nbytes, spec.bounds[j], bytes(data), *delta)
                    except ValueError as e:
                        raise WireError(str(e)) from None
                    report.delta_parts += 1
                if len(data) != expected:
                    raise WireError(f"result ended at {len(data)} of {expected} bytes")
                report.result_plain += expected
                outcome = PartResult(bytes(data), list(header.counted), header.tag, header.tag_votes,
                                     tuple(header.roots), first.header, first.signature, first.public_key,
                                     tuple(header.provisional))
                self._check_result(spec, j, header, outcome, forwarded)
                return outcome

    def _check_result(self, spec: RoundSpec, j: int, header: pb.ResultHeader, outcome: PartResult,
                      forwarded: bool) -> None:
        """The bytes match the signed digest, the part's reducer signed the header (required unless an
        unsigned node reads its reducer's own stream), and momentum values respect the signed bounds."""
        if hashlib.sha256(outcome.wire).digest() != header.wire_digest:
            raise WireError("result bytes do not match the digest in their header")
        if outcome.signature or forwarded or self.identity is not None:
            if not self.verifier.verify(spec.group[j].peer_id, outcome.public_key, result_signed_bytes(outcome.header),
                                        outcome.signature):
                raise WireError("the result is not signed by the part's reducer")
        if is_values(spec.upload):
            if header.statements:
                check_statements(header, [p.peer_id for p in spec.group], self.verifier)
                values = decoded(header, spec.result, spec.upload, outcome.wire)
                bound = value_bound(header, spec.result, spec.upload)
                if values.numel() and not float(values.abs().max()) <= bound:
                    raise WireError(f"momentum result holds |value| {float(values.abs().max()):.3g} above the "
                                    f"bound {bound:.3g} its counted voters signed")
            elif self.identity is not None:
                raise WireError("momentum result without its voters' signed statements")
        elif spec.second_level and self.identity is not None and not header.statements:
            raise WireError("second-level result without its voters' signed statements")
