"""Independent numpy references for the kernels and codecs (written from the spec, not from the code)."""
import numpy as np


def mix32(key: int, words: np.ndarray) -> np.ndarray:
    """The documented stream hash on uint32 arithmetic: murmur3 fmix32(word*0x9E3779B1 ^ key)."""
    with np.errstate(over="ignore"):
        h = words.astype(np.uint32) * np.uint32(0x9E3779B1) ^ np.uint32(key)
        h ^= h >> np.uint32(16)
        h *= np.uint32(0x85EBCA6B)
        h ^= h >> np.uint32(13)
        h *= np.uint32(0xC2B2AE35)
        h ^= h >> np.uint32(16)
    return h


def stream_bits(key: int, positions: np.ndarray) -> np.ndarray:
    positions = np.asarray(positions, dtype=np.int64)
    bits = (mix32(key & 0xFFFFFFFF, positions >> 5) >> (positions & 31).astype(np.uint32)) & 1
    return (bits ^ ((key >> 32) & 1)).astype(bool)  # bit 32 of the key inverts the stream


def unpack(packed: np.ndarray, numel: int) -> np.ndarray:
    return np.unpackbits(np.asarray(packed, dtype=np.uint8), bitorder="little")[:numel].astype(bool)


def pack(bits: np.ndarray) -> np.ndarray:
    return np.packbits(np.asarray(bits, dtype=bool), bitorder="little")


def counts(stack: np.ndarray) -> np.ndarray:
    return np.unpackbits(stack, axis=1, bitorder="little").sum(0, dtype=np.int64)


def int8_blocks(values: np.ndarray) -> np.ndarray:
    """Block floating point as the protocol documents it: blocks of 7 values (zeros pad the last), each
    8 bytes: the exponent byte e = k + 150 of the smallest power of two 2**k with max|block| / 2**k
    <= 127 (0 for an all-zero block), then the 7 values rounded half-to-even to int8 steps of 2**k."""
    v = np.asarray(values, dtype=np.float64).ravel()
    v = np.concatenate([v, np.zeros(-len(v) % 7)]).reshape(-1, 7)
    out = np.zeros((len(v), 8), dtype=np.uint8)
    for i, block in enumerate(v):
        m = np.abs(block).max()
        if m == 0:
            continue
        k = int(np.floor(np.log2(m / 127)))  # then correct log2's rounding both ways
        while m / 2.0 ** k > 127:
            k += 1
        while m / 2.0 ** (k - 1) <= 127:
            k -= 1
        k = min(max(k, -150), 105)
        out[i, 0] = k + 150
        out[i, 1:] = np.clip(np.rint(block / 2.0 ** k), -127, 127).astype(np.int8).view(np.uint8)
    return out.ravel()


def from_int8_blocks(raw: np.ndarray) -> np.ndarray:
    blocks = np.asarray(raw, dtype=np.uint8).reshape(-1, 8)
    scale = 2.0 ** (blocks[:, :1].astype(np.float64) - 150)
    return (blocks[:, 1:].view(np.int8).astype(np.float64) * scale).astype(np.float32).ravel()
