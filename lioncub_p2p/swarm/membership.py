"""Membership of a run in the hivemind DHT: who is here, and which group votes at which step.

Two of the run's signed keys (``records.py``), each with one subkey per author:

* ``{run}.peers``: each peer's own record, refreshed every few seconds with a short expiry: what the
  group needs (bandwidth weight, client mode, step, protocol version, whether its state is synced,
  the digest of the run manifest it follows, whether it is leaving) plus progress figures for monitors.
* ``{run}.group``: group records, each written by the leader that decided it (its first listening
  member that is alive). A record names the members and the step from which they vote together. It
  changes only when peers join or leave, and always for a step a few rounds ahead, so every member
  sees the change before it takes effect: no per-step matchmaking. It carries the previous group
  too, so a peer a round behind still finds the group of its step.

Everything read is hostile until checked: records are signed by their subkey's peer id, every field
is type- and range-checked (finite weights in [0, 1e6], steps below 2**53, bounded sizes before any
conversion), and a record that fails is skipped, logged (rate-limited) and never fatal. A member
accepts a new group only from a member of its current group and only within windows of epochs and
steps (``next_group``); a newcomer finds the run's group by asking the group's author to admit it
(``admit.py``).
"""
from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from hivemind import DHT
from hivemind.utils import get_dht_time

from ..allreduce.partition import PeerSpec
from ..identity import Identity, Verifier
from ..wire import PROTOCOL_VERSION
from .records import RateLimitedLog, RecordError, dht_key, open_record, read_records, store_record
from .tickets import TicketError, revoked_serials

if TYPE_CHECKING:
    from .tickets import TicketBook

logger = logging.getLogger(__name__)
MAX_MEMBERS = 1024
MAX_WEIGHT = 1e6
MAX_STEP = 1 << 53  # steps and epochs beyond this are lies (and lose float precision in JSON readers)
MAX_RATE = 1e15
MAX_PEER_ID_CHARS = 128
# an invited run's group record carries the tickets of the members its epoch adds (``tickets.py``): a
# ticket's text is under 3 KiB; at most this many ride in one record (the group record's size limit)
MAX_TICKET_CHARS = 4096
MAX_CARRIED_TICKETS = 64
DIGEST_HEX = 32  # a final parameter digest (closing.py): snapshot.params_digest, 16 bytes in hex
MAX_REPORTED = 16  # group-mates a peer reports missing votes of in its record (lead.missing_votes)
MAX_RECORDS = 4 * MAX_MEMBERS  # records of one key looked at per read; the rest are ignored (flooding)
MAX_EPOCH_GAP = 16  # a member accepts a group at most this many epochs past its own
DHT_TIMEOUT = 10.0  # every DHT read and write
MAX_TICKET_CHARS = 2800  # a ticket's text form (tickets.MAX_TICKET_BYTES in base64, and its prefix)


def _number(value: Any, low: float, high: float, *, integer: bool = False) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise RecordError(f"{value!r} is not a{'n integer' if integer else ' number'}")
    if not (low <= value <= high) or (isinstance(value, float) and not math.isfinite(value)):
        raise RecordError(f"{value!r} is outside [{low}, {high}]")
    return value


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise RecordError(f"{value!r} is not a boolean")
    return value


