"""Counter-based pseudo-random bits that every peer can recompute.

Tie-breaks and zero signs must be identical on all peers, unbiased over positions, and cheap.
The bit for position ``p`` under a 32-bit ``key`` is

    bit(key, p) = ((mix32(key mod 2**32, p // 32) >> (p % 32)) & 1) ^ ((key >> 32) & 1)

so one hash yields 32 bits, and the packed words of the bit stream (viewed as little-endian
int32) are exactly ``mix32(key, arange(nwords))``, complemented when bit 32 of the key is set (the
zero signs of an odd step invert the even step's: ``ops.step_zero_keys``). The Triton kernels evaluate the same formula
per element with uint32 arithmetic; the torch path below evaluates it per word with int64
arithmetic masked to 32 bits. Both must stay in sync: tests compare them.
"""
from __future__ import annotations

import numpy as np
import torch

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B1  # spreads consecutive word indices over the 32-bit range
FMIX_1 = 0x85EBCA6B  # murmur3 finalizer constants
FMIX_2 = 0xC2B2AE35


def fmix32(h: int) -> int:
    """murmur3's 32-bit finalizer on a Python int (used to derive keys)."""
    h &= MASK32
    h ^= h >> 16
    h = (h * FMIX_1) & MASK32
    h ^= h >> 13
    h = (h * FMIX_2) & MASK32
    h ^= h >> 16
    return h


KEY_START = 0x5BD1E995


def fold_key(h: int, part: int) -> int:
    """Fold one integer (64 bits of it, negative ones too) into a key derivation's 32-bit state."""
    part = int(part)
    for shift in (0, 32):
        h = fmix32(h ^ ((part >> shift) & MASK32)) + GOLDEN
    return h & MASK32


def derive_key(*parts: int) -> int:
    """A 32-bit key from any number of integers (seed, step, tensor index, ...)."""
    h = KEY_START
    for part in parts:
        h = fold_key(h, part)
    return fmix32(h)


def derive_keys_numpy(parts: tuple[int, ...], count: int, outer: tuple[int, ...] = ()) -> np.ndarray:
    """[derive_key(*outer, derive_key(*parts, i)) for i in range(count)] as uint32, vectorized.

    The reference for ``numba_impl.derive_keys`` (and the path without numba)."""
    h = KEY_START
    for part in parts:
        h = fold_key(h, part)
    keys = _fmix32_np(_fold_np(np.full(count, h, dtype=np.uint64), np.arange(count, dtype=np.uint64)))
    if outer:
        h = KEY_START
        for part in outer:
            h = fold_key(h, part)
        keys = _fmix32_np(_fold_np(np.full(count, h, dtype=np.uint64), keys))
    return keys.astype(np.uint32)


def _fmix32_np(h: np.ndarray) -> np.ndarray:
    m = np.uint64(MASK32)
    h = h & m
    h ^= h >> np.uint64(16)
    h = (h * np.uint64(FMIX_1)) & m
    h ^= h >> np.uint64(13)
    h = (h * np.uint64(FMIX_2)) & m
    return h ^ (h >> np.uint64(16))


def _fold_np(h: np.ndarray, part: np.ndarray) -> np.ndarray:
    """fold_key for non-negative parts below 2**32 (tensor indices, keys): the high half is 0."""
    for half in (part, np.zeros_like(part)):
        h = (_fmix32_np(h ^ half) + np.uint64(GOLDEN)) & np.uint64(MASK32)
    return h


def random_words(key: int, first_word: int, nwords: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """32 random bits per word for word indices first_word .. first_word+nwords-1, as int32.

    Computed in int64 and masked, since torch has no uint32 arithmetic on every device."""
    h = _hash_words(key, torch.arange(first_word, first_word + nwords, dtype=torch.int64, device=device))
    if (key >> 32) & 1:
        h ^= MASK32
    return (h - ((h >> 31) << 32)).to(torch.int32)  # reinterpret as signed int32


def random_bits_packed(key: int, nbytes: int, device: torch.device | str = "cpu", *, first_byte: int = 0) -> torch.Tensor:
    """Bytes [first_byte, first_byte + nbytes) of the stream, packed LSB-first; first_byte % 4 == 0."""
    words = random_words(key, first_byte // 4, (nbytes + 3) // 4, device)
    return words.view(torch.uint8)[:nbytes]


def random_bits_at(key: int, positions: torch.Tensor) -> torch.Tensor:
    """The stream's bits at arbitrary int64 positions, as a bool tensor."""
    h = _hash_words(key, positions >> 5)
    return (((h >> (positions & 31)) & 1) ^ ((key >> 32) & 1)).bool()


def _hash_words(key: int, words: torch.Tensor) -> torch.Tensor:
    """mix32(key, word) for an int64 tensor of word indices; values in [0, 2**32)."""
    h = ((words * GOLDEN) & MASK32) ^ (key & MASK32)
    h ^= h >> 16
    h = (h * FMIX_1) & MASK32
    h ^= h >> 13
    h = (h * FMIX_2) & MASK32
    return h ^ (h >> 16)
