"""What ``VoteNode`` (node.py) and its mixins share, so that no mixin imports node.py: the stream
protocol names, the network errors a stream may end with, the phrases refusals are recognized by,
``StreamClosed``, ``RoundState`` (one round in the node's live table, ``VoteNode._rounds``) and two
waits on events. Holds no state of its own.

``logger`` is node.py's logger, used by every mixin: VoteNode's log lines keep the name they had when
it was one module (log formats print it; tests capture it).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from ..wire import MAX_FRAME_BYTES, WireError
from .commit import MAX_HEADER_BYTES
from .reducer import PartReduction
from .round import PartResult, RoundReport, RoundSpec

logger = logging.getLogger("lioncub_p2p.allreduce.node")

VOTE_PROTOCOL = "lioncub/vote/1"
FETCH_PROTOCOL = "lioncub/fetch/1"
AUDIT_PROTOCOL = "lioncub/audit/1"
NETWORK_ERRORS = (ConnectionError, asyncio.IncompleteReadError, OSError, EOFError)
RESULT_FRAME_BYTES = MAX_FRAME_BYTES + MAX_HEADER_BYTES + 1024  # a first result chunk carries the header
OTHER_GROUP = "in another group"  # how a reducer refuses votes for a step it ran under another round id
HELD_UP = "its training is held up"  # how a stalled peer refuses rounds it has not started (``_find_round``)
FINISHED = "round already finished"  # how a reducer refuses a round that left its table of live rounds


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
    voted: bool = False
    tag: bytes = b""
    provisional: bool = False  # this peer's state was caught up, not yet decided for (``VoteChunk.provisional``)
    recovered: dict[int, PartResult] = field(default_factory=dict)  # parts received from other peers
    # part -> (monotonic time its result arrived, whether its reducer itself sent it): audits start from here
    received: dict[int, tuple[float, bool]] = field(default_factory=dict)
    handlers: set = field(default_factory=set)  # stream handler tasks serving this round here
    declared: list[bytes] = field(default_factory=list)  # result bases this peer named to its reducers
    deltas: dict = field(default_factory=dict)  # (bases named, plain result) -> what encode_for made of it
    asked: set[int] = field(default_factory=set)  # parts asked of their reducer in vain (``_ask_reducer``)


async def _first_of(a: asyncio.Event, b: asyncio.Event, timeout: float) -> None:
    """Wait until ``a`` or ``b`` is set; ``asyncio.TimeoutError`` after ``timeout`` seconds."""
    waits = [asyncio.ensure_future(a.wait()), asyncio.ensure_future(b.wait())]
    try:
        done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
    if not done:
        raise asyncio.TimeoutError


async def _set_within(event: asyncio.Event, seconds: float) -> bool:
    """Whether ``event`` is set within ``seconds``."""
    try:
        await asyncio.wait_for(event.wait(), seconds)
        return True
    except asyncio.TimeoutError:
        return False
