"""State sync: this peer's training state between steps, served to others and caught up from them.

A peer holds the swarm's state (``synced``) once it founded the run or downloaded a member's state;
only then does it vote and say so in its record. A snapshot is taken only between steps: the
training thread holds ``step_lock`` from the start of a step to the end of its ``after_step``, so the
state server's worker thread takes the lock (briefly) before encoding. With an overlapped round in
flight, its update is part of the state, so the worker first waits for it.

Every download of state goes through ``catch_up``: joining, coming back after a drop, a repair (a
divergence the state tags show), a follower's skip ahead and the run's closing settle. One rule
holds for all of them: a state is the run's only when a round of the run decided for it. So

* donors are tried by what this peer measured of them (``DonorLedger``: download rates, states a
  round refuted), never by what they announce (a member announcing the largest weight was the first
  donor of every join and repair), and proven liars and refused donors never;
* a state caught up is *provisional* until a round whose state tag hashes every parameter byte
  (``full_digest_every``) decides for it; this peer serves it only once a first round decided for
  the bytes its tag samples. A round that decides against it, with every round since the download
  applied here whole, proves the donors served a state that was not the run's: they are refused
  from then on (a poisoned snapshot with a recomputed digest kept a newcomer on garbage for its whole
  run, downloading it again at every repair);
* a peer serves its state only while its last decided round decided for it (``in_consensus``), so an
  honest donor that diverged serves nothing until repaired;
* the closing settle names the exact digest the group ended with (``expect``): checked before loading.

Threads: ``synced``, ``provisional``, ``in_consensus`` and the lock's holder are written by the
training thread; the state server's worker thread only reads, under the lock.
"""
from __future__ import annotations

import contextlib
import logging
import math
import random
import statistics
import threading
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

from .. import failpoints
from ..aio import BackgroundLoop
from ..allreduce.admission import Admission
from ..optim import LionCub
from . import snapshot
from .membership import GroupRecord, PeerRecord, announced_step, synced_members
from .state_transfer import FAR_STEPS, StateServer, StateTransferError, download_bound, download_state
from .upkeep import MAX_TTL_S, STEP_WINDOW, Upkeep

logger = logging.getLogger(__name__)


