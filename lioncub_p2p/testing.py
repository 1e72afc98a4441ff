"""LocalSwarm: n vote peers on 127.0.0.1 in this process, for tests and for exploring the protocol.

    with LocalSwarm(4, client_mode=(3,), weights=[2, 1, 1, 1]) as swarm:
        results = swarm.allreduce([ops.pack_signs(torch.randn(1000), seed=i) for i in range(4)])
        print(swarm.reports[0].parts)

Each peer runs its own libp2p daemon (hivemind's p2pd) with NAT probing off and its own identity
(so it signs its results), listening on TCP or (``transport="quic"``) QUIC only; peers in client mode
do not listen at all and only dial out. ``kill``
SIGKILLs a peer's daemon (optionally at a precise moment of the next round), ``stall`` freezes it
with SIGSTOP for some seconds. Leaving (the end of the ``with``) cancels the peers' tasks before
closing their daemons, as a leaving Swarm does.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import itertools
import os
import random
import shutil
import signal
import tempfile
import threading
import time
from typing import Awaitable, Callable, Collection, Iterator, Sequence

import torch
from hivemind.p2p import P2P, PeerID

from .aio import BackgroundLoop
from .allreduce import AllReduceConfig, PeerSpec, RoundReport, RoundSpec, VoteNode
from .allreduce.commit import result_signed_bytes
from .allreduce.reducer import PartReduction
from .allreduce.round import PartResult
from .codecs import result_codec, upload_codec
from .identity import Identity
from .wire import PROTOCOL_VERSION, pb, read_frame, write_frame

Behavior = Callable[[VoteNode, RoundSpec, torch.Tensor], Awaitable[object]]
FAST_CONFIG = AllReduceConfig(upload_timeout=3.0, result_timeout=6.0, join_timeout=2.0, recovery_timeout=2.0)
# whole Swarms training on loopback (tests, the soak): a missed round costs a few seconds, not a minute
SWARM_ROUNDS = AllReduceConfig(upload_timeout=2.0, result_timeout=4.0, join_timeout=2.0, recovery_timeout=1.0)


LISTEN = {"tcp": ["/ip4/127.0.0.1/tcp/0"], "quic": ["/ip4/127.0.0.1/udp/0/quic-v1"]}


class LocalSwarm:
    def __init__(self, n_peers: int, *, client_mode: Sequence[int] = (), weights: Sequence[float] | None = None,
                 config: AllReduceConfig = FAST_CONFIG, transport: str = "tcp", not_voters: Sequence[int] = ()):
        if n_peers < 1:
            raise ValueError("need at least one peer")
        if transport not in LISTEN:
            raise ValueError(f"transport must be one of {sorted(LISTEN)}, got {transport!r}")
        self.transport = transport
        self.n = n_peers
        self.client_mode = set(client_mode)
        self.not_voters = set(not_voters)  # members the group does not expect to vote (``PeerSpec.voter``)
        self.weights = list(weights) if weights is not None else [1.0] * n_peers
        if len(self.weights) != n_peers:
            raise ValueError(f"{len(self.weights)} weights for {n_peers} peers")
        self.config = config
        self.nodes: list[VoteNode] = []
        self.alive: list[bool] = []
        self.reports: list[RoundReport | None] = []
        self._rounds = itertools.count()
        self._loop: BackgroundLoop | None = None
        self._tasks: dict[int, asyncio.Task] = {}
        self._keys: str | None = None
        self.identities: list[Identity] = []

    # -- lifecycle ---------------------------------------------------------------------------------

    def __enter__(self) -> "LocalSwarm":
        self._loop = BackgroundLoop("local-swarm")
        try:
            self._loop.run(self._start(), timeout=60)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    async def _start(self) -> None:
        listening: list[str] = []
        self._keys = tempfile.mkdtemp(prefix="lioncub-local-")
        for i in range(self.n):
            client = i in self.client_mode
            identity = Identity.load_or_create(os.path.join(self._keys, f"peer{i}.key"))
            self.identities.append(identity)
            p2p = await P2P.create(initial_peers=listening, host_maddrs=LISTEN[self.transport], nat_port_map=False,
                                   auto_nat=False, no_listen=client, identity_path=identity.path,
                                   check_if_identity_free=False)  # fresh keys: nobody else has them
            node = VoteNode(p2p, self.config, identity=identity)
            await node.start()
            self.nodes.append(node)
            self.alive.append(True)
            if not client:
                listening += [str(m) for m in await p2p.get_visible_maddrs()]

    def __exit__(self, *exc) -> None:
        if self._loop is None:
            return
        for i in range(len(self.nodes)):
            if self.alive[i]:
                self._signal(i, signal.SIGCONT)
        try:  # tasks first, daemons after: what a leaving Swarm does (its loop stops before the DHT)
            self._loop.run(_cancel_tasks(), timeout=10)
        except Exception:
            pass
        for i, node in enumerate(self.nodes):
            try:
                self._loop.run(node.p2p.shutdown(), timeout=10)
            except Exception:
                self._signal(i, signal.SIGKILL)
        self._loop.stop()
        self._loop = None
        if self._keys is not None:
            shutil.rmtree(self._keys, ignore_errors=True)

    def run(self, coro, timeout: float = 60.0):
        """Run a coroutine on the swarm's event loop (rogue peers, inspections) and return its result."""
        return self._loop.run(coro, timeout=timeout)

    def settle_audits(self) -> None:
        """Wait for every peer's background audits of the last round; their verdicts land in
        ``node.caught`` and in the next round's reports."""
        async def settle() -> None:
            await asyncio.gather(*(node.settle_audits() for i, node in enumerate(self.nodes) if self.alive[i]))

        self._loop.run(settle(), timeout=60)

    @property
    def group(self) -> tuple[PeerSpec, ...]:
        return tuple(PeerSpec(node.peer_id, w, i in self.client_mode, i not in self.not_voters)
                     for i, (node, w) in enumerate(zip(self.nodes, self.weights)))

    # -- faults ------------------------------------------------------------------------------------

    def _signal(self, i: int, sig: int) -> None:
        child = getattr(self.nodes[i].p2p, "_child", None)
        if child is not None and child.returncode is None:
            os.kill(child.pid, sig)

    def kill(self, i: int, *, on: str | None = None, after: int = 1) -> None:
        """SIGKILL peer i's daemon now, or during the next round after its ``after``-th ``on`` event
        ("vote_chunk": mid-upload, "result_chunk": mid-answer as a reducer)."""
        if on is None:
            self._kill_now(i)
            return
        seen = itertools.count(1)

        def maybe_kill(event: str) -> None:
            if event == on and next(seen) == after:
                self._kill_now(i)

        self.nodes[i].on_event.append(maybe_kill)

    def _kill_now(self, i: int) -> None:
        self._signal(i, signal.SIGKILL)
        self.alive[i] = False
        task = self._tasks.get(i)
        if task is not None:
            self._loop.loop.call_soon_threadsafe(task.cancel)

    @contextlib.contextmanager
    def throttled(self, i: int, *, stopped: float = 0.03, running: float = 0.03) -> Iterator[None]:
        """Peer i's daemon alternately frozen (SIGSTOP, ``stopped`` s) and running (``running`` s) while
        the ``with`` block runs: everything it sends or answers comes late and in bursts, as from a
        loaded host on a slow link."""
        done = threading.Event()

        def toggle() -> None:
            while not done.is_set():
                self._signal(i, signal.SIGSTOP)
                done.wait(stopped)
                self._signal(i, signal.SIGCONT)
                done.wait(running)

        thread = threading.Thread(target=toggle, name=f"throttle-{i}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()
            self._signal(i, signal.SIGCONT)

    def stall(self, i: int, seconds: float) -> None:
        """Freeze peer i's daemon (SIGSTOP) for ``seconds``: its streams go silent, nothing resets."""
        self._signal(i, signal.SIGSTOP)
        self._loop.loop.call_soon_threadsafe(self._loop.loop.call_later, seconds, self._signal, i, signal.SIGCONT)

    # -- rounds ------------------------------------------------------------------------------------

    def allreduce(self, uploads: Sequence[torch.Tensor], *, upload: str = "sign", result: str = "majority",
                  step: int = 0, seed: int = 0, timeout: float = 120.0,
                  behaviors: dict[int, Behavior] | None = None,
                  delays: dict[int, float] | None = None, tags: Sequence[bytes] | None = None,
                  audit: bool = False, prepare: bool = True,
                  follow: dict[int, float] | None = None, family: str = "",
                  provisional: Collection[int] = ()) -> list[torch.Tensor | None]:
        """One round with every live peer voting its upload; one update per peer (None if it failed).

        ``uploads[i]`` is peer i's codes: (planes, nbytes) uint8, or packed signs (nbytes,).
        ``behaviors[i]``, if given, replaces peer i's honest ``run_round`` for this round (a rogue
        peer in experiments); its return value is ignored and peer i's result is None.
        ``delays[i]`` starts peer i's round that many seconds after the others (a slow peer).
        ``tags[i]`` is the state tag peer i sends with its votes; ``audit`` is passed to the spec (it
        has no effect since protocol 2: every round is audited). ``prepare=False``: peers start
        reducing only when they vote (a late reducer), not before the round as a swarm does.
        ``follow[i]``: peer i does not vote; that many seconds after the others started it receives
        the results (``VoteNode.follow_round``, a peer behind the group). ``family``: ``RoundSpec.family``.
        ``provisional``: the peers that vote with a state caught up and not yet decided for."""
        if len(uploads) != self.n:
            raise ValueError(f"{len(uploads)} uploads for {self.n} peers")
        codes = [u.reshape(1, -1) if u.dim() == 1 else u for u in uploads]
        spec = RoundSpec(round_id=f"local-{id(self)}-{next(self._rounds)}".encode(), step=step, group=self.group,
                         nbytes=codes[0].shape[1], upload=upload_codec(upload), result=result_codec(result), seed=seed,
                         audit=audit, family=family)
        tags = list(tags) if tags is not None else [b""] * self.n
        outcomes = self._loop.run(self._round(spec, codes, behaviors or {}, delays or {}, tags, prepare, follow or {},
                                              frozenset(provisional)), timeout=timeout)
        self.reports = [o[1] if o is not None else None for o in outcomes]
        return [o[0] if o is not None else None for o in outcomes]

    def two_level(self, uploads: Sequence[torch.Tensor], *, max_size: int, step: int = 0, seed: int = 0,
                  epoch: int = 0, absent: Sequence[int] = (), tags: Sequence[bytes] | None = None,
                  timeout: float = 120.0, provisional: Collection[int] = ()) -> list[torch.Tensor | None]:
        """One two-level vote of packed signs (``hierarchy.two_level_specs``): groups of at most
        ``max_size`` from ``epoch``, every live peer voting in its group's round; ``absent`` peers stay
        silent; ``tags[i]``: the state tag peer i sends; ``provisional``: the peers voting with a state
        not yet decided for. One update per peer (None for the absent); ``reports`` as in ``allreduce``."""
        from .allreduce.hierarchy import two_level_layout, two_level_specs

        codes = [u.reshape(1, -1) if u.dim() == 1 else u for u in uploads]
        ids = [p.peer_id for p in self.group]
        layout = two_level_layout(ids, epoch, codes[0].shape[1], max_size)
        specs = two_level_specs(f"local-{id(self)}-{next(self._rounds)}".encode(), step, layout, codes[0].shape[1],
                                seed=seed)

        async def run() -> list:
            for i in range(self.n):  # as a swarm does at the end of the previous round
                self.nodes[i].prepare_round(specs[ids[i]])
            voting = [i for i in range(self.n) if self.alive[i] and i not in absent]
            done = await asyncio.gather(*(self.nodes[i].run_round(specs[ids[i]], codes[i], tags[i] if tags else b"",
                                                                  provisional=i in provisional) for i in voting),
                                        return_exceptions=True)
            outcomes: list = [None] * self.n
            for i, value in zip(voting, done):
                outcomes[i] = None if isinstance(value, BaseException) else value
            return outcomes

        outcomes = self._loop.run(run(), timeout=timeout)
        self.reports = [o[1] if o is not None else None for o in outcomes]
        return [o[0] if o is not None else None for o in outcomes]

    async def _round(self, spec: RoundSpec, codes: list[torch.Tensor], behaviors: dict[int, Behavior],
                     delays: dict[int, float], tags: list[bytes], prepare: bool = True,
                     follow: dict[int, float] | None = None, provisional: frozenset[int] = frozenset()):
        follow = follow or {}

        async def honest(i: int):
            await asyncio.sleep(delays.get(i, follow.get(i, 0.0)))
            if i in follow:
                return await self.nodes[i].follow_round(spec, tags[i])
            return await self.nodes[i].run_round(spec, codes[i], tags[i], provisional=i in provisional)

        live = [i for i in range(self.n) if self.alive[i]]
        for i in live:  # as a swarm does at the end of the previous round
            if i not in behaviors and i not in follow and prepare:
                self.nodes[i].prepare_round(spec)
        self._tasks = {i: asyncio.create_task(behaviors[i](self.nodes[i], spec, codes[i]) if i in behaviors
                                              else honest(i)) for i in live}
        done = await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        outcomes: list = [None] * self.n
        for i, value in zip(self._tasks, done):
            if self.alive[i] and i not in behaviors and not isinstance(value, BaseException):
                outcomes[i] = value
        for node in self.nodes:
            node.on_event.clear()
        self._tasks = {}
        return outcomes


async def _cancel_tasks() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class LyingReduction(PartReduction):
    """A reducer that returns its part's result with every bit flipped, to everyone (experiments, tests).

    Its header still carries the true roots of the votes it received: only the result lies."""

    def __init__(self, spec: RoundSpec, part: int):
        super().__init__(spec, part)
        honest = self.tally.encode
        self.tally.encode = lambda *args, **kwargs: ~honest(*args, **kwargs)


def lying_reduction(probability: float = 1.0, seed: int = 0, first_bytes: int | None = None,
                    last_bytes: int | None = None):
    """A reduction class whose reducer lies in a round with ``probability`` (its own seeded coin),
    flipping every result byte, or only the first ``first_bytes`` or the last ``last_bytes`` (a liar
    hiding in one leaf). ``cls.lies`` lists the round ids it lied in."""
    rng = random.Random(seed)

    class Lying(PartReduction):
        lies: list[bytes] = []

        def __init__(self, spec: RoundSpec, part: int):
            super().__init__(spec, part)
            honest = self.tally.encode
            if rng.random() >= probability:
                return
            Lying.lies.append(spec.round_id)

            def encode(*args, **kwargs):
                wire = honest(*args, **kwargs).clone()
                end = wire.numel() if first_bytes is None else min(first_bytes, wire.numel())
                start = 0 if last_bytes is None else max(wire.numel() - last_bytes, 0)
                wire[start:end] = ~wire[start:end]
                return wire

            self.tally.encode = encode

    return Lying


def flipped(outcome: PartResult, identity: Identity) -> PartResult:
    """``outcome`` with every bit flipped, its header's digest redone and signed again by
    ``identity``: a result its reducer lies with, validly signed."""
    wire = bytes(b ^ 0xFF for b in outcome.wire)
    header = pb.ResultHeader.FromString(outcome.header)
    header.wire_digest = hashlib.sha256(wire).digest()
    raw = header.SerializeToString(deterministic=True)
    return dataclasses.replace(outcome, wire=wire, header=raw, signature=identity.sign(result_signed_bytes(raw)))


def lie_to(node: VoteNode, voter: int) -> list[bytes]:
    """Make ``node`` send group member ``voter`` a different result than everyone else, validly signed
    (``flipped``). Returns the list of round ids it lied in."""
    lied: list[bytes] = []

    def outcome_for(state, to: int, outcome):
        if to != voter:
            return outcome
        lied.append(state.spec.round_id)
        return flipped(outcome, node.identity)

    node._outcome_for = outcome_for  # type: ignore[method-assign]
    return lied


@contextlib.contextmanager
def cpu_load(processes: int = 2) -> Iterator[None]:
    """``processes`` busy loops in child processes while the ``with`` block runs (a loaded machine)."""
    import subprocess
    import sys

    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
               for _ in range(processes)]
    try:
        yield
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


