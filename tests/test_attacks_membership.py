"""Standing attack suite for the DHT side of a run (issue 12, items 1-3 and 8).

Each test trains real Swarm objects in threads (each with its own DHT process and libp2p daemon on
127.0.0.1) while a rogue hivemind DHT (no validator, speaking the DHT protocol directly) writes what
an outsider would, then checks that nobody dies, the honest peers end bitwise equal, and membership
upkeep keeps working: a joiner is added and a SIGKILLed member is dropped within ``DROP_BOUND_S``.
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import os
import signal
import threading
import time
from dataclasses import dataclass, field

import msgpack
import pytest
import torch
from hivemind import DHT
from hivemind.dht.routing import DHTID
from hivemind.utils import get_dht_time
from torch import nn

from lioncub_p2p import LionCub, MomentumSchedule
from lioncub_p2p.allreduce import PeerSpec
from lioncub_p2p.testing import SWARM_ROUNDS
from lioncub_p2p.allreduce.admission import run_key
from lioncub_p2p.identity import Identity
from lioncub_p2p.tasks.digits import digits_task
from lioncub_p2p.swarm import Swarm, SwarmConfig, snapshot
from lioncub_p2p.swarm.membership import GroupRecord, PeerRecord
from lioncub_p2p.swarm.upkeep import STEP_WINDOW
from lioncub_p2p.swarm.dht_process import descendants as _descendants
from lioncub_p2p.swarm.records import canonical, seal, signed_bytes

pytestmark = pytest.mark.slow  # each trains a swarm of 4 threads with their own daemons for ~a minute

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
FAST = SWARM_ROUNDS
ATTACK_AT, JOIN_AT, KILL_AT, OPEN_END = 10, 20, 30, 10**9
DROP_BOUND_S = 30.0  # DROP_AFTER_S (5 s) + two missed rounds + lead steps, with room for a loaded 2-core machine
WORDS = ["password", "letmein", "hunter2", "dragon", "monkey", "qwerty", "s3cret", "trustno1"]


# -- a rogue DHT peer: raw writes, no validator ----------------------------------------------------------

async def _store_raw(_dht, node, key: str, subkey, value: bytes, expiration: float) -> int:
    """Store ``value`` bytes as they are, in this node and at every node it knows; returns acceptances."""
    key_id = DHTID.generate(key)
    if subkey is None:
        node.protocol.storage.store(key_id, value, expiration)
    else:
        node.protocol.storage.store_subkey(key_id, subkey, value, expiration)
    peers = [peer for _, peer in node.protocol.routing_table.get_nearest_neighbors(key_id, k=64, exclude=node.node_id)]
    answers = await asyncio.gather(*(node.protocol.call_store(peer, [key_id], [value], [expiration], subkeys=[subkey])
                                     for peer in peers))
    return sum(bool(a and a[0]) for a in answers)


async def _dump(_dht, node, keys: list[str]) -> dict:
    """Everything the rogue's own storage holds under ``keys``, as raw bytes (what any DHT node sees)."""
    out = {}
    for key in keys:
        item = node.protocol.storage.get(DHTID.generate(key))
        if item is not None:
            value = item.value
            out[key] = {k: v for k, (v, _) in value.items()} if hasattr(value, "items") else {None: value}
    return out


async def _stored_key_ids(_dht, node) -> list[bytes]:
    return [key.to_bytes() for key, _ in node.protocol.storage.items()]


class Rogue:
    def __init__(self, initial_peers: list[str]):
        self.identity = Identity.load_or_create(None)
        self.dht = DHT(start=True, initial_peers=initial_peers, host_maddrs=LOOPBACK, identity_path=self.identity.path,
                       check_if_identity_free=False)
        self.peer_id = self.identity.peer_id

    def store_raw(self, key: str, subkey, value: bytes, expiration: float) -> int:
        return self.dht.run_coroutine(functools.partial(_store_raw, key=key, subkey=subkey, value=value,
                                                        expiration=expiration))

    def store(self, key: str, subkey, value, expiration: float) -> int:
        return self.store_raw(key, subkey, msgpack.packb(value, use_bin_type=True), expiration)

    def dump(self, keys: list[str]) -> dict:
        return self.dht.run_coroutine(functools.partial(_dump, keys=keys))

    def key_ids(self) -> list[bytes]:
        return self.dht.run_coroutine(_stored_key_ids)

    def close(self) -> None:
        self.dht.shutdown()


# -- honest trainers in threads ----------------------------------------------------------------------------

