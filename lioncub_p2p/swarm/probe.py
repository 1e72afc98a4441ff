"""A bandwidth probe every swarm member answers, for volunteers' preflight checks.

``lioncub/probe/1``: the caller sends a ``ProbeRequest`` (how many bytes it will send, how many it
wants back, each at most 8 MiB), then that many bytes; the member reads and discards them, block by
block, and answers with the requested bytes. Both directions are timed by the caller.

A probe costs the member at most one 64 KiB block of memory and ``PROBE_DEADLINE_S`` of time, and a
member serves ``MAX_PROBES`` at once, one per caller: probes cannot grow a trainer or crowd it.
"""
from __future__ import annotations

import asyncio
import time

from hivemind.p2p import P2P, PeerID

from ..allreduce.admission import OPEN, Admission
from ..wire import PROTOCOL_VERSION, WireError, close_after_reply, pb, read_frame, write_frame
from ..wire.gate import StreamGate, guard

PROBE_PROTOCOL = "lioncub/probe/1"
MAX_PROBE_BYTES = 8 << 20
BLOCK = 64 << 10
MAX_PROBES = 4
FIRST_FRAME_S = 5.0
PROBE_DEADLINE_S = 120.0  # 2 x 8 MiB at ~1.1 Mbit/s


async def serve_probe(p2p: P2P, admission: Admission = OPEN) -> StreamGate:
    """Answer bandwidth probes; returns the gate (its counters say how many were refused)."""
    gate = StreamGate("probe", per_peer=1, stranger_per_peer=1, strangers=MAX_PROBES, total=MAX_PROBES)

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, req: pb.ProbeRequest) -> None:
        left = req.upload_bytes
        while left:  # read and drop: never hold more than a block of what the caller sends
            block = await reader.read(min(BLOCK, left))
            if not block:
                raise asyncio.IncompleteReadError(b"", left)
            left -= len(block)
        block = bytes(BLOCK)
        for offset in range(0, req.download_bytes, BLOCK):
            writer.write(block[: min(BLOCK, req.download_bytes - offset)])
            await writer.drain()

    async def handle(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            req, _ = await asyncio.wait_for(read_frame(reader, pb.ProbeRequest, 1024), FIRST_FRAME_S)
            if req is None or admission.reason(info.peer_id.to_base58(), req.token):
                return
            if req.upload_bytes > MAX_PROBE_BYTES or req.download_bytes > MAX_PROBE_BYTES:
                raise WireError("probe larger than 8 MiB")
            await asyncio.wait_for(answer(reader, writer, req), PROBE_DEADLINE_S)
            await close_after_reply(reader, writer)  # the caller closes once it has read it all (QUIC)
        except (WireError, asyncio.TimeoutError, ConnectionError, asyncio.IncompleteReadError, OSError):
            pass

    await p2p.add_binary_stream_handler(PROBE_PROTOCOL, guard(gate, handle))
    return gate


async def measure(p2p: P2P, peer_id: str, *, nbytes: int = 4 << 20, token: bytes = b"") -> tuple[float, float]:
    """(upload, download) in Mbit/s between this peer and ``peer_id``."""
    _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), PROBE_PROTOCOL)
    try:
        await write_frame(writer, pb.ProbeRequest(version=PROTOCOL_VERSION, upload_bytes=nbytes, download_bytes=nbytes,
                                                  token=token))
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
