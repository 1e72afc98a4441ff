"""Admission before resources: what an incoming stream may hold before its sender is admitted.

A libp2p stream arrives with the remote peer id (authenticated by the transport) and nothing else.
Every stream handler sits behind a ``StreamGate``:

* a *member* (a peer this one currently runs rounds with, ``is_member``) may hold ``per_peer``
  streams on the handler at once;
* any other peer (a *stranger*: an outsider, or a newcomer not yet in a group) may hold
  ``stranger_per_peer``, and all strangers together ``strangers``, so strangers can never use up
  members' capacity, however many peer ids they make;
* ``stranger_per_address``, where set, caps the strangers' streams from one network address (an IPv4
  address, an IPv6 /64, a relay's address for relayed streams), whatever peer ids they use: ids cost
  nothing, addresses do, so one host cannot hold every slot of a handler that serves newcomers
  (admission, state download) with a handful of throwaway ids. Loopback is exempt: strangers there are
  this host's own processes;
* ``total`` caps everything;
* a stream over its cap is closed at once, before a byte is read from it.

The handler then reads its first frame under a short deadline and checks the sender (token,
membership) before giving the stream anything else: a table entry, a buffer, a download slot.
``guard`` wraps a handler with its gate and ends it quietly when the event loop cancels it (an
orderly leave): asyncio logs a cancelled connection task as an ERROR with a traceback otherwise.
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections import Counter
from typing import Awaitable, Callable

logger = logging.getLogger(__name__)

Handler = Callable[[object, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
WARN_EVERY_S = 60.0  # one warning per refused peer and gate per minute; the rest at debug level


def multiaddr_ip(address: object) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address | None, bool]:
    """The IP a stream's multiaddr starts with (None if it names none), and whether the stream is relayed
    (``.../p2p-circuit``: then the IP is the relay's)."""
    parts = str(address or "").split("/")
    relayed = "p2p-circuit" in parts
    if len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
        return None, relayed
    try:
        return ipaddress.ip_address(parts[2]), relayed
    except ValueError:
        return None, relayed


def address_bucket(address: object) -> str | None:
    """The network address a stream's multiaddr (``/ip4/1.2.3.4/tcp/5``, ``/ip6/...``, a relayed
    ``/ip4/R/tcp/p/p2p/Rid/p2p-circuit``) comes from, as ``StreamGate`` counts it: the IPv4 address, the
    IPv6 /64 (one home or server gets a whole /64; an IPv4-mapped one as IPv4), the relay's for a relayed
    stream; "" for one it cannot read (all such share one bucket); None for loopback (not capped)."""
    ip, relayed = multiaddr_ip(address)
    if ip is None:
        return ""
    ip = getattr(ip, "ipv4_mapped", None) or ip  # ::ffff:1.2.3.4 is 1.2.3.4
    if ip.is_loopback and not relayed:  # whoever is behind a relay, even one on this host, is no local process
        return None
    bucket = str(ipaddress.ip_network(f"{ip}/64", strict=False)) if ip.version == 6 else str(ip)
    return f"relay:{bucket}" if relayed else bucket


class StreamGate:
    def __init__(self, name: str, *, per_peer: int = 8, stranger_per_peer: int = 2, strangers: int = 32,
                 total: int = 256, is_member: Callable[[str], bool] | None = None,
                 stranger_per_address: int | None = None):
        if min(per_peer, stranger_per_peer, strangers, total, stranger_per_address or 0) < 0:
            raise ValueError("stream caps must be >= 0")
        self.name = name
        self.per_peer, self.stranger_per_peer, self.strangers, self.total = per_peer, stranger_per_peer, strangers, total
        self.stranger_per_address = stranger_per_address
        self.is_member = is_member or (lambda peer_id: False)
        self.open_by_peer: Counter[str] = Counter()
        self.open_by_address: Counter[str] = Counter()  # strangers' streams per ``address_bucket``
        self.open_strangers = 0
        self.open_total = 0
        self.refused = 0
        self._warned: dict[str, float] = {}

    def enter(self, peer_id: str, address: object = None) -> Callable[[], None] | None:
        """A release function if ``peer_id`` may open one more stream here from ``address`` (the stream's
        remote multiaddr), else None (close it)."""
        member = self.is_member(peer_id)
        cap = self.per_peer if member else self.stranger_per_peer
        bucket = None if member or self.stranger_per_address is None else address_bucket(address)
        if self.open_by_peer[peer_id] >= cap or self.open_total >= self.total \
                or (not member and self.open_strangers >= self.strangers) \
                or (bucket is not None and self.open_by_address[bucket] >= self.stranger_per_address):
            self._refuse(peer_id, member, address)
            return None
        self.open_by_peer[peer_id] += 1
        self.open_total += 1
        self.open_strangers += not member
        if bucket is not None:
            self.open_by_address[bucket] += 1
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
            if bucket is not None:
                self.open_by_address[bucket] -= 1
                if self.open_by_address[bucket] <= 0:
                    del self.open_by_address[bucket]

        return release

    def _refuse(self, peer_id: str, member: bool, address: object) -> None:
        self.refused += 1
        now = time.monotonic()
        # a member by its id; strangers by their address (throwaway ids would make every line new)
        key = peer_id if member else f"stranger@{address_bucket(address)}"
        if now - self._warned.get(key, -WARN_EVERY_S) >= WARN_EVERY_S:
            if len(self._warned) > 1024:
                self._warned.clear()
            self._warned[key] = now
            logger.warning("%s: refused a stream from %s %s at %s (%d open by it, %d in all): over its cap",
                           self.name, "member" if member else "stranger", peer_id, address or "an unknown address",
                           self.open_by_peer[peer_id], self.open_total)
        else:
            logger.debug("%s: refused a stream from %s", self.name, peer_id)


def guard(gate: StreamGate, handler: Handler) -> Handler:
    """``handler`` behind ``gate``; the writer is always closed, and a cancellation ends it quietly."""

    async def guarded(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        release = None
        try:
            release = gate.enter(info.peer_id.to_base58(), getattr(info, "addr", None))
            if release is not None:
                await handler(info, reader, writer)
        except asyncio.CancelledError:
            pass  # the loop is shutting down or the stream's round expired: nothing to report
        finally:
            if release is not None:
                release()
            writer.close()

    return guarded
