"""A peer's end of the butterfly vote all-reduce, on hivemind's P2P binary streams.

One round, from peer i's point of view (group of n; part j is reduced by member j):

1. For every other reducer j, in rotated order (i+1, i+2, ...) so that not everyone uploads to the
   same reducer at once: dial j (or reuse the stream kept from the last round), stream this peer's
   codes for part j in chunks, keep the stream open.
2. As reducer of part i: count its own codes and every incoming chunk on packed words; when all n
   votes are in, or a learned grace after a quorum, or ``upload_timeout`` after the first vote
   arrived, encode the part's result with the votes that completed, state it in a header (whom it
   counted, the Merkle root of each counted voter's codes, the result's digest), sign the header
   with this peer's libp2p key and stream both back on every voter's stream (late voters too).
3. Read each part's result from the stream it was uploaded on, until ``result_timeout``; check the
   header, the reducer's signature and the root of this peer's own codes.
4. Audit (in the background): pick another reducer's part and a few Merkle leaves with private
   randomness, have the reducer open every counted voter's codes there, recount (``audit.py``).

Fault rule (every survivor applies the same update):
* a voter that fails, lies about sizes or is late is left out of that part's count; the part's
  result names the counted voters; a result that counts fewer than a quorum (more than half of the
  group) is no result, for its reducer as for everyone else;
* a part whose result did not arrive (its reducer died, stalled or refused us) is asked for from the
  other peers (and the reducer), and only a result signed by that part's reducer is accepted, so a peer forging bytes
  for a dead reducer's part is ignored; if nobody has one, every peer applies a zero update there
  (momentum rounds: keeps its own momenta there);
* what timing can still split (a peer that received a part directly but stalls while others ask)
  is caught by the swarm's parameter digest and repaired by a state download;
* a reducer caught lying (audits, or a wrong root for a voter's own codes) is reported in
  ``RoundReport.caught``; what was applied stays applied (everyone applied the same), the swarm
  drops and refuses the liar.

Resources: every incoming stream passes a ``StreamGate`` (per-peer caps, strangers apart) before a
byte is read, must send its first message within ``first_frame_timeout``, is admitted (token,
membership) before it gets a table entry, and serves one round for at most
``config.serve_deadline`` whatever it sends; a round this peer forgets (``keep_rounds``) takes its
streams with it. Cancellation (an orderly leave) ends handlers quietly.

Without an ``identity`` (tests, callers not yet wired) a node signs nothing and accepts unsigned
results from the reducer's own stream only: nothing can then be recovered. Every member of a group
must run with its identity for recovery, audits with evidence and momentum bounds.

All connections are dialed by the voter, so peers in client mode (behind NAT) take part fully.
Untrusted input is checked chunk by chunk; a violation drops that peer's vote with a logged reason
and never raises in the caller.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import math
import random
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
import torch
from hivemind.p2p import P2P, PeerID

from ..codecs import is_values
from ..identity import Identity, Verifier
from ..ops import unpack_signs
from ..wire import MAX_FRAME_BYTES, PROTOCOL_VERSION, WireError, close_after_reply, pb, read_frame, write_frame
from ..wire.gate import StreamGate, guard
from . import hierarchy
from .admission import OPEN, Admission
from .archive import FORGOTTEN, RoundArchive
from .audit import (MAX_AUDIT_LEAVES, check_openings, check_statements, decoded, first_level_leaves, judge, leaf_span,
                    make_evidence, owed_margins, signed_by, value_bound)
from .commit import (DIGEST_BYTES, MAX_HEADER_BYTES, MAX_TAG_BYTES, build_header, check_header, leaf_bytes, leaf_count,
                     leaf_of, parse_header, result_signed_bytes, root_of, statement_signed_bytes)
from .deadline import AdaptiveDeadline
from .punctuality import Punctuality, probe_round
from .reducer import PartReduction
from .result_delta import ResultBases, check_declared, decode_from, encode_for
from .round import (AUDIT_MIN_RATE, MAX_FAMILY_CHARS, MAX_FIRST_FRAME_BYTES, AllReduceConfig, Caught, PartReport, PartResult,
                    RoundReport, RoundSpec, chunk_spans, result_wire, upload_wire)

logger = logging.getLogger(__name__)

VOTE_PROTOCOL = "lioncub/vote/1"
FETCH_PROTOCOL = "lioncub/fetch/1"
AUDIT_PROTOCOL = "lioncub/audit/1"
NETWORK_ERRORS = (ConnectionError, asyncio.IncompleteReadError, OSError, EOFError)
RESULT_FRAME_BYTES = MAX_FRAME_BYTES + MAX_HEADER_BYTES + 1024  # a first result chunk carries the header
MAX_AUDITS_IN_FLIGHT = 8
CATCH_UP_STEPS = 10  # a stalled peer's later rounds are refused at most this many steps past its stall (``_ran``)
OTHER_GROUP = "in another group"  # how a reducer refuses votes for a step it ran under another round id
HELD_UP = "its training is held up"  # how a stalled peer refuses rounds it has not started (``_find_round``)


class StreamClosed(WireError):
    """The stream ended before any result came: on a kept stream, the other end closed it meanwhile."""


class BadOpening(WireError):
    """An audit answer that does not open the reducer's signed commitments: never honest."""


class Unreachable(Exception):
    """The reducer to audit cannot be dialed (it left or died): no verdict."""


class TurnMissed(Exception):
    """An audit whose turn (one at a time per audited peer) did not come in time: not asked."""


@dataclass
class RoundState:
    spec: RoundSpec
    me: int
    report: RoundReport
    reduction: PartReduction | None
    direct: dict[int, asyncio.Future]  # part -> PartResult | None, as received from its reducer
    reducing: asyncio.Task | None = None
    voted: bool = False
    tag: bytes = b""
    recovered: dict[int, PartResult] = field(default_factory=dict)  # parts received from other peers
    # part -> (monotonic time its result arrived, whether its reducer itself sent it): audits start from here
    received: dict[int, tuple[float, bool]] = field(default_factory=dict)
    handlers: set = field(default_factory=set)  # stream handler tasks serving this round here
    declared: list[bytes] = field(default_factory=list)  # result bases this peer named to its reducers
    deltas: dict = field(default_factory=dict)  # (bases named, plain result) -> what encode_for made of it


