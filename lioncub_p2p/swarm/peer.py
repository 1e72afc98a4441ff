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
where its config has no opinion (None) and stops with one line where it differs (``SettingsMismatch``).

Every step: this peer votes in the round of its step with the group it accepted for that step,
sending a digest of its parameters along. If most voters' digest differs from its own, it diverged
(it missed a result, or a bit flipped): it downloads the state of the next step from a member and
carries on. After the update: momenta are averaged on the schedule (by default 1/20 of them each
step, fp8 on the wire, trimmed mean; a failed sync is logged and skipped), snapshots are made for peers that asked, checkpoints written.
Anything that goes wrong in a round is a missed round (a zero update, repaired by the digest if it
split anyone), never an exception out of ``optimizer.step()``.

Rooms and threads (each field has one writer): ``Swarm`` is the facade (training thread); ``Joining``
(``joining.py``) finds or founds the run, gets this peer listed and its state, waits for peers (training
thread; ``RunFinder``, ``finding.py``, reads the run's records and asks for admission; ``RunSettings``,
``settings.py``, resolves this peer's settings against the run's manifest); ``VotePipeline``
(``pipeline.py``) runs each step's vote round and owns the per-step counters (``stats``, ``repairs``,
``follow``, ``failures``, ...: training thread); ``StateSync`` (``state_sync.py``) holds the step lock
and serves and downloads state (training thread; the state server's worker thread only reads, under the
lock); ``Upkeep`` (``upkeep.py``) keeps the run's records, this peer's record and the group it leads
(event loop thread; it reads the training side only through ``upkeep.Local``; a group it plans also
goes straight to its members, and theirs to it: ``group_notice.py``); ``MomentumRounds``
(``momentum_sync.py``) and ``Verdicts`` (``verdicts.py``) are the momentum rounds and the judgement of
liars; ``RoundBook`` (``round_book.py``) names every round from the group records and looks up the
rounds others report on. Shared across threads, written down where they are: the round counters of
``Upkeep.count_vote`` (counted by the training thread, reset by the leader on the loop, one key at a
time), ``records`` (replaced whole, never mutated) and the group history (written by ``Upkeep`` on the
loop, and while joining by ``RunFinder`` before the loop's upkeep starts).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import time
from dataclasses import replace

import torch

from .. import failpoints
from ..aio import BackgroundLoop
from ..allreduce import PeerSpec, RoundSpec, VoteNode
from ..allreduce.admission import Admission
from ..allreduce.allgather import GatherNode
from ..codecs import result_codec, upload_codec
from ..identity import Identity
from ..optim import LionCub, Resolved
from . import checkpoint, manifest as manifests, reachability, snapshot
from .accuse import AccuseServer, Suspicions, send_accusation
from .admit import AdmitServer
from .closing import RunEnd
from .config import SwarmConfig
from .dht_process import port_in_use, start_dht, start_failure, stop_dht
from .errors import SwarmError
from .finding import RunFinder
from .manifest import Manifest
from .group_notice import GroupNoticeServer, notice_of, send_notices
from .membership import Directory, GroupHistory, GroupRecord, PeerRecord
from .momentum_sync import MomentumRounds, MomentumSync
from .probe import serve_probe
from .dht_budget import dht_validators
from .records import RateLimitedLog
from .tickets import TicketBook
from .pipeline import PipelineSettings, RoundInFlight, VotePipeline
from .state_sync import StateSync
from .state_transfer import StateTransferError
from .joining import Joining
from .round_book import RoundBook, RoundShape
from .settings import RunSettings
from .upkeep import GROUP_TTL, Local, Upkeep
from .verdicts import Verdicts

logger = logging.getLogger(__name__)
PORT_TRIES = 3  # daemon starts on a freshly picked port, when another process takes the first one meanwhile


def _anchor_ids(maddrs: list[str]) -> list[str]:
    """Peer ids named in multiaddrs (``.../p2p/ID``): the coordinators this peer was told to trust."""
    ids = []
    for maddr in maddrs:
        parts = str(maddr).split("/")
        for i, part in enumerate(parts[:-1]):
            if part in ("p2p", "ipfs") and parts[i + 1] not in ids:
                ids.append(parts[i + 1])
    return ids


# measured (docs/reliability.md, "Identities an attacker controls"; benchmarks/identities.py)
OPEN_RUN = ("run %s is open: anyone who reaches it may vote, and identities are free (3 identities started beside 3 "
            "volunteers took digits' test accuracy from 92.8%% to 8.9%% in 100 steps): invite the volunteers of a real "
            "run (lioncub-invite, see the README)")


def _from_rounds(name: str) -> property:
    return property(lambda swarm: getattr(swarm.rounds, name), doc=f"``VotePipeline.{name}``")


class Swarm:
    # what the round pipeline counts, read by trainers, monitors and tests (``pipeline.py`` owns them)
    stats = _from_rounds("stats")
    follow = _from_rounds("follow")
    repairs = _from_rounds("repairs")
    skips = _from_rounds("skips")
    rejoins = _from_rounds("rejoins")
    missed_rounds = _from_rounds("missed_rounds")
    last_report = _from_rounds("last_report")
    stranded = _from_rounds("stranded")
    failures = property(lambda swarm: swarm.upkeep.failures, doc="``Upkeep.failures``")
    failing_since = property(lambda swarm: swarm.upkeep.failing_since, doc="``Upkeep.failing_since``")
    final_repairs = property(lambda swarm: swarm.end.repairs, doc="``RunEnd.repairs``: final parameters downloaded")

    def __init__(self, config: SwarmConfig | None = None, **kwargs):
        self.config = config = config or SwarmConfig(**kwargs)
        self.loop = BackgroundLoop(f"swarm-{config.run_id}")
        self.log = RateLimitedLog(logger)
        self._background: set[concurrent.futures.Future] = set()
        self.optimizer: LionCub | None = None
        self.final_step: int | None = None  # where this peer stops (the trainer's --steps): no group starts later
        self._refresher: concurrent.futures.Future | None = None
        self._closed = False
        self._joined = False
        self._idle = True  # joining or waiting for peers, not stepping: group changes can take effect at once
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
        if config.ticket is not None and config.invitation().peer_id != self.identity.peer_id:
            self.loop.stop()
            raise SwarmError(f"the ticket is for peer id {config.invitation().peer_id}, but this peer's identity is "
                             f"{self.identity.peer_id}: pass --identity-path with the key file whose id the organizer "
                             f"signed (lioncub-invite id --identity-path FILE prints it)")
        asked = config
        for attempt in range(PORT_TRIES):
            config = self._plan_listening(asked)
            try:
                # a key made just now is not anyone else's: skip hivemind's check (it starts a second daemon, ~0.45 s)
                self.dht = start_dht(initial_peers=config.initial_peers, host_maddrs=config.host_maddrs,
                                     announce_maddrs=config.announce_maddrs or None, identity_path=self.identity.path,
                                     check_if_identity_free=not fresh,
                                     record_validators=dht_validators(config.run_id, authority=config.invitation(
                                         ).authority if config.ticket is not None else None),  # record check + storage budget
                                     client_mode=config.client_mode, no_listen=config.client_mode,
                                     nat_port_map=config.nat_probing, auto_nat=config.nat_probing)
                break
            except Exception as e:
                # the check picked a free port (any was asked for); something else took it before the daemon bound it
                picked = list(config.host_maddrs) != list(asked.host_maddrs)
                if port_in_use(e) and picked and attempt + 1 < PORT_TRIES:
                    logger.info("the port picked for listening was taken meanwhile: picking another")
                    continue
                self.loop.stop()
                raise SwarmError(start_failure(e, config.host_maddrs)) from e
        self.config = config
        try:
            self._start(config)
        except BaseException:
            self.shutdown()
            raise

    def _plan_listening(self, config: SwarmConfig) -> SwarmConfig:
        """``config`` with how this peer listens (``reachability.plan``): before the daemon takes the
        port, can peers dial it? Client mode is decided here, once."""
        try:
            self.listen_plan = self.loop.run(reachability.plan(config.client_mode, config.initial_peers,
                                                               config.host_maddrs, config.announce_maddrs), timeout=90)
        except Exception as e:  # the check must never keep a peer out: listen as configured
            self.listen_plan = reachability.ListenPlan(False, list(config.host_maddrs), list(config.announce_maddrs),
                                                       f"the reachability check failed ({type(e).__name__}: {e})")
        plan = self.listen_plan
        if plan.note:  # one line: whether peers can dial this machine, and what this peer does about it
            logger.log(logging.WARNING if plan.client_mode else logging.INFO, "%s", plan.note)
        return replace(config, client_mode=plan.client_mode, host_maddrs=plan.host_maddrs,
                       announce_maddrs=plan.announce_maddrs)

    def _start(self, config: SwarmConfig) -> None:
        self.p2p = self.loop.run(self.dht.replicate_p2p(), timeout=30)
        self.peer_id = self.p2p.peer_id.to_base58()
        history = GroupHistory()  # Upkeep writes it on the loop; the round book and this facade read it
        self.book = RoundBook(config.run_id, self.peer_id, history, liars=lambda: self.liars)
        self.verdicts = Verdicts(self.peer_id, self.book, lambda to, a: send_accusation(self.p2p, to, a),
                                 self._in_background, self.log)
        if self.peer_id != self.identity.peer_id:
            raise SwarmError("the DHT runs with another key than the identity file")
        ticket = config.invitation() if config.ticket is not None else None
        self.tickets = TicketBook(config.run_id, ticket.authority, own=ticket) if ticket is not None else None
        self.admission = Admission(config.run_id, config.run_secret.encode() if config.run_secret else None,
                                   frozenset(config.allow_peers), invitations=self.tickets)
        self.directory = Directory(self.dht, config.run_id, self.identity, tickets=self.tickets)
        if self.admission.open:
            logger.warning(OPEN_RUN, config.run_id)
        self.upkeep = Upkeep(peer_id=self.peer_id, spec=self._my_spec(), run_id=config.run_id,
                             directory=self.directory, store_manifest=self._store_manifest, admission=self.admission,
                             verdicts=self.verdicts, local=self._local, record_ttl=config.record_ttl,
                             refresh_period=config.refresh_period, lead_steps=config.lead_steps, log=self.log,
                             history=history)
        self.finder = RunFinder(loop=self.loop, p2p=self.p2p, dht=self.dht, directory=self.directory,
                                upkeep=self.upkeep, admission=self.admission, identity=self.identity,
                                run_id=config.run_id, peer_id=self.peer_id, anchors=_anchor_ids(config.initial_peers),
                                log=self.log)
        self.settings = RunSettings(config.run_id, self.opinions, self.peer_id)
        self.node = VoteNode(self.p2p, config.allreduce, self.admission, identity=self.identity)
        self.state = StateSync(p2p=self.p2p, loop=self.loop, run_id=config.run_id, peer_id=self.peer_id,
                               admission=self.admission, upkeep=self.upkeep, liars=lambda: self.liars,
                               max_uploads=config.max_state_uploads, join_timeout=config.join_timeout,
                               round_bound=self._round_bound())
        self.state.on_load = lambda: self.loop.loop.call_soon_threadsafe(self.node.resumed)
        self.joining = Joining(run_id=config.run_id, peer_id=self.peer_id, client_mode=bool(config.client_mode),
                               refresh_period=config.refresh_period, loop=self.loop, finder=self.finder,
                               settings=self.settings, upkeep=self.upkeep, state=self.state, directory=self.directory,
                               my_spec=self._my_spec, dialed_others=bool(config.initial_peers))
        self.joining.discover()
        self._apply_settings()
        if self.history.latest is not None:
            self.node.group_epoch = self.history.latest.epoch
        self.upkeep.on_epoch = lambda epoch: setattr(self.node, "group_epoch", epoch)
        self.node.in_run = self.book.in_run  # other groups' members ask for second-level slices as members
        self.upkeep.stop_waiting_for = self.node.stop_waiting_for
        self.upkeep.groups_of = self.book.groups_of  # who counts whose votes in a two-level vote
        self.gather = GatherNode(self.p2p, config.allreduce, self.admission) \
            if self.config.transport == "allgather" else None
        settings = PipelineSettings(config.run_id, bool(config.client_mode), self.config.full_digest_every, self.delay,
                                    self._round_bound())
        self.rounds = VotePipeline(peer_id=self.peer_id, settings=settings, loop=self.loop, node=self.node,
                                   gather=self.gather, upkeep=self.upkeep, state=self.state, verdicts=self.verdicts,
                                   spec=lambda group, step: self.book.spec(group, step), rejoin=self._rejoin,
                                   in_background=self._in_background, log=self.log)
        self.end = RunEnd(peer_id=self.peer_id, loop=self.loop, upkeep=self.upkeep, state=self.state,
                          refresh_period=config.refresh_period)
        self.admit_server = AdmitServer(self.p2p, self.admission, self.upkeep.admitted.add)
        self.accuse_server = AccuseServer(self.p2p, self.verdicts.on_header, self.verdicts.on_accusation,
                                          self.book.is_member)
        self.notices = GroupNoticeServer(self.p2p, config.run_id, self.directory.verifier, self.book.is_member,
                                         lambda group: self.upkeep.consider([group], "pushed"), self.log)
        self.upkeep.on_new_group = self._notify_members
        self.loop.run(self._start_services(), timeout=30)
        if failpoints.ARMED is not None:
            self.node.on_event.append(self._failpoint)

    def visible_maddrs(self) -> list[str]:
        """The addresses other peers can dial this one at (give them as --initial-peers)."""
        if self.config.client_mode:
            return []
        return [str(m) for m in self.dht.get_visible_maddrs()]

    def _failpoint(self, event: str) -> None:
        kind, step = self.rounds.current
        point = {"vote_chunk": "momentum" if kind == "momentum" else "upload", "finalize": "reduce",
                 "result_chunk": "result", "combined_chunk": "combine"}.get(event)
        if point is not None and (kind == "vote" or point == "momentum"):
            failpoints.reached(point, step)

    async def _start_services(self) -> None:
        await self.node.start()
        await serve_probe(self.p2p, self.admission)
        if self.gather is not None:
            await self.gather.start()
        await self.state.server.start()
        await self.admit_server.start()
        await self.accuse_server.start()
        await self.notices.start()
        if not self.config.client_mode:  # tell joiners whether they can be dialed (reachability.py)
            await reachability.serve_dialback(self.p2p)

    # -- the run's settings (``settings.py``) ------------------------------------------------------------

    @property
    def manifest(self) -> Manifest:
        """This peer's settings: the run's, adopted where it had no opinion (``settings.py``)."""
        return self.settings.current

    @property
    def run_manifest(self) -> Manifest | None:
        """The run's manifest as published by its founder or a coordinator (``settings.py``)."""
        return self.settings.run

    def _apply_settings(self) -> None:
        """Make this peer run with ``self.manifest``'s swarm settings (codecs, schedule, ...)."""
        m = self.manifest
        self.config = replace(self.config, upload=m.upload, result=m.result, transport=m.transport,
                              momentum=m.momentum_schedule(), momentum_rule=m.momentum_rule,
                              full_digest_every=m.full_digest_every, seed=m.seed, delay=m.delay or 0,
                              max_group=m.max_group)
        self.upload = upload_codec(m.upload)
        self.result = result_codec(m.result)

    # -- joining ---------------------------------------------------------------------------------

    def join(self, optimizer: LionCub, timeout: float | None = None, *, wait_peers: int = 0,
             wait_timeout: float = 300.0) -> int:
        """Become a voting member: resume a checkpoint, then start the run or fetch the swarm's state;
        ``wait_peers``: then wait up to ``wait_timeout`` s until the group has that many members holding
        the state, so that all start together (``joining.py``). Returns the step training continues
        from. Raises SwarmError (one line) for what the volunteer must fix: a refused admission, a model
        or settings that differ from the run's, no group in time.

        Step right after it returns: from then on, the groups this peer leads start a few steps ahead
        of its step, and a newcomer's state download waits for a donor to reach that step. To start
        together with others, pass ``wait_peers`` rather than waiting on your own."""
        if optimizer.aggregator is not self:
            raise ValueError("create the optimizer with aggregator=<this swarm>")
        try:
            self.config.momentum.check_names(name for name, _ in optimizer.momentum_buffers())
        except ValueError as e:
            raise SwarmError(str(e)) from None
        self.optimizer = self.state.optimizer = self.rounds.optimizer = optimizer
        config = self.config  # the run's settings, adopted at start (``_apply_settings``)
        sync = MomentumSync(config.momentum, config.momentum_rule, optimizer.momentum_buffers, config.seed)
        self.momentum = MomentumRounds(sync, self._momentum_spec, self._run_momentum, self._start_momentum,
                                       lambda: self.state.loads, self.log)
        self.book.shape = RoundShape(optimizer.buffer_bytes, self.upload, self.result, config.seed,
                                     config.max_group or 0, momentum=sync.spec)
        if self.config.checkpoint_dir:
            restored = checkpoint.restore(self.config.checkpoint_dir, optimizer, self.config.run_id)
            if restored is not None:
                logger.info("resumed checkpoint at step %d", restored)
        came_in_at = optimizer.step_count  # before any download
        deadline = time.monotonic() + (timeout or self.config.join_timeout)
        applied = Manifest(**{name: getattr(self.config, name) for name in manifests.SWARM_FIELDS})
        founded = self.joining.find_or_found(optimizer, applied, deadline)
        self._joined = True
        self._refresher = asyncio.run_coroutine_threadsafe(self.upkeep.run_forever(), self.loop.loop)
        try:
            self.joining.hold_state(deadline, founded=founded)
        except StateTransferError as e:
            raise SwarmError(f"could not download the run's state: {e}. Check this machine's connection (a "
                             "download needs about 1 Mbit/s), then start again: the run goes on without you") from None
        except TimeoutError:  # a DHT call of the join that never came back (``BackgroundLoop.run``)
            raise SwarmError("the swarm did not answer while joining (a DHT call timed out): check this machine's "
                             "connection and the --initial-peers, then start again") from None
        # Unless it waits for peers, the caller steps next: a group planned from here on must not start at
        # its step. One that did (planned between founding and a slow first step) made the first round
        # wait for a newcomer listed in it while the newcomer waited for the state of that step (10 s).
        self._idle = wait_peers > 0
        self.state.synced = True
        self.loop.run(self.upkeep.announce(), timeout=30)
        self.rounds.prepare(optimizer.step_count)
        if wait_peers:
            try:
                self.joining.wait_for_peers(wait_peers, time.monotonic() + wait_timeout, came_in_at=came_in_at,
                                            step=lambda: optimizer.step_count)
            finally:
                self._idle = False
        return optimizer.step_count

    def wait_for_peers(self, count: int, timeout: float = 300.0) -> None:
        """Gone: waiting after ``join`` let the groups this peer leads start at a step it was not taking."""
        raise SwarmError(f"Swarm.wait_for_peers is gone: pass wait_peers={count} (and wait_timeout={timeout:g}) to "
                         f"join() instead, which waits before the first step")

    def settle_final_state(self, seconds: float) -> bool:
        """After this peer's last step (``final_step``): make sure the group ends on one state, up to
        ``seconds`` (``closing.RunEnd.settle``: the last round has no next one whose state tags would
        repair a split in it). Counted in ``final_repairs``. True when every member announced the same
        parameters in time; call it before saving the final state."""
        if self.optimizer is None or self._closed or self.final_step is None \
                or self.optimizer.step_count != self.final_step:
            return False
        self._idle = True
        return self.end.settle(self.optimizer, seconds)

    def linger(self, seconds: float) -> None:
        """After this peer's last step: stay up to ``seconds`` while a live member is behind, leading and
        serving this final state (``closing.RunEnd.linger``)."""
        if self.optimizer is None or self._closed:
            return
        self._idle = True
        self.end.linger(self.optimizer, seconds)

    def _my_spec(self) -> PeerSpec:
        return PeerSpec(self.peer_id, self.config.weight, self.config.client_mode)

    # -- rounds ------------------------------------------------------------------------------------

    def before_step(self) -> None:
        """Called by LionCub before the step touches any state: snapshots wait from here on."""
        self.state.enter_step()

    def exclusive(self) -> contextlib.AbstractContextManager:
        """A section that changes the state between steps (``LionCub.flush``): no snapshot meanwhile."""
        return self.state.exclusive()

    def _round_bound(self) -> float:
        """The longest a vote round may take before its voters give up on it."""
        cfg = self.config.allreduce
        return cfg.result_timeout + cfg.recovery_timeout + 30

    @property
    def delay(self) -> int:
        """1 with overlapped rounds (``LionCub`` then calls ``submit``), else 0."""
        return self.config.delay or 0

    def aggregate(self, upload: torch.Tensor, *, step: int) -> torch.Tensor | None:
        return self.submit(upload, step=step).wait()

    def submit(self, upload: torch.Tensor, *, step: int) -> "RoundInFlight | Resolved":
        """Start the vote of ``step``; the returned handle's ``wait()`` gives its update (``pipeline.py``)."""
        if self.optimizer is None:
            raise SwarmError("call swarm.join(optimizer) before training")
        self.state.enter_step()
        self._idle = False
        return self.rounds.submit(upload, step)

    def _rejoin(self) -> None:
        self.state.synced = False
        self.joining.sync_from_swarm(time.monotonic() + self.config.join_timeout, params_only=True)
        self.state.synced = True
        self.rounds.prepare(self.optimizer.step_count)

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

    def after_step(self, optimizer: LionCub) -> None:
        """Momentum averaging, snapshots for joiners, checkpoints: each failure is logged, never raised."""
        try:
            step = optimizer.step_count
            try:
                synced = self.momentum.after_step(step)
                if synced is not None:
                    self.rounds.stats.momentum_synced = synced
            except Exception as e:
                self.log.warning("momentum", "step %d: momentum averaging failed, skipped: %s: %s", step,
                                 type(e).__name__, e)
            wanted = self.state.server.wanted_step()
            if (wanted is not None and wanted <= step) or self._adds_newcomers_at(step):
                try:
                    blob, digest = snapshot.encode(optimizer)
                    self.loop.run(self.state.server.offer(step, blob, digest), timeout=30)
                except Exception as e:
                    self.log.warning("offer", "step %d: no snapshot for joiners: %s: %s", step, type(e).__name__, e)
            if self.config.checkpoint_dir and self.config.checkpoint_every and step % self.config.checkpoint_every == 0:
                try:
                    checkpoint.save(self.config.checkpoint_dir, optimizer, self.config.run_id)
                except OSError as e:
                    self.log.warning("checkpoint", "step %d: checkpoint not written to %s: %s", step,
                                     self.config.checkpoint_dir, e)
        finally:
            self.state.exit_step()

    def _adds_newcomers_at(self, step: int) -> bool:
        """The group of ``step`` starts there and lists peers the one before did not. They download the
        state of ``step`` and may ask for it only once this peer is in that step, when it has no snapshot
        (its round waited out the upload timeout for their votes): make one now."""
        group = self.history.for_step(step)
        if group is None or group.from_step != step or not self.state.synced:
            return False
        before = self.history.for_step(step - 1)
        return bool(set(group.member_ids()) - set(before.member_ids() if before is not None else ()))

    def _momentum_spec(self, step: int) -> RoundSpec | None:
        """The momentum round after ``step``, with the group this peer voted that step in (None: not a member)."""
        group = self.history.for_step(step - 1)
        if group is None or self.peer_id not in group.member_ids():
            return None
        return self.book.spec(group, step, kind="momentum")

    def _momentum_round(self, spec: RoundSpec, upload: torch.Tensor):
        """The coroutine of a momentum round: behind, the others' average only (its values are late anyway)."""
        return self.node.follow_round(spec) if self.rounds.follow.following else self.node.run_round(spec, upload)

    def _run_momentum(self, spec: RoundSpec, upload: torch.Tensor):
        self.rounds.current = ("momentum", spec.step)  # a whole-buffer round is the step's (failpoints)
        return self.loop.run(self._momentum_round(spec, upload), timeout=self.config.allreduce.result_timeout + 30)

    def _start_momentum(self, spec: RoundSpec, upload: torch.Tensor) -> concurrent.futures.Future:
        # not marked current: a streamed round runs beside the next vote
        return asyncio.run_coroutine_threadsafe(self._momentum_round(spec, upload), self.loop.loop)

    def _notify_members(self, group: GroupRecord) -> None:
        """Send a group this peer planned to its other members (``group_notice.py``), in the background."""
        others = [pid for pid in group.member_ids() if pid != self.peer_id]
        if others:
            notice = notice_of(self.identity, self.config.run_id, group, GROUP_TTL)
            self._in_background(send_notices(self.p2p, notice, others))

    # -- caught reducers ----------------------------------------------------------------------------

    def _in_background(self, coro) -> None:
        if self.loop is None:  # shut down
            coro.close()
            return
        future = asyncio.run_coroutine_threadsafe(coro, self.loop.loop)
        self._background.add(future)
        future.add_done_callback(self._background.discard)

    # -- membership upkeep (``upkeep.py``, on the loop) ------------------------------------------------

    @property
    def history(self) -> GroupHistory:
        return self.upkeep.history

    @property
    def records(self) -> dict[str, PeerRecord]:
        return self.upkeep.records

    def _local(self) -> Local:
        """What upkeep reads of this side (``upkeep.Local``), taken on the loop when it needs it."""
        opt, stats = self.optimizer, self.rounds.stats
        seconds = max(stats.seconds, 1e-6)
        return Local(joined=opt is not None, step=opt.step_count if opt is not None else 0, synced=self.state.synced,
                     following=self.rounds.follow.following, idle=self._idle, final_step=self.final_step,
                     final=self.end.final if hasattr(self, "end") else "",
                     bytes_up_per_s=stats.bytes_up / seconds, bytes_down_per_s=stats.bytes_down / seconds,
                     samples_per_step=self.samples_per_step, loss=self.last_loss, run_manifest=self.run_manifest,
                     steps_per_s=1.0 / pace if (pace := self.rounds.pace.step_s) > 0 else 0.0,
                     asked_step=node.asked_step.get("vote", -1) if (node := getattr(self, "node", None)) else -1)

    async def _store_manifest(self, manifest: Manifest) -> None:
        await manifests.store(self.dht, self.config.run_id, manifest, self.identity)

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
                loop.run(self.upkeep.announce(leaving=True), timeout=5)
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
            stop_dht(dht)

    def __enter__(self) -> "Swarm":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
