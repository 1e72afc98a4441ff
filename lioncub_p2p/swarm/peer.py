"""Swarm: a volunteer's membership in a run, and the aggregator its LionCub optimizer votes through.

    swarm = Swarm("my-run", initial_peers=["/ip4/1.2.3.4/tcp/31337/p2p/Qm..."])
    model = build_model(swarm.manifest)  # the run's settings, adopted where this peer has no opinion
    opt = LionCub(model.named_parameters(), lr=3e-4, aggregator=swarm)
    swarm.join(opt)                      # starts the run, or downloads the swarm's state
    for x, y in data:                    # an ordinary training loop
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    swarm.shutdown()                     # tells the group at once, stops the DHT and its daemon

Starting: the peer runs with a libp2p identity (a file, or a fresh key in a private temporary
directory), reads the run's signed group and manifest records, and asks the group's author to admit
it (``admit.py``): a private run's members and newcomers prove the run key to each other there, and
a refused peer stops at once with one line (``AdmissionRefused``). It adopts the run's manifest
where its config has no opinion (None) and stops with one line where it differs (``ManifestMismatch``).

Every step: this peer votes in the round of its step with the group it accepted for that step,
sending a digest of its parameters along. If most voters' digest differs from its own, it diverged
(it missed a result, or a bit flipped): it downloads the state of the next step from a member and
carries on. After the update: momenta are averaged on the schedule (bf16, trimmed mean by default;
a failed sync is logged and skipped), snapshots are made for peers that asked, checkpoints written.
Anything that goes wrong in a round is a missed round (a zero update, repaired by the digest if it
split anyone), never an exception out of ``optimizer.step()``.

Threads. The *training thread* (join, ``submit``/``wait``, ``after_step``, ``linger``, ``shutdown``)
owns the optimizer's state and the per-step fields (``stats``, ``repairs``, ``skips``, ``follow``,
``missed_rounds``, ``last_report``, ``stranded``; the loop reads ``follow.following`` to announce
it); it holds ``_step_lock`` from ``before_step`` to the end of ``after_step``. The *event loop*
(``self.loop``: membership upkeep, leading, every stream handler, ``Verdicts``) owns ``history``
(published whole, ``GroupHistory``), ``evicted``, ``admitted`` and the records it refreshes; the
training thread reads them, and replaces ``records`` only with a fresh read made on the loop. The
state server's *worker thread* only reads, under ``_step_lock`` (``_snapshot_between_steps``).
``failures``/``failing_since`` are shared: counted by the training thread from its round reports,
read and reset for a returning peer by the leader on the loop, one key at a time (atomic under the
GIL; a lost count delays a drop by a round at most).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import logging
import os
import random
import signal
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch
from hivemind import DHT
from hivemind.utils import get_dht_time

from .. import failpoints
from ..aio import BackgroundLoop
from ..allreduce import AllReduceConfig, PeerSpec, RoundReport, RoundSpec, VoteNode
from ..allreduce.admission import Admission
from ..allreduce.allgather import GatherNode
from ..allreduce.audit import MAX_EVIDENCE_BYTES
from ..allreduce.commit import MAX_HEADER_BYTES, MAX_LEAF_BYTES, leaf_bytes
from ..codecs import result_codec, upload_codec
from ..identity import Identity, Verifier
from ..momentum import MomentumSchedule
from ..optim import LionCub, Resolved
from ..wire import PROTOCOL_VERSION
from . import checkpoint, manifest as manifests, reachability, snapshot
from .accuse import Accusation, AccuseServer, Refused, Suspicions, send_accusation
from .admit import AdmitServer, ask_admission
from .follow import FollowRule
from .manifest import DEFAULTS, Manifest, ManifestError, ManifestMismatch
from .lead import Health, leader_of, plan_group
from .membership import (Directory, GroupHistory, GroupRecord, PeerRecord, announced_step, assigned_weight, next_group,
                         reducer_floor)
from .momentum_sync import MomentumSync
from .probe import serve_probe
from .records import RateLimitedLog, RunRecordValidator
from .state_transfer import StateServer, download_state
from .verdicts import Verdicts

logger = logging.getLogger(__name__)


STRANDED_AFTER_S = 30.0  # with no live peer that can count votes for this long, a peer that cannot lead stops
SKIP_TRIES = 3  # failed state downloads in a row after which a follower that fell out stops
STEP_WINDOW = 100  # steps a member's announced step may lead the leader's and still count (forged far-future steps)
MAX_CANDIDATES = 8  # group records a newcomer asks for admission, most populated first
MAX_RECORD_TTL = 300.0
ROUND_KINDS = ("vote", "momentum")
# TCP and QUIC on every interface, ports chosen by the OS. Over QUIC a stream closed right after its
# last write loses that write, so every handler here that ends a stream with a reply waits (bounded)
# for the reader to close first (wire.close_after_reply; tests/test_transfer.py)
LISTEN_ALL = ["/ip4/0.0.0.0/tcp/0", "/ip4/0.0.0.0/udp/0/quic-v1"]


class SwarmError(RuntimeError):
    """Something a volunteer has to act on (unreachable coordinators, version mismatch, ...); one line."""


class AdmissionRefused(SwarmError):
    """The run's group refused this peer (wrong or missing run secret, not on the allow-list)."""


class SettingsMismatch(SwarmError):
    """This peer's settings or model differ from the run's manifest."""


@dataclass
class SwarmConfig:
    """Knobs of a swarm member. Timeouts are in seconds.

    Settings every peer of a run must share (``upload`` ... ``seed``, and ``manifest`` for the
    trainer's: task, lr, batch size, ...) default to None: adopt the run's manifest (the library
    defaults when founding a run); a value given is an opinion the run must share, else joining stops
    with one line naming the field."""

    run_id: str
    initial_peers: list[str] = field(default_factory=list)
    host_maddrs: list[str] = field(default_factory=lambda: list(LISTEN_ALL))  # all interfaces, TCP and QUIC
    announce_maddrs: list[str] = field(default_factory=list)
    identity_path: str | None = None  # None: a fresh key in a private temporary directory
    # "auto": ask the initial peers whether they can dial this machine (reachability.py): client mode if
    # not, the observed address announced behind a 1:1 NAT; True: client mode (dial out only, vote, reduce
    # nothing, serve no state); False: listen as configured
    client_mode: bool | str = "auto"
    weight: float = 1.0  # share of the reduction work (e.g. upload Mbit/s)
    nat_probing: bool = False  # UPnP / AutoNAT probing of the real network card
    upload: str | None = None  # "sign", "l1:BITS"
    result: str | None = None  # "majority", "ternary", "mean"
    transport: str | None = None  # "butterfly", or "allgather": D-Lion's all-gather of every vote (a baseline)
    momentum: MomentumSchedule | None = None  # default every 20 steps
    momentum_rule: str | None = None  # "trimmed_mean" (default) or "average"
    full_digest_every: int | None = None  # the state tag hashes every parameter byte on these steps (default 10)
    seed: int | None = None  # keys the shared random bits of rounds (default 0)
    # 1: overlapped rounds, the vote of step t travels during step t + 1's forward/backward and is applied
    # then (LionCub's docstring); 0 (default): each step waits for its own vote
    delay: int | None = None
    manifest: Manifest | None = None  # opinions on the trainer's settings (task, lr, batch size, ...)
    allreduce: AllReduceConfig = field(default_factory=AllReduceConfig)
    lead_steps: int = 3  # a new group takes effect this many steps after the leader decides it
    record_ttl: float = 10.0
    refresh_period: float = 0.5
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    max_state_uploads: int = 2
    join_timeout: float = 120.0
    run_secret: str | None = None  # admission: only peers knowing it vote, reduce, serve state, average
    allow_peers: list[str] = field(default_factory=list)  # admission: only these peer ids (if given)

    def __post_init__(self) -> None:
        if not self.run_id or "." in self.run_id:
            raise ValueError(f"run_id must be a non-empty name without dots, got {self.run_id!r}")
        if not 0 < self.record_ttl <= MAX_RECORD_TTL:
            raise ValueError(f"record_ttl must be in (0, {MAX_RECORD_TTL:.0f}] s, got {self.record_ttl}")
        if not self.weight >= 0 or self.weight > 1e6:
            raise ValueError(f"weight must be in [0, 1e6], got {self.weight}")
        if self.client_mode not in (True, False, "auto"):
            raise ValueError(f"client_mode must be True, False or 'auto', got {self.client_mode!r}")
        self.opinions()  # checks every setting given (ManifestError, a ValueError, names the field)

    def opinions(self) -> Manifest:
        """What this config says about the run's manifest (None where it has no opinion)."""
        own = Manifest(**{name: getattr(self, name) for name in manifests.SWARM_FIELDS if getattr(self, name) is not None})
        base = self.manifest or Manifest()
        clash = base.conflicts(own)
        if clash:
            raise ManifestError(f"{clash[0][0]} is set differently in SwarmConfig and in SwarmConfig.manifest")
        return replace(base.merged(own), protocol=PROTOCOL_VERSION, secret_required=self.run_secret is not None)


