"""A peer's momentum averaging rounds: which elements a sync averages, its round, and what it keeps.

Runs on the training thread, between optimizer steps (``spec`` may be asked on the event loop too: it
reads only sizes taken when the sync was made). It sees the optimizer only through its
momentum buffers and the swarm only through functions that name, run and start one round
(``MomentumRounds``), so it is tested without a network (``tests/test_momentum_sync.py``).

A whole-buffer sync (``every``, ``geometric``) is one round that the step waits for. A streamed one
(``slices``) does not hold up training: the round of step t starts after step t and runs beside the
next steps (``start``); after the first step that finds it ended, what it brought is applied as a
correction, ``m += average - sent`` (``Sent.finish``), so what the momentum did since is kept.

Every element a sync selects (the schedule's parameters; with ``slices``, the step's slice of
each) travels in the schedule's ``wire`` format (bf16, or e4m3 values sharing an exponent per 7)
to the reducers, which return the group's average or trimmed mean in the same format. Parts
nobody returned (a reducer left, the round failed) keep this peer's own values: a missed part
costs drift, never a wrong value.
"""
from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable

import torch

from ..allreduce import PeerSpec, RoundReport, RoundSpec
from ..codecs import AverageResult, upload_codec
from ..momentum import MomentumSchedule
from .records import RateLimitedLog

logger = logging.getLogger(__name__)
MOMENTUM_IN_FLIGHT = 8  # streamed momentum rounds kept waiting for; past it the oldest is given up

Buffers = Callable[[], list[tuple[str, torch.Tensor]]]  # LionCub.momentum_buffers
RunRound = Callable[[RoundSpec, torch.Tensor], tuple[torch.Tensor, RoundReport]]
StartRound = Callable[[RoundSpec, torch.Tensor], concurrent.futures.Future]  # a RunRound's result, later
SpecFor = Callable[[int], "RoundSpec | None"]  # the momentum round after a step (None: no group to sync with)


class MomentumSync:
    def __init__(self, schedule: MomentumSchedule, rule: str, buffers: Buffers, seed: int):
        self.schedule, self.buffers, self.seed = schedule, buffers, seed
        self.result = AverageResult(trimmed=rule == "trimmed_mean")
        self.codec = upload_codec(schedule.wire)
        # sizes only, read once here (the training thread): ``spec`` is also asked on the event loop (an
        # accusation names a momentum round's shape), which must not touch the optimizer meanwhile
        self.numels = tuple(m.numel() for name, m in buffers() if schedule.selects(name))

    def due(self, step: int) -> bool:
        return self.schedule.due(step)

    def selected(self, step: int) -> list[tuple[torch.Tensor, int, int]]:
        """(momentum, lo, hi): the elements the sync after ``step`` averages, per selected buffer."""
        return [(m, *self.schedule.slice_of(step, m.numel())) for name, m in self.buffers()
                if self.schedule.selects(name)]

    def spec(self, round_id: bytes, step: int, members: tuple[PeerSpec, ...]) -> RoundSpec:
        numel = sum(hi - lo for lo, hi in (self.schedule.slice_of(step, n) for n in self.numels))
        return RoundSpec(round_id, step, members, self.codec.nbytes_for(numel), self.codec, self.result, self.seed,
                         family="momentum")

    def average(self, spec: RoundSpec, run_round: RunRound) -> bool:
        """Run ``spec``'s round with this peer's selected momenta and keep what came back; True when
        every part did. Exceptions of ``run_round`` propagate: the caller logs and skips the sync."""
        sent = Sent.take(self, spec.step)
        return sent.keep(*run_round(spec, self.codec.encode(sent.flat)))

    def start(self, spec: RoundSpec, start_round: StartRound) -> "Sent":
        """Start ``spec``'s round in the background (streamed syncs); ``Sent.finish`` keeps its result."""
        sent = Sent.take(self, spec.step)
        sent.future = start_round(spec, self.codec.encode(sent.flat))
        return sent


