"""``lioncub/accuse/1``: a member tells another member (the group's leader) that a reducer cheated.

Audits (``allreduce/audit.py``) leave each voter with what it caught (``RoundReport.caught``); only
the group's leader can drop a member, so the others send it what they caught on a stream of its own
(evidence can be megabytes: a DHT record is no place for it):

    A -> L  HEADER    magic, kind, part, step, and the lengths of round id, accused, reason, evidence
    A -> L  FIELDS    round id, accused peer id, reason (UTF-8, <= 200 bytes)
    L -> A  READY     magic, code 2 (send the evidence): only for a lie whose header L accepts
    A -> L  EVIDENCE  the ``Evidence`` bytes of a lie
    L -> A  VERDICT   magic, code (0 taken, 1 refused), a reason of <= 200 bytes

The receiver checks the fixed header and the fields before reading any evidence: the sender must
be a member of the round's group, the accused that round's reducer of the part, and the evidence
no larger than what such a round can produce (``on_header`` returns that bound, or refuses). Then
``on_accusation`` decides, from the evidence alone for a lie (``audit.check_evidence``; an
accusation without valid evidence is refused), or as one member's suspicion otherwise. A member
serves one accusation per peer at once, ``MAX_CONCURRENT`` in all, a few per peer per minute, each
within ``EXCHANGE_TIMEOUT``.
"""
from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Awaitable, Callable

from hivemind.p2p import P2P, PeerID
from google.protobuf.message import DecodeError

from ..allreduce.audit import MAX_EVIDENCE_BYTES, check_evidence
from ..allreduce.commit import parse_header
from ..identity import Verifier
from ..wire import WireError, pb, printable
from ..wire.gate import StreamGate, guard

logger = logging.getLogger(__name__)

ACCUSE_PROTOCOL = "lioncub/accuse/1"
MAGIC = b"LCE1"
KINDS = ("lie", "misrepresented", "unanswered")
_HEADER = struct.Struct("!4sBIQBBBI")  # magic, kind, part, step, len(round id), len(accused), len(reason), len(evidence)
MAX_ROUND_ID = 64
MAX_PEER_ID = 128
MAX_REASON = 200
EXCHANGE_TIMEOUT = 60.0  # the whole exchange, evidence included
MAX_CONCURRENT = 4
MAX_PER_PEER_PER_MINUTE = 10
RATE_LIMITED = "too many accusations: try again later"  # an accuser tells it again later (Verdicts._send)
LINGER_S = 5.0  # wait for the accuser to close after the verdict (over QUIC a closed stream can lose its last write)
TAKEN, REFUSED, READY = 0, 1, 2


@dataclass(frozen=True)
class Accusation:
    kind: str  # "lie" (with evidence), "misrepresented", "unanswered" (suspicions)
    accused: str
    round_id: bytes
    part: int
    step: int
    reason: str
    evidence: bytes = b""


class Refused(Exception):
    """Why an accusation was not taken (sent back to the accuser, and logged)."""


@dataclass(frozen=True)
class Proof:
    reducer: str
    round_id: bytes
    part: int
    step: int
    reason: str


def prove(evidence: bytes, verifier: Verifier | None = None) -> Proof | None:
    """What ``evidence`` proves (``audit.check_evidence``), with the round's step, or None."""
    verdict = check_evidence(evidence, verifier)
    if verdict is None:
        return None
    try:  # check_evidence parsed and checked the same bytes: this cannot fail now, but stay total
        step = parse_header(pb.Evidence.FromString(evidence).header).step
    except (DecodeError, WireError, ValueError):
        return None
    reducer, round_id, part, reason = verdict
    return Proof(reducer, round_id, part, step, reason)


def _clean(text: str) -> str:
    return printable(text, MAX_REASON)


def _encode(accusation: Accusation) -> bytes:
    rid, accused = accusation.round_id, accusation.accused.encode()
    reason = _clean(accusation.reason).encode()[:MAX_REASON]
    if len(rid) > MAX_ROUND_ID or len(accused) > MAX_PEER_ID or len(accusation.evidence) > MAX_EVIDENCE_BYTES:
        raise ValueError("accusation too large")
    header = _HEADER.pack(MAGIC, KINDS.index(accusation.kind), accusation.part, accusation.step, len(rid),
                          len(accused), len(reason), len(accusation.evidence))
    return header + rid + accused + reason