@dataclass
class StepStats:
    step: int = 0
    peers: int = 0  # voters counted in this peer's view of the round
    group_size: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    result_down: int = 0  # result bytes from reducers as they came (deltas) and as plain results
    result_plain: int = 0
    seconds: float = 0.0  # the whole aggregate call
    round_s: float = 0.0  # the vote round alone (votes, reduction, results)
    wait_s: float = 0.0  # of which idle: own uploads done, no result byte yet (overlapped: blocked on the last vote)
    bits_per_param: float = 0.0
    repaired: bool = False
    momentum_synced: bool = False
    missed: bool = False  # the round failed here: no update applied
    followed: bool = False  # received the result without voting (behind the group, ``follow.py``)


def _anchor_ids(maddrs: list[str]) -> list[str]:
    """Peer ids named in multiaddrs (``.../p2p/ID``): the coordinators this peer was told to trust."""
    ids = []
    for maddr in maddrs:
        parts = str(maddr).split("/")
        for i, part in enumerate(parts[:-1]):
            if part in ("p2p", "ipfs") and parts[i + 1] not in ids:
                ids.append(parts[i + 1])
    return ids


def _descendants(pid: int) -> list[int]:
    """Process ids below ``pid`` (Linux /proc), deepest last: the DHT process's p2pd and helpers."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Swarm:
    def __init__(self, config: SwarmConfig | None = None, **kwargs):
        self.config = config = config or SwarmConfig(**kwargs)
        self.loop = BackgroundLoop(f"swarm-{config.run_id}")
        self.history = GroupHistory()
        self.log = RateLimitedLog(logger)
        self.records: dict[str, PeerRecord] = {}
        self.failures: Counter[str] = Counter()  # rounds in a row a member was not counted...
        self.failing_since: dict[str, float] = {}  # ...since when
        self._round_steps: OrderedDict[bytes, int] = OrderedDict()  # round id -> step, of this peer's recent rounds
        self._background: set[concurrent.futures.Future] = set()
        self.evicted: dict[str, float] = {}  # dropped peer -> expiry of its record when it was dropped
        self.admitted: set[str] = set()  # peers that proved the run key to this peer, or were members of its groups
        self._proved_to: set[str] = set()  # members that admitted this peer
        self.optimizer: LionCub | None = None
        self.stats = StepStats()
        self.repairs = 0
        self.skips = 0  # state downloads of a follower that fell out of the group's kept rounds
        self._skip_failures = 0
        self.follow = FollowRule()  # vote, or only receive results when this peer's votes come too late
        self.missed_rounds = 0
        self.final_step: int | None = None  # where this peer stops (the trainer's --steps): no group starts later
        self.stranded: str | None = None  # why training cannot go on (every other peer left), once it cannot
        self._alone_since: float | None = None
        self.last_report: RoundReport | None = None
        self.__synced = False
        self._refresher: concurrent.futures.Future | None = None
        self._progress = (time.monotonic(), 0)  # (time, step) at the last announcement, for samples/s
        self._published = 0.0
        self._manifest_published = 0.0
        self._last_expiration = 0.0  # of this peer's newest record (a leaving record must outlive it)
        self._closed = False
        self._joined = False
        # Held by the training thread from aggregate() to the end of after_step(): a snapshot taken
        # under it is a state between steps.
        self._step_lock = threading.Lock()
        self._in_step = False
        self._idle = True  # not stepping yet (joining, waiting for peers): group changes can take effect at once
        self.samples_per_step = 0  # set by the training loop, for monitors
        self.last_loss: float | None = None
        self.opinions = config.opinions()
        fresh = config.identity_path is None or not os.path.exists(config.identity_path)
        try:
            self.identity = Identity.load_or_create(config.identity_path)
        except (OSError, ValueError) as e:
            self.loop.stop()
            raise SwarmError(f"cannot use the identity file {config.identity_path} ({e}): give a writable path "
                             f"or another file") from None
        try:  # before the daemon takes the port: can peers dial it? (client mode decided here, once)
            self.listen_plan = self.loop.run(reachability.plan(config.client_mode, config.initial_peers,
                                                               config.host_maddrs, config.announce_maddrs), timeout=90)
        except Exception as e:  # the check must never keep a peer out: listen as configured
            self.listen_plan = reachability.ListenPlan(False, list(config.host_maddrs), list(config.announce_maddrs),
                                                       f"the reachability check failed ({type(e).__name__}: {e})")
        plan = self.listen_plan
        if plan.note:  # one line: whether peers can dial this machine, and what this peer does about it
            logger.log(logging.WARNING if plan.client_mode else logging.INFO, "%s", plan.note)
        self.config = config = replace(config, client_mode=plan.client_mode, host_maddrs=plan.host_maddrs,
                                       announce_maddrs=plan.announce_maddrs)
        try:
            # a key made just now is not anyone else's: skip hivemind's check (it starts a second daemon, ~0.45 s)
            self.dht = DHT(start=True, initial_peers=config.initial_peers, host_maddrs=config.host_maddrs,
                           announce_maddrs=config.announce_maddrs or None, identity_path=self.identity.path,
                           check_if_identity_free=not fresh, record_validators=[RunRecordValidator([config.run_id])],
                           client_mode=config.client_mode, no_listen=config.client_mode,
                           nat_port_map=config.nat_probing, auto_nat=config.nat_probing)
        except Exception as e:
            self.loop.stop()
            raise SwarmError(f"could not start the DHT ({e}); check --initial-peers and that the coordinators "
                             f"are reachable") from e
        try:
            self._start(config)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, config: SwarmConfig) -> None:
        self.p2p = self.loop.run(self.dht.replicate_p2p(), timeout=30)
        self.peer_id = self.p2p.peer_id.to_base58()
        self.verdicts = Verdicts(self.peer_id, _Rounds(self), lambda to, a: send_accusation(self.p2p, to, a),
                                 self._in_background, self.log)
        if self.peer_id != self.identity.peer_id:
            raise SwarmError("the DHT runs with another key than the identity file")
        self.admission = Admission(config.run_id, config.run_secret.encode() if config.run_secret else None,
                                   frozenset(config.allow_peers))
        self.directory = Directory(self.dht, config.run_id, self.identity)
        self.verifier = Verifier()
        self.anchors = _anchor_ids(config.initial_peers)
        self.run_manifest: Manifest | None = None  # the run's, as published by its leader (or a coordinator)
        self._unreachable = 0  # group authors that did not answer the last admission requests
        self.manifest = self.opinions.merged(DEFAULTS)  # this peer's settings (the run's, adopted)
        self._discover()
        self._apply_settings()
        self.node = VoteNode(self.p2p, config.allreduce, self.admission, identity=self.identity)
        self.gather = GatherNode(self.p2p, config.allreduce, self.admission) \
            if self.config.transport == "allgather" else None
        self.state_server = StateServer(self.p2p, config.run_id, max_uploads=config.max_state_uploads,
                                        provider=self._snapshot_between_steps, admission=self.admission)
        self.admit_server = AdmitServer(self.p2p, self.admission, self.admitted.add)
        self.accuse_server = AccuseServer(self.p2p, self._accusation_header, self.verdicts.on_accusation,
                                          self._is_member)
        self._synced = False  # the state server serves only once this peer holds the swarm's state
        self.loop.run(self._start_services(), timeout=30)
        self._round = ("vote", 0)  # the kind and step of the round in progress, for failpoints
        if failpoints.ARMED is not None:
            self.node.on_event.append(self._failpoint)

    def visible_maddrs(self) -> list[str]:
        """The addresses other peers can dial this one at (give them as --initial-peers)."""
        if self.config.client_mode:
            return []
        return [str(m) for m in self.dht.get_visible_maddrs()]

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
        await self.admit_server.start()
        await self.accuse_server.start()
        if not self.config.client_mode:  # tell joiners whether they can be dialed (reachability.py)
            await reachability.serve_dialback(self.p2p)

    # -- finding the run -----------------------------------------------------------------------------

    def _discover(self) -> None:
        """Read the run's group and manifest; if a group exists, ask its author to admit this peer and
        adopt the run's manifest. Raises AdmissionRefused or SettingsMismatch (one line each)."""
        if self.history.latest is None:
            candidates = self.loop.run(self.directory.groups(), timeout=30)
            if candidates:
                self.records = self.loop.run(self.directory.peers(), timeout=30)
                group = self._admitted_group(candidates)
                if group is not None:
                    self._trust(group)
        found = self.loop.run(manifests.read(self.dht, self.config.run_id, self.verifier, self.log), timeout=30)
        latest = self.history.latest
        members = ([latest.author] + latest.member_ids()) if latest is not None else []
        run = manifests.choose(found, members, self.anchors)
        if run is not None:
            try:
                self.manifest = manifests.resolve(self.opinions, run, self.config.run_id).merged(DEFAULTS)
            except ManifestMismatch as e:
                raise self._mismatch(e, run) from None
            self.run_manifest = run

    def _mismatch(self, error: ManifestMismatch, run: Manifest) -> SwarmError:
        if run.secret_required is not None and run.secret_required != self.opinions.secret_required:
            if run.secret_required:
                return AdmissionRefused(f"run {self.config.run_id} is private: pass its --run-secret")
            return AdmissionRefused(f"run {self.config.run_id} is open (no run secret): drop --run-secret")
        return SettingsMismatch(str(error))

    def _admitted_group(self, candidates: list[GroupRecord]) -> GroupRecord | None:
        """Ask the authors of the run's group records, most populated first, to admit this peer; the first
        that does (and, in a private run, proves the run key back) gives the group this peer trusts.
        Raises AdmissionRefused if every author answered and refused."""
        self._unreachable = 0
        live = {pid for pid, r in self.records.items() if not r.leaving}
        ranked = sorted(candidates, key=lambda g: (-sum(pid in live for pid in g.member_ids()), -g.epoch, g.author))
        refusals, failures = [], 0
        for group in ranked[:MAX_CANDIDATES]:
            if group.author == self.peer_id:
                continue
            try:
                verdict = self.loop.run(ask_admission(self.p2p, group.author, self.admission), timeout=15)
            except Exception as e:  # unreachable, or not a lioncub peer: try the next
                if "protocols not supported" not in str(e):  # a peer that is up but serves no admission is no member
                    failures += 1
                self.log.warning(f"ask:{group.author}", "could not ask %s for admission: %s: %s", group.author,
                                 type(e).__name__, e)
                continue
            run = self.config.run_id
            if not verdict.admitted and verdict.secret_required and not self.admission.needs_secret:
                refusals.append(f"run {run} is private: pass its --run-secret (its leader {group.author} refused "
                                f"this peer)")
            elif not verdict.admitted and verdict.reason == "not on the run's allow-list":
                refusals.append(f"run {run} refused this peer: not on the run's allow-list (asked {group.author}): "
                                f"ask the run's organizer to add peer id {self.peer_id}")
            elif not verdict.admitted:
                refusals.append(f"run {run} refused this peer: {verdict.reason} (asked {group.author}): check "
                                f"--run-secret")
            elif self.admission.needs_secret and not verdict.secret_required:
                refusals.append(f"run {run} is open (no run secret): drop --run-secret")
            elif self.admission.needs_secret and not verdict.member_proved:
                self.log.warning(f"impostor:{group.author}", "%s did not prove the run secret: ignoring its group",
                                 group.author)
            else:
                self._proved_to.add(group.author)
                return group
        self._unreachable = failures
        if refusals and not failures:
            raise AdmissionRefused(refusals[0])
        return None

    def _trust(self, group: GroupRecord) -> None:
        self.history.add(group)
        for g in self.history.by_epoch.values():
            self.admitted.update(g.member_ids())
        if hasattr(self, "node"):
            self.node.group_epoch = self.history.latest.epoch

    def _apply_settings(self) -> None:
        """Make this peer run with ``self.manifest``'s swarm settings (codecs, schedule, ...)."""
        m = self.manifest
        self.config = replace(self.config, upload=m.upload, result=m.result, transport=m.transport,
                              momentum=m.momentum_schedule(), momentum_rule=m.momentum_rule,
                              full_digest_every=m.full_digest_every, seed=m.seed, delay=m.delay or 0)
        self.upload = upload_codec(m.upload)
        self.result = result_codec(m.result)

    # -- joining ---------------------------------------------------------------------------------

    def join(self, optimizer: LionCub, timeout: float | None = None) -> int:
        """Become a voting member: resume a checkpoint, then start the run or fetch the swarm's state.
        Returns the step training continues from. Raises SwarmError (one line) for what the volunteer
        must fix: a refused admission, a model or settings that differ from the run's, no group in time."""
        if optimizer.aggregator is not self:
            raise ValueError("create the optimizer with aggregator=<this swarm>")
        try:
            self.config.momentum.check_names(name for name, _ in optimizer.momentum_buffers())
        except ValueError as e:
            raise SwarmError(str(e)) from None
        self.optimizer = optimizer
        if self.config.checkpoint_dir:
            restored = checkpoint.restore(self.config.checkpoint_dir, optimizer)
            if restored is not None:
                logger.info("resumed checkpoint at step %d", restored)
        self._start_step = optimizer.step_count  # before any download: where this peer came in
        deadline = time.monotonic() + (timeout or self.config.join_timeout)
        self._discover()
        if self.history.latest is None:
            time.sleep(1.0)  # a group record stored moments ago may not have reached us yet
            self._discover()
        # the run's group exists but its author did not answer: wait for it or a new leader. A client
        # cannot found a run (nobody could dial it to reduce): it waits for a group that can.
        while self.history.latest is None and (self._unreachable or self.config.client_mode) \
                and time.monotonic() < deadline:
            time.sleep(2.0)
            self._discover()
        if self.history.latest is None and self._unreachable:  # founding a group of our own would split the run
            raise SwarmError(f"the group of run {self.config.run_id} did not answer this peer's admission request "
                             f"in time: can this machine reach its peers (firewall, --initial-peers)?")
        if self.history.latest is None and self.config.client_mode:
            raise SwarmError(f"no group of run {self.config.run_id} found in time, and a peer in client mode cannot "
                             f"start one (nobody can dial it to reduce): start a listening peer first, or check "
                             f"--run-id and --initial-peers")
        self._settle_manifest(optimizer)
        founded = False
        if self.history.latest is None:
            founded = self._found()
            if not founded:  # another peer founded the run at the same moment: take its settings
                self._discover()
                self._settle_manifest(optimizer)
        self._joined = True
        self._refresher = asyncio.run_coroutine_threadsafe(self._refresh_forever(), self.loop.loop)
        latest = self.history.latest
        if self.peer_id not in latest.member_ids():
            self._sync_from_swarm(deadline)
        elif not founded:  # the leader may list a peer as soon as it announces: being listed is not holding the state
            self._download(min_step=latest.from_step, group=latest)
        self._synced = True
        self.loop.run(self._announce(), timeout=30)
        self._prepare(optimizer.step_count)
        return optimizer.step_count

    def _settle_manifest(self, optimizer: LionCub) -> None:
        """Add what the optimizer says (layout, lr, ...) to this peer's opinions and check them against
        the run's manifest; the founder's become the run's."""
        layout = snapshot.Layout.of(optimizer)
        found = {"layout_hash": layout.digest(), "param_count": layout.param_count()}
        for key in ("lr", "weight_decay", "betas"):
            values = {tuple(g[key]) if key == "betas" else g[key] for g in optimizer.param_groups}
            if len(values) == 1:  # one value for every group: part of the run's settings
                found[key] = values.pop()
        try:
            from_optimizer = Manifest(**found)
        except ManifestError:  # e.g. an lr beyond what a manifest holds: compare the layout only
            from_optimizer = Manifest(layout_hash=found["layout_hash"], param_count=found["param_count"])
        clash = from_optimizer.conflicts(self.opinions)
        if clash:
            name, mine, theirs = clash[0]
            raise SettingsMismatch(f"the optimizer's {name}={mine} differs from this peer's setting {name}={theirs}")
        own = self.opinions.merged(from_optimizer)
        run = self.run_manifest
        try:
            settled = manifests.resolve(own, run, self.config.run_id).merged(DEFAULTS)
        except ManifestMismatch as e:
            if run is not None and run.layout_hash not in (None, own.layout_hash):
                raise SettingsMismatch(
                    f"this peer's model differs from run {self.config.run_id}'s ({own.param_count} parameters, layout "
                    f"{own.layout_hash[:8]}; the run: {run.param_count} parameters, layout {run.layout_hash[:8]}): "
                    f"build the run's model (task {run.task or '?'}, {run.task_args or {}})") from None
            raise self._mismatch(e, run) from None
        applied = Manifest(**{name: getattr(self.config, name) for name in manifests.SWARM_FIELDS})
        changed = [name for name in manifests.SWARM_FIELDS if getattr(applied, name) != getattr(settled, name)]
        if changed:
            raise SettingsMismatch(f"run {self.config.run_id}'s manifest appeared after this Swarm was created and "
                                   f"sets {', '.join(changed)} otherwise: create the Swarm again to adopt it")
        self.manifest = settled
        if self.history.latest is None:  # this peer founds the run: its settings become the run's
            self.run_manifest = settled

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
            floor = reducer_floor([self._weight_of(m) for m in latest.members if not m.client_mode]) if latest else 0.0

            def weighted(m: PeerSpec) -> bool:  # the group gives it the part its record asks for (none: none)
                record = self.records.get(m.peer_id)
                if m.reduces or m.client_mode or record is None:
                    return m.reduces or m.client_mode or m.weight == 0
                return assigned_weight(record.weight, syncing=False, following=record.following, floor=floor,
                                       lone_reducers=False) == 0

            settled = latest is not None and all(  # every member synced, and the group says so (weights back)
                m.peer_id in synced and weighted(m) for m in latest.members)
            if settled and len(latest.members) >= count and latest.from_step <= self.optimizer.step_count:
                return
            if time.monotonic() > deadline:
                members = len(latest.members) if latest else 0
                raise SwarmError(f"the group did not reach {count} synced members in time ({members} members, "
                                 f"{len(synced & set(latest.member_ids() if latest else []))} synced)")
            time.sleep(self.config.refresh_period)

    def linger(self, seconds: float) -> None:
        """After this peer's last step: stay up to ``seconds`` while a live member is behind, leading
        and serving this final state. A member dropped near the end (a stall, a lost link) rejoins at
        the last step (``final_step`` caps the group's start) and downloads it, instead of waiting for a
        group that nobody steps any more. Returns at once when nobody is behind."""
        if self.optimizer is None or self._closed:
            return
        step, deadline = self.optimizer.step_count, time.monotonic() + seconds
        self._idle = True
        try:  # say at once that this peer is at its last step: those finishing with it need not wait for it
            self.loop.run(self._announce(), timeout=10)
        except Exception as e:
            logger.debug("announcing the last step failed: %s", e)
        waited = False
        while time.monotonic() < deadline:
            behind = sorted(pid for pid, r in self.records.items()  # records refresh on the loop thread
                            if pid != self.peer_id and not r.leaving and r.step < step)
            if not behind:
                break
            if not waited:
                logger.info("finished at step %d; staying up to %.0f s for %d peer(s) behind", step, seconds,
                            len(behind))
                waited = True
            time.sleep(self.config.refresh_period)

    def _found(self) -> bool:
        """Publish the run's manifest and a group of this peer alone; True if this peer keeps it.

        Two peers founding at once both publish; the one with the smaller peer id keeps its group and
        the other joins it (if it admits it)."""
        step = self.optimizer.step_count
        record = GroupRecord(0, step, (self._my_spec(),), author=self.peer_id)
        self.loop.run(manifests.store(self.dht, self.config.run_id, self.run_manifest, self.identity), timeout=30)
        self._manifest_published = time.monotonic()
        self.loop.run(self.directory.publish_group(record, ttl=60.0), timeout=30)
        self._published = time.monotonic()
        time.sleep(0.5)  # let a concurrent founder's record land too
        others = [g for g in self.loop.run(self.directory.groups(), timeout=30)
                  if g.author != self.peer_id and (g.epoch > 0 or g.author < self.peer_id)]
        if others:
            self.records = self.loop.run(self.directory.peers(), timeout=30)
            group = self._admitted_group(others)
            if group is not None:
                self._trust(group)
                logger.info("no group found for run %s: another peer started it", self.config.run_id)
                return False
        self._trust(record)
        logger.info("no group found for run %s: started it", self.config.run_id)
        return True

    def _sync_from_swarm(self, deadline: float) -> None:
        """Wait until the leader adds this peer to a group, then download the state of that step."""
        logger.info("waiting to be added to the group of run %s", self.config.run_id)
        asked = time.monotonic()
        while True:
            self.loop.run(self._refresh_group(), timeout=30)
            latest = self.history.latest
            if latest is not None and self.peer_id in latest.member_ids():
                break
            if time.monotonic() > deadline:
                raise SwarmError("no group took this peer in time. Is the run alive? Is --run-secret the run's? "
                                 f"Does the run speak protocol version {PROTOCOL_VERSION} (upgrade lioncub-p2p if not)?")
            if time.monotonic() - asked > 3.0:  # a new leader, or a lineage this peer lost: ask to be admitted again
                asked = time.monotonic()
                self._ask_again(latest)
            self.loop.run(self._announce(), timeout=30)
            time.sleep(self.config.refresh_period)
        self._download(min_step=latest.from_step, group=latest)

    def _ask_again(self, latest: GroupRecord | None) -> None:
        """Still not in the group: prove the key to its current author, and look for a newer group this
        peer cannot follow through its own history (two peers founded at once, or its lineage died)."""
        if latest is not None and latest.author not in self._proved_to and latest.author != self.peer_id:
            try:
                verdict = self.loop.run(ask_admission(self.p2p, latest.author, self.admission), timeout=15)
                if verdict.admitted:
                    self._proved_to.add(latest.author)
            except Exception as e:
                logger.debug("asking %s for admission failed: %s", latest.author, e)
        self.records = self.loop.run(self.directory.peers(), timeout=30)
        candidates = [g for g in self.loop.run(self.directory.groups(), timeout=30)
                      if latest is None or g.epoch > latest.epoch]
        if candidates:
            group = self._admitted_group(candidates)
            if group is not None:
                self.loop.run(self._adopt(group), timeout=10)  # on the loop, the history's only writer once running

    async def _adopt(self, group: GroupRecord) -> None:
        """Follow ``group`` instead of the lineage this peer lost."""
        self.history.clear()
        self._trust(group)

    def _download(self, min_step: int, group: GroupRecord) -> None:
        members = [m for m in group.members if m.peer_id != self.peer_id and not m.client_mode
                   and m.peer_id not in self.liars]
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

    def _round_id(self, kind: str, step: int, epoch: int) -> bytes:
        return hashlib.blake2b(f"{self.config.run_id}|{kind}|{step}|{epoch}".encode(), digest_size=16).digest()

    def _spec(self, group: GroupRecord, step: int, kind: str = "vote") -> RoundSpec:
        rid = self._round_id(kind, step, group.epoch)
        self._round_steps[rid] = step  # to name the round when reporting what its audits caught
        while len(self._round_steps) > 256:
            self._round_steps.popitem(last=False)
        if kind == "vote":
            return RoundSpec(rid, step, group.members, self.optimizer.buffer_bytes, self.upload, self.result,
                             self.config.seed)
        return self._momentum_sync().spec(rid, step, group.members)

    def _prepare(self, step: int) -> None:
        """Let this peer's reducer count others' votes for ``step`` while it still computes."""
        group = self.history.for_step(step)
        if (group is not None and self.peer_id in group.member_ids() and self.gather is None
                and any(m.reduces for m in group.members)):  # else nobody counts: the round is missed, not prepared
            spec = self._spec(group, step)

            def prepare() -> None:
                try:
                    self.node.prepare_round(spec)
                except ValueError as e:  # already run (a repeated step after a repair): nothing to prepare
                    logger.debug("not preparing step %d: %s", step, e)

            self.loop.call_soon(prepare)

    def before_step(self) -> None:
        """Called by LionCub before the step touches any state: snapshots wait from here on."""
        self._enter_step()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """A section that changes the state between steps (``LionCub.flush``): no snapshot meanwhile."""
        if self._in_step:  # inside a step already (the training thread holds the lock)
            yield
            return
        self._step_lock.acquire()
        try:
            yield
        finally:
            self._step_lock.release()

    def _round_bound(self) -> float:
        """The longest a vote round may take before its voters give up on it."""
        cfg = self.config.allreduce
        return cfg.result_timeout + cfg.recovery_timeout + 30

    def _enter_step(self) -> None:
        if not self._in_step:  # still held if an earlier step stopped between aggregate and after_step
            self._step_lock.acquire()
            self._in_step = True

    def _exit_step(self) -> None:
        if self._in_step:
            self._in_step = False
            self._step_lock.release()

    def _snapshot_between_steps(self, min_step: int) -> tuple[int, bytes, bytes] | None:
        """For the state server, from its worker thread: this peer's state if it is between steps.
        With a round in flight, its update is part of the state: wait for it without holding up the
        training thread, then take the state only if that round is still the last one."""
        if self.optimizer is None or not self._synced:
            return None
        in_flight = self.optimizer.in_flight
        if in_flight is not None:
            in_flight.peek(self._round_bound())
        if not self._step_lock.acquire(timeout=0.2):
            return None
        try:
            if self.optimizer.step_count < min_step or (self.optimizer.in_flight is not None
                                                        and not self.optimizer.in_flight.done()):
                return None
            blob, digest = snapshot.encode(self.optimizer)
            return self.optimizer.step_count, blob, digest
        finally:
            self._step_lock.release()

    @property
    def delay(self) -> int:
        """1 with overlapped rounds (``LionCub`` then calls ``submit``), else 0."""
        return self.config.delay or 0

    def aggregate(self, upload: torch.Tensor, *, step: int) -> torch.Tensor | None:
        return self.submit(upload, step=step).wait()

    def submit(self, upload: torch.Tensor, *, step: int) -> "RoundInFlight | Resolved":
        """Start the vote of ``step``; the returned handle's ``wait()`` gives its update (see ``aggregate``)."""
        if self.optimizer is None:
            raise SwarmError("call swarm.join(optimizer) before training")
        self._enter_step()
        self._idle = False
        self.stats = StepStats(step=step)
        try:
            return self._start_round(upload, step)
        except Exception as e:  # never into the training loop: a missed round (the digest repairs a split)
            return Resolved(self._failed(step, e))

    def _failed(self, step: int, e: Exception) -> torch.Tensor:
        self.log.warning(f"round:{type(e).__name__}", "step %d: the round failed here (%s: %s); applying no update",
                         step, type(e).__name__, e)
        return self._missed(step)

    def _missed(self, step: int) -> torch.Tensor:
        self.missed_rounds += 1
        self.stats.missed = True
        try:
            self._prepare(step + 1)
        except Exception as e:
            logger.debug("not preparing step %d: %s", step + 1, e)
        return torch.zeros(self.optimizer.buffer_bytes * 8)

    def _start_round(self, upload: torch.Tensor, step: int) -> "RoundInFlight | Resolved":
        group = self.history.for_step(step)
        if group is None or self.peer_id not in group.member_ids():
            logger.warning("step %d: this peer is not in the group (dropped after a stall?): rejoining", step)
            try:
                self._rejoin()
            except Exception as e:  # keep the training loop alive; the next step tries again
                logger.warning("rejoining failed: %s", e)
                self._check_stranded(step)
            return Resolved(None)
        if self.config.client_mode:  # it cannot lead: once no peer that can is left, it must stop
            self._check_stranded(step)
        spec = self._spec(group, step)
        tag = snapshot.state_tag(self.optimizer, full=step % self.config.full_digest_every == 0)
        self._round = ("vote", step)
        started = time.perf_counter()
        if self.gather is not None:  # the D-Lion baseline: everyone votes
            coro = self.gather.run_round(spec, upload, tag)
        elif self.follow.follow_next():
            coro = self.node.follow_round(spec, tag)
        else:  # a follower's probe vote recovers what it misses as it follows: each part once
            coro = self.node.run_round(spec, upload, tag, one_at_a_time=self.follow.following)
        future = asyncio.run_coroutine_threadsafe(coro, self.loop.loop)
        if self.delay:  # the next vote may start before this one ends: let its part count votes already
            self._prepare(step + 1)
        return RoundInFlight(self, spec, group, tag, started, future)

    def _check_stranded(self, step: int) -> None:
        """Set ``stranded`` once no other live peer that can count votes and lead has been seen for
        ``STRANDED_AFTER_S`` (records expire within seconds of a peer's death; the delay rides out
        a DHT that answers nothing for a while)."""
        others = [r for pid, r in self.records.items() if pid != self.peer_id and not r.leaving and not r.client_mode]
        if others:
            self._alone_since = None
            return
        if self._alone_since is None:
            self._alone_since = time.monotonic()
        elif time.monotonic() - self._alone_since > STRANDED_AFTER_S:
            self.stranded = (f"no peer of run {self.config.run_id} that can count votes is left (this peer is "
                             f"at step {step}{' and in client mode' * self.config.client_mode}): nothing to train with")

    def _finish_round(self, r: "RoundInFlight") -> torch.Tensor | None:
        """The training thread's side of a round that ended: observe it, repair a divergence it shows."""
        step, group, tag = r.spec.step, r.group, r.tag
        blocked = time.perf_counter()
        try:
            update, report = r.future.result(timeout=r.time_left())
        except Exception as e:  # never into the training loop: apply nothing; the digest repairs us next step
            r.future.cancel()
            logger.warning("step %d: the vote round failed (%s: %s); applying no update", step, type(e).__name__, e)
            return self._missed(step)
        self._observe(r.spec, report, r.started)
        if self.gather is None:
            self._follow_or_vote(report)
        if self.follow.fell_out(report):  # nobody keeps this round any more: skip ahead to a peer's state
            return self._skip_ahead(step, group)
        if self.delay:  # what the step waited for: the part of the round that compute did not hide
            self.stats.wait_s = time.perf_counter() - blocked
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
            try:  # from a peer past the step in progress (overlapped: the next one, whose vote is out)
                self._download(min_step=self.optimizer.step_count + 1, group=group)
            except Exception as e:  # apply nothing: still diverged, so the next round tries again
                logger.warning("step %d: repair failed (%s); retrying next step", step, e)
                return self._missed(step)
            self.repairs += 1
            self.stats.repaired = True
            self._prepare(self.optimizer.step_count)
            return None
        self._prepare(step + 1)
        return update

    def _follow_or_vote(self, report: RoundReport) -> None:
        """Follow while this peer's votes come too late to count (``follow.py``); tell the group at once."""
        was = self.follow.following
        self.follow.after(report)
        self.stats.followed = report.followed
        if self.follow.following != was:
            logger.info("step %d: %s", report.step, "this peer's votes came too late to count: following (results "
                        "only, no votes)" if self.follow.following else "votes count again: voting")
            self._in_background(self._announce())

    def _skip_ahead(self, step: int, group: GroupRecord) -> torch.Tensor | None:
        """Download a newer state; after ``SKIP_TRIES`` failures in a row stop (``stranded``) rather than
        go on applying zeros: a follower nobody serves any more must not finish as if it had trained."""
        logger.warning("step %d: this peer fell so far behind that nobody keeps its round: downloading the state", step)
        try:
            self._download(min_step=self.optimizer.step_count + 1, group=group)
        except Exception as e:
            self._skip_failures += 1
            logger.warning("step %d: skipping ahead failed (%s); retrying next step", step, e)
            if self._skip_failures >= SKIP_TRIES:
                self.stranded = (f"this peer fell behind the group and nobody holds the rounds it missed or a newer "
                                 f"state any more ({type(e).__name__}); its parameters are not the group's: start it "
                                 f"again to download the current state")
            return self._missed(step)
        self._skip_failures = 0
        self.skips += 1
        self.stats.repaired = True
        self._prepare(self.optimizer.step_count)
        return None

    def _rejoin(self) -> None:
        self._synced = False
        self._sync_from_swarm(time.monotonic() + self.config.join_timeout)
        self._synced = True
        self._prepare(self.optimizer.step_count)

    def suspects(self) -> set[str]:
        """Peers the leader drops and does not add (``Verdicts.suspects``)."""
        return self.verdicts.suspects()

    @property
    def liars(self) -> dict[str, str]:
        """Peers proven to lie -> why (``Verdicts``)."""
        return self.verdicts.liars

    @property
    def suspicions(self) -> Suspicions:
        return self.verdicts.suspicions

    def _observe(self, spec: RoundSpec, report: RoundReport, started: float) -> None:
        self.last_report = report
        if report.caught:  # checked and acted on in the background (evidence checks recount, reports dial)
            self._in_background(self.verdicts.act_on(list(report.caught)))
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
        self.stats.result_down, self.stats.result_plain = report.result_down, report.result_plain
        self.stats.bits_per_param = 8 * (report.bytes_up + report.bytes_down) / max(numel, 1)
        self.stats.seconds = time.perf_counter() - started
        timings = report.timings
        self.stats.round_s = timings.get("total", 0.0)
        if "first_result" in timings:
            self.stats.wait_s = max(timings["first_result"] - timings.get("upload", 0.0), 0.0)

    def after_step(self, optimizer: LionCub) -> None:
        """Momentum averaging, snapshots for joiners, checkpoints: each failure is logged, never raised."""
        try:
            step = optimizer.step_count
            if self._momentum_sync().due(step):
                try:
                    self.stats.momentum_synced = self._average_momentum(step)
                except Exception as e:
                    self.log.warning("momentum", "step %d: momentum averaging failed, skipped: %s: %s", step,
                                     type(e).__name__, e)
            wanted = self.state_server.wanted_step()
            if wanted is not None and wanted <= step:
                try:
                    blob, digest = snapshot.encode(optimizer)
                    self.loop.run(self.state_server.offer(step, blob, digest), timeout=30)
                except Exception as e:
                    self.log.warning("offer", "step %d: no snapshot for joiners: %s: %s", step, type(e).__name__, e)
            if self.config.checkpoint_dir and self.config.checkpoint_every and step % self.config.checkpoint_every == 0:
                try:
                    checkpoint.save(self.config.checkpoint_dir, optimizer)
                except OSError as e:
                    self.log.warning("checkpoint", "step %d: checkpoint not written to %s: %s", step,
                                     self.config.checkpoint_dir, e)
        finally:
            self._exit_step()

    def _momentum_sync(self) -> MomentumSync:
        """The momentum rounds under the current settings (the run's manifest may change them at join)."""
        return MomentumSync(self.config.momentum, self.config.momentum_rule, self.optimizer.momentum_buffers,
                            self.config.seed)

    def _average_momentum(self, step: int) -> bool:
        """One momentum round after ``step`` (``momentum_sync.py``); False if this peer had none or it failed."""
        group = self.history.for_step(step - 1)
        if group is None or self.peer_id not in group.member_ids():
            return False
        spec = self._spec(group, step, kind="momentum")
        self._round = ("momentum", step)
        timeout = self.config.allreduce.result_timeout + 30
        follow = self.follow.following  # behind: the others' average only (this peer's values are late anyway)
        try:
            return self._momentum_sync().average(
                spec, lambda spec, upload: self.loop.run(self.node.follow_round(spec) if follow
                                                         else self.node.run_round(spec, upload), timeout=timeout))
        except Exception as e:
            logger.warning("step %d: momentum averaging failed, skipped: %s", step, e)
            return False

    # -- caught reducers ----------------------------------------------------------------------------

    def _in_background(self, coro) -> None:
        if self.loop is None:  # shut down
            coro.close()
            return
        future = asyncio.run_coroutine_threadsafe(coro, self.loop.loop)
        self._background.add(future)
        future.add_done_callback(self._background.discard)

    def _round_of(self, round_id: bytes, step: int, part: int, reducer: str) -> tuple[GroupRecord, str] | None:
        """The group and kind of one of this peer's recent rounds, if ``reducer`` reduced ``part`` in it."""
        for group in list(self.history.by_epoch.values()):
            for kind in ROUND_KINDS:
                if self._round_id(kind, step, group.epoch) == round_id:
                    ok = 0 <= part < len(group.members) and group.members[part].peer_id == reducer
                    return (group, kind) if ok else None
        return None

    def _is_member(self, peer_id: str) -> bool:
        return any(peer_id in g.member_ids() for g in list(self.history.by_epoch.values()))

    def _accusation_header(self, accuser: str, accusation: Accusation, evidence_bytes: int) -> int:
        """Before any evidence is read: a round of this peer's groups, its reducer accused by another of its
        members. Returns the most evidence bytes such a round can produce."""
        found = self._round_of(accusation.round_id, accusation.step, accusation.part, accusation.accused)
        if found is None:
            raise Refused("not a recent round of this peer's groups, or the accused did not reduce that part")
        group, kind = found
        if accuser not in group.member_ids() or accuser == accusation.accused:
            raise Refused("the accuser is not another member of that round's group")
        if accusation.kind != "lie":
            return 0
        if self.optimizer is None:
            raise Refused("this peer has not joined yet")
        spec = self._spec(group, accusation.step, kind)
        start, stop = spec.bounds[accusation.part]
        n, planes = len(group.members), spec.upload.planes
        leaf = min(leaf_bytes(stop - start, planes) * planes, MAX_LEAF_BYTES)
        return min(MAX_EVIDENCE_BYTES, spec.result_size(accusation.part, n) + MAX_HEADER_BYTES + 8192 + n * (leaf + 1024))

    # -- membership upkeep (background) -------------------------------------------------------------

    async def _refresh_forever(self) -> None:
        last_announce = 0.0
        while True:
            try:
                await self._refresh_group()
                await self.verdicts.remind_leader()
                self.records = await self.directory.peers()
                leaving = {pid for pid, r in self.records.items() if r.leaving}  # signed by the peer itself
                if leaving:
                    self.node.stop_waiting_for(leaving, "it left the run")
                if time.monotonic() - last_announce > self.config.record_ttl / 3:
                    await self._announce()
                    last_announce = time.monotonic()
                await self._lead()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the DHT, a bad record: upkeep goes on with the next refresh
                self.log.warning(f"upkeep:{type(e).__name__}", "membership refresh failed: %s: %s", type(e).__name__, e)
            await asyncio.sleep(self.config.refresh_period)

    async def _refresh_group(self) -> None:
        """Accept the next group from the run's records (``membership.next_group``)."""
        if self.history.latest is None:
            return
        step = self.optimizer.step_count if self.optimizer is not None else 0
        window = 2 * STEP_WINDOW + self.config.lead_steps
        chosen = next_group(await self.directory.groups(), self.history, step=step, window=window,
                            run_step=announced_step(self.history.latest, self.records), refused=set(self.liars),
                            log=self.log)
        if chosen is not None:
            self._trust(chosen)

    async def _announce(self, *, leaving: bool = False) -> None:
        step = self.optimizer.step_count if self.optimizer is not None else 0
        now, (t0, step0) = time.monotonic(), self._progress
        rate = lambda amount: amount / max(now - t0, 1e-6)  # noqa: E731
        seconds = max(self.stats.seconds, 1e-6)
        record = PeerRecord(self.peer_id, self.config.weight, self.config.client_mode, step, PROTOCOL_VERSION,
                            self._synced and not leaving, samples_per_s=max(self.samples_per_step * rate(step - step0), 0.0),
                            bytes_up_per_s=self.stats.bytes_up / seconds, bytes_down_per_s=self.stats.bytes_down / seconds,
                            loss=self.last_loss, manifest=self.run_manifest.digest() if self.run_manifest else "",
                            leaving=leaving, following=self.follow.following and not leaving)
        self._progress = (now, step)
        # a newer record must expire later than the last (the DHT keeps the latest-expiring one)
        expiration = max(get_dht_time() + self.config.record_ttl, self._last_expiration + 1e-3)
        if await self.directory.announce(record, self.config.record_ttl, expiration=expiration):
            self._last_expiration = expiration

    def _may_join(self, record: PeerRecord) -> bool:
        """Whether the leader may add the peer of ``record`` to the group (logged, rate-limited, if not)."""
        problem = None
        if record.version != PROTOCOL_VERSION:
            problem = f"it speaks protocol version {record.version}, this peer {PROTOCOL_VERSION}"
        elif self.run_manifest is None or record.manifest != self.run_manifest.digest():
            problem = "it follows another manifest (other settings or model)"
        elif self.admission.allow and record.peer_id not in self.admission.allow:
            problem = "not on the run's allow-list"
        elif self.admission.needs_secret and record.peer_id not in self.admitted:
            problem = "it has not proved the run secret to this peer"
        if problem:
            self.log.warning(f"refuse:{record.peer_id}", "peer %s asked to join but is not added: %s",
                             record.peer_id, problem)
        return problem is None

    async def _lead(self) -> None:
        """If this peer leads the group, keep it equal to the live, admitted, compatible peers: who stays,
        who joins and with which weight is ``lead.plan_group``'s (the rules are in ``lead.py``); this
        publishes it, starting ``lead_steps`` past the fastest member's step, where a member's step
        counts only within ``STEP_WINDOW`` of this peer's (a far-future step is a lie, not progress)."""
        latest = self.history.latest
        if latest is None or self.optimizer is None or not self._synced:
            return
        suspects = self.suspects()
        healthy = Health(self.records, me=self.peer_id, now=time.monotonic(), failures=self.failures,
                         failing_since=self.failing_since, suspects=suspects)
        step = self.optimizer.step_count
        if leader_of(latest, healthy) != self.peer_id or step < latest.from_step:
            return
        if self.run_manifest is not None and time.monotonic() - self._manifest_published > manifests.MANIFEST_TTL / 3:
            self._manifest_published = time.monotonic()  # the leader keeps the run's manifest alive
            await manifests.store(self.dht, self.config.run_id, self.run_manifest, self.identity)
        plan = plan_group(latest, healthy, evicted=self.evicted, may_join=self._may_join)
        for m in plan.dropped:  # remember what the record of a dropped member said when it was dropped
            if m.peer_id in self.records:
                self.evicted[m.peer_id] = self.records[m.peer_id].expires
            if m.peer_id in self.liars:
                logger.warning("dropping %s from the group: it lied (%s)", m.peer_id, self.liars[m.peer_id])
            elif m.peer_id in suspects:
                logger.warning("dropping %s from the group: suspected (%s)", m.peer_id,
                               "; ".join(self.suspicions.reasons(m.peer_id)))
        for m in plan.joined:  # a returning peer starts with a clean slate
            self.failures[m.peer_id] = 0
            self.failing_since.pop(m.peer_id, None)
        desired = plan.members
        if set(desired) == set(latest.members) or not any(m.reduces for m in desired):
            if time.monotonic() - self._published > 20.0:  # keep the record from expiring (under our own subkey)
                self._published = time.monotonic()
                if latest.author != self.peer_id:
                    latest = GroupRecord(latest.epoch, latest.from_step, latest.members, latest.previous, self.peer_id)
                await self.directory.publish_group(latest, ttl=60.0)
            return
        known = {m.peer_id for m in latest.members}
        steps = [r.step for pid, r in self.records.items() if pid in known and step <= r.step <= step + STEP_WINDOW]
        ahead = max([step] + steps)  # the fastest member (a step beyond the window is a lie, not progress)
        lead = 0 if self._idle and ahead == step else self.config.lead_steps  # nobody steps yet: at once
        from_step = ahead + lead
        if self.final_step is not None:  # a group from past this peer's last step would never take effect
            from_step = max(latest.from_step, min(from_step, self.final_step))
        record = GroupRecord(latest.epoch + 1, from_step, desired, previous=latest, author=self.peer_id)
        if await self.directory.publish_group(record, ttl=60.0):
            self._published = time.monotonic()
            self._trust(record)
            logger.info("group epoch %d from step %d: %d members (+%d, -%d), %d reducing", record.epoch,
                        record.from_step, len(desired), len(plan.joined), len(plan.dropped),
                        sum(m.reduces for m in desired))

    # -- leaving -----------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Leave the run: tell the group (a signed "leaving" record, so the leader drops this peer at
        once), stop serving, stop the DHT process and its libp2p daemon. Safe to call twice."""
        if self._closed:
            return
        in_flight = self.optimizer.in_flight if getattr(self, "optimizer", None) is not None else None
        if in_flight is not None and not in_flight.done():  # finish the vote the others count on, then leave
            try:
                in_flight.peek(self._round_bound())
            except Exception as e:
                logger.debug("leaving with a round in flight: %s", e)
        self._closed = True
        loop = getattr(self, "loop", None)
        if self._refresher is not None:
            self._refresher.cancel()
            try:
                self._refresher.result(timeout=5)
            except (concurrent.futures.CancelledError, concurrent.futures.TimeoutError, Exception):
                pass
            self._refresher = None
        if loop is not None and self._joined and hasattr(self, "directory"):
            try:
                loop.run(self._announce(leaving=True), timeout=5)
                logger.info("left run %s: told the group", self.config.run_id)
            except Exception as e:
                logger.info("could not announce leaving run %s: %s", self.config.run_id, e)
        if loop is not None:
            try:
                if hasattr(self, "p2p"):
                    loop.run(self.p2p.shutdown(), timeout=5)  # our handle on the daemon (the DHT owns the daemon)
            except Exception as e:
                logger.debug("closing the p2p handle: %s", e)
            try:
                loop.stop()
            finally:
                self.loop = None
        dht = getattr(self, "dht", None)
        if dht is not None:
            self._stop_dht(dht)

    @staticmethod
    def _stop_dht(dht: DHT) -> None:
        """Stop the DHT process; make sure its p2pd and helpers are gone with it."""
        below = _descendants(dht.pid) if dht.pid is not None else []
        dht.shutdown()
        dht.join(10)
        for pid in [dht.pid] + below if dht.is_alive() else below:
            if pid is not None and _alive(pid):
                logger.info("process %d of the DHT outlived it: killing it", pid)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def __enter__(self) -> "Swarm":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


class _Rounds:
    """A swarm's recent rounds, as its ``Verdicts`` sees them (``verdicts.RoundLookup``)."""

    def __init__(self, swarm: Swarm):
        self.swarm = swarm

    def round_of(self, round_id: bytes, step: int, part: int, reducer: str) -> tuple[GroupRecord, str] | None:
        return self.swarm._round_of(round_id, step, part, reducer)

    def step_of(self, round_id: bytes) -> int | None:
        return self.swarm._round_steps.get(round_id)

    def latest(self) -> GroupRecord | None:
        return self.swarm.history.latest


