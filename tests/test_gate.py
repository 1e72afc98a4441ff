"""The stream gate's caps per peer id and per network address (``wire/gate.py``), without a network; the
remote address a real libp2p stream hands the gate; and the gates of the servers strangers reach first
(dial-back, state download, probe), driven through their real handlers."""
from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

from hivemind.p2p import P2P

from lioncub_p2p.aio import BackgroundLoop
from lioncub_p2p.allreduce.admission import OPEN, Admission
from lioncub_p2p.allreduce.partition import PeerSpec
from lioncub_p2p.swarm import probe, reachability
from lioncub_p2p.swarm.membership import GroupHistory, GroupRecord
from lioncub_p2p.swarm.state_sync import StateSync
from lioncub_p2p.wire import HEADER_BYTES, PROTOCOL_VERSION, pb
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


class _Handlers:
    """A P2P stand-in that keeps the stream handlers a server registers."""

    def __init__(self):
        self.handlers = {}

    async def add_binary_stream_handler(self, protocol, handler) -> None:
        self.handlers[protocol] = handler


class _Stream:
    """One incoming stream: its caller (id, multiaddr), what it sends, and what it was answered."""

    def __init__(self, peer_id: str, addr: str, sent: bytes | None):
        self.info = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: peer_id), addr=addr)
        self.reader = asyncio.StreamReader()
        if sent is not None:  # None: a caller that opens the stream and says nothing
            self.reader.feed_data(sent)
            self.reader.feed_eof()
        self.answer, self.closed = b"", False

    def write(self, data: bytes) -> None:
        self.answer += data

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def error(self) -> str:
        return pb.DialbackAnswer.FromString(self.answer[HEADER_BYTES:]).error if self.answer else "<no answer>"


def test_dialback_serves_two_streams_per_address_and_counts_only_valid_requests_against_its_budget(monkeypatch):
    """The dial-back server (``reachability.serve_dialback``): a third stream from one address is closed
    unanswered while two are open; requests that are not valid cost the caller's address nothing; valid
    ones draw on its budget until it answers busy, while another address is still served."""
    dialed: list[tuple[str, int]] = []

    async def dial(ip: str, port: int, nonce: bytes) -> bool:
        dialed.append((ip, port))
        return True

    monkeypatch.setattr(reachability, "_dial_and_send", dial)
    monkeypatch.setattr(reachability, "PER_IP_RATE", 0.0)  # no refill: the budget is the burst

    def request(port: int) -> bytes:
        body = pb.DialbackRequest(version=PROTOCOL_VERSION, port=port, nonce=b"n" * 16).SerializeToString()
        return len(body).to_bytes(HEADER_BYTES, "big") + body

    async def scenario() -> None:
        p2p = _Handlers()
        await reachability.serve_dialback(p2p)
        handle = p2p.handlers[reachability.DIALBACK_PROTOCOL]
        host, other = "/ip4/203.0.113.7/tcp/4001", "/ip4/198.51.100.9/tcp/4001"
        silent = [_Stream(f"quiet{i}", host, None) for i in range(2)]
        waiting = [asyncio.create_task(handle(s.info, s.reader, s)) for s in silent]
        await asyncio.sleep(0.05)
        third = _Stream("third", host, request(5000))
        await handle(third.info, third.reader, third)
        assert third.closed and third.answer == b"" and not dialed  # closed before a byte was read
        elsewhere = _Stream("elsewhere", other, request(5000))
        await handle(elsewhere.info, elsewhere.reader, elsewhere)
        assert elsewhere.error() == "" and dialed == [("198.51.100.9", 5000)]
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)

        for i in range(int(reachability.PER_IP_BURST) * 2):  # bad ports: answered, never counted
            bad = _Stream(f"bad{i}", host, request(80))
            await handle(bad.info, bad.reader, bad)
            assert bad.error().startswith("bad request"), bad.error()
        answers = []
        for i in range(int(reachability.PER_IP_BURST) + 1):
            s = _Stream(f"caller{i}", host, request(5000 + i))
            await handle(s.info, s.reader, s)
            answers.append(s.error())
        assert answers[:-1] == [""] * int(reachability.PER_IP_BURST) and answers[-1].startswith("busy"), answers
        late = _Stream("late", other, request(6000))
        await handle(late.info, late.reader, late)
        assert late.error() == ""  # one address's budget is its own

    asyncio.run(scenario())


