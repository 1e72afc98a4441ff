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


def test_a_key_with_another_public_exponent_is_no_key():
    """A valid RSA key with a huge public exponent makes each verification ~100x dearer (a flood of signed
    records from throwaway ids would hold every reader's event loop): only 65537 is accepted, what libp2p
    makes. Exponent 3 stands in here (the library makes no other); its signature is otherwise valid."""
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from hivemind.proto import crypto_pb2

    from lioncub_p2p.identity import _PADDING

    def key_and_signature(exponent: int) -> tuple[bytes, bytes]:
        private = rsa.generate_private_key(public_exponent=exponent, key_size=2048)
        spki = private.public_key().public_bytes(serialization.Encoding.DER,
                                                 serialization.PublicFormat.SubjectPublicKeyInfo)
        public = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=spki).SerializeToString()
        return public, private.sign(b"record", _PADDING, hashes.SHA256())

    verifier = Verifier()
    for exponent, accepted in ((65537, True), (3, False)):
        public, signature = key_and_signature(exponent)
        assert verifier.verify(peer_id_of(public), public, b"record", signature) is accepted, exponent


def test_a_broken_identity_file_is_one_clear_error_and_a_new_one_is_private(tmp_path):
    """A truncated key file raised protobuf's DecodeError (no ValueError: a traceback from the trainer);
    a new key was written with the default umask (0644) before hivemind narrowed it."""
    import os
    import stat

    import pytest

    good = Identity.load_or_create(tmp_path / "keys" / "id.key")
    assert stat.S_IMODE(os.stat(good.path).st_mode) & 0o077 == 0
    assert [p.name for p in (tmp_path / "keys").iterdir()] == ["id.key"]  # no scratch folder left
    broken = tmp_path / "broken.key"
    broken.write_bytes(open(good.path, "rb").read()[:40])
    with pytest.raises(ValueError, match="is not a libp2p RSA identity"):
        Identity(broken)
    (tmp_path / "text.key").write_text("hello")
    with pytest.raises(ValueError, match="is not a libp2p RSA identity"):
        Identity(tmp_path / "text.key")
