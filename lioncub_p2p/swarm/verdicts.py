"""Verdicts on reducers: what this peer's audits caught, what other members report, who lied.

A lie is convicted only on evidence this peer checked itself (``accuse.prove``): the liar is refused
for the rest of the run, and the evidence goes to the leader (to every member when the liar led the
group, or some would keep following its group records) and, later, to each new leader. Anything that
cannot be proven is one member's suspicion (``accuse.Suspicions``): two members for the same round
make a suspect for a while. Everything here runs on the swarm's event loop; other threads only read
``liars`` and ``suspects()``. The swarm is seen through ``RoundLookup`` (its recent rounds) and a
``send`` function, so these rules are testable without a network.
"""
from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import replace
from typing import Protocol

from ..allreduce import Caught
from .accuse import RATE_LIMITED, Accusation, Refused, Suspicions, prove
from .membership import GroupRecord
from .records import RateLimitedLog

logger = logging.getLogger(__name__)

MAX_PROOFS_KEPT = 64  # liars whose evidence this peer keeps to show later leaders
MAX_PROVING = 2  # members' evidence checked at once (a recount of up to 64 MiB each, in a worker thread)
BUSY = "busy checking other evidence: try again later"  # the refusal an accuser retries (RETRY_REPORT_S)
RETRY_REPORT_S = 10.0  # a leader that could not be told about a liar is told again after this


class RoundLookup(Protocol):
    def round_of(self, round_id: bytes, step: int, part: int, reducer: str) -> tuple[GroupRecord, str] | None:
        """The group and kind of one of this peer's recent rounds, if ``reducer`` reduced ``part`` in it."""

    def step_of(self, round_id: bytes) -> int | None:
        """The step of one of this peer's own recent rounds."""

    def accusation_header(self, accuser: str, accusation: Accusation, evidence_bytes: int) -> int:
        """Before any evidence is read: raises Refused unless it names a recent round of this peer's
        groups and another of its members; else the most evidence bytes that round can produce."""

    def latest(self) -> GroupRecord | None:
        """The newest group this peer follows."""