# -- rogue peers: the attack suite's tools (tests/test_attacks_round.py, lioncub-reliability) ---------


def rss_mib() -> float:
    """This process's resident memory in MiB (Linux)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


class PeakRss:
    """The highest RSS of this process while the ``with`` block runs (sampled every 20 ms)."""

    def __enter__(self) -> "PeakRss":
        self.mib, self._stop = rss_mib(), threading.Event()

        def sample() -> None:
            while not self._stop.wait(0.02):
                self.mib = max(self.mib, rss_mib())

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


async def start_outsider(swarm: LocalSwarm) -> P2P:
    """A daemon outside the group, connected to peer 0 (anyone who found the run on the DHT)."""
    maddrs = [str(m) for m in await swarm.nodes[0].p2p.get_visible_maddrs()]
    return await P2P.create(initial_peers=maddrs, host_maddrs=LISTEN[swarm.transport], nat_port_map=False,
                            auto_nat=False)


async def hold_streams(p2p: P2P, peer_id: str, protocol: str, count: int, until: asyncio.Event,
                       first: bytes = b"", dialed: list | None = None, redial: float = 0.05) -> int:
    """Keep ``count`` streams open to ``peer_id`` (re-dialing any that close after ``redial`` s) until
    ``until``; returns how many were dialed (also counted live in ``dialed[0]``). ``first``: bytes
    written on each (e.g. the start of a frame), else silence."""
    dialed = dialed if dialed is not None else [0]

    async def one() -> None:
        while not until.is_set():
            try:
                _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), protocol)
                dialed[0] += 1
                if first:
                    writer.write(first)
                try:
                    await asyncio.wait_for(reader.read(), 30)  # until the victim closes it
                except asyncio.TimeoutError:
                    pass
                writer.close()
            except Exception:
                pass
            await asyncio.sleep(redial)

    tasks = [asyncio.create_task(one()) for _ in range(count)]
    await until.wait()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return dialed[0]


def trickler(interval: float):
    """(behavior, tasks): a member that, every round, opens a stream to every reducer and sends an
    8-byte chunk every ``interval`` seconds, never finishing (each chunk restarts a per-frame timeout).
    Cancel ``tasks`` at the end."""
    from .allreduce import VOTE_PROTOCOL

    async def one(node: VoteNode, spec: RoundSpec, j: int) -> None:
        try:
            _, reader, writer = await node.p2p.call_binary_stream_handler(PeerID.from_base58(spec.group[j].peer_id),
                                                                          VOTE_PROTOCOL)
            for k in range(10_000):
                await write_frame(writer, pb.VoteChunk(
                    version=PROTOCOL_VERSION, round_id=spec.round_id, step=spec.step, part=j, offset=8 * k, length=8,
                    upload=pb.UPLOAD_SIGN, upload_bits=1, result=pb.RESULT_MAJORITY, codes=bytes(8), last=False))
                await asyncio.sleep(interval)
        except Exception:
            pass

    tasks: set[asyncio.Task] = set()

    async def behave(node: VoteNode, spec: RoundSpec, codes: torch.Tensor) -> None:
        for j, (a, b) in enumerate(spec.bounds):
            if b > a:
                task = asyncio.create_task(one(node, spec, j))
                tasks.add(task)
                task.add_done_callback(tasks.discard)

    return behave, tasks


async def cancel(tasks) -> None:
    for task in list(tasks):
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def forge_fetch_answers(swarm: LocalSwarm, rogue: int, variant: str) -> None:
    """Peer ``rogue`` answers every result request with forged bytes for the asked part: all ones,
    with a well-formed header, signed with its own key ("own key"), carrying the reducer's key and a
    bad signature ("reducer's key"), or unsigned."""
    from .allreduce import FETCH_PROTOCOL
    from .allreduce.commit import build_header

    node = swarm.nodes[rogue]

    async def handler(info, reader, writer) -> None:
        try:
            req, _ = await read_frame(reader, pb.FetchResult, 1024)
            spec = next(s.spec for s in node._rounds.values() if s.spec.round_id == req.round_id)
            wire = bytes([0xFF]) * spec.result_size(req.part, len(spec.group))
            raw = build_header(spec, req.part, list(range(len(spec.group))), [bytes(16)] * len(spec.group), b"", 0,
                               wire)
            reducer = swarm.identities[req.part]
            signature, key = {"own key": (node.identity.sign(result_signed_bytes(raw)), node.identity.public_key),
                              "reducer's key": (bytes(256), reducer.public_key), "unsigned": (b"", b"")}[variant]
            await write_frame(writer, pb.ResultChunk(version=PROTOCOL_VERSION, round_id=req.round_id, part=req.part,
                                                     offset=0, data=wire, last=True, result=pb.RESULT_MAJORITY,
                                                     header=raw, signature=signature, public_key=key))
            await asyncio.sleep(1)
        except Exception:
            pass
        finally:
            writer.close()

    async def replace() -> None:
        await node.p2p.remove_binary_stream_handler(FETCH_PROTOCOL)
        await node.p2p.add_binary_stream_handler(FETCH_PROTOCOL, handler)

    swarm.run(replace())


class HugeMomentumReduction(PartReduction):
    """A momentum reducer that returns 1e30 for every value of its part."""

    def __init__(self, spec: RoundSpec, part: int):
        super().__init__(spec, part)
        codec = self.tally.codec
        self.tally.encode = lambda *a, **k: codec.encode(torch.full((codec.values_in(self.nbytes),), 1e30)).reshape(-1)


_FD_VICTIM = r"""
import json, logging, resource, sys
import numpy as np, torch
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), hard))
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from lioncub_p2p import ops
from lioncub_p2p.testing import LocalSwarm
numel = 8 * 8000
codes = [ops.pack_signs(torch.randn(numel, generator=torch.Generator().manual_seed(i))) for i in range(3)]
bits = np.stack([np.unpackbits(c.numpy(), bitorder="little")[:numel] for c in codes])
want = np.packbits(bits.sum(0) * 2 > 3, bitorder="little")
with LocalSwarm(3) as swarm:
    swarm.allreduce(codes)
    async def maddrs():
        return [str(m) for m in await swarm.nodes[0].p2p.get_visible_maddrs()]
    print(json.dumps({"maddrs": swarm.run(maddrs()), "peer": swarm.nodes[0].peer_id}), flush=True)
    sys.stdin.readline()
    exact, why = [], []
    for step in range(1, int(sys.argv[2]) + 1):
        results = swarm.allreduce(codes, step=step)
        exact.append(all(r is not None and np.array_equal(r.numpy(), want) for r in results))
        if not exact[-1]:  # which part of whose round fell short, and what it counted
            why.append([step] + [[(p.status, p.counted, p.note) for p in rep.parts] if rep else None for rep in swarm.reports])
    print(json.dumps({"exact": exact, "why": why}), flush=True)