@dataclass
class Trainer:
    index: int
    swarm: Swarm
    steps: int
    wait_peers: int = 0
    stop: threading.Event = field(default_factory=threading.Event)
    step: int = 0
    digest: bytes | None = None
    error: str | None = None
    thread: threading.Thread | None = None

    def start(self, task) -> None:
        self.thread = threading.Thread(target=self._run, args=(task,), name=f"trainer{self.index}", daemon=True)
        self.thread.start()

    def _run(self, task) -> None:
        try:
            model = task.make_model(seed=0)
            opt = LionCub(model.named_parameters(), lr=1e-3, weight_decay=0.1, aggregator=self.swarm)
            self.swarm.join(opt, wait_peers=self.wait_peers, wait_timeout=60)
            x, y = task.shard(self.index % 4, 4)
            gen = torch.Generator().manual_seed(self.index)
            while opt.step_count < self.steps and not self.stop.is_set():
                idx = torch.randint(0, len(x), (32,), generator=gen)
                nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
                opt.step()  # must never raise, whatever the DHT holds
                opt.zero_grad()
                self.step = opt.step_count
                time.sleep(0.03)
            if opt.step_count == self.steps:
                self.digest = snapshot.params_digest(opt)
        except Exception as e:
            self.error = f"trainer {self.index}: {type(e).__name__}: {e}"

    def kill(self) -> None:
        """SIGKILL this peer's DHT process and daemon (no leaving record), and stop its loop."""
        self.stop.set()
        pids = [self.swarm.dht.pid] + _descendants(self.swarm.dht.pid)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@dataclass
class Outcome:
    trainers: list[Trainer]
    rogue: Rogue
    drop_seconds: float | None
    join_seconds: float | None
    killed: str
    joiner: str


def _config(run_id: str, **kwargs) -> SwarmConfig:
    return SwarmConfig(run_id, **{"host_maddrs": LOOPBACK, "allreduce": FAST, "join_timeout": 60.0,
                                  "momentum": MomentumSchedule(every=10), "record_ttl": 6.0, **kwargs})


def run_scenario(run_id: str, attack, *, secret: str | None = None, timeout: float = 240.0) -> Outcome:
    """Three peers train; the rogue attacks at ATTACK_AT; a fourth joins at JOIN_AT; peer 2 is SIGKILLed
    at KILL_AT. Once the joiner is in the group and the dead peer out of it (or time is up), every
    survivor trains to the same final step, 15 past the furthest. ``attack(rogue, trainers)`` may
    return a callable that is called every second afterwards (attacks that keep writing)."""
    task = digits_task(0, hidden=32)
    first = Trainer(0, Swarm(_config(run_id, run_secret=secret)), OPEN_END, wait_peers=3)
    peers = first.swarm.visible_maddrs()
    trainers = [first] + [Trainer(i, Swarm(_config(run_id, initial_peers=peers, run_secret=secret)), OPEN_END,
                                  wait_peers=3) for i in (1, 2)]
    rogue = Rogue(peers)
    drop_seconds = join_seconds = None
    try:
        for t in trainers:
            t.start(task)
            time.sleep(0.3)
        started, again, attacked, joined_at, killed_at = time.monotonic(), None, False, None, None
        joiner, final = None, None
        while True:
            alive = [t for t in trainers if not t.stop.is_set() and t.thread.is_alive()]
            if not alive or (final is not None and all(t.step >= final for t in alive)):
                break
            step = max(t.step for t in alive)
            if final is None and ((drop_seconds is not None and join_seconds is not None and step >= KILL_AT + 10)
                                  or time.monotonic() - started > timeout):
                final = step + 15
                for t in trainers:
                    t.steps = final
            if time.monotonic() - started > timeout + 120:
                break
            if not attacked and step >= ATTACK_AT:
                attacked = True
                again = attack(rogue, trainers)
            elif again is not None:
                again()
            if joiner is None and step >= JOIN_AT:
                joiner = Trainer(3, Swarm(_config(run_id, initial_peers=peers, run_secret=secret)), OPEN_END)
                joiner.start(task)
                trainers.append(joiner)
                joined_at = time.monotonic()
            if joiner is not None and join_seconds is None and \
                    joiner.swarm.peer_id in (first.swarm.history.latest.member_ids() if first.swarm.history.latest else []):
                join_seconds = time.monotonic() - joined_at
            if killed_at is None and step >= KILL_AT:
                trainers[2].kill()
                killed_at = time.monotonic()
            if killed_at is not None and drop_seconds is None and \
                    trainers[2].swarm.peer_id not in first.swarm.history.latest.member_ids():
                drop_seconds = time.monotonic() - killed_at
            time.sleep(1.0)
        for t in trainers:
            t.thread.join(30)
        if drop_seconds is None or join_seconds is None:  # what each peer saw, for the failure report
            for t in trainers:
                latest = t.swarm.history.latest
                print(f"trainer {t.index} {t.swarm.peer_id[:8]} step {t.step}: epoch {latest and latest.epoch} "
                      f"members {latest and [m[:8] for m in latest.member_ids()]} failures "
                      f"{ {k[:8]: v for k, v in t.swarm.failures.items()} } records {[k[:8] for k in t.swarm.records]}")
        return Outcome(trainers, rogue, drop_seconds, join_seconds, trainers[2].swarm.peer_id,
                       joiner.swarm.peer_id if joiner else "")
    finally:
        for t in trainers:
            t.stop.set()
            t.swarm.shutdown()
        rogue.close()


