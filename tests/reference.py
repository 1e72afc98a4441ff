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
