"""Result deltas: a packed majority result sent as its flips against the previous step's result.

The voted sign of most parameters is the same as one step earlier (``benchmarks/flip_rate.py``
measures how often it is not), so a part's result can be sent as the positions where it differs
from the part's previous result, coded as gaps, and the receiver XORs them onto its copy of the
previous result. Exact: ``decode_delta(encode_delta(r, p), p, len(r)) == r`` for every r and p.

One tag byte, then the body (bits LSB first, as ``ops.pack_signs`` packs them):

=====  ========  ===========================================================================
tag    name      body
=====  ========  ===========================================================================
0      plain     the packed result itself (nbytes bytes): no previous result, or nothing smaller
1      rice      the flips' gaps (zeros between consecutive flips, from position −1) in
                 Golomb-Rice code with parameter k, quotients and remainders as two streams:
                 varint count, byte k, varint quotient bytes, the quotients in unary (q ones
                 and a zero each, zero padding), then count·k remainder bits
2      zlib      zlib stream of the packed flip bitmap (XOR of the two results)
=====  ========  ===========================================================================

The encoder sends the smallest of the three; a delta that is not smaller than plain is refused
by the decoder (only one encoding of each result is valid, and memory stays bounded by the
part's size). Golomb-Rice with the best k is within a few percent of the entropy of independent
flips; zlib wins where flips cluster (see docs/benchmarks.md, "Cluster path and result bits").
The two streams of the Rice code make both directions vectorized numpy.
"""
from __future__ import annotations

import zlib

import numpy as np
import torch

PLAIN, RICE, ZLIB = 0, 1, 2
NAMES = {PLAIN: "plain", RICE: "rice", ZLIB: "zlib"}
MAX_K = 40  # Rice parameters above log2 of any part's bit count are never the smallest
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


# -- Golomb-Rice on gaps ---------------------------------------------------------------------------


def flip_positions(current: np.ndarray, previous: np.ndarray) -> np.ndarray:
    """Bit positions (LSB first) where two packed results differ, ascending int64."""
    return np.flatnonzero(np.unpackbits(current ^ previous, bitorder="little")).astype(np.int64)


def rice_size_bits(gaps: np.ndarray, k: int) -> int:
    return int((gaps >> k).sum()) + len(gaps) * (k + 1)


def best_rice_k(gaps: np.ndarray) -> int:
    """The Rice parameter that codes ``gaps`` in the fewest bits (exact search near log2 of the mean)."""
    if not len(gaps):
        return 0
    centre = max(int(np.log2(max(float(gaps.mean()), 1.0))), 0)
    candidates = range(max(centre - 2, 0), min(centre + 3, MAX_K) + 1)
    return min(candidates, key=lambda k: (rice_size_bits(gaps, k), k))


def _rice_body(positions: np.ndarray) -> bytes:
    gaps = np.diff(positions, prepend=-1) - 1
    count = len(gaps)
    k = best_rice_k(gaps)
    quotients = gaps >> k
    # unary: q ones then a zero per gap; the zero of gap i sits at sum(q[:i+1]) + i
    zeros_at = np.cumsum(quotients + 1) - 1
    used = int(zeros_at[-1]) + 1 if count else 0
    unary = np.ones(used, dtype=np.uint8)
    unary[zeros_at] = 0
    unary_bytes = np.packbits(unary, bitorder="little").tobytes()  # pads with zeros
    if k:
        remainders = gaps & ((1 << k) - 1)
        fields = ((remainders[:, None] >> np.arange(k, dtype=np.int64)) & 1).astype(np.uint8)
        remainder_bytes = np.packbits(fields.reshape(-1), bitorder="little").tobytes()
    else:
        remainder_bytes = b""
    return _varint(count) + bytes([k]) + _varint(len(unary_bytes)) + unary_bytes + remainder_bytes


