"""Result deltas: a packed majority result sent as its flips against the previous step's result.

The voted sign of most parameters is the same as one step earlier (``benchmarks/flip_rate.py``
measures how often it is not), so a part's result can be sent as the positions where it differs
from the part's previous result, and the receiver XORs them onto its copy of that result. A
parameter that flipped one step earlier flips again far more often than one that did not (signs
oscillate around zero), so when both ends also hold the result before that, the flips are coded in
two classes, those two contexts, each at its own rate. Exact: ``decode_delta(encode_delta(r, p, b),
p, len(r), b) == r`` for every r, p, b.

One tag byte, then the body (bits LSB first, as ``ops.pack_signs`` packs them):

=====  ========  ===========================================================================
tag    name      body
=====  ========  ===========================================================================
0      plain     the packed result itself (nbytes bytes): no previous result, or nothing smaller
1      rice      the flip bitmap as one Rice stream (below)
2      zlib      zlib stream of the packed flip bitmap (XOR of the two results)
3      context   two Rice streams: the flips at the positions that flipped one step earlier
                 (previous XOR the result before it), then the flips at the others, each over
                 its class's positions in order
=====  ========  ===========================================================================

A Rice stream codes a bit vector of known length m by the gaps (zeros) between its set bits, or
between its clear bits when more than half are set ("complement"), in Golomb-Rice code with the
parameter k that makes it smallest, quotients and remainders apart so both directions are
vectorized numpy: varint count, byte k | 0x80·complement, varint quotient bytes, the quotients in
unary (q ones and a zero each, zero padding), then count·k remainder bits (zero padding).

The encoder sends the smallest encoding (plain on ties). The decoder refuses anything malformed and
any delta that is not smaller than plain, so its work and memory are bounded by the part's size,
which the receiver knows, whatever the bytes claim: at most about 100 bytes of transient memory
per byte of the part (int64 positions of a dense delta), a few bytes for hostile streams that are
refused. It cannot tell whether a well-formed delta is
the one the reducer meant: the signed digest of the decoded result (and the state digest after
applying it) is what checks that (docs/benchmarks.md, "Cluster path and result bits").
"""
from __future__ import annotations

import zlib

import numpy as np
import torch

PLAIN, RICE, ZLIB, CONTEXT = 0, 1, 2, 3
NAMES = {PLAIN: "plain", RICE: "rice", ZLIB: "zlib", CONTEXT: "context"}
MAX_K = 40  # Rice parameters above log2 of any part's bit count are never the smallest
COMPLEMENT = 0x80
MAX_VARINT_BYTES = 10


class DeltaError(ValueError):
    """An encoded result that is not a valid encoding of a result of the expected size."""


def _bytes(t: torch.Tensor | np.ndarray | bytes) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        if t.dtype != torch.uint8 or t.dim() != 1:
            raise TypeError(f"a packed result is a 1-D uint8 tensor, got {t.dtype} {tuple(t.shape)}")
        return t.detach().cpu().numpy()
    if isinstance(t, (bytes, bytearray, memoryview)):
        return np.frombuffer(bytes(t), dtype=np.uint8)
    return np.asarray(t, dtype=np.uint8).reshape(-1)


def _bits(packed: np.ndarray) -> np.ndarray:
    return np.unpackbits(packed, bitorder="little").view(bool)


# -- varints -------------------------------------------------------------------------------------


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _read_varint(blob: bytes, at: int) -> tuple[int, int]:
    value = 0
    for i in range(MAX_VARINT_BYTES):
        if at + i >= len(blob):
            raise DeltaError("truncated varint")
        byte = blob[at + i]
        value |= (byte & 0x7F) << (7 * i)
        if not byte & 0x80:
            if i and not byte:
                raise DeltaError("varint with a redundant zero byte")
            return value, at + i + 1
    raise DeltaError("varint longer than 10 bytes")


# -- Rice streams ----------------------------------------------------------------------------------


def rice_size_bits(gaps: np.ndarray, k: int) -> int:
    return int((gaps >> k).sum()) + len(gaps) * (k + 1)


def best_rice_k(gaps: np.ndarray) -> int:
    """The Rice parameter that codes ``gaps`` in the fewest bits (exact search near log2 of the mean)."""
    if not len(gaps):
        return 0
    centre = max(int(np.log2(max(float(gaps.mean()), 1.0))), 0)
    candidates = range(max(centre - 2, 0), min(centre + 3, MAX_K) + 1)
    return min(candidates, key=lambda k: (rice_size_bits(gaps, k), k))