def furthest_step(group: GroupRecord, records: dict[str, PeerRecord], min_step: int) -> int | None:
    """The furthest step an honest donor's state can be at now, from ``group``'s synced members' signed
    records: where they say the run is (``announced_step``, a lower median) plus the steps their pace
    (the lower median of their ``steps_per_s``) makes, twice over, in the age a record can reach
    (``MAX_TTL_S``), at least ``FAR_STEPS`` (a pace measured during a stall understates a run that
    resumed since), plus ``STEP_WINDOW``. A lying minority moves neither median, so a donor cannot set a
    joiner far past its group (before: any step below 2**53). None while no pace is known (a run's
    first steps, older peers): no bound then."""
    run_step = announced_step(group, records)
    paces = sorted(r.steps_per_s for r in synced_members(group, records))
    pace = paces[(len(paces) - 1) // 2] if paces else 0.0
    if run_step is None or pace <= 0:
        return None
    return max(min_step, run_step) + STEP_WINDOW + max(FAR_STEPS, math.ceil(2 * pace * MAX_TTL_S))


@dataclass
class Provisional:
    """A state caught up and loaded that no full-digest round has decided for yet."""

    donors: frozenset[str]  # who served it (a resumed download: each sent the same snapshot)
    step: int
    loaded_at: float  # ``time.perf_counter()``: rounds started before it voted with the old state
    why: str
    clean: bool = True  # every round since applied the group's whole update here: a refutation is theirs
    agreed: bool = False  # a round (sampled tag) decided for it: served meanwhile, refutable until a full one


class DonorLedger:
    """What this peer measured of each donor: its download rates, and the donors it refuses."""

    def __init__(self, keep: int = 4096):
        self.rates: dict[str, float] = {}  # bytes/s of the last whole download from it
        self.refused: dict[str, str] = {}  # donor -> why (a state a round refuted)
        self.keep = keep

    def order(self, candidates: list[str]) -> list[str]:
        """Unrefused donors, fastest measured first; one never measured counts as the median measured
        rate (a newcomer knows none: random order, so joiners spread over donors)."""
        known = [self.rates[d] for d in candidates if d in self.rates]
        neutral = statistics.median(known) if known else 0.0
        allowed = [d for d in candidates if d not in self.refused]
        return sorted(allowed, key=lambda d: (-self.rates.get(d, neutral), random.random()))

    def measured(self, donor: str, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.rates[donor] = nbytes / seconds
            while len(self.rates) > self.keep:
                self.rates.pop(next(iter(self.rates)))

    def refuse(self, donor: str, why: str) -> None:
        self.refused[donor] = why

    def demote(self, donor: str) -> None:
        """Asked last from now on (rate 0): its state was replaced before a round agreed with it, which an
        honest donor's can be too (no majority in the round), so it is not refused."""
        self.rates[donor] = 0.0


class StateSync:
    def __init__(self, *, p2p, loop: BackgroundLoop, run_id: str, peer_id: str, admission: Admission,
                 upkeep: Upkeep, liars: Callable[[], dict[str, str]], max_uploads: int, join_timeout: float,
                 round_bound: float):
        self.p2p, self.loop, self.run_id, self.peer_id, self.admission = p2p, loop, run_id, peer_id, admission
        self.upkeep, self.liars, self.join_timeout, self.round_bound = upkeep, liars, join_timeout, round_bound
        self.optimizer: LionCub | None = None  # set at join
        self.server = StateServer(p2p, run_id, max_uploads=max_uploads, provider=self.snapshot_between_steps,
                                  admission=admission, current_step=self._step,
                                  is_member=lambda pid: self.upkeep.history.lists(pid))
        # reentrant: a repair inside ``LionCub.flush`` (which holds it through ``exclusive``) loads the state
        # under ``exclusive`` again, on the same thread (a plain Lock hung that thread for good)
        self.step_lock = threading.RLock()
        self._in_step = False
        self.ledger = DonorLedger()
        self._provisional: Provisional | None = None
        self._in_consensus = True  # its last decided round decided for its state, and reached it whole
        self.synced = False
        self.loads = 0  # states loaded from others (a download replaces this peer's momenta too)
        self.on_load: Callable[[], None] = lambda: None  # after each load (the swarm: ``VoteNode.resumed``)

    @property
    def synced(self) -> bool:
        """This peer holds the swarm's state: it may vote and say so in its record."""
        return self._synced

    @synced.setter
    def synced(self, value: bool) -> None:
        self._synced = value
        self._serve_if_sure()

    @property
    def provisional(self) -> Provisional | None:
        return self._provisional

    @property
    def in_consensus(self) -> bool:
        return self._in_consensus

    def _serve_if_sure(self) -> None:
        """Serve snapshots only of a state this peer knows is the run's (the module's rules)."""
        p = self._provisional
        self.server.holds_state = self._synced
        self.server.serving = self._synced and (p is None or p.agreed) and self._in_consensus

    def judge(self, started: float, step: int, decided: bytes | None, tag: bytes, *, whole: bool,
              full: bool, apart: bool = False) -> None:
        """After each round of this peer's (``started`` then, at ``step``, with state tag ``tag``): what the
        round ``decided`` (the tag most parts decide for; None: no majority) says of the state it holds.
        ``whole``: the round's update reached this peer complete (no part missing); ``full``: the tag
        hashes every parameter byte; ``apart``: a flat group split with no majority (this peer is not its
        author, who counts its own tag as decided). Confirms a provisional state, or refutes it (its
        donors refused when every round since it was loaded reached this peer whole); and says whether
        this peer may serve its state (``in_consensus``)."""
        decided = decided or None  # b"": no state has a majority
        p = self._provisional
        if p is not None and started >= p.loaded_at and decided is not None:
            if decided != tag:
                if p.clean:
                    for donor in sorted(p.donors):
                        self.ledger.refuse(donor, f"its state of step {p.step} was not the run's (round {step} "
                                                  f"decided for another)")
                    logger.warning("step %d: the state downloaded (%s) at step %d from %s is not the one the round "
                                   "decided for: refusing %s as a donor from now on", step, p.why, p.step,
                                   ", ".join(sorted(p.donors)), "it" if len(p.donors) == 1 else "them")
                self._provisional = None
            elif full:
                self._provisional = None  # every parameter byte is the run's
            else:
                p.agreed = True  # the bytes the tag samples are the run's: serve it, judge it again at a full tag
        p = self._provisional
        if p is not None and started >= p.loaded_at and not whole:
            p.clean = False  # this peer applied less than the group's update: a later refutation may be its own
        if decided is not None:
            # a decision for this state: what follows from it is the run's. Not "and applied whole": a part
            # missing for every member alike (a slow reducer, a newcomer's first rounds) left no member
            # serving, and joins and repairs failed until a round came back whole (the soak's joiner never did)
            self._in_consensus = decided == tag
        elif not whole or apart:  # no decision, and less than the group's update applied here, or apart from
            self._in_consensus = False  # the others: not until a round decides for its state again
        self._serve_if_sure()

    def _step(self) -> int:
        return self.optimizer.step_count if self.optimizer is not None else 0

    def enter_step(self) -> None:
        if not self._in_step:  # still held if an earlier step stopped between aggregate and after_step
            self.step_lock.acquire()
            self._in_step = True

    def exit_step(self) -> None:
        if self._in_step:
            self._in_step = False
            self.step_lock.release()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """A section that changes the state between steps (``LionCub.flush``): no snapshot meanwhile."""
        if self._in_step:  # inside a step already (the training thread holds the lock)
            yield
            return
        with self.step_lock:
            yield

    def snapshot_between_steps(self, min_step: int) -> tuple[int, bytes, bytes] | None:
        """For the state server, from its worker thread: this peer's state if it is between steps.
        With a round in flight, its update is part of the state: wait for it without holding up the
        training thread, then take the state only if that round is still the last one."""
        if self.optimizer is None or not self.synced:
            return None
        in_flight = self.optimizer.in_flight
        if in_flight is not None:
            in_flight.peek(self.round_bound)
        if not self.step_lock.acquire(timeout=0.2):
            return None
        try:
            if self.optimizer.step_count < min_step or (self.optimizer.in_flight is not None
                                                        and not self.optimizer.in_flight.done()):
                return None
            blob, digest = snapshot.encode(self.optimizer)
            return self.optimizer.step_count, blob, digest
        finally:
            self.step_lock.release()

    def donors(self, group: GroupRecord, only: Collection[str] | None = None) -> list[str]:
        """Members to download from: not this peer, not clients, not liars, not donors refused here (and
        among ``only``, if given); synced ones first, in the ledger's order (measured rates, never an
        announced weight)."""
        records = self.upkeep.records
        liars = self.liars()
        members = [m.peer_id for m in group.members if m.peer_id != self.peer_id and not m.client_mode
                   and m.peer_id not in liars and (only is None or m.peer_id in only)]
        donors = self.ledger.order(members)
        if failpoints.DONOR in donors:  # a fault test's armed donor (``failpoints.py``)
            donors.insert(0, donors.pop(donors.index(failpoints.DONOR)))
        synced = [pid for pid in donors if pid in records and records[pid].synced]
        return synced or donors  # peers that are joining themselves hold nothing to give

    def _hold_record(self, seconds: float) -> None:
        """Announce a record that outlives the download: a slow link carrying it starves the periodic
        announcements, and the leader drops a member whose record expired (seen at 1 Mbit/s: dropped
        and added back around every download, a group change for everyone each time). Followers only:
        they reduce nothing, so a long record of one that dies costs nobody a part (a reducer's
        record is what tells a leader of another group in a two-level vote that it is gone). Its later
        records keep that expiry (the DHT keeps the latest-expiring one): a peer that stops following
        and dies within it stays listed until then; its own group drops it for missed votes."""
        try:
            self.loop.run(self.upkeep.announce(hold_s=seconds), timeout=15)
        except Exception as e:  # the download matters more; its record may still be refreshed in time
            logger.info("announcing before the state download failed: %s: %s", type(e).__name__, e)

    def catch_up(self, why: str, min_step: int, group: GroupRecord, *, params_only: bool = False,
                 last: Collection[str] = (), slow_link: bool = False, only: Collection[str] | None = None,
                 expect: bytes | None = None, within: float | None = None) -> None:
        """Load a member's state of step ``min_step`` or later (nothing if this peer already holds it), for
        the reason ``why`` (join, rejoin, repair, skip, settle: the log says it); provisional until a
        round decides for it (``judge``). ``params_only``: keep this peer's own momenta (half the bytes:
        a repair, a skip ahead); ``last``: donors asked only after the others (a two-level group that
        diverged as a whole); ``slow_link`` (a follower): first announce a record that outlives the
        download (``_hold_record``). The run's end (``closing.py``): ``only`` these donors, a state of
        exactly ``min_step`` whose parameter digest is ``expect`` (else refused before anything is
        loaded: not provisional), in at most ``within`` seconds."""
        have = (self.optimizer.step_count, snapshot.params_digest(self.optimizer))
        max_bytes = snapshot.max_size(self.optimizer)
        bound = download_bound(max_bytes, self.join_timeout)
        bound = bound if within is None else min(bound, within)
        if slow_link:
            self._hold_record(bound)
        donors = sorted(self.donors(group, only), key=lambda pid: pid in last)
        if not donors and self.ledger.refused:
            raise StateTransferError(f"every member that could serve the state is refused here ({len(self.ledger.refused)} "
                                     f"served a state that was not the run's)")

        def check_final(step: int, digest: bytes) -> None:
            if expect is not None and (digest != expect or step != min_step):
                raise StateTransferError(f"the donor served parameters {digest.hex()[:8]} of step {step}, not "
                                         f"the {expect.hex()[:8]} of step {min_step} asked for")

        def check(step: int, blob: bytes, digest: bytes) -> None:  # on the loop, per donor: a bad one is left
            check_final(step, digest)
            furthest = furthest_step(group, self.upkeep.records, min_step)  # records as refreshed meanwhile
            if furthest is not None and step > furthest:
                raise StateTransferError(f"the donor's state is of step {step}, past where its group says the run "
                                         f"can be ({furthest})")
            snapshot.check(self.optimizer, blob, expect_digest=digest, expect_step=step)

        replaced = self._provisional
        if replaced is not None and replaced.clean:  # replaced before any round agreed with it: its donors last
            for donor in replaced.donors:
                self.ledger.demote(donor)
        served: set[str] = set()
        started = time.monotonic()
        step, blob, digest = self.loop.run(download_state(
            self.p2p, donors, self.run_id, min_step=min_step, max_bytes=max_bytes, timeout=bound,
            have=have, token=self.admission.token(self.peer_id), params_only=params_only, check=check,
            served=served, wanted=expect or b""), timeout=bound + 5)
        check_final(step, digest)  # again for the empty answer (step 0), which ``check`` never sees
        if not blob:
            logger.info("this peer already holds the swarm's state (step 0, same initialization)")
            return
        if len(served) == 1:
            self.ledger.measured(next(iter(served)), len(blob), time.monotonic() - started)
        with self.exclusive():  # not while the state server takes a snapshot
            snapshot.load(self.optimizer, blob, expect_digest=digest, expect_step=step)
            self._provisional = None if expect is not None else \
                Provisional(frozenset(served), step, time.perf_counter(), why)
            self._serve_if_sure()
        self.server.forget()  # a snapshot it cached of this step holds the state replaced
        self.loads += 1
        self.on_load()
        logger.info("loaded the swarm's state at step %d (%.1f MB, %s, from %s)", step, len(blob) / 1e6, why,
                    ", ".join(sorted(served)) or "?")
