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

Layout: ``VoteNode`` here owns the state (the round table, the rounds waited for, the held-up rule)
and the entry points (``prepare_round``, ``run_round``, ``follow_round``); its other methods come from
one mixin per concept, each module saying which of these attributes it reads and writes: voting.py
(the voter's side), recovery.py (missed parts), auditing.py (audits, convictions), serving.py (the
reducer's side, results forwarded); shared.py holds what they share (protocol names, ``RoundState``),
assembly.py ``assemble``. Everything runs on the event loop thread that owns ``p2p``.
"""
from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter, OrderedDict, deque
from typing import Callable, Iterator

import torch
from hivemind.p2p import P2P

from ..identity import Identity, Verifier
from ..wire import WireError, read_frame
from ..wire.gate import StreamGate, guard
from .admission import OPEN, Admission
from .archive import RoundArchive
from .assembly import assemble
from .auditing import AuditingMixin
from .deadline import AdaptiveDeadline
from .punctuality import Punctuality, probe_round
from .recovery import RecoveryMixin
from .reducer import PartReduction
from .result_delta import ResultBases
from .round import AllReduceConfig, Caught, PartReport, RoundReport, RoundSpec
from .serving import ServingMixin
from .shared import AUDIT_PROTOCOL, FETCH_PROTOCOL, VOTE_PROTOCOL, RoundState
from .voting import VotingMixin

# importers' names (``from lioncub_p2p.allreduce.node import FETCH_PROTOCOL``), kept here
__all__ = ["VoteNode", "RoundState", "assemble", "VOTE_PROTOCOL", "FETCH_PROTOCOL", "AUDIT_PROTOCOL"]

CATCH_UP_STEPS = 10  # a stalled peer's later rounds are refused at most this many steps past its stall (``_ran``)


class VoteNode(VotingMixin, RecoveryMixin, AuditingMixin, ServingMixin):
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
        # round -> the admitted peers whose votes for it were refused before this peer started it (held up,
        # not started within the join timeout): told so, they send none again, so its part does not wait for
        # them when this peer runs that round after all (``PartReduction.refuse_early``; a hung peer that
        # loaded the state mid-step waited the upload timeout there, and every group with it, measured).
        # Bounded: serving.py's REFUSED_ROUNDS.
        self._refused_before_start: OrderedDict[bytes, set[str]] = OrderedDict()
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

    async def _first_request(self, reader: asyncio.StreamReader, message, peer: str):
        """A fetch or audit stream's one request (at most 1 KiB, within ``first_frame_timeout``), once its
        sender is admitted; None when the stream closed first."""
        req, _ = await asyncio.wait_for(read_frame(reader, message, 1024), self.config.first_frame_timeout)
        if req is not None and (refused := self.admission.reason(peer, req.token)):
            raise WireError(f"not admitted: {refused}")
        return req

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
            state.reduction.refuse_early(others(frozenset(self._refused_before_start.pop(spec.round_id, ()))))
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
                        one_at_a_time: bool = False, provisional: bool = False) -> tuple[torch.Tensor, RoundReport]:
        """``_vote_round``, counted among this peer's rounds in progress (``_find_round``)."""
        with self._in_progress():
            return await self._vote_round(spec, upload, tag, one_at_a_time=one_at_a_time, provisional=provisional)

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

    @property
    def held_up_at(self) -> int | None:
        """The step from which this peer refuses the group's rounds as held up (its training thread
        started none it was asked for), or None. Read by the training thread (one read of a dict)."""
        return min(self._stalled_at.values(), default=None)

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