def _rice_positions(body: bytes, nbits: int) -> np.ndarray:
    count, at = _read_varint(body, 0)
    if count > nbits:
        raise DeltaError(f"{count} flips in a result of {nbits} bits")
    if at >= len(body):
        raise DeltaError("truncated rice header")
    k = body[at]
    if k > MAX_K:
        raise DeltaError(f"rice parameter {k} above {MAX_K}")
    unary_len, at = _read_varint(body, at + 1)
    remainder_len = (count * k + 7) // 8
    if at + unary_len + remainder_len != len(body):
        raise DeltaError(f"rice body of {len(body)} bytes, its header says {at + unary_len + remainder_len}")
    if not count:
        if unary_len:
            raise DeltaError("quotients without flips")
        return np.zeros(0, dtype=np.int64)
    unary = np.unpackbits(np.frombuffer(body, dtype=np.uint8, count=unary_len, offset=at), bitorder="little")
    zeros_at = np.flatnonzero(unary == 0)
    if len(zeros_at) < count:
        raise DeltaError(f"{len(zeros_at)} quotients for {count} flips")
    used = int(zeros_at[count - 1]) + 1
    if (used + 7) // 8 != unary_len or unary[used:].any():
        raise DeltaError("quotient stream not canonical (extra bytes or padding bits)")
    quotients = np.diff(zeros_at[:count], prepend=-1) - 1
    if k:
        fields = np.unpackbits(np.frombuffer(body, dtype=np.uint8, offset=at + unary_len),
                               bitorder="little")
        if fields[count * k:].any():
            raise DeltaError("remainder stream padding bits set")
        remainders = fields[: count * k].reshape(count, k).astype(np.int64) @ (np.int64(1) << np.arange(k))
    else:
        remainders = np.zeros(count, dtype=np.int64)
    if int(quotients.max()) > (nbits - 1) >> k:  # before shifting: q << k must not overflow
        raise DeltaError("a gap runs past the result")
    gaps = (quotients << k) | remainders
    if int(gaps.max()) >= nbits:
        raise DeltaError("a gap runs past the result")
    positions = np.cumsum(gaps + 1) - 1
    if int(positions[-1]) >= nbits:
        raise DeltaError(f"flip at bit {int(positions[-1])} of a {nbits}-bit result")
    return positions


# -- the result encoding -----------------------------------------------------------------------------


def encode_candidates(current, previous) -> dict[str, bytes]:
    """Every encoding of ``current`` (packed result) against ``previous`` (None: plain only), by name."""
    cur = _bytes(current)
    out = {"plain": bytes([PLAIN]) + cur.tobytes()}
    if previous is None:
        return out
    prev = _bytes(previous)
    if prev.shape != cur.shape:
        raise ValueError(f"previous result has {prev.size} bytes, this one {cur.size}")
    out["rice"] = bytes([RICE]) + _rice_body(flip_positions(cur, prev))
    out["zlib"] = bytes([ZLIB]) + zlib.compress((cur ^ prev).tobytes(), 9)
    return out


def encode_delta(current, previous=None) -> bytes:
    """The smallest encoding of ``current`` given the receiver holds ``previous`` (plain on ties)."""
    candidates = encode_candidates(current, previous)
    return min(candidates.values(), key=len)  # dicts keep order: plain wins ties


def decode_delta(blob: bytes, previous, nbytes: int) -> torch.Tensor:
    """The packed result (nbytes,) uint8 that ``blob`` encodes against ``previous`` (None: the sender
    had to send plain). Raises DeltaError for anything that is not the sender's canonical choice
    in shape: a wrong size, a delta no smaller than plain, trailing bytes, a flip out of range. Work
    and memory are bounded by ``nbytes`` (what the caller expects), not by the blob's claims."""
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
    if tag not in (RICE, ZLIB):
        raise DeltaError(f"unknown result encoding {tag}")
    if previous is None:
        raise DeltaError("a delta result, but no previous result to apply it to")
    prev = _bytes(previous)
    if prev.size != nbytes:
        raise DeltaError(f"previous result has {prev.size} bytes, expected {nbytes}")
    if len(body) >= nbytes:
        raise DeltaError(f"{NAMES[tag]} delta of {len(body)} bytes is not smaller than the plain result")
    if tag == RICE:
        flips = np.zeros(8 * nbytes, dtype=np.uint8)
        flips[_rice_positions(body, 8 * nbytes)] = 1
        xor = np.packbits(flips, bitorder="little")
    else:
        inflater = zlib.decompressobj()
        try:
            raw = inflater.decompress(body, nbytes)  # at most nbytes out, whatever the stream says
        except zlib.error as e:
            raise DeltaError(f"zlib delta does not inflate: {e}") from None
        if len(raw) != nbytes or not inflater.eof or inflater.unconsumed_tail or inflater.unused_data:
            raise DeltaError(f"zlib delta does not inflate to exactly {nbytes} bytes")
        xor = np.frombuffer(raw, dtype=np.uint8)
    return torch.from_numpy(prev ^ xor)


def encoded_kind(blob: bytes) -> str:
    return NAMES.get(blob[0], "?") if blob else "?"


__all__ = ["PLAIN", "RICE", "ZLIB", "DeltaError", "encode_delta", "decode_delta", "encode_candidates", "encoded_kind",
           "flip_positions", "best_rice_k", "rice_size_bits"]
