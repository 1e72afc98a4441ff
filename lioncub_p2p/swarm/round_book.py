"""RoundBook: the rounds of a run as this peer names them, from the group records it follows.

A round is named by its run, the protocol version, its kind, step and group epoch (``round_id``): a
signed result header of another version, whose rules differ, never names a round of this one (an audit
would re-judge it under this version's rules). Every member derives the same
spec from the same group record, so nothing is negotiated per round. With the manifest's
``max_group`` a group too big for one flat round votes two-level (``hierarchy.two_level_layout``,
at least ``MIN_GROUPS`` groups): this peer's round is its group's, whose id is derived from the flat
round's. The book also answers, for audits and accusations, which recent round an id names and whether
a reducer reduced a part in it.

Threads: the training thread names its own rounds (``spec``, which records their steps); the event
loop looks rounds up for ``Verdicts`` and the accusation server. ``steps`` is an ordered dict written
one key at a time by the training thread; the loop only reads it. ``shape`` is set once, by ``join``,
before this peer's first round.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..allreduce import PeerSpec, RoundSpec, hierarchy
from ..allreduce.audit import MAX_EVIDENCE_BYTES
from ..allreduce.commit import MAX_HEADER_BYTES, MAX_LEAF_BYTES, leaf_bytes
from ..codecs import ResultCodec, UploadCodec
from ..wire import PROTOCOL_VERSION
from .accuse import Accusation, Refused
from .membership import GroupHistory, GroupRecord

# a two-level round needs this many groups, else the round is flat: a group can still miss a part the
# others apply (a second-level slice that reached some combiners and not, in time, the others), and
# only a majority of groups tells it so (hierarchy.group_tag);
# of two groups neither is a majority (seen before slices were fetched: a run ending split)
MIN_GROUPS = 3
ROUND_KINDS = ("vote", "momentum")
KEPT_ROUNDS = 512  # this peer's recent rounds whose steps audits and accusations can still name


@dataclass(frozen=True)
class RoundShape:
    """What every vote round of this run is made of: the optimizer's buffer and the manifest's codecs."""
    nbytes: int
    upload: UploadCodec
    result: ResultCodec
    seed: int
    max_group: int = 0  # 0: always flat
    momentum: Callable[[bytes, int, tuple[PeerSpec, ...]], RoundSpec] | None = None  # MomentumSync.spec


class RoundBook:
    def __init__(self, run_id: str, peer_id: str, history: GroupHistory, liars: Callable[[], Mapping[str, str]]):
        self.run_id, self.peer_id, self.history, self.liars = run_id, peer_id, history, liars
        self.shape: RoundShape | None = None  # None until this peer joins: no round of its own yet
        self.steps: OrderedDict[bytes, int] = OrderedDict()  # round id -> step, of this peer's recent rounds

    def round_id(self, kind: str, step: int, epoch: int) -> bytes:
        return hashlib.blake2b(f"{self.run_id}|{PROTOCOL_VERSION}|{kind}|{step}|{epoch}".encode(),
                               digest_size=16).digest()

    def spec(self, group: GroupRecord, step: int, kind: str = "vote", *, own: bool = True) -> RoundSpec:
        """The round of ``step`` with ``group``; ``own``: this peer takes part (the training thread's, kept
        by id for naming what its audits catch later), else another's round read on the loop."""
        shape = self.shape
        rid = self.round_id(kind, step, group.epoch)
        spec = None
        if kind == "vote":
            spec = self.two_level_spec(group, step, rid) or RoundSpec(
                rid, step, group.members, shape.nbytes, shape.upload, shape.result, shape.seed, family="vote")
        if own:  # under both ids: what this peer's audits catch names its group's round of a two-level vote
            self.steps.update(dict.fromkeys({rid, spec.round_id if spec is not None else rid}, step))
            while len(self.steps) > KEPT_ROUNDS:
                self.steps.popitem(last=False)
        return spec or shape.momentum(rid, step, group.members)

    def two_level_spec(self, group: GroupRecord, step: int, rid: bytes) -> RoundSpec | None:
        """This peer's round of a two-level vote (``two_level_specs``); None: a flat round, or not its own."""
        specs = self.two_level_specs(group, step, rid)
        return specs.get(self.peer_id) if specs is not None else None

    def two_level_specs(self, group: GroupRecord, step: int, rid: bytes) -> dict[str, RoundSpec] | None:
        """Every member's round of a two-level vote (``layout``); None: a flat round."""
        layout = self.layout(group)
        if layout is None:
            return None
        return hierarchy.two_level_specs(rid, step, layout, self.shape.nbytes, seed=self.shape.seed, family="vote",
                                         members={m.peer_id: m for m in group.members})

    def layout(self, group: GroupRecord) -> hierarchy.TwoLevelLayout | None:
        """The groups and parts of ``group``'s two-level vote, when the run asks for one (``max_group``) and
        the group makes at least ``MIN_GROUPS`` groups: from the record's members and epoch
        (``hierarchy.two_level_layout``, the same on every peer: no matchmaking), reducers among its
        reducing members. None: a flat vote."""
        shape = self.shape
        if shape is None or not shape.max_group or len(group.members) <= shape.max_group:
            return None
        reducers = {m.peer_id for m in group.members if m.reduces}
        if not reducers:
            return None  # nobody reduces yet (all syncing): missed as a flat round would be
        layout = hierarchy.two_level_layout(group.member_ids(), group.epoch, shape.nbytes, shape.max_group,
                                            reducers=reducers)
        return layout if len(layout.groups) >= MIN_GROUPS else None

    def groups_of(self, group: GroupRecord) -> dict[str, tuple[str, ...]]:
        """Each member's group (itself included) in ``group``'s two-level vote; empty for a flat vote.
        Read on the loop, by the leader and by members reporting the group-mates they miss."""
        layout = self.layout(group)
        return {pid: tuple(g) for g in layout.groups for pid in g} if layout is not None else {}

    # -- looking rounds up (``verdicts.RoundLookup``, the accusation server) -----------------------------

    def step_of(self, round_id: bytes) -> int | None:
        """The step of one of this peer's own recent rounds."""
        return self.steps.get(round_id)

    def latest(self) -> GroupRecord | None:
        return self.history.latest

    def round_of(self, round_id: bytes, step: int, part: int, reducer: str) -> tuple[GroupRecord, str] | None:
        """The group and kind of one of this peer's recent rounds, if ``reducer`` reduced ``part`` in it;
        in a two-level vote, a round of any of the run's groups (``group_round``)."""
        found = self.find_round(round_id, step, part, reducer)
        return found[:2] if found is not None else None

    def find_round(self, round_id: bytes, step: int, part: int,
                   reducer: str) -> tuple[GroupRecord, str, RoundSpec | None] | None:
        """``round_of``, and the group's round of a two-level vote it is (None: a flat round)."""
        for group in list(self.history.by_epoch.values()):
            for kind in ROUND_KINDS:
                if self.round_id(kind, step, group.epoch) == round_id:
                    ok = 0 <= part < len(group.members) and group.members[part].peer_id == reducer
                    return (group, kind, None) if ok else None
            spec = self.group_round(group, step, round_id)
            if spec is not None:
                ok = 0 <= part < len(spec.group) and spec.group[part].peer_id == reducer \
                    and spec.combine[part] is not None
                return (group, "vote", spec) if ok else None
        return None

    def group_round(self, group: GroupRecord, step: int, round_id: bytes) -> RoundSpec | None:
        """The round of one of the groups of ``group``'s two-level vote at ``step`` named ``round_id``."""
        specs = self.two_level_specs(group, step, self.round_id("vote", step, group.epoch))
        return next((spec for spec in (specs or {}).values() if spec.round_id == round_id), None)

    def is_member(self, peer_id: str) -> bool:
        """In any group this peer still knows of."""
        return self.history.lists(peer_id)

    def in_run(self, peer_id: str) -> bool:
        """In the run's current group (every group of a two-level vote) and not proven to lie."""
        latest = self.history.latest
        return latest is not None and peer_id in latest.member_ids() and peer_id not in self.liars()

    def accusation_header(self, accuser: str, accusation: Accusation, evidence_bytes: int) -> int:
        """Before any evidence is read: a round of this peer's groups, its reducer accused by another of its
        members. Returns the most evidence bytes such a round can produce."""
        found = self.find_round(accusation.round_id, accusation.step, accusation.part, accusation.accused)
        if found is None:
            raise Refused("not a recent round of this peer's groups, or the accused did not reduce that part")
        group, kind, in_round = found  # in_round: one group's round of a two-level vote
        members = [m.peer_id for m in in_round.group] if in_round is not None else group.member_ids()
        if accuser not in members or accuser == accusation.accused:
            raise Refused("the accuser is not another member of that round's group")
        if accusation.kind != "lie":
            return 0
        if self.shape is None:
            raise Refused("this peer has not joined yet")
        spec = in_round or self.spec(group, accusation.step, kind, own=False)
        if not 0 <= accusation.part < len(spec.bounds):  # a flat round's id in a two-level vote: this peer's
            raise Refused("that part is not one of this peer's round")  # spec is its group's, with fewer parts
        start, stop = spec.bounds[accusation.part]
        n, planes = len(spec.group), spec.upload.planes
        leaf = min(leaf_bytes(stop - start, planes) * planes, MAX_LEAF_BYTES)
        openings = n * (leaf + 1024)
        if in_round is not None:  # a margins proof: the votes of two leaves, and a leaf of margins (≤ 8 bits)
            openings = 2 * openings + 8 * leaf + 1024
        return min(MAX_EVIDENCE_BYTES, spec.result_size(accusation.part, n) + MAX_HEADER_BYTES + 8192 + openings)
