"""Round time of a flat butterfly against a two-level vote for hundreds of peers, in virtual time.

Running 256-1024 real peers needs as many daemons and as many cores; this model replays the messages
each protocol sends and times them through three FIFO servers per peer, which is where a round spends
its time over the internet:

* the peer's **CPU**: ``per_message_s`` to send and again to receive any message (framing, stream
  bookkeeping, daemon hops: measured on real rounds, ``benchmarks/scale.py --calibrate``);
* its **uplink** and **downlink**: a message's bytes (payload plus ``header_bytes``) at the link's rate;
* the **path**: one-way latency ``access_s[i] + access_s[j]`` between peers i and j.

A message takes the sender's CPU, then its uplink, then the path, then the receiver's downlink and CPU,
each served first come first served; its bytes stream through (its downlink starts with its first
byte's arrival and ends no earlier than its last byte's), as TCP does, not store-and-forward. Every
peer starts its round at 0 (no compute skew) and no message is lost, so the times are the protocols'
floors on these links. Counting votes is left out (microseconds
per part against milliseconds per message).

Flat: every voter sends part j of its packed votes to member j, which sends the part's majority back
(2(n - 1) messages per peer). Two-level (``hierarchy.two_level_layout``): votes go to the group's
reducer of each part, the reducers of a part swap count planes and slice majorities across groups,
then send the part's result to their group (2(g - 1) + 2(G - 1) messages per peer, four path crossings
instead of two).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .. import ops
from ..allreduce.hierarchy import two_level_layout
from ..allreduce.partition import PeerSpec, part_bounds

MBIT = 1e6 / 8  # bytes per second in one Mbit/s


@dataclass(frozen=True)
class Network:
    """Each peer's links: rates in bytes per second, one-way access latency in seconds."""

    up: np.ndarray
    down: np.ndarray
    access_s: np.ndarray
    per_message_s: float = 0.0
    header_bytes: int = 80

    @property
    def peers(self) -> int:
        return len(self.up)

    @staticmethod
    def draw(peers: int, *, seed: int, rates_mbit: tuple[float, ...] = (100, 50, 20, 10),
             rtt_ms: tuple[float, float] = (20, 150), per_message_s: float = 0.0,
             header_bytes: int = 80) -> "Network":
        """Symmetric links with rates drawn from ``rates_mbit``; access latencies uniform so that the
        round trip between two peers, 2 (a_i + a_j), spans ``rtt_ms``."""
        rng = np.random.default_rng(seed)
        rates = rng.choice(np.asarray(rates_mbit, dtype=float), size=peers) * MBIT
        access = rng.uniform(rtt_ms[0] / 4, rtt_ms[1] / 4, size=peers) / 1000
        return Network(rates, rates.copy(), access, per_message_s, header_bytes)


@dataclass
class RoundTiming:
    finished: np.ndarray  # when each peer held every part's result (s)
    bytes_up: np.ndarray
    bytes_down: np.ndarray
    messages: np.ndarray  # sent, per peer

    @property
    def round_s(self) -> float:
        return float(self.finished.max())


@dataclass
class _Engine:
    """The three FIFO servers per peer and an event queue; ``send`` calls ``then`` on delivery."""

    net: Network
    cpu: np.ndarray = field(init=False)  # when each server is next free
    up: np.ndarray = field(init=False)
    down: np.ndarray = field(init=False)
    bytes_up: np.ndarray = field(init=False)
    bytes_down: np.ndarray = field(init=False)
    messages: np.ndarray = field(init=False)
    events: list = field(default_factory=list)
    seq: int = 0

    def __post_init__(self) -> None:
        n = self.net.peers
        self.cpu, self.up, self.down = np.zeros(n), np.zeros(n), np.zeros(n)
        self.bytes_up, self.bytes_down, self.messages = np.zeros(n), np.zeros(n), np.zeros(n)

    def _at(self, t: float, stage: int, message: tuple) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, stage, message))

    def _serve(self, server: np.ndarray, peer: int, t: float, seconds: float) -> float:
        start = max(t, server[peer])
        server[peer] = start + seconds
        return server[peer]

    def send(self, t: float, src: int, dst: int, payload: int, then: Callable[[float], None]) -> None:
        size = payload + self.net.header_bytes
        self.bytes_up[src] += size
        self.bytes_down[dst] += size
        self.messages[src] += 1
        self._at(self._serve(self.cpu, src, t, self.net.per_message_s), 0, (src, dst, size, 0.0, then))

    def run(self) -> None:
        net = self.net
        while self.events:
            t, _, stage, (src, dst, size, last, then) = heapq.heappop(self.events)
            if stage == 0:  # onto the sender's uplink; its first byte reaches the receiver one path later
                path = net.access_s[src] + net.access_s[dst]
                done = self._serve(self.up, src, t, size / net.up[src])
                self._at(done - size / net.up[src] + path, 1, (src, dst, size, done + path, then))
            elif stage == 1:  # through the receiver's downlink (not before its last byte), then its CPU
                start = max(t, self.down[dst])
                self.down[dst] = max(start + size / net.down[dst], last)
                self._at(self._serve(self.cpu, dst, self.down[dst], net.per_message_s), 2, (src, dst, size, last, then))
            else:
                then(t)

    def timing(self, finished: np.ndarray) -> RoundTiming:
        return RoundTiming(finished, self.bytes_up, self.bytes_down, self.messages)


