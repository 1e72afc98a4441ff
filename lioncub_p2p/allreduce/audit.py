"""Audits that a reducer cannot predict, and the proof they leave when they catch a liar.

After a round's results have arrived, each voter picks, with its own private randomness, one part
of another reducer and a few Merkle leaves of it, and asks that reducer for every counted voter's
codes in those leaves with their Merkle paths. The reducer committed to those codes (the roots in
its signed header) and to its result (the digest) *before* anyone chose, so it can neither dodge
nor adapt:

* an opening that does not verify against the signed root, no answer, or a refusal: the reducer
  cannot back its own result (reported, not provable to others);
* a recount of the opened codes that differs from the result bytes: a lie, with ``Evidence``
  (signed header, result bytes, opened codes) that anyone can check with ``check_evidence``;
* a root that differs from the voter's own codes: the reducer misrepresented that voter's vote
  (every voter checks its own root in every result, so fabricated votes are caught by their owner).

Catch rate: a reducer whose result differs from the honest one in the leaves it lies in is caught by
an auditor who opens one of them; with a auditors each opening ``leaves`` of the part's m leaves,
a lie in a fraction f of the leaves is caught per round with probability about
1 - (1 - f·leaves)^(a/(n-1)) (every voter audits one of the n-1 other parts).
"""
from __future__ import annotations

import hashlib
import numpy as np
import torch
from google.protobuf.message import DecodeError

from ..codecs import (FP8_BLOCK, AverageResult, Bf16Upload, Fp8Upload, L1Upload, ResultCodec, SignUpload, UploadCodec,
                      is_values, result_codec)
from ..identity import Verifier, peer_id_of
from ..ops import unpack_signs
from ..wire import PROTOCOL_VERSION, WireError, pb
from .commit import leaf_bytes, leaf_count, parse_header, result_signed_bytes, statement_signed_bytes, verify_path
from .hierarchy import derived_round_id, margin_codes
from .partition import PeerSpec, part_bounds

MAX_AUDIT_LEAVES = 8
MAX_EVIDENCE_BYTES = 64 << 20
BF16_RTOL = 2.0 ** -7  # one bf16 rounding step: recounts in another summation order may differ by this
_RESULTS = {pb.RESULT_MAJORITY: "majority", pb.RESULT_TERNARY: "ternary", pb.RESULT_MEAN: "mean",
            pb.RESULT_AVERAGE: "average"}


def codecs_of(header: pb.ResultHeader) -> tuple[UploadCodec, ResultCodec]:
    if header.upload == pb.UPLOAD_SIGN and header.upload_bits == 1:
        upload: UploadCodec = SignUpload()
    elif header.upload == pb.UPLOAD_L1 and 2 <= header.upload_bits <= 8:
        upload = L1Upload(header.upload_bits)
    elif header.upload == pb.UPLOAD_BF16 and header.upload_bits == 16:
        upload = Bf16Upload()
    elif header.upload == pb.UPLOAD_FP8 and header.upload_bits == 8:
        upload = Fp8Upload()
    else:
        raise WireError(f"unknown upload encoding ({header.upload}, {header.upload_bits})")
    if header.result == pb.RESULT_TRIMMED_MEAN:
        if not 0.0 < header.trim < 0.5:
            raise WireError(f"trim fraction {header.trim}")
        return upload, AverageResult(trimmed=True, trim=header.trim)
    if header.result not in _RESULTS:
        raise WireError(f"unknown result encoding {header.result}")
    return upload, result_codec(_RESULTS[header.result])


def leaf_span(header: pb.ResultHeader, k: int) -> tuple[int, int]:
    """Bytes [a, b) per plane of leaf k within the part."""
    size = header.stop - header.start
    a = k * header.leaf_bytes
    return a, min(a + header.leaf_bytes, size)


def decoded(header: pb.ResultHeader, result: ResultCodec, upload: UploadCodec, wire: bytes) -> torch.Tensor:
    """The part's result as one float per element (±1, ternary, mean, or momentum values)."""
    numel = 8 * (header.stop - header.start)
    raw = torch.frombuffer(bytearray(wire), dtype=torch.uint8) if wire else torch.zeros(0, dtype=torch.uint8)
    total = len(header.counted) * upload.max_code
    try:
        values = result.decode(raw, numel, total, codec=upload) if is_values(upload) else result.decode(raw, numel, total)
    except (ValueError, TypeError) as e:
        raise WireError(f"undecodable result: {e}") from e
    return unpack_signs(values, numel) if result.name == "majority" else values.float()


