"""Bit-sliced arithmetic on packed bit vectors (device-agnostic torch).

A vote tally is kept as *bit planes*: plane k is a packed bit vector holding bit k of the count at
every position. Counting n packed rows is then pure word-wide boolean logic (a carry-save adder
tree), never an (n, positions) tensor, and the planes are already the wire form of the ``mean``
result. Work happens on int64 words in column blocks small enough to stay in cache.
"""
from __future__ import annotations

import torch

# Column block sizes: large enough that each torch op amortizes its dispatch cost and runs on all
# threads, small enough that a block's temporaries stay in the last-level cache (measured on a
# 2-core EPYC with 1 MiB L2 per core and 32 MiB L3; see benchmarks/kernels.py).
BLOCK_BYTES = 1 << 17
STACK_BLOCK_TARGET = 8 << 20  # bytes of all rows of a stack block


def _stack_block(rows: int) -> int:
    return max(1 << 15, min(1 << 19, STACK_BLOCK_TARGET // rows)) // 8 * 8


def planes_needed(max_count: int) -> int:
    """Bit planes that hold counts 0..max_count."""
    return max(1, int(max_count).bit_length())


def _words(block: torch.Tensor) -> torch.Tensor:
    """View (rows, nbytes) uint8 as (rows, ceil(nbytes/8)) int64, copying (zero-padded) only if needed."""
    rows, nbytes = block.shape
    if nbytes % 8 == 0 and block.is_contiguous():
        return block.view(torch.int64)
    padded = torch.zeros((rows, (nbytes + 7) // 8 * 8), dtype=torch.uint8, device=block.device)
    padded[:, :nbytes] = block
    return padded.view(torch.int64)


def _csa_tree(rows: list[torch.Tensor], nplanes: int) -> list[torch.Tensor]:
    """Sum equal-shaped 1-bit word vectors into ``nplanes`` bit planes with full adders.

    Each full adder turns three vectors of weight 2^k into one of weight 2^k and one of 2^(k+1),
    so n rows cost about n adders of 5 word operations each."""
    level = list(rows)
    planes = []
    for _ in range(nplanes):
        carries: list[torch.Tensor] = []
        while len(level) >= 3:
            a, b, c = level.pop(), level.pop(), level.pop()
            t = a ^ b
            carries.append((a & b) | (t & c))
            level.append(t ^ c)
        if len(level) == 2:
            a, b = level
            carries.append(a & b)
            level = [a ^ b]
        planes.append(level[0] if level else torch.zeros_like(rows[0]))
        level = carries
    return planes


def count_planes(stack: torch.Tensor) -> torch.Tensor:
    """Bit planes (planes_needed(n), nbytes) uint8 of the per-position count of 1-bits in ``stack``."""
    n, nbytes = stack.shape
    nplanes = planes_needed(n)
    out = torch.empty((nplanes, nbytes), dtype=torch.uint8, device=stack.device)
    block = _stack_block(n)
    for start in range(0, nbytes, block):
        stop = min(start + block, nbytes)
        words = _words(stack[:, start:stop])
        planes = _csa_tree(list(words.unbind(0)), nplanes)
        out[:, start:stop] = torch.stack(planes).view(torch.uint8)[:, : stop - start]
    return out


def compare_planes(planes: torch.Tensor, threshold: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed masks (count > threshold, count == threshold) from bit planes, MSB first."""
    nplanes, nbytes = planes.shape
    if threshold >= 1 << nplanes:
        raise ValueError(f"threshold {threshold} does not fit in {nplanes} planes")
    words = _words(planes)
    greater = torch.zeros_like(words[0])
    equal = torch.full_like(words[0], -1)
    for k in reversed(range(nplanes)):
        if (threshold >> k) & 1:
            equal &= words[k]
        else:
            greater |= equal & words[k]
            equal &= ~words[k]
    as_bytes = lambda w: w.view(torch.uint8)[:nbytes]  # noqa: E731
    return as_bytes(greater), as_bytes(equal)


_T1, _T2, _T3 = 0x00AA00AA00AA00AA, 0x0000CCCC0000CCCC, 0x00000000F0F0F0F0


def _transpose8x8(x: torch.Tensor) -> torch.Tensor:
    """Transpose the 8x8 bit matrix in every int64 (bit 8i+j -> 8j+i), three delta swaps.

    Arithmetic right shifts are safe: every mask stops below the sign-extended bits."""
    for shift, mask in ((7, _T1), (14, _T2), (28, _T3)):
        t = (x ^ (x >> shift)) & mask
        x = x ^ t ^ (t << shift)
    return x


def _planes_to_bytes(planes: torch.Tensor) -> torch.Tensor:
    """Up to 8 planes (L, nbytes) -> (nbytes*8,) uint8 counts.

    Byte k of word i holds byte i of plane k; transposing that 8x8 bit matrix yields the 8 counts
    of the word's positions, one per byte."""
    nplanes, nbytes = planes.shape
    out = torch.empty(nbytes, dtype=torch.int64, device=planes.device)
    for start in range(0, nbytes, BLOCK_BYTES):
        stop = min(start + BLOCK_BYTES, nbytes)
        block = torch.zeros((stop - start, 8), dtype=torch.uint8, device=planes.device)
        block[:, :nplanes] = planes[:, start:stop].T
        out[start:stop] = _transpose8x8(block.view(torch.int64).view(-1))
    return out.view(torch.uint8)


def planes_to_counts(planes: torch.Tensor) -> torch.Tensor:
    """Expand bit planes (L, nbytes) into counts (nbytes*8,): uint8 for L <= 8, int16 to 15, else int32."""
    nplanes = planes.shape[0]
    if nplanes <= 8:
        return _planes_to_bytes(planes)
    if nplanes > 31:
        raise ValueError(f"{nplanes} planes exceed int32 counts")
    dtype = torch.int16 if nplanes <= 15 else torch.int32
    counts = _planes_to_bytes(planes[:8]).to(dtype)
    for low in range(8, nplanes, 8):
        counts += _planes_to_bytes(planes[low : low + 8]).to(dtype) << low
    return counts
