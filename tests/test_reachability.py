"""Reachability checks: on loopback (fast) the nonce comes back; behind a real NAT (slow, namespaces) it does not."""
import asyncio
import subprocess
import sys
import textwrap

import pytest
from hivemind.p2p import P2P

from lioncub_p2p.sim.hosts import HostNetwork, missing_tools
from lioncub_p2p.swarm import reachability


def test_dialback_on_loopback_reaches_the_listening_port_and_reports_the_observed_ip():
    async def scenario():
        server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, auto_nat=False)
        try:
            await reachability.serve_dialback(server)
            maddrs = [str(m) for m in await server.get_visible_maddrs()]
            first = await reachability.check(maddrs, reachability.free_port())
            nobody = await reachability.check(["/ip4/127.0.0.1/tcp/1/p2p/" + server.peer_id.to_base58()[:-1] + "x"],
                                              reachability.free_port(), timeout=3)
            return first, nobody
        finally:
            await server.shutdown()

    first, nobody = asyncio.run(scenario())
    assert first.dialable and first.observed_ip == "127.0.0.1", first
    assert not nobody.dialable and "no coordinator answered" in nobody.note, nobody


SERVER = textwrap.dedent("""
    import asyncio, sys
    from hivemind.p2p import P2P
    from lioncub_p2p.swarm import reachability
    async def main():
        p2p = await P2P.create(host_maddrs=["/ip4/0.0.0.0/tcp/31337"], announce_maddrs=[f"/ip4/{sys.argv[1]}/tcp/31337"],
                               nat_port_map=False, auto_nat=False)
        await reachability.serve_dialback(p2p)
        print(f"/ip4/{sys.argv[1]}/tcp/31337/p2p/{p2p.peer_id.to_base58()}", flush=True)
        await asyncio.sleep(120)
    asyncio.run(main())
""")
CLIENT = "import asyncio, sys; from lioncub_p2p.swarm import reachability as r; " \
         "x = asyncio.run(r.check([sys.argv[1]], r.free_port())); print(x.dialable, x.observed_ip)"


@pytest.mark.slow
def test_a_host_behind_nat_is_found_undialable_and_a_public_host_dialable():
    why = missing_tools(nat=True)
    assert why is None, f"this test builds network namespaces and a NAT router: {why}"
    with HostNetwork() as net:
        coordinator, public, home = net.add_public("c"), net.add_public("p"), net.add_private("h")
        server = subprocess.Popen(net.exec_prefix("c") + [sys.executable, "-c", SERVER, coordinator.ip],
                                  stdout=subprocess.PIPE, text=True, start_new_session=True)
        try:
            maddr = server.stdout.readline().strip()
            answers = {name: subprocess.run(net.exec_prefix(name) + [sys.executable, "-c", CLIENT, maddr],
                                            capture_output=True, text=True, timeout=60).stdout.split()
                       for name in ("p", "h")}
        finally:
            server.kill()
    assert answers["p"] == ["True", public.ip], answers
    assert answers["h"] == ["False", home.public_ip], answers  # the router's WAN address, as seen from outside
