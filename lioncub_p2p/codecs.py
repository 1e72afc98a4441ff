"""Vote codecs: what a peer uploads, how a reducer tallies it, and what the reducer returns.

Everything on the wire is *bit planes*: a p-bit code per element is sent as p packed bit vectors
(plane j holds bit j of every element's code). A reducer adds planes with bit-sliced ripple adders
on 64-bit words, so tallies never leave the packed form, and the ``mean`` result *is* the tally's
planes.

Each upload codec maps an element's direction c to a code in [0, U] (U = ``max_code``); the tally
T = Σ codes over the n counted voters lies in [0, total] with total = n·U, and its sign of
(2T − total) is the vote:

=========  ================================  ======================================================
upload     code                              bits per element
=========  ================================  ======================================================
sign       1 if c > 0 else 0 (U = 1)         1
l1 (p)     q + s, q = clip(round(c/mean|c|   p   (s = 2**(p-1) - 1; the all-ones code is invalid and
           · s/2), −s, s) per tensor              clipped to U = 2s by the reducer)
=========  ================================  ======================================================

=========  ============================================================  ==========================
result     value every peer applies                                       bits per element
=========  ============================================================  ==========================
majority   sign(2T − total); ties -> shared random ±1                     1
ternary    sign(2T − total) in {−1, 0, 1}; base-3, 5 elements per byte   8/5 = 1.6
mean       (2T − total)/total, the exact average vote (D-Lion average)    ceil(log2(total + 1))
=========  ============================================================  ==========================
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import ops
from .ops.bitslice import compare_planes, planes_needed, planes_to_counts

# ---------------------------------------------------------------------------------------------
# Packing codes into planes


def pack_planes(codes: torch.Tensor, nplanes: int) -> torch.Tensor:
    """Integer codes (numel,) -> (nplanes, ceil(numel/8)) uint8 bit planes."""
    codes = codes.reshape(-1).to(torch.int32)
    return torch.stack([ops.torch_impl._pack_bools(((codes >> j) & 1).bool()) for j in range(nplanes)])


def unpack_planes(planes: torch.Tensor, numel: int) -> torch.Tensor:
    """(L, nbytes) bit planes -> integer codes (numel,) (uint8 or int16)."""
    return planes_to_counts(planes)[:numel]


# ---------------------------------------------------------------------------------------------
# Upload codecs


@dataclass(frozen=True)
class SignUpload:
    """1 bit per element: the packed sign of the direction (``ops.pack_signs``)."""

    name = "sign"
    planes = 1
    max_code = 1

    @property
    def bits_per_element(self) -> float:
        return 1.0

    def encode(self, c: torch.Tensor, *, seed: int = 0) -> torch.Tensor:
        return ops.pack_signs(c, seed=seed).unsqueeze(0)

    def tally(self, nbytes: int, max_voters: int) -> VoteTally:
        return VoteTally(self, nbytes, max_voters)


@dataclass(frozen=True)
class L1Upload:
    """p bits per element: the direction quantized with an L1 scale (Lion Cub's main variant).

    q = clip(round(c / mean|c| · s/2), −s, s), sent as the offset code q + s. The reducer sums the
    codes exactly (bit-sliced, any n), so the vote is magnitude-weighted without the int8 headroom
    limit of an integer all-reduce."""

    bits: int = 4
    name = "l1"

    def __post_init__(self) -> None:
        if not 2 <= self.bits <= 8:
            raise ValueError(f"l1 upload needs 2 <= bits <= 8, got {self.bits}")

    @property
    def planes(self) -> int:
        return self.bits

    @property
    def scale_steps(self) -> int:
        return (1 << (self.bits - 1)) - 1

    @property
    def max_code(self) -> int:
        return 2 * self.scale_steps

    @property
    def bits_per_element(self) -> float:
        return float(self.bits)

    def quantize(self, c: torch.Tensor) -> torch.Tensor:
        s = self.scale_steps
        mean_abs = c.abs().mean()
        if mean_abs == 0:
            return torch.zeros_like(c, dtype=torch.int32)
        return torch.clamp(torch.round(c.float() / mean_abs * (s / 2)), -s, s).to(torch.int32)

    def encode(self, c: torch.Tensor, *, seed: int = 0) -> torch.Tensor:
        return pack_planes(self.quantize(c) + self.scale_steps, self.bits)

    def tally(self, nbytes: int, max_voters: int) -> VoteTally:
        return VoteTally(self, nbytes, max_voters)


@dataclass(frozen=True)
class Bf16Upload:
    """16 bits per element: plain bfloat16 values (momentum averaging, not votes).

    On the wire the values are their little-endian bytes, so a buffer of numel values is a
    (1, 2*numel) uint8 "plane" and parts split it on 8-byte (4-value) boundaries."""

    name = "bf16"
    planes = 1
    max_code = 1
    align = 2  # bytes of the smallest self-contained piece (a chunk holds whole ones)
    bits_per_element = 16.0

    def nbytes_for(self, numel: int) -> int:
        return 2 * numel

    def values_in(self, nbytes: int) -> int:
        return nbytes // 2

    def value_span(self, a: int, b: int) -> slice:
        """The values that bytes [a, b) hold (a and b multiples of ``align``)."""
        return slice(a // 2, b // 2)

    def encode(self, values: torch.Tensor, *, seed: int = 0) -> torch.Tensor:
        return values.detach().reshape(-1).to(torch.bfloat16).contiguous().view(torch.uint8).unsqueeze(0)

    def decode(self, raw: torch.Tensor) -> torch.Tensor:
        """float32 values of whole pieces of bytes (1-D uint8); anything decodes, non-finite included."""
        return raw.reshape(-1).contiguous().view(torch.bfloat16).float()

    def rounding(self, bound: float) -> float:
        """How far a re-encoded average may move past the largest |value| it averaged."""
        return 0.0

    def tally(self, nbytes: int, max_voters: int) -> "FloatTally":
        return FloatTally(self, nbytes, max_voters)


FP8_BLOCK, FP8_BIAS, FP8_MAX = 7, 150, 448.0  # values per 8-byte block; exponent bias; largest e4m3 value


@dataclass(frozen=True)
class Fp8Upload:
    """64/7 ≈ 9.1 bits per element for momentum averaging: 43% fewer bytes than bf16, as accurate in
    training (``docs/benchmarks.md``).

    Each 8-byte block holds 7 values: byte 0 an exponent e shared by the block, bytes 1..7 e4m3 codes
    (``torch.float8_e4m3fn``: 4 exponent bits, 3 mantissa bits, largest 448), value = code · 2**(e − 150).
    The encoder picks the smallest power of two 2**k with max|block| / 2**k ≤ 448 and rounds each
    value / 2**k to the nearest e4m3 (ties to even): a value keeps 4 significant bits (within 1/16 of
    itself) down to 2**-15 of its block's largest, and is within 2**-17 of it below that, so small
    momenta next to large ones are not flushed to zero (an int8 code with the same shared scale,
    within 1/127 of the largest, cost +1.8% loss at equal steps in our test; this costs +0.1%).
    Blocks are 8 bytes, so the parts, chunks and audit leaves (all on 8-byte boundaries) hold whole
    blocks; the buffer ends with zeros up to a whole block."""

    name = "fp8"
    planes = 1
    max_code = 1
    align = 8
    bits_per_element = 64 / FP8_BLOCK

    def nbytes_for(self, numel: int) -> int:
        return 8 * -(-numel // FP8_BLOCK)

    def values_in(self, nbytes: int) -> int:
        return nbytes // 8 * FP8_BLOCK

    def value_span(self, a: int, b: int) -> slice:
        return slice(a // 8 * FP8_BLOCK, b // 8 * FP8_BLOCK)

    def encode(self, values: torch.Tensor, *, seed: int = 0) -> torch.Tensor:
        v = values.detach().reshape(-1).double()  # float64: every power-of-two scale is exact
        if not torch.isfinite(v).all():
            raise ValueError("non-finite value for an fp8 upload")
        v = torch.nn.functional.pad(v, (0, (-v.numel()) % FP8_BLOCK)).view(-1, FP8_BLOCK)
        m = v.abs().amax(1)
        mantissa, exponent = torch.frexp(m / FP8_MAX)  # m/448 = mantissa · 2**exponent, mantissa in [0.5, 1)
        k = exponent - (mantissa == 0.5).to(exponent.dtype)  # ceil(log2(m / 448)), up to the rounding of m/448:
        k = k + (m > FP8_MAX * torch.exp2(k.double())).to(k.dtype)  # ... settled by an exact comparison
        e = torch.where(m > 0, (k + FP8_BIAS).clamp(0, 255), 0)
        scaled = (v / torch.exp2((e - FP8_BIAS).double())[:, None]).clamp(-FP8_MAX, FP8_MAX)
        blocks = torch.empty((v.shape[0], 8), dtype=torch.uint8)
        blocks[:, 0] = e.to(torch.uint8)
        blocks[:, 1:] = scaled.float().to(torch.float8_e4m3fn).view(torch.uint8)  # float32 is exact here
        return blocks.view(1, -1)

    def decode(self, raw: torch.Tensor) -> torch.Tensor:
        """Values of whole blocks; the two NaN codes decode to NaN (refused by tallies and results)."""
        blocks = raw.reshape(-1, 8)
        scale = torch.exp2(blocks[:, 0].double() - FP8_BIAS)
        codes = blocks[:, 1:].contiguous().view(torch.float8_e4m3fn).float().double()
        return (codes * scale[:, None]).float().reshape(-1)

    def rounding(self, bound: float) -> float:
        return bound / 16  # half an e4m3 step of the largest value of a block (4 significant bits)

    def tally(self, nbytes: int, max_voters: int) -> "FloatTally":
        return FloatTally(self, nbytes, max_voters)


ValuesUpload = Bf16Upload | Fp8Upload  # momentum averaging: values, not votes
VALUE_CODECS = {"bf16": Bf16Upload(), "fp8": Fp8Upload()}


def is_values(codec: object) -> bool:
    return isinstance(codec, (Bf16Upload, Fp8Upload))


def signed_max(codec: ValuesUpload, codes: torch.Tensor) -> float:
    """The largest |value| ``codes`` decode to (0 for none): the bound a voter signs for its part of a
    momentum round, which its reducer checks and a trimmed mean of two clips by."""
    values = codec.decode(codes)
    return float(values.abs().max()) if values.numel() else 0.0


class FloatTally:
    """Each voter's values of one part, decoded into rows so robust rules can look at all of them,
    and its bytes as received (what audits open)."""

    def __init__(self, codec: ValuesUpload, nbytes: int, max_voters: int):
        if nbytes % codec.align:
            raise ValueError(f"a {codec.name} part needs a multiple of {codec.align} bytes, got {nbytes}")
        self.codec = codec
        self.rows = torch.zeros((max_voters, codec.values_in(nbytes)), dtype=torch.float32)
        self.raw = torch.zeros((max_voters, nbytes), dtype=torch.uint8)

    def add(self, voter: int, codes: torch.Tensor, offset: int) -> None:
        length = codes.shape[1]
        if offset % self.codec.align or length % self.codec.align:
            raise ValueError(f"{self.codec.name} chunks must hold whole values")
        values = self.codec.decode(codes)
        if not torch.isfinite(values).all():
            raise ValueError(f"non-finite value in a {self.codec.name} upload")
        self.rows[voter, self.codec.value_span(offset, offset + length)] = values
        self.raw[voter, offset : offset + length] = codes.reshape(-1)

    def remove(self, voter: int) -> None:
        self.rows[voter] = 0
        self.raw[voter] = 0

    def encode(self, result: "AverageResult", counted: list[int], *, seed: int, step: int, offset: int,
               bounds: Sequence[float] = ()) -> torch.Tensor:
        return self.codec.encode(result.aggregate(self.rows[counted], bounds)).reshape(-1)


UploadCodec = SignUpload | L1Upload | Bf16Upload | Fp8Upload


def upload_codec(spec: str | UploadCodec) -> UploadCodec:
    """"sign", "l1" (4 bits), "l1:P", "bf16", "fp8", or a codec instance."""
    if isinstance(spec, (SignUpload, L1Upload, Bf16Upload, Fp8Upload)):
        return spec
    if spec in VALUE_CODECS:
        return VALUE_CODECS[spec]
    name, _, bits = str(spec).partition(":")
    if name == "sign" and not bits:
        return SignUpload()
    if name == "l1":
        return L1Upload(int(bits)) if bits else L1Upload()
    raise ValueError(f"unknown upload encoding {spec!r}; use 'sign', 'l1' or 'l1:BITS' (votes), 'bf16' or 'fp8' "
                     f"(momentum values)")


# ---------------------------------------------------------------------------------------------
# The reducer's tally


class Tally:
    """Running sum of upload codes over voters, as bit planes on int64 words.

    ``add`` and ``subtract`` take a voter's code planes for a byte range starting at a multiple of
    8 bytes, so a reducer can count chunks as they arrive and take back a voter that fails midway."""

    def __init__(self, codec: UploadCodec, nbytes: int, max_voters: int, device: torch.device | str = "cpu"):
        self.codec = codec
        self.nbytes = nbytes
        self.nplanes = planes_needed(max_voters * codec.max_code)
        self._words = torch.zeros((self.nplanes, (nbytes + 7) // 8), dtype=torch.int64, device=device)

    def _code_words(self, codes: torch.Tensor) -> torch.Tensor:
        p, length = codes.shape
        if p != self.codec.planes:
            raise ValueError(f"expected {self.codec.planes} code planes, got {p}")
        padded = torch.zeros((p, (length + 7) // 8 * 8), dtype=torch.uint8, device=codes.device)
        padded[:, :length] = codes
        words = padded.view(torch.int64)
        if self.codec.max_code < (1 << p) - 1:  # clip the one invalid code (all ones) to max_code
            all_ones = words[0].clone()
            for plane in words[1:]:
                all_ones &= plane
            words[0] &= ~all_ones
        return words

    def _slice(self, offset: int, length: int) -> slice:
        if offset % 8 or offset < 0 or offset + length > self.nbytes:
            raise ValueError(f"byte range [{offset}, {offset + length}) is not an 8-aligned range of {self.nbytes}")
        return slice(offset // 8, (offset + length + 7) // 8)

    def add(self, codes: torch.Tensor, offset: int = 0) -> None:
        window = self._slice(offset, codes.shape[1])
        x = self._code_words(codes)
        acc = self._words[:, window]
        carry = None
        for k in range(self.nplanes):
            xk = x[k] if k < len(x) else None
            if xk is None and carry is None:
                break
            a = acc[k].clone()
            if xk is None:
                acc[k] ^= carry
                carry = a & carry
            elif carry is None:
                acc[k] ^= xk
                carry = a & xk
            else:
                t = a ^ xk
                acc[k] = t ^ carry
                carry = (a & xk) | (t & carry)
        self._words[:, window] = acc

    def subtract(self, codes: torch.Tensor, offset: int = 0) -> None:
        window = self._slice(offset, codes.shape[1])
        x = self._code_words(codes)
        acc = self._words[:, window]
        borrow = torch.zeros_like(acc[0])
        for k in range(self.nplanes):
            a = acc[k].clone()
            xk = x[k] if k < len(x) else torch.zeros_like(a)
            t = a ^ xk
            acc[k] = t ^ borrow
            borrow = (~a & xk) | (~t & borrow)
        self._words[:, window] = acc

    def planes(self) -> torch.Tensor:
        """The tally as (nplanes, nbytes) uint8 bit planes."""
        return self._words.view(torch.uint8).view(self.nplanes, -1)[:, : self.nbytes]


class VoteTally:
    """A reducer's tally of one part, per voter: chunks are counted as they arrive and kept, so a voter
    that fails midway can be taken back out (``remove``)."""

    def __init__(self, codec: UploadCodec, nbytes: int, max_voters: int):
        self.tally = Tally(codec, nbytes, max_voters)
        self.kept: dict[int, list[tuple[int, torch.Tensor]]] = {}

    def add(self, voter: int, codes: torch.Tensor, offset: int) -> None:
        self.tally.add(codes, offset)
        self.kept.setdefault(voter, []).append((offset, codes))

    def remove(self, voter: int) -> None:
        for offset, codes in self.kept.pop(voter, []):
            self.tally.subtract(codes, offset)

    def encode(self, result: "ResultCodec", counted: list[int], *, seed: int, step: int, offset: int) -> torch.Tensor:
        self.kept.clear()
        total = len(counted) * self.tally.codec.max_code
        return result.encode(self.tally.planes(), total, 8 * self.tally.nbytes, seed=seed, step=step, offset=offset)


def tally_of(codec: UploadCodec, uploads: list[torch.Tensor]) -> torch.Tensor:
    """Tally planes of complete uploads, each (planes, nbytes); a carry-save tree for 1-bit codes."""
    if not uploads:
        raise ValueError("no uploads to tally")
    if codec.planes == 1:
        return ops.count_planes(torch.stack([u[0] for u in uploads]))
    tally = Tally(codec, uploads[0].shape[1], len(uploads), uploads[0].device)
    for u in uploads:
        tally.add(u)
    return tally.planes()


# ---------------------------------------------------------------------------------------------
# Result codecs


def _threshold_masks(planes: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Packed masks (2T > total, 2T == total); the tie mask is None when total is odd."""
    greater, equal = compare_planes(planes, total // 2)
    return greater, (equal if total % 2 == 0 else None)


@dataclass(frozen=True)
class MajorityResult:
    """1 bit: sign of the vote, ties broken by the shared random stream of (seed, step)."""

    name = "majority"

    def bits_per_element(self, total: int) -> float:
        return 1.0

    def wire_size(self, numel: int, total: int) -> int:
        return ops.packed_size(numel)

    def encode(self, planes: torch.Tensor, total: int, numel: int, *, seed: int = 0, step: int = 0,
               offset: int = 0) -> torch.Tensor:
        """``offset`` is the part's first byte in the whole buffer: tie bits depend on the global position."""
        greater, tie = _threshold_masks(planes, total)
        if tie is not None:
            greater |= tie & ops.random_tie_bits(seed, step, planes.shape[1], offset=offset, device=planes.device)
        return greater

    def decode(self, wire: torch.Tensor, numel: int, total: int) -> torch.Tensor:
        """Packed bits, ready for ``ops.apply_update``."""
        return _expect_size(wire, self.wire_size(numel, total), self.name)


_POW3 = torch.tensor([1, 3, 9, 27, 81], dtype=torch.int32)
_TERNARY_TABLE = torch.tensor([[(b // 3**j) % 3 - 1 for j in range(5)] for b in range(256)], dtype=torch.float32)


@dataclass(frozen=True)
class TernaryResult:
    """sign(2T − total) in {−1, 0, 1}, five base-3 digits per byte (1.6 bits)."""

    name = "ternary"

    def bits_per_element(self, total: int) -> float:
        return 1.6

    def wire_size(self, numel: int, total: int) -> int:
        return (numel + 4) // 5

    def encode(self, planes: torch.Tensor, total: int, numel: int, *, seed: int = 0, step: int = 0,
               offset: int = 0) -> torch.Tensor:
        greater, tie = _threshold_masks(planes, total)
        if tie is None:
            tie = torch.zeros_like(greater)
        digits = unpack_planes(torch.stack([tie, greater]), numel).to(torch.int32)  # 0: −1, 1: tie, 2: +1
        digits = torch.cat([digits, digits.new_zeros((-numel) % 5)]).view(-1, 5)
        return (digits * _POW3.to(digits.device)).sum(1).to(torch.uint8)

    def decode(self, wire: torch.Tensor, numel: int, total: int) -> torch.Tensor:
        wire = _expect_size(wire, self.wire_size(numel, total), self.name)
        if wire.numel() and int(wire.max()) >= 243:
            raise ValueError("ternary result holds a byte >= 243, which is not 5 base-3 digits")
        return _TERNARY_TABLE.to(wire.device)[wire.long()].view(-1)[:numel]


@dataclass(frozen=True)
class MeanResult:
    """The exact tally T in ceil(log2(total+1)) bit planes; decodes to (2T − total)/total."""

    name = "mean"

    def bits_per_element(self, total: int) -> float:
        return float(planes_needed(total))

    def wire_size(self, numel: int, total: int) -> int:
        return planes_needed(total) * ops.packed_size(numel)

    def encode(self, planes: torch.Tensor, total: int, numel: int, *, seed: int = 0, step: int = 0,
               offset: int = 0) -> torch.Tensor:
        return planes[: planes_needed(total)].reshape(-1).clone()

    def decode(self, wire: torch.Tensor, numel: int, total: int) -> torch.Tensor:
        wire = _expect_size(wire, self.wire_size(numel, total), self.name)
        tally = unpack_planes(wire.view(planes_needed(total), -1), numel).to(torch.float32)
        if tally.numel() and float(tally.max()) > total:
            raise ValueError(f"mean result holds a tally above its total {total}")
        return (2 * tally - total) / total


@dataclass(frozen=True)
class AverageResult:
    """The average of value uploads (bf16 or fp8), returned in the same format (as many bytes).

    ``trimmed=True`` drops, per element, the ``trim`` fraction of largest and of smallest values
    (at least one of each once n >= 3) before averaging: one peer sending huge values moves the
    result by at most the spread of the honest ones. Of two rows there is nothing to drop: both are
    clipped to the smaller of the two maxima their voters signed (``bounds``, known to every party:
    the reducer, its auditors, the receivers' ``audit.value_bound``), so one of two cannot push 1e34
    into everyone's momenta."""

    trimmed: bool = False
    trim: float = 0.2

    @property
    def name(self) -> str:
        return "trimmed_mean" if self.trimmed else "average"

    def bits_per_element(self, total: int) -> float:
        return 16.0

    def wire_size(self, numel: int, total: int) -> int:
        return numel // 8  # numel counts bit positions of the part: its bytes are the encoded values

    def aggregate(self, rows: torch.Tensor, bounds: Sequence[float] = ()) -> torch.Tensor:
        """Per element (so a leaf's recount equals the part's); ``bounds``: the counted voters' signed maxima."""
        n = rows.shape[0]
        if self.trimmed and n == 2 and len(bounds) == 2:
            limit = float(min(bounds))
            return rows.clamp(-limit, limit).mean(0)
        if not self.trimmed or n < 3:
            return rows.mean(0)
        k = max(1, int(n * self.trim))
        if 2 * k >= n:
            k = (n - 1) // 2
        ordered = rows.sort(0).values
        return ordered[k : n - k].mean(0)

    def decode(self, wire: torch.Tensor, numel: int, total: int, codec: ValuesUpload = Bf16Upload()) -> torch.Tensor:
        """The values of a part of ``numel // 8`` bytes, in the round's value format (its upload's)."""
        wire = _expect_size(wire, self.wire_size(numel, total), self.name)
        values = codec.decode(wire)
        if not torch.isfinite(values).all():
            raise ValueError("non-finite value in an average result")
        return values


ResultCodec = MajorityResult | TernaryResult | MeanResult | AverageResult
RESULTS = {"majority": MajorityResult(), "ternary": TernaryResult(), "mean": MeanResult(),
           "average": AverageResult(), "trimmed_mean": AverageResult(trimmed=True)}


def result_codec(spec: str | ResultCodec) -> ResultCodec:
    if isinstance(spec, (MajorityResult, TernaryResult, MeanResult, AverageResult)):
        return spec
    if spec not in RESULTS:
        raise ValueError(f"unknown result encoding {spec!r}; use one of {sorted(RESULTS)}")
    return RESULTS[spec]


def _expect_size(wire: torch.Tensor, nbytes: int, name: str) -> torch.Tensor:
    if wire.dtype != torch.uint8 or wire.dim() != 1:
        raise TypeError(f"{name} result must be a 1-D uint8 tensor, got {wire.dtype} {tuple(wire.shape)}")
    if wire.numel() != nbytes:
        raise ValueError(f"{name} result has {wire.numel()} bytes, expected {nbytes}")
    return wire


def reduce_votes(uploads: list[torch.Tensor], upload: UploadCodec, result: ResultCodec, *, numel: int,
                 seed: int = 0, step: int = 0) -> torch.Tensor:
    """What a single reducer of the whole buffer returns: the encoded result of all uploads."""
    total = len(uploads) * upload.max_code
    return result.encode(tally_of(upload, uploads), total, numel, seed=seed, step=step)


def wire_bits_per_element(upload: UploadCodec, result: ResultCodec, n: int) -> float:
    """Upload plus result bits per element (what one peer sends and receives, before the butterfly's
    (n−1)/n factor)."""
    return upload.bits_per_element + result.bits_per_element(n * upload.max_code)


__all__ = [
    "SignUpload", "L1Upload", "Bf16Upload", "Fp8Upload", "ValuesUpload", "is_values", "UploadCodec", "upload_codec", "Tally", "VoteTally", "FloatTally",
    "tally_of", "MajorityResult", "AverageResult",
    "TernaryResult", "MeanResult", "ResultCodec", "result_codec", "reduce_votes", "wire_bits_per_element",
    "pack_planes", "unpack_planes",
]
