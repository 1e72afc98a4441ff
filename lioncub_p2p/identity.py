"""A peer's libp2p identity in Python: sign with it, and check that bytes were signed by a peer id.

libp2p authenticates streams by peer id, but DHT records and results forwarded by a third peer carry
no such guarantee. A hivemind peer id is the SHA-256 multihash of the peer's RSA public key (libp2p's
protobuf encoding), so a record that carries that public key and a signature by the matching private
key is provably from that peer id. Every peer therefore runs with an identity file (one is created
in a private temporary directory when the user names none) that both the p2p daemon and this module
load.
"""
from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path

import base58
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from google.protobuf.message import DecodeError
from hivemind.p2p import P2P
from hivemind.proto import crypto_pb2

MAX_PUBLIC_KEY_BYTES = 800  # an RSA-4096 key in libp2p's encoding is ~550 bytes
MAX_SIGNATURE_BYTES = 512
_PADDING = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=32)
_SHA256_MULTIHASH = b"\x12\x20"  # multihash code sha2-256, 32-byte digest


def peer_id_of(public_key: bytes) -> str:
    """The base58 peer id of a libp2p-encoded public key."""
    return base58.b58encode(_SHA256_MULTIHASH + hashlib.sha256(public_key).digest()).decode()


class Identity:
    """The private key behind this peer's id."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        try:  # a truncated or foreign file: protobuf's DecodeError is no ValueError, and callers catch those
            key_proto = crypto_pb2.PrivateKey.FromString(Path(path).read_bytes())
            if key_proto.key_type != crypto_pb2.KeyType.RSA:
                raise ValueError("only RSA identities are supported")
            self._key = serialization.load_der_private_key(key_proto.data, password=None)
        except (DecodeError, ValueError, TypeError) as e:
            raise ValueError(f"{path} is not a libp2p RSA identity ({str(e) or type(e).__name__}): point --identity-path "
                             "at the file this peer created, or at a path that does not exist yet") from None
        self._named()

    def _named(self) -> None:
        spki = self._key.public_key().public_bytes(serialization.Encoding.DER,
                                                   serialization.PublicFormat.SubjectPublicKeyInfo)
        self.public_key = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=spki).SerializeToString()
        self.peer_id = peer_id_of(self.public_key)

    @classmethod
    def in_memory(cls, der: bytes | None = None) -> "Identity":
        """An identity with no file: a fresh RSA key, or the PKCS#8 ``der`` one (``der()``). What tests and
        benchmarks make by the hundred, as an attacker would; a peer's own has a file its daemon reads."""
        identity = cls.__new__(cls)
        identity.path = ""
        identity._key = rsa.generate_private_key(PUBLIC_EXPONENT, 2048) if der is None else \
            serialization.load_der_private_key(der, password=None)
        identity._named()
        return identity

    def der(self) -> bytes:
        """The private key, PKCS#8 DER (``in_memory`` takes it back)."""
        return self._key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption())

    @classmethod
    def load_or_create(cls, path: str | Path | None) -> "Identity":
        """The identity at ``path`` (created if missing), or a fresh one in a private temporary directory."""
        if path is None:
            directory = tempfile.mkdtemp(prefix="lioncub-id-")
            atexit.register(shutil.rmtree, directory, True)
            path = os.path.join(directory, "identity.key")
        if not os.path.exists(path):
            _create_privately(Path(path))
        return cls(path)

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data, _PADDING, hashes.SHA256())


def _create_privately(path: Path) -> None:
    """A new key at ``path``, never readable by others: written in a private (0700) folder beside it, then
    linked into place whole (a concurrent creator's key is kept, not overwritten)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=".identity-", dir=path.parent)
    try:
        fresh = os.path.join(scratch, "identity.key")
        P2P.generate_identity(fresh)  # then 0400 (hivemind), inside a folder only this user can enter
        with open(fresh, "rb") as f:
            os.fsync(f.fileno())
        try:
            os.link(fresh, path)
        except FileExistsError:
            pass
        except OSError:  # no hard links here (vfat, some network shares): an exclusive create, private from the start
            try:
                descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
            except FileExistsError:
                return
            with os.fdopen(descriptor, "wb") as f, open(fresh, "rb") as source:
                f.write(source.read())
                os.fsync(f.fileno())
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# libp2p and hivemind make keys with exponent 65537; a key with a huge one is valid RSA, but each
# verification then costs ~100x more (6.4 ms at a 2900-bit exponent): thousands of signed records from
# throwaway ids would hold every reader's event loop for tens of seconds per DHT read
PUBLIC_EXPONENT = 65537


class Verifier:
    """Checks signatures by peer id; keeps the last ``cache`` parsed keys (parsing costs more than verifying)."""

    def __init__(self, cache: int = 4096):
        self._keys: OrderedDict[bytes, rsa.RSAPublicKey | None] = OrderedDict()
        self._cache = cache

    def _load(self, public_key: bytes) -> rsa.RSAPublicKey | None:
        if public_key in self._keys:
            self._keys.move_to_end(public_key)
            return self._keys[public_key]
        key = None
        try:
            proto = crypto_pb2.PublicKey.FromString(public_key)
            if proto.key_type == crypto_pb2.RSA:
                loaded = serialization.load_der_public_key(proto.data)
                if isinstance(loaded, rsa.RSAPublicKey) and 2048 <= loaded.key_size <= 4096 \
                        and loaded.public_numbers().e == PUBLIC_EXPONENT:
                    key = loaded
        except Exception:  # any malformed key is simply not a key
            key = None
        self._keys[public_key] = key
        while len(self._keys) > self._cache:
            self._keys.popitem(last=False)
        return key

    def verify(self, peer_id: str, public_key: bytes, data: bytes, signature: bytes) -> bool:
        """True iff ``public_key`` is ``peer_id``'s and ``signature`` signs ``data`` with it."""
        if not isinstance(public_key, bytes) or not isinstance(signature, bytes):
            return False
        if len(public_key) > MAX_PUBLIC_KEY_BYTES or len(signature) > MAX_SIGNATURE_BYTES:
            return False
        if peer_id_of(public_key) != peer_id:
            return False
        key = self._load(public_key)
        if key is None:
            return False
        try:
            key.verify(signature, data, _PADDING, hashes.SHA256())
            return True
        except (InvalidSignature, ValueError):
            return False
