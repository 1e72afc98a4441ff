"""Reachability checks: on loopback (fast) the nonce comes back; behind a real NAT (slow, namespaces) it does not."""
import asyncio
import json
import logging
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hivemind.p2p import P2P

from lioncub_p2p.sim.hosts import HostNetwork, missing_tools
from lioncub_p2p.swarm import reachability, snapshot
from lioncub_p2p.swarm.reachability import Reachability

from procs import kill_group, wait_or_none


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


def test_a_dialback_reaches_no_relay_no_low_port_and_a_lying_answer_gives_no_address():
    """A stranger reaching a coordinator through a relay has the relay's IP in its stream address: a
    dial-back there would write a stranger's bytes to the relay's host, so a relayed stream has no
    observed IP. A port below 1024 is refused. A coordinator's answer that is not an IP is no address."""
    assert reachability.observed_ip("/ip4/9.9.9.9/tcp/4001/p2p/QmRelay/p2p-circuit") is None
    assert reachability.observed_ip("/ip4/9.9.9.9/tcp/4001") == "9.9.9.9"
    assert reachability.observed_ip("/ip6/::1/tcp/4001") == "::1"
    # an answer's "observed IP" goes into this peer's announced addresses: only one it could be dialed at
    for unusable in ("fe80::1%eth0", "224.0.0.1", "ff02::1", "0.0.0.0", "::", "1.2.3.4/tcp/1"):
        assert reachability.parse_ip(unusable) is None, unusable
    assert reachability.parse_ip("203.0.113.9") == "203.0.113.9" and reachability.parse_ip("10.78.0.2") == "10.78.0.2"

    async def lying_answer(info, reader, writer):
        from lioncub_p2p.wire import PROTOCOL_VERSION, pb, read_frame, write_frame

        await read_frame(reader, pb.DialbackRequest, 256)
        await write_frame(writer, pb.DialbackAnswer(version=PROTOCOL_VERSION, observed_ip="1.2.3.4/tcp/1/p2p-circuit"))
        writer.close()

    async def forging_answer(info, reader, writer):  # an error with a line of its own for the volunteer's log
        from lioncub_p2p.wire import PROTOCOL_VERSION, pb, read_frame, write_frame

        await read_frame(reader, pb.DialbackRequest, 256)
        await write_frame(writer, pb.DialbackAnswer(version=PROTOCOL_VERSION, error="busy\n  [ OK ] forged\x1b[2K"))
        writer.close()

    async def scenario():
        server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, auto_nat=False)
        liar = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, auto_nat=False)
        client = await P2P.create(initial_peers=[str(m) for m in await server.get_visible_maddrs()],
                                  nat_port_map=False, auto_nat=False)
        try:
            await reachability.serve_dialback(server)
            low = await reachability._ask(client, server.peer_id, 80, os.urandom(16))
            await liar.add_binary_stream_handler(reachability.DIALBACK_PROTOCOL, lying_answer)
            lied = await reachability.check([str(m) for m in await liar.get_visible_maddrs()], reachability.free_port())
            await liar.remove_binary_stream_handler(reachability.DIALBACK_PROTOCOL)
            await liar.add_binary_stream_handler(reachability.DIALBACK_PROTOCOL, forging_answer)
            forged = await reachability.check([str(m) for m in await liar.get_visible_maddrs()], reachability.free_port())
            return low, lied, forged
        finally:
            for p2p in (client, liar, server):
                await p2p.shutdown()

    low, lied, forged = asyncio.run(scenario())
    assert "bad request" in low.error and not low.connected, low
    assert lied.answered and not lied.dialable and lied.observed_ip is None, lied
    assert "forged" in forged.note and "\n" not in forged.note and "\x1b" not in forged.note, forged


