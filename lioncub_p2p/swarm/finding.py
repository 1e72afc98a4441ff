"""RunFinder: finding a run on the DHT and being admitted to its group (training thread, while joining).

A newcomer reads the run's signed group records and asks their authors, most populated group first,
to admit it (``admit.py``). The first author that does, and in a private run proves the run key back,
gives the group this peer trusts (``Upkeep.trust``). Refusals become one line naming the fix
(``AdmissionRefused``) only when every author answered: an author that could not be reached may be
the run's live leader, and founding a group beside it would split the run. The run's manifest is
read from the same place, and taken only from the trusted group's members or the coordinators.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from ..aio import BackgroundLoop
from ..allreduce.admission import Admission
from ..identity import Identity, Verifier
from . import manifest as manifests
from .admit import Verdict, ask_admission
from .errors import AdmissionRefused
from .manifest import Manifest
from .membership import Directory, GroupRecord
from .records import RateLimitedLog
from .upkeep import GROUP_TTL, Upkeep

logger = logging.getLogger(__name__)

MAX_CANDIDATES = 8  # group records a newcomer asks for admission, most populated first
ALLOW_LIST_REASON = "not on the run's allow-list"  # admit.py's reason for a peer the allow-list leaves out


def refusal(verdict: Verdict, run_id: str, author: str, peer_id: str, needs_secret: bool,
            invited: bool = False) -> str | None:
    """What stops this peer, in one line, when ``author`` answered with ``verdict``; None: no refusal
    (admitted, or an author in a private run that did not prove the key, whose group is ignored).
    ``invited``: this peer holds a ticket (``--ticket``)."""
    if verdict.not_invited and not invited:
        return (f"run {run_id} is invited-only: ask its organizer for a ticket for peer id {peer_id} (they run "
                f"lioncub-invite issue --peer {peer_id} ...), then pass it with --ticket FILE and the same "
                f"--identity-path")
    if verdict.not_invited:
        return (f"run {run_id} refused this peer's ticket: {verdict.reason} (asked {author}): ask the run's "
                f"organizer for a new ticket for peer id {peer_id}")
    if invited and not verdict.invited:
        return (f"run {run_id} asks for no ticket (not an invited run; asked {author}): check --run-id and "
                f"--initial-peers, or drop --ticket")
    if not verdict.admitted and verdict.secret_required and not needs_secret:
        return f"run {run_id} is private: pass its --run-secret (its leader {author} refused this peer)"
    if not verdict.admitted and verdict.reason == ALLOW_LIST_REASON:
        return (f"run {run_id} refused this peer: not on the run's allow-list (asked {author}): ask the run's "
                f"organizer to add peer id {peer_id}")
    if not verdict.admitted:
        return f"run {run_id} refused this peer: {verdict.reason} (asked {author}): check --run-secret"
    if needs_secret and not verdict.secret_required:
        return f"run {run_id} is open (no run secret): drop --run-secret"
    return None


class RunFinder:
    def __init__(self, *, loop: BackgroundLoop, p2p: Any, dht: Any, directory: Directory, upkeep: Upkeep,
                 admission: Admission, identity: Identity, run_id: str, peer_id: str, anchors: list[str],
                 log: RateLimitedLog):
        self.loop, self.p2p, self.dht, self.directory, self.upkeep = loop, p2p, dht, directory, upkeep
        self.admission, self.identity, self.verifier = admission, identity, Verifier()
        self.run_id, self.peer_id, self.anchors, self.log = run_id, peer_id, anchors, log
        self.proved_to: set[str] = set()  # group authors that admitted this peer
        self.unreachable = 0  # group authors that did not answer the last admission requests
        self.ended: set[str] = set()  # authors of groups found ended (said once)

    def find_group(self) -> None:
        """If this peer trusts no group yet: ask the authors of the run's group records to admit it, and
        trust the first that does. Raises AdmissionRefused (one line) if every author refused."""
        if self.upkeep.history.latest is not None:
            return
        candidates = self.loop.run(self.directory.groups(), timeout=30)
        self.unreachable = 0  # (counted again below): a group record that expired leaves nobody to wait for
        if candidates:
            self.upkeep.records = self.loop.run(self.directory.peers(), timeout=30)
            group = self.admitted_group(candidates)
            if group is not None:
                self.upkeep.trust(group)

    def read_manifest(self) -> Manifest | None:
        """The run's manifest, as published by a member of the trusted group or a coordinator."""
        latest = self.upkeep.history.latest
        members = ([latest.author] + latest.member_ids()) if latest is not None else []
        found = self.loop.run(manifests.read(self.dht, self.run_id, self.verifier, self.log,
                                             authors=set(members) | set(self.anchors)), timeout=30)
        return manifests.choose(found, members, self.anchors)

    def admitted_group(self, candidates: list[GroupRecord]) -> GroupRecord | None:
        """Ask the authors of the run's group records, most populated first, to admit this peer; the first
        that does (and, in a private run, proves the run key back) gives the group this peer trusts.
        Raises AdmissionRefused if every author answered and refused."""
        self.unreachable = 0
        live = {pid for pid, r in self.upkeep.records.items() if not r.leaving}
        # the rule members follow groups by (``Upkeep.admissible``): a lure listing peers the run never
        # admitted, or weights past their tickets, is not asked
        candidates = [g for g in candidates if self.upkeep.admissible(g) is None]
        ranked = sorted(candidates, key=lambda g: (-sum(pid in live for pid in g.member_ids()), -g.epoch, g.author))
        refusals, failures = [], 0
        for group in ranked[:MAX_CANDIDATES]:
            if group.author == self.peer_id:
                continue
            try:
                verdict = self.loop.run(ask_admission(self.p2p, group.author, self.admission), timeout=15)
            except Exception as e:  # unreachable, or not a lioncub peer: try the next
                # a peer that is up but serves no admission is no member; a group none of whose members
                # announces itself (no record, or a leaving one) has ended: nobody to wait for (reusing a run
                # id right after its run ended waited ~130 s, then stopped blaming the firewall)
                if not live & set(group.member_ids()):
                    if group.author not in self.ended:
                        self.ended.add(group.author)
                        logger.info("the group of epoch %d of run %s has ended: none of its members announces "
                                    "itself, and its author %s does not answer", group.epoch, self.run_id, group.author)
                    continue
                if "protocols not supported" not in str(e):
                    failures += 1
                self.log.warning(f"ask:{group.author}", "could not ask %s for admission: %s: %s", group.author,
                                 type(e).__name__, e)
                continue
            if verdict.busy:  # too many newcomers at once (or someone holding the slots): ask again later
                failures += 1
                self.log.warning(f"busy:{group.author}", "%s is busy admitting others: asking again", group.author)
                continue
            line = refusal(verdict, self.run_id, group.author, self.peer_id, self.admission.needs_secret,
                           self.admission.invited)
            if line is not None and self.admission.invited and verdict.invited and not verdict.member_proved:
                # a refusal from a "member" that showed no ticket of the run's authority is anyone's word
                self.log.warning(f"impostor:{group.author}", "%s refused this peer without proving it is invited: "
                                 "ignoring it", group.author)
            elif line is not None:
                refusals.append(line)
            elif (self.admission.needs_secret or self.admission.invited) and not verdict.member_proved:
                self.log.warning(f"impostor:{group.author}", "%s did not prove the run %s: ignoring its group",
                                 group.author, "secret" if self.admission.needs_secret else "authority's ticket")
            else:
                self.proved_to.add(group.author)
                return group
        self.unreachable = failures
        if refusals and not failures:
            raise AdmissionRefused(refusals[0])
        return None

    def found(self, record: GroupRecord, manifest: Manifest) -> bool:
        """Publish the run's manifest and ``record`` (a group of this peer alone); True if this peer keeps
        it. Two peers founding at once both publish; the one with the smaller peer id keeps its group and
        the other joins it (if it admits it)."""
        self.loop.run(manifests.store(self.dht, self.run_id, manifest, self.identity), timeout=30)
        self.upkeep.manifest_published = time.monotonic()
        self.loop.run(self.directory.publish_group(record, ttl=GROUP_TTL), timeout=30)
        self.upkeep.published = time.monotonic()
        time.sleep(0.5)  # let a concurrent founder's record land too
        others = [g for g in self.loop.run(self.directory.groups(), timeout=30)
                  if g.author != self.peer_id and (g.epoch > 0 or g.author < self.peer_id)]
        if others:
            self.upkeep.records = self.loop.run(self.directory.peers(), timeout=30)
            group = self.admitted_group(others)
            if group is not None:
                self.upkeep.trust(group)
                return False
        self.upkeep.trust(record)
        return True

    def ask_again(self, latest: GroupRecord | None) -> None:
        """Still not in the group: prove the key to its current author, and look for a newer group this
        peer cannot follow through its own history (two peers founded at once, or its lineage died)."""
        # an invited run asks again even an author that admitted this peer once: a ticket can be revoked
        if latest is not None and latest.author != self.peer_id \
                and (latest.author not in self.proved_to or self.admission.invited):
            try:
                verdict = self.loop.run(ask_admission(self.p2p, latest.author, self.admission), timeout=15)
                if verdict.admitted:
                    self.proved_to.add(latest.author)
            except Exception as e:
                logger.debug("asking %s for admission failed: %s", latest.author, e)
                verdict = None
            # revoked or expired since: no waiting on a group, once this peer's own reading of the authority's
            # list agrees (a refusal alone is its author's word, and stranding stops the trainer for good)
            own = self.admission.invitations.refusal(self.peer_id) if self.admission.invited else None
            if verdict is not None and verdict.not_invited and verdict.member_proved and own is not None:
                raise AdmissionRefused(refusal(verdict, self.run_id, latest.author, self.peer_id,
                                               self.admission.needs_secret, self.admission.invited))
        self.upkeep.records = self.loop.run(self.directory.peers(), timeout=30)
        candidates = [g for g in self.loop.run(self.directory.groups(), timeout=30)
                      if latest is None or g.epoch > latest.epoch]
        if candidates:
            group = self.admitted_group(candidates)
            if group is not None:
                self.loop.run(self.upkeep.adopt(group), timeout=10)  # on the loop, the history's only writer
