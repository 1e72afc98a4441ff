"""What a round's results are checked against: Merkle roots of votes and the reducer's signed header.

* **Merkle roots.** A voter's codes for a part are cut into leaves of ``leaf_bytes`` per plane
  (at most ``MAX_LEAVES`` leaves, at most ``MAX_LEAF_BYTES`` per leaf over all planes); a leaf is
  the plane-major bytes of its columns. Leaf hash = SHA-256(0x00 | leaf), node = SHA-256(0x01 |
  left | right), both cut to 16 bytes; an odd node is paired with itself. The number of leaves
  follows from the part size, so a root and a path are unambiguous.
* **Result header.** A reducer states the round, its part, the encodings, whom it counted, the root
  of each counted voter's codes, the consensus tag and the SHA-256 of the result bytes in a
  ``ResultHeader`` and signs exactly those bytes with its libp2p key. A voter checks the root of its
  own codes in every header it receives; an auditor opens leaves against the other roots.
* **Voter statements** (momentum rounds): each voter signs the root and max |value| of its bf16
  values for the part; the header carries them, so every receiver bounds the result on its own.
"""
from __future__ import annotations

import hashlib
import math
import struct
from typing import Sequence

import numpy as np
from google.protobuf.message import DecodeError

from ..wire import WireError, pb
from .partition import quorum
from .round import RoundSpec, result_wire, upload_wire

DIGEST_BYTES = 16
MAX_LEAVES = 256
MAX_LEAF_BYTES = 128 << 10
MAX_HEADER_BYTES = 64 << 10
MAX_TAG_BYTES = 32
_RESULT_DOMAIN = b"lioncub-result/2|"
_STATEMENT_DOMAIN = b"lioncub-statement/2|"


