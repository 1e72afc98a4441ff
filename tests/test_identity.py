"""Identity: signatures bind bytes to a libp2p peer id (checked against the daemon's own peer id)."""
import asyncio

from hivemind.p2p import P2P

from lioncub_p2p.identity import Identity, Verifier, peer_id_of


def test_identity_matches_the_daemons_peer_id_and_signatures_bind_to_it(tmp_path):
    ident = Identity.load_or_create(tmp_path / "id.key")
    assert Identity.load_or_create(tmp_path / "id.key").peer_id == ident.peer_id  # stable across loads

    async def daemon_peer_id() -> str:
        p2p = await P2P.create(identity_path=ident.path, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            return p2p.peer_id.to_base58()
        finally:
            await p2p.shutdown()

    assert asyncio.run(daemon_peer_id()) == ident.peer_id
    other = Identity.load_or_create(None)
    verifier = Verifier()
    signature = ident.sign(b"record")
    assert verifier.verify(ident.peer_id, ident.public_key, b"record", signature)
    assert not verifier.verify(ident.peer_id, ident.public_key, b"recorc", signature)  # other bytes
    assert not verifier.verify(other.peer_id, ident.public_key, b"record", signature)  # key is not that peer's
    assert not verifier.verify(other.peer_id, other.public_key, b"record", signature)  # signed by someone else
    assert not verifier.verify(ident.peer_id, b"\x08\x00junk", b"record", signature)  # malformed key
    assert not verifier.verify(ident.peer_id, ident.public_key, b"record", b"x" * 100_000)  # oversized
    assert peer_id_of(other.public_key) == other.peer_id
