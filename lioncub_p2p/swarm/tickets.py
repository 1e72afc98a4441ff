"""Invitations: an invited run admits only peers holding a ticket its authority signed.

The organizer holds the run's *authority*: a libp2p RSA key like a peer's (``identity.py``), named by
its id. ``lioncub-invite issue`` signs a ticket for one volunteer:

    {"m": "lioncub-ticket/1", "run": run id, "peer": the volunteer's peer id, "expires": unix time,
     "max_weight": the most reduction weight it may claim, "serial": 16 hex digits}

with the authority's key (the ticket carries the authority's public key and the signature). A ticket
is bound to one peer id, and libp2p authenticates peer ids on every stream, so a ticket is of no use
to another identity: k tickets admit at most k voting identities at once, whatever else an attacker
owns. The authority withdraws tickets by serial in a signed list, the record ``{run}.revoked`` under
its own id (``RevocationList``; a coordinator holding the key republishes it from a file).

Members learn each other's tickets from the admission exchange (``admit.py``) and from peer records
(each record carries its peer's ticket), and keep them in a ``TicketBook``: the run's ``Admission``
asks it about every stream, a leader adds only invited peers and caps their weight at the ticket's
bound, and a member follows no group that lists a peer it never saw a ticket for.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

import msgpack
from hivemind.utils import get_dht_time

from ..identity import MAX_PUBLIC_KEY_BYTES, MAX_SIGNATURE_BYTES, Identity, Verifier, peer_id_of
from .records import canonical, dht_key, seal

MAGIC = "lioncub-ticket/1"
TEXT_PREFIX = "lioncub-ticket:"
MAX_TICKET_BYTES = 2048  # payload (~250 bytes), an RSA public key (~300) and signature (~256), with room
MAX_DAYS = 3660.0
MAX_SERIALS = 4096  # serials a revocation list holds (17 bytes each in its JSON: within records.LIMITS)
MAX_WEIGHT = 1e6  # membership.MAX_WEIGHT
_SERIAL_HEX = 16
_PEER_ID_CHARS = 128


class TicketError(ValueError):
    """A ticket that is malformed, not signed by the authority named, or for something else."""


@dataclass(frozen=True)
class Ticket:
    run_id: str
    peer_id: str
    expires: float  # unix time (the DHT's clock)
    max_weight: float
    serial: str
    authority: str  # the authority's id: the peer id of ``public_key``
    public_key: bytes
    signature: bytes

    def payload(self) -> dict[str, Any]:
        return {"m": MAGIC, "run": self.run_id, "peer": self.peer_id, "expires": self.expires,
                "max_weight": self.max_weight, "serial": self.serial}

    def encode(self) -> bytes:
        return msgpack.packb({"p": canonical(self.payload()), "k": self.public_key, "s": self.signature})

    def text(self) -> str:
        """The form volunteers pass around (``--ticket``): a prefix and URL-safe base64, one line."""
        return TEXT_PREFIX + base64.urlsafe_b64encode(self.encode()).decode()

    def describe(self) -> str:
        left = self.expires - time.time()
        return (f"ticket {self.serial} for peer {self.peer_id} in run {self.run_id}, authority {self.authority}, "
                f"weight up to {self.max_weight:g}, expires {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(self.expires))}"
                f" ({'expired' if left <= 0 else f'in {left / 86400:.1f} days'})")


def issue(authority: Identity, run_id: str, peer_id: str, *, days: float, max_weight: float,
          serial: str | None = None, now: float | None = None) -> Ticket:
    """A ticket for ``peer_id`` in ``run_id``, valid ``days`` from ``now``, signed by ``authority``."""
    if not 0 < days <= MAX_DAYS:
        raise TicketError(f"days must be in (0, {MAX_DAYS:g}], got {days:g}")
    if not 0 < max_weight <= MAX_WEIGHT:
        raise TicketError(f"max weight must be in (0, {MAX_WEIGHT:g}], got {max_weight:g}")
    if not peer_id or len(peer_id) > _PEER_ID_CHARS or not peer_id.isalnum():
        raise TicketError(f"{peer_id!r} is not a peer id (lioncub-invite id prints one)")
    serial = serial or os.urandom(_SERIAL_HEX // 2).hex()
    expires = round((time.time() if now is None else now) + days * 86400.0, 3)
    unsigned = Ticket(run_id, peer_id, expires, float(max_weight), serial, authority.peer_id, authority.public_key, b"")
    signature = authority.sign(canonical(unsigned.payload()))
    return Ticket(run_id, peer_id, expires, float(max_weight), serial, authority.peer_id, authority.public_key,
                  signature)


def decode(data: bytes | str, verifier: Verifier) -> Ticket:
    """The ticket in ``data`` (its bytes, or its text form), checked to be signed by the key it names;
    what it is for is ``check``'s. Raises TicketError (one line)."""
    if isinstance(data, str):
        text = data.strip()
        if not text.startswith(TEXT_PREFIX):
            raise TicketError(f"not a lioncub ticket (it starts with {TEXT_PREFIX!r})")
        try:
            data = base64.b64decode(text[len(TEXT_PREFIX):].encode(), altchars=b"-_", validate=True)
        except (binascii.Error, ValueError):
            raise TicketError("the ticket's text is damaged (not base64): copy it again, whole") from None
    if not isinstance(data, (bytes, bytearray)) or not 0 < len(data) <= MAX_TICKET_BYTES:
        raise TicketError("no ticket, or one too large")
    try:
        value = msgpack.unpackb(bytes(data), raw=False, max_bin_len=MAX_TICKET_BYTES, max_str_len=256,
                                max_array_len=8, max_map_len=8)
    except Exception:
        raise TicketError("the ticket is damaged (not a signed ticket): copy it again, whole") from None
    if not isinstance(value, dict) or set(value) != {"p", "k", "s"} \
            or not all(isinstance(value[k], bytes) for k in "pks"):
        raise TicketError("the ticket is damaged (not a signed ticket): copy it again, whole")
    body, key, signature = value["p"], value["k"], value["s"]
    if len(key) > MAX_PUBLIC_KEY_BYTES or len(signature) > MAX_SIGNATURE_BYTES:
        raise TicketError("the ticket's key or signature is too large")
    try:
        p = json.loads(body)
        ticket = Ticket(_text(p["run"]), _text(p["peer"]), _number(p["expires"], 0.0, 1e11),
                        _number(p["max_weight"], 0.0, MAX_WEIGHT), _serial(p["serial"]), "", key, signature)
        if p.get("m") != MAGIC or set(p) != {"m", "run", "peer", "expires", "max_weight", "serial"}:
            raise ValueError("unknown format")
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise TicketError(f"the ticket's fields are malformed ({e})") from None
    if canonical(ticket.payload()) != body:
        raise TicketError("the ticket's fields are not in canonical form")
    authority = peer_id_of(key)  # whoever's key signed it; ``check`` says whether it is the run's
    if not verifier.verify(authority, key, body, signature):
        raise TicketError("the ticket's signature does not match its authority's key")
    return Ticket(ticket.run_id, ticket.peer_id, ticket.expires, ticket.max_weight, ticket.serial, authority, key,
                  signature)


