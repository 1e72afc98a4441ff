"""The wire protocol: messages generated from ``proto/lioncub.proto`` and their framing on streams.

Regenerate after editing the .proto (a test fails while the module is stale):

    python -m grpc_tools.protoc -Iproto --python_out=lioncub_p2p/wire proto/lioncub.proto

Streams are hivemind P2P binary streams carrying frames ``[4-byte big-endian length][message]``,
each handed to the libp2p daemon in one write (two writes cost a second syscall and daemon read per
frame: -17% median step on loopback with one). Readers check the length against a cap *before*
reading the body, so an oversized or garbage frame costs at most 4 bytes of memory; nothing from a
peer is ever unpickled. ``gate`` bounds what a stream gets before its sender is admitted.

Closing: the side that writes last must not close its stream right after its last write. The libp2p
daemon then tears the stream down with the tail still in flight, and over QUIC that tail is lost
(a 70 KB reply followed by a close was lost in 24 to 27 of 30 trials on loopback; never over TCP).
``close_after_reply`` waits, bounded in time and bytes, for the reader to close its end first;
readers close as soon as they have read what they asked for.
"""
from __future__ import annotations

import asyncio

from google.protobuf.message import DecodeError, Message

from . import lioncub_pb2 as pb

# 2: signed results, audits, voter statements, admission before resources; 3: the run setting "delay"
# (overlapped rounds) and snapshots that carry the vote in flight; 4: the quorum of a group's expected
# voters (group records mark followers, result headers carry the quorum); 5: a two-level vote's reducers
# sign their margins' root in the second-level round (voter statements there), group-round headers carry
# the second level's slices and margin bits, and evidence may carry a MarginsProof; 6: a two-level vote
# never makes a group of one (``allreduce.hierarchy.assign_groups``): older peers would split differently;
# leaders send new group records to their members (``lioncub/group/1``, ``GroupNotice``); 7: a trimmed
# momentum mean of two voters clips both rows to the smaller signed maximum (older peers would convict
# its reducer in audits); 8: round ids name the protocol version (a header signed under another version's
# rules names no round of this one)
PROTOCOL_VERSION = 9
HEADER_BYTES = 4
LINGER_S = 5.0  # the longest a writer waits for its reader to close after the last reply
LINGER_BYTES = 4 << 20  # ...reading and dropping at most this much meanwhile
MAX_CHUNK_BYTES = 1 << 20  # payload bytes per message
MAX_FRAME_BYTES = MAX_CHUNK_BYTES + 4096  # payload plus the largest header fields we accept


class WireError(Exception):
    """A peer sent something that breaks the protocol; the stream is dropped and the reason logged."""


async def write_frame(writer: asyncio.StreamWriter, message: Message) -> int:
    """Send one message; returns the bytes put on the stream (framing included)."""
    body = message.SerializeToString()
    writer.write(len(body).to_bytes(HEADER_BYTES, "big") + body)  # one write: see the module docstring
    await writer.drain()
    return HEADER_BYTES + len(body)


async def read_frame(reader: asyncio.StreamReader, message_type: type[Message],
                     max_bytes: int = MAX_FRAME_BYTES) -> tuple[Message | None, int]:
    """Read one message; (None, 0) at a clean end of stream. Raises WireError on a bad frame."""
    try:
        header = await reader.readexactly(HEADER_BYTES)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None, 0
        raise WireError("stream ended inside a frame header") from e
    length = int.from_bytes(header, "big")
    if length > max_bytes:
        raise WireError(f"frame of {length} bytes exceeds the {max_bytes}-byte limit")
    try:
        body = await reader.readexactly(length)
    except asyncio.IncompleteReadError as e:
        raise WireError(f"stream ended after {len(e.partial)} of {length} frame bytes") from e
    message = message_type()
    try:
        message.ParseFromString(body)
    except DecodeError as e:
        raise WireError(f"undecodable {message_type.__name__}: {e}") from e
    if message.version != PROTOCOL_VERSION:
        raise WireError(f"protocol version {message.version}, this peer speaks {PROTOCOL_VERSION}")
    return message, HEADER_BYTES + length


async def close_after_reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, timeout: float = LINGER_S,
                            max_bytes: int = LINGER_BYTES) -> bool:
    """Close a stream after this side's last write, once the other side has closed its end.

    Waits at most ``timeout`` seconds and drops at most ``max_bytes`` the other side still sends,
    so a peer that never closes holds the stream no longer than that. True if the other side closed."""
    loop = asyncio.get_running_loop()
    deadline, left, closed = loop.time() + timeout, max_bytes, False
    try:
        while left > 0:
            data = await asyncio.wait_for(reader.read(min(left, 64 << 10)), max(deadline - loop.time(), 0.0))
            if not data:
                closed = True
                break
            left -= len(data)
    except (asyncio.TimeoutError, ConnectionError, OSError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()
    return closed


def printable(text: str, limit: int = 200) -> str:
    """A peer's text (an error, a reason) as it may go into a log line: printable characters only (no
    newline or terminal escape to forge lines with), at most ``limit`` of them."""
    return "".join(ch for ch in text[: 4 * limit] if ch.isprintable())[:limit]


__all__ = ["pb", "PROTOCOL_VERSION", "MAX_CHUNK_BYTES", "MAX_FRAME_BYTES", "WireError", "write_frame", "read_frame",
           "close_after_reply", "LINGER_S", "printable"]