class Sent:
    """This peer's selected momenta as they went into a round, and where they live."""

    def __init__(self, step: int, selected: list[tuple[torch.Tensor, int, int]], flat: torch.Tensor):
        self.step, self.selected, self.flat = step, selected, flat
        self.future: concurrent.futures.Future | None = None
        self.loads = 0  # the caller's count of state downloads when it was sent: a later one voids it

    @classmethod
    def take(cls, sync: MomentumSync, step: int) -> "Sent":
        selected = sync.selected(step)
        return cls(step, selected, torch.cat([m.detach().view(-1)[lo:hi].float() for m, lo, hi in selected]))

    def finish(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the background round and keep its result (as a correction)."""
        assert self.future is not None
        return self.keep(*self.future.result(timeout), correction=True)

    def keep(self, averaged: torch.Tensor, report: RoundReport, *, correction: bool = False) -> bool:
        """Write the group's average where this peer's values were (``correction``: add the average
        minus what was sent, keeping what the momentum did since); parts nobody returned stay local."""
        averaged = averaged[: self.flat.numel()]  # fp8: the last block's padding
        if report.missing_parts:
            logger.warning("step %d: momentum averaging missed parts %s; they stay local", self.step,
                           report.missing_parts)
        keep = torch.isnan(averaged)
        averaged[keep] = self.flat[keep]
        offset = 0
        with torch.no_grad():
            for m, lo, hi in self.selected:
                values = averaged[offset : offset + hi - lo].to(m.dtype)
                if correction:
                    m.view(-1)[lo:hi] += values - self.flat[offset : offset + hi - lo].to(m.dtype)
                else:
                    m.view(-1)[lo:hi] = values
                offset += hi - lo
        return not report.missing_parts


class MomentumRounds:
    """This peer's momentum rounds after its steps, as the schedule asks (training thread).

    ``spec_for(step)`` gives the round after ``step`` with the group this peer voted in then (None:
    it was no member), ``run`` runs one and waits for it, ``start`` runs one in the background, and
    ``loads()`` counts this peer's state downloads: a download replaces the momenta, so a streamed
    slice sent before it is not kept. No step waits for a streamed round: past
    ``MOMENTUM_IN_FLIGHT`` still running, the oldest is given up (its round goes on for the others;
    its slice stays local)."""

    def __init__(self, sync: MomentumSync, spec_for: SpecFor, run: RunRound, start: StartRound,
                 loads: Callable[[], int], log: RateLimitedLog):
        self.sync, self.spec_for, self.run, self.start, self.loads, self.log = sync, spec_for, run, start, loads, log
        self.in_flight: list[Sent] = []  # streamed rounds still running, oldest first

    def after_step(self, step: int) -> bool | None:
        """The rounds due after ``step``; whether the last sync kept had every part back (None: none kept)."""
        if not (self.sync.due(step) or self.in_flight):
            return None
        return self.stream(step) if self.sync.schedule.slices else self.average(step)

    def average(self, step: int) -> bool:
        """One whole-buffer round after ``step``; False if this peer had none or it failed."""
        spec = self.spec_for(step)
        if spec is None:
            return False
        try:
            return self.sync.average(spec, self.run)
        except Exception as e:
            logger.warning("step %d: momentum averaging failed, skipped: %s", step, e)
            return False

    def stream(self, step: int) -> bool | None:
        """Keep the slices whose rounds finished (they ran beside the steps since), start this step's."""
        pending = [s for s in self.in_flight if s.loads == self.loads()]  # else a download replaced those momenta
        if len(pending) >= MOMENTUM_IN_FLIGHT and not pending[0].future.done():
            self.log.warning("momentum-late", "step %d: the momentum round of step %d is still running after %d "
                             "steps: its slice stays local", step, pending[0].step, step - pending[0].step)
            pending = pending[1:]
        self.in_flight, synced = [], None
        for sent in pending:
            if not sent.future.done():
                self.in_flight.append(sent)
                continue
            try:
                synced = sent.finish(0)
            except Exception as e:
                synced = False
                logger.warning("step %d: momentum averaging failed, skipped: %s: %s", sent.step, type(e).__name__, e)
        spec = self.spec_for(step) if self.sync.due(step) else None
        if spec is not None:
            sent = self.sync.start(spec, self.start)
            sent.loads = self.loads()
            self.in_flight.append(sent)
        return synced


__all__ = ["MOMENTUM_IN_FLIGHT", "MomentumRounds", "MomentumSync", "Sent"]
