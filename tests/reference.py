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


def e4m3(x: float) -> int:
    """The byte of the e4m3 value nearest x (|x| <= 448; ties to even): sign, 4 exponent bits (bias 7),
    3 mantissa bits; exponent field 0 holds the subnormals m/8 * 2**-6; no infinities."""
    sign = 0x80 if np.signbit(x) else 0
    a = abs(float(x))
    if a < 2.0 ** -6:  # subnormal range: steps of 2**-9
        q = int(np.rint(a / 2.0 ** -9))  # 8 steps = 2**-6: the smallest normal (0x08), also right
        return sign | q
    e = int(np.floor(np.log2(a)))
    while 2.0 ** e > a:
        e -= 1
    while 2.0 ** (e + 1) <= a:
        e += 1
    q = int(np.rint(a / 2.0 ** (e - 3)))  # 8..16 (16: the next binade)
    if q == 16:
        e, q = e + 1, 8
    return sign | (e + 7) << 3 | (q - 8)


def from_e4m3(byte: int) -> float:
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = byte >> 3 & 0xF, byte & 7
    if exponent == 15 and mantissa == 7:
        return float("nan")
    if exponent == 0:
        return sign * mantissa / 8 * 2.0 ** -6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


def fp8_blocks(values: np.ndarray) -> np.ndarray:
    """Blocks of 7 values (zeros pad the last), each 8 bytes: the exponent byte e = k + 150 of the
    smallest power of two 2**k with max|block| / 2**k <= 448 (0 for an all-zero block), then the 7
    values / 2**k as e4m3 bytes, as the protocol documents it."""
    v = np.asarray(values, dtype=np.float64).ravel()
    v = np.concatenate([v, np.zeros(-len(v) % 7)]).reshape(-1, 7)
    out = np.zeros((len(v), 8), dtype=np.uint8)
    for i, block in enumerate(v):
        m = np.abs(block).max()
        if m == 0:
            continue
        k = int(np.floor(np.log2(m / 448)))  # then correct log2's rounding both ways
        while m / 2.0 ** k > 448:
            k += 1
        while m / 2.0 ** (k - 1) <= 448:
            k -= 1
        k = min(max(k, -150), 105)
        out[i, 0] = k + 150
        out[i, 1:] = [e4m3(min(max(x / 2.0 ** k, -448.0), 448.0)) for x in block]
    return out.ravel()


def from_fp8_blocks(raw: np.ndarray) -> np.ndarray:
    blocks = np.asarray(raw, dtype=np.uint8).reshape(-1, 8)
    return np.array([from_e4m3(int(b)) * 2.0 ** (int(block[0]) - 150) for block in blocks for b in block[1:]],
                    dtype=np.float64).astype(np.float32)
