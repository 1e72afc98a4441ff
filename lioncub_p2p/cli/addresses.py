"""Multiaddrs on the command line: checked before any daemon starts, and sorted by who can dial them.

hivemind hands a malformed address to its libp2p daemon, which answers with a raw JSON blob (or
not at all): every address a user types is parsed here first, with hivemind's own parser.
"""
from __future__ import annotations

import ipaddress

from hivemind.utils.multiaddr import Multiaddr

from ..swarm.config import LISTEN_ALL  # every interface, TCP, ports the OS picks (hivemind's default: 127.0.0.1)
from .common import UsageError

EXAMPLE_PEER = "/ip4/203.0.113.7/tcp/31337/p2p/12D3KooW..."
PUBLIC_PORT_ADVICE = ("forward a port (e.g. 31337) on your router to this machine and pass "
                      "--host-maddrs /ip4/0.0.0.0/tcp/31337 --announce-maddrs /ip4/YOUR_PUBLIC_IP/tcp/31337, "
                      "or pass --client-mode (you then vote and get every result, but reduce nothing)")


def _parse(flag: str, text: str, example: str) -> Multiaddr:
    try:
        return Multiaddr(text)
    except Exception as e:  # the parser raises several unrelated types for malformed input
        reason = " ".join(str(e).split()).replace(f"Invalid MultiAddr {text!r}", "").strip(" :")
        raise UsageError(f"{flag} {text!r} is not a multiaddr ({reason or type(e).__name__}); "
                         f"write it like {example}") from None


def check_peers(flag: str, addresses: list[str]) -> list[str]:
    """Addresses of peers to dial: each must parse and end in the peer's id (``/p2p/12D3KooW...``)."""
    for text in addresses:
        maddr = _parse(flag, text, EXAMPLE_PEER)
        if "p2p" not in [p.name for p in maddr.protocols()]:
            raise UsageError(f"{flag} {text} lacks the peer id (/p2p/12D3KooW...): copy the whole address the "
                             f"coordinator printed, like {EXAMPLE_PEER}")
    return addresses


def check_listen(flag: str, addresses: list[str]) -> list[str]:
    """Addresses to listen on or announce: each must parse, name no peer id, and use QUIC's current name."""
    for text in addresses:
        maddr = _parse(flag, text, "/ip4/0.0.0.0/tcp/31337")
        names = [p.name for p in maddr.protocols()]
        if "p2p" in names:
            raise UsageError(f"{flag} {text}: drop the /p2p/... part; this peer's id comes from its identity")
        if "quic" in names:
            raise UsageError(f"{flag} {text}: the libp2p daemon does not start with /quic: write /quic-v1")
    return addresses


def scope(maddr: str) -> str:
    """Who can dial this address: "public", "private" (the local network), "loopback" (this machine)."""
    parts = str(maddr).split("/")
    if len(parts) > 2 and parts[1].startswith("dns"):
        return "public"
    if len(parts) > 2 and parts[1] in ("ip4", "ip6"):
        try:
            ip = ipaddress.ip_address(parts[2])
        except ValueError:
            return "private"
        if ip.is_loopback:
            return "loopback"
        if not (ip.is_private or ip.is_unspecified or ip.is_link_local or ip.is_reserved):
            return "public"
    return "private"


def dialable_from_outside(maddrs: list[str]) -> bool:
    return any(scope(m) == "public" for m in maddrs)


def reachability(maddrs: list[str], *, client_mode: bool = False) -> list[str]:
    """Lines telling the user which of its addresses others can dial, public ones first."""
    if client_mode:
        return ["client mode: not listening; this peer dials out only (it votes and gets every result, "
                "reduces nothing)"]
    if not maddrs:
        return ["no listening address: nobody can dial this peer"]
    where = {"public": "anyone", "private": "your local network only", "loopback": "this machine only"}
    lines = ["others can dial this peer at:"]
    for kind in ("public", "private", "loopback"):
        lines += [f"  {kind:8} {m}   ({where[kind]})" for m in maddrs if scope(m) == kind]
    if all(scope(m) == "loopback" for m in maddrs):
        lines.append("listening on loopback only: no other machine can dial you; listen on every interface with "
                     "--host-maddrs " + " ".join(LISTEN_ALL))
    elif not dialable_from_outside(maddrs):
        lines.append(f"no public address: peers on other networks cannot dial you; {PUBLIC_PORT_ADVICE}")
    return lines