def _rice_stream(bits: np.ndarray) -> bytes:
    """A bool vector as a Rice stream (its length is known to the reader)."""
    complement = int(np.count_nonzero(bits)) > len(bits) // 2
    positions = np.flatnonzero(~bits if complement else bits)
    gaps = np.diff(positions, prepend=-1) - 1
    count = len(gaps)
    k = best_rice_k(gaps)
    quotients = gaps >> k
    zeros_at = np.cumsum(quotients + 1) - 1  # the zero closing gap i's unary code
    unary = np.ones(int(zeros_at[-1]) + 1 if count else 0, dtype=np.uint8)
    unary[zeros_at] = 0
    unary_bytes = np.packbits(unary, bitorder="little").tobytes()
    if k:
        fields = ((gaps[:, None] >> np.arange(k, dtype=np.int64)) & 1).astype(np.uint8)
        remainder_bytes = np.packbits(fields.reshape(-1), bitorder="little").tobytes()
    else:
        remainder_bytes = b""
    return (_varint(count) + bytes([k | (COMPLEMENT if complement else 0)]) + _varint(len(unary_bytes)) + unary_bytes
            + remainder_bytes)


def _read_rice_stream(body: bytes, at: int, length: int) -> tuple[np.ndarray, int]:
    """The bool vector of ``length`` that the Rice stream at ``body[at:]`` codes, and where it ends."""
    count, at = _read_varint(body, at)
    if count > length:
        raise DeltaError(f"{count} positions in a stream of {length} bits")
    if at >= len(body):
        raise DeltaError("truncated rice header")
    k, complement = body[at] & ~COMPLEMENT, bool(body[at] & COMPLEMENT)
    if k > MAX_K:
        raise DeltaError(f"rice parameter {k} above {MAX_K}")
    ones = length - count if complement else count
    if complement != (ones > length // 2):  # one way to code each vector: the fewer positions
        raise DeltaError("rice stream's complement flag does not match its count")
    unary_len, at = _read_varint(body, at + 1)
    remainder_len = (count * k + 7) // 8
    end = at + unary_len + remainder_len
    if end > len(body):
        raise DeltaError(f"rice stream runs to byte {end} of {len(body)}")
    bits = np.full(length, complement, dtype=bool)
    if not count:
        if unary_len:
            raise DeltaError("quotients without positions")
        return bits, end
    unary = np.unpackbits(np.frombuffer(body, dtype=np.uint8, count=unary_len, offset=at), bitorder="little")
    zeros = unary.size - int(np.count_nonzero(unary))
    if zeros < count:
        raise DeltaError(f"{zeros} quotients for {count} positions")
    if zeros >= count + 8:  # counted before listing them: hostile zeros cost no index array
        raise DeltaError("quotient stream not canonical (extra bytes or padding bits)")
    zeros_at = np.flatnonzero(unary == 0)
    used = int(zeros_at[count - 1]) + 1
    if (used + 7) // 8 != unary_len or unary[used:].any():
        raise DeltaError("quotient stream not canonical (extra bytes or padding bits)")
    quotients = np.diff(zeros_at[:count], prepend=-1) - 1
    if k:
        fields = np.unpackbits(np.frombuffer(body, dtype=np.uint8, count=remainder_len, offset=at + unary_len),
                               bitorder="little")
        if fields[count * k :].any():
            raise DeltaError("remainder stream padding bits set")
        fields = fields[: count * k].reshape(count, k)
        remainders = np.zeros(count, dtype=np.int64)
        for j in range(k):  # bit by bit: no (count, k) int64 temporary
            remainders |= fields[:, j].astype(np.int64) << j
    else:
        remainders = np.zeros(count, dtype=np.int64)
    if int(quotients.max()) > (length - 1) >> k:  # before shifting: q << k must not overflow
        raise DeltaError("a gap runs past the stream")
    del unary, zeros_at
    gaps = quotients
    gaps <<= k
    gaps |= remainders
    del remainders
    if int(gaps.max()) >= length:
        raise DeltaError("a gap runs past the stream")
    gaps += 1
    positions = np.cumsum(gaps, out=gaps)
    positions -= 1
    if int(positions[-1]) >= length:
        raise DeltaError(f"position {int(positions[-1])} in a stream of {length} bits")
    bits[positions] = not complement
    return bits, end


# -- the result encoding -----------------------------------------------------------------------------


def _context(previous: np.ndarray, before: np.ndarray) -> np.ndarray:
    """True where the previous step flipped the sign: the class whose flips are coded first."""
    return _bits(previous ^ before)


def encode_candidates(current, previous=None, before=None, kinds=None) -> dict[str, bytes]:
    """Every encoding of ``current`` (a packed result) given what the receiver holds: ``previous``
    (the last result; None: plain only) and ``before`` (the one before; adds "context"), by name;
    ``kinds``: only these deltas (plain always)."""
    kinds = set(NAMES.values()) if kinds is None else set(kinds)
    cur = _bytes(current)
    out = {"plain": bytes([PLAIN]) + cur.tobytes()}
    if previous is None:
        return out
    prev = _bytes(previous)
    if prev.shape != cur.shape:
        raise ValueError(f"previous result has {prev.size} bytes, this one {cur.size}")
    xor = cur ^ prev
    flips = _bits(xor)
    if "rice" in kinds:
        out["rice"] = bytes([RICE]) + _rice_stream(flips)
    if "zlib" in kinds:
        out["zlib"] = bytes([ZLIB]) + zlib.compress(xor.tobytes())
    if before is not None and "context" in kinds:
        earlier = _bytes(before)
        if earlier.shape != cur.shape:
            raise ValueError(f"the result before has {earlier.size} bytes, this one {cur.size}")
        context = _context(prev, earlier)
        out["context"] = bytes([CONTEXT]) + _rice_stream(flips[context]) + _rice_stream(flips[~context])
    return out


def encode_delta(current, previous=None, before=None, kinds=None) -> bytes:
    """The smallest encoding of ``current`` given the receiver holds ``previous`` and ``before``
    (among ``kinds`` and plain)."""
    return min(encode_candidates(current, previous, before, kinds).values(), key=len)  # dict order: plain wins ties


def decode_delta(blob: bytes, previous, nbytes: int, before=None) -> torch.Tensor:
    """The packed result (nbytes,) uint8 that ``blob`` encodes against ``previous`` (and ``before``
    for the context kind). Raises DeltaError for anything malformed: a wrong size, a delta no
    smaller than plain, trailing bytes, a position out of range, a missing reference. Work and
    memory are bounded by ``nbytes`` (what the caller expects), not by what the blob claims."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise TypeError(f"an encoded result is bytes, got {type(blob).__name__}")
    blob = bytes(blob)
    if not blob:
        raise DeltaError("empty encoded result")
    tag, body = blob[0], blob[1:]
    if tag == PLAIN:
        if len(body) != nbytes:
            raise DeltaError(f"plain result of {len(body)} bytes, expected {nbytes}")
        return torch.frombuffer(bytearray(body), dtype=torch.uint8) if nbytes else torch.zeros(0, dtype=torch.uint8)
    if tag not in NAMES:
        raise DeltaError(f"unknown result encoding {tag}")
    if previous is None:
        raise DeltaError("a delta result, but no previous result to apply it to")
    prev = _bytes(previous)
    if prev.size != nbytes:
        raise DeltaError(f"previous result has {prev.size} bytes, expected {nbytes}")
    if len(body) >= nbytes:
        raise DeltaError(f"{NAMES[tag]} delta of {len(body)} bytes is not smaller than the plain result")
    nbits = 8 * nbytes
    if tag == ZLIB:
        inflater = zlib.decompressobj()
        try:
            raw = inflater.decompress(body, nbytes)  # at most nbytes out, whatever the stream says
        except zlib.error as e:
            raise DeltaError(f"zlib delta does not inflate: {e}") from None
        if len(raw) != nbytes or not inflater.eof or inflater.unconsumed_tail or inflater.unused_data:
            raise DeltaError(f"zlib delta does not inflate to exactly {nbytes} bytes")
        return torch.from_numpy(prev ^ np.frombuffer(raw, dtype=np.uint8))
    if tag == RICE:
        flips, end = _read_rice_stream(body, 0, nbits)
    else:
        if before is None:
            raise DeltaError("a context delta, but not the result before the previous one")
        earlier = _bytes(before)
        if earlier.size != nbytes:
            raise DeltaError(f"the result before has {earlier.size} bytes, expected {nbytes}")
        context = _context(prev, earlier)
        flipped_before = int(np.count_nonzero(context))
        again, end = _read_rice_stream(body, 0, flipped_before)
        fresh, end = _read_rice_stream(body, end, nbits - flipped_before)
        flips = np.empty(nbits, dtype=bool)
        flips[context], flips[~context] = again, fresh
    if end != len(body):
        raise DeltaError(f"{len(body) - end} bytes after the {NAMES[tag]} delta")
    return torch.from_numpy(prev ^ np.packbits(flips, bitorder="little"))


def encoded_kind(blob: bytes) -> str:
    return NAMES.get(blob[0], "?") if blob else "?"


__all__ = ["PLAIN", "RICE", "ZLIB", "CONTEXT", "DeltaError", "encode_delta", "decode_delta", "encode_candidates",
           "encoded_kind", "best_rice_k", "rice_size_bits"]
