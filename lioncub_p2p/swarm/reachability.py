"""Can other peers dial this machine? Asked of a peer that is already on the internet (a coordinator).

A volunteer behind a home router usually cannot be dialed: it must run in client mode (dial out
only, vote, receive results, reduce nothing, serve no state). A cloud VM often can be dialed on a
public IP that none of its interfaces carries (1:1 NAT): it must announce that IP. Both are decided
here, before the peer's daemon starts, with ``lioncub/dialback/1``:

1. the peer listens with a plain TCP socket on the port its daemon will use;
2. it opens a stream to a coordinator from a short-lived client-mode daemon and sends the port
   and a random nonce;
3. the coordinator dials the *observed* IP of that stream (never an address the caller names, so
   the service cannot be aimed at third parties) on that port, writes the nonce and closes;
4. the peer is dialable iff its socket received the nonce; the coordinator's answer also says
   which IP it saw (the address to announce).

A coordinator that lies can only make a peer choose client mode or announce a wrong address for
itself; it cannot make the peer dial anything.

``plan`` turns the answer into how a swarm member starts (``SwarmConfig.client_mode="auto"``): not
dialable -> client mode; dialable at an IP none of its interfaces carries -> announce that IP; a
founder (no initial peers), forced modes, given announce addresses and unanswered checks -> listen
as configured. Listening members and coordinators serve dial-backs (``serve_dialback``).
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from ..wire import PROTOCOL_VERSION, WireError, pb, printable, read_frame, write_frame
from ..wire.gate import StreamGate, address_bucket, guard, multiaddr_ip

logger = logging.getLogger(__name__)
DIALBACK_PROTOCOL = "lioncub/dialback/1"
CONNECT_TIMEOUT = 3.0
MAX_CONCURRENT = 8  # dial-backs served at once; more are refused
PER_IP_BURST, PER_IP_RATE = 8.0, 1.0  # dial-backs per caller address: a burst, then this many per second
MIN_PORT = 1024  # the lowest port a dial-back connects to
# A check asks every coordinator this many times over, RETRY_PAUSE_S apart, until one answers: three
# founders starting at once on a loaded host once had the one coordinator close a volunteer's stream
# unanswered, and that volunteer, behind NAT, listened and reduced instead of joining in client mode.
CHECK_PASSES, RETRY_PAUSE_S = 2, 1.0


@dataclass(frozen=True)
class Reachability:
    dialable: bool
    observed_ip: str | None  # this machine's address as a coordinator saw it
    note: str  # one line for the volunteer
    answered: bool = True  # False: no coordinator answered, so nothing is known either way


def observed_ip(maddr: Multiaddr | str | None) -> str | None:
    """The IP of a multiaddr such as /ip4/1.2.3.4/tcp/5 (None if it has none, or if it is a relayed
    stream's: /ip4/R/tcp/p/p2p/Rid/p2p-circuit names the relay's host, which a dial-back must not reach)."""
    ip, relayed = multiaddr_ip(maddr)
    return None if relayed or ip is None else parse_ip(str(ip))


def parse_ip(text: str) -> str | None:
    """``text`` as an IP address a peer could be dialed at, or None if it is not one (a scoped IPv6
    address, ``fe80::1%eth0``, names an interface of the answering host; multicast and unspecified
    addresses dial nobody)."""
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    return None if "%" in text or ip.is_multicast or ip.is_unspecified else str(ip)


async def serve_dialback(p2p: P2P) -> None:
    """Answer dial-back requests (coordinators and listening members run this)."""
    busy = 0
    budgets: dict[str, tuple[float, float]] = {}  # caller's address (``gate.address_bucket``) -> (tokens, when)

    def allow(address: str) -> bool:
        now = time.monotonic()
        tokens, when = budgets.get(address, (PER_IP_BURST, now))
        tokens = min(PER_IP_BURST, tokens + (now - when) * PER_IP_RATE)
        if len(budgets) > 4096:  # bounded memory: forget the oldest callers
            for old in sorted(budgets, key=lambda k: budgets[k][1])[:2048]:
                del budgets[old]
        budgets[address] = (tokens - 1, now) if tokens >= 1 else (tokens, now)
        return tokens >= 1

    async def handle(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal busy
        answer = pb.DialbackAnswer(version=PROTOCOL_VERSION)
        try:
            ip = observed_ip(info.addr)
            answer.observed_ip = ip or ""
            if ip is None:
                answer.error = "no IP address observed for this stream (relayed?)"
                return
            req, _ = await asyncio.wait_for(read_frame(reader, pb.DialbackRequest, 256), CONNECT_TIMEOUT)
            # a port below 1024 is a service's, never a volunteer's check listener: no bytes of a
            # stranger's choosing go to a mail or web server on the caller's host
            if req is None or not MIN_PORT <= req.port <= 65535 or not 16 <= len(req.nonce) <= 32:
                answer.error = f"bad request (a port from {MIN_PORT} and a 16-32 byte nonce)"
                return
            # counted once a valid request is in: a caller that says nothing holds a gate slot, not a dial
            if busy >= MAX_CONCURRENT or not allow(address_bucket(info.addr) or ip):
                answer.error = "busy: try again in a few seconds"
                return
            busy += 1
            try:
                answer.connected = await _dial_and_send(ip, req.port, req.nonce)
            finally:
                busy -= 1
        except (WireError, asyncio.TimeoutError, ConnectionError, OSError) as e:
            answer.error = f"bad request: {e}"
        finally:
            try:
                await asyncio.wait_for(write_frame(writer, answer), CONNECT_TIMEOUT)
            except (asyncio.TimeoutError, ConnectionError, OSError):
                pass
            writer.close()

    # every caller is a stranger (it asks before it joins): one stream each, twice the dial-backs served
    # and two per address (ids cost nothing: one host could hold every slot)
    gate = StreamGate("dialback", per_peer=1, stranger_per_peer=1, strangers=2 * MAX_CONCURRENT,
                      total=2 * MAX_CONCURRENT, stranger_per_address=2)
    await p2p.add_binary_stream_handler(DIALBACK_PROTOCOL, guard(gate, handle))


async def _dial_and_send(ip: str, port: int, nonce: bytes) -> bool:
    try:
        _, conn = await asyncio.wait_for(asyncio.open_connection(ip, port), CONNECT_TIMEOUT)
    except (asyncio.TimeoutError, OSError):
        return False
    try:
        conn.write(nonce)
        await asyncio.wait_for(conn.drain(), CONNECT_TIMEOUT)
        return True
    except (asyncio.TimeoutError, OSError):
        return False
    finally:
        conn.close()


def free_port(host: str = "0.0.0.0") -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def is_local(ip: str) -> bool:
    """Whether this machine has ``ip`` on one of its interfaces (the kernel lets a socket bind to it)."""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(ip).version == 6 else socket.AF_INET
        with socket.socket(family) as s:
            s.bind((ip, 0))
        return True
    except (OSError, ValueError):
        return False


async def check(initial_peers: list[str], port: int, *, timeout: float = 10.0, host: str = "0.0.0.0") -> Reachability:
    """Whether peers can dial this machine on TCP ``port`` at ``host`` (free now: the daemon takes it
    afterwards). Asks the initial peers one by one until one answers."""
    if not initial_peers:
        return Reachability(False, None, "no --initial-peers to ask: cannot tell whether peers can dial you",
                            answered=False)
    nonce = os.urandom(16)
    received = asyncio.Event()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if await asyncio.wait_for(reader.readexactly(len(nonce)), CONNECT_TIMEOUT) == nonce:
                received.set()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, OSError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, host, port, reuse_address=True)
    try:
        client = await P2P.create(initial_peers=initial_peers, no_listen=True, nat_port_map=False, auto_nat=False,
                                  host_maddrs=[], dht_mode="client", use_relay=False)
    except Exception as e:  # hivemind raises P2PDaemonError when no bootstrap peer answers
        server.close()
        return Reachability(False, None, f"no coordinator answered the reachability check "
                                         f"({' '.join(str(e).split())[:200]})", answered=False)
    notes = []
    try:
        for attempt in range(CHECK_PASSES):
            if attempt:
                await asyncio.sleep(RETRY_PAUSE_S)
            for peer in _peer_ids(initial_peers):
                try:
                    answer = await asyncio.wait_for(_ask(client, peer, port, nonce), timeout)
                except Exception as e:  # that peer is down, does not serve dial-backs or dropped this stream
                    notes.append(f"{peer.to_base58()[:12]}…: {type(e).__name__}")
                    continue
                if answer.error:  # a peer's words, into this peer's log: no forged lines
                    notes.append(f"{peer.to_base58()[:12]}…: {printable(answer.error)}")
                    continue
                if answer.connected:
                    try:  # the coordinator wrote the nonce before answering; give it a moment to land
                        await asyncio.wait_for(received.wait(), CONNECT_TIMEOUT)
                    except asyncio.TimeoutError:
                        pass
                ip = parse_ip(answer.observed_ip)  # an IP, or nothing: it may go into an address
                if received.is_set():
                    return Reachability(True, ip, f"peers can dial you at {ip}:{port}")
                return Reachability(False, ip, f"peers cannot dial {ip}:{port} (behind NAT or a firewall)")
        return Reachability(False, None, "no coordinator answered the reachability check (" + "; ".join(notes) + ")",
                            answered=False)
    finally:
        server.close()
        await client.shutdown()


async def _ask(client: P2P, peer: PeerID, port: int, nonce: bytes) -> pb.DialbackAnswer:
    _, reader, writer = await client.call_binary_stream_handler(peer, DIALBACK_PROTOCOL)
    try:
        await write_frame(writer, pb.DialbackRequest(version=PROTOCOL_VERSION, port=port, nonce=nonce))
        answer, _ = await read_frame(reader, pb.DialbackAnswer, 512)
        if answer is None:
            raise WireError("no answer")
        return answer
    finally:
        writer.close()


def _peer_ids(maddrs: list[str]) -> list[PeerID]:
    ids: list[PeerID] = []
    for maddr in maddrs:
        peer = Multiaddr(maddr).value_for_protocol("p2p") if "/p2p/" in maddr else None
        if peer and PeerID.from_base58(peer) not in ids:
            ids.append(PeerID.from_base58(peer))
    return ids


# -- how a swarm member starts -----------------------------------------------------------------------

CLIENT_MODE_NOTE = ("joining in client mode — you vote and receive every result, you reduce nothing and serve "
                    "no state")


@dataclass(frozen=True)
class ListenPlan:
    client_mode: bool
    host_maddrs: list[str]
    announce_maddrs: list[str]
    note: str = ""  # one line for the log ("" when there is nothing to say)
    reachability: Reachability | None = field(default=None, compare=False)


def _tcp_listen(host_maddrs: list[str]) -> tuple[int, str, int] | None:
    """(index, host, port) of the first /ip4|ip6/HOST/tcp/PORT address to listen on, if any."""
    for i, maddr in enumerate(host_maddrs):
        parts = str(maddr).split("/")
        if len(parts) == 5 and parts[1] in ("ip4", "ip6") and parts[3] == "tcp" and parts[4].isdigit():
            return i, parts[2], int(parts[4])
    return None


async def plan(client_mode: bool | str, initial_peers: list[str], host_maddrs: list[str],
               announce_maddrs: list[str], *,
               checker: Callable[..., Awaitable[Reachability]] | None = None) -> ListenPlan:
    """How a swarm member listens. ``client_mode`` True/False force it; "auto" with initial peers asks
    them (``check``, or ``checker``) whether the TCP port of ``host_maddrs`` can be dialed: no -> client
    mode; yes at an IP that is not this machine's -> announce ``/ip4/IP/tcp/PORT`` (1:1 NAT, cloud VMs).
    A founder (no initial peers), given ``announce_maddrs`` (the user knows where it is dialed), a
    QUIC-only listener and an unanswered check listen as configured."""
    hosts, announce = list(host_maddrs), list(announce_maddrs)
    if client_mode is True:
        return ListenPlan(True, hosts, announce)
    if client_mode is False or not initial_peers or announce:
        return ListenPlan(False, hosts, announce)
    tcp = _tcp_listen(hosts)
    if tcp is None:
        return ListenPlan(False, hosts, announce, "no TCP address to listen on: cannot check whether peers can "
                                                  "dial you (the dial-back is TCP)")
    i, host, port = tcp
    if port == 0:
        port = free_port(host)
        hosts[i] = f"/{'ip6' if ':' in host else 'ip4'}/{host}/tcp/{port}"
    found = await (checker or check)(initial_peers, port, host=host)
    if not found.answered:
        return ListenPlan(False, hosts, announce, f"could not check whether peers can dial you ({found.note}): "
                                                  f"listening on {hosts[i]}", found)
    where = f"[{found.observed_ip}]" if found.observed_ip and ":" in found.observed_ip else found.observed_ip
    if not found.dialable:
        return ListenPlan(True, hosts, announce, f"peers cannot dial {where or '?'}:{port} (behind NAT or a "
                                                 f"firewall): {CLIENT_MODE_NOTE}", found)
    if found.observed_ip and not is_local(found.observed_ip):
        version = "ip6" if ":" in found.observed_ip else "ip4"
        public = f"/{version}/{found.observed_ip}/tcp/{port}"
        return ListenPlan(False, hosts, [public], f"peers dial you at {where}:{port}, an address none of this "
                                                  f"machine's interfaces has (1:1 NAT): announcing {public}", found)
    return ListenPlan(False, hosts, announce, f"peers can dial you at {where}:{port}", found)