def check(ticket: Ticket, *, run_id: str, authority: str, peer_id: str, now: float | None = None,
          revoked: Collection[str] = ()) -> str | None:
    """Why ``ticket`` does not admit ``peer_id`` to ``run_id`` under ``authority`` now, or None."""
    if ticket.authority != authority:
        return f"its ticket is signed by {ticket.authority}, not by the run's authority {authority}"
    if ticket.run_id != run_id:
        return f"its ticket is for run {ticket.run_id}, not {run_id}"
    if ticket.peer_id != peer_id:
        return f"its ticket is for peer {ticket.peer_id}, not {peer_id}"
    if ticket.expires <= (time.time() if now is None else now):
        return f"its ticket {ticket.serial} expired"
    if ticket.serial in revoked:
        return f"its ticket {ticket.serial} was revoked by the run's authority"
    return None


def _text(value: Any) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= _PEER_ID_CHARS or not value.isprintable():
        raise ValueError(f"{value!r} is not a short name")
    return value


def _number(value: Any, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low < value <= high:
        raise ValueError(f"{value!r} is outside ({low:g}, {high:g}]")
    return float(value)


def _serial(value: Any) -> str:
    if not isinstance(value, str) or len(value) != _SERIAL_HEX or any(c not in "0123456789abcdef" for c in value):
        raise ValueError(f"serial {value!r} is not {_SERIAL_HEX} hex digits")
    return value


def revocation_payload(serials: Iterable[str]) -> dict[str, Any]:
    """The payload of the ``{run}.revoked`` record: the withdrawn serials, sorted, checked."""
    unique = sorted({_serial(s) for s in serials})
    if len(unique) > MAX_SERIALS:
        raise TicketError(f"a revocation list holds at most {MAX_SERIALS} serials, got {len(unique)}")
    return {"serials": unique}


def revoked_serials(payload: Any) -> frozenset[str]:
    """The serials of a revocation record's payload (read and signature-checked by ``records``)."""
    if not isinstance(payload, dict) or not isinstance(payload.get("serials"), list) \
            or len(payload["serials"]) > MAX_SERIALS:
        raise TicketError("not a revocation list")
    try:
        return frozenset(_serial(s) for s in payload["serials"])
    except ValueError as e:
        raise TicketError(f"a revocation list with a bad serial: {e}") from None


def read_serials_file(path: str) -> list[str]:
    """Serials listed one per line (``#`` comments and blank lines ignored): a coordinator's revocations."""
    with open(path) as f:
        lines = [line.split("#", 1)[0].strip() for line in f]
    serials = [line for line in lines if line]
    for s in serials:
        try:
            _serial(s)
        except ValueError:
            raise TicketError(f"{path}: {s!r} is not a ticket serial ({_SERIAL_HEX} hex digits)") from None
    return serials


def publish_revocations(dht: Any, run_id: str, authority: Identity, serials: Collection[str], *,
                        ttl: float = 1200.0, timeout: float = 10.0) -> bool:
    """Store the authority's signed list of revoked serials under ``{run_id}.revoked`` (synchronous, for a
    coordinator holding the authority key; republish every ttl/3). Returns whether the DHT took it."""
    expiration = get_dht_time() + ttl
    value = seal(authority, run_id, "revoked", expiration, revocation_payload(serials))
    future = dht.store(dht_key(run_id, "revoked"), value, expiration, subkey=authority.peer_id, return_future=True)
    return bool(future.result(timeout))


class TicketBook:
    """The tickets this member has seen, by peer id, and the authority's revocations: who is invited.

    Written from the event loop (records, admission exchanges) and read from stream handlers and
    the training thread: every change happens under a lock; readers see whole entries."""

    def __init__(self, run_id: str, authority: str, *, own: Ticket | None = None, verifier: Verifier | None = None,
                 cache: int = 8192):
        self.run_id, self.authority = run_id, authority
        self.own = own.encode() if own is not None else b""  # shown to members and newcomers (admit.py)
        self.own_text = own.text() if own is not None else ""  # ...and in this peer's record
        self.verifier = verifier or Verifier()
        self._lock = threading.Lock()
        self._tickets: dict[str, Ticket] = {}
        self._seen: OrderedDict[bytes, Ticket | TicketError] = OrderedDict()  # a ticket's bytes -> decoded
        self._cache = cache
        self.revoked: frozenset[str] = frozenset()
        if own is not None:
            self._tickets[own.peer_id] = own

    def learn(self, peer_id: str, data: bytes | str) -> str | None:
        """Keep ``peer_id``'s ticket if it admits it; else why not (one line, nothing kept)."""
        key = hashlib.blake2b(data.encode() if isinstance(data, str) else bytes(data), digest_size=16).digest()
        with self._lock:
            decoded = self._seen.get(key)
        if decoded is None:
            try:
                decoded = decode(data, self.verifier)
            except TicketError as e:
                decoded = e
            with self._lock:
                self._seen[key] = decoded
                while len(self._seen) > self._cache:
                    self._seen.popitem(last=False)
        if isinstance(decoded, TicketError):
            return f"its ticket is not valid: {decoded}"
        problem = check(decoded, run_id=self.run_id, authority=self.authority, peer_id=peer_id, revoked=self.revoked)
        if problem is None:
            with self._lock:
                held = self._tickets.get(peer_id)  # kept unless it expires later and still admits (a re-issue
                if held is None or decoded.expires >= held.expires or self.refusal(peer_id) is not None:
                    self._tickets[peer_id] = decoded  # after a revocation must replace the revoked one)
        return problem if problem is not None else self.refusal(peer_id)

    def refusal(self, peer_id: str) -> str | None:
        """Why ``peer_id`` is not admitted now (no ticket seen, expired, revoked), or None."""
        ticket = self._tickets.get(peer_id)
        if ticket is None:
            return "it holds no ticket of this run (an invited run)"
        return check(ticket, run_id=self.run_id, authority=self.authority, peer_id=peer_id, revoked=self.revoked)

    def known(self, peer_id: str) -> bool:
        """Whether this member ever saw a valid ticket of ``peer_id``'s (expired or revoked since, or not)."""
        return peer_id in self._tickets

    def text(self, peer_id: str) -> str | None:
        ticket = self._tickets.get(peer_id)
        return ticket.text() if ticket is not None else None

    def max_weight(self, peer_id: str) -> float | None:
        ticket = self._tickets.get(peer_id)
        return ticket.max_weight if ticket is not None else None

    def revoke(self, serials: Collection[str]) -> None:
        """Add the authority's revocations: they add up (two coordinators publishing lists of their own, or
        a list republished from a file that went missing, never let a revoked holder back in). Memory
        needs no bound here: only tickets the authority signed are ever kept, one per peer id."""
        self.revoked = self.revoked | frozenset(serials)