def _check(outcome: Outcome) -> None:
    print(f"joiner added after {outcome.join_seconds} s, killed member dropped after {outcome.drop_seconds} s")
    honest = [t for t in outcome.trainers if t.index != 2]
    assert not [t.error for t in outcome.trainers if t.error], [t.error for t in outcome.trainers]
    assert all(t.digest is not None for t in honest), [(t.index, t.step) for t in honest]  # nobody stuck
    assert len({t.digest for t in honest}) == 1  # bitwise equal parameters
    assert outcome.join_seconds is not None, "the joiner was never added"
    assert outcome.drop_seconds is not None and outcome.drop_seconds < DROP_BOUND_S, outcome.drop_seconds


# -- the attacks ---------------------------------------------------------------------------------------------

def test_forged_member_records_change_nothing_and_no_record_reveals_the_run_secret():
    """Item 1: a record under a member's subkey with weight=inf (and NaN, and a validly signed one by
    the rogue's key with a far later expiration) crashed every trainer of a private run.

    Item 8, in the same private run: public peer records carried HMAC(secret, run | peer id); "s3cret"
    fell to a word list at ~366k guesses/s. Now no DHT record or key name is a function of the secret:
    the same word-list attack, run on every byte of the run's records the rogue's DHT node holds (the
    forgeries among them), finds nothing (and finds "s3cret" in one old-style record, so the attack
    itself works)."""
    weights_seen: list[float] = []
    victim_listed: list[bool] = []
    dumped: dict = {}
    keys = [f"forge.{kind}" for kind in ("peers", "group", "manifest")]

    def attack(rogue: Rogue, trainers: list[Trainer]):
        victim = trainers[1].swarm.peer_id
        far = get_dht_time() + 10**6
        old_format = {"weight": float("inf"), "client_mode": False, "step": 12, "version": 2, "synced": True,
                      "token": b"\0" * 16}
        later = get_dht_time() + 290
        signed_by_rogue = seal(rogue.identity, "forge", "peers", later,
                               PeerRecord(victim, weight=1e6, step=12, synced=True).payload())
        # the rogue's key, but signing exactly what a record under the victim's subkey must sign
        body = canonical(PeerRecord(victim, weight=1e6, step=12, synced=True).payload())
        for_victims_subkey = {**signed_by_rogue, "p": body,
                              "s": rogue.identity.sign(signed_bytes("forge", "peers", victim, later + 1, body))}
        dumped["before"] = rogue.dump(keys)  # the victim's own record too: the forgeries shadow it on this node
        for value, expiration in ((old_format, far), ({**old_format, "weight": float("nan")}, far),
                                  (signed_by_rogue, later), (for_victims_subkey, later + 1)):
            rogue.store("forge.peers", victim, value, expiration)

        def observe():
            record = trainers[0].swarm.records.get(victim)
            if record is not None:
                weights_seen.append(record.weight)
            victim_listed.append(victim in trainers[0].swarm.history.latest.member_ids())
            dumped.update(rogue.dump(keys))
            dumped["key_ids"] = rogue.key_ids()
            dumped["peer_ids"] = [t.swarm.peer_id for t in trainers]
        return observe

    outcome = run_scenario("forge", attack, secret="s3cret")
    _check(outcome)
    assert weights_seen and set(weights_seen) == {1.0}  # the victim's own record kept being read, never the forgery
    assert victim_listed and all(victim_listed)  # its record was never shadowed: it never left the group
    _check_no_record_reveals_the_secret(dumped, "forge", keys)
    assert len(dumped["before"]["forge.peers"]) >= 3  # every trainer's own record was scanned, the victim's too


def test_undecodable_and_unkeyed_values_do_not_freeze_membership():
    """Item 2: a value hivemind cannot decode made every get of the key hang (joiners never added,
    the dead never dropped); a value stored without subkey blocks every subkey store on nodes that
    keep it; a 2**62 token made bytes(token) raise MemoryError."""
    read_times: list[float] = []

    def attack(rogue: Rogue, trainers: list[Trainer]):
        victim, far = trainers[1].swarm.peer_id, get_dht_time() + 10**6
        rogue.store_raw("freeze.peers", "junk", b"\xc1\xc1\xc1 not msgpack", far)
        rogue.store_raw("freeze.peers", victim, b"\xc1", far)
        rogue.store("freeze.peers", "big", {"weight": 1.0, "client_mode": False, "step": 1, "version": 2,
                                            "synced": True, "token": 1 << 62}, far)
        rogue.store_raw("freeze.group", None, b"\xc1 unkeyed", far)
        rogue.store_raw("freeze.manifest", None, msgpack.packb({"upload": "l1:8"}), far)

        def time_a_read():
            swarm = trainers[0].swarm
            started = time.monotonic()
            swarm.loop.run(swarm.directory.peers(), timeout=30)
            read_times.append(time.monotonic() - started)
        return time_a_read

    outcome = run_scenario("freeze", attack)
    _check(outcome)
    assert read_times and max(read_times) < 5.0, read_times  # reads still answer (the DHT timeout is 10 s)