def test_a_coordinator_that_drops_the_first_request_is_asked_again():
    """A stream the coordinator closes unanswered (seen once with three founders starting at once on a
    loaded host) is asked again after a pause: the volunteer learns whether peers can dial it instead of
    "nobody answered", which left a peer behind NAT listening and reducing."""
    from lioncub_p2p.wire import PROTOCOL_VERSION, pb, read_frame, write_frame

    streams = []

    async def drops_the_first(info, reader, writer):
        streams.append(info.peer_id)
        if len(streams) == 1:
            writer.close()
            return
        request, _ = await read_frame(reader, pb.DialbackRequest, 256)
        connected = await reachability._dial_and_send("127.0.0.1", request.port, request.nonce)
        await write_frame(writer, pb.DialbackAnswer(version=PROTOCOL_VERSION, observed_ip="127.0.0.1",
                                                    connected=connected))
        writer.close()

    async def scenario():
        server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, auto_nat=False)
        try:
            await server.add_binary_stream_handler(reachability.DIALBACK_PROTOCOL, drops_the_first)
            return await reachability.check([str(m) for m in await server.get_visible_maddrs()],
                                            reachability.free_port(), timeout=5)
        finally:
            await server.shutdown()

    answer = asyncio.run(scenario())
    assert len(streams) == 2, streams
    assert answer.answered and answer.dialable and answer.observed_ip == "127.0.0.1", answer


class FakeCheck:
    """Stands for ``reachability.check``: records what it was asked, answers ``answer``."""

    def __init__(self, answer: Reachability):
        self.answer, self.calls = answer, []

    async def __call__(self, initial_peers, port, *, timeout=10.0, host="0.0.0.0"):
        self.calls.append((list(initial_peers), port, host))
        return self.answer


PEERS = ["/ip4/10.0.0.1/tcp/31337/p2p/QmcoordinatorXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX"]
NAT = Reachability(False, "203.0.113.5", "peers cannot dial", answered=True)
PUBLIC_ELSEWHERE = Reachability(True, "203.0.113.5", "peers can dial", answered=True)  # TEST-NET: nobody's interface
HERE = Reachability(True, "127.0.0.1", "peers can dial", answered=True)
SILENT = Reachability(False, None, "no coordinator answered the reachability check (x)", answered=False)


def _plan(mode, answer, *, peers=PEERS, hosts=("/ip4/0.0.0.0/tcp/0",), announce=()):
    check = FakeCheck(answer)
    plan = asyncio.run(reachability.plan(mode, list(peers), list(hosts), list(announce), checker=check))
    return plan, check.calls


def test_auto_mode_decides_from_the_dialback_and_forced_modes_never_ask():
    plan, calls = _plan("auto", NAT)
    ((peers, port, host),) = calls
    assert peers == PEERS and host == "0.0.0.0" and 0 < port < 65536
    assert plan.client_mode and plan.host_maddrs == [f"/ip4/0.0.0.0/tcp/{port}"] and plan.announce_maddrs == []
    assert plan.note == (f"peers cannot dial 203.0.113.5:{port} (behind NAT or a firewall): joining in client mode — "
                         f"you vote and receive every result, you reduce nothing and serve no state")
    plan, calls = _plan("auto", PUBLIC_ELSEWHERE, hosts=["/ip4/0.0.0.0/tcp/4321", "/ip4/0.0.0.0/udp/0/quic-v1"])
    assert calls[0][1] == 4321 and not plan.client_mode  # a fixed port is the one checked and kept
    assert plan.host_maddrs == ["/ip4/0.0.0.0/tcp/4321", "/ip4/0.0.0.0/udp/0/quic-v1"]
    assert plan.announce_maddrs == ["/ip4/203.0.113.5/tcp/4321"] and "1:1 NAT" in plan.note
    plan, calls = _plan("auto", HERE, hosts=["/ip4/127.0.0.1/tcp/0"])
    assert calls[0][2] == "127.0.0.1"  # the check listens where the daemon will
    assert not plan.client_mode and plan.announce_maddrs == [] and "peers can dial you at 127.0.0.1" in plan.note
    plan, _ = _plan("auto", SILENT)  # nobody answered: nothing known, listen as configured
    assert not plan.client_mode and plan.announce_maddrs == [] and plan.note.startswith("could not check")
    for mode, kwargs, client in ((True, {}, True), (False, {}, False), ("auto", {"peers": []}, False),
                                 ("auto", {"announce": ["/ip4/198.51.100.1/tcp/31337"]}, False),
                                 ("auto", {"hosts": ["/ip4/0.0.0.0/udp/0/quic-v1"]}, False)):
        plan, calls = _plan(mode, NAT, **kwargs)
        assert not calls and plan.client_mode is client, (mode, kwargs)  # forced, a founder, told, or no TCP
        assert plan.host_maddrs == list(kwargs.get("hosts", ["/ip4/0.0.0.0/tcp/0"]))
        assert plan.announce_maddrs == list(kwargs.get("announce", []))


