"""A peer's momentum averaging rounds: which elements a sync averages, its round, and what it keeps.

Runs on the training thread, between optimizer steps. It sees the optimizer only through its
momentum buffers and the swarm only through a function that runs one round, so it is tested
without a network (``tests/test_momentum_sync.py``).

Every element a sync selects (the schedule's parameters; with ``slices``, the step's slice of
each) travels in the schedule's ``wire`` format (bf16, or e4m3 values sharing an exponent per 7)
to the reducers, which return the group's average or trimmed mean in the same format. Parts
nobody returned (a reducer left, the round failed) keep this peer's own values: a missed part
costs drift, never a wrong value.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ..allreduce import PeerSpec, RoundReport, RoundSpec
from ..codecs import AverageResult, upload_codec
from ..momentum import MomentumSchedule

logger = logging.getLogger(__name__)

Buffers = Callable[[], list[tuple[str, torch.Tensor]]]  # LionCub.momentum_buffers
RunRound = Callable[[RoundSpec, torch.Tensor], tuple[torch.Tensor, RoundReport]]


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
        return RoundSpec(round_id, step, members, self.codec.nbytes_for(numel), self.codec, self.result, self.seed)

    def average(self, spec: RoundSpec, run_round: RunRound) -> bool:
        """Run ``spec``'s round with this peer's selected momenta and keep what came back; True when
        every part did. Exceptions of ``run_round`` propagate: the caller logs and skips the sync."""
        selected = self.selected(spec.step)
        flat = torch.cat([m.detach().view(-1)[lo:hi].float() for m, lo, hi in selected])
        averaged, report = run_round(spec, self.codec.encode(flat))
        averaged = averaged[: flat.numel()]  # fp8: the last block's padding
        if report.missing_parts:
            logger.warning("step %d: momentum averaging missed parts %s; they stay local", spec.step,
                           report.missing_parts)
        keep = torch.isnan(averaged)
        averaged[keep] = flat[keep]
        offset = 0
        with torch.no_grad():
            for m, lo, hi in selected:
                m.view(-1)[lo:hi] = averaged[offset : offset + hi - lo]
                offset += hi - lo
        return not report.missing_parts


__all__ = ["MomentumSync"]
