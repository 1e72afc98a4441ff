"""Who may take part in a run: holders of a shared run secret, and/or peers on an allow-list.

The secret never appears in public: it is stretched once per process into a run key with scrypt
(40-85 ms, 16 MiB; salted with the run id), and only values derived from that key travel, and only
on authenticated libp2p streams:

* a *token*, HMAC-SHA256(key, run id | peer id), that a member sends in the first frame of every
  vote, fetch, probe and state stream to another member. libp2p authenticates the stream's peer id
  and the token is bound to it, so a token seen by a member is of no use from another peer id;
* the *proofs* of the admission exchange (``swarm/admit.py``): a newcomer proves the key to the
  member it asks to be admitted by, over both peer ids and both parties' fresh nonces, before that
  member proves it back.

Nothing derived from the secret is in any DHT record. An eavesdropper on the DHT learns nothing to
test guesses against; an active attacker who tricks a newcomer into the exchange gets one proof,
and each guess against it costs one scrypt (see docs/protocol.md, "Admission"). An invited run's
``invitations`` (``swarm/tickets.py``: tickets its authority signed, bound to peer ids) say who may
take part; a secret proves knowledge shared by everyone admitted, a ticket proves one identity.
Without a secret, a list or invitations, everyone is admitted.
"""
from __future__ import annotations

import functools
import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .partition import PeerSpec

TOKEN_BYTES = 16
PROOF_BYTES = 32
# scrypt cost: 40-85 ms (by load) and 16 MiB on one core of the project's machine, once per process and secret
SCRYPT_N, SCRYPT_R, SCRYPT_P = 1 << 14, 8, 1


@functools.lru_cache(maxsize=8)
def run_key(secret: bytes, run_id: str) -> bytes:
    """The run key: the secret stretched with scrypt, salted with the run id (one secret, many runs)."""
    return hashlib.scrypt(secret, salt=b"lioncub-run-key|" + run_id.encode(), n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P,
                          dklen=32, maxmem=64 << 20)


class Invitations(Protocol):
    """Who holds a valid invitation to the run (``swarm.tickets.TicketBook``)."""

    def refusal(self, peer_id: str) -> str | None:
        """Why ``peer_id`` is not invited now, or None."""

    def known(self, peer_id: str) -> bool:
        """Whether ``peer_id`` was ever shown to hold an invitation."""

    def learn(self, peer_id: str, data: bytes | str) -> str | None:
        """Keep ``peer_id``'s invitation ``data`` if it admits it; else why not."""

    def text(self, peer_id: str) -> str | None:
        """``peer_id``'s invitation as others can check it (None: none seen)."""

    def max_weight(self, peer_id: str) -> float | None:
        """The most reduction weight ``peer_id``'s invitation lets it claim (None: none seen)."""

    @property
    def own(self) -> bytes:
        """This peer's own invitation, as it shows it to others (empty: none)."""


@dataclass(frozen=True)
class Admission:
    run_id: str = ""
    secret: bytes | None = None
    allow: frozenset[str] = field(default_factory=frozenset)  # peer ids; empty: no list
    invitations: Invitations | None = field(default=None, compare=False)  # an invited run's tickets

    @property
    def open(self) -> bool:
        return self.secret is None and not self.allow and self.invitations is None

    @property
    def invited(self) -> bool:
        return self.invitations is not None

    def vouches(self, peer_id: str) -> str | None:
        """Why ``peer_id`` itself may not take part (the allow-list, its invitation), or None: what a
        member can check of another without a stream (the secret is proved on streams)."""
        if self.allow and peer_id not in self.allow:
            return "not on the run's allow-list"
        if self.invitations is not None:
            return self.invitations.refusal(peer_id)
        return None

    def may_list(self, peer_id: str) -> bool:
        """Whether a group may list ``peer_id``: on the allow-list, and shown to hold an invitation (even
        one expired or revoked since: the leader drops such members, and members that learned of a
        revocation before it did must not split from the group over it)."""
        return (not self.allow or peer_id in self.allow) and \
            (self.invitations is None or self.invitations.known(peer_id))

    def refuses_listing(self, members: Sequence[PeerSpec], tickets: Sequence[tuple[str, str]] = ()) -> str | None:
        """Why a group listing ``members`` is not one this peer follows, or None: the one rule every way
        a group is accepted applies (the next group, a rival's record, the group a newcomer is admitted
        to). A member not admitted (``may_list``), or given more reduction weight than its invitation
        allows: a leader cannot add identities, or weight, that the run's authority did not grant.
        ``tickets``: (peer id, invitation) the record carries for the members it adds, learned first."""
        if self.invitations is not None:
            for peer_id, ticket in tickets:
                self.invitations.learn(peer_id, ticket)
        for m in members:
            if not self.may_list(m.peer_id):
                return f"it lists {m.peer_id}, who is not admitted to the run (no ticket or allow-list entry seen)"
            bound = self.invitations.max_weight(m.peer_id) if self.invitations is not None else None
            if bound is not None and m.weight > bound * (1 + 1e-9):
                return f"it gives {m.peer_id} weight {m.weight:g}, more than its ticket's {bound:g}"
        return None

    @property
    def needs_secret(self) -> bool:
        return self.secret is not None

    @property
    def _key(self) -> bytes:
        return run_key(self.secret, self.run_id)

    def _mac(self, *parts: str | bytes) -> bytes:
        msg = b"|".join(p if isinstance(p, bytes) else p.encode() for p in parts)
        return hmac.new(self._key, msg, hashlib.sha256).digest()

    def token(self, peer_id: str) -> bytes:
        """What ``peer_id`` sends members on its streams (empty for runs without a secret)."""
        if self.secret is None:
            return b""
        return self._mac(b"lioncub-token", self.run_id, peer_id)[:TOKEN_BYTES]

    def proof(self, role: str, newcomer: str, member: str, newcomer_nonce: bytes, member_nonce: bytes) -> bytes:
        """One side's answer in the admission exchange: both peer ids and both nonces bound in, and the
        role, so neither side's proof can be reflected as the other's."""
        if self.secret is None:
            return b""
        return self._mac(b"lioncub-admit", role, self.run_id, newcomer, member, newcomer_nonce, member_nonce)

    def checks_proof(self, proof: bytes, role: str, newcomer: str, member: str, newcomer_nonce: bytes,
                     member_nonce: bytes) -> bool:
        if self.secret is None:
            return True
        return isinstance(proof, (bytes, bytearray)) and hmac.compare_digest(
            self.proof(role, newcomer, member, newcomer_nonce, member_nonce), bytes(proof[:PROOF_BYTES]))

    def admits(self, peer_id: str, token: bytes) -> bool:
        return self.reason(peer_id, token) is None

    def reason(self, peer_id: str, token: bytes) -> str | None:
        """Why ``peer_id`` (whose stream carried ``token``) is refused, or None if admitted."""
        problem = self.vouches(peer_id)
        if problem is not None:
            return problem
        if self.secret is not None and not (isinstance(token, (bytes, bytearray)) and
                                            hmac.compare_digest(self.token(peer_id), bytes(token[:TOKEN_BYTES]))):
            return "wrong or missing run secret"
        return None


OPEN = Admission()
