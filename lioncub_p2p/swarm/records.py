"""Signed DHT records: every record a peer acts on names its author and proves it.

A run keeps three keys in the DHT, ``{run}.peers``, ``{run}.group`` and ``{run}.manifest``, each a
dictionary with one subkey per author: the author's peer id. A value is a msgpack map

    {"r": run id, "t": kind, "p": payload, "k": author's libp2p public key, "s": signature}

where the payload is canonical JSON (sorted keys, no NaN or infinities) and the signature, made
with the author's libp2p identity (``identity.py``), covers run id, kind, subkey, the record's DHT
expiration time and the payload. So a record cannot be forged for another peer id, replayed into
another run, key or subkey, or replayed with a later expiration to shadow its author's newer ones.

Readers check everything before use (``open_record``): shape, sizes before decoding, signature,
that the subkey is the signer's peer id, and an expiration no further ahead than the kind allows.
``RunRecordValidator`` runs the same check inside the DHT, on every store a node accepts and on
every answer it reads: a forged or undecodable record is refused by honest nodes, and a node that
answers with one has its whole answer ignored (the reader asks the others), which is also what keeps
an undecodable value from reaching hivemind's decoder (where it would make ``get`` hang for ever).
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import struct
import time
from collections import OrderedDict
from collections.abc import Collection
from typing import Any, Iterable

import msgpack
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time

from ..identity import MAX_PUBLIC_KEY_BYTES, MAX_SIGNATURE_BYTES, Identity, Verifier

logger = logging.getLogger(__name__)

MAGIC = "lioncub-record/1"
# per kind: largest payload (bytes) and furthest expiration ahead of now (seconds)
LIMITS = {"peers": (4 << 10, 300.0), "group": (256 << 10, 300.0), "manifest": (16 << 10, 3600.0),
          "revoked": (128 << 10, 3600.0)}  # revoked: an invited run's authority lists withdrawn tickets (tickets.py)
MAX_SUBKEY_CHARS = 128
CLOCK_SKEW_S = 3.0  # hivemind's MAX_DHT_TIME_DISCREPANCY_SECONDS
_ENVELOPE_SLACK = 2048  # msgpack framing, key and signature on top of the payload
_MAX_PAYLOAD = max(size for size, _ in LIMITS.values())  # the largest kind's payload
REGULAR_VALUE_TAG = msgpack.packb(None)  # hivemind's subkey tag of a value stored without subkey


class RecordError(ValueError):
    """Why a DHT record was not used."""


def dht_key(run_id: str, kind: str) -> str:
    return f"{run_id}.{kind}"


def canonical(payload: dict) -> bytes:
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def signed_bytes(run_id: str, kind: str, subkey: str, expiration: float, payload: bytes) -> bytes:
    header = json.dumps([MAGIC, run_id, kind, subkey, float(expiration)], separators=(",", ":")).encode()
    return header + b"\n" + payload  # a JSON header has no raw newline: unambiguous


def seal(identity: Identity, run_id: str, kind: str, expiration: float, payload: dict) -> dict:
    """The DHT value of ``payload`` signed by ``identity``, to store under subkey ``identity.peer_id``."""
    body = canonical(payload)
    if len(body) > LIMITS[kind][0]:
        raise RecordError(f"{kind} record of {len(body)} bytes exceeds {LIMITS[kind][0]}")
    signature = identity.sign(signed_bytes(run_id, kind, identity.peer_id, expiration, body))
    return {"r": run_id, "t": kind, "p": body, "k": identity.public_key, "s": signature}


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a number")


def open_record(verifier: Verifier, run_id: str, kind: str, subkey: Any, value: Any, expiration: Any,
                *, now: float | None = None) -> dict:
    """The payload of a record read under ``{run_id}.{kind}``; RecordError if anything is off."""
    max_bytes, max_ahead = LIMITS[kind]
    if not isinstance(subkey, str) or not 0 < len(subkey) <= MAX_SUBKEY_CHARS:
        raise RecordError("subkey is not a peer id")
    if not isinstance(value, dict) or set(value) != {"r", "t", "p", "k", "s"}:
        raise RecordError("not a signed lioncub record")
    body, key, signature = value["p"], value["k"], value["s"]
    if not all(isinstance(x, bytes) for x in (body, key, signature)):
        raise RecordError("record fields have wrong types")
    if len(body) > max_bytes or len(key) > MAX_PUBLIC_KEY_BYTES or len(signature) > MAX_SIGNATURE_BYTES:
        raise RecordError("record too large")
    if value["r"] != run_id or value["t"] != kind:
        raise RecordError("record of another run or kind")
    if not isinstance(expiration, (int, float)) or not math.isfinite(expiration):
        raise RecordError("bad expiration time")
    if expiration > (get_dht_time() if now is None else now) + max_ahead + CLOCK_SKEW_S:
        raise RecordError(f"expiration {expiration - get_dht_time():.0f} s ahead, more than {max_ahead:.0f} s")
    if not verifier.verify(subkey, key, signed_bytes(run_id, kind, subkey, float(expiration), body), signature):
        raise RecordError("signature does not match the subkey's peer id")
    try:
        payload = json.loads(body, parse_constant=_no_constants)
    except (ValueError, RecursionError) as e:
        raise RecordError(f"payload is not JSON: {e}") from None
    if not isinstance(payload, dict):
        raise RecordError("payload is not a map")
    return payload


class RunRecordValidator(RecordValidatorBase):
    """hivemind record validator: refuses any record under a run's keys that ``open_record`` refuses,
    and any value stored there without a subkey (it would block every subkey store of the key).

    Records that carry a lioncub envelope under the keys of other runs are checked as well (the run
    and kind named in the envelope must hash to the record's key); other records pass untouched."""

    def __init__(self, run_ids: Iterable[str] = (), cache: int = 8192, authorities: dict[str, str] | None = None):
        self._known = {DHTID.generate(dht_key(run, kind)).to_bytes(): (run, kind) for run in run_ids for kind in LIMITS}
        # an invited run's authority (tickets.py): the one signer of its ``revoked`` list (throwaway ids
        # filling that key's subkeys kept the authority's own list out of every budgeted node)
        self._authorities = dict(authorities or {})
        self._cache_size = cache
        self._cache: OrderedDict[bytes, bool] = OrderedDict()
        self._verifier: Verifier | None = None  # made in the DHT process, on first use

    def validate(self, record: DHTRecord) -> bool:
        known = self._known.get(record.key)
        if known is None and len(record.value) > _MAX_PAYLOAD + _ENVELOPE_SLACK:
            return True  # too large to be one of ours: not our business (the storage budget's: dht_budget.py)
        if known is not None and len(record.value) > LIMITS[known[1]][0] + _ENVELOPE_SLACK:
            return False  # larger than its kind allows (its own limit, not the largest kind's): not even hashed
        digest = hashlib.blake2b(b"".join((record.key, b"\0", record.subkey, b"\0", record.value,
                                           struct.pack("<d", record.expiration_time))), digest_size=16).digest()
        if digest in self._cache:
            self._cache.move_to_end(digest)
            return self._cache[digest]
        verdict = self._check(record, known)
        if verdict is not None and math.isfinite(record.expiration_time):
            self._cache[digest] = verdict
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return True if verdict is None else verdict

    def _check(self, record: DHTRecord, known: tuple[str, str] | None) -> bool | None:
        """True/False for records under a lioncub key; None for keys that are not a run's."""
        try:
            largest = max(LIMITS[known[1]][0] if known is not None else _MAX_PAYLOAD, MAX_PUBLIC_KEY_BYTES)
            value = msgpack.unpackb(record.value, raw=False, strict_map_key=True, max_bin_len=largest,
                                    max_str_len=4096, max_array_len=16, max_map_len=16)
        except Exception:  # any undecodable value: never hand it to hivemind's decoder
            return False if known is not None else None
        if known is None:
            if not (isinstance(value, dict) and isinstance(value.get("r"), str) and value.get("t") in LIMITS
                    and DHTID.generate(dht_key(value["r"], value["t"])).to_bytes() == record.key):
                return None
            known = (value["r"], value["t"])
        if record.subkey == REGULAR_VALUE_TAG:
            return False
        try:
            subkey = msgpack.unpackb(record.subkey, raw=False, max_str_len=MAX_SUBKEY_CHARS)
            if self._verifier is None:
                self._verifier = Verifier()
            open_record(self._verifier, known[0], known[1], subkey, value, record.expiration_time)
            return known[1] != "revoked" or self._authorities.get(known[0], subkey) == subkey
        except Exception:
            return False


class RateLimitedLog:
    """Logs a warning per key at most once per ``period`` seconds, with the count it left out."""

    def __init__(self, log: logging.Logger, period: float = 60.0, max_keys: int = 4096):
        self.log, self.period, self.max_keys = log, period, max_keys
        self._last: OrderedDict[str, tuple[float, int]] = OrderedDict()

    def warning(self, key: str, message: str, *args: Any) -> bool:
        now = time.monotonic()
        last, skipped = self._last.get(key, (-math.inf, 0))
        if now - last < self.period:
            self._last[key] = (last, skipped + 1)
            return False
        self._last[key] = (now, 0)
        self._last.move_to_end(key)
        while len(self._last) > self.max_keys:
            self._last.popitem(last=False)
        self.log.warning(message + (f" ({skipped} more like it in the last {self.period:.0f} s)" if skipped else ""),
                         *args)
        return True


async def store_record(dht: Any, identity: Identity, run_id: str, kind: str, payload: dict, expiration: float,
                       *, timeout: float) -> bool:
    """Sign and store ``payload`` under ``{run_id}.{kind}``, subkey ``identity.peer_id``."""
    value = seal(identity, run_id, kind, expiration, payload)
    stored = await asyncio.wait_for(dht.store(dht_key(run_id, kind), value, expiration, subkey=identity.peer_id,
                                              return_future=True), timeout)
    return bool(stored)


async def read_records(dht: Any, run_id: str, kind: str, verifier: Verifier, log: RateLimitedLog, *,
                       timeout: float, limit: int, authors: Collection[str] | None = None) -> list[tuple[str, dict, float]]:
    """(author, payload, expiration) of every valid, unexpired record of ``kind``; the first ``limit``
    looked at. ``authors``: only theirs are looked at (nor counted, nor verified), so records from
    throwaway ids cannot push a wanted one past ``limit``. Never raises for what the DHT holds: a
    timeout or a bad record is logged and skipped."""
    try:
        found = await asyncio.wait_for(dht.get(dht_key(run_id, kind), latest=True, return_future=True), timeout)
    except asyncio.TimeoutError:
        log.warning(f"timeout:{kind}", "reading %s records timed out after %.0f s", kind, timeout)
        return []
    if found is None or not isinstance(found.value, dict):
        return []
    now, out = get_dht_time(), []
    items = found.value.items() if authors is None else \
        ((subkey, item) for subkey, item in found.value.items() if subkey in authors)
    for i, (subkey, item) in enumerate(items):
        if i >= limit:
            log.warning(f"flood:{kind}", "more than %d %s records; ignoring the rest", limit, kind)
            break
        expires = getattr(item, "expiration_time", None)
        if not isinstance(expires, (int, float)) or expires <= now:
            continue
        try:
            out.append((subkey, open_record(verifier, run_id, kind, subkey, getattr(item, "value", None), expires,
                                            now=now), float(expires)))
        except RecordError as e:
            log.warning(f"bad:{kind}:{str(e)[:40]}", "ignoring a %s record under subkey %.60r: %s", kind, subkey, e)
    return out