def _peer_ids(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > MAX_REPORTED:
        raise RecordError(f"missing or steady is not a list of at most {MAX_REPORTED} peer ids")
    return tuple(_text(pid, MAX_PEER_ID_CHARS) for pid in value)


def _hex_digest(value: Any) -> str:
    if not isinstance(value, str) or len(value) not in (0, DIGEST_HEX) or any(c not in "0123456789abcdef" for c in value):
        raise RecordError(f"final is not empty or a digest of {DIGEST_HEX} lowercase hex digits")
    return value


def _tickets(value: Any, members: set[str]) -> tuple[tuple[str, str], ...]:
    """A group record's carried tickets: [peer id, ticket text] of listed members, each at most once
    (what a ticket says is checked where it is learned: ``TicketBook.learn``)."""
    if not isinstance(value, list) or len(value) > MAX_CARRIED_TICKETS:
        raise RecordError(f"a group record carries at most {MAX_CARRIED_TICKETS} tickets in a list")
    pairs = []
    for item in value:
        if not isinstance(item, list) or len(item) != 2:
            raise RecordError("a carried ticket is not [peer id, ticket]")
        pairs.append((_text(item[0], MAX_PEER_ID_CHARS), _text(item[1], MAX_TICKET_CHARS)))
    if len({pid for pid, _ in pairs}) != len(pairs) or not {pid for pid, _ in pairs} <= members:
        raise RecordError("a carried ticket is for a peer the group does not list, or twice")
    return tuple(pairs)


def _text(value: Any, limit: int) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise RecordError("not a short string")
    return value


@dataclass
class PeerRecord:
    peer_id: str
    weight: float = 1.0
    client_mode: bool = False
    step: int = 0
    version: int = PROTOCOL_VERSION
    synced: bool = False  # holds the swarm's state and can vote
    samples_per_s: float = 0.0
    bytes_up_per_s: float = 0.0
    bytes_down_per_s: float = 0.0
    loss: float | None = None
    manifest: str = ""  # digest of the run manifest this peer follows (manifest.py)
    leaving: bool = False  # announced by Swarm.shutdown(): drop me now
    following: bool = False  # behind the group: receives results without voting (keep me, give me no part)
    missing: tuple[str, ...] = ()  # group-mates whose votes this peer misses (two-level: the leader sees no other group)
    steady: tuple[str, ...] = ()  # group-mates without a vote in the group whose votes count here, rounds in a row
    final: str = ""  # past its last step: its parameters' digest (hex) at ``step`` (closing.py)
    steps_per_s: float = 0.0  # its recent pace (a joiner bounds how far past the run a donor's state may be)
    ticket: str = ""  # an invited run: its ticket, in text form (tickets.py); members learn it from here
    expires: float = 0.0

    def payload(self) -> dict[str, Any]:
        loss = self.loss if self.loss is not None and math.isfinite(self.loss) else None
        return {"weight": float(self.weight), "client_mode": self.client_mode, "step": int(self.step),
                "version": int(self.version), "synced": self.synced, "samples_per_s": float(self.samples_per_s),
                "steps_per_s": float(self.steps_per_s),
                "bytes_up_per_s": float(self.bytes_up_per_s), "bytes_down_per_s": float(self.bytes_down_per_s),
                "loss": loss, "manifest": self.manifest, "leaving": self.leaving,
                "following": self.following, "missing": list(self.missing), "steady": list(self.steady),
                "final": self.final, **({"ticket": self.ticket} if self.ticket else {})}

    @classmethod
    def from_payload(cls, peer_id: str, value: dict, expires: float) -> "PeerRecord":
        """Raises RecordError on anything out of shape or range."""
        loss = value.get("loss")
        return cls(peer_id=_text(peer_id, MAX_PEER_ID_CHARS), weight=float(_number(value["weight"], 0.0, MAX_WEIGHT)),
                   client_mode=_flag(value["client_mode"]), step=_number(value["step"], 0, MAX_STEP, integer=True),
                   version=_number(value["version"], 0, 1 << 31, integer=True), synced=_flag(value["synced"]),
                   samples_per_s=float(_number(value.get("samples_per_s", 0.0), 0.0, MAX_RATE)),
                   steps_per_s=float(_number(value.get("steps_per_s", 0.0), 0.0, MAX_RATE)),
                   bytes_up_per_s=float(_number(value.get("bytes_up_per_s", 0.0), 0.0, MAX_RATE)),
                   bytes_down_per_s=float(_number(value.get("bytes_down_per_s", 0.0), 0.0, MAX_RATE)),
                   loss=None if loss is None else float(_number(loss, -MAX_RATE, MAX_RATE)),
                   manifest=_text(value.get("manifest", ""), 64), leaving=_flag(value.get("leaving", False)),
                   following=_flag(value.get("following", False)), missing=_peer_ids(value.get("missing", [])),
                   steady=_peer_ids(value.get("steady", [])), final=_hex_digest(value.get("final", "")),
                   ticket=_text(value.get("ticket", ""), MAX_TICKET_CHARS), expires=float(expires))

    @classmethod
    def parse(cls, peer_id: Any, value: Any, expires: Any, *, run_id: str | None = None,
              verifier: Verifier | None = None) -> "PeerRecord | None":
        """A peer record as read from ``{run}.peers`` (the signed value), or None if it does not check
        out. ``run_id`` defaults to the run the record names (fine for monitors; members pass theirs)."""
        try:
            if run_id is None:
                run_id = value.get("r") if isinstance(value, dict) else None
                if not isinstance(run_id, str):
                    return None
            payload = open_record(verifier or _VERIFIER, run_id, "peers", peer_id, value, expires)
            return cls.from_payload(peer_id, payload, expires)
        except (RecordError, KeyError, TypeError, ValueError):
            return None


_VERIFIER = Verifier()


@dataclass(frozen=True)
class GroupRecord:
    epoch: int
    from_step: int
    members: tuple[PeerSpec, ...]
    previous: "GroupRecord | None" = field(default=None, compare=False)
    author: str = field(default="", compare=False)  # the signer: the leader that decided it
    # (peer id, ticket text) of the members this epoch adds, in an invited run: the evidence that the
    # record may list them travels with it (a member that had not yet read a newcomer's peer record
    # refused to follow the record that added it, and the group split)
    tickets: tuple[tuple[str, str], ...] = field(default=(), compare=False)

    def payload(self, *, nested: bool = False) -> dict[str, Any]:
        value: dict[str, Any] = {"epoch": self.epoch, "from_step": self.from_step,
                                 "members": [[m.peer_id, float(m.weight), m.client_mode, m.voter] for m in self.members]}
        if self.tickets:  # nested too: a member that missed the epoch reads them in the next one's record
            value["tickets"] = [[pid, text] for pid, text in self.tickets]
        if not nested:
            value["previous"] = self.previous.payload(nested=True) if self.previous is not None else None
        return value

    @classmethod
    def from_payload(cls, value: Any, author: str = "", *, nested: bool = False) -> "GroupRecord":
        """Raises RecordError on anything out of shape or range."""
        if not isinstance(value, dict):
            raise RecordError("group is not a map")
        members = value.get("members")
        if not isinstance(members, list) or not 0 < len(members) <= MAX_MEMBERS:
            raise RecordError("group members missing or too many")
        specs = []
        for item in members:
            if not isinstance(item, list) or len(item) not in (3, 4):
                raise RecordError("a member is not [peer id, weight, client mode, voter]")
            specs.append(PeerSpec(_text(item[0], MAX_PEER_ID_CHARS), float(_number(item[1], 0.0, MAX_WEIGHT)),
                                  _flag(item[2]), _flag(item[3]) if len(item) == 4 else True))
        if len({s.peer_id for s in specs}) != len(specs) or not any(s.reduces for s in specs):
            raise RecordError("group lists a peer twice or has no reducer")
        # the order is the leader rule's (``lead.leader_of``: the first reducer alive leads) and every leader
        # sorts by peer id: a member that listed itself first would lead without dropping anyone
        if any(a.peer_id > b.peer_id for a, b in zip(specs, specs[1:])):
            raise RecordError("group members are not sorted by peer id")
        previous = None
        if not nested and value.get("previous") is not None:
            previous = cls.from_payload(value["previous"], nested=True)
        epoch = _number(value.get("epoch"), 0, MAX_STEP, integer=True)
        if previous is not None and previous.epoch != epoch - 1:
            raise RecordError("previous group is not the epoch before")
        return cls(epoch, _number(value.get("from_step"), 0, MAX_STEP, integer=True), tuple(specs), previous, author,
                   _tickets(value.get("tickets", []), {s.peer_id for s in specs}))

    @classmethod
    def authored(cls, value: Any, author: str) -> "GroupRecord":
        """A group record its author signed (read from the DHT or sent as a notice): ``from_payload``,
        and the author must be one of its members. Raises RecordError."""
        group = cls.from_payload(value, author)
        if author not in group.member_ids():
            raise RecordError("its author is not a member")
        return group

    def member_ids(self) -> list[str]:
        return [m.peer_id for m in self.members]


class Directory:
    """The run's membership records in the DHT. Methods are coroutines for the swarm's event loop;
    each DHT call is bounded by ``timeout`` and a failed read returns nothing rather than raising."""

    def __init__(self, dht: DHT, run_id: str, identity: Identity, *, timeout: float = DHT_TIMEOUT,
                 tickets: "TicketBook | None" = None):
        self.dht, self.run_id, self.identity, self.timeout = dht, run_id, identity, timeout
        self.tickets = tickets  # an invited run: the tickets records carry are learned, weights capped by them
        self.peers_key, self.group_key = dht_key(run_id, "peers"), dht_key(run_id, "group")
        self.verifier = Verifier()
        self.bad = RateLimitedLog(logger)

    async def _store(self, kind: str, payload: dict, expiration: float) -> bool:
        return await store_record(self.dht, self.identity, self.run_id, kind, payload, expiration, timeout=self.timeout)

    async def read(self, kind: str) -> list[tuple[str, dict, float]]:
        """(author, payload, expiration) of every valid, unexpired record of ``kind``."""
        return await read_records(self.dht, self.run_id, kind, self.verifier, self.bad, timeout=self.timeout,
                                  limit=MAX_RECORDS)

    async def announce(self, record: PeerRecord, ttl: float, *, expiration: float | None = None) -> bool:
        return await self._store("peers", record.payload(), expiration or get_dht_time() + ttl)

    async def peers(self) -> dict[str, PeerRecord]:
        records = {}
        for author, payload, expires in await self.read("peers"):
            try:
                record = self._invited(PeerRecord.from_payload(author, payload, expires))
            except (RecordError, KeyError) as e:
                self.bad.warning(f"peer:{str(e)[:40]}", "ignoring the peer record of %.60s: %s", author, e)
                continue
            if record is not None:
                records[author] = record
        return records

    def _invited(self, record: PeerRecord) -> PeerRecord | None:
        """In an invited run: the record, if the ticket it carries admits its author (learned here), with
        the weight it claims capped at its ticket's bound; None otherwise: a ticketless record is no
        record of the run (it would count in the leader's reducer floor, the run's step, the ranking of
        group records a newcomer asks)."""
        if self.tickets is None:
            return record
        problem = self.tickets.learn(record.peer_id, record.ticket) if record.ticket else \
            self.tickets.refusal(record.peer_id)  # its own (this peer's) or one learned in an exchange
        if problem is not None:
            self.bad.warning(f"ticket:{record.peer_id}", "ignoring the record of %.60s: %s", record.peer_id, problem)
            return None
        cap = self.tickets.max_weight(record.peer_id)
        return replace(record, weight=cap) if cap is not None and record.weight > cap else record

    async def revoked(self) -> frozenset[str] | None:
        """An invited run's revoked ticket serials, as its authority signed them (None: no list read)."""
        if self.tickets is None:
            return None
        found = await read_records(self.dht, self.run_id, "revoked", self.verifier, self.bad, timeout=self.timeout,
                                   limit=1, authors={self.tickets.authority})
        if not found:
            return None
        try:
            return revoked_serials(found[0][1])
        except TicketError as e:
            self.bad.warning("revoked", "ignoring the run's revocation list: %s", e)
            return None

    async def groups(self) -> list[GroupRecord]:
        """Every valid group record, each signed by its author (who must be one of its members)."""
        groups = []
        for author, payload, _ in await self.read("group"):
            try:
                groups.append(GroupRecord.authored(payload, author))
            except (RecordError, KeyError) as e:
                self.bad.warning(f"group:{str(e)[:40]}", "ignoring the group record of %.60s: %s", author, e)
        return groups

    async def group(self) -> GroupRecord | None:
        """The newest group record found (unverified beyond its signature: for reports, not for trust)."""
        groups = await self.groups()
        return max(groups, key=lambda g: g.epoch) if groups else None

    async def publish_group(self, record: GroupRecord, ttl: float) -> bool:
        return await self._store("group", record.payload(), get_dht_time() + ttl)


def announced_step(group: GroupRecord, records: dict[str, PeerRecord]) -> int | None:
    """Where the run is, as ``group``'s synced members announce it in their signed records: the lower
    median of their steps, so members lying about their own step move it only if they are a majority
    (the group is theirs then anyway). None if no member's record says."""
    steps = sorted(r.step for r in synced_members(group, records))
    return steps[(len(steps) - 1) // 2] if steps else None


def synced_members(group: GroupRecord, records: dict[str, PeerRecord]) -> list[PeerRecord]:
    """The signed records of ``group``'s members that hold the state and are not leaving."""
    members = set(group.member_ids())
    return [r for pid, r in records.items() if pid in members and r.synced and not r.leaving]


def next_group(candidates: list[GroupRecord], history: "GroupHistory", *, step: int, window: int,
               run_step: int | None = None, refused: frozenset[str] | set[str] = frozenset(),
               log: RateLimitedLog | None = None,
               admissible: Callable[[GroupRecord], str | None] | None = None) -> GroupRecord | None:
    """The group record a member with ``history`` accepts next, if any.

    Only from a member of its latest groups (an outsider's record, however well signed, is never
    followed) that is not ``refused`` (proven liars), only for the next ``MAX_EPOCH_GAP`` epochs, and
    only for a first step no further than ``window`` steps past the furthest of this peer's step, the
    current group's start and ``run_step`` (``announced_step``: where most of the group says the run
    is, which lets a peer that is joining at step 0, or coming back far behind, follow the group of a
    long-running run; a forged far-future step still cannot freeze group changes), and never for a
    first step before the current group's (a group slipped in under steps already voted would split
    the peers still running them; ``GroupHistory.for_step`` would not pick it past the current
    group's start anyway), and only one ``admissible`` says nothing against (``Admission.refuses_listing``:
    a peer not admitted, a weight past its ticket's). Among several, the newest; for one epoch, the
    author listed first."""
    latest = history.latest
    if latest is None:
        return None
    signers = {pid for g in history.by_epoch.values() if g.epoch >= latest.epoch - 1 for pid in g.member_ids()}
    order = {pid: i for i, pid in enumerate(latest.member_ids())}
    limit = max(step, latest.from_step, run_step or 0) + window
    accepted = []
    for group in candidates:
        if group.epoch <= latest.epoch:
            continue
        problem = None
        if group.author not in signers:
            problem = "its author is not a member of this peer's group"
        elif group.author in refused:
            problem = "its author was caught lying (audit evidence)"
        elif group.epoch > latest.epoch + MAX_EPOCH_GAP:
            problem = f"epoch {group.epoch} is more than {MAX_EPOCH_GAP} past {latest.epoch}"
        elif group.from_step > limit:
            problem = f"it starts at step {group.from_step}, more than {window} steps ahead"
        elif group.from_step < latest.from_step:  # a leader plans from where its group is, never before it
            problem = f"it starts at step {group.from_step}, before this peer's group ({latest.from_step})"
        elif admissible is not None and (refused := admissible(group)) is not None:
            problem = refused
        if problem:
            if log is not None:
                log.warning(f"next:{group.author}", "not following the group record of %.60s: %s", group.author,
                            problem)
            continue
        accepted.append(group)
    if not accepted:
        return None
    return max(accepted, key=lambda g: (g.epoch, -order.get(g.author, len(order))))


def preferred_rival(candidates: list[GroupRecord], history: "GroupHistory", *, step: int,
                    refused: frozenset[str] | set[str] = frozenset(),
                    admissible: Callable[[GroupRecord], str | None] | None = None) -> GroupRecord | None:
    """A record for this peer's newest epoch that wins over the one it holds, if any.

    Two members may each believe it leads (one saw the other miss rounds) and publish a group for the
    same epoch; members that read them in different orders would split. The rule every member applies:
    for one epoch, the record of the author listed first in the group both were planned from (the
    leader rule's own order, ``lead.leader_of``), from the same previous group. A member switches only
    while neither record has taken effect here (both start past ``step + 1``: an overlapped round may
    be in flight); later, a split is what the state digest finds and a repair mends."""
    latest = history.latest
    previous = history.by_epoch.get(latest.epoch - 1) if latest is not None else None
    if latest is None or previous is None or latest.from_step <= step + 1:
        return None
    order = {pid: i for i, pid in enumerate(previous.member_ids())}
    rank = order.get(latest.author, len(order))
    rivals = [g for g in candidates
              if g.epoch == latest.epoch and g.author != latest.author and g.author not in refused
              and order.get(g.author, len(order)) < rank and g.previous == previous and g.from_step > step + 1
              and g.from_step <= latest.from_step + MAX_RIVAL_LEAD
              and (admissible is None or admissible(g) is None)]  # the same rule as ``next_group``'s
    return min(rivals, key=lambda g: order[g.author]) if rivals else None


# a rival record may start at most this many steps after the one it replaces (a forged far-future start
# would otherwise freeze the group)
MAX_RIVAL_LEAD = 64


class GroupHistory:
    """The groups this peer has accepted, by epoch: which group votes at a given step.

    Written on the swarm's event loop, read on the training thread too: a change builds a new dict
    and publishes it whole (one reference swap), so a reader that takes ``by_epoch`` once iterates a
    dict nobody changes."""

    def __init__(self, keep: int = 16):
        self.keep = keep
        self.by_epoch: dict[int, GroupRecord] = {}

    def add(self, record: GroupRecord | None) -> None:
        groups = dict(self.by_epoch)
        while record is not None:
            groups.setdefault(record.epoch, record)
            record = record.previous
        for epoch in sorted(groups)[: -self.keep]:
            del groups[epoch]
        self.by_epoch = groups

    def replace(self, record: GroupRecord) -> None:
        """``record`` instead of the one held for its epoch (``preferred_rival``); older epochs stay."""
        groups = {epoch: g for epoch, g in self.by_epoch.items() if epoch < record.epoch}
        groups[record.epoch] = record
        self.by_epoch = groups

    def clear(self) -> None:
        self.by_epoch = {}

    @property
    def latest(self) -> GroupRecord | None:
        groups = self.by_epoch
        return groups[max(groups)] if groups else None

    def lists(self, peer_id: str) -> bool:
        """Whether any group kept here lists ``peer_id`` (callable from any thread: it reads one snapshot)."""
        return any(peer_id in g.member_ids() for g in list(self.by_epoch.values()))

    def for_step(self, step: int) -> GroupRecord | None:
        """The newest group whose ``from_step`` has come by ``step``."""
        eligible = [g for g in self.by_epoch.values() if g.from_step <= step]
        return max(eligible, key=lambda g: (g.from_step, g.epoch)) if eligible else None


# A member whose bandwidth weight is below this share of the group's median reduces nothing: its part
# would be tiny, yet every voter would wait on its link and its pace for it (a 1 Mbit/s peer among
# 100 Mbit/s ones held every step at the join timeout, and its missed parts split the group).
MIN_REDUCER_SHARE = 0.1


def reducer_floor(weights: list[float]) -> float:
    """The weight below which a leader gives a member no part (``MIN_REDUCER_SHARE`` of the median)."""
    return MIN_REDUCER_SHARE * statistics.median(weights) if weights else 0.0


def assigned_weight(announced: float, *, syncing: bool, following: bool, floor: float, lone_reducers: bool,
                    resting: bool = False) -> float:
    """The weight a leader gives a member (its share of the parts): none while it downloads the state,
    follows (``follow.py``: nobody should wait for its part) or rests after its part failed (``lead.py``),
    none below ``floor`` unless every member that could reduce is below it (``lone_reducers``: a group
    always has a reducer), else its own."""
    return 0.0 if syncing or following or resting or (announced < floor and not lone_reducers) else announced


def read_peer_records(dht: DHT, run_id: str, *, timeout: float = DHT_TIMEOUT) -> dict[str, PeerRecord]:
    """The run's valid, unexpired peer records, from synchronous code (monitors, coordinators).

    Bounded by ``timeout`` (an empty answer past it); bad records are skipped, never raised. Start the
    DHT with ``record_validators=[RunRecordValidator([run_id])]`` so that a value hivemind cannot
    decode never reaches its decoder (where it would leave every read of the key waiting)."""
    try:
        found = dht.get(dht_key(run_id, "peers"), latest=True, return_future=True).result(timeout)
    except Exception as e:  # a timeout, a DHT shutting down: no figures this time
        logger.info("reading %s peer records failed: %s: %s", run_id, type(e).__name__, e)
        return {}
    records, now = {}, get_dht_time()
    if found is not None and isinstance(found.value, dict):
        for i, (subkey, item) in enumerate(found.value.items()):
            if i >= MAX_RECORDS:
                break
            record = PeerRecord.parse(subkey, getattr(item, "value", None), getattr(item, "expiration_time", None),
                                      run_id=run_id)
            if record is not None and record.expires > now and not record.leaving:
                records[record.peer_id] = record
    return records
