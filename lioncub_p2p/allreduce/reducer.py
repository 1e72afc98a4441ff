"""The reducer's side of one part: count votes on packed words as chunks arrive, then encode the result."""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Collection

import numpy as np
import torch

from ..codecs import FloatTally, is_values, signed_max, unpack_planes
from ..wire import WireError, pb
from .commit import MAX_TAG_BYTES, MerkleTree, build_header, leaf_bytes
from .round import PartResult, RoundSpec

logger = logging.getLogger(__name__)

__all__ = ["PartReduction", "MAX_TAG_BYTES"]
REFUSED_EARLY = "its votes were refused before this peer started the round"


class PartReduction:
    """Votes for bytes [start, stop) of every code plane, from every member of the group.

    Invariants: a voter's chunks arrive in order without gaps or repeats; the tally holds the sum
    of every chunk received from voters not dropped; a voter is counted only if its whole slice
    arrived before ``close``; a result counts at least the round's quorum (``RoundSpec.quorum``), else there is none.
    Memory is bounded by the part: the tally plus each voter's received codes (kept so an
    incomplete voter can be taken out again, then for audits until the round is forgotten)."""

    def __init__(self, spec: RoundSpec, part: int):
        self.spec, self.part = spec, part
        start, stop = spec.bounds[part]
        self.start, self.nbytes = start, stop - start
        self.tally = spec.upload.tally(self.nbytes, len(spec.group))
        self.next_offset: dict[int, int] = {}
        self.complete: set[int] = set()
        self.dropped: dict[int, str] = {}
        self.first_in = asyncio.Event()  # a first chunk arrived: the upload timeout runs from here
        self.all_in = asyncio.Event()
        self.probed = frozenset()  # excused voters a probe round waits for a while (``punctuality.py``)
        self.probed_in = asyncio.Event()
        self.quorum_in = asyncio.Event()
        # every voter not excused is counted (a dropped one does not count: a member cutting its stream must
        # not bring the close forward), the quorum is not: it can only come from the excused
        self.only_excused_left = asyncio.Event()
        self.quorum = spec.quorum
        # voters not waited for (late round after round, ``punctuality.py``): counted if complete in time
        self.excused: frozenset[int] = frozenset()
        # voters whose streams this peer refused before it started the round (``refuse_early``): told so,
        # they send nothing more, so they are not waited for and count against the quorum's reach; one
        # whose refusal was lost on the way may vote after all (a voter retries a kept stream that closed
        # without a word on a fresh one): its votes are counted as anyone's
        self.refused: set[int] = set()
        self.last_arrival = self.quorum_time = 0.0
        self.tags: dict[int, bytes] = {}
        self.provisional: set[int] = set()  # voters that marked their state provisional (``VoteChunk``)
        self.statements: dict[int, pb.VoterStatement] = {}  # momentum rounds: each voter's signed bound
        self.closed = False
        self.outcome: PartResult | None = None
        self.counts: torch.Tensor | None = None  # a two-level vote's counted votes, as count planes
        # what audits open: each counted voter's codes and their Merkle tree, until the round is forgotten
        self.votes: dict[int, np.ndarray] = {}
        self.trees: dict[int, MerkleTree] = {}
        # the result as sent (signed), or None: below the quorum
        self.result: asyncio.Future[PartResult | None] = asyncio.get_running_loop().create_future()

    @property
    def finalized(self) -> bool:
        return self.closed

    def add(self, voter: int, offset: int, codes: torch.Tensor, last: bool) -> None:
        """Count one chunk (planes, length) of ``voter``'s slice; raises WireError if it breaks the rules."""
        if self.closed:
            raise WireError("the part was already reduced")
        self.refused.discard(voter)
        if voter in self.complete or voter in self.dropped:
            raise WireError(f"voter {voter} already {'voted' if voter in self.complete else 'was dropped'}")
        expected = self.next_offset.get(voter, 0)
        length = codes.shape[1]
        if offset != expected:
            raise WireError(f"chunk at offset {offset}, expected {expected} (duplicate, gap or reordering)")
        if offset + length > self.nbytes:
            raise WireError(f"chunk [{offset}, {offset + length}) runs past the part's {self.nbytes} bytes")
        if last != (offset + length == self.nbytes):
            raise WireError(f"chunk ends at {offset + length} of {self.nbytes} bytes but last={last}")
        if not last and length % 8:
            raise WireError(f"a non-final chunk of {length} bytes is not a multiple of 8")
        if voter in self.statements and is_values(self.spec.upload) and length % self.spec.upload.align == 0:
            if signed_max(self.spec.upload, codes) > self.statements[voter].max_abs:
                raise WireError(f"values above the bound {self.statements[voter].max_abs} the voter signed")
        if self.spec.margin_caps:
            self._check_margins(voter, codes)
        self.first_in.set()
        try:
            self.tally.add(voter, codes, offset)
        except ValueError as e:
            raise WireError(str(e)) from e
        self.next_offset[voter] = offset + length
        if last:
            self.complete.add(voter)
            self.last_arrival = time.perf_counter()
            self._check_all_in()

    def _check_margins(self, voter: int, codes: torch.Tensor) -> None:
        """A second-level voter's margins (L1 codes: margin + s) past its group's size are refused: within
        the codec's range, one group's reducer could outvote every other group at the positions it chose."""
        s, cap = self.spec.upload.scale_steps, self.spec.margin_caps[voter]
        margins = unpack_planes(codes, 8 * codes.shape[1]).to(torch.int32) - s
        largest = int(margins.abs().max()) if margins.numel() else 0
        if largest > cap:
            raise WireError(f"a margin of {largest} from a group of {cap} members")

    def drop(self, voter: int, reason: str) -> None:
        """Leave ``voter`` out of the count (a protocol violation, a dead or late stream)."""
        if self.closed or voter in self.complete or voter in self.dropped:
            return
        self._remove(voter, reason)

    def refuse_early(self, voters: Collection[int]) -> None:
        """Stop waiting for ``voters``: this peer refused their votes before it started the round."""
        voters = {v for v in voters if v not in self.complete and v not in self.dropped and v not in self.next_offset}
        if not voters or self.closed:
            return
        self.refused |= voters
        logger.info("round %s part %d: not waiting for peers %s: %s", self.spec.round_id.hex()[:12], self.part,
                    sorted(voters), REFUSED_EARLY)
        self._check_all_in()

    def _remove(self, voter: int, reason: str) -> None:
        self.tally.remove(voter)
        self.next_offset.pop(voter, None)
        self.complete.discard(voter)
        self.refused.discard(voter)
        self.dropped[voter] = reason
        logger.info("round %s part %d: vote of peer %d dropped: %s", self.spec.round_id.hex()[:12], self.part, voter,
                    reason)
        self._check_all_in()

    def _check_all_in(self) -> None:
        if (self.excused or self.refused) and len(self.complete) < self.quorum \
                and len(self.complete | self.excused | self.refused) >= len(self.spec.group):
            self.only_excused_left.set()
        if len(self.complete) >= self.quorum and not self.quorum_in.is_set():
            self.quorum_time = time.perf_counter()
            self.quorum_in.set()
        n, gone = len(self.spec.group), len(self.dropped) + len(self.refused)
        out_of_reach = n - gone < self.quorum  # too many dropped or refused for any quorum: decided now, no result
        if not self.probed - self.complete - self.dropped.keys() - self.refused or out_of_reach:
            self.probed_in.set()
        if len(self.complete) + gone >= n or (self.awaited_in() and len(self.complete) >= self.quorum) or out_of_reach:
            self.all_in.set()
            if not self.quorum_in.is_set():
                self.quorum_time = time.perf_counter()
                self.quorum_in.set()

    def awaited_in(self) -> bool:
        """Every voter not excused is counted or dropped."""
        return len(self.complete | self.dropped.keys() | self.excused | self.refused) >= len(self.spec.group)

    def excuse(self, voters: frozenset[int], probed: frozenset[int] = frozenset()) -> None:
        """Stop waiting for ``voters`` (still counted if their vote completes before ``close``), except
        a while for ``probed`` (a subset) once the others are in."""
        self.excused, self.probed = frozenset(voters), frozenset(probed) & frozenset(voters)
        self.probed_in.clear()
        self._check_all_in()

    def close(self) -> PartResult | None:
        """Stop counting: take out incomplete voters (and, in momentum rounds, voters whose codes do
        not match the root they signed), then encode the result with its header (once). None when
        fewer than a quorum of the group were counted: then no peer applies anything here."""
        if self.closed:
            return self.outcome
        for voter in list(self.next_offset):
            if voter not in self.complete:
                self._remove(voter, "upload incomplete at the deadline")
        for voter in self.refused:  # in the report's dropped votes, with why
            self.dropped.setdefault(voter, REFUSED_EARLY)
        self.refused.clear()
        leaf = leaf_bytes(self.nbytes, self.spec.upload.planes)
        for voter in sorted(self.complete):
            self.votes[voter] = self._codes_of(voter)
            self.trees[voter] = MerkleTree(self.votes[voter], leaf)
            statement = self.statements.get(voter)
            if statement is not None and statement.root != self.trees[voter].root:
                self._remove(voter, "codes do not match the root it signed")
                del self.votes[voter], self.trees[voter]
        self.closed = True
        counted = sorted(self.complete)
        if len(counted) < self.quorum:
            logger.info("round %s part %d: %d of %d votes counted, below the quorum of %d: no result",
                        self.spec.round_id.hex()[:12], self.part, len(counted), len(self.spec.group), self.quorum)
            self.votes.clear(), self.trees.clear()
            return None
        if self.spec.combine:  # a two-level vote: the counts go on to the second level (``VoteNode._combine``)
            self.counts = self.tally.tally.planes().clone()
        statements = [self.statements[v] for v in counted] if all(v in self.statements for v in counted) else []
        values = isinstance(self.tally, FloatTally) and statements  # a trimmed mean of two clips by them
        signed = {"bounds": [s.max_abs for s in statements]} if values else {}
        wire = self.tally.encode(self.spec.result, counted, seed=self.spec.seed, step=self.spec.step,
                                 offset=self.spec.tie_offset + self.start, **signed).numpy().tobytes()
        tag, votes, provisional = self.tag_count(counted)
        roots = tuple(self.trees[v].root for v in counted)
        header = build_header(self.spec, self.part, counted, roots, tag, votes, wire, statements, provisional)
        self.outcome = PartResult(wire, counted, tag, votes, roots, header, provisional=provisional)
        self.tally = None  # the counts are encoded; the kept codes live on in ``votes`` for audits
        return self.outcome

    def tag_count(self, counted: list[int]) -> tuple[bytes, int, tuple[int, ...]]:
        """(the state tag most counted voters sent, how many did, the counted voters left out). A voter that
        sent no tag names no state and counts against every tag (``round.decides``). A voter whose state
        is provisional is left out, for and against: its tag repeats its donor's, so counted, a liar's
        newcomer seconded the liar. Unless every voter naming a state is provisional (the founders gone):
        their tags are all there is."""
        named = {v: t for v in counted if (t := self.tags.get(v, b""))}
        confirmed = {v: t for v, t in named.items() if v not in self.provisional}
        basis = confirmed or named
        tags = Counter(basis.values())
        tag, votes = min(tags.items(), key=lambda kv: (-kv[1], kv[0])) if tags else (b"", 0)
        return tag, votes, tuple(sorted(set(named) - set(basis)))

    def _codes_of(self, voter: int) -> np.ndarray:
        """A complete voter's (planes, nbytes) codes for the part, as received."""
        if isinstance(self.tally, FloatTally):
            return self.tally.raw[voter].numpy().reshape(1, -1).copy()
        return torch.cat([codes for _, codes in self.tally.kept[voter]], dim=1).numpy()

    def codes_from(self, chunk: pb.VoteChunk) -> torch.Tensor:
        """The chunk's codes as (planes, length) uint8, after checking its size."""
        planes = self.spec.upload.planes
        if chunk.length == 0:
            raise WireError("empty chunk")
        if len(chunk.codes) != planes * chunk.length:
            raise WireError(f"chunk carries {len(chunk.codes)} bytes, expected {planes} planes x {chunk.length}")
        return torch.frombuffer(bytearray(chunk.codes), dtype=torch.uint8).view(planes, chunk.length)