HeaderCheck = Callable[[str, Accusation, int], int]  # (accuser, accusation without evidence, evidence bytes) -> bound
Decide = Callable[[str, Accusation], Awaitable[str]]  # (accuser, accusation) -> what was done; raises Refused


class AccuseServer:
    """A member's end. ``on_header`` checks an accusation before its evidence is read (raises Refused,
    or returns the most evidence bytes it accepts); ``on_accusation`` acts on it (raises Refused)."""

    def __init__(self, p2p: P2P, on_header: HeaderCheck, on_accusation: Decide,
                 is_member: Callable[[str], bool]):
        self.p2p, self.on_header, self.on_accusation = p2p, on_header, on_accusation
        self.gate = StreamGate("accuse", per_peer=1, stranger_per_peer=0, strangers=0, total=MAX_CONCURRENT,
                               is_member=is_member)
        self._attempts: OrderedDict[str, deque[float]] = OrderedDict()

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(ACCUSE_PROTOCOL, guard(self.gate, self._on_stream))

    def _rate_limited(self, peer_id: str) -> bool:
        now = time.monotonic()
        recent = self._attempts.setdefault(peer_id, deque(maxlen=MAX_PER_PEER_PER_MINUTE))
        self._attempts.move_to_end(peer_id)
        while len(self._attempts) > 1024:
            self._attempts.popitem(last=False)
        if len(recent) == recent.maxlen and now - recent[0] < 60.0:
            return True
        recent.append(now)
        return False

    async def _on_stream(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accuser = info.peer_id.to_base58()
        try:
            code, note = await asyncio.wait_for(self._exchange(accuser, reader, writer), EXCHANGE_TIMEOUT)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError) as e:
            logger.info("accusation from %s broke off: %s", accuser, type(e).__name__)
            return
        except Exception as e:  # a bug here must not take the handler down with a traceback
            logger.warning("accusation from %s failed: %s: %s", accuser, type(e).__name__, e)
            code, note = REFUSED, "internal error"
        try:
            await asyncio.wait_for(_answer(writer, code, note), LINGER_S)
            await asyncio.wait_for(reader.read(1), LINGER_S)  # the accuser closes first
        except (asyncio.TimeoutError, ConnectionError, OSError):
            pass

    async def _exchange(self, accuser: str, reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter) -> tuple[int, str]:
        fixed = await reader.readexactly(_HEADER.size)
        magic, kind, part, step, n_rid, n_accused, n_reason, n_evidence = _HEADER.unpack(fixed)
        if magic != MAGIC or kind >= len(KINDS) or not 0 < n_rid <= MAX_ROUND_ID or not 0 < n_accused <= MAX_PEER_ID \
                or n_reason > MAX_REASON or n_evidence > MAX_EVIDENCE_BYTES:
            return REFUSED, "malformed accusation"
        fields = await reader.readexactly(n_rid + n_accused + n_reason)
        try:
            accused = fields[n_rid : n_rid + n_accused].decode()
        except UnicodeDecodeError:
            return REFUSED, "malformed accusation"
        accusation = Accusation(KINDS[kind], accused, fields[:n_rid], part, step,
                                _clean(fields[n_rid + n_accused :].decode("utf-8", "replace")))
        if self._rate_limited(accuser):
            return REFUSED, RATE_LIMITED
        if (accusation.kind == "lie") != (n_evidence > 0):
            return REFUSED, "a lie needs evidence, a suspicion has none"
        try:
            bound = self.on_header(accuser, accusation, n_evidence)
            if n_evidence > bound:
                raise Refused(f"{n_evidence} bytes of evidence, more than such a round produces ({bound})")
            evidence = b""
            if n_evidence:  # only now may the accuser send it: nothing refused is ever sent or read
                await _answer(writer, READY, "")
                evidence = await reader.readexactly(n_evidence)
            done = await self.on_accusation(accuser, Accusation(**{**accusation.__dict__, "evidence": evidence}))
        except Refused as e:
            logger.info("refused an accusation of %s by %s: %s", accusation.accused, accuser, e)
            return REFUSED, str(e)
        return TAKEN, done