class VoteNode:
    """Runs vote rounds for one peer. Create inside the event loop that owns ``p2p``; call ``start``.

    ``identity`` is this peer's libp2p key (the daemon must run with ``identity_path=identity.path``):
    results this peer reduces are signed with it, and results from others must be signed."""

    def __init__(self, p2p: P2P, config: AllReduceConfig | None = None, admission: Admission = OPEN,
                 identity: Identity | None = None):
        self.p2p = p2p
        self.config = config or AllReduceConfig()
        self.admission = admission
        self.peer_id = p2p.peer_id.to_base58()
        if identity is not None and identity.peer_id != self.peer_id:
            raise ValueError(f"identity {identity.peer_id} is not the daemon's peer id {self.peer_id}: start the "
                             f"daemon with identity_path=identity.path")
        self.identity = identity
        self.verifier = Verifier()
        self.reduction_factory = PartReduction  # what reduces a part (simulations swap in lying reducers)
        self.deadline = AdaptiveDeadline(max_grace=self.config.upload_timeout)
        self.punctuality = Punctuality()  # voters late round after round: not waited for
        # the same for the second-level rounds this peer combines in: a table forgets whoever is not in the
        # round it observes, so one shared table would forget a gone group member at every second level
        self.combine_punctuality = Punctuality()
        self.audit_rng: random.Random = random.SystemRandom()  # private: reducers must not predict audits
        self._rounds: OrderedDict[bytes, RoundState] = OrderedDict()
        # Rounds that left the live table: more than the archive window holds at ten rounds a second, so a
        # late request for one is answered at once (kept, or FORGOTTEN), not held as a round yet to start.
        self._finished: deque[bytes] = deque(maxlen=4096)
        # (family, step) -> the round this peer ran (voted or followed) for them (``RoundSpec.family``): a
        # stream for the same step and family under another id comes from a peer on another group
        self._by_step: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._waiting_key: dict[bytes, tuple[str, int]] = {}  # (family, step) of rounds waited for
        self._waiting: dict[bytes, asyncio.Event] = {}  # rounds asked for before this peer started them
        # second-level rounds this peer combines in: any admitted peer may fetch their results (``_recover_combined``)
        self._second_level: OrderedDict[bytes, None] = OrderedDict()
        # family -> the newest step an admitted member asked this peer for (votes or results): how far the
        # group's fastest member is, seen within a round trip (its record says so seconds later)
        self.asked_step: dict[str, int] = {}
        # family -> the step of a round asked for here that this peer did not start within the join
        # timeout while it ran no round at all, until it runs one and caught up (``_find_round``, ``_ran``:
        # its training thread hangs)
        self._stalled_at: dict[str, int] = {}
        self._runs = 0  # rounds this peer ran (``_ran``)
        self._active = 0  # its rounds in progress (run_round, follow_round)
        self._waiters: Counter[bytes] = Counter()
        self._pending_by_peer: Counter[str] = Counter()
        self._kept: dict[str, list[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]]] = {}
        self._audits: set[asyncio.Task] = set()
        self._audit_turns: dict[str, asyncio.Lock] = {}  # one audit at a time per reducer (its stream cap is 2)
        self._audit_users: Counter[str] = Counter()
        self.audits_expired = 0  # audits not asked within half the window (a slow queue): not counted against anyone
        self.margins_checked = 0  # two-level: reducers' margins recounted from their group's votes (``_check_margins``)
        self.archive = RoundArchive(self.config.audit_window_s, self.config.audit_keep_bytes)
        self.bases = ResultBases()  # complete majority results, for results sent as deltas
        self.caught: dict[str, Caught] = {}  # every reducer this peer caught, by peer id (the first proof)
        self.catches: deque[Caught] = deque(maxlen=1024)  # every catch, newest last (measurements)
        self._new_caught: list[Caught] = []  # not reported yet
        self._warned: dict[tuple[str, str], float] = {}  # (peer, refusal) -> when last logged as a warning
        cfg = self.config
        caps = dict(per_peer=cfg.max_streams_per_peer, stranger_per_peer=2, strangers=cfg.max_stranger_streams,
                    total=cfg.max_streams, is_member=self._is_member)
        self.gates = {VOTE_PROTOCOL: StreamGate("vote", **caps),
                      FETCH_PROTOCOL: StreamGate("fetch", **dict(caps, is_member=self._may_fetch)),
                      AUDIT_PROTOCOL: StreamGate("audit", **dict(caps, per_peer=2))}
        # Observers of progress ("vote_chunk" / "result_chunk" after each chunk is written, "finalize",
        # "result:<part>" when a part's result arrived), for metrics and tests that inject faults.
        self.on_event: list[Callable[[str], None]] = []
        # The newest group epoch this peer knows, sent with every result so peers behind learn of a
        # group change within one round (set by the swarm).
        self.group_epoch = 0
        # Whether a peer is in the run's current group beyond this peer's own rounds (set by the swarm:
        # every group of a two-level vote). For the fetch gate's caps only: a group whose reducer failed
        # asks other groups' reducers for second-level slices all at once; as strangers (16 streams in
        # all) a group of 32 was half refused
        self.in_run: Callable[[str], bool] = lambda peer_id: False

    def _emit(self, event: str) -> None:
        for callback in self.on_event:
            callback(event)

    async def start(self) -> None:
        for name, handler in ((VOTE_PROTOCOL, self._on_vote_stream), (FETCH_PROTOCOL, self._on_fetch_stream),
                              (AUDIT_PROTOCOL, self._on_audit_stream)):
            await self.p2p.add_binary_stream_handler(name, guard(self.gates[name], handler))

    def _is_member(self, peer_id: str) -> bool:
        """In the group of a live round or of a finished one still kept (a peer behind asks for those)."""
        return (any(peer_id in state.spec._index for state in self._rounds.values())  # type: ignore[attr-defined]
                or self.archive.has_member(peer_id))

    def _may_fetch(self, peer_id: str) -> bool:
        return self._is_member(peer_id) or self.in_run(peer_id)

    def stop_waiting_for(self, peer_ids: set[str], reason: str) -> None:
        """Leave these peers' unfinished votes out of every part this peer still reduces (they said
        they left the run): the part closes with the votes in, not at the upload deadline."""
        for state in self._rounds.values():
            red = state.reduction
            if red is None or red.finalized:
                continue
            for peer_id in peer_ids:
                voter = state.spec._index.get(peer_id)  # type: ignore[attr-defined]
                if voter is not None and voter != state.me:
                    red.drop(voter, reason)

    async def settle_audits(self, timeout: float | None = None) -> None:
        """Wait for the audits in flight (tests, and a peer that wants its verdicts before leaving)."""
        if self._audits:
            await asyncio.wait(list(self._audits), timeout=timeout or self.config.audit_window_s)

    # -- running a round ---------------------------------------------------------------------------

    def prepare_round(self, spec: RoundSpec) -> RoundState:
        """Start reducing this peer's part of ``spec`` before this peer has voted.

        A swarm prepares round s+1 as soon as round s ends, so others' votes are counted while this
        peer still computes: a slow peer delays neither its own part nor anyone else's. Idempotent."""
        if spec.round_id in self._rounds:
            state = self._rounds[spec.round_id]
            if state.spec != spec:
                raise ValueError(f"round {spec.round_id.hex()} was prepared with another spec")
            return state
        me = spec.index_of(self.peer_id)
        parts = [PartReport(j, j, a, b, "pending" if b > a else "empty") for j, (a, b) in enumerate(spec.bounds)]
        loop = asyncio.get_running_loop()
        state = RoundState(spec, me, RoundReport(spec.round_id.hex(), spec.step, me, parts), None,
                           {j: loop.create_future() for j, (a, b) in enumerate(spec.bounds) if b > a})
        if me in state.direct:
            state.reduction = self.reduction_factory(spec, me)
            punctuality = self._punctuality(spec)

            def others(ids: frozenset[str]) -> frozenset[int]:
                return frozenset(i for i, p in enumerate(spec.group) if p.peer_id in ids and i != me)

            state.reduction.excuse(others(punctuality.late()),
                                   others(punctuality.probed()) if probe_round(spec) else frozenset())
            state.reducing = asyncio.create_task(self._reduce_part(state, state.reduction, state.direct[me]))
            if spec.combine and spec.combine[me] is not None:  # count other groups' margins as they come
                self._second_level[spec.combine[me].round_id] = None
                while len(self._second_level) > self._finished.maxlen:
                    self._second_level.popitem(last=False)
                self.prepare_round(spec.combine[me])
        self._register(state)
        return state

    def _punctuality(self, spec: RoundSpec) -> Punctuality:
        return self.combine_punctuality if spec.round_id in self._second_level else self.punctuality

    async def run_round(self, spec: RoundSpec, upload: torch.Tensor, tag: bytes = b"", *,
                        one_at_a_time: bool = False) -> tuple[torch.Tensor, RoundReport]:
        """``_vote_round``, counted among this peer's rounds in progress (``_find_round``)."""
        with self._in_progress():
            return await self._vote_round(spec, upload, tag, one_at_a_time=one_at_a_time)

    async def follow_round(self, spec: RoundSpec, tag: bytes = b"") -> tuple[torch.Tensor, RoundReport]:
        """``_follow_round``, counted among this peer's rounds in progress (``_find_round``)."""
        with self._in_progress():
            return await self._follow_round(spec, tag)

    @contextlib.contextmanager
    def _in_progress(self) -> Iterator[None]:
        self._active += 1
        try:
            yield
        finally:
            self._active -= 1

    async def _vote_round(self, spec: RoundSpec, upload: torch.Tensor, tag: bytes = b"", *,
                          one_at_a_time: bool = False) -> tuple[torch.Tensor, RoundReport]:
        """Vote with ``upload`` ((planes, nbytes) uint8 codes) and return (update, report).
        ``one_at_a_time``: recover missing parts as a follower does (a follower's probe vote).

        ``tag`` (≤ 32 bytes, e.g. a digest of this peer's parameters) travels with the votes; each
        reducer returns the most common tag of the voters it counted (``RoundReport.consensus_tag``).

        The update is packed uint8 (nbytes,) for a complete majority result, else float32
        (nbytes*8,) with zeros in parts nobody received (bf16 rounds: values, NaN where missing).
        Raises ValueError only for the caller's own mistakes (shapes, a repeated round); nothing a
        peer sends makes it raise: missed parts are in the report."""
        started = time.perf_counter()
        if upload.dtype != torch.uint8 or tuple(upload.shape) != (spec.upload.planes, spec.nbytes):
            raise ValueError(f"upload must be uint8 of shape ({spec.upload.planes}, {spec.nbytes}), "
                             f"got {upload.dtype} {tuple(upload.shape)}")
        if len(tag) > MAX_TAG_BYTES:
            raise ValueError(f"tag of {len(tag)} bytes exceeds {MAX_TAG_BYTES}")
        upload = upload.cpu().contiguous()
        state = self.prepare_round(spec)
        if state.voted:
            raise ValueError(f"round {spec.round_id.hex()} was already run by this peer")
        state.voted, state.tag = True, tag
        self._ran(state.spec)
        if self.config.result_deltas and spec.result.name == "majority":
            state.declared = self.bases.declared(spec.nbytes)
        me, report, parts = state.me, state.report, state.report.parts
        report.started = started
        codes = upload.numpy()
        roots = {j: root_of(codes[:, a:b], leaf_bytes(b - a, spec.upload.planes))
                 for j, (a, b) in enumerate(spec.bounds) if b > a}
        statements = {j: self._statement(spec, j, upload, roots[j]) for j in roots} \
            if spec.signs_votes and self.identity is not None else {}
        red = state.reduction
        if red is not None and not red.closed:
            a, b = spec.bounds[me]
            red.tags[me] = tag
            if me in statements:
                red.statements[me] = statements[me]
            red.add(me, 0, upload[:, a:b].clone(), last=True)

        tasks = [state.reducing] if state.reducing is not None else []
        turn = asyncio.Lock()  # uploads leave one reducer at a time, in rotated order
        n = len(spec.group)
        for k in range(1, n):
            j = (me + k) % n
            if j in state.direct:
                tasks.append(asyncio.create_task(self._vote_remote(state, j, upload, statements.get(j), turn, started)))
        await asyncio.gather(*tasks, return_exceptions=True)
        report.timings["results"] = time.perf_counter() - started
        return await self._conclude(state, roots, one_at_a_time=one_at_a_time)

    async def _follow_round(self, spec: RoundSpec, tag: bytes = b"") -> tuple[torch.Tensor, RoundReport]:
        """Receive a round's results without voting: for a peer behind the group, whose votes would
        reach parts that closed long ago (``punctuality.py``). Each part is asked of its reducer first
        (finished rounds are kept, ``archive.py``), then of one other member at a time, so a slow link
        downloads each part once. Returns what ``run_round`` returns (``report.followed`` set); a part
        nobody holds any more is missing."""
        started = time.perf_counter()
        state = self.prepare_round(spec)
        if state.voted:
            raise ValueError(f"round {spec.round_id.hex()} was already run by this peer")
        state.voted, state.tag = True, tag
        self._ran(state.spec)
        state.report.started, state.report.followed = started, True
        red = state.reduction
        # still a reducer (the leader has not taken its part away yet): a follower on time reduces its part
        # as any reducer. One behind (a member already asked it for a later step) finds the votes in, held
        # for it since, or nobody will send any: a short wait, then no result
        behind = self.asked_step.get(spec.family, -1) > spec.step
        wait = self.deadline.grace() if behind else self.deadline.probe_grace()
        if red is not None and not red.closed and not await _set_within(red.first_in, wait):
            state.reducing.cancel()
            outcome = red.close()
            for future in (red.result, state.direct[state.me]):
                if not future.done():
                    future.set_result(outcome)
        if state.reducing is not None:
            await asyncio.gather(state.reducing, return_exceptions=True)
        state.report.timings["results"] = time.perf_counter() - started
        return await self._conclude(state, {}, one_at_a_time=True)

    async def _conclude(self, state: RoundState, roots: dict[int, bytes], *,
                        one_at_a_time: bool = False) -> tuple[torch.Tensor, RoundReport]:
        """Recover the parts that did not come from their reducers, assemble the update, start audits.
        ``roots``: this peer's own code roots by part (none when it did not vote)."""
        spec, me, report, parts, started = state.spec, state.me, state.report, state.report.parts, state.report.started
        outcomes: dict[int, PartResult | None] = {j: fut.result() if fut.done() and not fut.cancelled() else None
                                                  for j, fut in state.direct.items()}
        for j, outcome in outcomes.items():
            if outcome is not None and j != me and j in roots:
                self._check_own_root(state, j, outcome, roots[j])
        # this peer's own part is missing when its group's votes fell below the quorum; in a two-level round
        # the other groups still decide it at the second level, so it is missing only if that fails too
        missing = [j for j, outcome in outcomes.items()
                   if outcome is None and (j != me or (spec.combine and spec.combine[j] is not None))]
        if missing:
            # all missing parts come over this peer's link at once: give each answer the time of all at 1 Mbit/s
            transfer_s = sum(spec.result_size(j, len(spec.group)) for j in missing) / AUDIT_MIN_RATE
            recovered = await asyncio.gather(*(self._recover_either(state, j, one_at_a_time=one_at_a_time,
                                                                    transfer_s=transfer_s) for j in missing))
            for j, outcome in zip(missing, recovered):
                outcomes[j] = outcome
                parts[j].status = "recovered" if outcome is not None else "missing"
                if outcome is not None:
                    parts[j].record(outcome)
                    state.recovered[j] = outcome
                    if j in roots:
                        self._check_own_root(state, j, outcome, roots[j])
            report.timings["recovery"] = time.perf_counter() - started - report.timings["results"]
        for j, outcome in outcomes.items():
            if parts[j].status == "pending":
                parts[j].status = "ok" if outcome is not None else "missing"
        update, undecodable = assemble(spec, outcomes)
        if self.config.result_deltas and update.dtype == torch.uint8 and spec.result.name == "majority":
            self.bases.remember(spec.round_id, update.numpy())  # a copy and a digest: only when deltas are on
        for j, reason in undecodable.items():
            parts[j].status, parts[j].note = "missing", f"undecodable result: {reason}"
        self._start_audits(state, {j: o for j, o in outcomes.items() if o is not None and j not in undecodable})
        report.caught, self._new_caught = self._new_caught, []
        report.timings["total"] = time.perf_counter() - started
        return update, report

    def _statement(self, spec: RoundSpec, j: int, upload: torch.Tensor, root: bytes) -> pb.VoterStatement:
        a, b = spec.bounds[j]
        max_abs = 0.0  # a second level's margins are bounded by their codec
        if is_values(spec.upload):
            values = spec.upload.decode(upload[0, a:b])
            max_abs = float(values.abs().max()) if values.numel() else 0.0
        signature = self.identity.sign(statement_signed_bytes(spec.round_id, j, root, max_abs))
        return pb.VoterStatement(root=root, max_abs=max_abs, signature=signature, public_key=self.identity.public_key)

    def _register(self, state: RoundState) -> None:
        rid = state.spec.round_id
        if rid in self._finished:
            raise ValueError(f"round {rid.hex()} was already run by this peer")
        self._rounds[rid] = state
        while len(self._rounds) > self.config.keep_rounds:
            old, old_state = self._rounds.popitem(last=False)
            self._forget(old_state)
            self._finished.append(old)
        if rid in self._waiting:
            self._waiting.pop(rid).set()

    def resumed(self) -> None:
        """This peer loaded a newer state (a rejoin, a skip ahead, a repair): whatever held it up is past,
        and its rounds are waited for again (``_stalled_at``)."""
        self._stalled_at.clear()

    def _ran(self, spec: RoundSpec) -> None:
        """This peer runs ``spec`` (votes or follows): no other round of its family and step will run here.
        (A prepared round is no such promise: a group change before the step prepares another.)"""
        self._runs += 1
        # its training thread runs again: wait for its rounds once it caught up to within a step of the
        # newest step a member asked of it (``CATCH_UP_STEPS`` at most, against an asker naming any step).
        # A peer that resumes steps behind starts the rounds asked of it seconds later, if ever (it is
        # dropped and downloads the state): waiting for them made steps of 6-9 s after a 12 s hang, measured
        for family, flagged in list(self._stalled_at.items()):
            if spec.step + 1 >= min(self.asked_step.get(family, -1), flagged + CATCH_UP_STEPS):
                del self._stalled_at[family]
        if not spec.family:
            return
        key = (spec.family, spec.step)
        self._by_step[key] = spec.round_id
        while len(self._by_step) > self._finished.maxlen:
            self._by_step.popitem(last=False)
        for other in [r for r, k in self._waiting_key.items() if k == key and r != spec.round_id and r in self._waiting]:
            self._waiting.pop(other).set()  # its streams wake to a refusal: another group's round

    def _forget(self, state: RoundState) -> None:
        """Take a round out of the live table: stop its reduction if no vote ever came, end the streams
        still serving it, and archive what late audits and result requests need (``archive.py``)."""
        tasks = [state.reducing, *state.handlers]
        for task in tasks:
            if task is not None and not task.done() and task is not asyncio.current_task():
                task.cancel()
        state.handlers.clear()
        results = {j: fut.result() for j, fut in state.direct.items()
                   if fut.done() and not fut.cancelled() and fut.result() is not None}
        results.update(state.recovered)
        self.archive.keep(state.spec, results, state.reduction)

    def _check_own_root(self, state: RoundState, j: int, outcome: PartResult, own_root: bytes) -> None:
        """A header that counts this peer must carry the root of exactly the codes it sent."""
        if state.me in outcome.counted and outcome.roots:
            if outcome.roots[outcome.counted.index(state.me)] != own_root:
                self._convict(Caught(state.spec.group[j].peer_id, state.spec.round_id, j, "misrepresented",
                                     f"round {state.spec.round_id.hex()[:12]} part {j}: its signed header has a "
                                     f"root for this peer's codes that is not theirs"))

    def _convict(self, caught: Caught) -> None:
        logger.warning("reducer %s caught (%s): %s", caught.peer_id, caught.kind, caught.reason)
        if caught.peer_id not in self.caught or (caught.evidence and not self.caught[caught.peer_id].evidence):
            self.caught[caught.peer_id] = caught
        self.catches.append(caught)
        if len(self._new_caught) < 1024:
            self._new_caught.append(caught)

    async def _reduce_part(self, state: RoundState, red: PartReduction, result: asyncio.Future) -> None:
        """Finalize when every vote is in, or a grace period after the quorum, or ``upload_timeout``
        after the first vote arrived."""
        await red.first_in.wait()
        started = time.perf_counter()
        deadline = started + self.config.upload_timeout
        try:
            # a group's round of a two-level vote whose quorum hinges on voters late round after round (a
            # member gone): a grace for them, not the upload timeout every round (which every group waits
            # for: this peer combines a slice of the part for all); the other groups decide the part. In a
            # flat round nobody else would: the late voters get the whole upload timeout
            hinge = red.only_excused_left if state.spec.combine else asyncio.Event()
            await _first_of(red.quorum_in, hinge, max(deadline - time.perf_counter(), 0.0))
            for awaited in (red.quorum_in, red.all_in):
                if not awaited.is_set():
                    await asyncio.wait_for(awaited.wait(), min(self.deadline.grace(),
                                                               max(deadline - time.perf_counter(), 0.0)))
            everyone = red.complete >= set(range(len(state.spec.group))) - red.excused
            # the spread before a probe's wait: a follower's lag must not teach the grace (the pace cap's point)
            self.deadline.observe(red.last_arrival - red.quorum_time if everyone else None, red.quorum_time)
        except asyncio.TimeoutError:
            self.deadline.observe(None)
        if red.probed and red.quorum_in.is_set() and not red.probed_in.is_set():
            # a probe round: excused voters (followers vote in it) get until the quorum's time plus the longest
            # the deadline waits for anyone at this group's pace; a follower lagging the group gains that much
            until = min(red.quorum_time + self.deadline.probe_grace(), deadline) - time.perf_counter()
            await _set_within(red.probed_in, max(until, 0.0))
        self._emit("finalize")
        outcome = red.close()
        if outcome is not None and state.spec.combine:
            outcome = await self._combine(state, red, outcome)
        group = state.spec.group
        self._punctuality(state.spec).observe({group[v].peer_id for v in red.complete},
                                              {p.peer_id for i, p in enumerate(group) if i != state.me},
                                              probe=probe_round(state.spec))
        if outcome is not None and self.identity is not None:
            outcome = dataclasses.replace(outcome, signature=self.identity.sign(result_signed_bytes(outcome.header)),
                                          public_key=self.identity.public_key)
            red.outcome = outcome
        part = state.report.parts[state.me]
        if outcome is not None:
            part.record(outcome)
        else:
            part.note = f"{len(red.complete)} of {len(state.spec.group)} votes: below the quorum, no result"
        state.report.dropped.extend(red.dropped.items())
        state.report.timings["reduce"] = time.perf_counter() - started  # from the first vote
        red.result.set_result(outcome)
        result.set_result(outcome)

    async def _combine(self, state: RoundState, red: PartReduction, outcome: PartResult) -> PartResult | None:
        """A two-level vote's second level: this group's counts of the part go to the part's round among
        the groups (``spec.combine``, margins as L1 votes, ``hierarchy.margin_codes``); its majority, the
        flat majority of every group counted there, is this part's result. None when a slice of it is
        missing (every group misses it alike) or the round could not run."""
        combine = state.spec.combine[state.me]
        try:
            margins = hierarchy.margin_codes(red.counts, len(outcome.counted), combine.upload.bits)
            update, report = await self.run_round(combine, margins, outcome.tag)  # the group's state, not its own
        except Exception as e:  # never let the second level take the first one down
            logger.warning("round %s part %d: second level failed: %s: %s", state.spec.round_id.hex()[:12],
                           red.part, type(e).__name__, e)
            return None
        finally:
            red.counts = None
        state.report.combine = report
        self._new_caught.extend(report.caught)  # reported with the first level's round, which the swarm reads
        if update.dtype != torch.uint8:  # a slice nobody received: no result for the part
            return None
        wire = update.numpy().tobytes()
        tag, tag_votes = hierarchy.group_tag(outcome.tag, outcome.tag_votes, len(outcome.counted), report)
        header = build_header(state.spec, red.part, outcome.counted, outcome.roots, tag, tag_votes, wire)
        red.outcome = dataclasses.replace(outcome, wire=wire, header=header, tag=tag, tag_votes=tag_votes)
        return red.outcome

    async def _vote_remote(self, state: RoundState, j: int, upload: torch.Tensor,
                           statement: pb.VoterStatement | None, turn: asyncio.Lock, started: float) -> None:
        """Send part j to its reducer and put its result (or None) in ``state.direct[j]``."""
        spec, report = state.spec, state.report
        deadline = self.config.result_timeout - (time.perf_counter() - started)
        writer = None

        async def exchange() -> PartResult:
            nonlocal writer
            peer = spec.group[j].peer_id
            for attempt in range(2):
                async with turn:  # dial inside the turn: the reducer expects the first chunk right after the dial
                    reader, writer, kept = await self._vote_stream(peer, fresh=attempt > 0)
                    try:
                        await self._send_votes(writer, state, j, upload, statement)
                    except NETWORK_ERRORS:
                        if not kept:
                            raise
                        writer.close()
                        writer = None
                        continue
                    report.timings["upload"] = max(report.timings.get("upload", 0.0), time.perf_counter() - started)
                try:
                    outcome = await self._read_result(reader, state, j)
                except (*NETWORK_ERRORS, StreamClosed):
                    if not kept:
                        raise
                    writer.close()  # the reducer closed the kept stream meanwhile: dial afresh, once
                    writer = None
                    continue
                self._kept.setdefault(peer, []).append((reader, writer, time.monotonic()))
                writer = None  # kept for the next round, not closed below
                return outcome
            raise StreamClosed("the reducer closed a fresh stream too")

        outcome: PartResult | None = None
        try:
            outcome = await asyncio.wait_for(exchange(), max(deadline, 0.0))
            state.received[j] = (time.monotonic(), True)
            report.parts[j].record(outcome)
            self._emit(f"result:{j}")
        except Exception as e:  # any failure of this reducer leaves the part to recovery
            note = f"no result from reducer {j}: {type(e).__name__}: {e}"
            report.parts[j].note, report.parts[j].other_group = note, OTHER_GROUP in str(e)
            logger.info("round %s: part %d %s", spec.round_id.hex()[:12], j, note)
            if HELD_UP in str(e) and state.reduction is not None:  # it has not started this round: no votes of
                state.reduction.drop(j, HELD_UP)  # its will come either, so this part stops waiting for them
        finally:
            if writer is not None:
                writer.close()
            if not state.direct[j].done():
                state.direct[j].set_result(outcome)

    async def _vote_stream(self, peer: str, *, fresh: bool = False):
        """(reader, writer, kept): a stream to ``peer``'s vote handler, kept from an earlier round
        when one is recent enough, else newly dialed."""
        kept = self._kept.get(peer, [])
        while kept and not fresh:
            reader, writer, since = kept.pop()
            if time.monotonic() - since < self.config.keep_streams_s and not writer.is_closing() \
                    and not reader.at_eof():
                return reader, writer, True
            writer.close()
        for other in [p for p, streams in self._kept.items() if not streams]:
            del self._kept[other]  # forget peers left without kept streams (e.g. gone from the group)
        _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer), VOTE_PROTOCOL)
        return reader, writer, False

    async def _send_votes(self, writer: asyncio.StreamWriter, state: RoundState, j: int, upload: torch.Tensor,
                          statement: pb.VoterStatement | None) -> None:
        spec = state.spec
        a, b = spec.bounds[j]
        encoding, bits = upload_wire(spec.upload)
        for offset, length in chunk_spans(b - a, self.config.chunk_bytes, planes=upload.shape[0]):
            codes = upload[:, a + offset : a + offset + length].contiguous().numpy().tobytes()
            first = offset == 0
            chunk = pb.VoteChunk(version=PROTOCOL_VERSION, round_id=spec.round_id, step=spec.step, part=j,
                                 family=spec.family,
                                 offset=offset, length=length, upload=encoding, upload_bits=bits,
                                 result=result_wire(spec.result), codes=codes, last=offset + length == b - a,
                                 tag=state.tag if first else b"",
                                 token=self.admission.token(self.peer_id) if first else b"",
                                 statement=statement if first and statement is not None else None,
                                 result_bases=state.declared if first else ())
            sent = await write_frame(writer, chunk)  # not `+= await`: that reads the total before awaiting
            state.report.bytes_up += sent
            state.report.payload_up += len(codes)
            self._emit("vote_chunk")

    async def _read_result(self, reader: asyncio.StreamReader, state: RoundState, j: int, *,
                           forwarded: bool = False, answering: asyncio.Event | None = None) -> PartResult:
        """Read and check a part's result chunks, from its reducer or (``forwarded``) another peer.
        ``answering`` is set once a checked header came: the sender has the result and is sending it."""
        spec, report = state.spec, state.report
        data, header, first, expected, delta = bytearray(), None, None, 0, None
        while True:
            msg, nread = await read_frame(reader, pb.ResultChunk, RESULT_FRAME_BYTES)
            if msg is None and header is None:
                raise StreamClosed("stream closed before the first result chunk")
            if msg is None:
                raise WireError("stream closed before the last result chunk")
            report.bytes_down += nread
            if msg.error:
                raise WireError(f"peer refused: {msg.error}")
            report.timings.setdefault("first_result", time.perf_counter() - report.started)
            if not forwarded:
                report.group_epoch = max(report.group_epoch, msg.group_epoch)
            if msg.round_id != spec.round_id or msg.part != j or msg.result != result_wire(spec.result):
                raise WireError("result chunk for another round, part or encoding")
            if header is None:
                if not msg.header:
                    raise WireError("the first result chunk has no header")
                header, first = check_header(spec, j, msg.header), msg
                if answering is not None:
                    answering.set()
                expected = spec.result_size(j, len(header.counted))
                if msg.delta_base:
                    if forwarded:
                        raise WireError("a forwarded result sent as a delta")
                    delta = (msg.delta_base, msg.delta_before)
            elif msg.header or msg.signature or msg.delta_base:
                raise WireError("a later result chunk repeats the header")
            if msg.offset != len(data) or len(data) + len(msg.data) > expected:
                raise WireError(f"result chunk at {msg.offset} (+{len(msg.data)}) after {len(data)} of {expected} bytes")
            data += msg.data
            report.payload_down += len(msg.data)
            if msg.last:
                report.result_down += len(data)
                if delta is not None:
                    try:
                        data = decode_from(self.bases, state.declared, spec.nbytes, spec.bounds[j], bytes(data), *delta)
                    except ValueError as e:
                        raise WireError(str(e)) from None
                    report.delta_parts += 1
                if len(data) != expected:
                    raise WireError(f"result ended at {len(data)} of {expected} bytes")
                report.result_plain += expected
                outcome = PartResult(bytes(data), list(header.counted), header.tag, header.tag_votes,
                                     tuple(header.roots), first.header, first.signature, first.public_key)
                self._check_result(spec, j, header, outcome, forwarded)
                return outcome

    def _check_result(self, spec: RoundSpec, j: int, header: pb.ResultHeader, outcome: PartResult,
                      forwarded: bool) -> None:
        """The bytes match the signed digest, the part's reducer signed the header (required unless an
        unsigned node reads its reducer's own stream), and momentum values respect the signed bounds."""
        if hashlib.sha256(outcome.wire).digest() != header.wire_digest:
            raise WireError("result bytes do not match the digest in their header")
        if outcome.signature or forwarded or self.identity is not None:
            if not self.verifier.verify(spec.group[j].peer_id, outcome.public_key, result_signed_bytes(outcome.header),
                                        outcome.signature):
                raise WireError("the result is not signed by the part's reducer")
        if is_values(spec.upload):
            if header.statements:
                check_statements(header, [p.peer_id for p in spec.group], self.verifier)
                values = decoded(header, spec.result, spec.upload, outcome.wire)
                bound = value_bound(header, spec.result, spec.upload)
                if values.numel() and not float(values.abs().max()) <= bound:
                    raise WireError(f"momentum result holds |value| {float(values.abs().max()):.3g} above the "
                                    f"bound {bound:.3g} its counted voters signed")
            elif self.identity is not None:
                raise WireError("momentum result without its voters' signed statements")
        elif spec.second_level and self.identity is not None and not header.statements:
            raise WireError("second-level result without its voters' signed statements")

    def _outcome_for(self, state: RoundState, voter: int, outcome: PartResult) -> PartResult:
        """The result sent to ``voter``: the same for everyone (simulations override it to lie to one)."""
        return outcome

    def _delta_for(self, state: RoundState, part: int, outcome: PartResult,
                   declared: list[bytes]) -> tuple[bytes, bytes, bytes] | None:
        """The part's result as flips against bases the voter named (None: send it plain); encoded
        once per round for all voters that named the same bases."""
        spec = state.spec
        if not declared or not self.config.result_deltas or spec.result.name != "majority":
            return None
        key = (tuple(declared), outcome.wire)
        if key not in state.deltas:
            state.deltas[key] = encode_for(self.bases, declared, spec.nbytes, spec.bounds[part], outcome.wire)
        return state.deltas[key]

    async def _send_result(self, writer: asyncio.StreamWriter, spec: RoundSpec, part: int, outcome: PartResult,
                           report: RoundReport | None = None, *,
                           delta: tuple[bytes, bytes, bytes] | None = None) -> None:
        """``delta``: (blob, base id, before id) from ``_delta_for``, sent in place of the plain result."""
        wire = outcome.wire if delta is None else delta[0]
        base, before = (b"", b"") if delta is None else delta[1:]
        # a small first chunk: its header tells a peer recovering the part that this sender answers
        for offset, length in chunk_spans(len(wire), self.config.chunk_bytes) or [(0, 0)]:
            first = offset == 0
            chunk = pb.ResultChunk(version=PROTOCOL_VERSION, round_id=spec.round_id, part=part, offset=offset,
                                   data=wire[offset : offset + length], last=offset + length >= len(wire),
                                   result=result_wire(spec.result), group_epoch=self.group_epoch,
                                   header=outcome.header if first else b"",
                                   signature=outcome.signature if first else b"",
                                   public_key=outcome.public_key if first else b"",
                                   delta_base=base if first else b"", delta_before=before if first else b"")
            sent = await write_frame(writer, chunk)
            if report is not None:
                report.bytes_up += sent
                report.payload_up += length
            self._emit("combined_chunk" if spec.round_id in self._second_level else "result_chunk")

    async def _fetch(self, state: RoundState, i: int, j: int, answering: asyncio.Event | None = None) -> PartResult:
        """Part j's signed result of ``state``'s round, asked of member i (``FETCH_PROTOCOL``)."""
        spec = state.spec
        _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(spec.group[i].peer_id),
                                                                      FETCH_PROTOCOL)
        try:
            sent = await write_frame(writer, pb.FetchResult(version=PROTOCOL_VERSION, round_id=spec.round_id, part=j,
                                                            token=self.admission.token(self.peer_id), step=spec.step,
                                                            family=spec.family))
            state.report.bytes_up += sent
            return await self._read_result(reader, state, j, forwarded=True, answering=answering)
        finally:
            writer.close()  # after the last chunk: the member waits for this close before its own

    async def _recover_either(self, state: RoundState, j: int, *, one_at_a_time: bool,
                              transfer_s: float) -> PartResult | None:
        """A missing part: from its reducer or this group's members (``_recover``: its signed header
        carries the counted votes and the state tag a follower's repair rule reads), then, in a
        two-level round, from the second level (``_recover_combined``): its reducer did not answer, or
        it is this peer's own part and its group's votes fell below the quorum (nobody here has it)."""
        outcome = None
        if j != state.me:
            outcome = await self._recover(state, j, one_at_a_time=one_at_a_time, transfer_s=transfer_s)
        if outcome is None and state.spec.combine:
            outcome = await self._recover_combined(state, j, transfer_s)
            if outcome is not None:
                logger.info("round %s: part %d assembled from the second level", state.spec.round_id.hex()[:12], j)
                state.report.parts[j].note = "assembled from the second level's signed slices"
                state.report.parts[j].second_level = True
        return outcome

    async def _recover_combined(self, state: RoundState, j: int, transfer_s: float) -> PartResult | None:
        """Part j of a two-level round from its second level: part j's round among the groups' reducers
        of part j decides part j for every group, so when this group's reducer fails after combining (it
        left mid-round), its voters fetch that round's slices, each signed by the combiner that reduced
        it, from any of those reducers. Before, the group applied nothing there while the other groups
        applied the part: it diverged as a whole, and each member downloaded the state. The same when
        the group's votes for part j fell below its quorum (its reducer, still a combiner, sent no
        margins: the group's votes are left out of part j), the reducer itself included.

        The assembled part has no header of this group's round: it counts nobody and carries no state
        tag, and it is never forwarded (no single signature covers it). All within
        ``recovery_timeout`` plus ``transfer_s``; None if a slice is nowhere to be had (then no group
        has the part: a combiner that failed before sending its slice leaves it missing for everyone)."""
        combine = state.spec.combine[j]  # one per member (``RoundSpec``); None for a member with no part
        if combine is None:
            return None
        second = RoundState(combine, -1, state.report, None, {})  # what _read_result checks the slices against
        failed = state.spec.group[j].peer_id  # this group's reducer of part j: asked last
        own = [p.peer_id for p in combine.group].index(failed)
        skip = own if failed == self.peer_id else None  # this peer's own part: it never asks itself
        per_ask = self.config.recovery_timeout / 2 + transfer_s

        async def own_slice() -> tuple[int, PartResult] | None:
            local = self._rounds.get(combine.round_id) if skip is not None else None
            if local is not None and own in local.direct:  # this peer combined it: no need to ask
                with contextlib.suppress(asyncio.TimeoutError):
                    outcome = await asyncio.wait_for(asyncio.shield(local.direct[own]), per_ask)
                    if outcome is not None:
                        return own, outcome
            return await self._fetch_slice(second, own, per_ask, last=failed, skip=skip)

        async def fetch_all() -> list[PartResult] | None:
            # the failed reducer's own slice first: if it died before combining, nobody has it (every
            # group misses the part alike) and the other slices are not worth their bytes
            first = await own_slice()
            if first is None:
                return None
            rest = await asyncio.gather(*(self._fetch_slice(second, q, per_ask, last=failed, skip=skip)
                                          for q in range(len(combine.group)) if q != own))
            if any(r is None for r in rest):
                return None
            slices = [r[1] for r in rest]
            slices.insert(own, first[1])
            return slices

        try:
            slices = await asyncio.wait_for(fetch_all(), self.config.recovery_timeout + transfer_s)
        except asyncio.TimeoutError:
            return None
        if slices is None:
            return None
        wire = b"".join(s.wire for s in slices)
        a, b = state.spec.bounds[j]
        if len(wire) != b - a:  # each slice's size was checked against the second level's spec
            return None
        state.received[j] = (time.monotonic(), False)
        return PartResult(wire, [])

    async def _fetch_slice(self, second: RoundState, q: int, per_ask: float, *, last: str = "",
                           skip: int | None = None) -> tuple[int, PartResult] | None:
        """(combiner asked, slice q of a second-level round signed by its combiner): asked of that
        combiner first, then of the others in turn, ``last`` last, ``skip`` never, each within
        ``per_ask`` seconds; None if nobody gave it."""
        combiners = [p.peer_id for p in second.spec.group]
        for i in sorted(range(len(combiners)), key=lambda i: (combiners[i] == last, i != q, (i - q) % len(combiners))):
            if i == skip:
                continue
            try:
                return i, await asyncio.wait_for(self._fetch(second, i, q), per_ask)
            except Exception as e:
                logger.info("round %s: slice %d not from combiner %d: %s: %s", second.spec.round_id.hex()[:12], q, i,
                            type(e).__name__, e)
        return None

    async def _recover(self, state: RoundState, j: int, *, one_at_a_time: bool = False,
                       transfer_s: float = 0.0) -> PartResult | None:
        """Ask the other reachable members (the reducer first: its vote stream may have failed while it
        lives) for part j's result; accept the first one its reducer signed.

        Hedged, never all at once: the next member is asked when the last one asked failed, or has not
        begun to answer (a checked header) within ``recovery_hedge_s`` while no byte of this round
        came in meanwhile, so a slow link downloads a part about once instead of once per member
        (asking all at once made a 1 Mbit/s peer time out on every copy and apply zeros where the
        others applied the part). All within ``recovery_timeout`` plus ``transfer_s``.
        ``one_at_a_time`` (a follower): no hedging, each member in turn within twice the recovery
        timeout (a member that has not started the round waits up to the join timeout before it
        refuses)."""
        spec = state.spec
        n = len(spec.group)
        askers = sorted((i for i, p in enumerate(spec.group) if i != state.me and not p.client_mode),
                        key=lambda i: (i != j, (i - state.me) % n))  # rotated: members spread their asks

        async def ask(i: int, answering: asyncio.Event | None = None) -> tuple[int, PartResult]:
            return i, await self._fetch(state, i, j, answering)

        def failed(i: int, e: BaseException) -> None:  # a refusal says why (kept in the report); else: gone
            if isinstance(e, WireError):
                logger.info("round %s: refused a result for part %d: %s", spec.round_id.hex()[:12], j, e)
                state.report.parts[j].forgotten |= FORGOTTEN in str(e)
                state.report.parts[j].other_group |= OTHER_GROUP in str(e)
            else:  # unreachable, timed out, gone
                logger.info("round %s: part %d not from member %d: %s", spec.round_id.hex()[:12], j, i,
                            type(e).__name__)

        if one_at_a_time:
            until = time.monotonic() + 2 * self.config.recovery_timeout
            for i in askers:
                left = min(until - time.monotonic(), self.config.recovery_timeout)
                if left <= 0:
                    break
                try:
                    sender, outcome = await asyncio.wait_for(ask(i), left)
                except Exception as e:
                    failed(i, e)
                    continue
                state.received[j] = (time.monotonic(), sender == j)
                return outcome
            return None
        begun = time.monotonic()
        limit = begun + self.config.recovery_timeout + transfer_s
        asking: dict[asyncio.Task, tuple[int, asyncio.Event]] = {}
        queue, last_ask, flowed = deque(askers), -math.inf, state.report.bytes_down
        try:
            while queue or asking:
                now = time.monotonic()
                answering = any(event.is_set() for _, event in asking.values())
                if queue and not answering and (not asking or now - last_ask >= self.config.recovery_hedge_s):
                    if asking and state.report.bytes_down > flowed:  # the link is busy with other parts: their
                        last_ask, flowed = now, state.report.bytes_down  # bytes would delay a new answer as much
                    else:
                        i, event = queue.popleft(), asyncio.Event()
                        asking[asyncio.create_task(ask(i, event))] = (i, event)
                        last_ask, flowed = now, state.report.bytes_down
                        continue
                until = limit if answering or not queue else min(limit, last_ask + self.config.recovery_hedge_s)
                if until <= now:
                    break
                done, _ = await asyncio.wait(asking, timeout=until - now, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    i, _ = asking.pop(task)
                    if task.exception() is None:
                        sender, outcome = task.result()
                        state.received[j] = (time.monotonic(), sender == j)
                        return outcome
                    failed(i, task.exception())
                    last_ask = -math.inf  # a member that failed: ask the next one now
            logger.info("round %s: part %d not recovered in %.1f s (%s)", spec.round_id.hex()[:12], j,
                        time.monotonic() - begun, ", ".join(f"member {i} {'answering' if event.is_set() else 'silent'}"
                                                           for i, event in asking.values()) or "every member failed")
            return None
        finally:
            for task in asking:
                task.cancel()
                task.add_done_callback(lambda t: t.cancelled() or t.exception())

    def _start_audits(self, state: RoundState, outcomes: dict[int, PartResult]) -> None:
        """Audit ``audits_per_round`` other reducers' parts, chosen now that their results are in."""
        candidates = sorted(j for j, outcome in outcomes.items() if j != state.me and outcome.header)
        if state.spec.combine:  # two-level: a part is the second level's majority, not its group's: compared
            candidates = [j for j in candidates if state.spec.combine[j] is not None]
            if self.audit_rng.random() >= self.config.slice_audit_rate:
                return
            for j in self.audit_rng.sample(candidates, min(self.config.audits_per_round, len(candidates))):
                self._track_audit(self._compare_with_second_level(state, j, outcomes[j]))
            return
        for j in self.audit_rng.sample(candidates, min(self.config.audits_per_round, len(candidates))):
            header = parse_header(outcomes[j].header)
            count = leaf_count(header.stop - header.start, header.leaf_bytes)
            leaves = self.audit_rng.sample(range(count), min(self.config.audit_leaves, count))
            self._track_audit(self._audit(state, j, outcomes[j], header, leaves))

    def _track_audit(self, coroutine) -> None:
        """Run an audit in the background, unless ``MAX_AUDITS_IN_FLIGHT`` run already (then none)."""
        if len(self._audits) >= MAX_AUDITS_IN_FLIGHT:
            self.audits_expired += 1
            logger.info("no audit (%d in flight)", len(self._audits))
            coroutine.close()
            return
        task = asyncio.create_task(coroutine)
        self._audits.add(task)
        task.add_done_callback(self._audits.discard)

    async def _compare_with_second_level(self, state: RoundState, j: int, outcome: PartResult) -> None:
        """A two-level round's audit (after a share ``slice_audit_rate`` of rounds): part j's result is its
        second-level round's majority, which this voter cannot recount, but can compare: one slice,
        chosen privately, fetched signed by the combiner that reduced it, must equal those bytes of what
        part j's reducer sent. A mismatch is checked against a second copy of the slice from another
        combiner (a combiner that signed two versions, one for auditors, must not frame an honest
        reducer); then the reducer is reported: a suspicion, not a proof. Bounded by half the audit
        window each; a slice nobody gives is no verdict."""
        combine = state.spec.combine[j]
        reducer = state.spec.group[j].peer_id
        q = self.audit_rng.randrange(len(combine.group))
        a, b = combine.bounds[q]
        second = RoundState(combine, -1, RoundReport(combine.round_id.hex(), combine.step, -1, []), None, {})
        per_ask = self.config.audit_window_s / 8 + (b - a) / AUDIT_MIN_RATE
        try:  # the audited reducer is asked last: it could serve a slice that matches its own lie
            got = await asyncio.wait_for(self._fetch_slice(second, q, per_ask, last=reducer),
                                         self.config.audit_window_s / 2)
            if got is not None and outcome.wire[a:b] != got[1].wire:
                # a second copy from another combiner: a combiner that signed two versions of its slice
                # (one for the reducers, one for auditors) must not get an honest reducer accused
                again = await asyncio.wait_for(self._fetch_slice(second, q, per_ask, last=reducer, skip=got[0]),
                                               self.config.audit_window_s / 2)
                if again is None or again[1].wire != got[1].wire:
                    logger.warning("round %s part %d: slice %d of the second level came in two versions signed by "
                                   "%s (or once only): no verdict on reducer %s", state.spec.round_id.hex()[:12],
                                   j, q, combine.group[q].peer_id, reducer)
                    return
                self._convict(Caught(reducer, state.spec.round_id, j, "misrepresented",
                                     f"round {state.spec.round_id.hex()[:12]} part {j}: its signed result differs "
                                     f"from slice {q} of the second level, signed by {combine.group[q].peer_id}"))
                return
        except asyncio.TimeoutError:
            got = None
        if got is None:
            self.audits_expired += 1
            return
        try:
            await asyncio.wait_for(self._check_margins(state, j, outcome, q, got[1]), self.config.audit_window_s / 2)
        except asyncio.TimeoutError:
            self.audits_expired += 1
        except Exception as e:  # a bug here must not look like a lie
            logger.warning("margins check of part %d failed: %s: %s", j, type(e).__name__, e)

    async def _check_margins(self, state: RoundState, j: int, outcome: PartResult, q: int, piece: PartResult) -> None:
        """After a slice compared equal: do the margins part j's reducer sent the second level match its
        group's votes? Slice q's combiner committed to each counted reducer's margin codes, each signed by
        that reducer (its statement in the slice's header: a combiner cannot put other margins in its
        name). One margin leaf, chosen privately, is opened by the combiner; the reducer opens its
        counted voters' codes for the same positions against the roots it signed for its group; the
        recount (``audit.owed_margins``: 2c - v + s) must equal what it sent. A mismatch convicts it with
        evidence that every piece of is signed by it (``audit.judge_margins``); an opening that does not
        verify is reported (a suspicion); a reducer that does not answer counts as in
        ``_audit``; a combiner that does not open is no verdict on the reducer, unless it is the reducer
        itself (it combines its own group's slice of the part). Both are asked within half the audit
        window from the result's arrival, as ``_audit`` asks (later, an honest peer may have forgotten
        the round)."""
        spec, combine = state.spec, state.spec.combine[j]
        reducer = spec.group[j].peer_id
        first, second = parse_header(outcome.header), parse_header(piece.header)
        r = combine.index_of(reducer)
        if r not in second.counted:
            return  # its group's margins were not counted in this slice: nothing of them to check
        if not second.statements:
            return  # an unsigned swarm's (a node with an identity refuses such a slice, ``_check_result``)
        pos = list(second.counted).index(r)
        statement = second.statements[pos] if len(second.statements) == len(second.counted) else None
        if statement is None or statement.root != second.roots[pos] \
                or not signed_by(statement, reducer, second.round_id, second.part, self.verifier):
            logger.warning("round %s part %d: slice %d's header does not carry reducer %s's signed margins: no "
                           "margins check", spec.round_id.hex()[:12], j, q, reducer)
            return
        k2 = self.audit_rng.randrange(leaf_count(second.stop - second.start, second.leaf_bytes))
        a2, b2 = leaf_span(second, k2)
        x, y = second.start + a2, second.start + b2  # the leaf's bytes of part j
        leaves = first_level_leaves(first, x, y)
        if len(leaves) > MAX_AUDIT_LEAVES:  # more than one audit may ask (never with the leaf sizes of commit.py)
            return
        combiner = combine.group[q].peer_id
        received_at, direct = state.received.get(j, (time.monotonic(), False))
        ask_by = received_at + self.config.audit_window_s / 2

        try:
            async with self._audit_turn(combiner, ask_by - time.monotonic()):
                opened = await asyncio.wait_for(self._ask_audit(combine, q, [k2], len(second.counted)),
                                                self._audit_deadline(combine, second, 1))
            try:
                check_openings(second, combine.upload.planes, k2, opened[k2])
            except WireError as e:
                raise BadOpening(str(e)) from e
        except (TurnMissed, Unreachable, asyncio.TimeoutError, WireError, *NETWORK_ERRORS) as e:
            logger.info("round %s part %d: combiner %s did not open slice %d's margins (%s): no margins check",
                        spec.round_id.hex()[:12], j, combiner, q, type(e).__name__)
            if combiner == reducer and not isinstance(e, (TurnMissed, Unreachable)):
                self._unanswered(state, j, direct, "did not open its own margins in its slice", e)
            return
        sent = opened[k2][pos].codes
        try:
            async with self._audit_turn(reducer, ask_by - time.monotonic()):
                votes = await asyncio.wait_for(self._ask_audit(spec, j, leaves, len(first.counted)),
                                               self._audit_deadline(spec, first, len(leaves)))
            try:
                owed = owed_margins(first, votes, second.upload_bits, x, y)
            except WireError as e:
                raise BadOpening(str(e)) from e
        except (TurnMissed, Unreachable) as e:
            logger.info("round %s part %d: reducer %s not asked for its votes: %s", spec.round_id.hex()[:12], j,
                        reducer, type(e).__name__)
            return
        except (asyncio.TimeoutError, WireError, *NETWORK_ERRORS) as e:
            self._unanswered(state, j, direct, "did not open the votes behind its margins", e)
            return
        self.margins_checked += 1
        if owed == sent:
            return
        differ = int(np.count_nonzero(np.frombuffer(owed, np.uint8) != np.frombuffer(sent, np.uint8)))
        reason = (f"round {spec.round_id.hex()[:12]} part {j}: the margins it sent slice {q} of the second level "
                  f"differ from its counted votes in {differ} of {len(owed)} bytes of leaf {k2}")
        if not outcome.signature:  # an unsigned swarm's: nothing to prove it with
            self._convict(Caught(reducer, spec.round_id, j, "misrepresented", reason))
            return
        proof = pb.MarginsProof(flat_round=spec.flat_round, group=spec.group_index, slice=q, statement=statement,
                                margins=opened[k2][pos])
        evidence = pb.Evidence(version=PROTOCOL_VERSION, header=outcome.header, signature=outcome.signature,
                               public_key=outcome.public_key, wire=outcome.wire, leaf=leaves[0],
                               votes=[answer for k in leaves for answer in votes[k]], margins=proof)
        self._convict(Caught(reducer, spec.round_id, j, "lie", reason, evidence.SerializeToString()))

    async def _audit(self, state: RoundState, j: int, outcome: PartResult, header: pb.ResultHeader,
                     leaves: list[int]) -> None:
        """Ask reducer j to open ``leaves`` and recount them. An auditor asks within half of the reducer's
        ``audit_window_s`` after the result arrived, one audit at a time per reducer (its audit stream
        cap is 2), or not at all. What counts against the reducer: a recount that differs (a lie, with
        evidence), an opening that does not verify, and, for a result its reducer sent this peer itself
        (so the window surely still ran when asked), a refusal, a timeout or a stream closed twice
        before any answer. A reducer this peer cannot dial any more (gone) is not accused."""
        spec = state.spec
        reducer = spec.group[j].peer_id
        received_at, direct = state.received.get(j, (time.monotonic(), False))
        ask_by = received_at + self.config.audit_window_s / 2
        verdict = "ok"
        try:
            async with self._audit_turn(reducer, ask_by - time.monotonic()):
                answers = await asyncio.wait_for(self._ask_audit(spec, j, leaves, len(header.counted)),
                                                 self._audit_deadline(spec, header, len(leaves)))
            for k in leaves:
                try:
                    reason = judge(header, outcome.wire, k, answers[k])
                except WireError as e:
                    raise BadOpening(str(e)) from e
                if reason:
                    evidence = make_evidence(outcome.header, outcome.signature, outcome.public_key, outcome.wire, k,
                                             answers[k]) if outcome.signature else b""
                    self._convict(Caught(reducer, spec.round_id, j, "lie",
                                         f"round {spec.round_id.hex()[:12]} part {j}: {reason}", evidence))
                    verdict = "lie"
                    break
        except TurnMissed:
            self.audits_expired += 1
            logger.info("round %s part %d: audit not asked within %.0f s of the result: dropped",
                        spec.round_id.hex()[:12], j, self.config.audit_window_s / 2)
            state.report.audit = (j, j, "expired")
            return
        except asyncio.CancelledError:
            return
        except Unreachable as e:
            verdict = "unreachable"
            logger.info("round %s part %d: reducer %s not audited: %s", spec.round_id.hex()[:12], j, reducer, e)
        except (asyncio.TimeoutError, WireError, *NETWORK_ERRORS) as e:
            counted = self._unanswered(state, j, direct, "audit not answered", e)
            verdict = "unanswered" if counted else "unanswered (forwarded result: not counted)"
        except Exception as e:  # a bug here must not look like a lie
            logger.warning("audit of part %d failed: %s: %s", j, type(e).__name__, e)
            return
        state.report.audit = (j, j, verdict)

    def _unanswered(self, state: RoundState, j: int, direct: bool, what: str, e: BaseException) -> bool:
        """Reducer j did not answer an audit (``e``). It counts against it, and is True, for an opening
        that does not verify or a result it sent this peer itself; a result forwarded by another member
        may have reached this peer after the reducer's window ended: not counted."""
        spec, reason = state.spec, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        if not direct and not isinstance(e, BadOpening):
            logger.info("round %s part %d: %s for a forwarded result (%s): not counted", spec.round_id.hex()[:12], j,
                        what, reason)
            return False
        self._convict(Caught(spec.group[j].peer_id, spec.round_id, j, "unanswered",
                             f"round {spec.round_id.hex()[:12]} part {j}: {what} ({reason})"))
        return True

    @contextlib.asynccontextmanager
    async def _audit_turn(self, peer: str, wait_s: float):
        """One audit of ``peer`` at a time (its audit stream cap is 2): enters once this one's turn came,
        raises ``TurnMissed`` when it did not come within ``wait_s``."""
        turn = self._audit_turns.setdefault(peer, asyncio.Lock())
        self._audit_users[peer] += 1
        try:
            try:
                await asyncio.wait_for(turn.acquire(), max(wait_s, 0.0))
            except asyncio.TimeoutError:
                raise TurnMissed(peer) from None
            try:
                yield
            finally:
                turn.release()
        finally:
            self._audit_users[peer] -= 1
            if self._audit_users[peer] <= 0:
                del self._audit_users[peer]
                self._audit_turns.pop(peer, None)

    def _audit_deadline(self, spec: RoundSpec, header: pb.ResultHeader, leaves: int) -> float:
        """``audit_timeout`` plus the answer's transfer at ``AUDIT_MIN_RATE`` (a slow link is no lie)."""
        count = leaf_count(header.stop - header.start, header.leaf_bytes)
        per_answer = spec.upload.planes * header.leaf_bytes + DIGEST_BYTES * max(count - 1, 0).bit_length() + 64
        return self.config.audit_timeout + leaves * len(header.counted) * per_answer / AUDIT_MIN_RATE

    async def _ask_audit(self, spec: RoundSpec, j: int, leaves: list[int], voters: int) -> dict[int, list]:
        """The reducer's answers, by leaf. A stream that ends before any answer (a stream cap that
        refused it, a reset) is asked again once; a reducer that cannot be dialed raises Unreachable."""
        attempt = 0
        while True:
            try:
                _, reader, writer = await self.p2p.call_binary_stream_handler(
                    PeerID.from_base58(spec.group[j].peer_id), AUDIT_PROTOCOL)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                raise Unreachable(f"{type(e).__name__}: {e}") from e
            answers: dict[int, list] = {k: [] for k in leaves}
            try:
                await write_frame(writer, pb.AuditRequest(version=PROTOCOL_VERSION, round_id=spec.round_id, part=j,
                                                          leaves=leaves, token=self.admission.token(self.peer_id)))
                for k in leaves:
                    for _ in range(voters):
                        msg, _ = await read_frame(reader, pb.AuditAnswer)
                        if msg is None:
                            raise StreamClosed("audit stream closed early")
                        if msg.error:
                            raise WireError(f"reducer refused the audit: {msg.error}")
                        answers[k].append(msg)
                return answers
            except (StreamClosed, *NETWORK_ERRORS):
                if attempt or any(answers.values()):
                    raise
            finally:
                writer.close()  # every answer read (or given up): the reducer waits for this close
            attempt += 1
            await asyncio.sleep(0.2)

    # -- serving other peers ---------------------------------------------------------------------

    async def _find_round(self, round_id: bytes, peer: str, family: str = "", step: int = 0) -> RoundState:
        """The round, waiting up to ``join_timeout`` for this peer to start it; each peer may wait for at
        most ``max_pending_rounds`` rounds at once (the stream gate bounds the streams doing so).
        ``family`` and ``step``: which round of its step the asker means, if it says; when this peer ran
        that round under another id (another group), it will never start here: refused at once rather
        than after the join timeout (seen: 3 rounds at 10 s each, then a repair). When this peer still
        runs the step before, the wait goes on up to ``upload_timeout`` longer: its own round starts when
        that one ends (a voter one step ahead otherwise stays ahead, its votes refused every round: seen
        behind a NAT, 5 rounds lost and then a drop)."""
        if family:
            self.asked_step[family] = max(self.asked_step.get(family, 0), step)
        if round_id in self._rounds:
            return self._rounds[round_id]
        if round_id in self._finished:
            raise WireError("round already finished")
        self._refuse_other_group(round_id, family, step)
        held_at = min(self._stalled_at.values(), default=step + 1)  # any family: a hung training thread starts none
        if family and held_at <= step:
            raise WireError(f"this peer has not started its rounds of step {held_at} yet ({HELD_UP}): refused at once")
        if self._pending_by_peer[peer] >= self.config.max_pending_rounds:
            raise WireError("too many rounds not started here yet")
        event = self._waiting.setdefault(round_id, asyncio.Event())
        if family:
            self._waiting_key[round_id] = (family, step)
        self._waiters[round_id] += 1
        self._pending_by_peer[peer] += 1
        runs = self._runs
        try:
            started = await _set_within(event, self.config.join_timeout)
            if not started and self._running_step_before(family, step):
                started = await _set_within(event, self.config.upload_timeout)
            if not started:
                # it started no round meanwhile and runs none now: its later rounds, of any family, are refused
                # at once until it catches up (``_ran``; a hung training thread made every round wait the join
                # timeout for it: steps of 3-12 s until it was dropped). The askers' parts stop waiting for
                # its votes (``_vote_remote``). Not when it ran any (a round it skipped, a bogus step asked: it is
                # alive), nor while one of its rounds is still in progress (a slow round holds it up: refusing
                # made the next rounds slow in turn, measured), and only a family it runs itself, so that an
                # asker cannot grow the table
                if family and self._runs == runs and not self._active and (family in self._stalled_at
                                                      or any(f == family for f, _ in self._by_step)):
                    self._stalled_at[family] = min(self._stalled_at.get(family, step), step)
                raise WireError(f"unknown round {round_id.hex()[:16]} (not started here within the join timeout)")
        finally:
            self._pending_by_peer[peer] -= 1
            if self._pending_by_peer[peer] <= 0:
                del self._pending_by_peer[peer]
            self._waiters[round_id] -= 1
            if self._waiters[round_id] <= 0:
                del self._waiters[round_id]
                self._waiting_key.pop(round_id, None)
                if not event.is_set():
                    self._waiting.pop(round_id, None)
        if round_id not in self._rounds:
            self._refuse_other_group(round_id, family, step)
            raise WireError("round already finished")
        return self._rounds[round_id]

    def _running_step_before(self, family: str, step: int) -> bool:
        """Whether this peer's newest round (any family: a momentum round follows its step's vote) is of
        ``step`` - 1 or of ``step`` itself, so that its round of ``family`` and ``step`` comes next."""
        return bool(family) and max((s for _, s in self._by_step), default=-2) in (step - 1, step)

    def _refuse_other_group(self, round_id: bytes, family: str, step: int) -> None:
        if family and self._by_step.get((family, step), round_id) != round_id:
            raise WireError(f"this peer ran the {family[:MAX_FAMILY_CHARS]} round of step {step} {OTHER_GROUP} "
                            f"(the newest epoch here is {self.group_epoch})")

    async def _on_vote_stream(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = True
        while await self._serve_round(info, reader, writer, first):
            first = False  # the voter keeps this stream for its next round

    async def _serve_round(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, first: bool) -> bool:
        """Count one round's votes from this stream and answer them. True: the stream may carry the
        voter's next round; False: it is done (closed by the voter, idle, or refused)."""
        state = voter = red = None
        replied = False
        peer = info.peer_id.to_base58()
        task = asyncio.current_task()
        try:
            wait = self.config.first_frame_timeout if first else 2 * self.config.keep_streams_s
            try:  # a round's first chunk is small (chunk_spans): at most 16 KiB before the sender is admitted
                chunk, nread = await asyncio.wait_for(read_frame(reader, pb.VoteChunk, MAX_FIRST_FRAME_BYTES), wait)
            except (asyncio.TimeoutError, *NETWORK_ERRORS):
                if first:
                    raise
                return False  # a kept stream: idle too long, or the voter went away between rounds
            if chunk is None:
                return False
            until = time.monotonic() + self.config.serve_deadline
            refused = self.admission.reason(peer, chunk.token)
            if refused:
                raise WireError(f"not admitted: {refused}")
            state = await self._find_round(chunk.round_id, peer, chunk.family, chunk.step)
            state.handlers.add(task)
            spec = state.spec
            voter = spec.index_of(peer)
            if chunk.part != state.me or state.reduction is None:
                raise WireError(f"part {chunk.part} is not reduced by this peer")
            red = state.reduction
            if len(chunk.tag) > MAX_TAG_BYTES:
                raise WireError(f"tag of {len(chunk.tag)} bytes")
            self._take_statement(state, red, voter, peer, chunk)
            declared = list(chunk.result_bases)
            try:
                check_declared(declared)
            except ValueError as e:
                raise WireError(str(e)) from None
            red.tags.setdefault(voter, chunk.tag)
            state.report.bytes_down += nread
            await asyncio.wait_for(self._receive_votes(state, red, voter, chunk, reader),
                                   max(until - time.monotonic(), 0.0))
            outcome = await asyncio.wait_for(asyncio.shield(red.result), max(until - time.monotonic(), 0.0))
            if outcome is None:
                raise WireError("no result: fewer than a quorum of votes were counted")
            outcome = self._outcome_for(state, voter, outcome)
            await asyncio.wait_for(self._send_result(writer, spec, red.part, outcome, state.report,
                                                     delta=self._delta_for(state, red.part, outcome, declared)),
                                   max(until - time.monotonic(), 0.0))
            return True
        except WireError as e:
            self._refuse(state, red, voter, info, str(e))
            replied = await self._try_send_error(writer, state, state.me if state else 0, str(e))
        except (asyncio.TimeoutError, *NETWORK_ERRORS) as e:
            self._refuse(state, red, voter, info, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
        except Exception as e:  # never let a peer's bytes crash this peer
            logger.warning("vote stream from %s failed: %s: %s", info.peer_id, type(e).__name__, e)
            self._refuse(state, red, voter, info, f"internal error: {e}")
        finally:
            if state is not None:
                state.handlers.discard(task)
        if replied:  # a refusal ends the stream: let the voter read it before closing (QUIC loses it otherwise)
            await close_after_reply(reader, writer)
        return False

    def _take_statement(self, state: RoundState, red: PartReduction, voter: int, peer: str,
                        chunk: pb.VoteChunk) -> None:
        """Momentum and second-level rounds: the voter's signed root (and bound; required from everyone when
        this peer signs)."""
        if not state.spec.signs_votes:
            if chunk.HasField("statement"):
                raise WireError("a statement in a vote round")
            return
        if not chunk.HasField("statement"):
            if self.identity is not None:
                raise WireError("votes without the voter's signed statement")
            return
        st = chunk.statement
        if not np.isfinite(st.max_abs) or st.max_abs < 0 or len(st.root) != DIGEST_BYTES:
            raise WireError("statement with a bad bound or root")
        if not signed_by(st, peer, state.spec.round_id, red.part, self.verifier):
            raise WireError("statement not signed by the voter")
        red.statements.setdefault(voter, st)

    async def _receive_votes(self, state: RoundState, red: PartReduction, voter: int, chunk: pb.VoteChunk,
                             reader: asyncio.StreamReader) -> None:
        spec = state.spec
        limit = spec.upload.planes * red.nbytes  # a late voter's bytes are read (not counted) up to this
        received = 0
        while True:
            if chunk.round_id != spec.round_id or chunk.part != red.part:
                raise WireError("chunk for another round or part on the same stream")
            spec.check_vote_header(chunk)
            codes = red.codes_from(chunk)
            state.report.payload_down += codes.numel()
            if red.closed:  # late: drain without counting, then answer like everyone else
                received += codes.numel()
                if received > limit:
                    raise WireError("late voter sent more than its part")
                if voter not in red.complete and voter not in red.dropped:
                    red.dropped[voter] = "late: arrived after the part was reduced"
            else:
                red.add(voter, chunk.offset, codes, chunk.last)
            if chunk.last:
                return
            remaining = self.config.upload_timeout + self.config.join_timeout
            chunk, nread = await asyncio.wait_for(read_frame(reader, pb.VoteChunk), remaining)
            if chunk is None:
                raise WireError("stream ended before the last chunk")
            state.report.bytes_down += nread

    def _refuse(self, state, red, voter, info, reason: str) -> None:
        key, now = (info.peer_id.to_base58(), reason[:48]), time.monotonic()
        if now - self._warned.get(key, -60.0) >= 60.0:  # a flood of the same refusal is logged once a minute
            if len(self._warned) > 4096:
                self._warned.clear()
            self._warned[key] = now
            logger.warning("rejected votes from %s: %s", info.peer_id, reason)
        else:
            logger.debug("rejected votes from %s: %s", info.peer_id, reason)
        if red is not None and voter is not None:
            red.drop(voter, reason)

    async def _try_send_error(self, writer, state, part: int, reason: str) -> bool:
        """Tell the other side why its stream ends; True if that was written."""
        try:
            await asyncio.wait_for(write_frame(writer, pb.ResultChunk(
                version=PROTOCOL_VERSION, round_id=state.spec.round_id if state else b"", part=part, error=reason[:200])),
                1.0)
            return True
        except Exception:
            return False

    async def _on_fetch_stream(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Forward a part's signed result: from a live round (waiting for it to settle; for one not started
        here yet, up to ``join_timeout`` for it to start), else from the archive."""
        state = None
        replied = False
        peer = info.peer_id.to_base58()
        task = asyncio.current_task()
        try:
            req, _ = await asyncio.wait_for(read_frame(reader, pb.FetchResult, 1024), self.config.first_frame_timeout)
            if req is None:
                return
            refused = self.admission.reason(peer, req.token)
            if refused:
                raise WireError(f"not admitted: {refused}")
            state = self._rounds.get(req.round_id)
            if state is None and req.round_id not in self._finished and self.archive.get(req.round_id) is None:
                # not started here yet (a follower caught up)
                state = await self._find_round(req.round_id, peer, req.family, req.step)
            if state is not None:
                spec = state.spec
                self._check_asker(spec, peer)
                future = state.direct.get(req.part)
                if future is None:
                    raise WireError(f"no part {req.part} in this round")
                state.handlers.add(task)
                outcome = await asyncio.wait_for(asyncio.shield(future), self.config.result_timeout)
                outcome = outcome or state.recovered.get(req.part)
            else:
                kept = self.archive.get(req.round_id)
                if kept is None:
                    raise WireError(FORGOTTEN)
                spec = kept.spec
                self._check_asker(spec, peer)
                outcome = kept.results.get(req.part)
            if outcome is None or not outcome.signature:
                raise WireError(f"part {req.part}: no result signed by its reducer here")
            await asyncio.wait_for(self._send_result(writer, spec, req.part, outcome, state and state.report),
                                   self.config.result_timeout)
            self.archive.served(req.round_id)
            replied = True
        except WireError as e:
            (logger.warning if "not admitted" in str(e) else logger.info)(
                "refused a result request from %s: %s", info.peer_id, e)
            replied = await self._try_send_error(writer, state, 0, str(e))
        except (asyncio.TimeoutError, *NETWORK_ERRORS):
            pass
        except Exception as e:
            logger.warning("fetch stream from %s failed: %s: %s", info.peer_id, type(e).__name__, e)
        finally:
            if state is not None:
                state.handlers.discard(task)
        if replied:  # the asker closes after the last chunk; closing first can lose it (QUIC)
            await close_after_reply(reader, writer)

    def _check_asker(self, spec: RoundSpec, peer: str) -> None:
        """Members ask for their round's results and audits; a second-level round's slices and openings go
        to any admitted peer (the voters of a group whose reducer failed assemble their part from them,
        ``_recover_combined``; a group's voters open their reducer's margins, ``_check_margins``)."""
        if spec.round_id not in self._second_level:
            spec.index_of(peer)

    def _audited(self, round_id: bytes) -> tuple[RoundSpec, PartReduction | None] | None:
        """The spec and this peer's reduction of a round, live or archived (None: unknown or forgotten)."""
        state = self._rounds.get(round_id)
        if state is not None:
            return state.spec, state.reduction
        kept = self.archive.get(round_id)
        return (kept.spec, kept.reduction) if kept is not None else None

    async def _on_audit_stream(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Open every counted voter's codes in the asked leaves of the part this peer reduced."""
        peer = info.peer_id.to_base58()
        replied = False
        try:
            req, _ = await asyncio.wait_for(read_frame(reader, pb.AuditRequest, 1024), self.config.first_frame_timeout)
            if req is None:
                return
            refused = self.admission.reason(peer, req.token)
            if refused:
                raise WireError(f"not admitted: {refused}")
            found = self._audited(req.round_id)
            if found is None:
                raise WireError("unknown or forgotten round")
            spec, red = found
            self._check_asker(spec, peer)
            if red is None or req.part != red.part or red.outcome is None or not red.trees:
                raise WireError(f"no result of part {req.part} here")
            leaf = leaf_bytes(red.nbytes, spec.upload.planes)
            count = leaf_count(red.nbytes, leaf)
            if not 0 < len(req.leaves) <= MAX_AUDIT_LEAVES or any(k >= count for k in req.leaves):
                raise WireError(f"audit of leaves {list(req.leaves)[:8]} of {count}")
            for k in req.leaves:
                for voter in red.outcome.counted:
                    answer = pb.AuditAnswer(version=PROTOCOL_VERSION, leaf=k, voter=voter,
                                            codes=leaf_of(red.votes[voter], leaf, k), path=red.trees[voter].path(k))
                    await asyncio.wait_for(write_frame(writer, answer), self.config.audit_timeout)
                    replied = True
        except WireError as e:
            logger.info("refused an audit from %s: %s", info.peer_id, e)
            try:
                await asyncio.wait_for(write_frame(writer, pb.AuditAnswer(version=PROTOCOL_VERSION, error=str(e)[:200])),
                                       1.0)
                replied = True
            except Exception:
                pass
        except (asyncio.TimeoutError, *NETWORK_ERRORS):
            pass
        except Exception as e:
            logger.warning("audit stream from %s failed: %s: %s", info.peer_id, type(e).__name__, e)
        if replied:  # the auditor closes once it has every answer; closing first can lose the last (QUIC)
            await close_after_reply(reader, writer)


async def _first_of(a: asyncio.Event, b: asyncio.Event, timeout: float) -> None:
    """Wait until ``a`` or ``b`` is set; ``asyncio.TimeoutError`` after ``timeout`` seconds."""
    waits = [asyncio.ensure_future(a.wait()), asyncio.ensure_future(b.wait())]
    try:
        done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
    if not done:
        raise asyncio.TimeoutError


async def _set_within(event: asyncio.Event, seconds: float) -> bool:
    """Whether ``event`` is set within ``seconds``."""
    try:
        await asyncio.wait_for(event.wait(), seconds)
        return True
    except asyncio.TimeoutError:
        return False


def assemble(spec: RoundSpec, outcomes: dict[int, PartResult | None]) -> tuple[torch.Tensor, dict[int, str]]:
    """The whole buffer's update from its parts, and the parts whose bytes did not decode.

    Packed bits (nbytes,) if every part has a majority result, else float32 (nbytes*8,) with zeros
    where a part is missing or undecodable (every peer holding the same bytes decides the same)."""
    parts = sorted(outcomes)
    if is_values(spec.upload):  # values, not votes: NaN marks what the caller keeps locally
        return _assemble_values(spec, outcomes)
    if spec.result.name == "majority" and all(outcomes[j] is not None for j in parts):
        joined = bytearray(b"".join(outcomes[j].wire for j in parts))
        return (torch.frombuffer(joined, dtype=torch.uint8) if joined else torch.zeros(0, dtype=torch.uint8)), {}
    update, bad = torch.zeros(spec.nbytes * 8, dtype=torch.float32), {}
    for j in parts:
        outcome = outcomes[j]
        if outcome is None:
            continue
        a, b = spec.bounds[j]
        raw = torch.frombuffer(bytearray(outcome.wire), dtype=torch.uint8)
        try:
            if spec.result.name == "majority":
                update[8 * a : 8 * b] = unpack_signs(raw, 8 * (b - a))
            else:
                update[8 * a : 8 * b] = spec.result.decode(raw, 8 * (b - a), len(outcome.counted) * spec.upload.max_code)
        except ValueError as e:
            bad[j] = str(e)
    return update, bad


def _assemble_values(spec: RoundSpec, outcomes: dict[int, PartResult | None]) -> tuple[torch.Tensor, dict[int, str]]:
    values, bad = torch.full((spec.upload.values_in(spec.nbytes),), float("nan")), {}
    for j, outcome in outcomes.items():
        if outcome is None:
            continue
        a, b = spec.bounds[j]
        try:
            values[spec.upload.value_span(a, b)] = spec.result.decode(
                torch.frombuffer(bytearray(outcome.wire), dtype=torch.uint8), 8 * (b - a), len(outcome.counted),
                codec=spec.upload)
        except ValueError as e:
            bad[j] = str(e)
    return values, bad
