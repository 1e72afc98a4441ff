"""Admission before resources: what an incoming stream may hold before its sender is admitted.

A libp2p stream arrives with the remote peer id (authenticated by the transport) and nothing else.
Every stream handler sits behind a ``StreamGate``:

* a *member* (a peer this one currently runs rounds with, ``is_member``) may hold ``per_peer``
  streams on the handler at once;
* any other peer (a *stranger*: an outsider, or a newcomer not yet in a group) may hold
  ``stranger_per_peer``, and all strangers together ``strangers``, so strangers can never use up
  members' capacity, however many peer ids they make;
* ``total`` caps everything;
* a stream over its cap is closed at once, before a byte is read from it.

The handler then reads its first frame under a short deadline and checks the sender (token,
membership) before giving the stream anything else: a table entry, a buffer, a download slot.
``guard`` wraps a handler with its gate and ends it quietly when the event loop cancels it (an
orderly leave): asyncio logs a cancelled connection task as an ERROR with a traceback otherwise.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Awaitable, Callable

logger = logging.getLogger(__name__)

Handler = Callable[[object, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
WARN_EVERY_S = 60.0  # one warning per refused peer and gate per minute; the rest at debug level


class StreamGate:
    def __init__(self, name: str, *, per_peer: int = 8, stranger_per_peer: int = 2, strangers: int = 32,
                 total: int = 256, is_member: Callable[[str], bool] | None = None):
        if min(per_peer, stranger_per_peer, strangers, total) < 0:
            raise ValueError("stream caps must be >= 0")
        self.name = name
        self.per_peer, self.stranger_per_peer, self.strangers, self.total = per_peer, stranger_per_peer, strangers, total
        self.is_member = is_member or (lambda peer_id: False)
        self.open_by_peer: Counter[str] = Counter()
        self.open_strangers = 0
        self.open_total = 0
        self.refused = 0
        self._warned: dict[str, float] = {}

    def enter(self, peer_id: str) -> Callable[[], None] | None:
        """A release function if ``peer_id`` may open one more stream here, else None (close it)."""
        member = self.is_member(peer_id)
        cap = self.per_peer if member else self.stranger_per_peer
        if self.open_by_peer[peer_id] >= cap or self.open_total >= self.total \
                or (not member and self.open_strangers >= self.strangers):
            self._refuse(peer_id, member)
            return None
        self.open_by_peer[peer_id] += 1
        self.open_total += 1
        self.open_strangers += not member
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            self.open_by_peer[peer_id] -= 1
            if self.open_by_peer[peer_id] <= 0:
                del self.open_by_peer[peer_id]
            self.open_total -= 1
            self.open_strangers -= not member

        return release

    def _refuse(self, peer_id: str, member: bool) -> None:
        self.refused += 1
        now = time.monotonic()
        if now - self._warned.get(peer_id, -WARN_EVERY_S) >= WARN_EVERY_S:
            if len(self._warned) > 1024:
                self._warned.clear()
            self._warned[peer_id] = now
            logger.warning("%s: refused a stream from %s %s (%d open by it, %d in all): over its cap", self.name,
                           "member" if member else "stranger", peer_id, self.open_by_peer[peer_id], self.open_total)
        else:
            logger.debug("%s: refused a stream from %s", self.name, peer_id)


def guard(gate: StreamGate, handler: Handler) -> Handler:
    """``handler`` behind ``gate``; the writer is always closed, and a cancellation ends it quietly."""

    async def guarded(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        release = gate.enter(info.peer_id.to_base58())
        if release is None:
            writer.close()
            return
        try:
            await handler(info, reader, writer)
        except asyncio.CancelledError:
            pass  # the loop is shutting down or the stream's round expired: nothing to report
        finally:
            release()
            writer.close()

    return guarded
