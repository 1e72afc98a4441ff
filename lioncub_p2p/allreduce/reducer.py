"""The reducer's side of one part: count votes on packed words as chunks arrive, then encode the result."""
from __future__ import annotations

import asyncio
import logging
from collections import Counter
import time

import torch

from ..wire import WireError, pb
from .round import PartResult, RoundSpec

MAX_TAG_BYTES = 32

logger = logging.getLogger(__name__)


class PartReduction:
    """Votes for bytes [start, stop) of every code plane, from every member of the group.

    Invariants: a voter's chunks arrive in order without gaps or repeats; the tally holds the sum
    of every chunk received from voters not dropped; a voter is counted only if its whole slice
    arrived before ``finalize``. Memory is bounded by the part: the tally, plus each voter's received
    chunks (kept so an incomplete voter can be taken out again)."""

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
        self.quorum_in = asyncio.Event()
        self.quorum = len(spec.group) // 2 + 1
        self.last_arrival = self.quorum_time = 0.0
        self.tags: dict[int, bytes] = {}
        self.result: asyncio.Future[PartResult] = asyncio.get_running_loop().create_future()

    @property
    def finalized(self) -> bool:
        return self.result.done()

    def add(self, voter: int, offset: int, codes: torch.Tensor, last: bool) -> None:
        """Count one chunk (planes, length) of ``voter``'s slice; raises WireError if it breaks the rules."""
        if self.finalized:
            raise WireError("the part was already reduced")
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

    def drop(self, voter: int, reason: str) -> None:
        """Leave ``voter`` out of the count (a protocol violation, a dead or late stream)."""
        if self.finalized or voter in self.complete or voter in self.dropped:
            return
        self.tally.remove(voter)
        self.next_offset.pop(voter, None)
        self.dropped[voter] = reason
        logger.info("round %s part %d: vote of peer %d dropped: %s", self.spec.round_id.hex()[:12], self.part, voter,
                    reason)
        self._check_all_in()

    def _check_all_in(self) -> None:
        if len(self.complete) >= self.quorum and not self.quorum_in.is_set():
            self.quorum_time = time.perf_counter()
            self.quorum_in.set()
        if len(self.complete) + len(self.dropped) >= len(self.spec.group):
            self.all_in.set()
            if not self.quorum_in.is_set():
                self.quorum_time = time.perf_counter()
                self.quorum_in.set()

    def finalize(self) -> PartResult:
        """Count the complete voters, subtract the rest, encode the result (once)."""
        if not self.finalized:
            for voter in list(self.next_offset):
                if voter not in self.complete:
                    self.drop(voter, "upload incomplete at the deadline")
            counted = sorted(self.complete)
            wire = self.tally.encode(self.spec.result, counted, seed=self.spec.seed, step=self.spec.step,
                                     offset=self.start)
            tags = Counter(self.tags.get(v, b"") for v in counted)
            tag, votes = min(tags.items(), key=lambda kv: (-kv[1], kv[0])) if tags else (b"", 0)
            self.result.set_result(PartResult(wire.numpy().tobytes(), counted, tag, votes))
        return self.result.result()

    def codes_from(self, chunk: pb.VoteChunk) -> torch.Tensor:
        """The chunk's codes as (planes, length) uint8, after checking its size."""
        planes = self.spec.upload.planes
        if chunk.length == 0:
            raise WireError("empty chunk")
        if len(chunk.codes) != planes * chunk.length:
            raise WireError(f"chunk carries {len(chunk.codes)} bytes, expected {planes} planes x {chunk.length}")
        return torch.frombuffer(bytearray(chunk.codes), dtype=torch.uint8).view(planes, chunk.length)
