"""Majority results sent as flips against results both ends already hold (``codecs_delta``).

Most voted signs repeat from one round to the next, so a reducer may send a part's result as its
flips against an earlier round's result. Both ends must hold that earlier result, so the voter says
which it holds (``VoteChunk.result_bases``: names, below, newest first) and the reducer uses only
those it holds too (``ResultChunk.delta_base``/``delta_before``). The signed header still carries
the digest of the plain result, so a wrong base or a forged delta decodes to bytes that fail the
digest: nothing is trusted that was not already checked before deltas existed. Recovery, audits
and evidence see only plain results.

A base is the whole packed result of a majority round (every part received), named by its round
id and a digest of its bytes: a reducer that signed different results for different voters
(equivocation) leaves them holding different bases under different names, so no delta is ever
decoded against the wrong base. A few are kept per buffer size (the model's parameter count / 8 bytes
each, and a two-level reducer's second-level part).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from ..codecs_delta import CONTEXT, PLAIN, DeltaError, decode_delta, encode_delta

DECLARED = 2  # bases a voter names per round: the context coder uses two
KEPT = 3  # one spare, so a base named when voting is still held when its result comes back
MAX_SIZES = 4  # buffer sizes kept at once: the whole buffer and a two-level reducer's part, across a regrouping
DIGEST_BYTES = 16
MAX_ID_BYTES = 64 + DIGEST_BYTES  # RoundSpec's bound on round ids, then the digest of the result


class ResultBases:
    """The newest complete majority results this peer holds, by name (loop thread only)."""

    def __init__(self, kept: int = KEPT):
        self.kept = kept
        self._results: OrderedDict[bytes, np.ndarray] = OrderedDict()

    def remember(self, round_id: bytes, packed: np.ndarray) -> None:
        """Keep ``packed`` (the round's whole packed result, uint8) as a base for later rounds."""
        packed = np.array(packed, dtype=np.uint8, copy=True).reshape(-1)
        name = round_id + hashlib.sha256(packed.tobytes()).digest()[:DIGEST_BYTES]
        self._results[name] = packed
        self._results.move_to_end(name)
        # ``kept`` of each size: a two-level group's reducer remembers its part's second-level result
        # between two of the whole buffer's, and evicting by age alone dropped a base it had just named
        same = [n for n, p in self._results.items() if p.size == packed.size]
        for old in same[: -self.kept]:
            del self._results[old]
        while len(self._results) > self.kept * MAX_SIZES:  # sizes of epochs long gone, oldest first
            self._results.popitem(last=False)

    def declared(self, nbytes: int) -> list[bytes]:
        """The bases to name in a vote for a buffer of ``nbytes`` bytes, newest first."""
        ids = [name for name, packed in reversed(self._results.items()) if packed.size == nbytes]
        return ids[:DECLARED]

    def get(self, name: bytes, nbytes: int) -> np.ndarray | None:
        packed = self._results.get(name)
        return packed if packed is not None and packed.size == nbytes else None


def check_declared(ids: list[bytes]) -> None:
    """ValueError unless ``ids`` is a well-formed ``result_bases`` field (a voter's claim)."""
    if len(ids) > DECLARED or any(not 0 < len(i) <= MAX_ID_BYTES for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"result_bases must name at most {DECLARED} distinct bases of 1..{MAX_ID_BYTES} bytes")


def encode_for(bases: ResultBases, declared: list[bytes], nbytes: int, bounds: tuple[int, int],
               wire: bytes) -> tuple[bytes, bytes, bytes] | None:
    """(delta blob, base id, before id or b"") for a part whose plain result is ``wire`` (bytes
    ``bounds`` of a buffer of ``nbytes``), or None when no declared base is held or plain is smallest."""
    held = [(rid, packed) for rid in declared if (packed := bases.get(rid, nbytes)) is not None]
    if not held:
        return None
    a, b = bounds
    (base_id, base), before = held[0], held[1] if len(held) > 1 else (b"", None)
    current = np.frombuffer(wire, dtype=np.uint8)
    # One delta kind per part: the two-class code when both ends hold two bases (it won 92-99% of
    # parts in benchmarks/flip_rate.py), else Rice; zlib's extra ~3 ms per 34 KB part rarely pays.
    kinds = ("rice",) if before[1] is None else ("context",)
    blob = encode_delta(current, base[a:b], None if before[1] is None else before[1][a:b], kinds)
    if blob[0] == PLAIN:
        return None
    return blob, base_id, before[0] if blob[0] == CONTEXT else b""


def decode_from(bases: ResultBases, declared: list[bytes], nbytes: int, bounds: tuple[int, int], blob: bytes,
                base_id: bytes, before_id: bytes) -> bytes:
    """The plain result of a part sent as a delta; ValueError for a base this peer did not name or
    no longer holds, or a malformed delta (the caller checks the result's signed digest next)."""
    if base_id not in declared or (before_id and before_id not in declared) or before_id == base_id:
        raise ValueError("the result is a delta against a round this peer did not name")
    base = bases.get(base_id, nbytes)
    before = bases.get(before_id, nbytes) if before_id else None
    if base is None or (before_id and before is None):
        raise ValueError("the result is a delta against a round this peer no longer holds")
    a, b = bounds
    try:
        plain = decode_delta(blob, base[a:b], b - a, None if before is None else before[a:b])
    except DeltaError as e:
        raise ValueError(f"undecodable result delta: {e}") from None
    return plain.numpy().tobytes()


__all__ = ["DECLARED", "KEPT", "ResultBases", "check_declared", "decode_from", "encode_for"]
