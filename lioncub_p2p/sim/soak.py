"""Soak: many rounds of a real swarm (DHT, libp2p daemons) with random churn, in one process.

Peers train the digits example in threads. A fault schedule drawn from the seed makes peers leave
(shut down mid-run), new peers join (download state and catch up), one peer stall (its training
loop freezes for seconds), and parameters flip (a perturbed peer must notice and repair itself).
At the end every peer still in the run must hold bitwise identical parameters.
"""
from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from ..momentum import MomentumSchedule
from ..optim import LionCub
from ..swarm import Swarm, SwarmConfig, snapshot
from ..tasks.digits import digits_task
from ..testing import SWARM_ROUNDS

logger = logging.getLogger(__name__)


@dataclass
class SoakReport:
    rounds: int = 0
    seconds: float = 0.0
    faults: dict[str, int] = field(default_factory=lambda: {"leave": 0, "join": 0, "stall": 0, "bit_flip": 0})
    repairs: int = 0
    rejoins: int = 0
    peers_at_end: int = 0
    identical_at_end: bool = False
    unrepaired: int = 0
    errors: list[str] = field(default_factory=list)


class _Peer:
    def __init__(self, index: int, config: SwarmConfig, task, steps: int, team: int = 0):
        self.index, self.task, self.steps, self.config = index, task, steps, config
        self.team = team  # the founding team's size, whose members start together; 0: a newcomer
        self.swarm: Swarm | None = None
        self.joined = threading.Event()  # holds the run's state (or failed to)
        self.stop = threading.Event()
        self.stall_for = 0.0
        self.flip = False
        self.digest: bytes | None = None
        self.step = 0
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, name=f"soak-peer{index}", daemon=True)

    def _run(self) -> None:
        try:
            if self.swarm is None:  # a newcomer starts its own (not on the schedule's thread: that takes seconds)
                with _STARTING:  # one at a time: DHTs start processes, which must not fork side by side
                    self.swarm = Swarm(self.config)
            model = self.task.make_model(seed=0)
            opt = LionCub(model.parameters(), lr=1e-3, weight_decay=0.1, aggregator=self.swarm)
            self.swarm.final_step = self.steps  # as lioncub-train: no group starts past the last step
            self.swarm.join(opt, wait_peers=self.team, wait_timeout=60)
            self.joined.set()
            x, y = self.task.shard(self.index % 4, 4)
            gen = torch.Generator().manual_seed(self.index)
            while opt.step_count < self.steps and not self.stop.is_set():
                if self.stall_for:
                    time.sleep(self.stall_for)
                    self.stall_for = 0.0
                if self.flip:
                    with torch.no_grad():
                        next(model.parameters()).view(-1)[0] += 0.5  # a flipped exponent bit's worth
                    self.flip = False
                idx = torch.randint(0, len(x), (32,), generator=gen)
                nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
                opt.step()
                opt.zero_grad()
                self.step = opt.step_count
            if opt.step_count >= self.steps:
                self.digest = snapshot.params_digest(opt)
        except Exception as e:  # reported, and it fails the soak
            self.error = f"peer {self.index}: {type(e).__name__}: {e}"
            logger.exception("soak peer %d failed", self.index)
            self.shutdown()  # a crashed volunteer's machine goes away with it
        finally:
            self.joined.set()

    def shutdown(self) -> None:
        if self.swarm is not None:
            self.swarm.shutdown()

    @property
    def repairs(self) -> int:
        return self.swarm.repairs if self.swarm is not None else 0


_STARTING = threading.Lock()


def _leave(peer: "_Peer") -> None:
    peer.thread.join(30)
    peer.shutdown()


def run_soak(rounds: int = 300, peers: int = 4, *, seed: int = 0, fault_every: int = 25, hidden: int = 64,
             timeout: float = 600.0, max_group: int = 0) -> SoakReport:
    """``max_group``: a two-level vote in groups of at most that many (it needs 3 groups: 6 peers for 2)."""
    rng = random.Random(seed)
    task = digits_task(0, hidden=hidden)
    base = dict(host_maddrs=["/ip4/127.0.0.1/tcp/0"], allreduce=SWARM_ROUNDS, momentum=MomentumSchedule(every=10),
                record_ttl=6.0, max_group=max_group or None)
    report, started = SoakReport(), time.monotonic()
    first = _Peer(0, SwarmConfig("soak", **base), task, rounds, team=peers)
    first.swarm = Swarm(first.config)
    maddrs = [str(m) for m in first.swarm.dht.get_visible_maddrs()]
    config = lambda: SwarmConfig("soak", initial_peers=maddrs, **base)  # noqa: E731
    team = [first] + [_Peer(i, config(), task, rounds, team=peers) for i in range(1, peers)]
    for p in team[1:]:
        p.swarm = Swarm(p.config)
    for p in team:  # the first founds the run; the rest join it one by one, and all train once all joined
        p.thread.start()
        deadline = time.monotonic() + 60
        while p is first and first.swarm.history.latest is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
    for p in team:
        p.joined.wait(60)
    next_index, next_fault, gone, leaving = peers, fault_every, [], []
    try:
        while time.monotonic() - started < timeout:
            alive = [p for p in team if p.thread.is_alive()]
            if not alive:
                break
            step = max(p.step for p in alive)
            if step >= next_fault and step < rounds - fault_every:
                next_fault += fault_every
                kind = rng.choice(["leave", "stall", "bit_flip"])
                victim = rng.choice([p for p in alive if p is not first])  # keep the bootstrap peer up
                report.faults[kind] += 1
                if kind == "leave":  # it leaves (in the background: the schedule must not wait); a newcomer comes
                    victim.stop.set()
                    leaving.append(threading.Thread(target=_leave, args=(victim,), daemon=True))
                    leaving[-1].start()
                    team.remove(victim)
                    gone.append(victim)
                    newcomer = _Peer(next_index, config(), task, rounds)
                    next_index += 1
                    team.append(newcomer)
                    newcomer.thread.start()
                    report.faults["join"] += 1
                elif kind == "stall":
                    victim.stall_for = 6.0
                else:
                    victim.flip = True
                logger.info("soak: step %d, %s on peer %d", step, kind, victim.index)
            time.sleep(0.1)
        for p in team:
            p.thread.join(max(timeout - (time.monotonic() - started), 1.0))
        for t in leaving:
            t.join(60)
    finally:
        for p in team:
            p.stop.set()
        for p in team:
            p.thread.join(30)  # a peer still starting its swarm has it before it is shut down here
            report.repairs += p.repairs
            p.shutdown()
        for p in gone:
            report.repairs += p.repairs
    report.seconds = time.monotonic() - started
    report.rounds = max((p.step for p in team), default=0)
    finished = [p for p in team if p.digest is not None]
    report.peers_at_end = len(finished)
    report.identical_at_end = len(finished) == len(team) and len({p.digest for p in finished}) == 1
    majority = max({p.digest for p in finished}, key=lambda d: sum(p.digest == d for p in finished)) if finished else None
    report.unrepaired = sum(p.digest != majority for p in finished) + len(team) - len(finished)
    report.errors = [p.error for p in team + gone if p.error]
    return report
