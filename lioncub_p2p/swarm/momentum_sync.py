"""A peer's momentum averaging rounds: which elements a sync averages, its round, and what it keeps.

Runs on the training thread, between optimizer steps. It sees the optimizer only through its
momentum buffers and the swarm only through a function that runs one round, so it is tested
without a network (``tests/test_momentum_sync.py``).

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

logger = logging.getLogger(__name__)

Buffers = Callable[[], list[tuple[str, torch.Tensor]]]  # LionCub.momentum_buffers
RunRound = Callable[[RoundSpec, torch.Tensor], tuple[torch.Tensor, RoundReport]]
StartRound = Callable[[RoundSpec, torch.Tensor], concurrent.futures.Future]  # a RunRound's result, later


class MomentumSync:
    def __init__(self, schedule: MomentumSchedule, rule: str, buffers: Buffers, seed: int):
        self.schedule, self.buffers, self.seed = schedule, buffers, seed
        self.result = AverageResult(trimmed=rule == "trimmed_mean")
        self.codec = upload_codec(schedule.wire)

    def due(self, step: int) -> bool:
        return self.schedule.due(step)

    def selected(self, step: int) -> list[tuple[torch.Tensor, int, int]]:
        """(momentum, lo, hi): the elements the sync after ``step`` averages, per selected buffer."""
        return [(m, *self.schedule.slice_of(step, m.numel())) for name, m in self.buffers()
                if self.schedule.selects(name)]

    def spec(self, round_id: bytes, step: int, members: tuple[PeerSpec, ...]) -> RoundSpec:
        numel = sum(hi - lo for _, lo, hi in self.selected(step))
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


__all__ = ["MomentumSync", "Sent"]