def test_far_future_steps_cannot_freeze_group_changes():
    """Item 3: a forged step=2**62 record made the leader publish a group from step 4611686018427387907
    and stop all future group changes. Here: the forgery, a member's own signed record lying about its
    step (a million steps ahead), and the rogue's signed group record for the far future."""
    def attack(rogue: Rogue, trainers: list[Trainer]):
        victim = trainers[1].swarm
        rogue.store("future.peers", victim.peer_id, {"weight": 1.0, "client_mode": False, "step": 1 << 62,
                                                      "version": 2, "synced": True}, get_dht_time() + 10**6)

        def lie():  # the member itself (its key) claims a step far ahead, outliving its own refreshes
            exp = get_dht_time() + 120
            lying = PeerRecord(victim.peer_id, step=victim.optimizer.step_count + 10**6, synced=True,
                               manifest=victim.run_manifest.digest())
            rogue.store("future.peers", victim.peer_id, seal(victim.identity, "future", "peers", exp, lying.payload()),
                        exp)
            latest = trainers[0].swarm.history.latest
            group = GroupRecord(latest.epoch + 1, 1 << 50, latest.members + (PeerSpec(rogue.peer_id),),
                                author=rogue.peer_id)
            rogue.store("future.group", rogue.peer_id, seal(rogue.identity, "future", "group", exp, group.payload()), exp)
        lie()
        return lie

    outcome = run_scenario("future", attack)
    _check(outcome)
    steps = max(t.step for t in outcome.trainers)
    for t in outcome.trainers:
        if t.index != 2:
            # an honest group starts at most its pace's lead (0.5 s of steps) past the fastest member;
            # the lies are 10**6 and 2**50 steps ahead
            assert all(g.from_step <= steps + STEP_WINDOW for g in t.swarm.history.by_epoch.values())
            assert all(g.author != outcome.rogue.peer_id for g in t.swarm.history.by_epoch.values())


def _check_no_record_reveals_the_secret(dumped: dict, run: str, keys: list[str]) -> None:
    """The word-list attack of item 8 on what the rogue's DHT node held of ``run``'s ``keys``."""
    assert set(dumped) >= set(keys)
    # the DHT keys the run writes are the public names: nothing namespaced by the secret
    public = {DHTID.generate(k).to_bytes() for k in keys}
    assert set(dumped["key_ids"]) <= public, "a DHT key depends on something other than the run id"

    def candidates(guess: str, peer_id: str) -> set[bytes]:
        """What a guesser would compare against: the old token, and every MAC a run key could make."""
        old = hmac.new(guess.encode(), f"lioncub-admission|{run}|{peer_id}".encode(), hashlib.sha256).digest()
        key = run_key(guess.encode(), run)
        new = hmac.new(key, b"|".join([b"lioncub-token", run.encode(), peer_id.encode()]), hashlib.sha256).digest()
        raw = {old[:16], new[:16], new, key, guess.encode()}
        return raw | {r.hex().encode() for r in raw}  # hex, as a JSON payload would carry it

    def found_in(blobs: list[bytes]) -> set[str]:
        hits = set()
        for guess in WORDS:
            for peer_id in dumped["peer_ids"]:
                if any(c in blob for c in candidates(guess, peer_id) for blob in blobs):
                    hits.add(guess)
        return hits

    dumps = (dumped, dumped.get("before", {}))  # what the node held at the end, and before any forgery
    blobs = [bytes(v) for dump in dumps for key in keys for v in dump.get(key, {}).values()]
    blobs += [bytes(field) for blob in blobs for value in [msgpack.unpackb(blob, raw=False)] for field in value.values()
              if isinstance(value, dict) and isinstance(field, bytes)]
    assert blobs and found_in(blobs) == set()
    victim = dumped["peer_ids"][0]  # the attack works: it finds the secret in an old-style record at once
    old_token = hmac.new(b"s3cret", f"lioncub-admission|{run}|{victim}".encode(), hashlib.sha256).digest()[:16]
    assert found_in([msgpack.packb({"weight": 1.0, "token": old_token})]) == {"s3cret"}