class Verdicts:
    def __init__(self, peer_id: str, rounds: RoundLookup, send: Callable[[str, Accusation], Awaitable[tuple[bool, str]]],
                 spawn: Callable[[Coroutine], None], log: RateLimitedLog):
        self.peer_id, self.rounds, self.send, self.spawn, self.log = peer_id, rounds, send, spawn, log
        self.liars: dict[str, str] = {}  # peers proven to lie (checked audit evidence) -> why; refused for the run
        self.suspicions = Suspicions()  # unprovable reports (misrepresented votes, unanswered audits)
        self._proofs: OrderedDict[str, Accusation] = OrderedDict()  # liar -> the checked evidence (for new leaders)
        self._reported: set[tuple[str, str]] = set()  # (liar, leader) this peer gave the evidence to
        self._proving = 0  # members' evidence being checked in threads (the event loop's count)

    def suspects(self) -> set[str]:
        """Proven liars (for the rest of the run), and reducers that two members reported for the same
        round in the last few minutes: the leader drops them and does not add them."""
        return set(self.liars) | self.suspicions.suspects()

    async def _prove_bounded(self, evidence: bytes):
        """``prove`` in a worker thread, at most ``MAX_PROVING`` at once. Counted until the thread ends: the
        accusation stream's timeout cancels the wait, not the recount, so a member uploading evidence
        slowly and often would otherwise stack recounts in the thread pool."""
        if self._proving >= MAX_PROVING:
            raise Refused(BUSY)
        recount = asyncio.get_running_loop().run_in_executor(None, prove, evidence)
        self._proving += 1
        recount.add_done_callback(self._proved)
        return await asyncio.shield(recount)  # a cancelled wait leaves the recount, and its count, running

    def _proved(self, _recount: asyncio.Future) -> None:
        self._proving -= 1

    async def act_on(self, caught: list[Caught]) -> None:
        """What this peer's audits caught: a lie it can prove convicts the reducer here and goes to the
        leader with its evidence; anything else is one member's suspicion, noted and reported."""
        for c in caught:
            try:
                if c.kind == "lie":
                    proof = await asyncio.to_thread(prove, c.evidence) if c.evidence else None
                    if proof is None or proof.reducer != c.peer_id or self.rounds.round_of(proof.round_id, proof.step,
                                                                                   proof.part, c.peer_id) is None:
                        self.log.warning(f"unproven:{c.peer_id}", "reducer %s reported lying without evidence that "
                                         "checks out here: not acted on (%s)", c.peer_id, c.reason)
                        continue
                    accusation = Accusation("lie", c.peer_id, proof.round_id, proof.part, proof.step,
                                            f"{proof.reason}", c.evidence)
                    self.convict(accusation, self.peer_id)
                else:
                    step = self.rounds.step_of(c.round_id)
                    if step is None or self.rounds.round_of(c.round_id, step, c.part, c.peer_id) is None:
                        continue  # a round this peer no longer knows: too old to report
                    accusation = Accusation(c.kind, c.peer_id, c.round_id, c.part, step, c.reason)
                    self.suspect(accusation, self.peer_id)
                await self._report(accusation)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a report that fails is logged; training goes on
                self.log.warning(f"report:{type(e).__name__}", "acting on a caught reducer failed: %s: %s",
                                 type(e).__name__, e)

    def leader(self, group: GroupRecord | None, *, besides: str = "") -> str | None:
        """Who leads ``group`` in this peer's eyes: its first reducing member not proven to lie."""
        if group is None:
            return None
        return next((m.peer_id for m in group.members if m.reduces and m.peer_id not in self.liars
                     and m.peer_id != besides), None)

    def convict(self, accusation: Accusation, by: str) -> str:
        """A proven lie (the evidence was checked): refuse the liar for the rest of the run."""
        liar = accusation.accused
        if liar in self.liars:
            return "already known"
        latest = self.rounds.latest()
        led = latest is not None and liar == next((m.peer_id for m in latest.members if m.reduces), None)
        self.liars[liar] = (f"round {accusation.round_id.hex()[:12]} (step {accusation.step}) part {accusation.part}: "
                            f"{accusation.reason}; proved by {by}")
        self._proofs[liar] = accusation
        while len(self._proofs) > MAX_PROOFS_KEPT:  # the oldest liars' evidence goes (they stay refused here)
            self._proofs.popitem(last=False)
        logger.warning("reducer %s proven to lie (evidence checked, from %s): %s; refused for the rest of the run",
                       liar, "this peer's audit" if by == self.peer_id else by, accusation.reason)
        if led and self.leader(latest) == self.peer_id:
            # the liar led the group: every member must hear it, or some keep following its group records
            members = [m.peer_id for m in latest.members if m.peer_id not in (liar, self.peer_id, by)]
            for member in members:
                self.spawn(self._send(member, accusation))
        return "convicted"

    def suspect(self, accusation: Accusation, by: str) -> str:
        """One member's unprovable report: two for the same round make the reducer a suspect for a while."""
        if self.suspicions.add(accusation.accused, accusation.round_id, by, f"{accusation.kind}: {accusation.reason}"):
            logger.warning("reducer %s suspected by two members for the same round, dropped while it is: %s",
                           accusation.accused, "; ".join(self.suspicions.reasons(accusation.accused)))
            return "suspected"
        logger.info("reducer %s reported by %s (%s): %s", accusation.accused, by, accusation.kind, accusation.reason)
        return "noted"

    async def _report(self, accusation: Accusation) -> None:
        """Tell the leader: a lie once per liar and leader, every suspicion (the leader matches them by round)."""
        leader = self.leader(self.rounds.latest(), besides=accusation.accused)
        key = (accusation.accused, leader)
        if leader is None or leader == self.peer_id or key in self._reported:
            return
        if accusation.kind == "lie":
            self._reported.add(key)  # in flight or done; a failed send is retried after RETRY_REPORT_S
        if not await self._send(leader, accusation) and accusation.kind == "lie":
            asyncio.get_running_loop().call_later(RETRY_REPORT_S, self._reported.discard, key)

    async def remind_leader(self) -> None:
        """A proven liar in the group this peer follows: its leader (a new one, say) has not seen the
        evidence. Give it, once per leader."""
        latest = self.rounds.latest()
        if latest is None:
            return
        for liar in [pid for pid in latest.member_ids() if pid in self._proofs]:
            if (liar, self.leader(latest, besides=liar)) not in self._reported:
                self.spawn(self._report(self._proofs[liar]))

    async def _send(self, to: str, accusation: Accusation) -> bool:
        """Whether ``to`` heard it (took it or said why not; "busy" and "too many accusations" are not
        heard: it is told again; reporting two liars, busy retries ran into the rate limit and a report
        refused there was never told again)."""
        try:
            taken, note = await self.send(to, accusation)
        except Exception as e:
            self.log.warning(f"send:{to}", "could not tell %s about %s: %s: %s", to, accusation.accused,
                             type(e).__name__, e)
            return False
        logger.info("told %s that %s %s: %s", to, accusation.accused,
                    "lied" if accusation.kind == "lie" else f"is suspect ({accusation.kind})",
                    note if taken else f"refused: {note}")
        return taken or note not in (BUSY, RATE_LIMITED)

    def on_header(self, accuser: str, accusation: Accusation, evidence_bytes: int) -> int:
        """An accusation's header, before its evidence travels (``AccuseServer``): the round's checks, and
        "busy" while ``MAX_PROVING`` recounts run, said before the accuser uploads up to 64 MiB rather
        than after. (A recount that starts during the upload can still make it busy after.)"""
        bound = self.rounds.accusation_header(accuser, accusation, evidence_bytes)
        if accusation.kind == "lie" and self._proving >= MAX_PROVING:
            raise Refused(BUSY)
        return bound

    async def on_accusation(self, accuser: str, accusation: Accusation) -> str:
        """A member's report: a lie only with evidence that proves exactly it; else a suspicion."""
        if accusation.kind != "lie":
            return self.suspect(accusation, accuser)
        proof = await self._prove_bounded(accusation.evidence)
        if proof is None or (proof.reducer, proof.round_id, proof.part, proof.step) != \
                (accusation.accused, accusation.round_id, accusation.part, accusation.step):
            raise Refused("the evidence does not prove that reducer lied in that round and part")
        return self.convict(replace(accusation, reason=proof.reason), accuser)
