"""Swarm: a volunteer's membership in a run, and the aggregator its LionCub optimizer votes through.

    swarm = Swarm("my-run", initial_peers=["/ip4/1.2.3.4/tcp/31337/p2p/Qm..."])
    opt = LionCub(model.parameters(), lr=3e-4, aggregator=swarm)
    swarm.join(opt)                      # starts the run, or downloads the swarm's state
    for x, y in data:                    # an ordinary training loop
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    swarm.shutdown()

Every step: this peer votes in the round of its step with the group the DHT names for that step,
sending a digest of its parameters along. If most voters' digest differs from its own, it diverged
(it missed a result, or a bit flipped): it downloads the state of the next step from a member and
carries on. After the update: momenta are averaged on the schedule (bf16, trimmed mean by default;
a failed sync is logged and skipped), snapshots are made for peers that asked, checkpoints written.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from hivemind import DHT

from .. import failpoints
from ..aio import BackgroundLoop
from ..allreduce import AllReduceConfig, PeerSpec, RoundReport, RoundSpec, VoteNode
from ..allreduce.admission import Admission
from ..allreduce.allgather import GatherNode
from ..codecs import AverageResult, Bf16Upload, result_codec, upload_codec
from ..momentum import MomentumSchedule
from ..optim import LionCub
from ..wire import PROTOCOL_VERSION
from . import checkpoint, snapshot
from .membership import Directory, GroupHistory, GroupRecord, PeerRecord
from .probe import serve_probe
from .state_transfer import StateServer, download_state

logger = logging.getLogger(__name__)


SYNC_GRACE_ROUNDS = 30  # rounds a joining member may miss before it is dropped
DROP_AFTER_S = 5.0  # ...and seconds any member may miss rounds: fast rounds must not drop a peer that is starting up


class SwarmError(RuntimeError):
    """Something a volunteer has to act on (unreachable coordinators, version mismatch, ...)."""


@dataclass
class SwarmConfig:
    """Knobs of a swarm member. Timeouts are in seconds."""

    run_id: str
    initial_peers: list[str] = field(default_factory=list)
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    announce_maddrs: list[str] = field(default_factory=list)
    identity_path: str | None = None
    client_mode: bool = False  # behind NAT: dial out only, reduce nothing
    weight: float = 1.0  # share of the reduction work (e.g. upload Mbit/s)
    nat_probing: bool = False  # UPnP / AutoNAT probing of the real network card
    upload: str = "sign"
    result: str = "majority"
    transport: str = "butterfly"  # or "allgather": D-Lion's all-gather of every vote (a baseline)
    momentum: MomentumSchedule = field(default_factory=lambda: MomentumSchedule(every=20))
    momentum_rule: str = "trimmed_mean"  # or "average"
    allreduce: AllReduceConfig = field(default_factory=AllReduceConfig)
    lead_steps: int = 3  # a new group takes effect this many steps after the leader decides it
    record_ttl: float = 10.0
    refresh_period: float = 0.5
    full_digest_every: int = 10  # the state tag hashes every parameter byte on these steps
    audit_every: int = 5  # every this many rounds one sampled part is reduced twice (0: never)
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    max_state_uploads: int = 2
    join_timeout: float = 120.0
    run_secret: str | None = None  # admission: only peers knowing it vote, reduce, serve state, average
    allow_peers: list[str] = field(default_factory=list)  # admission: only these peer ids (if given)
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.run_id or "." in self.run_id:
            raise ValueError(f"run_id must be a non-empty name without dots, got {self.run_id!r}")
        if self.transport not in ("butterfly", "allgather"):
            raise ValueError(f"transport must be butterfly or allgather, got {self.transport!r}")


@dataclass
class StepStats:
    step: int = 0
    peers: int = 0  # voters counted in this peer's view of the round
    group_size: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    seconds: float = 0.0  # the whole aggregate call
    round_s: float = 0.0  # the vote round alone (votes, reduction, results)
    wait_s: float = 0.0  # of which idle: own uploads done, no result byte yet (waiting for others)
    bits_per_param: float = 0.0
    repaired: bool = False
    momentum_synced: bool = False


class Swarm:
    def __init__(self, config: SwarmConfig | None = None, **kwargs):
        self.config = config = config or SwarmConfig(**kwargs)
        self.upload = upload_codec(config.upload)
        self.result = result_codec(config.result)
        self.loop = BackgroundLoop(f"swarm-{config.run_id}")
        self.history = GroupHistory()
        self._refused: set[str] = set()  # peers (and "group") already warned about
        self.records: dict[str, PeerRecord] = {}
        self.failures: Counter[str] = Counter()  # rounds in a row a member was not counted...
        self.failing_since: dict[str, float] = {}  # ...since when
        self.disputes: dict[str, set[str]] = {}  # peer -> the peers whose results disagreed with its own
        self.evicted: dict[str, float] = {}  # dropped peer -> expiry of its record when it was dropped
        self.optimizer: LionCub | None = None
        self.stats = StepStats()
        self.repairs = 0
        self.last_report: RoundReport | None = None
        self.__synced = False
        self._refresher: asyncio.Task | None = None
        self._progress = (time.monotonic(), 0)  # (time, step) at the last announcement, for samples/s
        self._published = 0.0
        # Held by the training thread from aggregate() to the end of after_step(): a snapshot taken
        # under it is a state between steps.
        self._step_lock = threading.Lock()
        self._in_step = False
        self._idle = True  # not stepping yet (joining, waiting for peers): group changes can take effect at once
        self.samples_per_step = 0  # set by the training loop, for monitors
        self.last_loss: float | None = None
        try:
            self.dht = DHT(start=True, initial_peers=config.initial_peers, host_maddrs=config.host_maddrs,
                           announce_maddrs=config.announce_maddrs or None, identity_path=config.identity_path,
                           client_mode=config.client_mode, no_listen=config.client_mode,
                           nat_port_map=config.nat_probing, auto_nat=config.nat_probing)
        except Exception as e:
            self.loop.stop()
            raise SwarmError(f"could not start the DHT ({e}); check --initial-peers and that the coordinators "
                             f"are reachable") from e
        self.p2p = self.loop.run(self.dht.replicate_p2p(), timeout=30)
        self.peer_id = self.p2p.peer_id.to_base58()
        self.admission = Admission(config.run_id, config.run_secret.encode() if config.run_secret else None,
                                   frozenset(config.allow_peers))
        namespace = hashlib.blake2b(config.run_secret.encode(), digest_size=6).hexdigest() if config.run_secret else ""
        self.directory = Directory(self.dht, config.run_id, namespace)
        self.node = VoteNode(self.p2p, config.allreduce, self.admission)
        self.gather = GatherNode(self.p2p, config.allreduce, self.admission) if config.transport == "allgather" else None
        self.state_server = StateServer(self.p2p, config.run_id, max_uploads=config.max_state_uploads,
                                        provider=self._snapshot_between_steps, admission=self.admission)
        self._synced = False  # the state server serves only once this peer holds the swarm's state
        self.loop.run(self._start_services(), timeout=30)
        self._round = ("vote", 0)  # the kind and step of the round in progress, for failpoints
        if failpoints.ARMED is not None:
            self.node.on_event.append(self._failpoint)

    def _failpoint(self, event: str) -> None:
        kind, step = self._round
        point = {"vote_chunk": "momentum" if kind == "momentum" else "upload", "finalize": "reduce",
                 "result_chunk": "result"}.get(event)
        if point is not None and (kind == "vote" or point == "momentum"):
            failpoints.reached(point, step)

    @property
    def _synced(self) -> bool:
        """This peer holds the swarm's state: it may vote, serve snapshots and say so in its record."""
        return self.__synced

    @_synced.setter
    def _synced(self, value: bool) -> None:
        self.__synced = value
        if hasattr(self, "state_server"):
            self.state_server.serving = value

    async def _start_services(self) -> None:
        await self.node.start()
        await serve_probe(self.p2p, self.admission)
        if self.gather is not None:
            await self.gather.start()
        await self.state_server.start()

    # -- joining ---------------------------------------------------------------------------------

    def join(self, optimizer: LionCub, timeout: float | None = None) -> int:
        """Become a voting member: resume a checkpoint, then start the run or fetch the swarm's state.
        Returns the step training continues from."""
        if optimizer.aggregator is not self:
            raise ValueError("create the optimizer with aggregator=<this swarm>")
        self.optimizer = optimizer
        if self.config.checkpoint_dir:
            restored = checkpoint.restore(self.config.checkpoint_dir, optimizer)
            if restored is not None:
                logger.info("resumed checkpoint at step %d", restored)
        self._start_step = optimizer.step_count  # before any download: where this peer came in
        self._refresher = asyncio.run_coroutine_threadsafe(self._refresh_forever(), self.loop.loop)
        deadline = time.monotonic() + (timeout or self.config.join_timeout)
        self.loop.run(self._refresh_group(), timeout=30)
        if self.history.latest is None:
            time.sleep(1.0)  # a group record stored moments ago may not have reached us yet
            self.loop.run(self._refresh_group(), timeout=30)
        founded = False
        if self.history.latest is None:
            self._check_not_locked_out()
            founded = self._found()
        latest = self.history.latest
        if self.peer_id not in latest.member_ids():
            self._sync_from_swarm(deadline)
        elif not founded:  # the leader may list a peer as soon as it announces: being listed is not holding the state
            self._download(min_step=latest.from_step, group=latest)
        self._synced = True
        self.loop.run(self._announce(), timeout=30)
        self._prepare(optimizer.step_count)
        return optimizer.step_count

    def wait_for_peers(self, count: int, timeout: float = 300.0) -> None:
        """Block until the group has ``count`` members holding the swarm's state (all start together).

        Returns at once when others trained past the step this peer came in at: a peer that comes back
        to a run in progress must step with the group, not wait for a start that happened long ago."""
        deadline = time.monotonic() + timeout
        self.records = self.loop.run(self.directory.peers(), timeout=30)
        while True:
            if any(r.step > self._start_step for pid, r in self.records.items() if pid != self.peer_id):
                return
            latest = self.history.latest
            synced = {pid for pid, r in self.records.items() if r.synced} | {self.peer_id}
            settled = latest is not None and all(  # every member synced, and the group says so (weights back)
                m.peer_id in synced and (m.reduces or m.client_mode or self.records.get(m.peer_id, m).weight == 0)
                for m in latest.members)
            if settled and len(latest.members) >= count and latest.from_step <= self.optimizer.step_count:
                return
            if time.monotonic() > deadline:
                raise SwarmError(f"only {len(latest.members) if latest else 0} of {count} peers joined in time")
            time.sleep(self.config.refresh_period)

    def _check_not_locked_out(self) -> None:
        """Peers of this run are around but none shares our secret: founding a group of our own would
        only train alone. Say so."""
        self.records = self.loop.run(self.directory.peers(), timeout=30)
        others = [r for pid, r in self.records.items() if pid != self.peer_id]
        if others and not self.admission.open and not any(self.admission.admits(r.peer_id, r.token) for r in others):
            raise SwarmError(f"{len(others)} peers of run {self.config.run_id} are online but none shares this "
                             f"peer's run secret: check --run-secret (or the allow-list)")

    def _found(self) -> bool:
        """Publish a group of this peer alone; True if it is the group the DHT kept."""
        step = self.optimizer.step_count
        record = self._signed(GroupRecord(0, step, (self._my_spec(),)))
        self.loop.run(self.directory.publish_group(record, ttl=60.0), timeout=30)
        time.sleep(0.5)  # let a concurrent founder's record land too; the DHT keeps one of them
        self.loop.run(self._refresh_group(), timeout=30)
        started = self.history.latest.epoch == 0 and self.history.latest.member_ids() == [self.peer_id]
        logger.info("no group found for run %s: %s", self.config.run_id, "started it" if started else "another peer did")
        return started

    def _sync_from_swarm(self, deadline: float) -> None:
        """Wait until the leader adds this peer to a group, then download the state of that step."""
        logger.info("waiting to be added to the group of run %s", self.config.run_id)
        while True:
            latest = self.history.latest
            if latest is not None and self.peer_id in latest.member_ids():
                break
            if time.monotonic() > deadline:
                raise SwarmError("no group took this peer in time. Is the run alive? Is --run-secret the run's? "
                                 f"Does the run speak protocol version {PROTOCOL_VERSION} (upgrade lioncub-p2p if not)?")
            self.loop.run(self._announce(), timeout=30)
            time.sleep(self.config.refresh_period)
        self._download(min_step=latest.from_step, group=latest)

    def _download(self, min_step: int, group: GroupRecord) -> None:
        members = [m for m in group.members if m.peer_id != self.peer_id and not m.client_mode]
        # the fastest donors first; ties in random order so newcomers spread
        members.sort(key=lambda m: (-self._weight_of(m), random.random()))
        donors = [m.peer_id for m in members]
        synced = [pid for pid in donors if pid in self.records and self.records[pid].synced]
        donors = synced or donors  # peers that are joining themselves hold nothing to give
        have = (self.optimizer.step_count, snapshot.params_digest(self.optimizer))
        step, blob, digest = self.loop.run(download_state(
            self.p2p, donors, self.config.run_id, min_step=min_step, max_bytes=snapshot.max_size(self.optimizer),
            have=have, token=self.admission.token(self.peer_id)), timeout=self.config.join_timeout)
        if not blob:
            logger.info("this peer already holds the swarm's state (step 0, same initialization)")
            return
        snapshot.load(self.optimizer, blob, expect_digest=digest)
        logger.info("loaded the swarm's state at step %d (%.1f MB)", step, len(blob) / 1e6)

    def _weight_of(self, member: PeerSpec) -> float:
        """A member's announced bandwidth weight (its group weight is 0 while it syncs)."""
        return self.records[member.peer_id].weight if member.peer_id in self.records else member.weight

    def _my_spec(self) -> PeerSpec:
        return PeerSpec(self.peer_id, self.config.weight, self.config.client_mode)

    # -- rounds ------------------------------------------------------------------------------------

    def _spec(self, group: GroupRecord, step: int, kind: str = "vote") -> RoundSpec:
        rid = hashlib.blake2b(f"{self.config.run_id}|{kind}|{step}|{group.epoch}".encode(), digest_size=16).digest()
        if kind == "vote":
            audit = bool(self.config.audit_every) and step % self.config.audit_every == 0
            return RoundSpec(rid, step, group.members, self.optimizer.buffer_bytes, self.upload, self.result,
                             self.config.seed, audit=audit and self.gather is None)
        numel = sum(m.numel() for name, m in self.optimizer.momentum_buffers() if self.config.momentum.selects(name))
        return RoundSpec(rid, step, group.members, 2 * numel, Bf16Upload(),
                         AverageResult(trimmed=self.config.momentum_rule == "trimmed_mean"), self.config.seed)

    def _prepare(self, step: int) -> None:
        """Let this peer's reducer count others' votes for ``step`` while it still computes."""
        group = self.history.for_step(step)
        if group is not None and self.peer_id in group.member_ids() and self.gather is None:
            spec = self._spec(group, step)

            def prepare() -> None:
                try:
                    self.node.prepare_round(spec)
                except ValueError as e:  # already run (a repeated step after a repair): nothing to prepare
                    logger.debug("not preparing step %d: %s", step, e)

            self.loop.call_soon(prepare)

    def _enter_step(self) -> None:
        if not self._in_step:  # still held if an earlier step stopped between aggregate and after_step
            self._step_lock.acquire()
            self._in_step = True

    def _exit_step(self) -> None:
        if self._in_step:
            self._in_step = False
            self._step_lock.release()

    def _snapshot_between_steps(self, min_step: int) -> tuple[int, bytes, bytes] | None:
        """For the state server, from its worker thread: this peer's state if it is between steps."""
        if self.optimizer is None or not self._synced or not self._step_lock.acquire(timeout=0.2):
            return None
        try:
            if self.optimizer.step_count < min_step:
                return None
            blob, digest = snapshot.encode(self.optimizer)
            return self.optimizer.step_count, blob, digest
        finally:
            self._step_lock.release()

    def aggregate(self, upload: torch.Tensor, *, step: int) -> torch.Tensor | None:
        if self.optimizer is None:
            raise SwarmError("call swarm.join(optimizer) before training")
        self._enter_step()
        self._idle = False
        started = time.perf_counter()
        self.stats = StepStats(step=step)
        group = self.history.for_step(step)
        if group is None or self.peer_id not in group.member_ids():
            logger.warning("step %d: this peer is not in the group (dropped after a stall?): rejoining", step)
            try:
                self._rejoin()
            except Exception as e:  # keep the training loop alive; the next step tries again
                logger.warning("rejoining failed: %s", e)
            return None
        spec = self._spec(group, step)
        tag = snapshot.state_tag(self.optimizer, full=step % self.config.full_digest_every == 0)
        cfg = self.config.allreduce
        timeout = cfg.result_timeout + cfg.recovery_timeout + 30
        try:
            node = self.gather or self.node
            self._round = ("vote", step)
            update, report = self.loop.run(node.run_round(spec, upload, tag), timeout=timeout)
        except Exception as e:  # never into the training loop: apply nothing; the digest repairs us next step
            logger.warning("step %d: the vote round failed (%s: %s); applying no update", step, type(e).__name__, e)
            self._prepare(step + 1)
            return torch.zeros(self.optimizer.buffer_bytes * 8)
        self._observe(spec, report, started)
        if report.group_epoch > self.history.latest.epoch:  # a group change we have not seen: fetch it now
            try:
                self.loop.run(self._refresh_group(), timeout=10)
            except Exception as e:
                logger.info("group refresh failed: %s", e)
        consensus, votes = report.consensus_tag()
        all_votes = sum(p.tag_votes for p in report.parts if p.status in ("ok", "recovered"))
        if votes * 2 > all_votes and consensus != tag:
            logger.warning("step %d: parameters differ from %d of %d votes: repairing from a peer", step, votes,
                           all_votes)
            try:
                self._download(min_step=step + 1, group=group)
            except Exception as e:  # apply nothing: still diverged, so the next round tries again
                logger.warning("step %d: repair failed (%s); retrying next step", step, e)
                self._prepare(step + 1)
                return torch.zeros(self.optimizer.buffer_bytes * 8)
            self.repairs += 1
            self.stats.repaired = True
            self._prepare(self.optimizer.step_count)
            return None
        self._prepare(step + 1)
        return update

    def _rejoin(self) -> None:
        self._synced = False
        self._sync_from_swarm(time.monotonic() + self.config.join_timeout)
        self._synced = True
        self._prepare(self.optimizer.step_count)

    def suspects(self) -> set[str]:
        """Peers caught in audit mismatches with at least two different partners: lying reducers."""
        return {pid for pid, partners in self.disputes.items() if len(partners) >= 2}

    def _observe(self, spec: RoundSpec, report: RoundReport, started: float) -> None:
        self.last_report = report
        if report.audit is not None and report.audit[2] == "mismatch":
            reducer, auditor = (spec.group[i].peer_id for i in report.audit[:2])
            self.disputes.setdefault(reducer, set()).add(auditor)
            self.disputes.setdefault(auditor, set()).add(reducer)
        received = [p for p in report.parts if p.status in ("ok", "recovered")]
        counted = set().union(*(set(p.counted) for p in received)) if received else set()
        for i, member in enumerate(spec.group):
            if member.peer_id != self.peer_id:
                if i in counted:
                    self.failures[member.peer_id] = 0
                    self.failing_since.pop(member.peer_id, None)
                else:
                    self.failures[member.peer_id] += 1
                    self.failing_since.setdefault(member.peer_id, time.monotonic())
        numel = sum(s.param.numel() for s in self.optimizer.slots)
        self.stats.peers = max((len(p.counted) for p in received), default=0)
        self.stats.group_size = len(spec.group)
        self.stats.bytes_up, self.stats.bytes_down = report.bytes_up, report.bytes_down
        self.stats.bits_per_param = 8 * (report.bytes_up + report.bytes_down) / max(numel, 1)
        self.stats.seconds = time.perf_counter() - started
        timings = report.timings
        self.stats.round_s = timings.get("total", 0.0)
        if "first_result" in timings:
            self.stats.wait_s = max(timings["first_result"] - timings.get("upload", 0.0), 0.0)

    def after_step(self, optimizer: LionCub) -> None:
        try:
            step = optimizer.step_count
            if self.config.momentum.due(step):
                self.stats.momentum_synced = self._average_momentum(step)
            wanted = self.state_server.wanted_step()
            if wanted is not None and wanted <= step:
                blob, digest = snapshot.encode(optimizer)
                self.loop.run(self.state_server.offer(step, blob, digest), timeout=30)
            if self.config.checkpoint_dir and self.config.checkpoint_every and step % self.config.checkpoint_every == 0:
                checkpoint.save(self.config.checkpoint_dir, optimizer)
        finally:
            self._exit_step()

    def _average_momentum(self, step: int) -> bool:
        """One bf16 averaging round over the selected momenta; parts nobody received stay local."""
        group = self.history.for_step(step - 1)
        if group is None or self.peer_id not in group.member_ids():
            return False
        selected = [m for name, m in self.optimizer.momentum_buffers() if self.config.momentum.selects(name)]
        spec = self._spec(group, step, kind="momentum")
        flat = torch.cat([m.detach().reshape(-1).float() for m in selected])
        self._round = ("momentum", step)
        try:
            averaged, report = self.loop.run(self.node.run_round(spec, Bf16Upload().encode(flat)),
                                             timeout=self.config.allreduce.result_timeout + 30)
        except Exception as e:
            logger.warning("step %d: momentum averaging failed, skipped: %s", step, e)
            return False
        if report.missing_parts:
            logger.warning("step %d: momentum averaging missed parts %s; they stay local", step, report.missing_parts)
        keep = torch.isnan(averaged)
        averaged[keep] = flat[keep]
        offset = 0
        with torch.no_grad():
            for m in selected:
                m.copy_(averaged[offset : offset + m.numel()].view_as(m))
                offset += m.numel()
        return not report.missing_parts

    # -- membership upkeep (background) -------------------------------------------------------------

    async def _refresh_forever(self) -> None:
        last_announce = 0.0
        while True:
            try:
                await self._refresh_group()
                self.records = await self.directory.peers()
                if time.monotonic() - last_announce > self.config.record_ttl / 3:
                    await self._announce()
                    last_announce = time.monotonic()
                await self._lead()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                logger.debug("membership refresh failed: %s", e)
            await asyncio.sleep(self.config.refresh_period)

    async def _refresh_group(self) -> None:
        record = await self.directory.group()
        if record is not None and not self.admission.verifies(record.content(), record.proof):
            if "group" not in self._refused:
                self._refused.add("group")
                logger.warning("ignoring a group record of run %s not signed with this run's secret",
                               self.config.run_id)
            record = None
        self.history.add(record)
        if self.history.latest is not None:
            self.node.group_epoch = self.history.latest.epoch

    async def _announce(self) -> None:
        step = self.optimizer.step_count if self.optimizer is not None else 0
        now, (t0, step0) = time.monotonic(), self._progress
        rate = lambda amount: amount / max(now - t0, 1e-6)  # noqa: E731
        record = PeerRecord(self.peer_id, self.config.weight, self.config.client_mode, step, PROTOCOL_VERSION,
                            self._synced, samples_per_s=self.samples_per_step * rate(step - step0),
                            bytes_up_per_s=self.stats.bytes_up / max(self.stats.seconds, 1e-6),
                            bytes_down_per_s=self.stats.bytes_down / max(self.stats.seconds, 1e-6), loss=self.last_loss,
                            token=self.admission.token(self.peer_id))
        self._progress = (now, step)
        await self.directory.announce(record, ttl=self.config.record_ttl)

    async def _lead(self) -> None:
        """If this peer leads the group, keep it equal to the live, admitted, compatible peers.

        A member that is still downloading the swarm's state votes with weight 0 (it reduces no part,
        so nobody waits for its part); it gets its weight once its record says it is synced. A member
        that was not counted in two rounds in a row, for at least ``DROP_AFTER_S``, is dropped; one still
        syncing gets ``SYNC_GRACE_ROUNDS`` before that; a peer caught lying by audits is dropped at once."""
        latest = self.history.latest
        if latest is None or self.optimizer is None or not self._synced:
            return
        alive = set(self.records) | {self.peer_id}
        syncing = {pid for pid, r in self.records.items() if not r.synced}
        suspects = self.suspects()

        def healthy(pid: str) -> bool:
            if pid in suspects:
                return False
            limit = SYNC_GRACE_ROUNDS if pid in syncing else 2
            recent = time.monotonic() - self.failing_since.get(pid, time.monotonic()) < DROP_AFTER_S
            return pid == self.peer_id or (pid in alive and (self.failures[pid] < limit or recent))

        def spec(pid: str, weight: float, client_mode: bool) -> PeerSpec:
            return PeerSpec(pid, 0.0 if pid in syncing else weight, client_mode)

        leader = next((m.peer_id for m in latest.members if m.reduces and healthy(m.peer_id)), None)
        step = self.optimizer.step_count
        if leader != self.peer_id or step < latest.from_step:
            return
        known = {m.peer_id for m in latest.members}
        dropped = [m for m in latest.members if not healthy(m.peer_id)]
        keep = [spec(m.peer_id, self._weight_of(m), m.client_mode) for m in latest.members if m not in dropped]
        for m in dropped:  # remember what the record of a dropped member said when it was dropped
            if m.peer_id in self.records:
                self.evicted[m.peer_id] = self.records[m.peer_id].expires
        # a dropped peer comes back only with a record announced since (a dead peer's record lingers
        # until it expires; re-adding it would make the group flap)
        new = [spec(r.peer_id, r.weight, r.client_mode) for r in self.records.values()
               if r.peer_id not in known and r.version == PROTOCOL_VERSION and self._admits(r)
               and r.expires > self.evicted.get(r.peer_id, 0.0) and r.peer_id not in suspects]
        for m in new:  # a returning peer starts with a clean slate
            self.failures[m.peer_id] = 0
            self.failing_since.pop(m.peer_id, None)
        desired = tuple(sorted(keep + new, key=lambda m: m.peer_id))
        if set(desired) == set(latest.members) or not any(m.reduces for m in desired):
            if time.monotonic() - self._published > 20.0:  # keep the record from expiring
                self._published = time.monotonic()
                await self.directory.publish_group(latest, ttl=60.0)
            return
        ahead = max([step] + [r.step for r in self.records.values() if r.peer_id in known])  # the fastest member
        lead = 0 if self._idle and ahead == step else self.config.lead_steps  # nobody steps yet: at once
        record = self._signed(GroupRecord(latest.epoch + 1, ahead + lead, desired, previous=latest))
        if await self.directory.publish_group(record, ttl=60.0):
            self._published = time.monotonic()
            self.history.add(record)
            self.node.group_epoch = record.epoch
            logger.info("group epoch %d from step %d: %d members (+%d, -%d), %d reducing", record.epoch,
                        record.from_step, len(desired), len(new), len(dropped),
                        sum(m.reduces for m in desired))

    def _signed(self, record: GroupRecord) -> GroupRecord:
        return GroupRecord(record.epoch, record.from_step, record.members, record.previous,
                           self.admission.sign(record.content()))

    def _admits(self, record: PeerRecord) -> bool:
        refused = self.admission.reason(record.peer_id, record.token)
        if refused and record.peer_id not in self._refused:
            self._refused.add(record.peer_id)
            logger.warning("peer %s asked to join but is refused: %s", record.peer_id, refused)
        return refused is None

    # -- leaving -----------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Leave the run: stop serving, close the daemon. Safe to call twice."""
        if self._refresher is not None:
            self._refresher.cancel()
            self._refresher = None
        if self.loop is not None:
            try:
                self.loop.stop()
            finally:
                self.loop = None
                self.dht.shutdown()

    def __enter__(self) -> "Swarm":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