async def _answer(writer: asyncio.StreamWriter, code: int, note: str) -> None:
    reason = _clean(note).encode()[:MAX_REASON]
    writer.write(MAGIC + bytes([code, len(reason)]) + reason)
    await writer.drain()


async def _read_answer(reader: asyncio.StreamReader) -> tuple[int, str]:
    head = await reader.readexactly(len(MAGIC) + 2)
    if head[:4] != MAGIC or head[4] not in (TAKEN, REFUSED, READY) or head[5] > MAX_REASON:
        raise ConnectionError("not an accusation verdict")
    note = (await reader.readexactly(head[5])).decode("utf-8", "replace") if head[5] else ""
    return head[4], _clean(note)


async def send_accusation(p2p: P2P, to: str, accusation: Accusation, *,
                          timeout: float = EXCHANGE_TIMEOUT) -> tuple[bool, str]:
    """Send ``accusation`` to member ``to``; (taken, its note). Raises on a broken exchange."""
    async def exchange() -> tuple[bool, str]:
        _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(to), ACCUSE_PROTOCOL)
        try:
            writer.write(_encode(accusation))
            await writer.drain()
            code, note = await _read_answer(reader)
            if code == READY and accusation.evidence:
                chunk = 1 << 20
                for offset in range(0, len(accusation.evidence), chunk):
                    writer.write(accusation.evidence[offset : offset + chunk])
                    await writer.drain()
                code, note = await _read_answer(reader)
            if code == READY:
                raise ConnectionError("asked for evidence twice")
            return code == TAKEN, note
        finally:
            writer.close()

    return await asyncio.wait_for(exchange(), timeout)


class Suspicions:
    """Reports nobody can prove (a misrepresented vote, an unanswered audit): a reducer is suspect for
    ``window`` seconds once ``by`` distinct members reported it *for the same round* (independent
    witnesses of one event, so scattered false alarms over a long run never add up to a drop)."""

    def __init__(self, by: int = 2, window: float = 300.0, max_rounds: int = 64, max_accused: int = 4096):
        self.by, self.window, self.max_rounds, self.max_accused = by, window, max_rounds, max_accused
        self._reports: OrderedDict[str, OrderedDict[bytes, dict[str, str]]] = OrderedDict()
        self._since: dict[str, tuple[float, list[str]]] = {}  # suspect -> (when, the reports that made it one)

    def add(self, accused: str, round_id: bytes, accuser: str, reason: str, *, now: float | None = None) -> bool:
        """Note one report; True if it makes ``accused`` a suspect."""
        now = time.monotonic() if now is None else now
        rounds = self._reports.setdefault(accused, OrderedDict())
        self._reports.move_to_end(accused)
        while len(self._reports) > self.max_accused:
            self._reports.popitem(last=False)
        witnesses = rounds.setdefault(round_id, {})
        rounds.move_to_end(round_id)
        while len(rounds) > self.max_rounds:
            rounds.popitem(last=False)
        if accuser in witnesses or accuser == accused:
            return False
        witnesses[accuser] = reason
        if len(witnesses) < self.by:
            return False
        was = self.suspected(accused, now=now)
        self._since[accused] = (now, [f"{pid}: {why}" for pid, why in witnesses.items()])
        return not was

    def suspected(self, accused: str, *, now: float | None = None) -> bool:
        since = self._since.get(accused)
        return since is not None and (time.monotonic() if now is None else now) - since[0] < self.window

    def suspects(self, *, now: float | None = None) -> set[str]:
        now = time.monotonic() if now is None else now
        for old in [pid for pid, (t, _) in self._since.items() if now - t >= self.window]:
            del self._since[old]
        return set(self._since)

    def reasons(self, accused: str) -> list[str]:
        return list(self._since.get(accused, (0.0, []))[1])