"""


def fd_exhaustion(workdir: str, *, limit: int = 1024, streams: int = 700, rounds: int = 5) -> dict:
    """A 3-peer LocalSwarm in a process limited to ``limit`` file descriptors; an outsider keeps
    ``streams`` streams open at each of peer 0's vote, fetch and audit handlers (re-dialing as they
    close) while it runs ``rounds`` rounds. Returns whether each round was the exact majority, how
    many streams reached it, its exit code and whether it logged "Too many open files"."""
    import json
    import select
    import subprocess
    import sys

    from .aio import BackgroundLoop
    from .allreduce import AUDIT_PROTOCOL, FETCH_PROTOCOL, VOTE_PROTOCOL

    def readline(proc, timeout: float) -> str:
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        return proc.stdout.readline() if ready else ""

    log_path = os.path.join(workdir, "fd-victim.log")
    with open(log_path, "w") as log:
        victim = subprocess.Popen([sys.executable, "-c", _FD_VICTIM, str(limit), str(rounds)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    loop = BackgroundLoop("outsider")
    done: dict = {}
    dialed = [0]
    try:
        hello = json.loads(readline(victim, 120) or "{}")
        if hello:
            attacker = loop.run(P2P.create(initial_peers=hello["maddrs"], host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                           nat_port_map=False, auto_nat=False), timeout=60)
            stop = asyncio.Event()
            floods = [asyncio.run_coroutine_threadsafe(hold_streams(attacker, hello["peer"], protocol, streams, stop,
                                                                    dialed=dialed), loop.loop)
                      for protocol in (VOTE_PROTOCOL, FETCH_PROTOCOL, AUDIT_PROTOCOL)]
            deadline = time.monotonic() + 60
            while dialed[0] < 3 * streams and time.monotonic() < deadline:
                time.sleep(0.1)  # more streams than the victim has file descriptors reached it
            victim.stdin.write("go\n")
            victim.stdin.flush()
            done = json.loads(readline(victim, 120) or "{}")
            loop.loop.call_soon_threadsafe(stop.set)
            for flood in floods:
                flood.result(120)
            loop.run(attacker.shutdown(), timeout=30)
        victim.stdin.close()
        victim.wait(60)
    finally:
        if victim.poll() is None:
            os.killpg(victim.pid, signal.SIGKILL)
            victim.wait()
        loop.stop()
    text = open(log_path).read()
    return dict(exact=done.get("exact", []), why=done.get("why", []), dialed=dialed[0], returncode=victim.returncode,
                too_many_open_files="Too many open files" in text or "out of system resource" in text,
                log_tail=text[-3000:])
