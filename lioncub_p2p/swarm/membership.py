"""Membership of a run in the hivemind DHT: who is here, and which group votes at which step.

Two keys per run:

* ``{run}.peers``: one subkey per peer, refreshed every few seconds with a short expiry, holding
  what the group needs (bandwidth weight, client mode, step, protocol version, whether its state is
  synced) plus progress figures for monitors.
* ``{run}.group``: the group record, written by the group's leader (its first listening member
  that is alive). It names the members and the step from which they vote together. It changes only
  when peers join or leave, and always for a step a few rounds ahead, so every member sees the
  change before it takes effect: no per-step matchmaking. The record carries the previous group
  too, so a peer a round behind still finds the group of its step.

DHT values come from untrusted peers: every field is type-checked and a malformed record is ignored.
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from hivemind import DHT
from hivemind.utils import get_dht_time

from ..allreduce.partition import PeerSpec
from ..wire import PROTOCOL_VERSION

logger = logging.getLogger(__name__)
MAX_MEMBERS = 1024


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
    token: bytes = b""  # admission token (see allreduce/admission.py)
    expires: float = 0.0

    def to_value(self) -> dict[str, Any]:
        value = asdict(self)
        del value["peer_id"], value["expires"]
        return value

    @classmethod
    def parse(cls, peer_id: Any, value: Any, expires: float) -> "PeerRecord | None":
        if not isinstance(peer_id, str) or not isinstance(value, dict):
            return None
        try:
            record = cls(peer_id=peer_id, weight=float(value["weight"]), client_mode=bool(value["client_mode"]),
                         step=int(value["step"]), version=int(value["version"]), synced=bool(value["synced"]),
                         samples_per_s=float(value.get("samples_per_s", 0.0)),
                         bytes_up_per_s=float(value.get("bytes_up_per_s", 0.0)),
                         bytes_down_per_s=float(value.get("bytes_down_per_s", 0.0)),
                         loss=None if value.get("loss") is None else float(value["loss"]),
                         token=bytes(value.get("token", b""))[:64], expires=float(expires))
        except (KeyError, TypeError, ValueError):
            return None
        return record if record.weight >= 0 and record.step >= 0 else None


@dataclass(frozen=True)
class GroupRecord:
    epoch: int
    from_step: int
    members: tuple[PeerSpec, ...]
    previous: "GroupRecord | None" = field(default=None, compare=False)
    proof: bytes = field(default=b"", compare=False)  # the leader's HMAC of content() with the run secret

    def content(self) -> bytes:
        """What the proof covers: epoch, first step and members, canonically."""
        return repr((self.epoch, self.from_step, [(m.peer_id, m.weight, m.client_mode) for m in self.members])).encode()

    def to_value(self) -> dict[str, Any]:
        def plain(g: GroupRecord) -> dict[str, Any]:
            return {"epoch": g.epoch, "from_step": g.from_step,
                    "members": [[m.peer_id, m.weight, m.client_mode] for m in g.members]}

        value = plain(self)
        value["previous"] = plain(self.previous) if self.previous is not None else None
        value["proof"] = self.proof
        return value

    @classmethod
    def parse(cls, value: Any, *, nested: bool = False) -> "GroupRecord | None":
        try:
            members = value["members"]
            if not isinstance(members, list) or not 0 < len(members) <= MAX_MEMBERS:
                return None
            specs = tuple(PeerSpec(str(pid), float(w), bool(c)) for pid, w, c in members)
            if len({s.peer_id for s in specs}) != len(specs) or not any(s.reduces for s in specs):
                return None
            previous = None
            if not nested and value.get("previous") is not None:
                previous = cls.parse(value["previous"], nested=True)
            proof = bytes(value.get("proof", b""))[:64] if not nested else b""
            return cls(int(value["epoch"]), int(value["from_step"]), specs, previous, proof)
        except (KeyError, TypeError, ValueError):
            return None

    def member_ids(self) -> list[str]:
        return [m.peer_id for m in self.members]


class Directory:
    """The run's records in the DHT. Methods are coroutines for the swarm's event loop."""

    def __init__(self, dht: DHT, run_id: str, group_namespace: str = ""):
        self.dht = dht
        self.peers_key = f"{run_id}.peers"
        # runs with a secret keep their group record under a key derived from it: a peer with another
        # secret can neither read nor overwrite it (it would only find, or found, a group of its own)
        self.group_key = f"{run_id}.group" + (f".{group_namespace}" if group_namespace else "")

    async def announce(self, record: PeerRecord, ttl: float) -> None:
        await self.dht.store(self.peers_key, record.to_value(), get_dht_time() + ttl, subkey=record.peer_id,
                             return_future=True)

    async def peers(self) -> dict[str, PeerRecord]:
        found = await self.dht.get(self.peers_key, latest=True, return_future=True)
        if found is None or not isinstance(found.value, dict):
            return {}
        now, records = get_dht_time(), {}
        for subkey, item in found.value.items():
            record = PeerRecord.parse(subkey, getattr(item, "value", None), getattr(item, "expiration_time", 0.0))
            if record is not None and record.expires > now:
                records[record.peer_id] = record
        return records

    async def group(self) -> GroupRecord | None:
        found = await self.dht.get(self.group_key, latest=True, return_future=True)
        return GroupRecord.parse(found.value) if found is not None else None

    async def publish_group(self, record: GroupRecord, ttl: float) -> bool:
        return bool(await self.dht.store(self.group_key, record.to_value(), get_dht_time() + ttl,
                                         return_future=True))


class GroupHistory:
    """The groups this peer has seen, by epoch: which group votes at a given step."""

    def __init__(self, keep: int = 16):
        self.keep = keep
        self.by_epoch: dict[int, GroupRecord] = {}
        self.seen_at = 0.0

    def add(self, record: GroupRecord | None) -> None:
        while record is not None:
            self.by_epoch.setdefault(record.epoch, record)
            record = record.previous
        for epoch in sorted(self.by_epoch)[: -self.keep]:
            del self.by_epoch[epoch]
        self.seen_at = time.monotonic()

    @property
    def latest(self) -> GroupRecord | None:
        return self.by_epoch[max(self.by_epoch)] if self.by_epoch else None

    def for_step(self, step: int) -> GroupRecord | None:
        """The newest group whose ``from_step`` has come by ``step``."""
        eligible = [g for g in self.by_epoch.values() if g.from_step <= step]
        return max(eligible, key=lambda g: (g.from_step, g.epoch)) if eligible else None
