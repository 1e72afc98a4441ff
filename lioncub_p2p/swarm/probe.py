"""A bandwidth probe every swarm member answers, for volunteers' preflight checks.

``lioncub/probe/2``: the caller sends a ``ProbeRequest`` (how many bytes it will send, how many it
wants back, each at most 8 MiB); the member answers one status byte (``GO``; ``BUSY`` or ``DENIED``, a
token this run does not admit, and closes), the caller then sends that many bytes, and the member reads and discards them, block by block, and
answers with the requested bytes. Both directions are timed by the caller.

A probe costs the member at most one 64 KiB block of memory and ``PROBE_DEADLINE_S`` of time, and a
member serves ``MAX_PROBES`` at once, one per caller: probes cannot grow a trainer or crowd it. Nor can
they take its link: all probes together spend a ``ProbeBudget`` of bytes (a burst of
``BUDGET_BYTES``, refilled at ``BUDGET_BYTES_PER_S``, about 1 Mbit/s), since peer ids cost a stranger
nothing; past it a member answers ``BUSY`` and the caller asks another member. A stream over the
gate's caps (one per caller and per address) is closed before a byte is read: the caller hears nothing,
which ``measure`` reports as busy, never as a refused token (another volunteer behind the same NAT
probing at the same time is not a wrong run secret).
"""
from __future__ import annotations

import asyncio
import time

from hivemind.p2p import P2P, PeerID

from ..allreduce.admission import OPEN, Admission
from ..wire import PROTOCOL_VERSION, WireError, close_after_reply, pb, read_frame, write_frame
from ..wire.gate import StreamGate, guard

PROBE_PROTOCOL = "lioncub/probe/2"
MAX_PROBE_BYTES = 8 << 20
BLOCK = 64 << 10
MAX_PROBES = 4
FIRST_FRAME_S = 5.0
PROBE_DEADLINE_S = 120.0  # 2 x 8 MiB at ~1.1 Mbit/s
BUDGET_BYTES = 4 * MAX_PROBE_BYTES  # two of the largest probes at once, or four preflights (4 MiB each way)
BUDGET_BYTES_PER_S = 128 << 10  # ~1 Mbit/s: one preflight's probe a minute, sustained
GO, BUSY, DENIED = b"\x00", b"\x01", b"\x02"


class ProbeBusy(Exception):
    """The member cannot take this probe now (its budget or its slots are taken): ask another member."""


class ProbeDenied(Exception):
    """The member does not admit this peer's run token (a wrong or missing run secret, or not allow-listed)."""


class ProbeBudget:
    """Bytes all probes of one member may move: a bucket of ``capacity`` bytes refilled at ``rate``."""

    def __init__(self, capacity: float = BUDGET_BYTES, rate: float = BUDGET_BYTES_PER_S):
        self.capacity, self.rate = capacity, rate
        self.left, self.at = capacity, time.monotonic()

    def spend(self, nbytes: int) -> bool:
        now = time.monotonic()
        self.left = min(self.capacity, self.left + (now - self.at) * self.rate)
        self.at = now
        if nbytes > self.left:
            return False
        self.left -= nbytes
        return True

    def refund(self, nbytes: int) -> None:
        """Bytes reserved by ``spend`` that never moved (a caller that read GO and left)."""
        self.left = min(self.capacity, self.left + nbytes)


async def serve_probe(p2p: P2P, admission: Admission = OPEN, budget: ProbeBudget | None = None) -> StreamGate:
    """Answer bandwidth probes; returns the gate (its counters say how many were refused)."""
    gate = StreamGate("probe", per_peer=1, stranger_per_peer=1, strangers=MAX_PROBES, total=MAX_PROBES,
                      stranger_per_address=1)  # ids cost nothing: one host cannot take every probe slot
    budget = budget or ProbeBudget()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, req: pb.ProbeRequest,
                     moved: list[int]) -> None:
        left = req.upload_bytes
        while left:  # read and drop: never hold more than a block of what the caller sends
            block = await reader.read(min(BLOCK, left))
            if not block:
                raise asyncio.IncompleteReadError(b"", left)
            left -= len(block)
            moved[0] += len(block)
        block = bytes(BLOCK)
        for offset in range(0, req.download_bytes, BLOCK):
            size = min(BLOCK, req.download_bytes - offset)
            writer.write(block[:size])
            await writer.drain()
            moved[0] += size

    async def handle(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            req, _ = await asyncio.wait_for(read_frame(reader, pb.ProbeRequest, 1024), FIRST_FRAME_S)
            if req is None:
                return
            if req.upload_bytes > MAX_PROBE_BYTES or req.download_bytes > MAX_PROBE_BYTES:
                raise WireError("probe larger than 8 MiB")
            denied = admission.reason(info.peer_id.to_base58(), req.token)
            if denied or not budget.spend(req.upload_bytes + req.download_bytes):
                writer.write(DENIED if denied else BUSY)  # said, so a caller tells a wrong secret from a full member
                await writer.drain()
                if denied:  # a status closed at once can be lost (QUIC); a lost BUSY reads as busy anyway.
                    await close_after_reply(reader, writer, timeout=2.0, max_bytes=64)  # nothing uncharged moves
                return
            writer.write(GO)
            moved = [0]  # charged as the bytes move: a caller that reads GO and leaves spends nothing
            try:
                await asyncio.wait_for(answer(reader, writer, req, moved), PROBE_DEADLINE_S)
            finally:
                budget.refund(req.upload_bytes + req.download_bytes - moved[0])
            await close_after_reply(reader, writer)  # the caller closes once it has read it all (QUIC)
        except (WireError, asyncio.TimeoutError, ConnectionError, asyncio.IncompleteReadError, OSError):
            pass

    await p2p.add_binary_stream_handler(PROBE_PROTOCOL, guard(gate, handle))
    return gate


async def measure(p2p: P2P, peer_id: str, *, nbytes: int = 4 << 20, token: bytes = b"") -> tuple[float, float]:
    """(upload, download) in Mbit/s between this peer and ``peer_id``. Raises ``ProbeDenied`` when the
    member refuses this peer's token, ``ProbeBusy`` when its probe budget is spent or it closed the
    stream unanswered (its slots were taken), ConnectionError or IncompleteReadError when a probe broke off."""
    _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), PROBE_PROTOCOL)
    try:
        try:  # the gate may close the stream before the request is through
            await write_frame(writer, pb.ProbeRequest(version=PROTOCOL_VERSION, upload_bytes=nbytes,
                                                      download_bytes=nbytes, token=token))
            status = await reader.readexactly(1)
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            raise ProbeBusy(f"{peer_id[:12]}… closed the probe unanswered ({type(e).__name__}: its probe slots are "
                            "taken, one per address): ask another member, or again in a minute") from e
        if status == DENIED:
            raise ProbeDenied(f"{peer_id[:12]}… does not admit this peer's run token")
        if status != GO:
            raise ProbeBusy(f"{peer_id[:12]}… answered probes of others in the last minutes (its probe budget is "
                            "spent): ask another member, or again in a minute")
        started = time.perf_counter()
        block = bytes(BLOCK)
        for offset in range(0, nbytes, BLOCK):
            writer.write(block[: min(BLOCK, nbytes - offset)])
            await writer.drain()
        first = await reader.readexactly(1)  # the member answers only after reading everything we sent
        up = time.perf_counter() - started
        started = time.perf_counter()
        await reader.readexactly(nbytes - len(first))
        down = time.perf_counter() - started
        return 8 * nbytes / up / 1e6, 8 * nbytes / down / 1e6
    finally:
        writer.close()