def _element_span(upload: UploadCodec, a: int, b: int) -> slice:
    return upload.value_span(a, b) if is_values(upload) else slice(8 * a, 8 * b)


def recount(header: pb.ResultHeader, upload: UploadCodec, result: ResultCodec, k: int,
            votes: list[bytes]) -> torch.Tensor:
    """Leaf k's result, one float per element, from the counted voters' codes of that leaf."""
    a, b = leaf_span(header, k)
    length, planes = b - a, upload.planes
    codes = [torch.frombuffer(bytearray(v), dtype=torch.uint8).view(planes, length) for v in votes]
    if is_values(upload):
        rows = torch.stack([upload.decode(c) for c in codes])
        return upload.decode(upload.encode(result.aggregate(rows, [s.max_abs for s in header.statements])))
    tally = upload.tally(length, header.group_size)
    for voter, c in zip(header.counted, codes):
        tally.add(voter, c, 0)
    wire = tally.encode(result, list(header.counted), seed=header.seed, step=header.step,
                        offset=header.tie_offset + header.start + a)
    leaf_header = pb.ResultHeader()
    leaf_header.CopyFrom(header)
    leaf_header.start, leaf_header.stop = header.start + a, header.start + b
    return decoded(leaf_header, result, upload, wire.numpy().tobytes())