def test_is_local_knows_this_machines_addresses():
    assert reachability.is_local("127.0.0.1") and not reachability.is_local("203.0.113.5")
    assert not reachability.is_local("not an ip")


def test_a_swarm_behind_nat_starts_in_client_mode_by_itself_and_says_so_once(monkeypatch, caplog):
    """SwarmConfig's default client_mode="auto": the check (patched: NAT, then 1:1 NAT) decides before the
    daemon starts. Behind NAT the peer does not listen, announces client mode and logs one line; behind
    a 1:1 NAT it announces the observed address."""
    from lioncub_p2p.swarm import Swarm, SwarmConfig

    founder = Swarm(SwarmConfig("nat-auto", host_maddrs=["/ip4/127.0.0.1/tcp/0"]))  # no initial peers: listens
    try:
        assert founder.listen_plan.reachability is None and founder.visible_maddrs()
        maddrs = founder.visible_maddrs()
        monkeypatch.setattr(reachability, "check", FakeCheck(NAT))
        with caplog.at_level(logging.INFO, logger="lioncub_p2p.swarm"):
            joiner = Swarm(SwarmConfig("nat-auto", initial_peers=maddrs))
        try:
            lines = [r.getMessage() for r in caplog.records if "client mode" in r.getMessage()]
            assert len(lines) == 1 and "peers cannot dial 203.0.113.5:" in lines[0], lines
            assert joiner.config.client_mode is True and joiner.visible_maddrs() == []
            assert joiner._my_spec().client_mode and not joiner._my_spec().reduces
        finally:
            joiner.shutdown()
        monkeypatch.setattr(reachability, "check", FakeCheck(PUBLIC_ELSEWHERE))
        joiner = Swarm(SwarmConfig("nat-auto", initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
        try:
            port = joiner.config.host_maddrs[0].split("/")[-1]
            assert joiner.config.client_mode is False
            assert [m.rsplit("/p2p/", 1)[0] for m in joiner.visible_maddrs()] == [f"/ip4/203.0.113.5/tcp/{port}"]
        finally:
            joiner.shutdown()
    finally:
        founder.shutdown()


def test_a_port_taken_between_the_check_and_the_daemon_is_replaced_by_another(monkeypatch, caplog):
    """The check picks a free port for a peer that asked for any (tcp/0) and the daemon binds it
    later; a port something else takes in between (seen with peers starting side by side) costs one
    more pick, not the start."""
    import socket

    from lioncub_p2p.swarm import Swarm, SwarmConfig

    founder = Swarm(SwarmConfig("port-race", host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    taken = socket.socket()
    dialable = FakeCheck(HERE)

    async def check_then_lose_the_port(initial_peers, port, **kwargs):  # (the real check's own bind can race too)
        if not taken.getsockname()[1]:  # the first pick only
            taken.bind(("127.0.0.1", port))
            taken.listen()
        return await dialable(initial_peers, port, **kwargs)

    try:
        monkeypatch.setattr(reachability, "check", check_then_lose_the_port)
        with caplog.at_level(logging.INFO, logger="lioncub_p2p.swarm"):
            joiner = Swarm(SwarmConfig("port-race", initial_peers=founder.visible_maddrs(),
                                       host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
        try:
            port = int(joiner.config.host_maddrs[0].split("/")[-1])
            assert taken.getsockname()[1] and port not in (0, taken.getsockname()[1]) and joiner.visible_maddrs()
            assert any("taken meanwhile" in r.getMessage() for r in caplog.records) and len(dialable.calls) == 2
        finally:
            joiner.shutdown()
    finally:
        taken.close()
        founder.shutdown()


SERVER = textwrap.dedent("""
    import asyncio, sys
    from hivemind.p2p import P2P
    from lioncub_p2p.swarm import reachability, snapshot
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


@pytest.mark.slow
@pytest.mark.xdist_group("processes")  # trainer processes: one such test at a time (conftest.py)
def test_a_trainer_behind_nat_chooses_client_mode_by_itself_and_trains_with_a_public_founder(tmp_path):
    """Two hosts: a founder on the public segment, a volunteer behind a masquerading NAT router. Both
    run lioncub-train with no --client-mode flag; the volunteer finds out by itself (a dial-back from
    the founder fails) that it cannot be dialed, joins in client mode, votes every round, and both end
    at the same step with bitwise-equal parameters."""
    why = missing_tools(nat=True)
    assert why is None, f"this test builds network namespaces and a NAT router: {why}"
    steps = 60
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS="1")
    common = f"--run-id natrun --steps {steps} --wait-peers 2 --quiet --hidden 32"
    procs = []
    with HostNetwork() as net:
        founder_host, home = net.add_public("f"), net.add_private("h")

        def spawn(host: str, args: str) -> subprocess.Popen:
            proc = subprocess.Popen(net.exec_prefix(host) + ["bash", "-c", f"lioncub-train {args}"], cwd=tmp_path,
                                    env=env, stdout=open(tmp_path / f"{host}.log", "w"), stderr=subprocess.STDOUT,
                                    start_new_session=True)
            procs.append(proc)
            return proc

        def founder_address() -> str | None:
            found = re.search(r"(/ip4/" + re.escape(founder_host.ip) + r"/tcp/31337/p2p/\w+)",
                              (tmp_path / "f.log").read_text())
            return found.group(1) if found else None

        try:
            founder = spawn("f", f"{common} --host-maddrs /ip4/0.0.0.0/tcp/31337 --final-state f.state")
            deadline = time.monotonic() + 90
            while founder_address() is None and time.monotonic() < deadline and founder.poll() is None:
                time.sleep(0.2)
            address = founder_address()
            assert address, (tmp_path / "f.log").read_text()[-2000:]
            volunteer = spawn("h", f"{common} --initial-peers {address} --final-state h.state "
                                   f"--metrics-jsonl h.jsonl")
            codes = [wait_or_none(founder, 240), wait_or_none(volunteer, 240)]
        finally:
            for proc in procs:
                kill_group(proc)
    logs = {h: (tmp_path / f"{h}.log").read_text() for h in ("f", "h")}
    assert codes == [0, 0], {h: log[-4000:] for h, log in logs.items()}
    lines = [line for line in logs["h"].splitlines() if "client mode" in line and "peers cannot dial" in line]
    assert len(lines) == 1 and f"peers cannot dial {home.public_ip}:" in lines[0], logs["h"][-2000:]
    assert "client mode" not in logs["f"]  # the founder (no initial peers) listens
    # the same step and parameters (momenta are each peer's own; the default sync streams 1/20 per step)
    final = [snapshot.step_and_params_digest((tmp_path / f"{h}.state").read_bytes()) for h in ("f", "h")]
    assert final[0] == final[1] and final[0][0] == steps
    rows = [json.loads(line) for line in (tmp_path / "h.jsonl").read_text().splitlines() if line.strip()]
    assert rows[-1]["step"] == steps - 1 and max(r["peers"] for r in rows) == 2  # it voted with the founder
