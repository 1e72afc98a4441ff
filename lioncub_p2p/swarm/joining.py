"""Becoming a member of a run: find its group or found it, get listed, hold its state, start together.

``Swarm.join`` wires the optimizer into the rooms and calls these in order:

* ``find_or_found``: read the run's group and manifest (``RunFinder``: admission is asked of the
  group's author), wait while the author does not answer or while this peer, a client, could not
  reduce for a group of its own; then check the optimizer against the run's settings
  (``RunSettings.settle``) and found the run if no group exists;
* ``hold_state``: a peer not yet listed waits until the leader adds it (asking for admission again
  every 3 s: a new leader, a lineage it lost) and downloads the state of that group's first step; a
  listed one downloads it too (being listed is not holding the state); a founder holds it already.
  A peer dropped from the group comes back the same way (``Swarm._rejoin``, its own momenta kept);
* ``wait_for_peers``: with ``join(wait_peers=n)``, until the group has n members holding the state.

Each stop is a ``SwarmError`` of one line naming what the volunteer can check. Owned by the training
thread. The group history and the records are written on the loop by ``Upkeep`` (records replaced
whole), and on the training thread by ``RunFinder`` and ``wait_for_peers`` before ``Upkeep.run_forever``
starts, or in a read made whole on the loop. This peer stays idle while it waits for peers, so the
groups it leads meanwhile take effect at once (``Upkeep.lead``).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ..aio import BackgroundLoop
from ..allreduce import PeerSpec
from ..optim import LionCub
from ..wire import PROTOCOL_VERSION
from .errors import SwarmError
from .finding import RunFinder
from .manifest import Manifest
from .membership import Directory, GroupRecord, assigned_weight, reducer_floor
from .settings import RunSettings
from .state_sync import StateSync
from .upkeep import Upkeep

logger = logging.getLogger(__name__)
ASK_AGAIN_S = 3.0  # a peer not listed yet asks for admission again this often


class Joining:
    def __init__(self, *, run_id: str, peer_id: str, client_mode: bool, refresh_period: float, loop: BackgroundLoop,
                 finder: RunFinder, settings: RunSettings, upkeep: Upkeep, state: StateSync, directory: Directory,
                 my_spec: Callable[[], PeerSpec], dialed_others: bool = False):
        self.run_id, self.peer_id, self.client_mode, self.refresh_period = run_id, peer_id, client_mode, refresh_period
        self.dialed_others = dialed_others  # started with initial peers: it meant to join a run
        self.loop, self.finder, self.settings, self.upkeep = loop, finder, settings, upkeep
        self.state, self.directory, self.my_spec = state, directory, my_spec

    @property
    def latest(self) -> GroupRecord | None:
        return self.upkeep.history.latest

    def discover(self) -> None:
        """Read the run's group and manifest; if a group exists, ask its author to admit this peer and
        adopt the run's manifest. Raises AdmissionRefused or SettingsMismatch (one line each)."""
        self.finder.find_group()
        self.settings.adopt(self.finder.read_manifest())

    def find_or_found(self, optimizer: LionCub, applied: Manifest, deadline: float) -> bool:
        """Find the run's group, or found the run; True when this peer founded it. ``applied``: the swarm
        settings this peer runs with (adopted when it started)."""
        self.discover()
        if self.latest is None:
            time.sleep(1.0)  # a group record stored moments ago may not have reached us yet
            self.discover()
        announced = self.settings.run is not None  # a manifest read (a coordinator's, or the run's founder's)
        # the run's group exists but its author did not answer: wait for it or a new leader. A client
        # cannot found a run (nobody could dial it to reduce): it waits for a group that can.
        while self.latest is None and (self.finder.unreachable or self.client_mode) and time.monotonic() < deadline:
            time.sleep(2.0)
            self.discover()
        if self.latest is None and self.finder.unreachable:  # founding a group of our own would split the run
            raise SwarmError(f"the group of run {self.run_id} did not answer this peer's admission request "
                             f"in time: can this machine reach its peers (firewall, --initial-peers)?")
        if self.latest is None and self.client_mode:
            raise SwarmError(f"no group of run {self.run_id} found in time, and a peer in client mode cannot "
                             f"start one (nobody can dial it to reduce): start a listening peer first, or check "
                             f"--run-id and --initial-peers")
        self.settings.settle(optimizer, applied, founding=self.latest is None)
        if self.latest is not None:
            return False
        if self._found(optimizer.step_count, announced):
            return True
        self.discover()  # another peer founded the run at the same moment: take its settings
        self.settings.settle(optimizer, applied, founding=self.latest is None)
        return False

    def _found(self, step: int, announced: bool = True) -> bool:
        """Start the run: publish its manifest and a group of this peer alone; True if this peer keeps it
        (of two peers founding at once, the one with the smaller peer id does: ``RunFinder.found``)."""
        record = GroupRecord(0, step, (self.my_spec(),), author=self.peer_id)
        kept = self.finder.found(record, self.settings.run)
        logger.info("no group found for run %s: %s", self.run_id, "started it" if kept else "another peer started it")
        if kept and not announced:  # a typo in --run-id, or a forgotten --initial-peers, must not train alone unseen
            logger.warning("nobody announces run %r %s: this peer starts it and trains alone until others join (%s)",
                           self.run_id, "at the initial peers (no manifest, no group)" if self.dialed_others
                           else "(no --initial-peers)", "is --run-id right?" if self.dialed_others
                           else "to join a running run, pass --initial-peers")
        return kept

    def hold_state(self, deadline: float, *, founded: bool) -> None:
        """After ``find_or_found``: get listed if need be, and the state of the group's first step."""
        latest = self.latest
        if self.peer_id not in latest.member_ids():
            self.sync_from_swarm(deadline)
        elif not founded:  # the leader may list a peer as soon as it announces: being listed is not holding the state
            self.state.catch_up("join", latest.from_step, latest)

    def sync_from_swarm(self, deadline: float, *, params_only: bool = False) -> None:
        """Wait until the leader adds this peer to a group, then download the state of that step
        (``params_only``: a peer coming back keeps its own momenta, half the bytes)."""
        logger.info("waiting to be added to the group of run %s", self.run_id)
        asked = time.monotonic()
        while True:
            self.loop.run(self.upkeep.refresh_group(), timeout=30)
            latest = self.latest
            if latest is not None and self.peer_id in latest.member_ids():
                break
            if time.monotonic() > deadline:
                raise SwarmError("no group took this peer in time. Is the run alive? Is --run-secret the run's? "
                                 f"Does the run speak protocol version {PROTOCOL_VERSION} (upgrade lioncub-p2p if not)?")
            if time.monotonic() - asked > ASK_AGAIN_S:  # a new leader, or a lineage this peer lost: ask again
                asked = time.monotonic()
                self.finder.ask_again(latest)
            self.loop.run(self.upkeep.announce(), timeout=30)
            time.sleep(self.refresh_period)
        self.state.catch_up("rejoin" if params_only else "join", latest.from_step, latest, params_only=params_only)

    def wait_for_peers(self, count: int, deadline: float, *, came_in_at: int, step: Callable[[], int]) -> None:
        """Block until the group has ``count`` members holding the swarm's state (all start together).

        Returns at once when others trained past ``came_in_at``, the step this peer came in at: a peer
        that comes back to a run in progress must step with the group, not wait for a start that
        happened long ago. ``step``: this peer's step now (a group planned meanwhile starts there)."""
        self.upkeep.records = self.loop.run(self.directory.peers(), timeout=30)
        while True:
            records = self.upkeep.records  # replaced whole on the loop
            if any(r.step > came_in_at for pid, r in records.items() if pid != self.peer_id):
                return
            latest = self.latest
            synced = {pid for pid, r in records.items() if r.synced} | {self.peer_id}
            announced = [records[m.peer_id].weight if m.peer_id in records else m.weight  # 0 in the group while
                         for m in (latest.members if latest else ()) if not m.client_mode]  # it syncs
            floor = reducer_floor(announced) if latest else 0.0

            def weighted(m: PeerSpec) -> bool:  # the group gives it the part its record asks for (none: none)
                record = records.get(m.peer_id)
                if m.reduces or m.client_mode or record is None:
                    return m.reduces or m.client_mode or m.weight == 0
                return assigned_weight(record.weight, syncing=False, following=record.following, floor=floor,
                                       lone_reducers=False) == 0

            settled = latest is not None and all(  # every member synced, and the group says so (weights back)
                m.peer_id in synced and weighted(m) for m in latest.members)
            if settled and len(latest.members) >= count and latest.from_step <= step():
                return
            if time.monotonic() > deadline:
                members = len(latest.members) if latest else 0
                raise SwarmError(f"the group did not reach {count} synced members in time ({members} members, "
                                 f"{len(synced & set(latest.member_ids() if latest else []))} synced)")
            time.sleep(self.refresh_period)
