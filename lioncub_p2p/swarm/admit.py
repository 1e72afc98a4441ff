"""The admission exchange ``lioncub/admit/1``: a newcomer and a member prove the run key to each other.

A newcomer N asks the author M of the run's group record (a member, reachable: it leads and listens)
to admit it, on a libp2p stream (both peer ids authenticated by the transport):

    N -> M  HELLO      magic, N's fresh 32-byte nonce
    M -> N  CHALLENGE  magic, flags (secret required, allow-list), M's fresh 32-byte nonce
    N -> M  PROOF      magic, HMAC(run key, "newcomer" | run | N | M | both nonces), zeros without a secret
    N -> M  TICKET     (invited runs) magic, u16 length, N's ticket (``tickets.py``; empty: none)
    M -> N  VERDICT    magic, code, HMAC(run key, "member" | ...) if admitted in a private run, reason
    M -> N  TICKET     (invited runs) M's own ticket: a newcomer trusts only a member the authority invited

The newcomer proves first: a peer that dials a member learns nothing it could test guesses against,
and M proves back only to a newcomer that proved. What an impostor M (someone who published a group
record to lure newcomers) gets is one newcomer proof; each guess against it costs a scrypt of the
run key (40-85 ms). A newcomer trusts a group record only from an author that proved the key (private
runs). A member admits a newcomer for itself (the leader then lists it); the verdict tells a refused
newcomer why, within one exchange, so it stops at once with one line instead of waiting for ever.

Fixed-size messages (no protobuf: nothing here but nonces, MACs and a short reason); every read is
bounded in size and time; a member serves at most ``MAX_CONCURRENT`` exchanges, two per peer id and two
per network address (``wire.gate.address_bucket``: ids cost nothing, so a handful of throwaway ids on
one host held every slot); a stream past them is closed at once, one that has not sent its hello and
proof within ``PROOF_TIMEOUT`` is dropped; and a few per peer per minute (online guessing costs the
guesser a round trip and a scrypt each, and is rate-limited here: those are answered ``BUSY``, which a
newcomer takes as "ask again later", never as a refusal). The proof is checked before the allow-list,
so a peer without the key learns nothing of the list from the verdict.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable

from hivemind.p2p import P2P, PeerID

import struct

from ..allreduce.admission import PROOF_BYTES, Admission
from ..wire import printable
from ..wire.gate import StreamGate, guard
from .records import RateLimitedLog

logger = logging.getLogger(__name__)

ADMIT_PROTOCOL = "lioncub/admit/1"
MAGIC = b"LCA1"
NONCE_BYTES = 32
MAX_REASON_BYTES = 200
EXCHANGE_TIMEOUT = 10.0
PROOF_TIMEOUT = 3.0  # the newcomer's hello and proof, both: until then it is a stranger holding a slot
MAX_CONCURRENT = 16
PER_ADDRESS = 2  # exchanges at once from one network address (``wire.gate.address_bucket``)
MAX_PER_PEER_PER_MINUTE = 6
LINGER_S = 5.0  # a member waits this long for the newcomer to close after the verdict

MAX_TICKET_BYTES = 2048  # tickets.MAX_TICKET_BYTES

SECRET_REQUIRED, ALLOW_LIST, INVITED = 1, 2, 4
ADMITTED, WRONG_SECRET, NOT_ALLOWED, BUSY, NOT_INVITED = 0, 1, 2, 3, 4
_REASONS = {WRONG_SECRET: "wrong or missing run secret", NOT_ALLOWED: "not on the run's allow-list",
            BUSY: "too many admission attempts; try again later"}


class AdmitError(ConnectionError):
    """The exchange broke off (malformed message, timeout, closed stream)."""


@dataclass(frozen=True)
class Verdict:
    admitted: bool
    member_proved: bool  # the member showed it holds the run key (private runs)
    secret_required: bool
    reason: str = ""
    busy: bool = False  # the member had too many exchanges: ask again later, nothing refused
    invited: bool = False  # the member asked for a ticket (an invited run)
    not_invited: bool = False  # refused for this peer's ticket (none, expired, revoked, another run's)


async def _read(reader: asyncio.StreamReader, n: int) -> bytes:
    data = await reader.readexactly(n)
    if data[:4] != MAGIC:
        raise AdmitError("not an admission message")
    return data[4:]


def _ticket_frame(ticket: bytes) -> bytes:
    return MAGIC + struct.pack("<H", len(ticket)) + ticket


async def _read_ticket(reader: asyncio.StreamReader) -> bytes:
    (length,) = struct.unpack("<H", await _read(reader, 4 + 2))
    if length > MAX_TICKET_BYTES:
        raise AdmitError("ticket too long")
    return await reader.readexactly(length)


class AdmitServer:
    """A member's end: answers newcomers, and calls ``on_admitted(peer_id)`` for each that proved the run
    key (private runs; in an open run there is nothing to remember, and throwaway ids would grow it)."""

    def __init__(self, p2p: P2P, admission: Admission, on_admitted: Callable[[str], None]):
        self.p2p, self.admission, self.on_admitted = p2p, admission, on_admitted
        self.peer_id = p2p.peer_id.to_base58()
        # newcomers are strangers: two exchanges each and per address at once, MAX_CONCURRENT in all; a
        # stream past them is closed at once (held open, streams over the cap were no cap at all)
        self.gate = StreamGate("admit", per_peer=2, stranger_per_peer=2, strangers=MAX_CONCURRENT,
                               total=MAX_CONCURRENT, stranger_per_address=PER_ADDRESS)
        self.log = RateLimitedLog(logger)
        self._attempts: OrderedDict[str, deque[float]] = OrderedDict()

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(ADMIT_PROTOCOL, guard(self.gate, self._on_stream))

    def _rate_limited(self, peer_id: str) -> bool:
        now = time.monotonic()
        recent = self._attempts.setdefault(peer_id, deque(maxlen=MAX_PER_PEER_PER_MINUTE))
        self._attempts.move_to_end(peer_id)
        while len(self._attempts) > 4096:
            self._attempts.popitem(last=False)
        if len(recent) == recent.maxlen and now - recent[0] < 60.0:
            return True
        recent.append(now)
        return False

    async def _on_stream(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        newcomer = info.peer_id.to_base58()
        busy = self._rate_limited(newcomer)
        try:
            await asyncio.wait_for(self._exchange(newcomer, reader, writer, busy), EXCHANGE_TIMEOUT)
        except (AdmitError, asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError) as e:
            logger.debug("admission exchange with %s broke off: %s", newcomer, e)

    async def _exchange(self, newcomer: str, reader, writer, busy: bool) -> None:
        # hello and proof within a few seconds: until then the stream holds one of MAX_CONCURRENT slots
        newcomer_nonce, member_nonce, proof, ticket = await asyncio.wait_for(self._hello_and_proof(reader, writer),
                                                                             PROOF_TIMEOUT)
        invitations, uninvited = self.admission.invitations, ""
        if busy:
            code = BUSY
        elif not self.admission.checks_proof(proof, "newcomer", newcomer, self.peer_id, newcomer_nonce, member_nonce):
            code = WRONG_SECRET
        elif self.admission.allow and newcomer not in self.admission.allow:
            code = NOT_ALLOWED
        elif invitations is not None and (uninvited := (invitations.learn(newcomer, ticket) if ticket else
                                                        "it showed no ticket of this run") or ""):
            code = NOT_INVITED
        else:
            code = ADMITTED
        answer = self.admission.proof("member", newcomer, self.peer_id, newcomer_nonce, member_nonce) \
            if code == ADMITTED and self.admission.needs_secret else b""
        if code == ADMITTED and self.admission.needs_secret:  # before the verdict: the newcomer may announce
            self.on_admitted(newcomer)                          # itself the moment it reads it
        elif code != ADMITTED:  # throwaway ids make every line new: rate-limited per reason
            self.log.warning(f"refused:{code}", "refused admission to %s: %s", newcomer, uninvited or _REASONS[code])
        reason = (uninvited or _REASONS.get(code, "")).encode()[:MAX_REASON_BYTES]
        writer.write(MAGIC + bytes([code]) + answer.ljust(PROOF_BYTES, b"\0") + bytes([len(reason)]) + reason
                     + (_ticket_frame(invitations.own) if invitations is not None else b""))
        await writer.drain()
        # let the newcomer close first: closing now can drop the verdict still in flight (seen over QUIC)
        await asyncio.wait_for(reader.read(1), LINGER_S)

    async def _hello_and_proof(self, reader, writer) -> tuple[bytes, bytes, bytes, bytes]:
        """The newcomer's nonce, this member's, the newcomer's proof and (an invited run) its ticket."""
        newcomer_nonce = await _read(reader, 4 + NONCE_BYTES)
        member_nonce = os.urandom(NONCE_BYTES)
        flags = (SECRET_REQUIRED if self.admission.needs_secret else 0) | (ALLOW_LIST if self.admission.allow else 0) \
            | (INVITED if self.admission.invited else 0)
        writer.write(MAGIC + bytes([flags]) + member_nonce)
        await writer.drain()
        proof = await _read(reader, 4 + PROOF_BYTES)
        ticket = await _read_ticket(reader) if self.admission.invited else b""
        return newcomer_nonce, member_nonce, proof, ticket


