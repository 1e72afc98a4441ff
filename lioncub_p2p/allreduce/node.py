"""A peer's end of the butterfly vote all-reduce, on hivemind's P2P binary streams.

One round, from peer i's point of view (group of n; part j is reduced by member j):

1. For every other reducer j, in rotated order (i+1, i+2, ...) so that not everyone uploads to the
   same reducer at once: dial j (or reuse the stream kept from the last round), stream this peer's
   codes for part j in chunks, keep the stream open.
2. As reducer of part i: count its own codes and every incoming chunk on packed words; when all n
   votes are in, or ``upload_timeout`` after this peer's round began, encode the part's result with
   the votes that completed and stream it back on every voter's stream (late voters get it too).
3. Read each part's result from the stream it was uploaded on, until ``result_timeout``.

Fault rule (every survivor applies the same update):
* a voter that fails, lies about sizes or is late is left out of that part's count; the part's
  result names the counted voters;
* a part whose result did not arrive (its reducer died, stalled or refused us) is asked for from the
  other peers, who answer only with a result they received directly from that reducer; if anyone got
  it, everyone who asks gets the same bytes; if nobody did, every peer applies a zero update there;
* what timing can still split (a peer that received a part directly but stalls while others ask)
  is caught by the swarm's parameter digest and repaired by a state download.

All connections are dialed by the voter, so peers in client mode (behind NAT) take part fully.
Untrusted input is checked chunk by chunk (round, part, group membership, encodings, offsets, sizes);
a violation drops that peer's vote with a logged reason and never raises in the caller.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

import torch
from hivemind.p2p import P2P, PeerID

from ..codecs import Bf16Upload
from ..ops import unpack_signs
from ..wire import PROTOCOL_VERSION, WireError, pb, read_frame, write_frame
from .admission import OPEN, Admission
from .deadline import AdaptiveDeadline
from .reducer import MAX_TAG_BYTES, PartReduction
from .round import AllReduceConfig, PartReport, PartResult, RoundReport, RoundSpec, result_wire, upload_wire

logger = logging.getLogger(__name__)

VOTE_PROTOCOL = "lioncub/vote/1"
FETCH_PROTOCOL = "lioncub/fetch/1"
NETWORK_ERRORS = (ConnectionError, asyncio.IncompleteReadError, OSError, EOFError)


class StreamClosed(WireError):
    """The stream ended before any result came: on a kept stream, the other end closed it meanwhile."""



@dataclass
class RoundState:
    spec: RoundSpec
    me: int
    report: RoundReport
    reduction: PartReduction | None
    direct: dict[int, asyncio.Future]  # part -> PartResult | None, as received from its reducer
    reducing: asyncio.Task | None = None
    auditing: asyncio.Task | None = None
    voted: bool = False
    tag: bytes = b""
    audit_reduction: PartReduction | None = None  # this peer audits the sampled part
    no_recovery: set = field(default_factory=set)  # parts applied as zero on purpose (audit mismatch)
    audit_result: asyncio.Future | None = None  # the auditor's result for the sampled part


class VoteNode:
    """Runs vote rounds for one peer. Create inside the event loop that owns ``p2p``; call ``start``."""

    def __init__(self, p2p: P2P, config: AllReduceConfig | None = None, admission: Admission = OPEN):
        self.p2p = p2p
        self.config = config or AllReduceConfig()
        self.admission = admission
        self.reduction_factory = PartReduction  # what reduces a part (simulations swap in lying reducers)
        self.deadline = AdaptiveDeadline(max_grace=self.config.upload_timeout)
        self.peer_id = p2p.peer_id.to_base58()
        self._rounds: OrderedDict[bytes, RoundState] = OrderedDict()
        self._finished: deque[bytes] = deque(maxlen=256)
        self._waiting: dict[bytes, asyncio.Event] = {}
        self._streams = 0
        self._kept: dict[str, list[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]]] = {}
        # Observers of progress ("vote_chunk" / "result_chunk" after each chunk is written), for
        # metrics and for tests that inject faults at a precise moment.
        self.on_event: list[Callable[[str], None]] = []
        # The newest group epoch this peer knows, sent with every result so peers behind learn of a
        # group change within one round (set by the swarm).
        self.group_epoch = 0

    def _emit(self, event: str) -> None:
        for callback in self.on_event:
            callback(event)

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(VOTE_PROTOCOL, self._on_vote_stream)
        await self.p2p.add_binary_stream_handler(FETCH_PROTOCOL, self._on_fetch_stream)

    # -- running a round ---------------------------------------------------------------------------

    def prepare_round(self, spec: RoundSpec) -> RoundState:
        """Start reducing this peer's part of ``spec`` before this peer has voted.

        A swarm prepares round s+1 as soon as round s ends, so others' votes are counted while this
        peer still computes: a slow peer delays neither its own part nor anyone else's. Idempotent."""
        if spec.round_id in self._rounds:
            state = self._rounds[spec.round_id]
            if state.spec != spec:
                raise ValueError(f"round {spec.round_id.hex()} was prepared with another spec")
            return state
        me = spec.index_of(self.peer_id)
        parts = [PartReport(j, j, a, b, "pending" if b > a else "empty") for j, (a, b) in enumerate(spec.bounds)]
        loop = asyncio.get_running_loop()
        state = RoundState(spec, me, RoundReport(spec.round_id.hex(), spec.step, me, parts), None,
                           {j: loop.create_future() for j, (a, b) in enumerate(spec.bounds) if b > a})
        if me in state.direct:
            state.reduction = self.reduction_factory(spec, me)
            state.reducing = asyncio.create_task(self._reduce_part(state, state.reduction, state.direct[me]))
        if spec.audit_pair is not None:
            part, auditor = spec.audit_pair
            state.audit_result = loop.create_future()
            if auditor == me:
                state.audit_reduction = self.reduction_factory(spec, part)
                state.auditing = asyncio.create_task(self._reduce_part(state, state.audit_reduction, state.audit_result))
        self._register(state)
        return state

    async def run_round(self, spec: RoundSpec, upload: torch.Tensor, tag: bytes = b"") -> tuple[torch.Tensor, RoundReport]:
        """Vote with ``upload`` ((planes, nbytes) uint8 codes) and return (update, report).

        ``tag`` (≤ 32 bytes, e.g. a digest of this peer's parameters) travels with the votes; each
        reducer returns the most common tag of the voters it counted (``RoundReport.consensus_tag``).

        The update is packed uint8 (nbytes,) for a complete majority result, else float32
        (nbytes*8,) with zeros in parts nobody received."""
        started = time.perf_counter()
        if upload.dtype != torch.uint8 or tuple(upload.shape) != (spec.upload.planes, spec.nbytes):
            raise ValueError(f"upload must be uint8 of shape ({spec.upload.planes}, {spec.nbytes}), "
                             f"got {upload.dtype} {tuple(upload.shape)}")
        upload = upload.cpu().contiguous()
        state = self.prepare_round(spec)
        if state.voted:
            raise ValueError(f"round {spec.round_id.hex()} was already run by this peer")
        if len(tag) > MAX_TAG_BYTES:
            raise ValueError(f"tag of {len(tag)} bytes exceeds {MAX_TAG_BYTES}")
        state.voted, state.tag = True, tag
        me, report, parts = state.me, state.report, state.report.parts
        report.started = started
        for red in (state.reduction, state.audit_reduction):
            if red is not None and not red.finalized:
                a, b = spec.bounds[red.part]
                red.tags[me] = tag
                red.add(me, 0, upload[:, a:b].clone(), last=True)

        tasks = [t for t in (state.reducing, state.auditing) if t is not None]
        turn = asyncio.Lock()  # uploads leave one reducer at a time, in rotated order
        n = len(spec.group)
        for k in range(1, n):
            j = (me + k) % n
            if j in state.direct:
                tasks.append(asyncio.create_task(self._vote_remote(state, j, j, upload, turn, started, state.direct[j])))
        if spec.audit_pair is not None and spec.audit_pair[1] != me:
            part, auditor = spec.audit_pair
            tasks.append(asyncio.create_task(self._vote_remote(state, auditor, part, upload, turn, started,
                                                               state.audit_result)))
        await asyncio.gather(*tasks)
        self._check_audit(state)
        report.timings["results"] = time.perf_counter() - started

        missing = [j for j, fut in state.direct.items() if fut.result() is None and j not in state.no_recovery]
        outcomes: dict[int, PartResult | None] = {j: fut.result() for j, fut in state.direct.items()}
        if missing:
            recovered = await asyncio.gather(*(self._recover(state, j) for j in missing))
            for j, outcome in zip(missing, recovered):
                outcomes[j] = outcome
                parts[j].status = "recovered" if outcome is not None else "missing"
                if outcome is not None:
                    parts[j].record(outcome)
            report.timings["recovery"] = time.perf_counter() - started - report.timings["results"]
        for j, outcome in outcomes.items():
            if parts[j].status == "pending":
                parts[j].status = "ok" if outcome is not None else "missing"
        update, undecodable = assemble(spec, outcomes)
        for j, reason in undecodable.items():
            parts[j].status, parts[j].note = "missing", f"undecodable result: {reason}"
        report.timings["total"] = time.perf_counter() - started
        return update, report

    def _register(self, state: RoundState) -> None:
        rid = state.spec.round_id
        if rid in self._finished:
            raise ValueError(f"round {rid.hex()} was already run by this peer")
        self._rounds[rid] = state
        while len(self._rounds) > self.config.keep_rounds:
            old, old_state = self._rounds.popitem(last=False)
            for task in (old_state.reducing, old_state.auditing):
                if task is not None and not task.done():
                    task.cancel()  # prepared, but no vote ever came
            self._finished.append(old)
        if rid in self._waiting:
            self._waiting.pop(rid).set()

    def _check_audit(self, state: RoundState) -> None:
        """Compare the audited part's result from its reducer with the auditor's. Different bytes from
        the same counted voters mean one of the two lies: nobody can tell which from here, so the part
        is applied as zero and both are reported (the swarm excludes a peer caught with several partners)."""
        if state.spec.audit_pair is None:
            return
        part, auditor = state.spec.audit_pair
        direct, audit = state.direct[part].result(), state.audit_result.result()
        if direct is None or audit is None or direct.counted != audit.counted:
            verdict = "inconclusive"
        elif direct.wire == audit.wire:
            verdict = "ok"
        else:
            verdict = "mismatch"
            state.direct[part] = asyncio.get_running_loop().create_future()
            state.direct[part].set_result(None)
            state.report.parts[part].note = f"audit mismatch with auditor {auditor}: applied as zero"
            state.no_recovery.add(part)
            logger.warning("round %s: part %d's result differs from auditor %d's: one of them lies",
                           state.spec.round_id.hex()[:12], part, auditor)
        state.report.audit = (part, auditor, verdict)

    async def _reduce_part(self, state: RoundState, red: PartReduction, result: asyncio.Future) -> None:
        """Finalize when every vote is in, or a grace period after the quorum, or ``upload_timeout``
        after the first vote arrived."""
        await red.first_in.wait()
        started = time.perf_counter()
        deadline = started + self.config.upload_timeout
        try:
            await asyncio.wait_for(red.quorum_in.wait(), max(deadline - time.perf_counter(), 0.0))
            if not red.all_in.is_set():
                grace = min(self.deadline.grace(), max(deadline - time.perf_counter(), 0.0))
                await asyncio.wait_for(red.all_in.wait(), grace)
            everyone = len(red.complete) == len(state.spec.group)
            self.deadline.observe(red.last_arrival - red.quorum_time if everyone else None)
        except asyncio.TimeoutError:
            self.deadline.observe(None)
        self._emit("finalize")
        outcome = red.finalize()
        if red is state.reduction:
            state.report.parts[state.me].record(outcome)
            state.report.dropped.extend(red.dropped.items())
            state.report.timings["reduce"] = time.perf_counter() - started  # from the first vote
        result.set_result(outcome)

    async def _vote_remote(self, state: RoundState, reducer: int, j: int, upload: torch.Tensor, turn: asyncio.Lock,
                           started: float, target: asyncio.Future) -> None:
        """Send part j to ``reducer`` (its own reducer, or the auditor) and put its result in ``target``."""
        spec, report = state.spec, state.report
        deadline = self.config.result_timeout - (time.perf_counter() - started)
        writer = None
        audit = reducer != j

        async def exchange() -> PartResult:
            nonlocal writer
            peer = spec.group[reducer].peer_id
            for attempt in range(2):
                reader, writer, kept = await self._vote_stream(peer, fresh=attempt > 0)
                try:
                    async with turn:
                        await self._send_votes(writer, state, j, upload)
                        report.timings.setdefault("upload", 0.0)
                        report.timings["upload"] = max(report.timings["upload"], time.perf_counter() - started)
                    outcome = await self._read_result(reader, state, j)
                except (*NETWORK_ERRORS, StreamClosed):
                    if not kept:
                        raise
                    writer.close()  # the reducer closed the kept stream meanwhile: dial afresh, once
                    writer = None
                    continue
                self._kept.setdefault(peer, []).append((reader, writer, time.monotonic()))
                writer = None  # kept for the next round, not closed below
                return outcome
            raise AssertionError("unreachable: the second attempt dials a fresh stream")

        outcome: PartResult | None = None
        try:
            outcome = await asyncio.wait_for(exchange(), max(deadline, 0.0))
            if not audit:
                report.parts[j].record(outcome)
        except Exception as e:  # any failure of this reducer leaves the part to recovery
            note = f"no result from {'auditor' if audit else 'reducer'} {reducer}: {type(e).__name__}: {e}"
            if not audit:
                report.parts[j].note = note
            logger.info("round %s: part %d %s", spec.round_id.hex()[:12], j, note)
        finally:
            if writer is not None:
                writer.close()
            target.set_result(outcome)

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

    async def _send_votes(self, writer: asyncio.StreamWriter, state: RoundState, j: int, upload: torch.Tensor) -> None:
        spec = state.spec
        a, b = spec.bounds[j]
        encoding, bits = upload_wire(spec.upload)
        for offset in range(0, b - a, self.config.chunk_bytes):
            length = min(self.config.chunk_bytes, b - a - offset)
            codes = upload[:, a + offset : a + offset + length].contiguous().numpy().tobytes()
            chunk = pb.VoteChunk(version=PROTOCOL_VERSION, round_id=spec.round_id, step=spec.step, part=j,
                                 offset=offset, length=length, upload=encoding, upload_bits=bits,
                                 result=result_wire(spec.result), codes=codes, last=offset + length == b - a,
                                 tag=state.tag if offset == 0 else b"",
                                 token=self.admission.token(self.peer_id) if offset == 0 else b"")
            sent = await write_frame(writer, chunk)  # not `+= await`: that reads the total before awaiting
            state.report.bytes_up += sent
            state.report.payload_up += len(codes)
            self._emit("vote_chunk")

    async def _read_result(self, reader: asyncio.StreamReader, state: RoundState, j: int) -> PartResult:
        """Read and check a part's result chunks (from its reducer or a recovering peer)."""
        spec, report = state.spec, state.report
        data, voters, counted, expected = bytearray(), None, None, None
        while True:
            msg, nread = await read_frame(reader, pb.ResultChunk)
            if msg is None and voters is None:
                raise StreamClosed("stream closed before the first result chunk")
            if msg is None:
                raise WireError("stream closed before the last result chunk")
            report.bytes_down += nread
            if msg.error:
                raise WireError(f"peer refused: {msg.error}")
            report.timings.setdefault("first_result", time.perf_counter() - report.started)
            report.group_epoch = max(report.group_epoch, msg.group_epoch)
            if msg.round_id != spec.round_id or msg.part != j or msg.result != result_wire(spec.result):
                raise WireError("result chunk for another round, part or encoding")
            if voters is None:
                voters, counted, tag, tag_votes = msg.voters, list(msg.counted), msg.tag, msg.tag_votes
                if len(tag) > MAX_TAG_BYTES or tag_votes > voters:
                    raise WireError(f"result claims tag of {len(tag)} bytes with {tag_votes} of {voters} votes")
                if not 1 <= voters <= len(spec.group) or len(counted) != voters or len(set(counted)) != voters \
                        or any(c >= len(spec.group) for c in counted):
                    raise WireError(f"result claims {voters} voters with counted={counted[:8]}")
                expected = spec.result_size(j, voters)
            elif msg.voters != voters or list(msg.counted) != counted:
                raise WireError("result chunks disagree on the counted voters")
            if msg.offset != len(data) or len(data) + len(msg.data) > expected:
                raise WireError(f"result chunk at {msg.offset} (+{len(msg.data)}) after {len(data)} of {expected} bytes")
            data += msg.data
            report.payload_down += len(msg.data)
            if msg.last:
                if len(data) != expected:
                    raise WireError(f"result ended at {len(data)} of {expected} bytes")
                return PartResult(bytes(data), counted, tag, tag_votes)

    async def _send_result(self, writer: asyncio.StreamWriter, state: RoundState, part: int, outcome: PartResult) -> None:
        wire, step = outcome.wire, self.config.chunk_bytes
        for offset in range(0, max(len(wire), 1), step):
            chunk = pb.ResultChunk(version=PROTOCOL_VERSION, round_id=state.spec.round_id, part=part, offset=offset,
                                   data=wire[offset : offset + step], last=offset + step >= len(wire),
                                   voters=len(outcome.counted), counted=outcome.counted,
                                   result=result_wire(state.spec.result), tag=outcome.tag, tag_votes=outcome.tag_votes,
                                   group_epoch=self.group_epoch)
            sent = await write_frame(writer, chunk)
            state.report.bytes_up += sent
            state.report.payload_up += min(step, len(wire) - offset)
            self._emit("result_chunk")

    async def _recover(self, state: RoundState, j: int) -> PartResult | None:
        """Ask every other reachable member for part j's result as it came from its reducer."""
        spec = state.spec
        askers = [i for i, p in enumerate(spec.group) if i not in (j, state.me) and not p.client_mode]

        async def ask(i: int) -> PartResult:
            _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(spec.group[i].peer_id),
                                                                          FETCH_PROTOCOL)
            try:
                sent = await write_frame(writer, pb.FetchResult(version=PROTOCOL_VERSION, round_id=spec.round_id, part=j,
                                                                token=self.admission.token(self.peer_id)))
                state.report.bytes_up += sent
                return await self._read_result(reader, state, j)
            finally:
                writer.close()

        pending = {asyncio.create_task(asyncio.wait_for(ask(i), self.config.recovery_timeout)) for i in askers}
        for task in pending:  # answers that come after the first good one are not needed, nor their errors
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task.exception() is None:
                        return task.result()
        finally:
            for task in pending:
                task.cancel()
        return None

    # -- serving other peers ---------------------------------------------------------------------

    async def _find_round(self, round_id: bytes) -> RoundState:
        if round_id in self._rounds:
            return self._rounds[round_id]
        if round_id in self._finished:
            raise WireError("round already finished")
        if round_id not in self._waiting and len(self._waiting) >= 8:
            raise WireError("too many rounds not started here yet")
        event = self._waiting.setdefault(round_id, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), self.config.join_timeout)
        except asyncio.TimeoutError:
            self._waiting.pop(round_id, None)
            raise WireError(f"unknown round {round_id.hex()[:16]} (not started here within the join timeout)")
        return self._rounds[round_id]

    async def _on_vote_stream(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._streams >= self.config.max_streams:
            logger.warning("refused a stream from %s: %d streams open", info.peer_id, self._streams)
            writer.close()
            return
        self._streams += 1
        try:
            first = True
            while await self._serve_round(info, reader, writer, first):
                first = False  # the voter keeps this stream for its next round
        finally:
            self._streams -= 1
            writer.close()

    async def _serve_round(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, first: bool) -> bool:
        """Count one round's votes from this stream and answer them. True: the stream may carry the
        voter's next round; False: it is done (closed by the voter, idle, or refused)."""
        state = voter = red = None
        try:
            wait = self.config.join_timeout if first else 2 * self.config.keep_streams_s
            try:
                chunk, nread = await asyncio.wait_for(read_frame(reader, pb.VoteChunk), wait)
            except (asyncio.TimeoutError, *NETWORK_ERRORS):
                if first:
                    raise
                return False  # a kept stream: idle too long, or the voter went away between rounds
            if chunk is None:
                return False
            refused = self.admission.reason(info.peer_id.to_base58(), chunk.token)
            if refused:
                raise WireError(f"not admitted: {refused}")
            state = await self._find_round(chunk.round_id)
            spec = state.spec
            voter = spec.index_of(info.peer_id.to_base58())
            if chunk.part == state.me and state.reduction is not None:
                red = state.reduction
            elif state.audit_reduction is not None and chunk.part == state.audit_reduction.part:
                red = state.audit_reduction
            else:
                raise WireError(f"part {chunk.part} is not reduced by this peer")
            if len(chunk.tag) > MAX_TAG_BYTES:
                raise WireError(f"tag of {len(chunk.tag)} bytes")
            red.tags.setdefault(voter, chunk.tag)
            state.report.bytes_down += nread
            await self._receive_votes(state, red, voter, chunk, reader)
            outcome = await asyncio.shield(red.result)
            await self._send_result(writer, state, red.part, outcome)
            return True
        except WireError as e:
            self._refuse(state, red, voter, info, str(e))
            await self._try_send_error(writer, state, state.me if state else 0, str(e))
        except (asyncio.TimeoutError, *NETWORK_ERRORS) as e:
            self._refuse(state, red, voter, info, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
        except Exception as e:  # never let a peer's bytes crash this peer
            logger.exception("vote stream from %s failed", info.peer_id)
            self._refuse(state, red, voter, info, f"internal error: {e}")
        return False

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
            if red.finalized:  # late: drain without counting, then answer like everyone else
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
        logger.warning("rejected votes from %s: %s", info.peer_id, reason)
        if red is not None and voter is not None:
            red.drop(voter, reason)

    async def _try_send_error(self, writer, state, part: int, reason: str) -> None:
        try:
            await asyncio.wait_for(write_frame(writer, pb.ResultChunk(
                version=PROTOCOL_VERSION, round_id=state.spec.round_id if state else b"", part=part, error=reason[:200])),
                1.0)
        except Exception:
            pass

    async def _on_fetch_stream(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        state = None
        try:
            req, _ = await asyncio.wait_for(read_frame(reader, pb.FetchResult, 1024), self.config.join_timeout)
            if req is None:
                return
            refused = self.admission.reason(info.peer_id.to_base58(), req.token)
            if refused:
                raise WireError(f"not admitted: {refused}")
            state = self._rounds.get(req.round_id)
            if state is None:
                raise WireError("unknown round")
            state.spec.index_of(info.peer_id.to_base58())
            future = state.direct.get(req.part)
            if future is None:
                raise WireError(f"no part {req.part} in this round")
            outcome = await asyncio.wait_for(asyncio.shield(future), self.config.result_timeout)
            if outcome is None:
                raise WireError(f"part {req.part} was not received from its reducer here")
            await self._send_result(writer, state, req.part, outcome)
        except WireError as e:
            (logger.warning if "not admitted" in str(e) else logger.info)(
                "refused a result request from %s: %s", info.peer_id, e)
            await self._try_send_error(writer, state, 0, str(e))
        except (asyncio.TimeoutError, *NETWORK_ERRORS):
            pass
        except Exception:
            logger.exception("fetch stream from %s failed", info.peer_id)
        finally:
            writer.close()


def assemble(spec: RoundSpec, outcomes: dict[int, PartResult | None]) -> tuple[torch.Tensor, dict[int, str]]:
    """The whole buffer's update from its parts, and the parts whose bytes did not decode.

    Packed bits (nbytes,) if every part has a majority result, else float32 (nbytes*8,) with zeros
    where a part is missing or undecodable (every peer holding the same bytes decides the same)."""
    parts = sorted(outcomes)
    if isinstance(spec.upload, Bf16Upload):  # values, not votes: NaN marks what the caller keeps locally
        return _assemble_values(spec, outcomes)
    if spec.result.name == "majority" and all(outcomes[j] is not None for j in parts):
        joined = bytearray(b"".join(outcomes[j].wire for j in parts))
        return (torch.frombuffer(joined, dtype=torch.uint8) if joined else torch.zeros(0, dtype=torch.uint8)), {}
    update, bad = torch.zeros(spec.nbytes * 8, dtype=torch.float32), {}
    for j in parts:
        outcome = outcomes[j]
        if outcome is None:
            continue
        a, b = spec.bounds[j]
        raw = torch.frombuffer(bytearray(outcome.wire), dtype=torch.uint8)
        try:
            if spec.result.name == "majority":
                update[8 * a : 8 * b] = unpack_signs(raw, 8 * (b - a))
            else:
                update[8 * a : 8 * b] = spec.result.decode(raw, 8 * (b - a), len(outcome.counted) * spec.upload.max_code)
        except ValueError as e:
            bad[j] = str(e)
    return update, bad


def _assemble_values(spec: RoundSpec, outcomes: dict[int, PartResult | None]) -> tuple[torch.Tensor, dict[int, str]]:
    values, bad = torch.full((spec.nbytes // 2,), float("nan")), {}
    for j, outcome in outcomes.items():
        if outcome is None:
            continue
        a, b = spec.bounds[j]
        try:
            values[a // 2 : b // 2] = spec.result.decode(torch.frombuffer(bytearray(outcome.wire), dtype=torch.uint8),
                                                         8 * (b - a), len(outcome.counted))
        except ValueError as e:
            bad[j] = str(e)
    return values, bad
