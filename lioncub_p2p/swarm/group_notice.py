"""``lioncub/group/1``: the leader hands each member a new group record as it publishes it.

Members read group records from the DHT once per refresh period, and a read takes from milliseconds
to seconds, while a new group starts only a few steps after it is planned (``lead.steps_ahead``). A
member that read it after its first step ran that step in the old group, and every member waited
for it (seen: 0 steps of notice, ~11 s lost by all at the next step). So the leader also sends the
record to every other member of the new group, on a stream of its own:

    L -> M  GroupNotice   what the leader stores in the DHT: payload, public key, signature, expiration
    M       closes        (nothing is answered; the leader waits for the close, bounded)

The member checks a notice as it checks a record read from the DHT: signed for this run by the
sender's own peer id (``records.open_record``), unexpired, a valid ``GroupRecord`` whose author is a
member, and then the same rules decide whether it follows it (``Upkeep.consider``,
``membership.next_group``: only from a member of its latest groups, newer, within the step window).
Only members of this peer's groups may open such a stream, two each, ``MAX_STREAMS`` in all, read
within ``READ_TIMEOUT``. A notice that is lost or late changes nothing: the DHT read still comes.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_dht_time

from ..identity import Identity, Verifier
from ..wire import PROTOCOL_VERSION, WireError, pb, read_frame, write_frame
from ..wire.gate import StreamGate, guard
from .membership import GroupRecord
from .records import LIMITS, RateLimitedLog, RecordError, open_record, seal

logger = logging.getLogger(__name__)

GROUP_PROTOCOL = "lioncub/group/1"
MAX_NOTICE_BYTES = LIMITS["group"][0] + 4096  # the largest group record, its key and signature
MAX_STREAMS = 8
READ_TIMEOUT = 5.0
SEND_TIMEOUT = 5.0  # per member: open, write, and wait for its close
SEND_PARALLEL = 16  # members notified at once


def notice_of(identity: Identity, run_id: str, record: GroupRecord, ttl: float) -> pb.GroupNotice:
    """``record`` signed by ``identity`` (its author), as the DHT value is."""
    expiration = get_dht_time() + ttl
    value = seal(identity, run_id, "group", expiration, record.payload())
    return pb.GroupNotice(version=PROTOCOL_VERSION, payload=value["p"], public_key=value["k"], signature=value["s"],
                          expiration=expiration)


def open_notice(notice: pb.GroupNotice, run_id: str, sender: str, verifier: Verifier) -> GroupRecord:
    """The group record of a notice from ``sender``; RecordError (or KeyError) if anything is off."""
    if notice.expiration <= get_dht_time():
        raise RecordError("the notice expired")
    value = {"r": run_id, "t": "group", "p": notice.payload, "k": notice.public_key, "s": notice.signature}
    return GroupRecord.authored(open_record(verifier, run_id, "group", sender, value, notice.expiration), sender)


class GroupNoticeServer:
    """A member's end: ``on_group`` gets each checked record (on the event loop, like the DHT reads)."""

    def __init__(self, p2p: P2P, run_id: str, verifier: Verifier, is_member: Callable[[str], bool],
                 on_group: Callable[[GroupRecord], None], log: RateLimitedLog):
        self.p2p, self.run_id, self.verifier, self.on_group, self.log = p2p, run_id, verifier, on_group, log
        # two per member: a leader may plan the next epoch while its last notice is still being read
        self.gate = StreamGate("group", per_peer=2, stranger_per_peer=0, strangers=0, total=MAX_STREAMS,
                               is_member=is_member)

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(GROUP_PROTOCOL, guard(self.gate, self._on_stream))

    async def _on_stream(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sender = info.peer_id.to_base58()
        try:
            notice, _ = await asyncio.wait_for(read_frame(reader, pb.GroupNotice, MAX_NOTICE_BYTES), READ_TIMEOUT)
            if notice is None:
                return
            group = open_notice(notice, self.run_id, sender, self.verifier)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError) as e:
            logger.debug("group notice from %s broke off: %s", sender, type(e).__name__)
            return
        except (WireError, RecordError, KeyError, ValueError, TypeError) as e:
            self.log.warning(f"notice:{sender}", "ignoring a group notice from %.60s: %s", sender, e)
            return
        try:
            self.on_group(group)
        except Exception as e:  # as a failed DHT read: upkeep's next read goes on
            self.log.warning("notice:follow", "following a group notice failed: %s: %s", type(e).__name__, e)


async def send_notices(p2p: P2P, notice: pb.GroupNotice, peer_ids: Iterable[str]) -> int:
    """Send ``notice`` to each peer, ``SEND_PARALLEL`` at once; how many closed the stream after it (read
    it, or refused it at the gate: a member that refused it reads the DHT)."""
    limit = asyncio.Semaphore(SEND_PARALLEL)

    async def send(peer_id: str) -> bool:
        async with limit:
            try:
                return await asyncio.wait_for(_send_one(p2p, notice, peer_id), SEND_TIMEOUT)
            except Exception as e:  # a member we cannot reach reads the DHT as before
                logger.debug("group notice to %s not sent: %s: %s", peer_id, type(e).__name__, e)
                return False

    return sum(await asyncio.gather(*(send(pid) for pid in peer_ids)))


async def _send_one(p2p: P2P, notice: pb.GroupNotice, peer_id: str) -> bool:
    _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), GROUP_PROTOCOL)
    try:
        await write_frame(writer, notice)
        return await reader.read(1) == b""  # the member closes once it has read the notice
    finally:
        writer.close()