def flat_round(net: Network, numel: int) -> RoundTiming:
    """One flat butterfly round: every peer reduces 1/n of the packed votes."""
    n, nbytes = net.peers, ops.packed_size(numel)
    parts = part_bounds(nbytes, [PeerSpec(str(j)) for j in range(n)])
    engine, votes, results = _Engine(net), np.zeros(n, dtype=int), np.zeros(n, dtype=int)
    finished = np.zeros(n)

    def got_result(peer: int) -> Callable[[float], None]:
        def then(t: float) -> None:  # its own part counts too, when it is reduced
            results[peer] += 1
            if results[peer] == n:
                finished[peer] = t
        return then

    def reduce(j: int, t: float) -> None:
        got_result(j)(t)
        size = parts[j][1] - parts[j][0]
        for k in range(1, n):  # rotated order, as every peer starts with its neighbour
            engine.send(t, j, (j + k) % n, size, got_result((j + k) % n))

    def got_vote(j: int) -> Callable[[float], None]:
        def then(t: float) -> None:
            votes[j] += 1
            if votes[j] == n - 1:
                reduce(j, t)
        return then

    if n == 1:
        reduce(0, 0.0)

    for i in range(n):
        for k in range(1, n):
            j = (i + k) % n
            engine.send(0.0, i, j, parts[j][1] - parts[j][0], got_vote(j))
    engine.run()
    return engine.timing(finished)


def two_level_round(net: Network, numel: int, max_size: int = 32, epoch: int = 0) -> RoundTiming:
    """One two-level round under exact counts, in ``hierarchy.two_level_layout``'s layout."""
    n = net.peers
    ids = [f"peer{i}" for i in range(n)]
    index = {pid: i for i, pid in enumerate(ids)}
    layout = two_level_layout(ids, epoch, ops.packed_size(numel), max_size)
    groups = [[index[pid] for pid in g] for g in layout.groups]
    G, P = len(groups), len(layout.parts)
    engine, finished = _Engine(net), np.zeros(n)
    votes = np.zeros((G, P), dtype=int)
    counts_in = np.zeros((G, P), dtype=int)  # [q, k]: groups' counts of slice q of part k at its combiner
    slices_back = np.zeros((G, P), dtype=int)  # [a, k]: slice majorities back at group a's reducer of k
    results = np.zeros(n, dtype=int)  # parts whose majority a peer holds (its own part's included)

    def size(lo_hi: tuple[int, int]) -> int:
        return lo_hi[1] - lo_hi[0]

    def got_result(peer: int) -> Callable[[float], None]:
        def then(t: float) -> None:
            results[peer] += 1
            if results[peer] == P:
                finished[peer] = t
        return then

    def part_done(a: int, k: int, t: float) -> None:  # group a's reducer of part k holds its majority
        me = groups[a][k]
        got_result(me)(t)
        members = groups[a]
        for step in range(1, len(members)):  # rotated, as the votes
            other = members[(k + step) % len(members)]
            engine.send(t, me, other, size(layout.parts[k]), got_result(other))

    def got_slice(a: int, k: int) -> Callable[[float], None]:
        def then(t: float) -> None:
            slices_back[a, k] += 1
            if slices_back[a, k] == G:  # G - 1 from the other combiners, one of its own
                part_done(a, k, t)
        return then

    def got_counts(q: int, k: int) -> Callable[[float], None]:
        def then(t: float) -> None:
            counts_in[q, k] += 1
            if counts_in[q, k] == G:  # every group's counts of this slice, its own included
                me = groups[q][k]
                for a in range(G):
                    if a == q:
                        got_slice(a, k)(t)
                    else:
                        engine.send(t, me, groups[a][k], size(layout.slices[k][q]), got_slice(a, k))
        return then

    def counted(a: int, k: int, t: float) -> None:  # group a's votes on part k are counted
        me, planes = groups[a][k], ops.planes_needed(len(groups[a]))
        for q in range(G):
            if q == a:
                got_counts(q, k)(t)
            else:
                engine.send(t, me, groups[q][k], planes * size(layout.slices[k][q]), got_counts(q, k))

    def got_vote(a: int, k: int) -> Callable[[float], None]:
        def then(t: float) -> None:
            votes[a, k] += 1
            if votes[a, k] == len(groups[a]) - 1:
                counted(a, k, t)
        return then

    for a, members in enumerate(groups):
        for pos, peer in enumerate(members):
            for step in range(1, P + 1):
                k = (pos + step) % len(members)
                if k < P and k != pos:
                    engine.send(0.0, peer, members[k], size(layout.parts[k]), got_vote(a, k))
        if len(members) == 1:
            counted(a, 0, 0.0)
    engine.run()
    return engine.timing(finished)


__all__ = ["Network", "RoundTiming", "flat_round", "two_level_round", "MBIT"]
