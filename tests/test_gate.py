"""The stream gate's caps per peer id and per network address (``wire/gate.py``), without a network, and
the remote address a real libp2p stream hands the gate."""
from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

from hivemind.p2p import P2P

from lioncub_p2p.wire.gate import StreamGate, address_bucket, guard


def test_address_buckets_are_the_ipv4_address_the_ipv6_64_or_the_relay_and_loopback_is_not_capped():
    assert address_bucket("/ip4/203.0.113.7/tcp/4001") == address_bucket("/ip4/203.0.113.7/udp/9/quic") \
        == "203.0.113.7"
    assert address_bucket("/ip6/2001:db8:1:2::5/tcp/1") == address_bucket("/ip6/2001:db8:1:2:ffff::9/tcp/2") \
        == "2001:db8:1:2::/64"
    assert address_bucket("/ip6/2001:db8:1:3::5/tcp/1") != address_bucket("/ip6/2001:db8:1:2::5/tcp/1")
    relayed = "/ip4/198.51.100.1/tcp/4001/p2p/QmRelay/p2p-circuit"
    assert address_bucket(relayed) == "relay:198.51.100.1" != address_bucket("/ip4/198.51.100.1/tcp/4001")
    assert address_bucket("/ip4/127.0.0.1/tcp/5") is None and address_bucket("/ip6/::1/tcp/5") is None
    assert address_bucket("/ip4/127.0.0.1/tcp/5/p2p/QmRelay/p2p-circuit") == "relay:127.0.0.1"  # not this host's
    assert address_bucket("/ip6/::ffff:203.0.113.7/tcp/1") == "203.0.113.7"
    assert address_bucket("/ip6/::ffff:127.0.0.1/tcp/1") is None
    assert address_bucket(None) == address_bucket("/dns4/example.org/tcp/1") == address_bucket("/ip4/999.1.1.1") == ""


def test_throwaway_ids_from_one_address_hold_only_its_share_of_the_slots(caplog):
    """Eight ids, two streams each, from one host: without the address cap they held all 16 slots (and
    each new id logged a warning of its own)."""
    gate = StreamGate("admit", per_peer=2, stranger_per_peer=2, strangers=16, total=16, stranger_per_address=2,
                      is_member=lambda pid: pid == "member")
    attacker = "/ip4/203.0.113.7/tcp/4001"
    held = [r for i in range(8) for r in (gate.enter(f"throwaway{i}", attacker) for _ in range(2)) if r is not None]
    assert len(held) == 2 and gate.open_by_address["203.0.113.7"] == 2 and gate.refused == 14
    assert sum("refused a stream" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING) == 1
    newcomer = gate.enter("newcomer", "/ip4/198.51.100.9/tcp/5")
    assert newcomer is not None  # another host still gets in...
    assert gate.enter("member", attacker) is not None  # ...and members are never counted by address
    for release in held:
        release()
        release()  # twice is once
    assert "203.0.113.7" not in gate.open_by_address and gate.enter("throwaway9", attacker) is not None
    local = [gate.enter(f"local{i}", "/ip4/127.0.0.1/tcp/9") for i in range(8)]
    assert all(r is not None for r in local)  # loopback: this host's own processes
    uncapped = StreamGate("vote", stranger_per_peer=2, strangers=16, total=16)
    assert sum(uncapped.enter(f"t{i}", attacker) is not None for i in range(8) for _ in range(2)) == 16


def test_guard_counts_a_stream_under_the_address_the_transport_reports():
    gate = StreamGate("admit", stranger_per_address=1)
    opened, closed = [], []

    async def handler(info, reader, writer) -> None:
        opened.append(gate.open_by_address.copy())

    writer = SimpleNamespace(close=lambda: closed.append(1))
    info = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: "x"), addr="/ip4/203.0.113.7/tcp/1")
    asyncio.run(guard(gate, handler)(info, None, writer))
    assert opened == [{"203.0.113.7": 1}] and closed == [1] and not gate.open_by_address


def test_a_libp2p_stream_hands_its_handler_the_remote_address():
    """The per-address cap needs the caller's multiaddr: hivemind's binary stream handlers get it in
    ``StreamInfo.addr`` (an RPC handler's context has none)."""
    async def scenario() -> list[str]:
        server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        client = await P2P.create(initial_peers=[str(m) for m in await server.get_visible_maddrs()],
                                  host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        seen: list[str] = []

        async def handler(info, reader, writer) -> None:
            seen.append(str(info.addr))
            writer.close()

        try:
            await server.add_binary_stream_handler("lioncub/test-addr/1", handler)
            _, reader, writer = await client.call_binary_stream_handler(server.peer_id, "lioncub/test-addr/1")
            await asyncio.wait_for(reader.read(), 10)
            writer.close()
            return seen
        finally:
            await asyncio.gather(server.shutdown(), client.shutdown())

    seen = asyncio.run(scenario())
    assert len(seen) == 1 and seen[0].startswith("/ip4/127.0.0.1/"), seen
    assert address_bucket(seen[0]) is None  # loopback: exempt
