"""Who may take part in a run: holders of a shared run secret, and/or peers on an allow-list.

libp2p authenticates every stream's remote peer id with the peer's key. A member proves it knows
the run secret with a token bound to that id, HMAC-SHA256(secret, run id | peer id): anyone can
see a token (it also sits in the public DHT record) but nobody can use it from another peer id,
and computing one needs the secret. Without a secret or list, everyone is admitted.
"""
from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field

TOKEN_BYTES = 16


@dataclass(frozen=True)
class Admission:
    run_id: str = ""
    secret: bytes | None = None
    allow: frozenset[str] = field(default_factory=frozenset)  # peer ids; empty: no list

    @property
    def open(self) -> bool:
        return self.secret is None and not self.allow

    def token(self, peer_id: str) -> bytes:
        if self.secret is None:
            return b""
        msg = f"lioncub-admission|{self.run_id}|{peer_id}".encode()
        return hmac.new(self.secret, msg, hashlib.sha256).digest()[:TOKEN_BYTES]

    def sign(self, content: bytes) -> bytes:
        """A proof that whoever wrote ``content`` knows the run secret (empty for open runs)."""
        if self.secret is None:
            return b""
        return hmac.new(self.secret, b"lioncub-group|" + content, hashlib.sha256).digest()[:TOKEN_BYTES]

    def verifies(self, content: bytes, proof: bytes) -> bool:
        return self.secret is None or hmac.compare_digest(self.sign(content), bytes(proof))

    def admits(self, peer_id: str, token: bytes) -> bool:
        if self.allow and peer_id not in self.allow:
            return False
        return self.secret is None or hmac.compare_digest(self.token(peer_id), bytes(token))

    def reason(self, peer_id: str, token: bytes) -> str | None:
        """Why ``peer_id`` is refused, or None if admitted."""
        if self.allow and peer_id not in self.allow:
            return "not on the run's allow-list"
        if self.secret is not None and not hmac.compare_digest(self.token(peer_id), bytes(token)):
            return "wrong or missing run secret"
        return None


OPEN = Admission()