@dataclass
class RoundInFlight:
    """A vote round started by ``Swarm.submit`` (``optim.PendingUpdate``)."""

    swarm: Swarm
    spec: RoundSpec
    group: GroupRecord
    tag: bytes
    started: float
    future: concurrent.futures.Future

    def wait(self) -> torch.Tensor | None:
        """On the training thread: the update to apply (zeros for a missed round; None after a repair)."""
        try:
            return self.swarm._finish_round(self)
        except Exception as e:  # never into the training loop
            return self.swarm._failed(self.spec.step, e)

    def time_left(self) -> float:
        """Until the round's bound, counted from its start (an overlapped round started a step ago)."""
        return max(self.started + self.swarm._round_bound() - time.perf_counter(), 0.0)

    def peek(self, timeout: float) -> torch.Tensor:
        """From any thread: the update ``wait`` applies unless this peer must repair (then it is replaced).
        Waits at most ``timeout`` and never past the round's bound, after which ``wait`` gives up on it."""
        try:
            update, _ = self.future.result(timeout=min(timeout, self.time_left()))
            return update
        except concurrent.futures.TimeoutError:
            raise
        except Exception:  # a failed round applies no update
            return torch.zeros(self.spec.nbytes * 8)

    def done(self) -> bool:
        return self.future.done()
