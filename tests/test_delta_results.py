"""Result deltas (codecs_delta): every encoding decodes to exactly the result it encodes, the sender
picks the smallest, and corrupted, truncated or oversized encodings are refused with bounded memory."""
from __future__ import annotations

import random
import tracemalloc
import zlib

import numpy as np
import pytest
import torch

from lioncub_p2p.codecs_delta import (CONTEXT, PLAIN, RICE, ZLIB, DeltaError, best_rice_k, decode_delta, encode_candidates,
                                      encode_delta, encoded_kind, rice_size_bits)


def _pair(rng: np.random.Generator, nbytes: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(current, previous) packed results whose flips follow ``kind``."""
    previous = rng.integers(0, 256, nbytes, dtype=np.uint8)
    nbits = 8 * nbytes
    if kind == "none":
        flips = np.zeros(nbits, dtype=bool)
    elif kind == "all":
        flips = np.ones(nbits, dtype=bool)
    elif kind == "first":
        flips = np.zeros(nbits, dtype=bool)
        flips[:1] = True
    elif kind == "last":
        flips = np.zeros(nbits, dtype=bool)
        flips[-1:] = True
    elif kind == "bursts":  # whole runs flip (a tensor's signs turning together)
        flips = np.zeros(nbits, dtype=bool)
        for _ in range(rng.integers(1, 5)):
            a = int(rng.integers(0, max(nbits, 1)))
            flips[a : a + int(rng.integers(1, 4000))] = True
    elif kind == "far":  # a few flips with huge gaps
        flips = np.zeros(nbits, dtype=bool)
        flips[rng.integers(0, max(nbits, 1), size=min(3, nbits))] = True
    else:
        flips = rng.random(nbits) < float(kind)
    current = previous ^ np.packbits(flips, bitorder="little")
    return torch.from_numpy(current), torch.from_numpy(previous)


def _triple(rng: np.random.Generator, nbytes: int, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(current, previous, before): previous flipped ``kind``-like against before; current flips the
    positions that flipped at rate 0.6 and the others at 0.1 (oscillating signs), or ``kind`` again."""
    previous, before = _pair(rng, nbytes, kind)
    flipped = np.unpackbits((previous ^ before).numpy(), bitorder="little").astype(bool)
    if kind in ("none", "all", "first", "last"):
        flips = np.unpackbits(_pair(rng, nbytes, kind)[0].numpy() ^ _pair(rng, nbytes, kind)[1].numpy(),
                              bitorder="little").astype(bool) if kind != "none" else np.zeros(8 * nbytes, dtype=bool)
    else:
        flips = np.where(flipped, rng.random(8 * nbytes) < 0.6, rng.random(8 * nbytes) < 0.1)
    current = previous.numpy() ^ np.packbits(flips, bitorder="little")
    return torch.from_numpy(current), previous, before


KINDS = ["none", "all", "first", "last", "bursts", "far", "0.0001", "0.01", "0.1", "0.3", "0.5", "0.9"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_encoding_decodes_to_exactly_the_result(kind):
    rng = np.random.default_rng(abs(hash(kind)) % 2**32)
    for nbytes in (1, 2, 7, 8, 9, 63, 1000, 40_001):
        current, previous = _pair(rng, nbytes, kind)
        expected = current.numpy().tobytes()
        candidates = encode_candidates(current, previous)
        assert set(candidates) == {"plain", "rice", "zlib"}
        for name, blob in candidates.items():
            if name != "plain" and len(blob) >= len(candidates["plain"]):
                with pytest.raises(DeltaError, match="not smaller than the plain result"):
                    decode_delta(blob, previous, nbytes)
                continue
            assert decode_delta(blob, previous, nbytes).numpy().tobytes() == expected, (name, nbytes)
        chosen = encode_delta(current, previous)
        assert len(chosen) == min(len(b) for b in candidates.values())
        assert decode_delta(chosen, previous, nbytes).numpy().tobytes() == expected


@pytest.mark.parametrize("kind", KINDS)
def test_context_encodings_decode_to_exactly_the_result(kind):
    rng = np.random.default_rng(abs(hash(kind)) % 2**32 + 1)
    for nbytes in (1, 8, 9, 1000, 40_001):
        current, previous, before = _triple(rng, nbytes, kind)
        candidates = encode_candidates(current, previous, before)
        assert set(candidates) == {"plain", "rice", "zlib", "context"}
        blob = candidates["context"]
        if len(blob) < len(candidates["plain"]):
            out = decode_delta(blob, previous, nbytes, before)
            assert out.numpy().tobytes() == current.numpy().tobytes(), nbytes
        chosen = encode_delta(current, previous, before)
        assert len(chosen) == min(len(b) for b in candidates.values())
        assert decode_delta(chosen, previous, nbytes, before).numpy().tobytes() == current.numpy().tobytes()


def test_context_classes_are_coded_at_their_own_rates():
    """Flips at 0.6 where the previous step flipped (30% of positions) and 0.1 elsewhere: the context
    delta is within 5% of 0.3·H(0.6) + 0.7·H(0.1) bits per position, below the rice delta's H(0.25)."""
    rng = np.random.default_rng(5)
    nbytes = 100_000
    before = rng.integers(0, 256, nbytes, dtype=np.uint8)
    flipped = rng.random(8 * nbytes) < 0.3
    previous = before ^ np.packbits(flipped, bitorder="little")
    flips = np.where(flipped, rng.random(8 * nbytes) < 0.6, rng.random(8 * nbytes) < 0.1)
    current = previous ^ np.packbits(flips, bitorder="little")
    h = lambda p: -(p * np.log2(p) + (1 - p) * np.log2(1 - p))  # noqa: E731
    bound = 0.3 * h(0.6) + 0.7 * h(0.1)
    sizes = {k: 8 * len(v) / (8 * nbytes) for k, v in encode_candidates(current, previous, before).items()}
    assert sizes["context"] < 1.05 * bound, sizes
    assert sizes["rice"] > 0.95 * h(flips.mean()) and sizes["rice"] > 1.2 * sizes["context"], sizes
    assert encoded_kind(encode_delta(current, previous, before)) == "context"


def test_no_previous_result_means_plain():
    current = torch.arange(100, dtype=torch.uint8)
    blob = encode_delta(current)
    assert blob[0] == PLAIN and len(blob) == 101 and encoded_kind(blob) == "plain"
    assert torch.equal(decode_delta(blob, None, 100), current)
    delta = encode_delta(current, current)  # no flip at all: a few bytes
    assert delta[0] == RICE and len(delta) <= 5
    with pytest.raises(DeltaError, match="no previous result"):
        decode_delta(delta, None, 100)


def test_sizes_follow_the_flip_rate_near_the_entropy():
    """Independent flips at rate p: the Rice delta is within 5% of n·H(p) bits (+ a few header bytes)."""
    rng = np.random.default_rng(1)
    nbytes = 100_000
    for p in (0.001, 0.01, 0.1, 0.25):
        current, previous = _pair(rng, nbytes, str(p))
        h = -(p * np.log2(p) + (1 - p) * np.log2(1 - p))
        rice = len(encode_candidates(current, previous)["rice"])
        assert rice * 8 < 1.05 * h * 8 * nbytes + 80, (p, rice * 8 / (8 * nbytes), h)


def test_best_rice_k_is_the_exhaustive_minimum():
    rng = np.random.default_rng(2)
    for mean in (0.3, 2, 17, 300, 5000):
        gaps = rng.geometric(1 / (mean + 1), size=2000).astype(np.int64) - 1
        exhaustive = min(range(41), key=lambda k: (rice_size_bits(gaps, k), k))
        assert rice_size_bits(gaps, best_rice_k(gaps)) == rice_size_bits(gaps, exhaustive), mean


def test_random_corruptions_decode_or_raise_delta_error_only():
    """Flipped bits, truncations, extensions and random bytes: DeltaError or some result of the right
    size (a corrupted delta can still be a valid delta: the state digest catches what it changes)."""
    rng = np.random.default_rng(3)
    prng = random.Random(3)
    nbytes = 2000
    for trial in range(300):
        current, previous = _pair(rng, nbytes, prng.choice(["0.01", "0.1", "bursts", "far", "none"]))
        blob = bytearray(prng.choice(list(encode_candidates(current, previous).values())))
        how = trial % 4
        if how == 0:
            for _ in range(prng.randint(1, 4)):
                blob[prng.randrange(len(blob))] ^= 1 << prng.randrange(8)
        elif how == 1:
            del blob[prng.randrange(len(blob)) :]
        elif how == 2:
            blob += bytes(prng.randrange(256) for _ in range(prng.randint(1, 9)))
        else:
            blob = bytearray([prng.choice([PLAIN, RICE, ZLIB, 7])]) + bytes(
                prng.randrange(256) for _ in range(prng.randint(0, 300)))
        try:
            out = decode_delta(bytes(blob), previous, nbytes)
        except DeltaError:
            continue
        assert out.dtype == torch.uint8 and out.shape == (nbytes,)


def _varint(v: int) -> bytes:
    out = bytearray()
    while True:
        b, v = v & 0x7F, v >> 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


ADVERSARIAL = {
    "empty": b"",
    "unknown tag": bytes([9]) + b"\x00" * 10,
    "plain too short": bytes([PLAIN]) + b"\x00" * 999,
    "plain too long": bytes([PLAIN]) + b"\x00" * 1001,
    "count above the bits": bytes([RICE]) + _varint(8001) + bytes([0]) + _varint(0),
    "huge count": bytes([RICE]) + _varint(2**62) + bytes([0]) + _varint(0),
    "varint of 11 bytes": bytes([RICE]) + b"\xff" * 10 + b"\x01",
    "redundant varint": bytes([RICE]) + b"\x80\x00" + bytes([0]) + _varint(0),
    "k too large": bytes([RICE]) + _varint(1) + bytes([41]) + _varint(1) + b"\x00" + b"\x00" * 6,
    "length mismatch": bytes([RICE]) + _varint(2) + bytes([0]) + _varint(5) + b"\x00",
    "no zero in the quotients": bytes([RICE]) + _varint(3) + bytes([0]) + _varint(4) + b"\xff" * 4,
    "gap past the end": bytes([RICE]) + _varint(1) + bytes([13]) + _varint(1) + b"\x00" + b"\xff\x1f",
    "huge quotient, shift overflow": bytes([RICE]) + _varint(1) + bytes([40]) + _varint(120) + b"\xff" * 119
                                     + b"\x7f" + b"\x00" * 5,
    "padding bits set": bytes([RICE]) + _varint(1) + bytes([0]) + _varint(1) + b"\x02",
    "extra quotient byte": bytes([RICE]) + _varint(1) + bytes([0]) + _varint(2) + b"\x00\x00",
    "flips without quotients": bytes([RICE]) + _varint(0) + bytes([0]) + _varint(1) + b"\x00",
    "zlib of too much": bytes([ZLIB]) + zlib.compress(b"\x00" * 1001),
    "zlib of too little": bytes([ZLIB]) + zlib.compress(b"\x00" * 999),
    "zlib with trailing bytes": bytes([ZLIB]) + zlib.compress(b"\x00" * 1000) + b"\x00",
    "zlib garbage": bytes([ZLIB]) + b"\x78\x9c" + b"\x13" * 40,
    "context without the result before": bytes([CONTEXT]) + bytes(4),
    "bytes after the rice delta": bytes([RICE]) + _varint(0) + bytes([0]) + _varint(0) + b"\x00",
    "complement flag without a majority": bytes([RICE]) + _varint(4001) + bytes([0x80 | 12]) + _varint(1) + b"\x00",
    "plain flag with a majority set": bytes([RICE]) + _varint(4001) + bytes([12]) + _varint(1) + b"\x00" * 7,
    "delta as large as plain": bytes([ZLIB]) + zlib.compress(np.random.default_rng(0).integers(0, 256, 1000,
                                                                                                 dtype=np.uint8).tobytes(), 0),
}


REFUSALS = {"empty": "empty encoded result",
            "unknown tag": "unknown result encoding 9",
            "plain too short": "plain result of 999 bytes",
            "plain too long": "plain result of 1001 bytes",
            "count above the bits": "8001 positions in a stream of 8000 bits",
            "huge count": "positions in a stream of 8000 bits",
            "varint of 11 bytes": "varint longer than 10 bytes",
            "redundant varint": "redundant zero byte",
            "k too large": "rice parameter 41 above 40",
            "length mismatch": "rice stream runs to byte 8 of 4",
            "no zero in the quotients": "0 quotients for 3 positions",
            "gap past the end": "a gap runs past the stream",
            "huge quotient, shift overflow": "a gap runs past the stream",
            "padding bits set": "not canonical",
            "extra quotient byte": "not canonical",
            "flips without quotients": "quotients without positions",
            "zlib of too much": "inflate to exactly 1000",
            "zlib of too little": "inflate to exactly 1000",
            "zlib with trailing bytes": "inflate to exactly 1000",
            "zlib garbage": "inflate",
            "delta as large as plain": "not smaller than the plain",
            "context without the result before": "not the result before the previous one",
            "bytes after the rice delta": "1 bytes after the rice delta",
            "complement flag without a majority": "complement flag does not match",
            "plain flag with a majority set": "complement flag does not match"}


@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_crafted_encodings_are_refused_for_their_flaw(name):
    previous = torch.zeros(1000, dtype=torch.uint8)
    with pytest.raises(DeltaError, match=REFUSALS[name]):
        decode_delta(ADVERSARIAL[name], previous, 1000)


def test_a_quotient_that_would_overflow_the_shift_is_refused():
    """q = 2**24 with k = 40 wraps to gap 0 in int64: refused before shifting, not read as a flip at bit 0."""
    nbytes = 4 << 20
    unary = np.packbits(np.r_[np.ones(1 << 24, dtype=np.uint8), 0], bitorder="little").tobytes()
    blob = bytes([RICE]) + _varint(1) + bytes([40]) + _varint(len(unary)) + unary + b"\x00" * 5
    with pytest.raises(DeltaError, match="a gap runs past the stream"):
        decode_delta(blob, torch.zeros(nbytes, dtype=torch.uint8), nbytes)


def test_a_valid_craft_is_accepted():
    """The crafted cases above are refused for their flaw, not because crafting is wrong: the same
    construction with the flaw removed decodes (one flip at bit 5, then bit 7999)."""
    previous = torch.zeros(1000, dtype=torch.uint8)
    # gaps 5 and 7993 with k = 0 would be long; k = 12: q = (0, 1), r = (5, 7993 - 4096)
    q_bits = [0, 1, 0]  # q=0 -> "0"; q=1 -> "10"
    unary = np.packbits(np.array(q_bits, dtype=np.uint8), bitorder="little").tobytes()
    fields = np.array([[(r >> j) & 1 for j in range(12)] for r in (5, 7993 - 4096)], dtype=np.uint8)
    rem = np.packbits(fields.reshape(-1), bitorder="little").tobytes()
    blob = bytes([RICE]) + _varint(2) + bytes([12]) + _varint(len(unary)) + unary + rem
    out = np.unpackbits(decode_delta(blob, previous, 1000).numpy(), bitorder="little")
    assert list(np.flatnonzero(out)) == [5, 7999]


def test_memory_stays_bounded_by_the_expected_size():
    """A zlib bomb (100 MB of zeros in ~100 KB) and a maximal quotient stream against a 1 MB result:
    refused, and numpy's peak allocation stays within a fixed multiple of the result's size."""
    nbytes = 1 << 20
    previous = torch.zeros(nbytes, dtype=torch.uint8)
    bomb = bytes([ZLIB]) + zlib.compress(b"\x00" * (100 << 20), 9)
    assert len(bomb) < nbytes
    zeros = bytes([RICE]) + _varint(8 * nbytes) + bytes([0]) + _varint(nbytes - 8) + b"\x00" * (nbytes - 8)
    for blob in (bomb, zeros):
        tracemalloc.start()
        try:
            with pytest.raises(DeltaError):
                decode_delta(blob, previous, nbytes)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 80 * nbytes, f"peak {peak / nbytes:.0f} x the result's size"


def test_context_memory_stays_bounded_and_streams_must_fit_their_classes():
    """Against a 1 MB result whose previous step flipped everything: a first stream claiming more
    positions than its class, and a maximal quotient stream, are refused within bounded memory."""
    nbytes = 1 << 20
    previous, before = torch.zeros(nbytes, dtype=torch.uint8), torch.full((nbytes,), 255, dtype=torch.uint8)
    too_many = bytes([CONTEXT]) + _varint(8 * nbytes + 1) + bytes([0]) + _varint(0)
    zeros = bytes([CONTEXT]) + _varint(4 * nbytes) + bytes([0]) + _varint(nbytes - 16) + b"\x00" * (nbytes - 16)
    for blob, match in ((too_many, "positions in a stream of 8388608 bits"), (zeros, "not canonical")):
        tracemalloc.start()
        try:
            with pytest.raises(DeltaError, match=match):
                decode_delta(blob, previous, nbytes, before)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 80 * nbytes, f"peak {peak / nbytes:.0f} x the result's size"


def test_decoding_a_dense_valid_delta_stays_within_about_100_bytes_per_result_byte():
    nbytes = 1 << 20
    rng = np.random.default_rng(6)
    previous, before = torch.zeros(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    current = torch.from_numpy(np.packbits(rng.random(8 * nbytes) < 0.3, bitorder="little"))
    for name, blob in encode_candidates(current, previous, before).items():
        tracemalloc.start()
        try:
            out = decode_delta(blob, previous, nbytes, before)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert torch.equal(out, current) and peak < 128 * nbytes, (name, peak / nbytes)


def test_previous_of_another_size_is_refused():
    current, previous = torch.zeros(10, dtype=torch.uint8), torch.zeros(11, dtype=torch.uint8)
    with pytest.raises(ValueError, match="previous result has 11 bytes"):
        encode_delta(current, previous)
    with pytest.raises(DeltaError, match="previous result has 11 bytes, expected 10"):
        decode_delta(bytes([RICE]) + b"\x00\x00\x00", previous, 10)


def test_result_bases_are_named_by_round_and_content_and_bounded():
    """Two peers holding different results for the same round (a reducer that equivocated) name them
    differently, so neither decodes a delta against the other's; only the newest few are kept, and
    only those of the buffer's size are named."""
    from lioncub_p2p.allreduce.result_delta import DECLARED, KEPT, MAX_SIZES, ResultBases, check_declared, encode_for
    rng = np.random.default_rng(0)
    mine, theirs = ResultBases(), ResultBases()
    a = rng.integers(0, 256, 64, dtype=np.uint8)
    b = a.copy()
    b[3] ^= 4
    mine.remember(b"round-1", a)
    theirs.remember(b"round-1", b)
    assert mine.declared(64) != theirs.declared(64)
    current = a.copy()
    current[10] ^= 1
    assert encode_for(theirs, mine.declared(64), 64, (0, 64), current.tobytes()) is None  # not held: plain
    made = encode_for(mine, mine.declared(64), 64, (0, 64), current.tobytes())
    assert made is not None and len(made[0]) < 64
    for k in range(2, 2 + KEPT + 1):
        mine.remember(f"round-{k}".encode(), rng.integers(0, 256, 64, dtype=np.uint8))
    mine.remember(b"other-size", rng.integers(0, 256, 32, dtype=np.uint8))
    named = mine.declared(64)
    assert len(named) == DECLARED and all(n.startswith(f"round-{2 + KEPT}".encode()) or
                                          n.startswith(f"round-{1 + KEPT}".encode()) for n in named)
    assert mine.get(named[0], 32) is None and len(mine.declared(32)) == 1
    check_declared(named)
    # a two-level group's reducer: its part's second-level result comes between two of the whole
    # buffer's; the bases it named for the whole buffer are still held when the results come back
    reducer = ResultBases()
    for t in range(1, 4):
        reducer.remember(f"flat-{t}".encode(), rng.integers(0, 256, 64, dtype=np.uint8))
        named = reducer.declared(64)
        for k in range(KEPT):  # its second-level round(s) of step t+1 end before the whole buffer's
            reducer.remember(f"part-{t}-{k}".encode(), rng.integers(0, 256, 16, dtype=np.uint8))
        assert all(reducer.get(n, 64) is not None for n in named), t
    for size in range(1, 3 * MAX_SIZES):  # and many sizes (regroupings) stay bounded
        reducer.remember(f"size-{size}".encode(), rng.integers(0, 256, size, dtype=np.uint8))
    assert len(reducer._results) <= KEPT * MAX_SIZES
    for bad in ([b"x"] * 2, [b"a", b"b", b"c"], [b""], [b"y" * 81]):
        with pytest.raises(ValueError):
            check_declared(bad)
