"""What every peer of a round must agree on, the knobs, and the round's report."""
from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field

from ..codecs import Bf16Upload, Fp8Upload, MajorityResult, ResultCodec, SignUpload, UploadCodec, is_values
from ..wire import MAX_CHUNK_BYTES, WireError, pb
from .partition import PeerSpec, part_bounds, quorum


@dataclass(frozen=True)
class AllReduceConfig:
    """Timeouts (seconds), sizes and caps of a vote round. Tuning guide:

    * ``upload_timeout``: how long a reducer waits for votes, from the first vote of the part it
      received. A voter whose upload is not complete by then is left out of that part's count (it
      still gets the result). Set it above the slowest peer's compute skew plus its upload time.
    * ``result_timeout``: how long a voter waits, from the start of its round, for each part's
      result; must exceed ``upload_timeout`` plus the result's transfer time.
    * ``join_timeout``: how long a reducer holds a stream that arrived before its own round started
      (up to ``upload_timeout`` longer while the reducer still runs the step before).
    * ``recovery_timeout``: how long a peer asks the others for a part whose reducer failed (for
      the first answer's header; an answer under way gets the missing bytes' time at 1 Mbit/s more).
    * ``recovery_hedge_s``: members are asked for such a part one after another, the next one when
      the last one failed or has not begun to answer within this; above the slowest round trip.
    * ``chunk_bytes``: payload per message (≤ 1 MiB); 256 KiB was fastest on loopback.
    * ``keep_streams_s``: a voter keeps its stream to each reducer for the next round if that comes
      within this many seconds (opening a libp2p stream costs milliseconds per reducer per round);
      reducers close a kept stream idle for twice that.
    * ``first_frame_timeout``: a new incoming stream must deliver its first message within this;
      nothing is allocated to it before (see ``wire/gate.py`` for the stream caps).
    * ``audits_per_round``: parts each voter audits after a round (chosen privately, see
      ``audit.py``); ``audit_leaves``: Merkle leaves opened per audit; ``audit_timeout``: how long
      an auditor waits for the reducer's answer, plus its transfer at ``AUDIT_MIN_RATE`` (audits run
      in the background).
    * ``audit_window_s``: a reducer answers audits of a part for at least this long after it last
      sent the part's result (and members forward results they hold as long); auditors ask within
      half of it. ``audit_keep_bytes`` bounds what is kept for that (``archive.py``).
    * ``slice_audit_rate``: in a two-level round, the share of rounds after which a voter compares
      its parts with the second level's signed slices (``VoteNode._compare_with_second_level``):
      each comparison downloads a slice, 1/G of a part (every round: +9% bytes and +8% step time
      for 6 peers in 3 groups of 2 on namespaces); a reducer that lies every round is still caught
      within a few.
    * ``result_deltas``: majority results may come back as flips against an earlier round's result
      both ends hold (``result_delta.py``): 12–56% fewer result bytes on real training, a few ms of
      CPU per step to code them. Off: always the plain packed result."""

    chunk_bytes: int = 256 << 10
    upload_timeout: float = 10.0
    result_timeout: float = 20.0
    join_timeout: float = 5.0
    recovery_timeout: float = 5.0
    recovery_hedge_s: float = 1.0
    max_streams: int = 256  # concurrent incoming streams per handler, all peers together
    max_streams_per_peer: int = 8  # ... from one group member
    max_stranger_streams: int = 16  # ... from all peers in no recent group together (2 each at most)
    max_pending_rounds: int = 2  # rounds one peer may ask for before this peer started them
    keep_rounds: int = 4  # finished rounds kept to serve late voters, recovery requests and audits
    keep_streams_s: float = 30.0
    first_frame_timeout: float = 5.0
    audits_per_round: int = 1
    audit_leaves: int = 2
    audit_timeout: float = 10.0
    audit_window_s: float = 30.0
    audit_keep_bytes: int = 256 << 20
    slice_audit_rate: float = 0.25
    result_deltas: bool = True

    def __post_init__(self) -> None:
        if not 8 <= self.chunk_bytes <= MAX_CHUNK_BYTES or self.chunk_bytes % 8:
            raise ValueError(f"chunk_bytes must be a multiple of 8 in [8, {MAX_CHUNK_BYTES}], got {self.chunk_bytes}")
        if not 0 < self.upload_timeout < self.result_timeout:
            raise ValueError("need 0 < upload_timeout < result_timeout")
        if not 1 <= self.audit_leaves <= 8 or self.audits_per_round < 0:
            raise ValueError("need 1 <= audit_leaves <= 8 and audits_per_round >= 0")
        if not (self.audit_timeout > 0 and self.audit_window_s > 0 and self.audit_keep_bytes >= 0):
            raise ValueError("need audit_timeout > 0, audit_window_s > 0 and audit_keep_bytes >= 0")
        if not 0.0 <= self.slice_audit_rate <= 1.0:
            raise ValueError(f"slice_audit_rate must be in [0, 1], got {self.slice_audit_rate}")

    @property
    def serve_deadline(self) -> float:
        """The longest a reducer serves one round on one stream, from its first message: the votes,
        a wait for the round to start here, and the result. Whatever the stream does, it ends then."""
        return self.join_timeout + 2 * self.upload_timeout + self.result_timeout