def leaf_bytes(nbytes: int, planes: int) -> int:
    """Bytes per plane in one Merkle leaf of a part of ``nbytes`` bytes per plane (a multiple of 8)."""
    per_leaf = -(-nbytes // MAX_LEAVES)  # ceil
    per_leaf = max(8, -(-per_leaf // 8) * 8)
    return min(per_leaf, max(8, MAX_LEAF_BYTES // max(planes, 1) // 8 * 8))


def leaf_count(nbytes: int, leaf: int) -> int:
    return max(1, -(-nbytes // leaf))


def depth(count: int) -> int:
    return math.ceil(math.log2(count)) if count > 1 else 0


def _leaf_hash(data: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + data).digest()[:DIGEST_BYTES]


def _node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()[:DIGEST_BYTES]


def leaf_of(codes: np.ndarray, leaf: int, k: int) -> bytes:
    """Leaf k of a (planes, nbytes) uint8 array: its columns [k*leaf, (k+1)*leaf), plane-major."""
    return np.ascontiguousarray(codes[:, k * leaf : (k + 1) * leaf]).tobytes()


class MerkleTree:
    """All levels of the tree over a voter's codes for a part (leaf hashes first, root last)."""

    def __init__(self, codes: np.ndarray, leaf: int):
        codes = np.ascontiguousarray(codes)
        count = leaf_count(codes.shape[1], leaf)
        level = []
        for k in range(count):  # hash each plane's slice in place: no copy of the leaf
            digest = hashlib.sha256(b"\x00")
            for plane in codes:
                digest.update(memoryview(plane[k * leaf : (k + 1) * leaf]))
            level.append(digest.digest()[:DIGEST_BYTES])
        self.levels = [level]
        while len(level) > 1:
            level = [_node_hash(level[i], level[i + 1] if i + 1 < len(level) else level[i])
                     for i in range(0, len(level), 2)]
            self.levels.append(level)

    @property
    def root(self) -> bytes:
        return self.levels[-1][0]

    def path(self, k: int) -> list[bytes]:
        siblings = []
        for level in self.levels[:-1]:
            sibling = k ^ 1
            siblings.append(level[sibling] if sibling < len(level) else level[k])
            k //= 2
        return siblings


def root_of(codes: np.ndarray, leaf: int) -> bytes:
    return MerkleTree(codes, leaf).root


def verify_path(root: bytes, data: bytes, k: int, count: int, path: Sequence[bytes]) -> bool:
    """True iff ``data`` is leaf ``k`` of ``count`` under ``root``."""
    if not 0 <= k < count or len(path) != depth(count) or any(len(s) != DIGEST_BYTES for s in path):
        return False
    node = _leaf_hash(data)
    for sibling in path:
        node = _node_hash(node, sibling) if k % 2 == 0 else _node_hash(sibling, node)
        k //= 2
    return node == root


# -- the result header ------------------------------------------------------------------------------


def result_signed_bytes(header: bytes) -> bytes:
    return _RESULT_DOMAIN + header


def statement_signed_bytes(round_id: bytes, part: int, root: bytes, max_abs: float) -> bytes:
    return _STATEMENT_DOMAIN + struct.pack(">H", len(round_id)) + round_id + struct.pack(">If", part, max_abs) + root


def build_header(spec: RoundSpec, part: int, counted: Sequence[int], roots: Sequence[bytes], tag: bytes,
                 tag_votes: int, wire: bytes, statements: Sequence[pb.VoterStatement] = (),
                 provisional: Sequence[int] = ()) -> bytes:
    start, stop = spec.bounds[part]
    upload, bits = upload_wire(spec.upload)
    header = pb.ResultHeader(
        round_id=spec.round_id, step=spec.step, part=part, start=start, stop=stop, upload=upload, upload_bits=bits,
        result=result_wire(spec.result), trim=getattr(spec.result, "trim", 0.0) if spec.result.name == "trimmed_mean"
        else 0.0, seed=spec.seed, group_size=len(spec.group), counted=list(counted), roots=list(roots), tag=tag,
        tag_votes=tag_votes, wire_digest=hashlib.sha256(wire).digest(),
        leaf_bytes=leaf_bytes(stop - start, spec.upload.planes), statements=list(statements),
        tie_offset=spec.tie_offset, quorum=spec.quorum, provisional=list(provisional),
        **second_level_reading(spec, part))
    return header.SerializeToString(deterministic=True)


def second_level_reading(spec: RoundSpec, part: int) -> dict[str, int]:
    """How part ``part``'s second-level round reads its reducer's margins (a two-level vote's group round)."""
    combine = spec.combine[part] if spec.combine else None
    if combine is None:
        return {}
    return {"second_level_groups": len(combine.group), "margin_bits": combine.upload.bits}


def header_quorum(header: pb.ResultHeader) -> int:
    """The votes a header's result must count (0 on the wire: a majority of the whole group)."""
    return header.quorum or quorum(header.group_size)


def parse_header(raw: bytes) -> pb.ResultHeader:
    """Decode a header and check what holds for any round: sizes, order, quorum."""
    if len(raw) > MAX_HEADER_BYTES:
        raise WireError(f"result header of {len(raw)} bytes")
    header = pb.ResultHeader()
    try:
        header.ParseFromString(raw)
    except DecodeError as e:
        raise WireError(f"undecodable result header: {e}") from e
    counted = list(header.counted)
    if not 0 < header.group_size or any(c >= header.group_size for c in counted) \
            or any(a >= b for a, b in zip(counted, counted[1:])):
        raise WireError(f"result header counts voters {counted[:8]} of a group of {header.group_size}")
    need = header_quorum(header)
    if not 0 < need <= header.group_size or len(counted) < need:
        raise WireError(f"result counts {len(counted)} voters, below the quorum of {need}")
    if len(header.roots) != len(counted) or any(len(r) != DIGEST_BYTES for r in header.roots):
        raise WireError("result header has no root for each counted voter")
    if len(header.tag) > MAX_TAG_BYTES or header.tag_votes > len(counted) - len(header.provisional):
        raise WireError(f"result claims a tag of {len(header.tag)} bytes with {header.tag_votes} votes")
    provisional = list(header.provisional)
    if not set(provisional) <= set(counted) or any(a >= b for a, b in zip(provisional, provisional[1:])):
        raise WireError(f"result header leaves out voters {provisional[:8]} it did not count, or not ascending")
    if len(header.wire_digest) != 32 or header.stop < header.start or header.leaf_bytes < 8:
        raise WireError("result header has a bad digest, part bounds or leaf size")
    return header


def check_header(spec: RoundSpec, part: int, raw: bytes) -> pb.ResultHeader:
    """``parse_header`` plus: it describes this round's part ``part`` with this round's encodings."""
    header = parse_header(raw)
    start, stop = spec.bounds[part]
    upload, bits = upload_wire(spec.upload)
    reading = second_level_reading(spec, part)
    expected = (spec.round_id, spec.step, part, start, stop, upload, bits, result_wire(spec.result), spec.seed,
                len(spec.group), leaf_bytes(stop - start, spec.upload.planes), spec.tie_offset, spec.quorum,
                reading.get("second_level_groups", 0), reading.get("margin_bits", 0))
    got = (header.round_id, header.step, header.part, header.start, header.stop, header.upload, header.upload_bits,
           header.result, header.seed, header.group_size, header.leaf_bytes, header.tie_offset, header_quorum(header),
           header.second_level_groups, header.margin_bits)
    if got != expected:
        raise WireError("result header describes another round, part or encoding")
    if spec.result.name == "trimmed_mean" and header.trim != np.float32(spec.result.trim):
        raise WireError("result header has another trim fraction")
    if spec.signs_votes:
        if header.statements and len(header.statements) != len(header.counted):
            raise WireError("result without a statement for each counted voter")
    elif header.statements:
        raise WireError("statements in a vote round's result")
    return header