def test_the_state_server_caps_strangers_per_address_but_not_members_of_this_peers_groups():
    """``StateSync``'s download gate: strangers behind one address share two streams; a member of a
    group this peer keeps is counted by its id only (several members behind one NAT download at once)."""
    history = GroupHistory()
    history.add(GroupRecord(1, 0, (PeerSpec("me"), PeerSpec("mate1"), PeerSpec("mate2"))))
    loop = BackgroundLoop("gate-test")
    try:
        sync = StateSync(p2p=None, loop=loop, run_id="r", peer_id="me", admission=OPEN,
                         upkeep=SimpleNamespace(history=history), liars=dict, max_uploads=1, join_timeout=5.0,
                         round_bound=5.0)
    finally:
        loop.stop()
    gate, nat = sync.server.gate, "/ip4/203.0.113.7/tcp/4001"
    strangers = [gate.enter(f"stranger{i}", nat) for i in range(4)]
    assert sum(r is not None for r in strangers) == 2
    mates = [gate.enter(pid, nat) for pid in ("mate1", "mate1", "mate2", "mate2")]
    assert all(r is not None for r in mates)  # members: 2 each by id, whatever the address holds
    assert gate.enter("mate1", nat) is None  # ...and no more than that


def test_the_probe_server_takes_one_probe_per_address():
    async def gate() -> StreamGate:
        return await probe.serve_probe(_Handlers())

    probes = asyncio.run(gate())
    held = [probes.enter(f"id{i}", "/ip4/203.0.113.7/tcp/1") for i in range(3)]
    assert sum(r is not None for r in held) == 1
    assert probes.enter("another", "/ip6/2001:db8::1/tcp/1") is not None


def test_a_probe_tells_a_refused_token_from_a_member_whose_slots_are_taken():
    """Preflight fails on a refused run token and only warns when a member is busy: a probe over the
    gate's cap (here the caller's own second stream; on the internet, another volunteer behind the same
    NAT) is closed unanswered and reads as busy, a wrong token as denied (before, both closed unanswered
    and preflight told the volunteer to check its run secret)."""
    async def scenario() -> list[str]:
        member = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        caller = await P2P.create(initial_peers=[str(m) for m in await member.get_visible_maddrs()],
                                  host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        private = Admission(run_id="r", secret=b"the run's secret")
        target, token = member.peer_id.to_base58(), private.token(caller.peer_id.to_base58())
        outcomes: list[str] = []

        async def probe_once(token: bytes) -> None:
            try:
                up, down = await asyncio.wait_for(probe.measure(caller, target, nbytes=64 << 10, token=token), 20)
                outcomes.append("ok" if up > 0 and down > 0 else "zero")
            except (probe.ProbeBusy, probe.ProbeDenied) as e:
                outcomes.append(type(e).__name__)

        async def until(condition) -> None:
            for _ in range(500):
                if condition():
                    return
                await asyncio.sleep(0.02)
            raise AssertionError(f"the probe gate still holds {gate.open_total} stream(s) after 10 s")

        try:
            gate = await probe.serve_probe(member, admission=private)
            await probe_once(b"\0" * len(token))
            await until(lambda: gate.open_total == 0)
            _, _, held = await caller.call_binary_stream_handler(member.peer_id, probe.PROBE_PROTOCOL)
            await until(lambda: gate.open_total == 1)
            await probe_once(token)
            held.close()
            await until(lambda: gate.open_total == 0)
            await probe_once(token)
            return outcomes
        finally:
            await asyncio.gather(member.shutdown(), caller.shutdown())

    assert asyncio.run(scenario()) == ["ProbeDenied", "ProbeBusy", "ok"]