AUDIT_MIN_RATE = 125_000  # bytes/s (1 Mbit/s): the slowest link an audit answer is given time for
FIRST_CHUNK_BYTES = 4096  # a stream's first chunk is small: the reducer admits its sender within
MAX_FIRST_FRAME_BYTES = 16 << 10  # ...its first-frame deadline and buffers at most this before that


def chunk_spans(nbytes: int, chunk_bytes: int, planes: int = 1) -> list[tuple[int, int]]:
    """(offset, length) of the chunks a voter sends for ``nbytes`` per plane: a first chunk of at most
    ``FIRST_CHUNK_BYTES`` (it must arrive within the reducer's first-frame deadline even on a slow
    link), then ``chunk_bytes`` each. A chunk carries ``length`` bytes of each of ``planes`` planes
    (an l1:4 code has 4), so lengths are divided by ``planes``: a frame's payload stays within them."""
    per_plane = max(8, chunk_bytes // planes // 8 * 8)
    first = max(8, min(FIRST_CHUNK_BYTES, chunk_bytes) // planes // 8 * 8)
    spans, offset = [], 0
    while offset < nbytes:
        length = min(first if offset == 0 else per_plane, nbytes - offset)
        spans.append((offset, length))
        offset += length
    return spans


_RESULT_ENUM = {"majority": pb.RESULT_MAJORITY, "ternary": pb.RESULT_TERNARY, "mean": pb.RESULT_MEAN,
                "average": pb.RESULT_AVERAGE, "trimmed_mean": pb.RESULT_TRIMMED_MEAN}


MAX_FAMILY_CHARS = 16


def upload_wire(codec: UploadCodec) -> tuple[int, int]:
    if isinstance(codec, SignUpload):
        return pb.UPLOAD_SIGN, 1
    if isinstance(codec, Bf16Upload):
        return pb.UPLOAD_BF16, 16
    if isinstance(codec, Fp8Upload):
        return pb.UPLOAD_FP8, 8
    return pb.UPLOAD_L1, codec.bits


def result_wire(codec: ResultCodec) -> int:
    return _RESULT_ENUM[codec.name]


@dataclass(frozen=True)
class RoundSpec:
    """One vote round. Every member builds the same spec (same group order, sizes and codecs)."""

    round_id: bytes
    step: int
    group: tuple[PeerSpec, ...]
    nbytes: int  # bytes per code plane of the whole buffer
    upload: UploadCodec = field(default_factory=SignUpload)
    result: ResultCodec = field(default_factory=MajorityResult)
    seed: int = 0
    audit: bool = False  # no effect since protocol 2: voters audit every round (see audit.py)
    # which of a step's rounds this is ("vote", "momentum"): a peer that ran the step's round of this
    # family under another id (another group) refuses streams for this one at once; "": no such check
    family: str = ""
    # A two-level vote (``hierarchy.py``): ``combine[k]`` is the second-level round the reducer of part
    # k runs with its group's counts, whose result it returns as part k's; () for a one-level round.
    combine: tuple["RoundSpec | None", ...] = ()
    tie_offset: int = 0  # where this buffer starts in the (seed, step) tie stream: a part of a larger one
    # a two-level vote's second-level round (``hierarchy.two_level_specs``): its voters are the groups'
    # reducers, and each signs the root of its margins (``signs_votes``), which binds them to it
    second_level: bool = False
    # a group's round of a two-level vote: the flat round both levels' ids derive from, and its group
    # (``hierarchy.derived_round_id``): a proof that its reducer sent up false margins names them
    flat_round: bytes = b""
    group_index: int = 0
    # a second-level round: the most each voter's margin may be, its group's size (an L1 code within
    # the codec's range but past the group's size is a count no honest group can make)
    margin_caps: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        ids = [p.peer_id for p in self.group]
        if len(set(ids)) != len(ids):
            raise ValueError("a peer appears twice in the group")
        if not self.round_id or len(self.round_id) > 64:
            raise ValueError("round_id must be 1..64 bytes")
        if len(self.family) > MAX_FAMILY_CHARS:
            raise ValueError(f"family must be at most {MAX_FAMILY_CHARS} characters")
        if self.tie_offset < 0 or self.tie_offset % 4:
            raise ValueError(f"tie_offset must be a non-negative multiple of 4, got {self.tie_offset}")
        if self.combine and (len(self.combine) != len(self.group) or self.result.name != "majority"
                             or not isinstance(self.upload, SignUpload)):  # its counts are of 1-bit votes
            raise ValueError("a two-level vote names one second-level round per member and votes a majority of signs")
        if self.margin_caps and (len(self.margin_caps) != len(self.group) or min(self.margin_caps) < 0):
            raise ValueError("margin_caps names one non-negative cap per member")
        object.__setattr__(self, "_bounds", part_bounds(self.nbytes, self.group))
        object.__setattr__(self, "_index", {pid: i for i, pid in enumerate(ids)})

    @property
    def bounds(self) -> list[tuple[int, int]]:
        return self._bounds  # type: ignore[attr-defined]

    @property
    def signs_votes(self) -> bool:
        """Each voter signs a statement of its codes' root (``pb.VoterStatement``): in momentum rounds with
        the bound of its values; in a second-level round so that a group's voters can hold its reducer
        to the margins it sent (``VoteNode._check_margins``)."""
        return is_values(self.upload) or self.second_level

    @property
    def voters(self) -> list[int]:
        """Group indices of the members expected to vote (``PeerSpec.voter``)."""
        return [i for i, p in enumerate(self.group) if p.voter]

    @property
    def quorum(self) -> int:
        """Votes a part's result must count: a majority of the members expected to vote (``PeerSpec.voter``)."""
        return quorum(len(self.voters))

    def index_of(self, peer_id: str) -> int:
        if peer_id not in self._index:  # type: ignore[attr-defined]
            raise WireError(f"peer {peer_id} is not in this round's group")
        return self._index[peer_id]  # type: ignore[attr-defined]

    def part_numel(self, part: int) -> int:
        start, stop = self.bounds[part]
        return 8 * (stop - start)

    def result_size(self, part: int, voters: int) -> int:
        return self.result.wire_size(self.part_numel(part), voters * self.upload.max_code)

    def check_vote_header(self, chunk: pb.VoteChunk) -> None:
        """Encodings and step of an incoming chunk must be this round's."""
        if (chunk.upload, chunk.upload_bits) != upload_wire(self.upload) or chunk.result != result_wire(self.result):
            raise WireError(f"encoding ({chunk.upload}, {chunk.upload_bits}, {chunk.result}) is not this round's "
                            f"({self.upload.name}, {self.result.name})")
        if chunk.step != self.step:
            raise WireError(f"step {chunk.step} does not match the round's step {self.step}")


@dataclass(frozen=True)
class PartResult:
    """A part's encoded result as its reducer produced it, with whom it counted, their consensus tag,
    the Merkle root of each counted voter's codes, and the reducer's signed header (empty when the
    reducer runs without an identity)."""

    wire: bytes
    counted: list[int]
    tag: bytes = b""
    tag_votes: int = 0
    roots: tuple[bytes, ...] = ()
    header: bytes = b""  # serialized ResultHeader, exactly the signed bytes
    signature: bytes = b""
    public_key: bytes = b""
    provisional: tuple[int, ...] = ()  # counted voters whose tags counted for no state (``PartReduction.tag_count``)


@dataclass(frozen=True)
class Caught:
    """A reducer this peer caught. ``kind``: "lie" (``evidence`` proves it to anyone, see
    ``audit.check_evidence``), "misrepresented" (its signed header has a wrong root for this peer's
    own codes), "unanswered" (audited, it did not open its commitments)."""

    peer_id: str
    round_id: bytes
    part: int
    kind: str
    reason: str
    evidence: bytes = b""


@dataclass
class PartReport:
    index: int
    reducer: int  # group index of the reducer
    start: int
    stop: int
    status: str = "pending"  # ok | recovered | missing | empty
    counted: list[int] = field(default_factory=list)  # group indices counted in this part
    note: str = ""
    tag: bytes = b""  # the counted voters' most common state tag, and how many sent it
    tag_votes: int = 0
    provisional: list[int] = field(default_factory=list)  # counted voters left out of the tag's count
    forgotten: bool = False  # its reducer refused it as a round it no longer keeps (``archive.FORGOTTEN``)
    other_group: bool = False  # its reducer refused this peer's votes: it ran this step in another group
    second_level: bool = False  # two-level: assembled from the second level's slices, not from its reducer

    def record(self, result: PartResult) -> None:
        self.counted, self.tag, self.tag_votes = list(result.counted), result.tag, result.tag_votes
        self.provisional = list(result.provisional)


def decides(votes: int, voters: Collection[int], counted: Collection[int],
            provisional: Collection[int] = ()) -> bool:
    """Whether ``votes`` for one state tag are more than half of a group's expected ``voters`` and of any
    others a part ``counted`` (a follower's vote that came in time counts, and counts against), less the
    counted voters whose state is ``provisional``: caught up from a donor and not yet decided for, their
    tag repeats their donor's. Counted, a liar's newcomer seconded the liar's state (2 of 3 decided for
    it); left out of the count alone, no pair with a newcomer could decide."""
    return 2 * votes > len((set(voters) | set(counted)) - set(provisional))


@dataclass
class RoundReport:
    """What one peer saw of one round."""

    round_id: str
    step: int
    peer: int
    parts: list[PartReport]
    bytes_up: int = 0  # everything this peer wrote to streams, framing included
    bytes_down: int = 0
    payload_up: int = 0  # code and result bytes alone
    payload_down: int = 0
    result_down: int = 0  # result bytes received from reducers, as sent (deltas included) ...
    result_plain: int = 0  # ... and as plain results: the result leg's saving is their ratio
    delta_parts: int = 0  # parts that came as deltas
    timings: dict[str, float] = field(default_factory=dict)
    dropped: list[tuple[int, str]] = field(default_factory=list)  # (voter, reason) in parts this peer reduced
    started: float = 0.0  # perf_counter when this peer began voting; timings are seconds from here
    group_epoch: int = 0  # the newest group epoch any reducer mentioned
    followed: bool = False  # this peer received the results without voting (``VoteNode.follow_round``)
    provisional: bool = False  # this peer voted with a provisional state (``VoteChunk.provisional``)
    # This peer's audit of this round: (part, reducer, verdict), verdict "ok" | "lie" |
    # "unanswered"; set when the audit ends, which may be after run_round returned (it runs in the
    # background), so read ``caught`` to act.
    audit: tuple[int, int, str] | None = None
    # Reducers this peer caught since its previous round returned: in this round (a wrong root for its
    # own codes) or by audits of earlier rounds that ended meanwhile. The swarm drops and refuses them.
    caught: list[Caught] = field(default_factory=list)
    combine: "RoundReport | None" = None  # a two-level vote: this peer's second-level round, if it ran one

    @property
    def missing_parts(self) -> list[int]:
        return [p.index for p in self.parts if p.status == "missing"]

    def split_off(self) -> bool:
        """Most other reducers refused this peer's votes because they ran this step in another group."""
        others = [p for p in self.parts if p.status != "empty" and p.reducer != self.peer]
        return bool(others) and 2 * sum(p.other_group for p in others) > len(others)

    def tag_majority(self, voters: Collection[int], own: bytes | None = None) -> tuple[bytes, int, int]:
        """(the state tag to hold, the parts deciding for it, the parts of the round) in a round whose
        expected voters are ``voters`` (group indices); the tag is b"" when no state has a majority. Each
        part's result names the tag most of its counted voters sent and how many did (a tie by byte
        order). A part *decides* for its tag when more than half of the round's voters, and of any
        others it counted (a follower's vote that came in time), sent it; a tag decided by more than
        half of the round's parts (missing ones included) is the one to hold.

        Against the round's voters, not the ones a part counted: a part that counted a quorum of 3 of
        5 with both diverged peers in it had them decide, and 3 of 5 such parts made the honest majority
        download the minority's state. Against every part, not the ones received: a pair's mate that
        withheld its vote from this peer's part left its own part alone, "1 of 1". ``own``: the tag this
        peer sent (flat rounds): a part that counted it but names another tag cannot have all its votes,
        so a lying reducer's "2 of 2" in a pair is read as at most 1. A part counts once, whatever it
        claims, so a reducer cannot outweigh the others by claiming many voters. Voters a part lists as
        ``provisional`` count for no state (``decides``); a part listing this peer so while it was not
        shrank the voters a tag needs more than half of with a lie, and decides nothing."""
        expected = [p for p in self.parts if p.status != "empty"]
        decided: Counter[bytes] = Counter()
        for p in expected:
            if p.status not in ("ok", "recovered") or not p.counted or not p.tag:
                continue
            if self.peer in p.provisional and not self.provisional:
                continue  # it left this peer's tag out, which it sent as the run's: a lie, it decides nothing
            votes = p.tag_votes
            if own is not None and p.tag != own and self.peer in p.counted and self.peer not in p.provisional:
                votes = min(votes, len(p.counted) - len(p.provisional) - 1)
            if decides(votes, voters, p.counted, p.provisional):
                decided[p.tag] += 1
        if decided:
            tag, parts = min(decided.items(), key=lambda kv: (-kv[1], kv[0]))
            if 2 * parts > len(expected):
                return tag, parts, len(expected)
        return b"", max(decided.values(), default=0), len(expected)

    def split_everywhere(self, voters: Collection[int]) -> bool:
        """No state has a majority (``tag_majority``), yet every part of the round came back and counted
        every one of the group's ``voters`` (indices), naming a state: each voter's state was seen and
        none is held by most (a pair apart, 2 of 4, three ways). Withheld or late votes never make one."""
        expected = [p for p in self.parts if p.status != "empty"]
        return bool(expected) and all(p.status in ("ok", "recovered") and p.tag and set(voters) <= set(p.counted)
                                      for p in expected)