async def ask_admission(p2p: P2P, member: str, admission: Admission, *, timeout: float = EXCHANGE_TIMEOUT) -> Verdict:
    """Ask ``member`` to admit this peer; raises AdmitError (or a network error) if the exchange breaks."""
    me = p2p.peer_id.to_base58()
    _, reader, writer = await asyncio.wait_for(
        p2p.call_binary_stream_handler(PeerID.from_base58(member), ADMIT_PROTOCOL), timeout)
    try:
        return await asyncio.wait_for(_ask(me, member, admission, reader, writer), timeout)
    finally:
        writer.close()


async def _ask(me: str, member: str, admission: Admission, reader, writer) -> Verdict:
    newcomer_nonce = os.urandom(NONCE_BYTES)
    try:
        writer.write(MAGIC + newcomer_nonce)
        await writer.drain()
        challenge = await _read(reader, 4 + 1 + NONCE_BYTES)
    except (asyncio.IncompleteReadError, ConnectionResetError) as e:
        if getattr(e, "partial", b""):
            raise
        # closed before a byte of its challenge (the hello's write may see it first): its gate was full
        # (admission slots, or this address's)
        return Verdict(False, False, False, _REASONS[BUSY], busy=True)
    flags, member_nonce = challenge[0], challenge[1:]
    required, invited = bool(flags & SECRET_REQUIRED), bool(flags & INVITED)
    # prove only to a member that asks for the secret: an open "member" has no use for our proof
    proof = admission.proof("newcomer", me, member, newcomer_nonce, member_nonce) if required else b""
    own = admission.invitations.own if admission.invitations is not None else b""
    writer.write(MAGIC + proof.ljust(PROOF_BYTES, b"\0") + (_ticket_frame(own) if invited else b""))
    await writer.drain()
    verdict = await _read(reader, 4 + 1 + PROOF_BYTES + 1)
    code, answer, length = verdict[0], verdict[1 : 1 + PROOF_BYTES], verdict[1 + PROOF_BYTES]
    if length > MAX_REASON_BYTES:
        raise AdmitError("reason too long")
    reason = (await reader.readexactly(length)).decode("utf-8", "replace") if length else ""
    member_ticket = await _read_ticket(reader) if invited else b""
    proved = required and admission.needs_secret and admission.checks_proof(
        answer, "member", me, member, newcomer_nonce, member_nonce)
    if admission.invitations is not None:  # an invited run: the member must show the authority's ticket too
        proved = invited and (not admission.needs_secret or proved) \
            and admission.invitations.learn(member, member_ticket) is None
    if code != ADMITTED:  # ``member_proved`` too: a refusal counts only from a member that proved its ticket
        return Verdict(False, proved if admission.invitations is not None else False, required,
                       printable(reason, MAX_REASON_BYTES) or f"code {code}", busy=code == BUSY, invited=invited,
                       not_invited=code == NOT_INVITED)
    return Verdict(True, proved, required, invited=invited)