def agrees(upload: UploadCodec, got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.shape != want.shape:
        return False
    if isinstance(upload, Bf16Upload):
        return bool(torch.all((got - want).abs() <= BF16_RTOL * torch.maximum(got.abs(), want.abs()) + 1e-30))
    if isinstance(upload, Fp8Upload):  # a recount may round to the neighbouring e4m3 value: one step is
        # at most 1/8 of the value, or a subnormal step (below 2**-16 of the block's largest)
        larger = torch.maximum(got.abs(), want.abs()).view(-1, FP8_BLOCK)
        tolerance = larger / 8 + larger.amax(1, keepdim=True) * 2.0 ** -16
        return bool(torch.all((got - want).abs().view(-1, FP8_BLOCK) <= tolerance + 1e-30))
    return torch.equal(got, want)


def check_openings(header: pb.ResultHeader, planes: int, k: int, answers: list[pb.AuditAnswer]) -> None:
    """Raises WireError unless ``answers`` open leaf k of every counted voter against the signed roots."""
    count = leaf_count(header.stop - header.start, header.leaf_bytes)
    a, b = leaf_span(header, k)
    if not 0 <= k < count or len(answers) != len(header.counted):
        raise WireError(f"audit answer for leaf {k} of {count} with {len(answers)} of {len(header.counted)} voters")
    for answer, voter, root in zip(answers, header.counted, header.roots):
        if answer.voter != voter or answer.leaf != k or len(answer.codes) != planes * (b - a):
            raise WireError(f"audit answer for voter {answer.voter}, leaf {answer.leaf} is not the one asked")
        if not verify_path(root, answer.codes, k, count, list(answer.path)):
            raise WireError(f"voter {voter}'s codes in leaf {k} do not open its signed root")


def first_level_leaves(first: pb.ResultHeader, x: int, y: int) -> list[int]:
    """The leaves of a group's round that hold bytes [x, y) of its part."""
    return list(range(x // first.leaf_bytes, (y - 1) // first.leaf_bytes + 1))


def owed_margins(first: pb.ResultHeader, openings: dict[int, list[pb.AuditAnswer]], bits: int, x: int,
                 y: int) -> bytes:
    """The margin codes (``hierarchy.margin_codes``, plane-major, ``bits`` planes of y - x bytes) that a
    group's reducer owes the second level for bytes [x, y) of its part, recounted from its counted voters'
    codes in the leaves ``first_level_leaves(first, x, y)``, each checked against the roots it signed in
    its group's result header ``first``. Raises WireError when an opening does not verify."""
    leaves = first_level_leaves(first, x, y)
    if sorted(openings) != leaves:
        raise WireError(f"openings of leaves {sorted(openings)[:8]}, not {leaves[:8]}")
    upload, _ = codecs_of(first)
    if not isinstance(upload, SignUpload):
        raise WireError("a two-level vote's groups vote signs")
    for k in leaves:
        check_openings(first, 1, k, openings[k])
    lo, hi = leaf_span(first, leaves[0])[0], leaf_span(first, leaves[-1])[1]
    tally = upload.tally(hi - lo, first.group_size)
    for i, voter in enumerate(first.counted):
        codes = b"".join(openings[k][i].codes for k in leaves)
        tally.add(voter, torch.frombuffer(bytearray(codes), dtype=torch.uint8).view(1, hi - lo), 0)
    margins = margin_codes(tally.tally.planes(), len(first.counted), bits)
    return np.ascontiguousarray(margins.numpy()[:, x - lo : y - lo]).tobytes()


MAX_SECOND_LEVEL_GROUPS = 4096  # a proof's slices, bounded before any work


def judge_margins(header: pb.ResultHeader, proof: pb.MarginsProof, votes: list[pb.AuditAnswer],
                  verifier: Verifier, reducer: str) -> str | None:
    """Why ``proof`` convicts ``reducer``, whose signed group-round header is ``header``: the margins it
    signed for one leaf of one slice of its part's second-level round differ from the recount of its
    group's votes at the same positions (``votes``: every counted voter's codes in each first-level leaf
    under that leaf, leaf by leaf). None if they agree. Raises WireError when a piece does not check
    out: the ids do not derive from ``flat_round``, the statement is not the reducer's, an opening does
    not verify. Everything it reads is bound by the reducer's signatures (its header fixes the slices
    and the margins' bits), so a proof cannot be made against an honest reducer."""
    groups, bits = header.second_level_groups, header.margin_bits
    if not 1 <= groups <= MAX_SECOND_LEVEL_GROUPS or not 2 <= bits <= 8 or not proof.slice < groups:
        raise WireError(f"margins of slice {proof.slice} of {groups} in {bits} bits: not a two-level group round")
    if derived_round_id(proof.flat_round, "group", proof.group) != header.round_id:
        raise WireError("the group's round does not derive from the flat round named")
    statement, answer = proof.statement, proof.margins
    if not signed_by(statement, reducer, derived_round_id(proof.flat_round, "part", header.part), proof.slice, verifier):
        raise WireError("the margins' statement is not signed by the reducer")
    a, b = part_bounds(header.stop - header.start, [PeerSpec(str(q)) for q in range(groups)])[proof.slice]
    if b <= a:
        raise WireError(f"slice {proof.slice} of the part is empty")
    leaf = leaf_bytes(b - a, bits)
    k, count = answer.leaf, leaf_count(b - a, leaf)
    a2 = k * leaf
    b2 = min(a2 + leaf, b - a)
    if not 0 <= k < count or len(answer.codes) != bits * (b2 - a2):
        raise WireError(f"margin leaf {k} of {count} with {len(answer.codes)} bytes")
    if not verify_path(statement.root, answer.codes, k, count, list(answer.path)):
        raise WireError("the margin codes do not open the reducer's signed root")
    x, y = a + a2, a + b2
    leaves = first_level_leaves(header, x, y)
    voters = len(header.counted)
    if len(votes) != voters * len(leaves):
        raise WireError(f"{len(votes)} openings for {len(leaves)} leaves of {voters} voters")
    openings = {k1: votes[i * voters:(i + 1) * voters] for i, k1 in enumerate(leaves)}
    owed = owed_margins(header, openings, bits, x, y)
    if owed == answer.codes:
        return None
    differ = int(np.count_nonzero(np.frombuffer(owed, np.uint8) != np.frombuffer(answer.codes, np.uint8)))
    return (f"the margins it signed for slice {proof.slice} of the second level differ from its counted votes in "
            f"{differ} of {len(owed)} bytes of leaf {k}")


def judge(header: pb.ResultHeader, wire: bytes, k: int, answers: list[pb.AuditAnswer]) -> str | None:
    """Why the opened leaf k convicts the reducer (a recount that differs from its result), or None if it
    agrees. Raises WireError when the answers do not open the leaf against the signed roots."""
    upload, result = codecs_of(header)
    a, b = leaf_span(header, k)
    check_openings(header, upload.planes, k, answers)
    want = recount(header, upload, result, k, [answer.codes for answer in answers])
    got = decoded(header, result, upload, wire)[_element_span(upload, a, b)]
    if agrees(upload, got, want):
        return None
    differ = int((got != want).sum())
    return f"result differs from the recount of its committed votes in {differ} elements of leaf {k}"


def value_bound(header: pb.ResultHeader, result: ResultCodec, upload: UploadCodec) -> float:
    """The largest |value| a momentum result may hold: what the counted voters signed, after trimming
    (a trimmed mean of c values drops k per side, so it is bounded by the (k+1)-th largest bound; of
    two, both rows are clipped to the smaller bound: ``AverageResult``)."""
    bounds = sorted((s.max_abs for s in header.statements), reverse=True)
    c = len(bounds)
    drop = 0
    if isinstance(result, AverageResult) and result.trimmed and c == 2:
        drop = 1
    elif isinstance(result, AverageResult) and result.trimmed and c >= 3:
        drop = max(1, int(c * result.trim))
        if 2 * drop >= c:
            drop = (c - 1) // 2
    return bounds[drop] * (1 + BF16_RTOL) + upload.rounding(bounds[drop])


def signed_by(statement: pb.VoterStatement, peer_id: str, round_id: bytes, part: int, verifier: Verifier) -> bool:
    """Whether ``peer_id`` signed ``statement`` (its root and bound) for part ``part`` of round ``round_id``."""
    return verifier.verify(peer_id, statement.public_key,
                           statement_signed_bytes(round_id, part, statement.root, statement.max_abs),
                           statement.signature)


def check_statements(header: pb.ResultHeader, group_ids: list[str], verifier: Verifier) -> None:
    """Every counted voter signed its root and bound (momentum rounds)."""
    for voter, root, statement in zip(header.counted, header.roots, header.statements):
        if statement.root != root or not np.isfinite(statement.max_abs) or statement.max_abs < 0:
            raise WireError(f"voter {voter}'s statement does not match its root or has a bad bound")
        if not signed_by(statement, group_ids[voter], header.round_id, header.part, verifier):
            raise WireError(f"voter {voter}'s statement is not signed by it")


def make_evidence(raw_header: bytes, signature: bytes, public_key: bytes, wire: bytes, k: int,
                  answers: list[pb.AuditAnswer]) -> bytes:
    return pb.Evidence(version=PROTOCOL_VERSION, header=raw_header, signature=signature, public_key=public_key,
                       wire=wire, leaf=k, votes=answers).SerializeToString()


def check_evidence(blob: bytes, verifier: Verifier | None = None) -> tuple[str, bytes, int, str] | None:
    """(reducer peer id, round id, part, reason) if ``blob`` proves that reducer lied, else None.

    Checks the reducer's signature on the header, the result bytes against the signed digest, the
    opened codes against the signed roots, and recounts: the result (``judge``), or, in a two-level
    group round, the margins it sent up (``judge_margins``). The caller checks that the reducer is the
    one of that part in the round it knows under that round id."""
    if len(blob) > MAX_EVIDENCE_BYTES:
        return None
    try:
        evidence = pb.Evidence.FromString(blob)
        header = parse_header(evidence.header)
        reducer = peer_id_of(evidence.public_key)
        if not (verifier or Verifier()).verify(reducer, evidence.public_key, result_signed_bytes(evidence.header),
                                               evidence.signature):
            return None
        if hashlib.sha256(evidence.wire).digest() != header.wire_digest:
            return None
        if evidence.HasField("margins"):
            reason = judge_margins(header, evidence.margins, list(evidence.votes), verifier or Verifier(), reducer)
        elif header.second_level_groups or header.margin_bits:
            # a two-level group round's result is the second level's majority, not its group's: a recount of
            # the group's votes differs from it wherever the other groups tipped the vote, honest or not
            return None
        else:
            reason = judge(header, evidence.wire, evidence.leaf, list(evidence.votes))
    except (DecodeError, WireError, ValueError, TypeError, RuntimeError, ArithmeticError, IndexError):
        return None
    return (reducer, header.round_id, header.part, reason) if reason else None
