"""The pieces of an in-process run (``lioncub-compare``, ``sim/variants.py``): a method's settings, the
workers' momentum syncs as a swarm runs them, what a bad voter sends, the compute clock, the outcome."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..codecs import AverageResult, pack_planes, signed_max, unpack_planes, upload_codec
from ..momentum import MomentumSchedule, average_in_process
from .compare_tasks import CompareTask


def momentum_wire_bits(schedule: MomentumSchedule) -> float:
    """Bits per synced element in each direction of a momentum round (16 in bf16, 64/7 in fp8 blocks)."""
    return upload_codec(schedule.wire).bits_per_element


FP32_BITS = 32.0
MOMENTUM_RULES = ("exact", "trimmed_mean", "average")  # exact mean in fp32; the swarm's bf16 rules


@dataclass(frozen=True)
class Method:
    name: str
    upload: str | None = None  # None: global Lion (averaged gradients)
    result: str = "majority"
    momentum: MomentumSchedule = field(default_factory=MomentumSchedule.never)
    momentum_rule: str = "exact"  # or the swarm's: bf16 on the wire, "trimmed_mean" or "average"
    variant: tuple[str, ...] = ()  # experimental changes of the vote (sim/variants.py), in process only
    lr: float | None = None  # this method's own lr (None: the run's)


@dataclass
class Outcome:
    method: str
    steps: int
    workers: int
    test_accuracy: float  # the evaluation's second value (accuracy %, or bits/byte for the byte LM)
    test_loss: float
    bits_per_element_per_step: float  # up + down
    replicas_identical: bool
    seconds: float
    curve: list = field(default_factory=list)  # (step from 0, mean training loss over workers)
    train_loss: float = float("nan")  # final model on the whole training set (no sampling noise)
    upload_bits: float = float("nan")  # what one peer sends per element per step (votes + momentum + side info)
    lr: float = float("nan")
    seed: int = 0
    evals: list = field(default_factory=list)  # (step, {name: value}) after that many updates
    compute_s: float = float("nan")  # median seconds of one worker's forward + backward

    @property
    def losses(self) -> list[float]:
        return [loss for _, loss in self.curve]


BYZANTINE = ("random", "invert", "ones")


def corrupt(upload: torch.Tensor, codec, behavior: str, gen: torch.Generator) -> torch.Tensor:
    """What a bad voter sends instead of its honest codes (planes, nbytes)."""
    if behavior == "random":
        return torch.randint(0, 256, upload.shape, dtype=torch.uint8, generator=gen)
    if behavior == "ones":
        return torch.full_like(upload, 255)
    if behavior == "invert":
        if codec.planes == 1:
            return ~upload
        codes = unpack_planes(upload, upload.shape[1] * 8).to(torch.int32).clamp(max=codec.max_code)
        return pack_planes(codec.max_code - codes, codec.planes)
    raise ValueError(f"unknown bad-voter behavior {behavior!r}; use one of {BYZANTINE}")


def average_momenta(momenta: list[list[tuple[str, torch.Tensor]]], schedule: MomentumSchedule, rule: str,
                    step: int = 1) -> int:
    """One momentum sync over peers after ``step`` (its slice of each tensor, with ``slices``), in
    place; returns elements synced. ``exact``: the fp32 mean; ``trimmed_mean`` / ``average``: what a
    swarm's momentum round does (each peer's momenta in the schedule's ``wire`` format, bf16 or fp8
    blocks, the reducer's rule, the result in the same format, ``codecs.AverageResult``)."""
    if rule == "exact":
        return average_in_process(momenta, schedule, step)
    if rule not in MOMENTUM_RULES:
        raise ValueError(f"unknown momentum rule {rule!r}; use one of {MOMENTUM_RULES}")
    schedule.check_names(name for name, _ in momenta[0])
    codec, reducer, synced = upload_codec(schedule.wire), AverageResult(trimmed=rule == "trimmed_mean"), 0
    for buffers in zip(*momenta):
        if not schedule.selects(buffers[0][0]):
            continue
        lo, hi = schedule.slice_of(step, buffers[0][1].numel())
        numel = hi - lo
        nbytes = codec.nbytes_for(numel)
        tally, bounds = codec.tally(nbytes, len(buffers)), []
        for voter, (_, m) in enumerate(buffers):
            encoded = codec.encode(m.view(-1)[lo:hi])
            tally.add(voter, encoded, 0)
            bounds.append(signed_max(codec, encoded))
        wire = tally.encode(reducer, list(range(len(buffers))), seed=0, step=0, offset=0, bounds=bounds)
        mean = reducer.decode(wire, 8 * nbytes, len(buffers), codec=codec)[:numel]
        for _, m in buffers:
            m.view(-1)[lo:hi] = mean
        synced += numel
    return synced


class MomentumSyncs:
    """In process, a swarm's momentum syncs (``swarm/momentum_sync.py``): a whole-buffer one is applied
    at its step; a streamed one is computed from the momenta at its step and applied after the next
    step, as ``m += average - sent``. ``synced`` counts elements averaged."""

    def __init__(self, schedule: MomentumSchedule, rule: str):
        self.schedule, self.rule, self.synced = schedule, rule, 0
        self.pending: list | None = None  # per peer: (momenta sent, their averages)

    def after_step(self, momenta: list[list[tuple[str, torch.Tensor]]], step: int) -> None:
        if self.pending is not None:
            with torch.no_grad():
                for (sent, averaged), current in zip(self.pending, momenta):
                    for (_, s), (_, a), (_, m) in zip(sent, averaged, current):
                        m.add_(a - s)  # zero outside the slice
            self.pending = None
        if not self.schedule.due(step):
            return
        if not self.schedule.slices:
            self.synced += average_momenta(momenta, self.schedule, self.rule, step)
            return
        sent = [[(n, m.detach().clone()) for n, m in peer] for peer in momenta]
        averaged = [[(n, m.clone()) for n, m in peer] for peer in sent]
        self.synced += average_momenta(averaged, self.schedule, self.rule, step)
        self.pending = list(zip(sent, averaged))


class Clock:
    """Seconds of each worker's forward + backward (the compute a real peer spends per step)."""

    def __init__(self) -> None:
        self.samples: list[float] = []

    def median(self) -> float:
        return sorted(self.samples)[len(self.samples) // 2] if self.samples else float("nan")


def worker_loss(task: CompareTask, model: nn.Module, source: Callable[[], Any], clock: Clock,
                scale: float = 1.0) -> float:
    start = time.perf_counter()
    loss = task.loss(model, source())
    (loss * scale if scale != 1.0 else loss).backward()
    clock.samples.append(time.perf_counter() - start)
    return loss.item()
